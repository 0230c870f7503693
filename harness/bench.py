r"""`wus-bench`: wus beside the alternatives a JAX user has, measured in one run.

Variants, all on the same model, optimizer (Adam), data and N simulated
devices, with the state donated:

  replicated   `jax.jit(jax.shard_map(step))` of `steps.make_train_step`: every
               replica updates every weight (`steps.map_train_step`).
  gspmd_zero1  `jax.jit` of the global step with the optimizer state given a
               `NamedSharding` over the data axis (`zero.gspmd_step`).
  handwritten  `jax.shard_map` ZeRO with `psum_scatter` / `all_gather` by hand
               (`zero.handwritten_step`): what a careful person achieves, one
               collective per tensor each way.
  handwritten_flat  the same with one flat buffer (`zero.flat_step`): every
               gradient concatenated, one reduce-scatter, one all-gather, the
               weights sliced out of it.
  wus          `wus.shard_map(step)`, told this machine's topology (measured
               at the start of the run, `calibrate.measure`) for its cost model.
  wus_undonated  the same without donating the state.
  wus_gG       `wus.shard_map(step, shard_group_size=G)`: partial sharding within
               groups of G devices (§5.2), in the partial-sharding regime.

What a `jax.jit` user has (weight-update-bound regime), on the step written on
global arrays (`steps.make_train_step(..., "jit")`), the batch placed on
P("data"):

  jit          `jax.jit(step)`: the state replicated, GSPMD all-reduces the
               gradients.
  gspmd_zero1  (above) the ZeRO-1 such a user writes by hand.
  wus_jit      `wus.jit(step)`: the same step, one changed line.

Regimes:

  weight-update-bound  large weights, a small per-replica batch.
  many-small-tensors   the same on a Transformer-like model of 100 tensors of
                       mixed sizes (`--small_tensors_model`), where batching
                       small tensors' collectives matters (§5.2).
  compute-bound        the same model, a large per-replica batch.
  partial-sharding     the weight-update-bound setting with replicated and wus_gG
                       for each G of --group_sizes (§5.2, Fig. 10).
  bf16-loop            k updates per call in a `lax.fori_loop`, the forward and
                       backward pass reading the weights in bfloat16 (Fig. 4
                       right, Fig. 7); replicated and wus only: the alternatives
                       have no loop form here.
  muon                 Muon on a Transformer-like model and on an imbalanced one:
                       replicated, a hand-written owner-computes Muon and wus
                       (ownership; `harness/muon_bench.py`, its own models).

The variants of a regime run interleaved, in a new random order every round,
so that they share the machine's noise; each timed update follows an
untimed one of the same program, as in a training loop (an update right
after another program's ran up to 1.25x slower on these CPU devices, so a
fixed order of neighbours biased the ratios). In the
regimes with one update per call, the parts of a sharded step are timed
alone in the same rounds (`limit`: the forward and backward pass, one
reduce-scatter and one all-gather of every byte into reused buffers, the
update of a 1/N shard); the sum of their medians is the limit wus is
compared with, beside the data movement (copies, concatenates, slices) of
its compiled step. On simulated
CPU devices a collective is a memory copy on the same two cores, not a
network transfer; the "wire" bytes are what each device would send by ring
algorithms, read from the compiled HLO, and nothing here derives an ideal time
from them.

Example:
  wus-bench                       # all regimes
  wus-bench --regimes=weight-update-bound --regimes=many-small-tensors --rounds=20
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import platform
import statistics
import sys
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import flags
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from wus.analysis import costmodel, network
from wus.harness import (batches, calibrate, config as config_lib, console, datasets, limit,
                         muon_bench, optim, report, steps, tasks, zero)

VARIANTS = ("replicated", "gspmd_zero1", "handwritten", "handwritten_flat", "wus",
            "wus_undonated")
ALTERNATIVES = VARIANTS[:4]
# The variants of a `jax.jit` user (issue 20), compared among themselves.
JIT_VARIANTS = ("jit", "wus_jit")
JIT_ALTERNATIVES = ("jit", "gspmd_zero1")
MIB = 2 ** 20

# Targets of issues 5 and 22, checked on the measurements of one run.
TIME_RATIO = 1.0         # wus / each alternative (and donated / undonated), median step time
STATE_TOLERANCE = 0.01   # |opt state per device / (V/N) - 1|
BF16_WIRE_RATIO = 0.76   # wus / replicated collective bytes, bf16 weight gather
ANALYSIS_FRACTION = 0.1  # (analysis + rewrite) / XLA compile time of the wus step
LIMIT_RATIO = 1.05       # wus / the sum of its parts timed alone (`limit`)
COMPILE_RATIO = 1.2      # XLA compile time, wus / replicated
# Regimes whose wus step is compared with its parts alone and the alternatives.
LIMIT_REGIMES = ("weight-update-bound", "many-small-tensors")


@dataclasses.dataclass(frozen=True)
class Regime:
  """One benchmark setting.

  Attributes:
    name: as printed.
    batch_size: examples per replica per update.
    steps_per_call: updates per call of the step, in a `lax.fori_loop`; more
      than 1 also reads the weights in bfloat16 in the forward pass.
    group_sizes: G of the partial-sharding variants `wus_gG` (§5.2); with
      them the regime compares replicated and those only (memory: every
      variant holds its own copy of the state).
    model: the model of this regime; None: `run_regime`'s.
    skip: variants left out (GSPMD ZeRO-1 cannot partition the Transformer's
      embedding lookup on a batch-split mesh in JAX 0.10: it asks for the
      gather's out_sharding).
    jit: also the `jax.jit` user's variants (JIT_VARIANTS).
  """

  name: str
  batch_size: int
  steps_per_call: int = 1
  group_sizes: tuple[int, ...] = ()
  model: str | None = None
  skip: tuple[str, ...] = ()
  jit: bool = False

  @property
  def parts(self) -> bool:
    """Whether the parts of the sharded step are timed alone (`limit`): one update per call."""
    return self.steps_per_call == 1 and not self.group_sizes

  @property
  def variants(self) -> tuple[str, ...]:
    if self.steps_per_call > 1:
      return ("replicated", "wus")
    if self.group_sizes:  # wus (G = N) is in the weight-update-bound regime.
      return ("replicated",) + tuple(f"wus_g{g}" for g in self.group_sizes)
    return tuple(v for v in VARIANTS + JIT_VARIANTS * self.jit if v not in self.skip)


def group_size(variant: str) -> int | None:
  """G of a `wus_gG` variant, None for the others."""
  return int(variant[len("wus_g"):]) if variant.startswith("wus_g") else None


def make_loop_step(task: tasks.Task, tx, steps_per_call: int, compute_dtype=jnp.bfloat16):
  """The per-replica step running `steps_per_call` updates in a `lax.fori_loop`.

  Its batch holds `steps_per_call` batches of this replica, one after the
  other along the leading dim; each update reads the weights in
  `compute_dtype` for the forward and backward pass (mixed precision).
  Metrics are those of the last update.
  """
  def step(params, model_state, opt_state, batch):
    split = jax.tree.map(lambda x: x.reshape(steps_per_call, -1, *x.shape[1:]), batch)

    def update(i, carry):
      params, model_state, opt_state, _ = carry
      grads, model_state, metrics = steps.gradients(
          task, params, model_state, jax.tree.map(lambda x: x[i], split), compute_dtype)
      updates, opt_state = tx.update(grads, opt_state, params)
      return (optax.apply_updates(params, updates), model_state, opt_state,
              lax.pmean(metrics, steps.AXIS_NAME))

    metrics = {"loss": jnp.zeros(()), "accuracy": jnp.zeros(())}
    return lax.fori_loop(0, steps_per_call, update, (params, model_state, opt_state, metrics))

  return step


def _copy(tree):
  """A copy of every array of `tree` (each variant donates its own state)."""
  return jax.tree.map(lambda x: jax.device_put(x, x.sharding, may_alias=False), tree)


def _variant_steps(regime: Regime, task: tasks.Task, tx, mesh: Mesh, state: steps.TrainState,
                   topology=None):
  """{variant: (step, its initial state)}: each step takes (*state, batch), donating
  state (but wus_undonated); the wus variants get `topology`."""
  if regime.steps_per_call > 1:
    train_step = make_loop_step(task, tx, regime.steps_per_call)
  else:
    train_step = steps.make_train_step(task, tx)
  out = {}
  for name in regime.variants:
    fresh = _copy(state)
    if name == "replicated":
      out[name] = steps.map_train_step(name, train_step, mesh), fresh
    elif name in JIT_VARIANTS:
      out[name] = steps.map_train_step("replicated" if name == "jit" else "wus",
                                       steps.make_train_step(task, tx, "jit"), mesh, step="jit",
                                       topology=topology), fresh
    elif name.startswith("wus"):
      out[name] = steps.map_train_step("wus", train_step, mesh, group_size(name),
                                       donate=name != "wus_undonated", topology=topology), fresh
    else:
      if name == "handwritten_flat":
        step, place = zero.flat_step(task, tx, mesh, fresh.opt_state, fresh.params)
      else:
        make = zero.gspmd_step if name == "gspmd_zero1" else zero.handwritten_step
        step, place = make(task, tx, mesh, fresh.opt_state)
      out[name] = step, fresh._replace(opt_state=place(fresh.opt_state))
  return out


def run_regime(regime: Regime, *, model: str, rounds: int, mesh: Mesh, seed: int = 0,
               progress=None, topology: network.Topology | None = None) -> dict:
  """Measures every variant of `regime` on `model` (Adam), interleaved.

  Args:
    regime: the setting.
    model: a key of `tasks.MODELS` without collectives in its model (the MLPs,
      the Transformers; see `zero`); `regime.model` if it names one.
    rounds: timed updates per variant, after two warm-up calls.
    mesh: a 1-D mesh with the axis `steps.AXIS_NAME`.
    seed: of the initialization and the synthetic data.
    progress: called with no arguments after each timed call, or None.
    topology: the devices, for the wus variants' cost model; None: wus's default.

  Returns:
    JSON-ready: "regime", "model", "num_devices", "batch_size",
    "steps_per_call", "opt_state_bytes" (V, whole) and per variant:
    "step_seconds" (each timed call, divided by steps_per_call), "median",
    "min", "max" (seconds per update), "memory" (`report.memory` of the
    compiled step, bytes per device), "collectives" (kind -> count, bytes,
    wire_bytes), "moves" (`report.data_movement` of the compiled step: kind ->
    count, bytes), "wire_bytes" (sum over kinds), "opt_state_per_device"
    (bytes device 0 holds), "lower_seconds", "compile_seconds",
    "compile_cpu_seconds" (the CPU time of this process's threads while XLA
    compiled: less sensitive than the wall time to other jobs on the machine),
    "wire_bytes" (bytes a device sends per update: `report.collectives`
    per run of the program, divided by steps_per_call), "loop_wire_bytes"
    (the same for the collectives inside the loop only: per update of a
    training loop, without what is gathered once per call after it),
    "max_param_difference" (max |params - replicated params| after the run;
    wus_jit also "max_jit_param_difference", against jit's);
    wus also "analysis_seconds", "rewrite_seconds", "bucket_bytes",
    "alone_bytes" and "buckets" (the Plan's choice). With one update per call
    (`Regime.parts`) also "rest_seconds", "collectives_seconds" and
    "update_seconds": each timed call of the parts alone (`limit.Parts` and
    `steps.make_gradient_step`), and "tensor_elements" (of every weight).
  """
  model = regime.model or model
  kind = tasks.MODELS[model][0]
  cfg = config_lib.RunConfig.for_model(model, optimizer="adam", seed=seed)
  dataset = datasets.load("synthetic", kind, seq_len=cfg.seq_len, image_size=cfg.image_size,
                          seed=seed)
  task = tasks.make(model, num_classes=dataset.num_classes, seq_len=cfg.seq_len,
                    axis_name=steps.AXIS_NAME)
  tx, _ = optim.make("adam", **cfg.optimizer_hyperparameters())
  params, model_state = task.init(seed, dataset.train.load(np.arange(1)))
  state = jax.device_put(steps.TrainState(params, model_state, tx.init(params)),
                         NamedSharding(mesh, P()))
  global_batch = regime.batch_size * regime.steps_per_call * mesh.size
  data = [batches.train_batch(dataset.train, seed=seed, step=i, batch_size=global_batch,
                              sharding=NamedSharding(mesh, P(steps.AXIS_NAME)))
          for i in range(rounds + 2)]
  variants = _variant_steps(regime, task, tx, mesh, state, topology)
  out = {"regime": regime.name, "model": model, "num_devices": mesh.size,
         "variants": list(variants),
         "batch_size": regime.batch_size, "steps_per_call": regime.steps_per_call,
         "opt_state_bytes": sum(x.nbytes for x in jax.tree.leaves(state.opt_state)),
         "tensor_elements": [int(x.size) for x in jax.tree.leaves(params)],
         "rest_seconds": [], "collectives_seconds": [], "update_seconds": []}
  # The parts alone: the forward and backward pass (no all-reduce, no update;
  # the cost model's "rest" of a one-update step), the collectives and the update.
  parts = {}
  if regime.parts:
    rest = steps.make_gradient_step(task, mesh)
    pieces = limit.Parts(out["tensor_elements"], tx, mesh, steps.AXIS_NAME)
    parts = {"rest_seconds": lambda r: rest(state.params, state.model_state, data[2 + r]),
             "collectives_seconds": lambda r: pieces.collectives(),
             "update_seconds": lambda r: pieces.update()}
  states = {}
  for name, (step, fresh) in variants.items():
    start = time.perf_counter()
    lowered = step.lower(*fresh, data[0])
    middle, cpu = time.perf_counter(), time.process_time()
    compiled = lowered.compile()
    cpu = time.process_time() - cpu
    hlo = compiled.as_text()
    collectives = report.collectives(hlo, per_run=True)
    in_loop = report.collectives(hlo, per_run=True, only=report.in_loops(hlo))
    out[name] = {"lower_seconds": middle - start, "compile_seconds": time.perf_counter() - middle,
                 "compile_cpu_seconds": cpu,
                 "memory": report.memory(compiled),
                 "collectives": {k: c._asdict() for k, c in collectives.items()},
                 "moves": {k: m._asdict() for k, m in report.data_movement(hlo).items()},
                 "wire_bytes": sum(c.wire_bytes for c in collectives.values())
                               / regime.steps_per_call,
                 "loop_wire_bytes": sum(c.wire_bytes for c in in_loop.values())
                                    / regime.steps_per_call,
                 "step_seconds": []}
    if name.startswith("wus"):
      plan = step.plan(*fresh, data[0])
      out[name].update(bucket_bytes=plan.bucket_bytes, alone_bytes=plan.alone_bytes,
                       buckets=plan.buckets)
    if hasattr(step, "timings"):  # wus.shard_map (wus.jit has no timings).
      timings = step.timings(*fresh, data[0])
      out[name].update(analysis_seconds=timings["analysis"], rewrite_seconds=timings["rewrite"])
    for batch in data[:2]:  # Warm up: compile, and (wus) shard the state.
      fresh = steps.TrainState(*jax.block_until_ready(step(*fresh, batch))[:3])
    states[name] = fresh
  for call in parts.values():
    jax.block_until_ready(call(-2))
  shuffle = np.random.default_rng(seed)
  for r in range(rounds):
    for key in map(str, shuffle.permutation(list(parts) + list(variants))):
      if key in parts:
        jax.block_until_ready(parts[key](r))  # Untimed: the program warm (module docstring).
        start = time.perf_counter()
        jax.block_until_ready(parts[key](r))
        out[key].append(time.perf_counter() - start)
        continue
      step = variants[key][0]
      states[key] = steps.TrainState(*jax.block_until_ready(step(*states[key], data[2 + r]))[:3])
      start = time.perf_counter()
      result = jax.block_until_ready(step(*states[key], data[2 + r]))
      out[key]["step_seconds"].append((time.perf_counter() - start) / regime.steps_per_call)
      states[key] = steps.TrainState(*result[:3])
      if progress:
        progress()
  for name in variants:
    seconds = out[name]["step_seconds"]
    out[name].update(median=statistics.median(seconds), min=min(seconds), max=max(seconds))
    out[name]["opt_state_per_device"] = report.bytes_per_device(states[name].opt_state)
    out[name]["max_param_difference"] = _max_difference(states[name].params,
                                                         states["replicated"].params)
  if "wus_jit" in variants:
    out["wus_jit"]["max_jit_param_difference"] = _max_difference(states["wus_jit"].params,
                                                                 states["jit"].params)
  return out


def _max_difference(a, b) -> float:
  """max |a - b| over the leaves of two trees of arrays."""
  return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def paired_ratio(a: Sequence[float], b: Sequence[float]) -> float:
  """The median over rounds of a[r] / b[r]: two variants timed in the same round share its
  load, so their ratio is steadier than the ratio of their medians."""
  return statistics.median(x / y for x, y in zip(a, b, strict=True))


def limit_of(result: dict) -> dict | None:
  """The limit of a regime whose parts were timed (seconds per update), or None.

  Returns:
    {"rest", "collectives", "update": medians of the parts alone, "total":
    their sum, "rounds": the sum of the parts in each round}.
  """
  if not result.get("collectives_seconds"):
    return None
  parts = {k: statistics.median(result[f"{k}_seconds"]) for k in ("rest", "collectives", "update")}
  rounds = [sum(t) for t in zip(*(result[f"{k}_seconds"] for k in parts), strict=True)]
  return {**parts, "total": sum(parts.values()), "rounds": rounds}


def predict(result: dict, topology: network.Topology) -> dict | None:
  """The cost model's step times for a regime's replicated and wus steps (seconds per update).

  Fed this machine's measured costs (`calibrate.measure`) and the measured
  median of the forward and backward pass alone as "rest"; nothing is fitted
  to the step times it is compared with. Adam, sharded N ways (G = N), the
  collectives batched as the wus step batches them (`Plan.bucket_bytes`,
  `Plan.alone_bytes`).

  Returns:
    {"replicated": StepPrediction, "wus": StepPrediction}, or None for a
    regime with several updates per call (no "rest" measured).
  """
  if not result.get("rest_seconds") or "wus" not in result:
    return None
  workload = costmodel.Workload(tuple(result["tensor_elements"]), costmodel.OPTIMIZERS["adam"])
  rest = statistics.median(result["rest_seconds"])
  bucket, alone = result["wus"]["bucket_bytes"], result["wus"].get("alone_bytes")
  return {"replicated": costmodel.predict_replicated(workload, topology, rest, bucket),
          "wus": costmodel.predict_sharded(workload, topology, result["num_devices"], rest, bucket,
                                           alone)}


def prediction_markdown(results: list[dict], topology: network.Topology, raw: dict) -> str:
  """Predicted beside measured, per regime with one update per call."""
  axis = topology.axes[0]
  (d0, t0), (d1, t1) = raw["all_reduce"]
  rows = []
  for r in results:
    p = predict(r, topology)
    if p is None:
      continue
    for v in ("replicated", "wus"):
      rows.append([r["regime"], v, 1e3 * r[v]["median"], 1e3 * p[v].with_copies,
                   1e3 * p[v].rest, 1e3 * (p[v].communication + p[v].copies),
                   1e3 * p[v].update,
                   p[v].with_copies / p["replicated"].total if v == "wus" else "-",
                   r[v]["median"] / r["replicated"]["median"] if v == "wus" else "-"])
  return "\n\n".join([
      "### Cost model: predicted beside measured",
      f"This machine, measured before the regimes ran: all-reduce over {axis.size} devices of "
      f"{d0} B in {1e3 * t0:.3f} ms and {d1} B in {1e3 * t1:.3f} ms, i.e. alpha "
      f"{1e6 * axis.alpha:.1f} us per ring step and {axis.bandwidth / 1e9:.2f} GB/s per "
      f"device; memory {topology.memory_bandwidth / 1e9:.2f} GB/s per device (all devices "
      "busy). \"rest\" is the measured forward and backward pass alone; the model adds "
      "collectives and the update to it (`wus.analysis.costmodel`, nothing fitted to "
      "the step times).",
      report.table(["regime", "variant", "measured ms", "predicted ms", "rest ms",
                    "collectives + copies ms (pred.)", "update ms (pred.)",
                    "wus/replicated predicted",
                    "wus/replicated measured"], rows)])


def targets(results: list[dict]) -> list[tuple[str, bool | None, str]]:
  """The targets of issues 5 and 22 on measured results: (target, met or None if not
  measured, detail)."""
  rows = []
  for r in results:
    name = r["regime"]
    for v in r.get("variants", ()):
      if (g := group_size(v)) is None:
        continue
      share = r[v]["opt_state_per_device"] * g / r["opt_state_bytes"]
      rows.append((f"{name}: {v} optimizer state per device within {STATE_TOLERANCE:.0%} of V/G",
                   abs(share - 1) <= STATE_TOLERANCE, f"{share:.4f} x V/{g}"))
      wire = r[v]["wire_bytes"] / r["replicated"]["wire_bytes"]
      rows.append((f"{name}: {v} collective bytes <= replicated all-reduce's (§5.2)", wire <= 1,
                   f"ratio {wire:.4f}"))
    rows += _jit_targets(r)
    if "wus" not in r:
      continue
    ws = r["wus"]
    if name in LIMIT_REGIMES:
      for alt in (a for a in ALTERNATIVES if a in r):
        ratio = paired_ratio(ws["step_seconds"], r[alt]["step_seconds"])
        rows.append((f"{name}: wus step time <= {alt}'s (median of per-round ratios)",
                     ratio <= TIME_RATIO, f"ratio {ratio:.3f}"))
      rows += _copy_free_targets(r)
    share = ws["opt_state_per_device"] * r["num_devices"] / r["opt_state_bytes"]
    rows.append((f"{name}: optimizer state per device within {STATE_TOLERANCE:.0%} of V/N",
                 abs(share - 1) <= STATE_TOLERANCE, f"{share:.4f} x V/N"))
    wire = ws["wire_bytes"] / r["replicated"]["wire_bytes"]
    if r["steps_per_call"] > 1:
      # Per step of the loop; what is gathered once after it is amortized over
      # the loop's steps (§4.2), and shown in the regime's table.
      wire = ws["loop_wire_bytes"] / r["replicated"]["loop_wire_bytes"]
      rows.append((f"{name}: collective bytes per step in the loop <= {BF16_WIRE_RATIO:.0%} of "
                   "replicated (bfloat16 weight all-gather)", wire <= BF16_WIRE_RATIO,
                   f"ratio {wire:.3f}"))
    else:
      rows.append((f"{name}: collective bytes <= replicated all-reduce's", wire <= 1,
                   f"ratio {wire:.4f}"))
    fraction = (ws["analysis_seconds"] + ws["rewrite_seconds"]) / ws["compile_seconds"]
    rows.append((f"{name}: wus analysis + rewrite < {ANALYSIS_FRACTION:.0%} of XLA compile time",
                 fraction < ANALYSIS_FRACTION, f"{fraction:.1%}"))
  return rows


def _jit_targets(r: dict) -> list[tuple[str, bool | None, str]]:
  """Issue 20's targets of a regime with the `jax.jit` user's variants."""
  if "wus_jit" not in r:
    return []
  name, wj, rows = r["regime"], r["wus_jit"], []
  for alt in (a for a in JIT_ALTERNATIVES if a in r):
    ratio = paired_ratio(wj["step_seconds"], r[alt]["step_seconds"])
    rows.append((f"{name}: wus_jit step time <= {alt}'s (median of per-round ratios)",
                 ratio <= TIME_RATIO, f"ratio {ratio:.3f}"))
  share = wj["opt_state_per_device"] * r["num_devices"] / r["opt_state_bytes"]
  rows.append((f"{name}: wus_jit optimizer state per device within {STATE_TOLERANCE:.0%} of "
               "V/N", abs(share - 1) <= STATE_TOLERANCE, f"{share:.4f} x V/N"))
  return rows


def jit_markdown(r: dict) -> str:
  """The `jax.jit` user's variants side by side: wus_jit's step time over each, state / (V/N)."""
  names = [v for v in (*JIT_ALTERNATIVES, "wus_jit") if v in r]
  if "wus_jit" not in names:
    return ""
  per = r["opt_state_bytes"] / r["num_devices"]
  rows = [[v, 1e3 * r[v]["median"], paired_ratio(r["wus_jit"]["step_seconds"],
                                                  r[v]["step_seconds"]),
           r[v]["opt_state_per_device"] / per, r[v]["moves"]["copy"]["bytes"] / MIB,
           r[v]["compile_cpu_seconds"]] for v in names]
  return "\n\n".join([
      "For a `jax.jit` user (the step on global arrays, the batch on P(\"data\")):",
      report.table(["variant", "median ms/update", "wus_jit / it (per-round ratio, median)",
                    "opt state / (V/N)", "HLO copy MiB", "XLA compile CPU s"], rows)])


def _copy_free_targets(r: dict) -> list[tuple[str, bool | None, str]]:
  """Issue 22's targets of a regime: at the limit, donation no slower, no weight copied."""
  name, ws, rows = r["regime"], r["wus"], []
  bound = limit_of(r)
  if bound is not None:
    ratio = paired_ratio(ws["step_seconds"], bound["rounds"])
    medians = ws["median"] / bound["total"]
    rows.append((f"{name}: wus / limit (the parts timed alone) <= {LIMIT_RATIO}",
                 ratio <= LIMIT_RATIO, f"ratio {ratio:.3f} (of the medians: {medians:.3f})"))
  if "wus_undonated" in r:
    ratio = paired_ratio(ws["step_seconds"], r["wus_undonated"]["step_seconds"])
    rows.append((f"{name}: wus with the state donated no slower than without",
                 ratio <= TIME_RATIO, f"ratio {ratio:.3f}"))
  copies = ws["moves"]["parameter copy"]
  rows.append((f"{name}: the compiled wus step copies no parameter", copies["count"] == 0,
               f"{copies['count']} copies, {copies['bytes'] / MIB:.3g} MiB"))
  ratio = ws["compile_cpu_seconds"] / r["replicated"]["compile_cpu_seconds"]
  wall = ws["compile_seconds"] / r["replicated"]["compile_seconds"]
  rows.append((f"{name}: XLA compile time (CPU seconds), wus / replicated <= {COMPILE_RATIO}",
               ratio <= COMPILE_RATIO, f"ratio {ratio:.3f} (wall clock {wall:.3f})"))
  return rows


def limit_markdown(r: dict) -> str:
  """The regime's limit (its parts timed alone) beside wus, and wus's data movement."""
  bound = limit_of(r)
  if bound is None:
    return ""
  moved = lambda v, k: r[v]["moves"][k]["bytes"] / MIB  # noqa: E731
  flat = 4 * limit.flat_elements(r["tensor_elements"], r["num_devices"]) / MIB
  lines = [f"Limit: forward and backward {1e3 * bound['rest']:.2f} ms + one reduce-scatter and "
           f"one all-gather of {flat:.3g} MiB {1e3 * bound['collectives']:.2f} ms + Adam on a "
           f"1/{r['num_devices']} shard "
           f"{1e3 * bound['update']:.2f} ms = {1e3 * bound['total']:.2f} ms (medians of the same "
           "rounds)."]
  rows = [[v, paired_ratio(r[v]["step_seconds"], bound["rounds"]), moved(v, "copy"),
           moved(v, "concatenate"), moved(v, "slice"), r[v]["moves"]["parameter copy"]["count"],
           r[v]["compile_cpu_seconds"]]
          for v in r["variants"]]
  lines.append(report.table(["variant", "/ limit (per-round ratio, median)", "HLO copy MiB",
                             "concatenate MiB", "slice MiB", "parameter copies",
                             "XLA compile CPU s"], rows))
  if "buckets" in r.get("wus", {}):
    lines.append(f"wus plan: {r['wus']['buckets']}.")
  return "\n\n".join(lines)


def markdown(results: list[dict]) -> str:
  """The benchmark as Markdown: one table per regime, then the targets."""
  parts = []
  for r in results:
    names = r.get("variants") or [v for v in VARIANTS if v in r]
    alternatives = [v for v in names if v in ALTERNATIVES or v == "replicated"]
    best = min(alternatives, key=lambda v: r[v]["median"])
    rows = []
    for v in names:
      m = r[v]
      rows.append([v, 1e3 * m["median"], f"{1e3 * m['min']:.2f}-{1e3 * m['max']:.2f}",
                   m["median"] / r["replicated"]["median"],
                   m["median"] / r[best]["median"] if v == "wus" else "-",
                   m["memory"]["total"] / MIB, m["opt_state_per_device"] / MIB,
                   m["wire_bytes"] / MIB, m["compile_seconds"], m["max_param_difference"]])
    parts += [f"### {r['regime']}: {r['model']} + Adam, N={r['num_devices']}, "
              f"{r['batch_size']} examples per replica per update"
              + (f", {r['steps_per_call']} updates per call" if r["steps_per_call"] > 1 else "")
              + f"; {len(r['replicated']['step_seconds'])} timed calls per variant",
              report.table(["variant", "median ms/update", "min-max ms", "/ replicated",
                            f"/ best alternative ({best})", "memory MiB/device",
                            "opt state MiB/device", "collective wire MiB/update",
                            "XLA compile s",
                            "max |Δ params| vs replicated"], rows)]
    parts += [text for text in (limit_markdown(r), jit_markdown(r)) if text]
    parts += [f"{v} analysis {r[v]['analysis_seconds']:.3f} s + rewrite "
              f"{r[v]['rewrite_seconds']:.3f} s, beside XLA's compile of the {v} step "
              f"{r[v]['compile_seconds']:.2f} s." for v in names if "analysis_seconds" in r[v]]
    if r["steps_per_call"] > 1:
      parts.append("Collective wire MiB per update inside the loop: " + ", ".join(
          f"{v} {r[v]['loop_wire_bytes'] / MIB:.3f}" for v in names) + " (the table's column "
          "adds what is gathered once per call after the loop, spread over its updates).")
  parts += ["### Targets", report.table(
      ["target", "", "measured"],
      [[t, {True: "met", False: "NOT MET", None: "-"}[ok], d] for t, ok, d in targets(results)])]
  return "\n\n".join(parts)


def _define_flags() -> None:
  flags.DEFINE_string("model", "mlp_deep", "Model (tasks.MODELS; not the ResNets, whose "
                      "batch norm needs the mesh axis the GSPMD variant has not). Adam, "
                      "synthetic data.")
  flags.DEFINE_string("small_tensors_model", "transformer_mixed", "Model of the "
                      "many-small-tensors regime (as --model).")
  flags.DEFINE_enum("topology", "measured", ["measured", "default"], "What the wus variants' "
                    "cost model is told about the devices: this machine, measured before the "
                    "regimes run (calibrate.measure), or wus's default (accelerator-class "
                    "figures).")
  flags.DEFINE_integer("update_bound_batch", 1, "Examples per replica per update, "
                       "weight-update-bound regime.", lower_bound=1)
  flags.DEFINE_integer("compute_bound_batch", 32, "Examples per replica per update, "
                       "compute-bound regime.", lower_bound=1)
  flags.DEFINE_integer("steps_per_call", 4, "Updates per call in the bf16-loop regime.",
                       lower_bound=2)
  regimes = ["weight-update-bound", "many-small-tensors", "compute-bound", "partial-sharding",
             "bf16-loop"]
  flags.DEFINE_multi_enum("regimes", regimes, regimes + ["muon"], "Regimes to run (muon: "
                          "only when named).")
  flags.DEFINE_integer("rounds", 15, "Timed updates per variant and regime.", lower_bound=1)
  flags.DEFINE_multi_integer("group_sizes", [2, 4], "G of the partial-sharding variants "
                             "(shard_group_size, §5.2) in the partial-sharding regime; each "
                             "must divide --num_devices.")
  flags.DEFINE_integer("num_devices", 8, "Simulated CPU devices (N).", lower_bound=2)
  flags.DEFINE_string("output", None, "If set, a JSON file for the measurements.")


def regimes_from_flags() -> list[Regime]:
  f = flags.FLAGS
  every = {"weight-update-bound": Regime("weight-update-bound", f.update_bound_batch, jit=True),
           "many-small-tensors": Regime(
               "many-small-tensors", f.update_bound_batch, model=f.small_tensors_model,
               skip=("gspmd_zero1",) if tasks.MODELS[f.small_tensors_model][0] == tasks.TEXT
               else ()),
           "partial-sharding": Regime("partial-sharding", f.update_bound_batch,
                                      group_sizes=tuple(f.group_sizes)),
           "compute-bound": Regime("compute-bound", f.compute_bound_batch),
           "bf16-loop": Regime("bf16-loop", f.update_bound_batch, f.steps_per_call)}
  return [every[name] for name in f.regimes if name in every]


def main(argv) -> None:
  import tqdm  # pylint: disable=g-import-not-at-top

  if len(argv) > 1:
    sys.exit(f"wus-bench: error: unexpected arguments {argv[1:]}; flags are --name=value")
  f = flags.FLAGS
  for name, model in (("model", f.model), ("small_tensors_model", f.small_tensors_model)):
    if model not in tasks.MODELS or model.startswith("resnet"):
      sys.exit(f"wus-bench: error: --{name}={model}: choose one of "
               f"{[m for m in tasks.MODELS if not m.startswith('resnet')]}")
  jax.config.update("jax_num_cpu_devices", f.num_devices)
  mesh = jax.make_mesh((f.num_devices,), (steps.AXIS_NAME,))
  regimes = regimes_from_flags()
  load = os.getloadavg()
  # This machine's costs, measured first: the wus variants' cost model plans
  # for them (--topology=measured), and the predictions are printed beside
  # the measured step times at the end.
  topology, raw = calibrate.measure(mesh, steps.AXIS_NAME)
  results = []
  with tqdm.tqdm(total=sum(f.rounds * len(r.variants) for r in regimes), unit="step",
                 file=sys.stderr) as bar:
    for regime in regimes:
      bar.set_description(regime.name)
      results.append(run_regime(regime, model=f.model, rounds=f.rounds, mesh=mesh,
                                progress=bar.update,
                                topology=topology if f.topology == "measured" else None))
  print(f"JAX {jax.__version__}, {jax.device_count()} simulated CPU devices on "
        f"{os.cpu_count()} cores ({platform.processor() or platform.machine()}); load average "
        f"{load[0]:.2f} at the start, {os.getloadavg()[0]:.2f} at the end; wus planned for the "
        f"{f.topology} topology\n")
  if results:
    print(markdown(results))
  muon = muon_bench.run_regime(mesh, f.rounds) if "muon" in f.regimes else []
  if muon:
    print("\n" + muon_bench.markdown(muon))
  if results:
    print("\n" + prediction_markdown(results, topology, raw))
  for r in results:
    p = predict(r, topology)
    if p:
      r["predicted"] = {v: dataclasses.asdict(x) for v, x in p.items()}
  calibration = {"topology": dataclasses.asdict(topology), "measured": raw}
  if f.output:
    pathlib.Path(f.output).write_text(json.dumps({"regimes": results, "calibration": calibration,
                                                  "muon": muon}, indent=2))
    print(f"\nWrote {f.output}")


def run() -> None:
  """Entry point of the `wus-bench` console script."""
  _define_flags()
  console.run_console(main, __doc__, __name__)


if __name__ == "__main__":
  run()
