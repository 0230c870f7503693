r"""`wus-scale`: the cost model at the paper's scale, beside the paper's published results.

Feeds `wus.analysis.costmodel` the settings of Xu et al. 2020 (arXiv:2004.13336),
Table 1: ResNet-50 with LARS and the Transformer ("big", as MLPerf 0.6 ran it)
with Adam, each on 32 TPU v3 cores (16 chips) and on 2048 cores (1024 chips),
one replica per core. For each it predicts the step time without and with
weight-update sharding, and prints the predicted change beside what the paper
published (§6.1, Fig. 11): Transformer 46.5 ms -> 25.6 ms on 1024 chips;
ResNet-50 about 6% faster on 1024 chips; Transformer about 9% on 16 chips;
with the relative error of each prediction, whatever it is.

Nothing is fitted to the figures the predictions are compared with. The
hardware figures come from published specifications, cited in the output;
what no source gives is an assumption, named as one, and varied in a
sensitivity table. The rest of the step (forward, backward, input) is the
one term the model cannot know:
  * Transformer, 1024 chips: the paper's published baseline, 46.5 ms, minus
    the model's own all-reduce, update and bfloat16 copy of the weights
    (§4.2, Fig. 7 left) of that baseline;
  * Transformer, 16 chips: that rest per example per core, times the 16
    examples per core of Table 1 (the paper gives no baseline there);
  * ResNet-50: the Flax ImageNet example's published TPU v3-8 wall time per
    step (128 examples per core), minus the model's all-reduce, update and
    bfloat16 copy of that run, per example, times the examples per core of
    Table 1.

Hardware: `tpu_v3`; models and optimizers: `paper_model`; --model_parallel=M:
`scale_tp` (the Transformer on a data x M model mesh: state per device, change).

Example:
  wus-scale
  wus-scale --alpha_us=0.5 --output=/tmp/scale.json
  wus-scale --model_parallel=2
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

from absl import flags

from wus.analysis import costmodel, network, sizing
from wus.harness import console, errors
from wus.harness.tools import paper_model, report, scale_tp, tpu_v3

MS = 1e3
MIB = 2 ** 20

# The sources cited in the output: the hardware's, the models', and the runs'.
CITATIONS = {
    **tpu_v3.CITATIONS,
    **paper_model.CITATIONS,
    "flax-imagenet": "Flax ImageNet example, github.com/google/flax examples/imagenet: "
                     "README.md (ResNet-50 on TPU v3-8: 125,100 steps, 4.4 h wall time) and "
                     "configs/tpu.py (batch_size 1024, 100 epochs, half_precision, SGD "
                     "momentum 0.9).",
}
Settings = tpu_v3.Settings
ASSUMPTIONS = tpu_v3.ASSUMPTIONS


@dataclasses.dataclass(frozen=True)
class Case:
  """One setting of the paper's Table 1, with what §6.1 published about it.

  Attributes:
    model: a key of MODELS.
    optimizer: a key of `paper_model.OPTIMIZERS`.
    cores: replicas, one per core.
    batch_size: global batch.
    chips: (x, y) array of chips.
    torus: whether the chip array wraps around.
    published_reduction: the step-time reduction §6.1 states, or None.
    published_ms: (baseline, sharded) step times §6.1 states, or None.
    published_text: what the paper says, quoted or paraphrased.
  """

  model: str
  optimizer: str
  cores: int
  batch_size: int
  chips: tuple[int, int]
  torus: bool
  published_reduction: float | None
  published_ms: tuple[float, float] | None
  published_text: str

  @property
  def per_core(self) -> int:
    return self.batch_size // self.cores

  @property
  def label(self) -> str:
    return f"{self.model} + {self.optimizer}, {self.cores} cores"


CASES = (
    Case("resnet50", "lars", 32, 4096, (4, 4), False, None, None,
         "small impact for models with small weights (no figure in the text)"),
    Case("resnet50", "lars", 2048, 32768, (tpu_v3.POD_SIDE,) * 2, True, 0.06, None,
         "'it is giving a 6% speedup'"),
    Case("transformer", "adam", 32, 512, (4, 4), False, 0.09, None,
         "'improvements in the range of 9%'"),
    Case("transformer", "adam", 2048, 2048, (tpu_v3.POD_SIDE,) * 2, True, (46.5 - 25.6) / 46.5,
         (46.5, 25.6), "'the step time reduces from 46.5ms to 25.6ms'"),
)

# The runs the rest of the step is derived from (see the module docstring).
FLAX_V3_8_SECONDS_PER_STEP = 4.4 * 3600 / 125100   # flax-imagenet
FLAX_V3_8_PER_CORE = 1024 // 8
TRANSFORMER_BASELINE_MS = 46.5                     # paper, §6.1
TRANSFORMER_BASELINE_CASE = CASES[3]               # the setting of that baseline


def workload(model: str, optimizer: str, settings: Settings,
             model_parallel: int = 1) -> costmodel.Workload:
  """The model's tensors (one model rank's blocks) and optimizer: float32 gradients and
  state, the weights read in bfloat16 by the forward pass (§4.2, Fig. 7) and gathered in
  `settings.gather_bytes`."""
  tensors = paper_model.MODELS[model](**({"model_parallel": model_parallel}
                                          if model_parallel > 1 else {}))
  return _workload(tensors, optimizer, settings)


def _workload(tensors, optimizer: str, settings: Settings) -> costmodel.Workload:
  w = paper_model.workload(tensors, optimizer, grad_bytes=4,
                           gather_bytes=settings.gather_bytes, state_bytes=4)
  return dataclasses.replace(w, cast=tuple((n, *settings.cast) for n in tensors))


def _replicated(w: costmodel.Workload, topology: network.Topology,
                rest: float = 0.0) -> costmodel.StepPrediction:
  bucket = sizing.choose_bucket_bytes(w, topology)
  return costmodel.predict_replicated(w, topology, rest, bucket)


def rest_per_example(model: str, settings: Settings) -> tuple[float, str]:
  """Seconds of the rest of the step per example per core, and where it comes from.

  Raises:
    ValueError: the model predicts more than the published step time for the
      all-reduce and update alone (no rest left): its figures are wrong.
  """
  if model == "transformer":
    case = TRANSFORMER_BASELINE_CASE
    topology = tpu_v3.topology(*case.chips, torus=case.torus, settings=settings)
    own = _replicated(workload(model, case.optimizer, settings), topology)
    rest = _positive(TRANSFORMER_BASELINE_MS / MS - own.total, model)
    return rest / case.per_core, (
        f"paper's baseline {TRANSFORMER_BASELINE_MS} ms at 1 example/core minus the "
        f"predicted all-reduce ({own.communication * MS:.2f} ms), update "
        f"({own.update * MS:.2f} ms) and bfloat16 copy ({own.cast * MS:.2f} ms)")
  # The Flax run: SGD momentum, float32 weights read in bfloat16 (half_precision).
  flax = _workload(paper_model.resnet50_tensors(), "momentum", settings)
  own = _replicated(flax, tpu_v3.topology(2, 2, torus=False, settings=settings))
  rest = _positive(FLAX_V3_8_SECONDS_PER_STEP - own.total, model)
  return rest / FLAX_V3_8_PER_CORE, (
      f"Flax ResNet-50 on v3-8: {FLAX_V3_8_SECONDS_PER_STEP * MS:.1f} ms/step at "
      f"{FLAX_V3_8_PER_CORE} examples/core minus the predicted all-reduce "
      f"({own.communication * MS:.2f} ms), momentum update ({own.update * MS:.2f} ms) and "
      f"bfloat16 copy ({own.cast * MS:.2f} ms)")


def _positive(rest: float, model: str) -> float:
  if rest <= 0:
    raise ValueError(f"{model}: the predicted all-reduce and update exceed the published "
                     "step time they are subtracted from; check the hardware figures")
  return rest


def _prediction_dict(p: costmodel.StepPrediction) -> dict:
  return {"group_size": p.group_size, "bucket_bytes": p.bucket_bytes,
          "step_ms": p.total * MS, "rest_ms": p.rest * MS,
          "reduce_scatter_ms": p.reduce_scatter * MS, "all_reduce_ms": p.all_reduce * MS,
          "norm_all_reduce_ms": p.norm_all_reduce * MS, "update_ms": p.update * MS,
          "all_gather_ms": p.all_gather * MS, "cast_ms": p.cast * MS,
          "collectives": dict(p.collectives),
          "wire_bytes": p.wire_bytes}


def predict_case(case: Case, settings: Settings = Settings()) -> dict:
  """The predictions for one case, its published result, and the relative errors.

  Returns:
    JSON-ready: the case's fields; "params"; "rest_ms" and "rest_source";
    "replicated" and "sharded" (`_prediction_dict`, all predicted);
    "predicted_reduction" (1 - sharded / replicated); "relative_error"
    (of the reduction, against the published one, or None); for the
    1024-chip Transformer also "relative_error_sharded_ms" (of the sharded
    step time against 25.6 ms).
  """
  w = workload(case.model, case.optimizer, settings)
  topology = tpu_v3.topology(*case.chips, torus=case.torus, settings=settings)
  per_example, source = rest_per_example(case.model, settings)
  rest = per_example * case.per_core
  replicated = _replicated(w, topology, rest)
  if settings.group_size:
    bucket = sizing.choose_bucket_bytes(w, topology, settings.group_size)
    sharded = costmodel.predict_sharded(w, topology, settings.group_size, rest, bucket)
  else:
    sharded = sizing.best_sharded(w, topology, rest)
  reduction = 1 - sharded.total / replicated.total
  out = {**dataclasses.asdict(case), "per_core": case.per_core, "label": case.label,
         "params": w.num_elements, "tensors": len(w.gradients),
         "rest_ms": rest * MS,
         "rest_source": f"{per_example * MS:.4f} ms/example x {case.per_core}: {source}",
         "replicated": _prediction_dict(replicated), "sharded": _prediction_dict(sharded),
         "predicted_reduction": reduction, "relative_error": None}
  if case.published_reduction is not None:
    out["relative_error"] = reduction / case.published_reduction - 1
  if case.published_ms is not None:
    out["relative_error_sharded_ms"] = sharded.total * MS / case.published_ms[1] - 1
  return out


def sensitivity(settings: Settings = Settings()) -> list[dict]:
  """The predicted change of each case under each variant of the assumptions."""
  rows = []
  for name, changes in tpu_v3.SENSITIVITY:
    row = {"variant": name, "cases": []}
    for case in CASES:
      s = dataclasses.replace(settings, **{
          k: (case.cores if f is None else f(settings)) for k, f in changes.items()})
      r = predict_case(case, s)
      row["cases"].append({"label": case.label, "predicted_reduction": r["predicted_reduction"],
                           "group_size": r["sharded"]["group_size"],
                           "relative_error": r["relative_error"]})
    rows.append(row)
  return rows


def _pct(x: float | None) -> str:
  return "-" if x is None else f"{100 * x:+.1f}%"


def _value(v) -> str:
  if isinstance(v, float) and v >= 1e6:
    return f"{v / 1e9:g} GB/s"
  return f"{v:g}" if isinstance(v, float) else str(v)


def headline(out: dict) -> str:
  """One line: the 1024-chip Transformer's predicted and published change, and the TPU v3
  figures the prediction uses."""
  r = next(r for r in out["rows"] if r["model"] == "transformer" and r["cores"] == 2048)
  hw = out["hardware"]
  return (f"1024-chip Transformer, PREDICTED {r['replicated']['step_ms']:.2f} -> "
          f"{r['sharded']['step_ms']:.2f} ms ({_pct(-r['predicted_reduction'])}, G="
          f"{r['sharded']['group_size']}) against the published 46.5 -> 25.6 ms "
          f"({_pct(-r['published_reduction'])}): relative error {_pct(r['relative_error'])}. "
          f"TPU v3 figures: HBM {_value(hw['hbm_bytes_per_second_per_core']['value'])} per "
          f"core (900 GBps per chip), ICI "
          f"{hw['ici_port_bytes_per_second_per_direction']['value'] / 1e9:.0f} GB/s per port "
          "per direction (340 TB/s all-reduce bandwidth per pod), 2 cores per chip, a 32 x 32 "
          f"torus, 8 x 128 tiles; assumed: alpha {hw['alpha_seconds']['value'] * 1e6:g} us, "
          f"core-to-core {_value(hw['core_to_core_bytes_per_second']['value'])}; bfloat16 copy "
          f"{hw['bfloat16_copy_bytes_per_weight']['value']}.")


def _main_row(r: dict) -> list:
  """A case's row of the main table: its predicted times and change beside the published."""
  rep, sh = r["replicated"], r["sharded"]
  if r["published_ms"]:
    baseline, sharded = r["published_ms"]
    published = f"{baseline} -> {sharded} ms ({_pct(-r['published_reduction'])})"
  elif r["published_reduction"] is not None:
    published = f"about {_pct(-r['published_reduction'])}"
  else:
    published = "small (no figure)"
  error = _pct(r["relative_error"])
  if "relative_error_sharded_ms" in r:
    error += f"; sharded ms {_pct(r['relative_error_sharded_ms'])}"
  sharded_comm = sh["step_ms"] - sh["rest_ms"] - sh["update_ms"] - sh["cast_ms"]
  return [r["model"], r["optimizer"], f"{r['cores']} ({r['cores'] // 2})",
          r["per_core"], f"{r['params'] / 1e6:.1f}", f"{rep['rest_ms']:.2f}",
          f"{rep['step_ms']:.2f} = {rep['all_reduce_ms']:.2f} + {rep['update_ms']:.2f}"
          f" + {rep['cast_ms']:.2f}",
          f"{sh['step_ms']:.2f} = {sharded_comm:.2f} + {sh['update_ms']:.3f}"
          f" + {sh['cast_ms']:.3f}",
          sh["group_size"], _pct(-r["predicted_reduction"]), published, error]


def _plan_rows(rows: list[dict]) -> list[list]:
  """The 2048-replica rows' collectives and times, replicated and sharded."""
  plan = []
  for r in (r for r in rows if r["cores"] == 2048):
    for mode in ("replicated", "sharded"):
      p = r[mode]
      c = p["collectives"]
      plan.append([r["model"], mode, p["group_size"], p["bucket_bytes"] / MIB,
                   c["reduce-scatter"], c["all-reduce"], c["all-gather"],
                   p["reduce_scatter_ms"], p["all_reduce_ms"] + p["norm_all_reduce_ms"],
                   p["all_gather_ms"], p["update_ms"], p["wire_bytes"] / MIB])
  return plan


def markdown(out: dict) -> str:
  """`results` as text: predictions beside the paper, the 2048-replica plan, hardware,
  assumptions, sensitivity, sources."""
  rows, sens = out["rows"], out["sensitivity"]
  sens_rows = [[s["variant"], *(f"{_pct(-c['predicted_reduction'])} (G={c['group_size']})"
                                for c in s["cases"])] for s in sens]
  parts = [
      headline(out),
      "PREDICTED by the alpha-beta cost model (wus.analysis.costmodel), beside the paper's "
      "published results (Xu et al. 2020, §6.1, Fig. 11). Times in ms per step: the rest "
      "of the step (derived, see below), the predicted replicated step = rest + all-reduce "
      "+ update + the bfloat16 copy of the weights (Fig. 7 left: every replica converts "
      "them whole), the predicted sharded step = rest + collectives + update + the "
      "bfloat16 copy (Fig. 7 right: the update writes its shard in bfloat16); G the sharding "
      "group size the model chose; change = sharded / replicated - 1; relative error = "
      "predicted change / published change - 1. No parameter is fitted to the published "
      "results.",
      report.table(["model", "optimizer", "cores (chips)", "examples/core", "params M",
                    "rest ms", "replicated ms = AR + update + bf16",
                    "sharded ms = comm + update + bf16",
                    "G", "predicted change", "published (§6.1)", "relative error"],
                   [_main_row(r) for r in rows]),
      *([scale_tp.markdown(out["model_parallel"])] if out.get("model_parallel") else []),
      "Other statements of the paper, beside the PREDICTED figure:\n" + "\n".join(
          f"  {c['section']} '{c['claim']}': predicted {c['predicted']}" for c in out["checks"]),
      "Rest of the step:\n" + "\n".join(f"  {r['model']}, {r['cores']} cores: "
                                        f"{r['rest_source']}" for r in rows),
      "At 2048 replicas, PREDICTED: the group size G and bucket limit chosen, and the "
      "collectives per step (one per bucket; a multi-phase collective counts once; the "
      "sharded all-reduces are those across groups, plus one of the LARS norms).",
      report.table(["model", "mode", "G", "bucket MiB", "reduce-scatters", "all-reduces",
                    "all-gathers", "RS ms", "AR ms", "AG ms", "update ms",
                    "wire MiB/device"], _plan_rows(rows)),
      "Hardware (TPU v3):\n" + "\n".join(f"  {k}: {_value(v['value'])} [{v['source']}]"
                                         for k, v in out["hardware"].items()),
      "Assumptions:\n" + "\n".join(f"  - {a}" for a in ASSUMPTIONS),
      "Sensitivity of the PREDICTED change to the assumptions (the rest of the step "
      "re-derived under each):",
      report.table(["variant", *(c.label for c in CASES)], sens_rows),
      "Sources:\n" + "\n".join(f"  [{k}] {v}" for k, v in CITATIONS.items()),
  ]
  return "\n\n".join(parts)


def checks(settings: Settings = Settings()) -> list[dict]:
  """Other statements of the paper the model can be held against (no error is computed:
  they are bounds or comparisons, not figures)."""
  out = []
  case = TRANSFORMER_BASELINE_CASE
  rep = predict_case(case, settings)["replicated"]
  out.append({"claim": "Transformer on 1024 chips spends more than 40% of the step in the "
                       "weight update", "section": "§2.2",
              "predicted": f"{rep['update_ms'] / rep['step_ms']:.1%} of the replicated step "
                           f"({rep['update_ms']:.2f} of {rep['step_ms']:.2f} ms; "
                           f"{(rep['update_ms'] + rep['cast_ms']) / rep['step_ms']:.1%} with "
                           "the bfloat16 copy of the new weights)"})
  for case in (c for c in CASES if c.cores == 2048):
    by_g = {g: predict_case(case, dataclasses.replace(settings, group_size=g))["sharded"]
            for g in (64, case.cores)}
    out.append({"claim": f"{case.model}: sharding 2048 ways saves nothing observable over 64 "
                         "ways", "section": "§5.2",
                "predicted": f"G=64 {by_g[64]['step_ms']:.2f} ms, G=2048 "
                             f"{by_g[case.cores]['step_ms']:.2f} ms"})
  return out


def model_parallel_rows(model_parallel: int, settings: Settings = Settings()) -> list[dict]:
  """The Transformer cases on a (cores / M) data x M model mesh (`scale_tp.predict`)."""
  rows = []
  for case in (c for c in CASES if c.model == "transformer"):
    per_example, _ = rest_per_example(case.model, settings)
    rows.append(scale_tp.predict(case, model_parallel, per_example * case.per_core,
                                 workload(case.model, case.optimizer, settings, model_parallel),
                                 settings))
  return rows


def results(settings: Settings = Settings(), model_parallel: int = 1) -> dict:
  """Everything `wus-scale` prints, JSON-ready; with `model_parallel` > 1 also
  "model_parallel", the data x model predictions."""
  out = {"label": "predictions of wus.analysis.costmodel, not measurements",
         "rows": [predict_case(c, settings) for c in CASES],
         "checks": checks(settings),
         "sensitivity": sensitivity(settings), "hardware": tpu_v3.hardware(settings),
         "assumptions": ASSUMPTIONS, "citations": CITATIONS}
  if model_parallel > 1:
    out["model_parallel"] = model_parallel_rows(model_parallel, settings)
  return out


def _define_flags() -> None:
  if "alpha_us" in flags.FLAGS:  # already defined (tests call main in-process)
    return
  flags.DEFINE_float("alpha_us", tpu_v3.ALPHA * 1e6, "Latency of one ring step, microseconds "
                     "(an assumption: no published TPU v3 figure).", lower_bound=0)
  flags.DEFINE_integer("group_size", 0, "Sharding group size G; 0: the cost model chooses.",
                       lower_bound=0)
  if "model_parallel" not in flags.FLAGS:
    flags.DEFINE_integer("model_parallel", 1, "M > 1: also predict the Transformer on a "
                         "(cores / M) data x M model mesh, split Megatron-style over M "
                         "consecutive cores: optimizer state per device and the step-time "
                         "change of wus against TP with state replicated over data.",
                         lower_bound=1)
  if "output" not in flags.FLAGS:
    flags.DEFINE_string("output", None, "If set, a JSON file for the predictions, the "
                        "published results, the sources and the assumptions.")


def predict_all() -> None:
  """`wus-scale` on the parsed flags: the predictions printed (and written, --output).

  Raises:
    errors.InputError: a --group_size that does not divide every case's cores (or
      their data axes, with --model_parallel); a --model_parallel that does not
      split the Transformer or the cores.
  """
  f = flags.FLAGS
  settings = Settings(alpha=f.alpha_us * 1e-6, group_size=f.group_size)
  m = f.model_parallel
  if settings.group_size and any(c.cores // m % settings.group_size for c in CASES):
    raise errors.InputError(f"--group_size={settings.group_size} must divide "
                            f"{sorted({c.cores // m for c in CASES})}")
  if m > 1 and (why := scale_tp.check(CASES, m)):
    raise errors.InputError(why)
  out = results(settings, m)
  print(markdown(out))
  if f.output:
    pathlib.Path(f.output).write_text(json.dumps(out, indent=2))
    print(f"\nWrote {f.output}")


COMMAND = console.Command("wus-scale", predict_all, __doc__, __name__, _define_flags)
main, run = COMMAND.main, COMMAND.run  # absl's main; the console script's entry point.


if __name__ == "__main__":
  run()
