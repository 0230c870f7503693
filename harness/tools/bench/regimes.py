"""One regime of `wus-bench` measured: every variant compiled, warmed up and timed
interleaved, with the parts of a sharded step alone (`limit`)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from wus.analysis import cost, network
from wus.harness.data import batches, datasets
from wus.harness.models import tasks
from wus.harness.tools import report
from wus.harness.tools.bench import choices, compose, limit, timing
from wus.harness.tools.bench.variants import Regime, variant_steps
from wus.harness.training import config as config_lib, optim, steps


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
    (`Regime.rest`) also "rest_seconds": each timed call of the forward and
    backward pass alone (`steps.make_gradient_step`); without partial-sharding
    variants (`Regime.parts`) also "collectives_seconds", "update_seconds" and
    "update_per_tensor_seconds" (`limit.Parts`), with both also "sequence_seconds" (the
    three parts of the limit run back to back, each after the other, in one timed call)
    and the limit composed in one program, whole and by pairs (`compose.KEYS`);
    "part_page_faults": each part's minor page faults per call (median).
    "tensor_elements": of every weight.
  """
  s = _setting(regime, model, rounds, mesh, seed)
  variants = variant_steps(regime, s.task, s.tx, mesh, s.state, topology)
  out = {"regime": regime.name, "model": s.model, "num_devices": mesh.size,
         "variants": list(variants),
         "batch_size": regime.batch_size, "steps_per_call": regime.steps_per_call,
         "opt_state_bytes": sum(x.nbytes for x in jax.tree.leaves(s.state.opt_state)),
         "tensor_elements": [int(x.size) for x in jax.tree.leaves(s.params)],
         "rest_seconds": [], "collectives_seconds": [], "update_seconds": [],
         "update_per_tensor_seconds": [], "sequence_seconds": [],
         **{key: [] for key in compose.KEYS.values()}}
  parts = _parts(regime, s, mesh, out["tensor_elements"])
  states, batchings = {}, {}
  for name, (step, fresh) in variants.items():
    out[name], states[name], found = _warmed(name, step, fresh, s.data, regime, mesh, topology)
    batchings.update(found)
  for call in parts.values():
    jax.block_until_ready(call(-2))
  calls = _calls(parts, variants, states, batchings, s.data)
  faults = {}
  seconds = timing.interleaved(
      calls, rounds, seed=seed,
      progress=progress and (lambda name: name in variants and progress()), faults=faults)
  _record(out, seconds, faults, parts, batchings, regime)
  _compare(out, variants, states)
  return out


class _Setting(NamedTuple):
  """What every variant of a regime runs on: the model, its task, Adam, the replicated
  state and the global batches (two warm-up calls', then one per round)."""
  model: str
  task: tasks.Task
  tx: optax.GradientTransformation
  params: Any
  state: steps.TrainState
  data: list


def _setting(regime: Regime, model: str, rounds: int, mesh: Mesh, seed: int) -> _Setting:
  """The model (`regime.model` if it names one), initialized, and synthetic data for it."""
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
  return _Setting(model, task, tx, params, state, data)


def _parts(regime: Regime, s: _Setting, mesh: Mesh,
           tensor_elements: list[int]) -> dict[str, Callable[[int], Any]]:
  """The parts alone, by their key in the result: the forward and backward pass (no
  all-reduce, no update; the cost model's "rest" of a one-update step), the collectives and
  the update, and (both) the limit's parts in sequence and composed (`compose`); each a
  call of the round."""
  parts = {}
  if regime.rest:
    rest = steps.make_gradient_step(s.task, mesh)
    parts["rest_seconds"] = lambda r: rest(s.state.params, s.state.model_state, s.data[2 + r])
  if regime.parts:
    pieces = limit.Parts(tensor_elements, s.tx, mesh, steps.AXIS_NAME)
    parts.update(collectives_seconds=lambda r: pieces.collectives(),
                 update_seconds=lambda r: pieces.update(),
                 update_per_tensor_seconds=lambda r: pieces.update_per_tensor())
    if regime.rest:
      parts["sequence_seconds"] = lambda r: _in_sequence(
          lambda: rest(s.state.params, s.state.model_state, s.data[2 + r]),
          pieces.collectives, pieces.update)
      composed = compose.Composed(s.task, s.state.params, s.state.model_state, s.tx, mesh)
      parts.update({compose.KEYS[name]: lambda r, call=call: call(s.data[2 + r])
                    for name, call in composed.calls.items()})
  return parts


def _in_sequence(*calls: Callable[[], Any]) -> Any:
  """Runs `calls` one after another, each to completion before the next starts (as the
  parts of a step follow each other): the last one's result, not yet waited for."""
  for call in calls[:-1]:
    jax.block_until_ready(call())
  return calls[-1]()


def _compiled(step, fresh: steps.TrainState, batch, steps_per_call: int) -> dict:
  """A variant's step lowered and compiled, timed: its compile times, memory, collectives and
  data movement (the variant's entry of the result, "step_seconds" still empty)."""
  start = time.perf_counter()
  lowered = step.lower(*fresh, batch)
  middle, cpu = time.perf_counter(), time.process_time()
  compiled = lowered.compile()
  cpu = time.process_time() - cpu
  hlo = compiled.as_text()
  collectives = report.collectives(hlo, per_run=True)
  in_loop = report.collectives(hlo, per_run=True, only=report.in_loops(hlo))
  return {"lower_seconds": middle - start, "compile_seconds": time.perf_counter() - middle,
          "compile_cpu_seconds": cpu,
          "memory": report.memory(compiled),
          "collectives": {k: c._asdict() for k, c in collectives.items()},
          "moves": {k: m._asdict() for k, m in report.data_movement(hlo).items()},
          "wire_bytes": sum(c.wire_bytes for c in collectives.values()) / steps_per_call,
          "loop_wire_bytes": sum(c.wire_bytes for c in in_loop.values()) / steps_per_call,
          "step_seconds": []}


def _warmed(name: str, step, fresh: steps.TrainState, data: list, regime: Regime, mesh: Mesh,
            topology: network.Topology | None) -> tuple[dict, steps.TrainState, dict]:
  """A variant compiled (`_compiled`, with wus's Plan choice and times), then warmed up on
  the first two batches: (its entry of the result, its state after them, the batchings
  `_batchings` times beside the "wus" variant of a regime with parts, else {})."""
  entry, batchings = _compiled(step, fresh, data[0], regime.steps_per_call), {}
  if name.startswith("wus"):
    plan = step.plan(*fresh, data[0])
    entry.update(bucket_bytes=plan.bucket_bytes, alone_bytes=plan.alone_bytes,
                 buckets=plan.buckets)
    if name == "wus" and regime.parts:
      batchings = _batchings(plan, mesh, topology)
  if hasattr(step, "timings"):  # wus.shard_map (wus.jit has no timings).
    timings = step.timings(*fresh, data[0])
    entry.update(analysis_seconds=timings["analysis"], rewrite_seconds=timings["rewrite"])
  for batch in data[:2]:  # Warm up: compile, and (wus) shard the state.
    fresh = steps.TrainState(*jax.block_until_ready(step(*fresh, batch))[:3])
  return entry, fresh, batchings


def _calls(parts: dict, variants: dict, states: dict, batchings: dict,
           data: list) -> dict[str, Callable[[int], None]]:
  """What `timing.interleaved` times, by name: the parts, each variant's update (which
  advances its state in `states`) and each batching's program (compiled here)."""

  def update(name: str) -> Callable[[int], None]:
    def call(r: int) -> None:
      states[name] = steps.TrainState(
          *jax.block_until_ready(variants[name][0](*states[name], data[2 + r]))[:3])
    return call

  calls = {k: lambda r, c=c: jax.block_until_ready(c(r)) for k, c in parts.items()}
  calls.update({name: update(name) for name in variants})
  for name, b in batchings.items():
    run, args = b["program"]
    jax.block_until_ready(run(*args))  # Compile.
    calls[f"batching:{name}"] = lambda r, run=run, args=args: jax.block_until_ready(run(*args))
  return calls


def _record(out: dict, seconds: dict, faults: dict, parts: dict, batchings: dict,
            regime: Regime) -> None:
  """The timed calls' seconds into `out`: the parts', the batchings' beside their
  predictions, and each variant's per update with their median, min, max and page faults."""
  for key in parts:
    out[key] = seconds[key]
  out["part_page_faults"] = {key: statistics.median(faults[key]) for key in parts}
  if batchings:
    out["choices"] = {name: {"collectives": b["collectives"], "predicted": b["predicted"],
                             "seconds": seconds[f"batching:{name}"]}
                      for name, b in batchings.items()}
  for name in out["variants"]:
    out[name]["step_seconds"] = [t / regime.steps_per_call for t in seconds[name]]
    out[name]["page_faults"] = statistics.median(faults[name]) / regime.steps_per_call
  for name in out["variants"]:
    times = out[name]["step_seconds"]
    out[name].update(median=statistics.median(times), min=min(times), max=max(times))


def _compare(out: dict, variants: dict, states: dict) -> None:
  """Each variant's state after the run into `out`: its optimizer state's bytes on device 0
  and its weights' difference from the replicated variant's (wus_jit's also from jit's)."""
  for name in variants:
    out[name]["opt_state_per_device"] = report.bytes_per_device(states[name].opt_state)
    out[name]["max_param_difference"] = _max_difference(states[name].params,
                                                         states["replicated"].params)
  if "wus_jit" in variants:
    out["wus_jit"]["max_jit_param_difference"] = _max_difference(states["wus_jit"].params,
                                                                 states["jit"].params)


def _batchings(plan, mesh: Mesh, topology: network.Topology | None) -> dict:
  """The Plan's batching and the two extremes (`choices`), each with its program, its
  collectives each way and its prediction for the topology the step was planned with."""
  workload = cost.step_workload(plan.clusters)
  if workload is None:
    return {}
  n = plan.num_shards
  topology = topology or network.default_topology(n, platform=mesh.devices.flat[0].platform)
  out = {}
  for name, (bucket, alone) in choices.choices(plan.bucket_bytes, plan.alone_bytes).items():
    out[name] = {"program": choices.program(workload, mesh, steps.AXIS_NAME, bucket, alone),
                 "collectives": choices.collective_counts(workload, n, bucket, alone),
                 "predicted": choices.predicted_seconds(workload, topology, n, bucket, alone)}
  return out


def _max_difference(a, b) -> float:
  """max |a - b| over the leaves of two trees of arrays."""
  return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))
