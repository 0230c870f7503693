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
`results.json` there keeps one record per run: a resumed run appends its own.

Examples:
  wus-train                                      # Transformer LM on stdlib bytes
  wus-train --model=resnet_small --modes=wus     # ResNet + LARS on the digits
  wus-train --model=resnet_small --modes=wus --output_dir=/tmp/run   # resumable
  # Two processes of 4 devices (the other one with --process_id=1):
  wus-train --modes=wus --num_devices=4 --num_processes=2 --process_id=0 \
      --coordinator_address=127.0.0.1:12355
"""

import json
import pathlib
import sys

import jax
import numpy as np
from absl import app

from wus.harness import checkpoint, cli, datasets, errors, loop, optim, report, steps, tasks
from wus.harness.config import RunConfig


def build(config: RunConfig):
  """(dataset, task, optimizer, schedule) of `config`.

  Raises:
    errors.InputError: the data cannot be read.
  """
  kind = tasks.MODELS[config.model][0]
  dataset = datasets.load(config.data, kind, seq_len=config.seq_len,
                          image_size=config.image_size, seed=config.seed)
  task = tasks.make(config.model, num_classes=dataset.num_classes, seq_len=config.seq_len,
                    axis_name=steps.AXIS_NAME)
  tx, schedule = optim.make(config.optimizer, **config.optimizer_hyperparameters())
  return dataset, task, tx, schedule


def identity(config: RunConfig, task: tasks.Task) -> dict:
  """What a checkpoint of `config` records and checks: the model and the optimizer."""
  return {**task.identity(), "optimizer": config.optimizer}


def open_checkpoints(config: RunConfig, task: tasks.Task) -> checkpoint.Checkpointer:
  """The checkpoints of `config` in `<output_dir>/checkpoints`, for `task` and the optimizer.

  Raises:
    errors.InputError: they are of another model or optimizer, or unreadable.
  """
  return checkpoint.Checkpointer(config.output_dir / "checkpoints", identity(config, task),
                                 max_to_keep=config.keep_checkpoints)


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
  mesh = jax.make_mesh((jax.device_count(),), (steps.AXIS_NAME,))
  checkpointer = open_checkpoints(config, task) if config.output_dir else None
  first = jax.process_index() == 0
  if first:
    print(f"{config.mode}: {config.model} on {dataset.description}; "
          f"{jax.device_count()} devices in {jax.process_count()} process(es)", file=sys.stderr)
  try:
    result = loop.train(config, task=task, dataset=dataset, tx=tx, schedule=schedule,
                        mesh=mesh, checkpointer=checkpointer, log_enabled=first)
  finally:
    if checkpointer:
      checkpointer.close()
  if config.output_dir and first:
    (config.output_dir / "summary.json").write_text(json.dumps(result.summary, indent=2))
  return result


def fit_modes(configs: list[RunConfig]) -> dict[str, dict]:
  """`fit` of each config (one per mode, same data, model and optimizer), in order.

  Every mode's checkpoints are checked before the first mode trains, so a bad
  one stops the run before any training and before anything is written.

  Returns:
    {mode: summary}.

  Raises:
    errors.InputError: as `fit`.
  """
  built = build(configs[0])
  for config in configs:
    if config.output_dir:
      checkpoint.check(config.output_dir / "checkpoints", identity(config, built[1]))
  return {config.mode: fit(config, built).summary for config in configs}


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
  start = max(results[m]["start_step"] for m in modes)
  stop = min(results[m]["final_step"] for m in modes)
  # [num_modes, num_steps]: updates start+1..stop, run by every mode.
  losses = np.array([results[m]["losses"][start - results[m]["start_step"]:
                                          stop - results[m]["start_step"]] for m in modes])
  num_steps = losses.shape[1]
  loss_headers = ["step", *(f"{m} loss" for m in modes)]
  loss_rows = [[start + i + 1, *map(float, losses[:, i])]
               for i in sorted({*range(0, num_steps, max(1, num_steps // 10)), num_steps - 1})
               if num_steps]

  def row(label, value):
    return [label, *(value(results[m]) for m in modes)]

  summary_rows = [
      row("held-out loss", lambda r: r["eval"]["loss"]),
      row("held-out accuracy", lambda r: r["eval"]["accuracy"]),
      row("median step time (ms)", lambda r: 1e3 * r["step_seconds"] if r["step_seconds"]
          else "-"),
      row("throughput (examples/s)", lambda r: r["examples_per_second"] or "-"),
      row("first step, incl. compile (s)", lambda r: r["first_step_seconds"] or "-"),
      row("optimizer state, whole (bytes)", lambda r: r["opt_state_bytes"]),
      *(row(f"{k} per device (bytes)", lambda r, k=k: r["state_bytes_per_device"][k])
        for k in results[modes[0]]["state_bytes_per_device"]),
      *(row(f"compiled step {k} (bytes)", lambda r, k=k: r.get("memory", {}).get(k, "-"))
        for k in ("argument", "output", "alias", "temp", "total")),
  ]
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
  if all("collectives" in results[m] for m in modes):
    fields = [(m, f) for m in modes for f in ("count", "bytes", "wire_bytes")]
    parts += ["Collectives in the compiled step (from its optimized HLO; bytes per device: "
              "result sizes, and sent by ring algorithms on a network)",
              report.table(["kind", *(f"{m} {f}" for m, f in fields)],
                           [[kind, *(results[m]["collectives"][kind][f] for m, f in fields)]
                            for kind in report.COLLECTIVE_KINDS])]
  return "\n\n".join(parts)


def main(argv):
  cli.quiet_logs()
  if len(argv) > 1:
    sys.exit(f"wus-train: error: unexpected arguments {argv[1:]}; flags are --name=value")
  try:
    configs = cli.configs_from_flags()
    cli.setup_jax(configs[0])
    results = fit_modes(configs)
  except errors.InputError as e:
    sys.exit(f"wus-train: error: {e}")
  if jax.process_index() == 0:
    print(format_results(results))
    if configs[0].output_dir:
      path = configs[0].output_dir.parent / "results.json"
      append_record(path, {"flags": cli.flag_values(), "modes": results})
      print(f"\nAppended this run's results to {path}")


def run():
  """Entry point of the `wus-train` console script."""
  # --help shows the docstring of __main__ and the flags of the module named
  # sys.argv[0]; for a console script, that is a generated wrapper.
  main_module = sys.modules["__main__"]
  main_module.__doc__ = main_module.__doc__ or __doc__
  for flag in cli.FLAGS.get_key_flags_for_module(cli.__name__):
    cli.FLAGS.register_key_flag_for_module(sys.argv[0], flag)
  app.run(main)


if __name__ == "__main__":
  run()
