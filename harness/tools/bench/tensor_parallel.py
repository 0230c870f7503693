"""The tensor-parallel regime of `wus-bench`: optimizer state over data x model.

The default Transformer split Megatron-style over a "model" axis
(`transformer_tp`: heads and MLP hidden units, a psum after the row-parallel
matmuls) on a (N / M data) x (M model) mesh, Adam, synthetic bytes, one
window per data replica per update (weight-update bound, as the default
`wus-train` run). Variants, each with its state donated:

  tp           `jax.jit(jax.shard_map(step))` of the step `wus-train
               --model_parallel=M` runs (`steps.map_train_step`): the weights
               and their optimizer state split over "model" only, repeated on
               every data replica (1/M of a copy of the split weights' state).
  gspmd_zero1  the ZeRO-1 MaxText users write: `jax.jit` of the step on
               global arrays (`TransformerLM.apply`), the weights placed by the
               same specs, each optimizer-state tensor's spec with "data" added
               to its first dim that the data size divides and "model" does not
               split (MaxText's `add_data_to_sharding`; a tensor without one
               stays as its weight). GSPMD partitions the rest.
  wus          `wus.shard_map(step)` of the tp step, unchanged.

Measured in one run, interleaved (`timing`): median step time, optimizer state
per device (as a fraction of one whole copy), the collectives of each compiled
step (count and bytes per device, from its optimized HLO), and the weights'
largest difference from tp's after the same updates. On this loaded machine
the times show that it runs, not which is faster.
"""

from __future__ import annotations

import statistics

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import wus
from wus.harness.data import batches, datasets
from wus.harness.models import tasks
from wus.harness.tools import report
from wus.harness.tools.bench import timing
from wus.harness.training import loop, optim, steps

VARIANTS = ("tp", "gspmd_zero1", "wus")


def add_data_to_spec(spec: P, shape: tuple[int, ...], n_data: int) -> P:
  """`spec` with AXIS_NAME on the first dim of `shape` it leaves whole and `n_data` divides
  (MaxText's `add_data_to_sharding`); `spec` unchanged if there is none."""
  parts = list(spec) + [None] * (len(shape) - len(spec))
  for d, size in enumerate(shape):
    if parts[d] is None and size % n_data == 0:
      parts[d] = steps.AXIS_NAME
      return P(*parts)
  return spec


def unusable(model: str, model_parallel: int, num_devices: int) -> str | None:
  """Why the regime cannot run `model` split over `model_parallel` of `num_devices`
  devices (flags named as `wus-bench` names them), or None."""
  if num_devices % model_parallel:
    return f"--model_parallel={model_parallel} does not divide --num_devices={num_devices}"
  try:
    tasks.make(model, num_classes=None, seq_len=1, axis_name=None, model_parallel=model_parallel)
  except (KeyError, ValueError) as e:
    return f"--tp_model={model}: {e}"
  return None


def _variants(model: str, model_parallel: int, seq_len: int, topology=None) -> dict:
  """{variant: (step, mesh, state shardings)} and the shared (task, tx, dataset, state)."""
  dataset = datasets.load("synthetic", tasks.TEXT, seq_len=seq_len, image_size=1, seed=0)
  tp_task = tasks.make(model, num_classes=None, seq_len=seq_len, axis_name=steps.AXIS_NAME,
                       model_parallel=model_parallel)
  whole_task = tasks.make(model, num_classes=None, seq_len=seq_len, axis_name=None)
  tx, _ = optim.make("adam", learning_rate=2e-3, warmup_steps=6, b1=0.9, b2=0.98, eps=1e-9)
  state = jax.eval_shape(lambda: loop.init_state(tp_task, tx, dataset, 0))
  specs = steps.state_specs(tp_task, tx, state)
  shard_mesh = steps.make_mesh("shard_map", model_parallel)
  jit_mesh = steps.make_mesh("jit", model_parallel)  # Auto axes: GSPMD partitions the rest

  def on(mesh, tree):
    return jax.tree.map(lambda s: NamedSharding(mesh, s), tree, is_leaf=lambda x: isinstance(x, P))
  n_data = jit_mesh.shape[steps.AXIS_NAME]
  zero1 = specs._replace(opt_state=jax.tree.map(
      lambda s, x: add_data_to_spec(s, x.shape, n_data), specs.opt_state, state.opt_state,
      is_leaf=lambda x: isinstance(x, P)))
  zero1_placed = on(jit_mesh, zero1)
  train_step = steps.make_train_step(tp_task, tx)
  out = {name: (steps.map_train_step(name if name == "wus" else "replicated", train_step,
                                     shard_mesh, specs=specs, topology=topology),
                shard_mesh, on(shard_mesh, specs)) for name in ("tp", "wus")}
  out["gspmd_zero1"] = (jax.jit(
      steps.make_train_step(whole_task, tx, "jit"),
      in_shardings=(*zero1_placed, NamedSharding(jit_mesh, P(steps.AXIS_NAME))),
      out_shardings=(*zero1_placed, NamedSharding(jit_mesh, P())), donate_argnums=(0, 1, 2)),
      jit_mesh, zero1_placed)
  return out, (tp_task, tx, dataset)


def run(mesh: Mesh, *, rounds: int, model: str = "transformer_wide", model_parallel: int = 2,
        seq_len: int = 32, topology=None) -> dict:
  """Measures the variants (module docstring), interleaved, `rounds` timed updates each.

  Args:
    mesh: the bench's 1-D mesh (only its size is read: N devices).
    rounds: timed updates per variant.
    model: a Transformer of `tasks.MODELS` whose heads and MLP width M divides.
    model_parallel: M, the size of the "model" axis; it must divide N.
    seq_len: bytes per example.
    topology: the wus variant's, for its cost model; None: its default.

  Returns:
    JSON-ready: "model", "mesh" ({axis: size}), "opt_state_bytes" (one whole
    copy), and per variant "median", "min", "max" (seconds per update),
    "opt_state_per_device" (bytes on device 0), "collectives" ({kind: {count,
    bytes, wire_bytes}}) and "max_param_difference" (from tp's weights).
  """
  variants, (task, tx, dataset) = _variants(model, model_parallel, seq_len, topology)
  n_data = mesh.size // model_parallel
  init = jax.device_get(jax.jit(lambda: loop.init_state(task, tx, dataset, 0))())  # host
  states, calls, out = {}, {}, {"model": model, "variants": list(VARIANTS),
                                "mesh": {steps.AXIS_NAME: n_data, steps.MODEL_AXIS: model_parallel},
                                "opt_state_bytes": loop.logical_bytes(init.opt_state)}
  for name in VARIANTS:
    step, vmesh, placed = variants[name]
    data = [batches.train_batch(dataset.train, seed=0, step=i, batch_size=n_data,
                                sharding=NamedSharding(vmesh, P(steps.AXIS_NAME)))
            for i in range(rounds + 2)]
    state = tuple(jax.device_put(init, placed))
    hlo = step.lower(*state, data[0]).compile().as_text()
    out[name] = {"collectives": {k: c._asdict() for k, c in report.collectives(hlo).items()}}
    for batch in data[:2]:  # Warm up: compile, and (wus) shard the state.
      state = jax.block_until_ready(step(*state, batch))[:3]
    states[name] = state

    def call(r, name=name, step=step, data=data):
      states[name] = jax.block_until_ready(step(*states[name], data[2 + r]))[:3]
    calls[name] = call
  seconds = timing.interleaved(calls, rounds)
  reference = jax.tree.map(np.asarray, states["tp"][0])
  for name in VARIANTS:
    out[name].update(median=statistics.median(seconds[name]), min=min(seconds[name]),
                     max=max(seconds[name]),
                     opt_state_per_device=report.bytes_per_device(states[name][2]))
    out[name]["max_param_difference"] = max(
        float(np.max(np.abs(np.asarray(a, np.float64) - b))) for a, b in
        zip(jax.tree.leaves(wus.unshard(states[name][0])), jax.tree.leaves(reference),
            strict=True))
  return out


def targets(r: dict) -> list[tuple[str, bool, str]]:
  """Issue 29's targets of the regime: (target, met, measured)."""
  ws, z1, tp = r["wus"], r["gspmd_zero1"], r["tp"]
  state = ws["opt_state_per_device"] / z1["opt_state_per_device"]
  time = ws["median"] / tp["median"]
  return [("wus optimizer state per device <= GSPMD ZeRO-1's", state <= 1, f"ratio {state:.3f}"),
          ("wus median step time <= tp's (state replicated over data)", time <= 1,
           f"ratio {time:.3f}")]


def markdown(r: dict) -> str:
  """The regime's table, its collectives and its targets."""
  whole, tp = r["opt_state_bytes"], r["tp"]
  mesh = " x ".join(f"{a} {n}" for a, n in r["mesh"].items())
  rows = [[v, 1e3 * r[v]["median"], f"{1e3 * r[v]['min']:.1f}-{1e3 * r[v]['max']:.1f}",
           r[v]["median"] / tp["median"], r[v]["opt_state_per_device"] / 2 ** 20,
           r[v]["opt_state_per_device"] / whole, r[v]["max_param_difference"]]
          for v in r["variants"]]
  kinds = [k for k in report.COLLECTIVE_KINDS if any(r[v]["collectives"][k]["count"]
                                                     for v in r["variants"])]
  coll = [[v, *(f"{r[v]['collectives'][k]['count']} ({r[v]['collectives'][k]['bytes']:,} B)"
                for k in kinds)] for v in r["variants"]]
  return "\n\n".join([
      f"### tensor-parallel: {r['model']} split Megatron-style over 'model', mesh {mesh}, "
      f"Adam; {len(r['variants'])} variants interleaved",
      report.table(["variant", "median ms/step", "min-max ms", "/ tp", "opt state MiB/device",
                    "/ whole copy", "max |Δ params| vs tp"], rows),
      "Collectives in each compiled step (count, result bytes per device)",
      report.table(["variant", *kinds], coll),
      report.table(["target", "", "measured"],
                   [[t, "met" if ok else "NOT MET", d] for t, ok, d in targets(r)])])
