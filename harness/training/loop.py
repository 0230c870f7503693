"""The training loop of `wus-train`: resume, train, evaluate, checkpoint, measure.

State stays as the step returns it: in `wus` mode the optimizer state is
`wus.ShardedArray`s from the first step on, passed straight back to the next
step, saved from its shards, and never gathered. Evaluation reads only the
weights and model state, which the step returns whole.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
import time
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import wus
from wus.harness.data import batches, datasets
from wus.harness.training import checkpoint, logs, steps
from wus.harness.tools import report
from wus.harness.models import tasks
from wus.harness.training.config import RunConfig


# The initialization runs once: XLA's backend optimizations of its random-number
# code take longer to compile (about 9 s for resnet_small) than they save.
INIT_COMPILER_OPTIONS = {"xla_backend_optimization_level": 0}
# Held-out examples per device per evaluation batch, at least: evaluation runs
# no backward pass, and a training batch of one or two examples per device
# would make it a long series of tiny calls.
MIN_EVAL_BATCH_PER_DEVICE = 16


@dataclasses.dataclass(frozen=True)
class Result:
  """The end of a run.

  Attributes:
    state: the final `steps.TrainState` (optimizer state sharded in wus mode).
    summary: JSON-ready measurements (see `train`).
  """

  state: steps.TrainState
  summary: dict


def evaluate(eval_step, state: steps.TrainState, split, *, batch_size: int, max_examples: int,
             sharding: NamedSharding) -> dict[str, float]:
  """Held-out {"loss" (nats, mean per prediction), "accuracy" (fraction)} of `state`.

  Evaluates the first `max_examples` examples of `split` (`Split.eval_ids`), in
  global batches of `batch_size`.
  """
  params, model_state = wus.unshard((state.params, state.model_state))  # no-op unless sharded
  sums = {"loss": 0.0, "correct": 0.0, "count": 0.0}
  for batch in batches.eval_batches(split, batch_size=batch_size, max_examples=max_examples,
                                    sharding=sharding):
    for k, v in jax.device_get(eval_step(params, model_state, batch)).items():
      sums[k] += float(v)
  return {"loss": sums["loss"] / sums["count"], "accuracy": sums["correct"] / sums["count"]}


def logical_bytes(tree) -> int:
  """Bytes of the whole (unsharded, unpadded) values of a state tree: of each tensor's
  global shape, whether wus shards it or the step splits it over a "model" axis."""
  def nbytes(x) -> int:
    return math.prod(x.shape) * np.dtype(x.dtype).itemsize
  return sum(map(nbytes, jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, wus.ShardedArray))))


def measure(train_step, state: steps.TrainState, batch, seconds: list[float]) -> dict[str, Any]:
  """Time, memory and collectives of a run's step (see `train` for the keys).

  Args:
    train_step: the mapped step.
    state: the final state.
    batch: the last global batch, or None if no update ran.
    seconds: wall time of each update of the run, in seconds.
  """
  step_seconds = statistics.median(seconds[1:]) if len(seconds) > 1 else None
  global_batch = len(jax.tree.leaves(batch)[0]) if batch else 0
  out = {
      "step_seconds": step_seconds,
      "first_step_seconds": seconds[0] if seconds else None,
      "examples_per_second": global_batch / step_seconds if step_seconds else None,
      "state_bytes_per_device": {k: report.bytes_per_device(v) for k, v in state._asdict().items()},
      "opt_state_bytes": logical_bytes(state.opt_state),
  }
  if seconds:
    compiled = train_step.lower(*state, batch).compile()
    out["memory"] = report.memory(compiled)
    out["collectives"] = {kind: c._asdict()
                          for kind, c in report.collectives(compiled.as_text()).items()}
  return out


def update_seconds(modes, task: tasks.Task, tx, mesh: Mesh, state: steps.TrainState, batch,
                   *, calls: int = 10) -> dict[str, float]:
  """Median wall time of the gradient collectives and weight update alone, per mode.

  Times `steps.make_update_step` mapped as each of `modes` maps the training
  step, from the gradients of `batch` at `state` (computed once, not timed)
  and a copy of `state` per mode, after one call that compiles it (and in wus
  mode shards the optimizer state); the modes take turns, so that they share
  the machine's load. Every process must call it.

  Returns:
    {mode: seconds}.
  """
  params, model_state, opt_state = wus.unshard(tuple(state))
  grads = steps.make_gradient_step(task, mesh)(params, model_state, batch)
  copy = functools.partial(jax.tree.map,
                           lambda x: jax.device_put(x, x.sharding, may_alias=False))
  runs = {}
  for mode in modes:
    update = steps.map_update_step(mode, steps.make_update_step(tx), mesh)
    runs[mode] = update, jax.block_until_ready(update(*copy((params, opt_state)), grads))
  seconds = {mode: [] for mode in modes}
  for _ in range(calls):
    for mode, (update, args) in runs.items():
      begin = time.perf_counter()
      runs[mode] = update, jax.block_until_ready(update(*args, grads))
      seconds[mode].append(time.perf_counter() - begin)
  return {mode: statistics.median(s) for mode, s in seconds.items()}


def init_state(task: tasks.Task, tx, dataset: datasets.Dataset, seed: int) -> steps.TrainState:
  """The initial state, a pure function of `seed` (shapes from one training example)."""
  params, model_state = task.init(seed, dataset.train.load(np.arange(1)))
  return steps.TrainState(params, model_state, tx.init(params))


def _placed_step(config: RunConfig, task: tasks.Task, tx, mesh: Mesh, init) -> tuple:
  """(the train step, mapped as `config.mode` says; the state's specs; its shardings): where
  the state of `init()` lies, each leaf whole or split over "model", and the step reading it."""
  specs = steps.state_specs(task, tx, jax.eval_shape(init))
  placed = jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                        is_leaf=lambda x: isinstance(x, P))  # whole, or split over "model"
  train_step = steps.map_train_step(config.mode, steps.make_train_step(task, tx, config.step),
                                    mesh, step=config.step,
                                    specs=specs if config.model_parallel > 1 and
                                    config.step == "shard_map" else None)
  return train_step, specs, placed


def train(config: RunConfig, *, task: tasks.Task, dataset: datasets.Dataset, tx, schedule,
          mesh: Mesh, checkpointer: checkpoint.Checkpointer | None, log_enabled: bool) -> Result:
  """Trains `task` from scratch or from the latest checkpoint up to `config.steps`.

  Update `i` (0-based) reads the global batch `dataset.train.sample(seed, i)`,
  so a resumed run sees exactly the batches an uninterrupted one would.
  Evaluation reads the held-out examples in global batches of
  `max(batch_size, MIN_EVAL_BATCH_PER_DEVICE)` per device.

  Args:
    config: the run.
    task: the model.
    dataset: training and held-out data of the task's kind.
    tx, schedule: the optimizer and its learning-rate schedule.
    mesh: `steps.make_mesh(config.step, config.model_parallel)`: the axis
      `steps.AXIS_NAME` over the replicas (all devices, unless the model is
      split over the axis `steps.MODEL_AXIS` beside it).
    checkpointer: where to resume from and save to; None for neither.
    log_enabled: show progress and write metrics (the first process only).

  Returns:
    The final state and a summary: "start_step" and "final_step" (updates
    done before and after this run), "num_devices" (devices of the mesh),
    "replicas" (N, along its data axis), "global_batch" (examples per update),
    "losses" (training loss of each update of this run),
    "step_seconds" (median wall time of an update after the first of this
    run, call to outputs ready), "first_step_seconds" (includes compilation),
    "examples_per_second" (global_batch / step_seconds), "eval" (held-out
    metrics of the final state), "memory" (`report.memory` of the compiled
    step, bytes per device), "state_bytes_per_device" (params, model_state,
    opt_state as held on device 0), "opt_state_bytes" (whole optimizer
    state, for comparison) and "collectives" ({kind: {"count", "bytes"}} in
    the compiled step). Times are None if fewer than two updates ran; memory
    and collectives are missing if none ran.
  """
  batch_sharding = NamedSharding(mesh, P(steps.AXIS_NAME))
  replicas = mesh.shape[steps.AXIS_NAME]
  global_batch = config.batch_size * replicas
  init = functools.partial(init_state, task, tx, dataset, config.seed)
  train_step, specs, placed = _placed_step(config, task, tx, mesh, init)
  start = checkpointer.latest_step() if checkpointer else None
  if start is None:
    start, state = 0, jax.jit(init, out_shardings=placed,
                              compiler_options=INIT_COMPILER_OPTIONS)()
  else:  # As the step reads it: in wus mode, optimizer state sharded for this N.
    first_batch = batches.train_batch(dataset.train, seed=config.seed, step=start,
                                      batch_size=global_batch, sharding=batch_sharding)
    abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            jax.eval_shape(init), placed)  # as placed (split over "model")
    state = checkpointer.restore(start, checkpoint.restore_target(
        train_step, abstract, first_batch, placed))
    if log_enabled:
      print(f"{config.mode}: resumed from step {start} of {checkpointer.directory}", flush=True)
  eval_batch = replicas * max(config.batch_size, MIN_EVAL_BATCH_PER_DEVICE)
  eval_step = functools.partial(evaluate, steps.make_eval_step(
      task, mesh, specs.params if config.step == "shard_map" else P()),
                                split=dataset.held_out, batch_size=eval_batch,
                                max_examples=config.eval_examples, sharding=batch_sharding)
  learning_rate = jax.jit(schedule)  # the rate update i uses, for the log
  log = logs.Log(config.output_dir if log_enabled else None, total_steps=config.steps,
                 start_step=start, enabled=log_enabled, label=config.mode)

  losses, seconds, batch, held_out = [], [], None, None
  for i in range(start, config.steps):
    batch = batches.train_batch(dataset.train, seed=config.seed, step=i,
                                batch_size=global_batch, sharding=batch_sharding)
    begin = time.perf_counter()
    params, model_state, opt_state, metrics = jax.block_until_ready(train_step(*state, batch))
    seconds.append(time.perf_counter() - begin)
    state = steps.TrainState(params, model_state, opt_state)
    metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
    losses.append(metrics["loss"])
    done = i + 1
    log.train(done, metrics, learning_rate=float(learning_rate(i)), seconds=seconds[-1])
    if done == config.steps or (config.eval_every and done % config.eval_every == 0):
      held_out = eval_step(state)
      log.eval(done, held_out)
    if checkpointer and (done == config.steps or
                         (config.checkpoint_every and done % config.checkpoint_every == 0)):
      checkpointer.save(done, state)
  log.close()

  summary = {"start_step": start, "final_step": max(start, config.steps),
             "num_devices": mesh.size, "replicas": replicas, "global_batch": global_batch,
             "losses": losses,
             "eval": held_out or eval_step(state),  # evaluated now if nothing was left to train
             **measure(train_step, state, batch, seconds)}
  if config.model_parallel > 1 and config.mode == "wus" and batch is not None:
    # What wus did with the weights split over "model", as its Plan says (its first lines:
    # the clusters sharded and the state per device).
    summary["plan"] = str(train_step.plan(*state, batch)).splitlines()[:2]
  return Result(state, summary)
