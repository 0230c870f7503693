r"""`wus-train`: trains a byte-level Transformer LM with and without wus, and compares.

The same data-parallel step, on the same data from the same seed, is compiled
twice: with `jax.jit(jax.shard_map(...))` ("replicated": every replica updates
every weight) and with `wus.shard_map(...)` ("wus": the weight update is sharded
across replicas). At the end it prints, all measured: the two loss curves, the
step times, the per-device memory of each compiled step, and the collectives in
each compiled step.

Example:
  wus-train --steps=20 --modes=replicated --output_dir=/tmp/wus
"""

import dataclasses
import functools
import json
import pathlib
import statistics
import sys
import time

import jax
import numpy as np
import optax
import tqdm
from absl import app, flags
from jax.sharding import NamedSharding, PartitionSpec as P

import wus
from wus.harness import data, models, report

MODES = ("replicated", "wus")
AXIS_NAME = "data"
SPECS = {"in_specs": (P(), P(), P(AXIS_NAME)), "out_specs": (P(), P(), P())}

FLAGS = flags.FLAGS
flags.DEFINE_string("text_file", None, "Train on the bytes of this file instead of the "
                    "Python standard library's .py sources.")
flags.DEFINE_integer("steps", 100, "Training steps per mode.", lower_bound=2)
flags.DEFINE_integer("batch_size", 4, "Sequences per replica per step; the global batch "
                     "is batch_size * num_devices.", lower_bound=1)
flags.DEFINE_integer("seq_len", 128, "Tokens (bytes) per sequence fed to the model.",
                     lower_bound=1)
flags.DEFINE_enum("model", "small", list(models.CONFIGS), "Transformer size: small (2 "
                  "layers, width 128) or base (6 layers, width 512, as in the Flax WMT "
                  "example).")
flags.DEFINE_float("learning_rate", 1e-3, "Adam learning rate.")
flags.DEFINE_integer("num_devices", 8, "Data-parallel replicas: simulated CPU devices, "
                     "one mesh axis named 'data'.", lower_bound=1)
flags.DEFINE_integer("seed", 0, "Seed of the parameter initialization and of the data "
                     "order; both modes use it.", lower_bound=0)
flags.DEFINE_multi_enum("modes", list(MODES), MODES, "Modes to run; replicated runs first "
                        "when both are given.")
flags.DEFINE_string("output_dir", None, "If set, write results.json here: per mode the "
                    "losses, step times, memory and collectives.")


def make_train_step(loss_fn, tx: optax.GradientTransformation):
  """The per-replica data-parallel step, to be mapped over the 'data' axis.

  Args:
    loss_fn: (params, batch) -> float32 scalar, the mean loss of a batch.
    tx: the optimizer.

  Returns:
    train_step(params, opt_state, batch) -> (params, opt_state, loss), where
    batch is this replica's share and loss is the float32 mean over replicas.
  """

  def train_step(params, opt_state, batch):
    # Differentiate at a per-replica ("varying") copy of the weights, so that the
    # gradients are this replica's own and `pmean` is their one all-reduce. At the
    # replicated `params` themselves (check_vma=True), AD would already sum the
    # gradients over replicas, and `pmean` would all-reduce them a second time.
    local_params = jax.lax.pcast(params, AXIS_NAME, to="varying")
    loss, grads = jax.value_and_grad(loss_fn)(local_params, batch)
    grads = jax.lax.pmean(grads, AXIS_NAME)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, AXIS_NAME)

  return train_step


def map_step(mode: str, train_step, mesh: jax.sharding.Mesh):
  """`train_step` mapped over `mesh` and compiled, the plain JAX way or by wus."""
  if mode == "replicated":
    return jax.jit(jax.shard_map(train_step, mesh=mesh, **SPECS))
  return wus.shard_map(train_step, mesh=mesh, **SPECS)


def train(step, params, opt_state, batches, num_steps: int, desc: str):
  """Runs `num_steps` steps with a progress bar; times each call.

  Args:
    step: the mapped step, (params, opt_state, batch) -> (params, opt_state,
      loss).
    params, opt_state: the initial state.
    batches: step index -> that step's global batch on the mesh.
    num_steps: number of steps.
    desc: label of the progress bar.

  Returns:
    (params, opt_state, losses, seconds): the final state; the loss of each
    step; the wall time of each call in seconds, from the call until its outputs
    are ready (the first includes compilation).
  """
  losses, seconds = [], []
  with tqdm.trange(num_steps, desc=desc, unit="step") as bar:
    for i in bar:
      batch = batches(i)
      start = time.perf_counter()
      params, opt_state, loss = jax.block_until_ready(step(params, opt_state, batch))
      seconds.append(time.perf_counter() - start)
      losses.append(float(loss))
      bar.set_postfix(loss=f"{losses[-1]:.4f}")
  return params, opt_state, losses, seconds


def run_mode(mode: str, mesh, model: models.TransformerLM, tx, batches, eval_batch,
             num_steps: int, seed: int) -> dict:
  """Trains in one mode from a fresh initialization, then measures it.

  Args:
    mode: one of MODES.
    mesh: the mesh, with one axis named AXIS_NAME.
    model: the language model.
    tx: the optimizer.
    batches: step index -> int32 [global_batch, seq_len + 1] on the mesh.
    eval_batch: a held-out batch like those of `batches`.
    num_steps: training steps.
    seed: parameter-initialization seed.

  Returns:
    A JSON-ready dict: "losses" (per step), "step_seconds" (per call),
    "median_step_seconds" (over calls after the first), "eval_loss" (of the
    final parameters on `eval_batch`), "memory" (report.memory of the compiled
    steady-state step), "opt_state_bytes" (per device, after training) and
    "collectives" ({kind: {"count", "bytes"}} in the compiled step).
  """
  loss_fn = functools.partial(models.loss, model)
  params = models.init(model, seed)
  params, opt_state = jax.device_put((params, tx.init(params)), NamedSharding(mesh, P()))
  step = map_step(mode, make_train_step(loss_fn, tx), mesh)
  params, opt_state, losses, seconds = train(step, params, opt_state, batches, num_steps,
                                             mode)
  evaluate = jax.jit(jax.shard_map(lambda p, b: jax.lax.pmean(loss_fn(p, b), AXIS_NAME),
                                   mesh=mesh, in_specs=(P(), P(AXIS_NAME)), out_specs=P()))
  compiled = step.lower(params, opt_state, batches(0)).compile()
  return {
      "losses": losses,
      "step_seconds": seconds,
      "median_step_seconds": statistics.median(seconds[1:]),
      "eval_loss": float(evaluate(params, eval_batch)),
      "memory": report.memory(compiled),
      "opt_state_bytes": report.bytes_per_device(opt_state),
      "collectives": {kind: {"count": count, "bytes": size}
                      for kind, (count, size) in report.collectives(compiled.as_text()).items()},
  }


def format_results(results: dict[str, dict]) -> str:
  """The printed summary of `run_mode` results, keyed by mode.

  With two modes (replicated, wus), adds the difference of their losses and the
  ratio wus/replicated of each time and memory figure.
  """
  modes = list(results)
  both = len(modes) == 2
  losses = np.array([results[m]["losses"] for m in modes])  # [num_modes, num_steps]
  num_steps = losses.shape[1]
  loss_headers = ["step", *(f"{m} loss" for m in modes)]
  loss_rows = [[i, *map(float, losses[:, i])]
               for i in sorted({*range(0, num_steps, max(1, num_steps // 10)), num_steps - 1})]
  summary_headers = ["", *modes]
  summary_rows = [
      ["median step time (ms)", *(1e3 * results[m]["median_step_seconds"] for m in modes)],
      ["first call, incl. compile (s)", *(results[m]["step_seconds"][0] for m in modes)],
      ["optimizer state (bytes)", *(results[m]["opt_state_bytes"] for m in modes)],
      *([f"compiled step {k} (bytes)", *(results[m]["memory"][k] for m in modes)]
        for k in results[modes[0]]["memory"]),
  ]
  held_out = "Held-out loss of the final parameters: " + ", ".join(
      f"{m} {results[m]['eval_loss']:.4f}" for m in modes)
  if both:
    loss_headers.append(f"{modes[1]} - {modes[0]}")
    for row in loss_rows:
      row.append(row[2] - row[1])
    held_out += ("\nmax |difference| of training loss over all steps: "
                 f"{np.abs(losses[1] - losses[0]).max():.3g}")
    summary_headers.append(f"{modes[1]}/{modes[0]}")
    for row in summary_rows:
      row.append(row[2] / row[1] if row[1] else "-")

  fields = [(m, field) for m in modes for field in ("count", "bytes")]
  collective_rows = [[kind, *(results[m]["collectives"][kind][field] for m, field in fields)]
                     for kind in report.COLLECTIVE_KINDS]
  return "\n\n".join([
      "Training loss (nats per byte)", report.table(loss_headers, loss_rows), held_out,
      "Time (median over calls after the first) and per-device memory",
      report.table(summary_headers, summary_rows),
      "Collectives in the compiled step (from its optimized HLO; bytes per device)",
      report.table(["kind", *(f"{m} {field}" for m, field in fields)], collective_rows),
  ])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  jax.config.update("jax_num_cpu_devices", FLAGS.num_devices)
  mesh = jax.make_mesh((FLAGS.num_devices,), (AXIS_NAME,))
  config = dataclasses.replace(models.CONFIGS[FLAGS.model], max_len=FLAGS.seq_len)
  train_tokens, eval_tokens = data.split(data.load_tokens(FLAGS.text_file))
  sample = functools.partial(data.windows, seed=FLAGS.seed, seq_len=FLAGS.seq_len,
                             batch_size=FLAGS.batch_size * FLAGS.num_devices)
  results = {
      mode: run_mode(mode, mesh, models.TransformerLM(config), optax.adam(FLAGS.learning_rate),
                     lambda i: data.on_mesh(sample(train_tokens, step=i), mesh),
                     data.on_mesh(sample(eval_tokens, step=0), mesh), FLAGS.steps, FLAGS.seed)
      for mode in MODES if mode in FLAGS.modes
  }
  print(format_results(results))
  if FLAGS.output_dir:
    path = pathlib.Path(FLAGS.output_dir) / "results.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    flag_values = {f.name: f.value for f in FLAGS.get_key_flags_for_module(sys.modules[__name__])}
    path.write_text(json.dumps({"flags": flag_values, "modes": results}, indent=2))
    print(f"\nWrote {path}")


def run():
  """Entry point of the `wus-train` console script."""
  app.run(main)


if __name__ == "__main__":
  run()
