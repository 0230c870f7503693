r"""`wus-train`: trains a model with and without wus, and compares.

The same data-parallel step, on the same data from the same seed, runs in
each mode of --modes: "replicated" (`jax.jit(jax.shard_map(...))`: every
replica updates every weight) and "wus" (`wus.shard_map(...)`: the weight
update is sharded across replicas, optimizer state stays sharded). Each mode
shows a progress bar; at the end it prints, all measured: the loss curves,
held-out loss and accuracy, step times and throughput, per-device memory of
the state and of the compiled step, and the collectives in each compiled step.
With --output_dir, each mode checkpoints there and resumes from its latest
checkpoint; every mode's checkpoints are checked before the first one trains.
`results.json` there keeps one record per run: a resumed run appends its own;
`comparison.png` is the picture of the last run (the modes' loss curves on one axis,
and the optimizer state and compiled step per device, replicated beside wus).

Examples:
  wus-train                                      # Transformer LM on stdlib bytes
  wus-train --model=resnet_small --modes=wus     # ResNet + LARS on the digits
  wus-train --model=resnet_small --modes=wus --output_dir=/tmp/run   # resumable
  wus-train --model_parallel=2     # Megatron-style TP on a 4 x 2 (data x model) mesh
  # Two processes of 4 devices (the other one with --process_id=1):
  wus-train --modes=wus --num_devices=4 --num_processes=2 --process_id=0 \
      --coordinator_address=127.0.0.1:12355
"""

import dataclasses
import json
import math
import pathlib

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

from wus.harness.data import batches, datasets
from wus.harness.training import checkpoint, cli, figure, loop, optim, steps
from wus.harness import console, errors
from wus.harness.tools import report
from wus.harness.models import tasks
from wus.harness.training.config import RunConfig


def build(config: RunConfig):
  """(dataset, task, optimizer, schedule) of `config`.

  Raises:
    errors.InputError: the data cannot be read, or the model cannot be split
      `config.model_parallel` ways.
  """
  kind = tasks.MODELS[config.model][0]
  dataset = datasets.load(config.data, kind, seq_len=config.seq_len,
                          image_size=config.image_size, seed=config.seed)
  try:
    task = tasks.make(config.model, num_classes=dataset.num_classes, seq_len=config.seq_len,
                      axis_name=steps.AXIS_NAME if config.step == "shard_map" else None,
                      model_parallel=config.model_parallel, manual=config.step == "shard_map")
  except ValueError as e:
    raise errors.InputError(f"--model_parallel={config.model_parallel}: {e}") from None
  tx, schedule = optim.make(config.optimizer, **config.optimizer_hyperparameters())
  return dataset, task, tx, schedule


def identity(config: RunConfig, task: tasks.Task) -> dict:
  """What a checkpoint of `config` records and checks: the model and the optimizer."""
  return {**task.identity(), "optimizer": config.optimizer}


def continue_schedule(config: RunConfig, given: dict) -> RunConfig:
  """`config` with the schedule saved with its latest checkpoint, if any: a resumed run
  continues the saved learning-rate schedule and optimizer hyperparameters exactly.

  Every process must call it (after `cli.setup_jax`).

  Args:
    config: the run as its flags make it.
    given: {schedule field: (flag, value)} of the flags given (`cli.given_schedule`).

  Raises:
    errors.InputError: a given flag differs from the saved schedule, or (LARS) the run
      would go past the step where the saved schedule's rate reaches 0.
  """
  if not config.output_dir:
    return config
  found = checkpoint.saved_schedule(config.output_dir / "checkpoints")
  if found is None:
    return config
  step, saved = found
  where = f"the checkpoint at step {step} in {config.output_dir / 'checkpoints'}"
  for field, value in saved.items():
    if field in given and given[field][1] != value:
      flag, mine = given[field]
      raise errors.InputError(
          f"--{flag}={mine} differs from the schedule saved with {where} ({field}={value}): "
          "a resumed run continues the saved schedule; drop the flag, or use another "
          "--output_dir")
  config = dataclasses.replace(config, **{k: v for k, v in saved.items() if hasattr(config, k)})
  if config.optimizer == "lars" and config.steps > config.decay_steps:
    raise errors.InputError(
        f"--steps={config.steps} goes past the LARS schedule saved with {where}, whose rate "
        f"reaches 0 at update {config.decay_steps} (decay_steps): start a run with "
        f"--decay_steps={config.steps} to extend it later, or use another --output_dir")
  return config


def describe(config: RunConfig, dataset, task: tasks.Task, tx, modes: list[str]) -> str:
  """What the run trains, with what, on what: the lines `wus-train` starts with."""
  abstract = jax.eval_shape(lambda: loop.init_state(task, tx, dataset, config.seed))
  count = sum(math.prod(x.shape) for x in jax.tree.leaves(abstract.params))
  s = config.schedule()
  if config.optimizer == "lars":
    opt = (f"LARS (momentum {s['momentum']}, weight decay {s['weight_decay']:g}); learning "
           f"rate 0 -> {s['learning_rate']:g} over {s['warmup_steps']} warmup updates, then "
           f"polynomial decay (power 2) to 0 at update {s['decay_steps']}")
  else:
    opt = (f"Adam (b1 {s['b1']}, b2 {s['b2']}, eps {s['eps']:g}); learning rate 0 -> "
           f"{s['learning_rate']:g} over {s['warmup_steps']} warmup updates, then "
           "inverse-square-root decay")
  devices = (f"{jax.device_count()} {jax.devices()[0].platform.upper()} devices in "
             f"{jax.process_count()} process(es), one mesh axis {steps.AXIS_NAME!r}")
  per = "device"
  if config.model_parallel > 1:
    n_data = jax.device_count() // config.model_parallel
    per = f"data replica ({config.model_parallel} devices)"
    devices = (f"{jax.device_count()} {jax.devices()[0].platform.upper()} devices in "
               f"{jax.process_count()} process(es), mesh {steps.AXIS_NAME!r} ({n_data}) x "
               f"{steps.MODEL_AXIS!r} ({config.model_parallel}): attention heads and MLP "
               f"hidden units split over {steps.MODEL_AXIS!r} (Megatron-style)")
  saving = (f"checkpoints every {config.checkpoint_every or config.steps} updates and metrics "
            f"under {config.output_dir.parent}/<mode>/ (resumes from the latest)"
            if config.output_dir else "nothing (no --output_dir: no checkpoints, no metrics)")
  return "\n".join([
      f"wus-train: {config.model}, {count:,} parameters",
      f"  data: {dataset.description}",
      f"  optimizer: {opt}",
      f"  {config.steps} updates of {config.batch_size} examples per {per}; {devices}",
      f"  modes: {', '.join(modes)}; saving: {saving}"])


def open_checkpoints(config: RunConfig, task: tasks.Task) -> checkpoint.Checkpointer:
  """The checkpoints of `config` in `<output_dir>/checkpoints`, for `task` and the optimizer.

  Raises:
    errors.InputError: they are of another model or optimizer, or unreadable.
  """
  return checkpoint.Checkpointer(config.output_dir / "checkpoints", identity(config, task),
                                 max_to_keep=config.keep_checkpoints,
                                 schedule=config.schedule())


def fit(config: RunConfig, built=None) -> loop.Result:
  """Loads the data, builds model and optimizer, and trains (`loop.train`).

  JAX must be set up for `config` (`cli.setup_jax`). With `config.output_dir`,
  resumes from and saves to `<output_dir>/checkpoints` and writes
  `summary.json` there (first process only; the summary of this call).

  Args:
    config: the run.
    built: `build(config)`, if already done.

  Raises:
    errors.InputError: the data cannot be read or the checkpoints there are
      of another model or optimizer, or unreadable.
  """
  dataset, task, tx, schedule = built or build(config)
  mesh = steps.make_mesh(config.step, config.model_parallel)
  checkpointer = open_checkpoints(config, task) if config.output_dir else None
  first = jax.process_index() == 0
  try:
    result = loop.train(config, task=task, dataset=dataset, tx=tx, schedule=schedule,
                        mesh=mesh, checkpointer=checkpointer, log_enabled=first)
  finally:
    if checkpointer:
      checkpointer.close()
  if config.output_dir and first:
    (config.output_dir / "summary.json").write_text(json.dumps(result.summary, indent=2))
  return result


def _on_every_process(decision: bool) -> bool:
  """The first process's `decision`, on every process (each times its own steps)."""
  if jax.process_count() == 1:
    return decision
  return bool(multihost_utils.broadcast_one_to_all(np.int32(decision)))


def fit_modes(configs: list[RunConfig]) -> dict[str, dict]:
  """`fit` of each config (one per mode, same data, model and optimizer), in order.

  Every mode's checkpoints are checked (each array read) before the first mode
  trains, so a bad or damaged one stops the run before any training and before
  anything is written.

  If wus's median step time is not below replicated's, the gradient
  collectives and weight update of both steps are then timed alone, in turns
  (`loop.update_seconds`), to say why: "update_seconds" in both summaries.

  Returns:
    {mode: summary}.

  Raises:
    errors.InputError: as `fit`.
  """
  built = build(configs[0])
  dataset, task, tx, _ = built
  for config in configs:
    if config.output_dir:
      checkpoint.check(config.output_dir / "checkpoints", identity(config, task))
  if jax.process_index() == 0:  # Once the checkpoints are known good.
    print(describe(configs[0], dataset, task, tx, [c.mode for c in configs]), flush=True)
  summaries = {}
  for config in configs:  # only the last state is kept: each is replicated on every device
    last = fit(config, built)
    summaries[config.mode] = last.summary
  times = [summaries.get(mode, {}).get("step_seconds") for mode in steps.MODES]
  # Timing the update alone maps it with whole weights: not for a tensor-parallel model.
  if (all(times) and configs[0].model_parallel == 1
      and _on_every_process(times[1] >= times[0])):
    mesh = steps.make_mesh(configs[0].step)
    batch = batches.train_batch(dataset.train, seed=configs[0].seed, step=0,
                                batch_size=last.summary["global_batch"],
                                sharding=NamedSharding(mesh, P(steps.AXIS_NAME)))
    seconds = loop.update_seconds(steps.MODES, task, tx, mesh, last.state, batch)
    for mode, summary in summaries.items():
      summary["update_seconds"] = seconds[mode]
  return summaries


def append_record(path: pathlib.Path, record: dict) -> None:
  """Appends `record` to the JSON list in `path` (created if missing).

  A file that is not such a list (an older single record, or unreadable) is
  kept: a record becomes the list's first element; an unreadable file is
  renamed to `<name>.unreadable`.
  """
  records = []
  if path.exists():
    try:
      records = json.loads(path.read_text())
    except json.JSONDecodeError:
      path.rename(path.with_name(path.name + ".unreadable"))
    records = records if isinstance(records, list) else [records]
  path.write_text(json.dumps([*records, record], indent=2))


def format_results(results: dict[str, dict]) -> str:
  """The printed summary of `loop.train` summaries, keyed by mode.

  With two modes (replicated, wus), adds the difference of their losses and
  the ratio wus/replicated of each time and memory figure.
  """
  modes = list(results)
  both = len(modes) == 2
  start, stop, losses, loss_rows = _training_losses(results, modes)
  num_steps = losses.shape[1]
  loss_headers = ["step", *(f"{m} loss" for m in modes)]
  split = all(r.get("update_seconds") and r["step_seconds"] for r in results.values())
  summary_rows = _summary_rows(results, modes, split)
  summary_headers = ["", *modes]
  notes = []
  if both:
    loss_headers.append(f"{modes[1]} - {modes[0]}")
    for r in loss_rows:
      r.append(r[2] - r[1])
    if num_steps:
      notes.append("max |difference| of training loss over all steps: "
                   f"{np.abs(losses[1] - losses[0]).max():.3g}")
    summary_headers.append(f"{modes[1]}/{modes[0]}")
    for r in summary_rows:
      numbers = all(isinstance(v, (int, float)) for v in r[1:]) and r[1]
      r.append(r[2] / r[1] if numbers else "-")

  parts = []
  if num_steps:
    parts += [f"Training loss, updates {start + 1}-{stop}", report.table(loss_headers, loss_rows),
              *notes]
  parts += ["Held-out metrics, time (median over updates after the first) and per-device "
            "memory", report.table(summary_headers, summary_rows)]
  if both and split:
    parts.append(time_note(results[modes[0]], results[modes[1]]))
  if both and (note := temp_note(results[modes[0]], results[modes[1]])):
    parts.append(note)
  parts += [f"{m}'s Plan:\n" + "\n".join(results[m]["plan"]) for m in modes
            if results[m].get("plan")]
  if all("collectives" in results[m] for m in modes):
    parts += _collectives_table(results, modes)
  return "\n\n".join(parts)


def _training_losses(results: dict[str, dict], modes: list[str]) -> tuple:
  """(start, stop, losses, rows): the updates start+1..stop every mode ran, their training
  losses [num_modes, num_steps], and the loss table's rows (about ten updates and the last)."""
  start = max(results[m]["start_step"] for m in modes)
  stop = min(results[m]["final_step"] for m in modes)
  losses = np.array([results[m]["losses"][start - results[m]["start_step"]:
                                          stop - results[m]["start_step"]] for m in modes])
  num_steps = losses.shape[1]
  rows = [[start + i + 1, *map(float, losses[:, i])]
          for i in sorted({*range(0, num_steps, max(1, num_steps // 10)), num_steps - 1})
          if num_steps]
  return start, stop, losses, rows


def _summary_rows(results: dict[str, dict], modes: list[str], split: bool) -> list[list]:
  """The summary table's rows, one per figure (held-out metrics, times, memory), a column per
  mode; with the collectives and update timed alone if `split`."""

  def row(label, value):
    return [label, *(value(results[m]) for m in modes)]

  return [
      row("held-out loss", lambda r: r["eval"]["loss"]),
      row("held-out accuracy", lambda r: r["eval"]["accuracy"]),
      row("median step time (ms)", lambda r: 1e3 * r["step_seconds"] if r["step_seconds"]
          else "-"),
      *([row("  collectives + update alone (ms)", lambda r: 1e3 * r["update_seconds"])]
        if split else []),
      row("throughput (examples/s)", lambda r: r["examples_per_second"] or "-"),
      row("first step, incl. compile (s)", lambda r: r["first_step_seconds"] or "-"),
      row("optimizer state, whole (bytes)", lambda r: r["opt_state_bytes"]),
      *(row(f"{k} per device (bytes)", lambda r, k=k: r["state_bytes_per_device"][k])
        for k in results[modes[0]]["state_bytes_per_device"]),
      *([row("opt_state per device / whole copy", lambda r: r["state_bytes_per_device"][
          "opt_state"] / r["opt_state_bytes"])]
        if any(r.get("replicas", r.get("num_devices")) != r.get("num_devices")
               for r in results.values()) else []),  # tensor parallelism: say the fraction
      *(row(f"compiled step {k} (bytes)", lambda r, k=k: r.get("memory", {}).get(k, "-"))
        for k in ("argument", "output", "alias", "temp", "total")),
  ]


def _collectives_table(results: dict[str, dict], modes: list[str]) -> list[str]:
  """The collectives of each mode's compiled step, counted and sized by kind: title, table."""
  fields = [(m, f) for m in modes for f in ("count", "bytes", "wire_bytes")]
  return ["Collectives in the compiled step (from its optimized HLO; bytes per device: "
          "result sizes, and sent by ring algorithms on a network)",
          report.table(["kind", *(f"{m} {f}" for m, f in fields)],
                       [[kind, *(results[m]["collectives"][kind][f] for m, f in fields)]
                        for kind in report.COLLECTIVE_KINDS])]


def temp_note(replicated: dict, sharded: dict) -> str:
  """Says so, with the bytes, when wus's compiled step holds more temporary memory.

  Args:
    replicated, sharded: `loop.train` summaries with "memory" (`report.memory`).
  """
  before, after = replicated.get("memory", {}), sharded.get("memory", {})
  if not before or not after or after["temp"] <= before["temp"]:
    return ""
  ratio = after["temp"] / max(before["temp"], 1)
  return (f"wus's compiled step needs more temporary memory per device: {after['temp']:,} "
          f"bytes against {before['temp']:,} replicated ({ratio:.2f}x, "
          f"+{after['temp'] - before['temp']:,}), while its arguments fall from "
          f"{before['argument']:,} to {after['argument']:,} bytes and its total from "
          f"{before['total']:,} to {after['total']:,}: the batched collectives concatenate the "
          "gradients of each bucket into one buffer before the reduce-scatter and cut the "
          "gathered weights from another, and the update's shards are padded; at this size "
          "those buffers are not small beside the state.")


def time_note(replicated: dict, sharded: dict) -> str:
  """Why wus's step is not faster than the replicated one, measured.

  Args:
    replicated, sharded: `fit_modes` summaries of the two modes, both with
      "step_seconds" and "update_seconds".
  """
  ms = 1e3
  step_r, step_w = replicated["step_seconds"], sharded["step_seconds"]
  update_r, update_w = replicated["update_seconds"], sharded["update_seconds"]
  share = update_r / step_r
  n = sharded.get("num_devices", "N")
  gather = sharded.get("collectives", {}).get("all-gather", {"count": 0, "bytes": 0})
  note = (f"wus is not faster in this run (step time wus/replicated {step_w / step_r:.3f}, "
          f"{(step_w - step_r) * ms:+.1f} ms). The gradient collectives and weight update, timed "
          f"alone after training, take {update_r * ms:.1f} ms replicated ({share:.0%} of its "
          f"{step_r * ms:.1f} ms step: an all-reduce, then every replica updates every weight) "
          f"and {update_w * ms:.1f} ms with wus (a reduce-scatter, the update of 1/{n} of every "
          "tensor, then all-gathers): ")
  if update_w >= update_r:
    note += (f"the extra collective round ({gather['count']} all-gather(s) of the new weights, "
             f"{gather['bytes']:,} bytes per device, after the reduce-scatter, where the "
             f"replicated step has one all-reduce) costs more than updating 1/{n} of every "
             f"tensor saves ({(update_w - update_r) * ms:.1f} ms more).")
  else:
    note += (f"sharding saves {(update_r - update_w) * ms:.1f} ms of it timed alone, so the "
             "difference of the steps lies outside the update: in the rest of the two programs, "
             "which XLA fuses and schedules differently around the collectives, or in timing "
             "noise on a shared machine.")
  return note + (" Larger weights or a smaller per-replica batch make the update a larger "
                 "share of the step, as in the default run.")


def train() -> None:
  """`wus-train` on the parsed flags: each mode trained, the comparison printed.

  Raises:
    errors.InputError: flags, data or a checkpoint that cannot be used.
  """
  configs = cli.configs_from_flags()
  cli.setup_jax(configs[0])
  given = cli.given_schedule()
  configs = [continue_schedule(c, given) for c in configs]
  results = fit_modes(configs)
  if jax.process_index() == 0:
    print(format_results(results))
    print()
    if configs[0].output_dir:
      path = configs[0].output_dir.parent / "results.json"
      append_record(path, {"flags": cli.flag_values(), "modes": results})
      picture = figure.plot(results, configs[0].output_dir.parent / "comparison.png",
                            f"{configs[0].model}, {configs[0].optimizer}, "
                            f"{jax.device_count()} devices")
      for c in configs:
        print(f"Saved {c.mode}: checkpoints in {c.output_dir / 'checkpoints'} (latest: update "
              f"{results[c.mode]['final_step']}), metrics in {c.output_dir / 'metrics.jsonl'} "
              f"and {c.output_dir / 'tensorboard'}")
      print(f"Appended this run's results to {path}; its picture (losses, memory per "
            f"device) is {picture}")
    else:
      print("Nothing was saved (no --output_dir): pass --output_dir=DIR for checkpoints, "
            "metrics and resuming.")


COMMAND = console.Command("wus-train", train, __doc__, cli.__name__)
main, run = COMMAND.main, COMMAND.run  # absl's main; the console script's entry point.


if __name__ == "__main__":
  run()
