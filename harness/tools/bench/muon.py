r"""The Muon regime of `wus-bench`: matrix-wise updates owned by one replica each.

Muon (`optax.contrib.muon`) orthogonalizes each weight matrix's momentum with
Newton-Schulz matmuls: an update no replica can run on 1/N of a tensor. wus
plans ownership: each replica runs the whole update of some matrices
(DESIGN.md, Ownership). Variants, on the same Transformer-like model (blocks
of four [d,d] attention projections and a [d,4d] / [4d,d] MLP, LayerNorms and
biases: Muon for the matrices, its own Adam fallback for the vectors), data
and N simulated devices:

  replicated   `jax.jit(jax.shard_map(step))`: every replica updates every matrix.
  handwritten  nanochat's DistMuon scheme in `jax.shard_map`, written by hand:
               matrices of one shape stacked and padded to N x k, the stack's
               gradient reduce-scattered on the stack dim, each replica running
               Newton-Schulz (vmapped) on its k slots with its slots' momentum,
               the new matrices all-gathered; the vectors' Adam as ZeRO
               (flattened, reduce-scattered, all-gathered).
  wus          `wus.shard_map(step)`.

Measured in one run, interleaved: median step time; per-device flops of the
update (XLA's cost analysis of the compiled step minus that of the same step
without its update; a conditional counts its costliest branch); collective
bytes from the optimized HLO; optimizer state per device. An imbalanced model
(several [d,d] matrices and one [2d,2d], 4x the elements) shows wus's
balancing: the Plan's predicted per-replica work beside the measured flops.
"""

from __future__ import annotations

import math
import statistics
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from optax.contrib._muon import orthogonalize_via_newton_schulz

import wus
from wus.harness.tools import report
from wus.harness.tools.bench import timing

AXIS = "data"
LEARNING_RATE = 1e-2
BETA = 0.95
NS_COEFFS = (3.4445, -4.7750, 2.0315)
VARIANTS = ("replicated", "handwritten", "wus")


class Block(nn.Module):
  """Pre-LayerNorm attention (q, k, v, o: [d,d]; no q, k, v biases: a key bias has no
  gradient but rounding, which Adam would scale to a full step) and MLP ([d,4d], [4d,d])."""

  width: int

  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm()(x)
    q, k, v = (nn.Dense(self.width, use_bias=False)(h) for _ in range(3))
    att = jax.nn.softmax(q @ jnp.swapaxes(k, -1, -2) / math.sqrt(self.width)) @ v
    x = x + nn.Dense(self.width)(att)
    h = nn.LayerNorm()(x)
    return x + nn.Dense(self.width)(nn.gelu(nn.Dense(4 * self.width)(h)))


class Transformer(nn.Module):
  width: int = 64
  depth: int = 4

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(self.width)(x)
    for _ in range(self.depth):
      x = Block(self.width)(x)
    return nn.Dense(16)(nn.LayerNorm()(x))


class Imbalanced(nn.Module):
  """Several [d,d] matrices and one [2d,2d]: 4x the elements, 8x the Newton-Schulz flops."""

  width: int = 64
  depth: int = 7

  @nn.compact
  def __call__(self, x):
    x = nn.tanh(nn.Dense(self.width, use_bias=False)(x))
    for _ in range(self.depth):
      x = nn.tanh(nn.Dense(self.width, use_bias=False)(x))
    x = jnp.concatenate([x, x], axis=-1)
    x = nn.tanh(nn.Dense(2 * self.width, use_bias=False)(x))
    return x[..., :16]


def _loss(model):
  def loss(params, batch):
    x, y = batch
    return jnp.mean((model.apply({"params": params}, x) - y) ** 2)
  return loss


def _step(model, tx):
  """The per-replica step as `wus-train` writes it under check_vma=True: the gradient
  of the pmean of the loss (AD all-reduces each gradient once), optax update."""
  loss = _loss(model)

  def step(params, opt_state, batch):
    grads = jax.grad(lambda p: lax.pmean(loss(p, batch), AXIS))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state
  return step


# --- The hand-written owner-computes Muon (nanochat's DistMuon scheme). ----------------


def _stacks(params) -> dict:
  """Matrix leaves by shape: shape -> [leaf position, ...] (flattening order)."""
  out: dict = {}
  for k, x in enumerate(jax.tree.leaves(params)):
    if x.ndim == 2:
      out.setdefault(tuple(x.shape), []).append(k)
  return out


def handwritten(model, mesh: Mesh, params):
  """DistMuon in `jax.shard_map`: (step, initial state); step(params, state, batch).

  The state holds, per matrix shape, the momentum of each replica's k slots (a
  [N * k, r, c] array split over the mesh) and the Adam moments of the
  flattened vectors as flat shards, and a step count.
  """
  n = mesh.size
  leaves, treedef = jax.tree.flatten(params)
  stacks = _stacks(params)
  vectors = [k for k, x in enumerate(leaves) if x.ndim != 2]
  vsize = sum(leaves[k].size for k in vectors)
  vshard = max(1, -(-vsize // n))
  adam = optax.adamw(LEARNING_RATE, weight_decay=0.0, nesterov=True)  # As muon's fallback.
  state = {"mu": {s: jnp.zeros((n * -(-len(ks) // n), *s)) for s, ks in stacks.items()},
           "count": jnp.zeros((), jnp.int32),
           "adam": adam.init(jnp.zeros((n * vshard,)))}
  specs = {"mu": {s: P(AXIS) for s in stacks}, "count": P(),
           "adam": jax.tree.map(lambda x: P(AXIS) if x.ndim else P(), state["adam"])}
  loss = _loss(model)

  def muon_slots(g, mu, p, count):  # Each of this replica's k slots, as optax's muon.
    mu = BETA * mu + (1 - BETA) * g
    c1 = count + 1
    mu_hat = (BETA * mu / (1 - BETA ** (c1 + 1)) + (1 - BETA) * g / (1 - BETA ** c1))
    u = jax.vmap(lambda x: orthogonalize_via_newton_schulz(x, jnp.asarray(NS_COEFFS), 5))(mu_hat)
    u = u * jnp.sqrt(jnp.maximum(1.0, p.shape[2] / p.shape[1]))
    return p - LEARNING_RATE * u, mu

  def step(params, state, batch):
    grads = jax.tree.leaves(jax.grad(loss)(params, batch))
    ps = jax.tree.leaves(params)
    new = list(ps)
    mine = lax.axis_index(AXIS)
    mus = {}
    for shape, ks in stacks.items():
      k = -(-len(ks) // n)
      pad = [jnp.zeros(shape)] * (n * k - len(ks))
      g = lax.psum_scatter(jnp.stack([grads[i] for i in ks] + pad), AXIS, tiled=True) / n
      p = lax.dynamic_slice_in_dim(jnp.stack([ps[i] for i in ks] + pad), mine * k, k)
      p, mus[shape] = muon_slots(g, state["mu"][shape], p, state["count"])
      every = lax.all_gather(p, AXIS, tiled=True, to="invarying")
      for j, i in enumerate(ks):
        new[i] = every[j]
    adam_state = state["adam"]
    if vectors:  # ZeRO by hand: one flat buffer of every vector.
      flat = jnp.concatenate([grads[i].reshape(-1) for i in vectors])
      g = lax.psum_scatter(jnp.pad(flat, (0, n * vshard - vsize)), AXIS, tiled=True) / n
      pflat = jnp.pad(jnp.concatenate([ps[i].reshape(-1) for i in vectors]),
                      (0, n * vshard - vsize))
      pshard = lax.dynamic_slice_in_dim(pflat, mine * vshard, vshard)
      upd, adam_state = adam.update(g, adam_state, pshard)
      vs = lax.all_gather(pshard + upd, AXIS, tiled=True, to="invarying")
      start = 0
      for i in vectors:
        new[i] = vs[start:start + ps[i].size].reshape(ps[i].shape)
        start += ps[i].size
    return (jax.tree.unflatten(treedef, new),
            {"mu": mus, "count": state["count"] + 1, "adam": adam_state})

  mapped = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P(AXIS)),
                                 out_specs=(P(), specs)), donate_argnums=(0, 1))
  placed = jax.device_put(state, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
  return mapped, placed


# --- Measuring. ---------------------------------------------------------------------


def _batches(mesh: Mesh, rounds: int, batch_size: int, seq: int = 8):
  keys = jax.random.split(jax.random.key(1), rounds + 2)
  shape = (batch_size * mesh.size, seq, 16)
  return [tuple(jax.device_put(jax.random.normal(k2, shape), NamedSharding(mesh, P(AXIS)))
                for k2 in jax.random.split(k)) for k in keys]


def _flops(lowered) -> float:
  return lowered.compile().cost_analysis()["flops"]


def run(model: nn.Module, mesh: Mesh, *, rounds: int, batch_size: int = 1,
        variants=VARIANTS) -> dict:
  """Measures the variants on `model` with Muon, interleaved (module docstring).

  Returns:
    JSON-ready: per variant "median", "min", "max" (seconds per step),
    "update_flops" (per device), "wire_bytes" (per step, from the HLO),
    "collectives" (kind -> count), "opt_state_per_device" (bytes),
    "compile_seconds", "max_param_difference" (vs replicated); "opt_state_bytes"
    (whole), "loads" (wus's predicted seconds of owned updates per replica),
    "imbalance", "predicted" (the Plan's [replicated, owned] seconds of the owned
    updates and their collectives: the ownership choice, `Ownership.predicted`)
    and "rest_seconds" (each timed call of the step without its update).
  """
  tx = optax.contrib.muon(LEARNING_RATE)
  data = _batches(mesh, rounds, batch_size)
  params = model.init(jax.random.key(0), jnp.ones((1, *data[0][0].shape[1:])))["params"]
  params = jax.device_put(params, NamedSharding(mesh, P()))
  kw = dict(mesh=mesh, in_specs=(P(), P(), P(AXIS)), out_specs=(P(), P()))
  whole_state = jax.device_put(tx.init(params), NamedSharding(mesh, P()))
  steps = {"replicated": (jax.jit(jax.shard_map(_step(model, tx), **kw), donate_argnums=(0, 1)),
                          whole_state),
           "wus": (wus.shard_map(_step(model, tx), donate_argnums=(0, 1), **kw), whole_state)}
  if "handwritten" in variants:
    steps["handwritten"] = handwritten(model, mesh, params)
  loss = _loss(model)

  def grads_only(p, s, batch):  # The step without its update: subtracted from every variant.
    return jax.grad(lambda p: lax.pmean(loss(p, batch), AXIS))(p), s
  rest = jax.jit(jax.shard_map(grads_only, **kw))
  base = _flops(rest.lower(params, whole_state, data[0]))
  out: dict = {"model": type(model).__name__, "num_devices": mesh.size, "variants": list(variants),
               "opt_state_bytes": sum(x.nbytes for x in jax.tree.leaves(whole_state))}
  states = {}
  for name in variants:
    out[name], ownership, states[name] = _warmed(name, *steps[name], params, data, base)
    out.update(ownership)

  def update(name: str):
    def call(r: int) -> None:
      states[name] = jax.block_until_ready(steps[name][0](*states[name], data[2 + r]))
    return call

  calls = {name: update(name) for name in variants}
  jax.block_until_ready(rest(params, whole_state, data[0]))
  calls["rest"] = lambda r: jax.block_until_ready(rest(params, whole_state, data[2 + r]))
  seconds = timing.interleaved(calls, rounds)
  out["rest_seconds"] = seconds["rest"]
  for name in variants:
    out[name]["step_seconds"] = seconds[name]
  _record(out, states)
  return out


def _warmed(name: str, step, state, params, data: list, base: float) -> tuple[dict, dict, tuple]:
  """A variant compiled and measured (its flops above `base`, the step's without an update),
  then warmed up on the first two batches: (its entry of the result, the Plan's ownership
  for "wus", else {}; its (params, state) after them)."""
  state = jax.tree.map(lambda x: jax.device_put(x, x.sharding, may_alias=False), state)
  started = time.perf_counter()
  lowered = step.lower(_copy(params), state, data[0])
  compiled = lowered.compile()
  hlo = compiled.as_text()
  collectives = report.collectives(hlo, per_run=True)
  entry = {"compile_seconds": time.perf_counter() - started,
           "update_flops": compiled.cost_analysis()["flops"] - base,
           "wire_bytes": sum(c.wire_bytes for c in collectives.values()),
           "collectives": {k: c.count for k, c in collectives.items() if c.count},
           "step_seconds": []}
  ownership = {}
  if name == "wus":
    plan = step.plan(params, state, data[0])
    ownership = {"loads": list(plan.owned.loads) if plan.owned else [],
                 "imbalance": plan.owned.imbalance if plan.owned else None,
                 "plan_ownership": str(plan.owned),
                 "predicted": list(plan.owned.predicted) if plan.owned else []}
  current = (_copy(params), state)
  for batch in data[:2]:  # Warm up: compile, and (wus) convert the state.
    current = jax.block_until_ready(step(*current, batch))
  return entry, ownership, current


def _record(out: dict, states: dict) -> None:
  """Each variant's times per step (median, min, max), its optimizer state's bytes on device 0
  and its weights' difference from the replicated variant's, after the run, into `out`."""
  reference = jax.tree.map(np.asarray, states["replicated"][0])
  for name in out["variants"]:
    seconds = out[name]["step_seconds"]
    out[name].update(median=statistics.median(seconds), min=min(seconds), max=max(seconds))
    out[name]["opt_state_per_device"] = report.bytes_per_device(states[name][1])
    out[name]["max_param_difference"] = max(
        float(np.max(np.abs(np.asarray(a, np.float64) - b)))
        for a, b in zip(jax.tree.leaves(states[name][0]), jax.tree.leaves(reference), strict=True))


def _copy(tree):
  return jax.tree.map(lambda x: jax.device_put(x, x.sharding, may_alias=False), tree)


def targets(result: dict) -> list[tuple[str, bool, str]]:
  """Issue 21's targets on a Transformer run: (target, met, measured)."""
  n, ws, rep = result["num_devices"], result["wus"], result["replicated"]
  rows = []
  if "handwritten" in result:
    ratio = ws["median"] / result["handwritten"]["median"]
    rows.append(("wus median step time <= hand-written owner-computes Muon's", ratio <= 1,
                 f"ratio {ratio:.3f}"))
  ratio = ws["median"] / rep["median"]
  rows.append(("wus median step time < replicated Muon's", ratio < 1, f"ratio {ratio:.3f}"))
  flops = ws["update_flops"] / rep["update_flops"]
  rows.append((f"wus update flops per device <= 1.25/N of replicated ({1.25 / n:.3f})",
               flops <= 1.25 / n, f"{flops:.4f}"))
  state = ws["opt_state_per_device"] / result["opt_state_bytes"]
  rows.append((f"wus optimizer state per device <= 1.25/N of the whole ({1.25 / n:.3f})",
               state <= 1.25 / n, f"{state:.4f}"))
  wire = ws["wire_bytes"] / rep["wire_bytes"]
  rows.append(("wus collective bytes <= 1.25 x replicated's", wire <= 1.25, f"ratio {wire:.3f}"))
  return rows


def markdown(results: list[dict]) -> str:
  """The Muon regime's tables (the Transformer, then the imbalanced model) and targets."""
  parts = []
  for r in results:
    rows = [[v, 1e3 * r[v]["median"], f"{1e3 * r[v]['min']:.1f}-{1e3 * r[v]['max']:.1f}",
             r[v]["median"] / r["replicated"]["median"], r[v]["update_flops"] / 1e6,
             r[v]["update_flops"] / r["replicated"]["update_flops"],
             r[v]["opt_state_per_device"] / 2 ** 20, r[v]["wire_bytes"] / 2 ** 20,
             " ".join(f"{k} {c}" for k, c in r[v]["collectives"].items()),
             r[v]["compile_seconds"], r[v]["max_param_difference"]]
            for v in r["variants"]]
    parts += [f"### muon: {r['model']} + optax.contrib.muon (Adam for vectors), "
              f"N={r['num_devices']}; {len(r['replicated']['step_seconds'])} timed steps each",
              report.table(["variant", "median ms/step", "min-max ms", "/ replicated",
                            "update MFLOP/device", "/ replicated", "opt state MiB/device",
                            "collective wire MiB/step", "collectives", "compile s",
                            "max |Δ params| vs replicated"], rows)]
    if r.get("loads"):
      parts.append("wus predicted owned work per replica (us): "
                   + ", ".join(f"{1e6 * x:.3g}" for x in r["loads"])
                   + f"; imbalance {r['imbalance']:.3f} (busiest / mean).")
    if r.get("predicted"):
      rest = statistics.median(r["rest_seconds"])
      rep, own = (1e3 * x for x in r["predicted"])
      measured = {v: 1e3 * (r[v]["median"] - rest) for v in ("replicated", "wus")}
      parts.append(
          f"Ownership, predicted beside measured (issue 30): the Plan predicts the owned "
          f"updates and their collectives at {own:.3g} ms owned against {rep:.3g} ms "
          f"replicated ({own / rep:.3f}); measured, the step minus the step without its "
          f"update ({1e3 * rest:.3g} ms; every update, the vectors' too): "
          f"{measured['wus']:.3g} ms wus against {measured['replicated']:.3g} ms replicated "
          f"({measured['wus'] / measured['replicated']:.3f}).")
  first = results[0]
  parts += ["### Targets (Transformer)", report.table(
      ["target", "", "measured"],
      [[t, "met" if ok else "NOT MET", d] for t, ok, d in targets(first)])]
  return "\n\n".join(parts)


def run_regime(mesh: Mesh, rounds: int) -> list[dict]:
  """The Transformer with all variants, then the imbalanced model (replicated, handwritten, wus)."""
  return [run(Transformer(), mesh, rounds=rounds), run(Imbalanced(), mesh, rounds=rounds)]
