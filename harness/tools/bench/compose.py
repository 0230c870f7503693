"""The limit's parts composed in one program, whole and by pairs, by hand and without wus.

`limit` times each part of a sharded step alone; a step runs them in one
program. Between the two lie what composing costs by itself (XLA:CPU running
8 simulated devices' compute and collectives in one program on a few cores)
and what a particular step adds (wus's rewrite, its per-tensor collectives,
its ordering). These programs measure the first, each a `jax.shard_map` of
the limit's parts with nothing of wus (issue 42):

  step                 the limit in one program: forward and backward, the
                       gradients laid end to end (`limit.flat_elements`), one
                       flat reduce-scatter, Adam on the flat shard, one flat
                       all-gather into a donated buffer.
  rest_flat            forward and backward, the gradients laid end to end into a
                       donated buffer: what laying them out flat costs beside
                       `limit`'s forward and backward pass alone.
  rest_reduce_scatter  forward and backward, the flat gradients reduce-scattered.
  reduce_scatter_update  the flat reduce-scatter, then Adam on its shard.
  update_all_gather    Adam on the flat shard, then the flat all-gather.
  reduce_scatter, all_gather  each collective alone (the pairs' other halves).

Each pair is compared with its two parts alone in the same rounds (the first
pair with `rest_flat`): what the pair costs beyond them is what running those
two parts in one program costs.
The weights read by the forward pass are the model's (not the gathered ones:
the next step's); the gradients' concatenation is part of the step and of
`rest_reduce_scatter` (the parts alone reduce-scatter a buffer made once).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from wus.harness.models import tasks
from wus.harness.tools.bench import limit
from wus.harness.training import steps

# The result's keys (seconds of each timed call) of the programs, by program name.
KEYS = {name: f"composed_{name}_seconds" for name in (
    "step", "rest_flat", "rest_reduce_scatter", "reduce_scatter_update", "update_all_gather",
    "reduce_scatter", "all_gather")}
# Each pair and the parts alone it composes (keys of the result).
PAIRS = {"rest_reduce_scatter": (KEYS["rest_flat"], KEYS["reduce_scatter"]),
         "reduce_scatter_update": (KEYS["reduce_scatter"], "update_seconds"),
         "update_all_gather": ("update_seconds", KEYS["all_gather"])}


class Composed:
  """The module docstring's programs on a model's weights, each a call of the batch.

  Attributes:
    elements: N k, the flat elements (`limit.flat_elements`).
    calls: program name -> a call of the batch (this replica's shares, global)
      running it once, its state and output buffers donated and kept.
  """

  def __init__(self, task: tasks.Task, params, model_state, tx: optax.GradientTransformation,
               mesh: Mesh, axis: str = steps.AXIS_NAME):
    n = mesh.shape[axis]
    self.elements = limit.flat_elements(limit.sizes_of(params), n)
    dtype = jax.tree.leaves(params)[0].dtype
    split = NamedSharding(mesh, P(axis))
    held = _flat_state(tx, mesh, axis, self.elements // n, dtype)
    held.update(reduced=jax.device_put(jnp.zeros((self.elements,), dtype), split),
                gathered=jax.device_put(jnp.zeros((n * self.elements,), dtype), split),
                grads=jax.device_put(jnp.full((n * self.elements,), 1e-3, dtype), split))
    self._programs = _programs(task, tx, mesh, axis, self.elements, held["specs"])
    self._held, self._fixed = held, {"params": params, "model_state": model_state}
    self.calls = {name: (lambda batch, name=name: self._run(name, batch))
                  for name in self._programs}

  def arguments(self, name: str, batch) -> tuple:
    """The arguments of program `name` on the held buffers (`_IO`)."""
    every = {**self._held, **self._fixed, "batch": batch}
    return tuple(every[k] for k in _IO[name][0])

  def _run(self, name: str, batch) -> object:
    """Runs one program on the held buffers, keeping what it returns for the next call."""
    out = self._programs[name](*self.arguments(name, batch))
    outputs = _IO[name][1]
    out = (out,) if len(outputs) == 1 else out
    self._held.update(zip(outputs, out, strict=True))
    return out[-1]


# Each program's arguments and what its results replace, by name in `Composed._held`
# (donated: what is both an argument and a result, and the output buffers).
_IO = {"step": (("params", "model_state", "batch", "shard", "state", "gathered"),
                ("shard", "state", "gathered")),
       "rest_flat": (("params", "model_state", "batch", "grads"), ("grads",)),
       "rest_reduce_scatter": (("params", "model_state", "batch", "reduced"), ("reduced",)),
       "reduce_scatter_update": (("grads", "shard", "state"), ("shard", "state")),
       "update_all_gather": (("shard", "grad_shard", "state", "gathered"),
                             ("shard", "state", "gathered")),
       "reduce_scatter": (("grads", "reduced"), ("reduced",)),
       "all_gather": (("shard", "gathered"), ("gathered",))}


def _flat_state(tx: optax.GradientTransformation, mesh: Mesh, axis: str, k: int,
                dtype) -> dict:
  """A flat weight shard of k elements per device, its gradients' shard, the optimizer's
  state of it and that state's specs (global arrays split over `axis`)."""
  n, split = mesh.shape[axis], NamedSharding(mesh, P(axis))
  shapes = jax.eval_shape(tx.init, jax.ShapeDtypeStruct((k,), dtype))
  specs = jax.tree.map(lambda x: P(axis) if x.ndim else P(), shapes)
  ones = jax.device_put(jnp.ones((n * k,), dtype), split)
  state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(axis), out_specs=specs,
                                check_vma=False))(ones)
  return {"shard": ones, "state": state, "specs": specs,
          "grad_shard": jax.device_put(jnp.full((n * k,), 1e-3, dtype), split)}


def _programs(task: tasks.Task, tx: optax.GradientTransformation, mesh: Mesh, axis: str,
              elements: int, specs) -> dict[str, Callable]:
  """The module docstring's programs, jitted: name -> program."""

  def flat_gradients(params, model_state, batch):
    grads, _, _ = steps.local_gradients(task, params, model_state, batch)
    leaves = [g.reshape(-1) for g in jax.tree.leaves(grads)]
    pad = elements - sum(g.size for g in leaves)
    return jnp.concatenate(leaves + [jnp.zeros((pad,), leaves[0].dtype)])

  def reduce(flat):
    return lax.psum_scatter(flat, axis, tiled=True)

  def update(shard, grad, state):
    updates, state = tx.update(grad, state, shard)
    return optax.apply_updates(shard, updates), state

  def gather(shard):
    return lax.all_gather(shard, axis, tiled=True)

  def step(params, model_state, batch, shard, state, gathered):
    del gathered  # Its buffer only: the all-gather writes into it.
    shard, state = update(shard, reduce(flat_gradients(params, model_state, batch)), state)
    return shard, state, gather(shard)

  def update_all_gather(shard, grad, state, gathered):
    del gathered
    shard, state = update(shard, grad, state)
    return shard, state, gather(shard)

  def compiled(f, in_specs, out_specs, donate):
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs),
                   donate_argnums=donate, keep_unused=True)

  a, whole = P(axis), P()
  return {
      "step": compiled(step, (whole, whole, a, a, specs, a), (a, specs, a), (3, 4, 5)),
      "rest_flat": compiled(lambda params, model_state, batch, grads: flat_gradients(
          params, model_state, batch), (whole, whole, a, a), a, (3,)),
      "rest_reduce_scatter": compiled(
          lambda params, model_state, batch, reduced: reduce(
              flat_gradients(params, model_state, batch)),
          (whole, whole, a, a), a, (3,)),
      "reduce_scatter_update": compiled(lambda grads, shard, state: update(
          shard, reduce(grads), state), (a, a, specs), (a, specs), (1, 2)),
      "update_all_gather": compiled(update_all_gather, (a, a, specs, a), (a, specs, a),
                                    (0, 2, 3)),
      "reduce_scatter": compiled(lambda grads, reduced: reduce(grads), (a, a), a, (1,)),
      "all_gather": compiled(lambda shard, gathered: gather(shard), (a, a), a, (1,)),
  }


def composition(result: dict) -> dict | None:
  """What composing the limit's parts in one program costs, from a regime's result (median
  over rounds of each round's figure), or None if the composed programs were not timed.

  Returns:
    {"step": the limit in one program (seconds), "over_parts": it / the parts alone
    (forward and backward + the flat collectives + the flat update), "wus_over_step": wus /
    it (None without wus), "flat": the gradients laid end to end (`rest_flat` less the
    forward and backward pass alone), "pairs": pair -> (its seconds over its two parts'
    alone, its seconds less theirs)}.
  """
  if not result.get(KEYS["step"]):
    return None
  step = result[KEYS["step"]]
  alone = [sum(t) for t in zip(*(result[f"{k}_seconds"] for k in ("rest", "collectives",
                                                                    "update")), strict=True)]
  wus = result.get("wus", {}).get("step_seconds")
  pairs = {}
  for name, (a, b) in PAIRS.items():
    rounds = list(zip(result[KEYS[name]], result[a], result[b], strict=True))
    pairs[name] = (statistics.median(p / (x + y) for p, x, y in rounds),
                   statistics.median(p - x - y for p, x, y in rounds))
  return {"step": statistics.median(step),
          "over_parts": statistics.median(s / t for s, t in zip(step, alone, strict=True)),
          "wus_over_step": None if wus is None else statistics.median(
              w / s for w, s in zip(wus, step, strict=True)),
          "flat": statistics.median(f - r for f, r in zip(
              result[KEYS["rest_flat"]], result["rest_seconds"], strict=True)),
          "pairs": pairs}


def markdown(result: dict) -> str:
  """The composition's figures as a paragraph, or "" if not measured."""
  c = composition(result)
  if c is None:
    return ""
  pairs = "; ".join(f"{name.replace('_', ' ')} {ratio:.3f} ({1e3 * extra:+.2f} ms)"
                    for name, (ratio, extra) in c["pairs"].items())
  wus = "" if c["wus_over_step"] is None else f"wus / it {c['wus_over_step']:.3f}; "
  faults = result.get("part_page_faults", {})
  if KEYS["step"] in faults and "rest_seconds" in faults:
    wus += (f"minor page faults per call: it {faults[KEYS['step']]:.0f}, forward and backward "
            f"alone {faults['rest_seconds']:.0f}, laid end to end "
            f"{faults[KEYS['rest_flat']]:.0f}; ")
  return (f"The limit in one program, by hand (`compose`: forward and backward, one flat "
          f"reduce-scatter, Adam on the flat shard, one flat all-gather): "
          f"{1e3 * c['step']:.2f} ms, {c['over_parts']:.3f} x the parts alone; {wus}"
          f"laying the gradients end to end costs {1e3 * c['flat']:+.2f} ms beside the "
          f"forward and backward pass alone; "
          f"each pair in one program / its two parts alone (per-round ratios, medians): "
          f"{pairs}.")
