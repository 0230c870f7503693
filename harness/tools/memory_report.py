r"""`wus-memory`: per-device memory of the replicated and the wus step, measured (§4.2).

For each case (model, optimizer, number of replicas N) three programs of the
same model and optimizer are compiled, with the training state donated as a
training loop does:

* replicated: `jax.jit(jax.shard_map(train_step))`, every replica updates
  every weight;
* wus: `wus.shard_map(train_step)` in steady state (optimizer state sharded);
* forward and backward alone (each replica's gradients, before any
  all-reduce, no update): the paper's P.

Nothing runs: inputs are abstract (`jax.ShapeDtypeStruct`), so ResNet-50 at
224x224 is reported without the memory to train it. Everything in the tables
is read from the compiled programs: per-device bytes from
`Compiled.memory_analysis()` (a program's total is argument + output - alias
+ temp), collectives from the optimized HLO. Beside them, labelled as
predictions, the paper's formula (§4.2): with W the weights (and model state
such as batch-norm averages), V the optimizer state, and P what the forward
and backward pass allocates beyond W, peak memory goes from W + V + P to
max(W + V/N + P, W + V). The step itself needs W + V/N + P; the whole state,
W + V, exists only before its first step shards it and after `wus.unshard`.

Examples:
  wus-memory                                   # all models, N = 8 and 4
  wus-memory --models=mlp_large --num_devices=8,2 --output_dir=/tmp/memory
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import sys
import time

import jax
import numpy as np
from absl import flags
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from wus.harness.training import config as config_lib
from wus.harness import console, errors
from wus.harness.training import optim, steps
from wus.harness.tools import report
from wus.harness.models import tasks

# Per model: its optimizer and the per-replica batch and input sizes reported.
# ResNet-50 and the Transformer follow the paper's Table 1 (LARS, Adam); the
# MLP is the weight-update-bound case (large weights, small batch).
MODEL_CASES = {
    "resnet50": {"optimizer": "lars", "batch_size": 32, "image_size": 224},
    "transformer_base": {"optimizer": "adam", "batch_size": 8, "seq_len": 256},
    "mlp_large": {"optimizer": "adam", "batch_size": 2, "image_size": 32},
}
NUM_CLASSES = 1000  # ImageNet's, for the image models


@dataclasses.dataclass(frozen=True)
class Case:
  """One report row pair.

  Attributes:
    model: a key of `tasks.MODELS`.
    optimizer: "lars" or "adam" (`optim.make`).
    num_devices: N, the replicas (the first N devices).
    batch_size: examples per replica.
    image_size: side in pixels of the images an image model reads.
    seq_len: tokens a language model reads per example.
  """

  model: str
  optimizer: str
  num_devices: int
  batch_size: int
  image_size: int = 32
  seq_len: int = 128

  @classmethod
  def for_model(cls, model: str, num_devices: int) -> Case:
    return cls(model, num_devices=num_devices, **MODEL_CASES[model])

  @property
  def label(self) -> str:
    return f"{self.model} + {self.optimizer}, N={self.num_devices}"


def nbytes(tree) -> int:
  """Bytes of the arrays (or abstract arrays) of a pytree."""
  return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def _example(kind: str, case: Case, rows: int) -> dict[str, np.ndarray]:
  """A batch of `rows` zero examples of `kind`, for shapes."""
  if kind == tasks.IMAGES:
    return {"image": np.zeros((rows, case.image_size, case.image_size, 3), np.float32),
            "label": np.zeros((rows,), np.int32)}
  return {"tokens": np.zeros((rows, case.seq_len + 1), np.int32)}


def abstract_inputs(case: Case, mesh: jax.sharding.Mesh):
  """(task, optimizer, state, batch) of `case`; state and batch are abstract on `mesh`.

  Returns:
    The task, the optax optimizer, a `steps.TrainState` of
    `jax.ShapeDtypeStruct`s replicated on `mesh`, and the global batch
    (`batch_size * N` examples) as `jax.ShapeDtypeStruct`s split over the data
    axis.
  """
  kind = tasks.MODELS[case.model][0]
  task = tasks.make(case.model, num_classes=NUM_CLASSES, seq_len=case.seq_len,
                    axis_name=steps.AXIS_NAME)
  run = config_lib.RunConfig.for_model(case.model, optimizer=case.optimizer)
  tx, _ = optim.make(case.optimizer, **run.optimizer_hyperparameters())
  params, model_state = jax.eval_shape(lambda: task.init(0, _example(kind, case, 1)))
  opt_state = jax.eval_shape(tx.init, params)
  replicated = NamedSharding(mesh, P())
  state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated),
                       steps.TrainState(params, model_state, opt_state))
  split = NamedSharding(mesh, P(steps.AXIS_NAME))
  batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=split)
           for k, v in _example(kind, case, case.batch_size * mesh.size).items()}
  return task, tx, state, batch


def _program(compiled: jax.stages.Compiled) -> dict:
  return {"memory": report.memory(compiled),
          "collectives": {k: c._asdict()
                          for k, c in report.collectives(compiled.as_text()).items()}}


def measure(case: Case, step: str = "shard_map") -> dict:
  """The measured report of one case: its fields and `measure_step`'s.

  Args:
    case: the model, optimizer and sizes.
    step: "shard_map" (`jax.shard_map` against `wus.shard_map`) or "jit" (the step on
      global arrays, `jax.jit` against `wus.jit`, on Auto axes).

  Raises:
    ValueError: `case.num_devices` is more than the devices JAX has.
  """
  if case.num_devices > jax.device_count():
    raise ValueError(f"{case.label}: needs {case.num_devices} devices, JAX has "
                     f"{jax.device_count()}; set --num_devices (or jax_num_cpu_devices)")
  types = (AxisType.Auto,) if step == "jit" else None
  mesh = jax.make_mesh((case.num_devices,), (steps.AXIS_NAME,), axis_types=types,
                       devices=jax.devices()[:case.num_devices])
  task, tx, state, batch = abstract_inputs(case, mesh)
  return {**dataclasses.asdict(case), **measure_step(task, tx, state, batch, mesh, step)}


def measure_step(task: tasks.Task, tx, state: steps.TrainState, batch,
                 mesh: jax.sharding.Mesh, step: str = "shard_map") -> dict:
  """Compiles the replicated and the wus step of `task` and `tx` and reads their bytes.

  Args:
    task: the model.
    tx: the optax optimizer.
    state: the training state (arrays or `jax.ShapeDtypeStruct`s), replicated
      on `mesh`.
    batch: the global batch, split over the data axis of `mesh`.
    mesh: a 1-D mesh with the axis `steps.AXIS_NAME`.

  Returns:
    JSON-ready, bytes per device: "weights_bytes" (W: params and model
    state), "opt_state_bytes" (V, whole), "activations_bytes" (P: total of the
    forward and backward pass, up to each replica's gradients, minus W); per
    mode "replicated" and "wus": {"memory": `report.memory`, "collectives":
    {kind: {count, bytes, wire_bytes}}, "opt_state_per_device": V minus the drop
    in argument bytes from replicated to wus (for replicated, V)};
    "predicted" (§4.2, from W, V, P: replicated W + V + P, wus W + V/N + P);
    "wus_seconds" (wus's own: tracing the step, the analysis and the rewrite) and
    "compile_seconds" (XLA's compile of the lowered wus step).
  """
  out = {"weights_bytes": nbytes((state.params, state.model_state)),
         "opt_state_bytes": nbytes(state.opt_state)}
  # The gradients leave stacked over the replicas, not all-reduced: the
  # all-reduce belongs to the update.
  grads = steps.make_gradient_step(task, mesh).lower(state.params, state.model_state,
                                                     batch).compile()
  out["activations_bytes"] = report.memory(grads)["total"] - out["weights_bytes"]
  train_step = steps.make_train_step(task, tx, step)
  for mode in steps.MODES:
    mapped = steps.map_train_step(mode, train_step, mesh, step=step)
    lowered = mapped.lower(*state, batch)
    start = time.perf_counter()
    compiled = lowered.compile()
    out[mode] = _program(compiled)
    if mode == "wus":
      out["compile_seconds"] = time.perf_counter() - start
      out["wus_seconds"] = sum(mapped.timings(*state, batch).values())
  drop = out["replicated"]["memory"]["argument"] - out["wus"]["memory"]["argument"]
  out["replicated"]["opt_state_per_device"] = out["opt_state_bytes"]
  out["wus"]["opt_state_per_device"] = out["opt_state_bytes"] - drop
  w, v, p = out["weights_bytes"], out["opt_state_bytes"], out["activations_bytes"]
  out["predicted"] = {"replicated": w + v + p, "wus": w + v / mesh.size + p}
  return out


def markdown(results: list[dict]) -> str:
  """The report as Markdown: one row per case and mode, then W, V, P per case."""
  mib = 2 ** 20
  rows = []
  for r in results:
    label = Case(**{f.name: r[f.name] for f in dataclasses.fields(Case)}).label
    for mode in steps.MODES:
      m, c = r[mode]["memory"], r[mode]["collectives"]
      rows.append([label, mode, m["argument"] / mib, m["temp"] / mib, m["total"] / mib,
                   r["predicted"][mode] / mib, r[mode]["opt_state_per_device"] / mib,
                   *(f"{c[k]['count']} / {c[k]['wire_bytes'] / mib:.2f}"
                     for k in ("all-reduce", "reduce-scatter", "all-gather"))])
  memory = report.table(
      ["case", "mode", "argument MiB", "temp MiB", "total MiB", "predicted MiB (§4.2)",
       "opt state MiB", "all-reduce n / wire MiB", "reduce-scatter n / wire MiB",
       "all-gather n / wire MiB"], rows)
  terms = report.table(
      ["case", "W MiB", "V MiB", "P MiB", "wus total / replicated total",
       "opt state per device / (V/N)", "wus s / XLA compile s"],
      [[Case(**{f.name: r[f.name] for f in dataclasses.fields(Case)}).label,
        r["weights_bytes"] / mib, r["opt_state_bytes"] / mib, r["activations_bytes"] / mib,
        r["wus"]["memory"]["total"] / r["replicated"]["memory"]["total"],
        r["wus"]["opt_state_per_device"] * r["num_devices"] / r["opt_state_bytes"],
        f"{r['wus_seconds']:.2f} / {r['compile_seconds']:.2f} = "
        f"{r['wus_seconds'] / r['compile_seconds']:.2f}"]
       for r in results])
  return "\n\n".join([
      "Per-device memory and collectives of the compiled step, measured: memory_analysis() "
      "(total = argument + output - alias + temp; the state is donated) and the optimized HLO "
      "(wire = bytes a device sends by ring algorithms). Predicted, the paper's §4.2: "
      "W + V + P (replicated), W + V/N + P (the wus step; the whole W + V exists only before "
      "the first step shards it).", memory,
      "Terms of the formula, measured (W weights and model state, V optimizer state, P what "
      "forward and backward allocate beyond W), and measured ratios; wus's own seconds "
      "(tracing the step, the analysis, the rewrite) against XLA's compile of the wus step.",
      terms])


def plot(results: list[dict], path: pathlib.Path) -> None:
  """A bar chart of the measured bytes per device of the step, replicated and wus,
  per case, with the paper's predictions as markers; written as PNG to `path`."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top

  mib = 2 ** 20
  labels = [f"{r['model']}\n{r['optimizer']}, N={r['num_devices']}" for r in results]
  x = np.arange(len(results))
  fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(results)), 4.5))
  for k, (mode, color) in enumerate([("replicated", "tab:gray"), ("wus", "tab:blue")]):
    offset = (k - 0.5) * 0.38
    ax.bar(x + offset, [r[mode]["memory"]["total"] / mib for r in results], 0.36, color=color,
           label=f"{mode}: measured")
    ax.scatter(x + offset, [r["predicted"][mode] / mib for r in results], marker="_",
               s=400, color="black", zorder=3,
               label="predicted, §4.2" if k else None)
  ax.set_xticks(x, labels, fontsize=8)
  ax.set_ylabel("MiB per device (argument + output - alias + temp)")
  ax.set_title("Memory of the training step per device")
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def write(results: list[dict], output_dir: pathlib.Path) -> dict[str, pathlib.Path]:
  """Writes report.md, report.json and report.png to `output_dir`; returns their paths."""
  output_dir.mkdir(parents=True, exist_ok=True)
  paths = {k: output_dir / f"report.{k}" for k in ("md", "json", "png")}
  paths["md"].write_text(markdown(results) + "\n")
  paths["json"].write_text(json.dumps(results, indent=2))
  plot(results, paths["png"])
  return paths


def _define_flags() -> None:
  flags.DEFINE_multi_enum("models", list(MODEL_CASES), list(MODEL_CASES),
                          "Models to report, each with its optimizer and sizes: "
                          + "; ".join(f"{m}: {c}" for m, c in MODEL_CASES.items()) + ".")
  flags.DEFINE_list("num_devices", ["8", "4"], "Replica counts N to report; the largest "
                    "is the number of simulated CPU devices.")
  flags.DEFINE_string("output_dir", "wus-memory-report", "Where report.md, report.json "
                      "and report.png go.")
  flags.DEFINE_enum("step", "shard_map", list(steps.STEP_STYLES), "How the step is written: "
                    "per replica under jax.shard_map / wus.shard_map, or on global arrays "
                    "under jax.jit / wus.jit.")


def report_memory() -> None:
  """`wus-memory` on the parsed flags: each case compiled and measured, the report written.

  Raises:
    errors.InputError: --num_devices is not a list of positive counts.
  """
  try:
    counts = [int(n) for n in flags.FLAGS.num_devices]
  except ValueError:
    raise errors.InputError(f"--num_devices={','.join(flags.FLAGS.num_devices)} must be whole "
                            "numbers") from None
  if not counts or min(counts) < 1:
    raise errors.InputError("--num_devices needs at least one count of 1 or more")
  jax.config.update("jax_num_cpu_devices", max(counts))
  results = []
  for model in flags.FLAGS.models:
    for n in counts:
      case = Case.for_model(model, n)
      print(f"compiling {case.label} ...", file=sys.stderr, flush=True)
      results.append(measure(case, flags.FLAGS.step))
  paths = write(results, pathlib.Path(flags.FLAGS.output_dir))
  print(markdown(results))
  print("\nWrote " + ", ".join(map(str, paths.values())))


COMMAND = console.Command("wus-memory", report_memory, __doc__, __name__, _define_flags)
main, run = COMMAND.main, COMMAND.run  # absl's main; the console script's entry point.


if __name__ == "__main__":
  run()
