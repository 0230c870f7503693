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
    the model's own all-reduce and update of that baseline;
  * Transformer, 16 chips: that rest per example per core, times the 16
    examples per core of Table 1 (the paper gives no baseline there);
  * ResNet-50: the Flax ImageNet example's published TPU v3-8 wall time per
    step (128 examples per core), minus the model's all-reduce and update of
    that run, per example, times the examples per core of Table 1.

Example:
  wus-scale
  wus-scale --alpha_us=0.5 --output=/tmp/scale.json
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

from absl import flags

from wus.analysis import costmodel, network
from wus.harness import console, errors
from wus.harness.tools import paper_model, report

MS = 1e3
MIB = 2 ** 20

# --- Sources ---------------------------------------------------------------------

CITATIONS = {
    "paper": "Xu, Lee, Chen, Choi, Hechtman, Wang, 'Automatic Cross-Replica Sharding of "
             "Weight Update in Data-Parallel Training', arXiv:2004.13336 (2020): Table 1 "
             "(models, optimizers, batch sizes, core counts), §6 (16 and 1024 TPU v3 chips "
             "in a 2D mesh, 2 cores per chip, one replica per core), §6.1 and Fig. 11 "
             "(results), §4.2 and Fig. 7 (weights all-gathered in bfloat16), §5 "
             "(multi-phase, partial sharding, batching).",
    "cloud-tpu-v3": "Google Cloud, 'TPU v3', cloud.google.com/tpu/docs/v3: two TensorCores "
                    "per chip; HBM2 32 GiB, 900 GBps per chip; TPU Pod of 1024 chips; "
                    "interconnect topology 2D torus; bisection bandwidth per Pod 6.4 TB/s.",
    "cloud-tpu-v5e": "Google Cloud, 'TPU v5e', cloud.google.com/tpu/docs/v5e: 4 ICI ports "
                     "and 400 GBps bidirectional ICI bandwidth per chip, 2D torus of 16 x 16 "
                     "chips, bisection bandwidth 1.6 TB/s per Pod (= 32 links x 50 GB/s one "
                     "way): the convention used to read v3's bisection figure.",
    "perf-guide": "Google Cloud, 'Cloud TPU performance guide', "
                  "cloud.google.com/tpu/docs/performance-guide (the paper's ref [7]): XLA "
                  "pads tensors into 8 x 128 tiles.",
    "thakur2005": "Thakur, Rabenseifner, Gropp, 'Optimization of Collective Communication "
                  "Operations in MPICH', IJHPCA 19(1) 2005 (the paper's ref [22]): ring "
                  "reduce-scatter, all-gather, all-reduce.",
    "resnet50": "torchvision, resnet50 (pytorch.org/vision/stable/models/generated/"
                "torchvision.models.resnet50.html): num_params 25,557,032 (ResNet v1.5, "
                "the MLPerf variant; 161 tensors, rebuilt here from He et al. 2016 Table 1).",
    "mlperf-transformer": "MLPerf training reference (github.com/mlcommons/training), "
                          "translation/tensorflow/transformer/model: model_params.py "
                          "TransformerBigParams (hidden 1024, filter 4096, 16 heads, 6 "
                          "layers, vocab_size 33945); attention_layer.py (q, k, v, output "
                          "without bias); ffn_layer.py (with bias); transformer.py (layer "
                          "norm scale and bias, input embedding shared with the softmax).",
    "vaswani2017": "Vaswani et al., 'Attention Is All You Need', NIPS 2017, Table 3: "
                   "Transformer (big) 213 x 10^6 parameters (with a 37,000-token vocabulary).",
    "flax-imagenet": "Flax ImageNet example, github.com/google/flax examples/imagenet: "
                     "README.md (ResNet-50 on TPU v3-8: 125,100 steps, 4.4 h wall time) and "
                     "configs/tpu.py (batch_size 1024, 100 epochs, half_precision, SGD "
                     "momentum 0.9).",
}

# --- Hardware (TPU v3) -----------------------------------------------------------

CORES_PER_CHIP = 2                     # cloud-tpu-v3
HBM_PER_CHIP = 900e9                   # bytes/s, cloud-tpu-v3
POD_SIDE = 32                          # 1024 chips in a 2D torus: 32 x 32, cloud-tpu-v3
BISECTION_PER_POD = 6.4e12             # bytes/s, cloud-tpu-v3
# Halving a 32 x 32 torus cuts 32 rows, each twice (its wraparound link too);
# bisection bandwidth counts one direction (cloud-tpu-v5e: 1.6 TB/s over 32 links
# = 50 GB/s, its 400 GBps bidirectional per chip over 4 ports and 2 directions).
LINK_BANDWIDTH = BISECTION_PER_POD / (2 * POD_SIDE)   # bytes/s per link per direction
TILE_ELEMENTS = 8 * 128                # perf-guide
ALPHA = 1e-6                           # seconds per ring step: ASSUMED, see ASSUMPTIONS

ASSUMPTIONS = [
    "alpha, the latency of one ring step, is 1 us on every axis: no published TPU v3 "
    "figure was found (secondary sources say sub-microsecond between neighbouring chips); "
    "the sensitivity table varies it 10x each way.",
    "The two TensorCores of a chip exchange data at one core's HBM bandwidth (450 GB/s): "
    "the on-chip path is not published. Varied in the sensitivity table (at one ICI link "
    "instead).",
    "Rings along a torus axis use both directions of both links of a chip (two "
    "counter-rotating rings), shared by its 2 cores: 2 x 100 / 2 = 100 GB/s per core. The "
    "16-chip slice is a 4 x 4 mesh without wraparound (the paper, §6: '2D mesh'): a ring "
    "uses each link one way, 100 / 2 = 50 GB/s per core.",
    "Gradients are reduced in float32 and the weights and optimizer state are float32; "
    "with sharding the weights are all-gathered in bfloat16 (§4.2, Fig. 7), and the update "
    "writes the bfloat16 copy the forward pass reads (2 bytes per weight, with or without "
    "sharding).",
    "Nothing overlaps: step = rest + collectives + update.",
    "The rest of the step scales linearly with the examples per core. This ignores that "
    "few examples per core run less efficiently (it underestimates the rest when scaling "
    "down, as for ResNet-50 at 16 per core, and overestimates it when scaling up, as for "
    "the Transformer at 16 per core).",
    "ResNet-50's rest comes from another implementation (Flax, SGD momentum, bfloat16) than "
    "MLPerf's, and its wall time includes evaluation and compilation: an upper bound on its "
    "rest per example. The README's TPU v3-32 row is not used: its pod command sets a batch "
    "of 32 x 256 = 8192, while its 125,100 steps imply 1024 (100 epochs).",
]


@dataclasses.dataclass(frozen=True)
class Settings:
  """The model's inputs that are assumptions; the defaults are the main prediction.

  Attributes:
    alpha: seconds per ring step, every axis.
    core_bandwidth: bytes/s per core between the two cores of a chip.
    gather_bytes: bytes per element of the all-gathered weights.
    tile_elements: elements per tile of the memory layout (1: no padding).
    group_size: G; 0: `costmodel.choose_group_size` picks it.
  """

  alpha: float = ALPHA
  core_bandwidth: float = HBM_PER_CHIP / CORES_PER_CHIP
  gather_bytes: int = 2
  tile_elements: int = TILE_ELEMENTS
  group_size: int = 0


def tpu_v3_topology(chips_x: int, chips_y: int, *, torus: bool,
                    settings: Settings = Settings()) -> network.Topology:
  """TPU v3 cores as a costmodel topology: axes core (2), x, y; fast to slow.

  Args:
    chips_x, chips_y: the 2D array of chips.
    torus: whether the axes wrap around (the full pod) or not (a mesh slice).
    settings: alpha, the core-to-core bandwidth, the tile.
  """
  per_chip = LINK_BANDWIDTH * (2 if torus else 1)  # one ring step's send rate per chip
  per_core = per_chip / CORES_PER_CHIP
  return network.Topology(
      (network.Axis("core", CORES_PER_CHIP, settings.alpha, settings.core_bandwidth),
       network.Axis("x", chips_x, settings.alpha, per_core),
       network.Axis("y", chips_y, settings.alpha, per_core)),
      memory_bandwidth=HBM_PER_CHIP / CORES_PER_CHIP, tile_elements=settings.tile_elements)


# --- Models ------------------------------------------------------------------------


def resnet50_tensors() -> tuple[int, ...]:
  """Elements of ResNet-50's 161 weight tensors (v1.5; no conv biases; BN scale and bias).

  25,557,032 in all (torchvision's num_params).
  """
  out = [7 * 7 * 3 * 64, 64, 64]
  cin = 64
  for width, blocks in zip((64, 128, 256, 512), (3, 4, 6, 3), strict=True):
    for b in range(blocks):
      out += [cin * width, width, width, 9 * width * width, width, width,
              width * 4 * width, 4 * width, 4 * width]
      if b == 0:  # projection shortcut
        out += [cin * 4 * width, 4 * width, 4 * width]
      cin = 4 * width
  return tuple(out + [2048 * 1000, 1000])


def transformer_big_tensors(vocab: int = 33945, hidden: int = 1024, filter_size: int = 4096,
                            layers: int = 6) -> tuple[int, ...]:
  """Elements of the MLPerf reference Transformer big's 185 weight tensors.

  Shared input/output embedding; attention projections without bias; the
  feed-forward network with biases; a layer norm (scale, bias) before each
  sublayer and after each stack. 211,047,424 in all with MLPerf's 33,945-token
  vocabulary (Vaswani et al. report 213 M with 37,000 tokens).
  """
  norm = [hidden, hidden]
  attention = [hidden * hidden] * 4
  ffn = [hidden * filter_size, filter_size, filter_size * hidden, hidden]
  encoder = (norm + attention + norm + ffn) * layers + norm
  decoder = (norm + attention + norm + attention + norm + ffn) * layers + norm
  return tuple([vocab * hidden] + encoder + decoder)


MODELS = {"resnet50": resnet50_tensors, "transformer": transformer_big_tensors}


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
    Case("resnet50", "lars", 2048, 32768, (POD_SIDE, POD_SIDE), True, 0.06, None,
         "'it is giving a 6% speedup'"),
    Case("transformer", "adam", 32, 512, (4, 4), False, 0.09, None,
         "'improvements in the range of 9%'"),
    Case("transformer", "adam", 2048, 2048, (POD_SIDE, POD_SIDE), True, (46.5 - 25.6) / 46.5,
         (46.5, 25.6), "'the step time reduces from 46.5ms to 25.6ms'"),
)

# The runs the rest of the step is derived from (see the module docstring).
FLAX_V3_8_SECONDS_PER_STEP = 4.4 * 3600 / 125100   # flax-imagenet
FLAX_V3_8_PER_CORE = 1024 // 8
TRANSFORMER_BASELINE_MS = 46.5                     # paper, §6.1
TRANSFORMER_BASELINE_CASE = CASES[3]               # the setting of that baseline


def workload(model: str, optimizer: str, settings: Settings) -> costmodel.Workload:
  """The model's tensors and optimizer, float32 state, bfloat16 copy and gather."""
  return paper_model.workload(MODELS[model](), optimizer, grad_bytes=4,
                              gather_bytes=settings.gather_bytes, state_bytes=4, copy_bytes=2)


def _replicated(w: costmodel.Workload, topology: network.Topology,
                rest: float = 0.0) -> costmodel.StepPrediction:
  bucket = costmodel.choose_bucket_bytes(w, topology)
  return costmodel.predict_replicated(w, topology, rest, bucket)


def rest_per_example(model: str, settings: Settings) -> tuple[float, str]:
  """Seconds of the rest of the step per example per core, and where it comes from.

  Raises:
    ValueError: the model predicts more than the published step time for the
      all-reduce and update alone (no rest left): its figures are wrong.
  """
  if model == "transformer":
    case = TRANSFORMER_BASELINE_CASE
    topology = tpu_v3_topology(*case.chips, torus=case.torus, settings=settings)
    own = _replicated(workload(model, case.optimizer, settings), topology)
    rest = _positive(TRANSFORMER_BASELINE_MS / MS - own.communication - own.update, model)
    return rest / case.per_core, (
        f"paper's baseline {TRANSFORMER_BASELINE_MS} ms at 1 example/core minus the "
        f"predicted all-reduce ({own.communication * MS:.2f} ms) and update "
        f"({own.update * MS:.2f} ms)")
  # The Flax run: SGD momentum, float32 weights cast in the forward pass (no copy).
  flax = paper_model.workload(resnet50_tensors(), "momentum")
  own = _replicated(flax, tpu_v3_topology(2, 2, torus=False, settings=settings))
  rest = _positive(FLAX_V3_8_SECONDS_PER_STEP - own.communication - own.update, model)
  return rest / FLAX_V3_8_PER_CORE, (
      f"Flax ResNet-50 on v3-8: {FLAX_V3_8_SECONDS_PER_STEP * MS:.1f} ms/step at "
      f"{FLAX_V3_8_PER_CORE} examples/core minus the predicted all-reduce "
      f"({own.communication * MS:.2f} ms) and momentum update ({own.update * MS:.2f} ms)")


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
          "all_gather_ms": p.all_gather * MS, "collectives": dict(p.collectives),
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
  topology = tpu_v3_topology(*case.chips, torus=case.torus, settings=settings)
  per_example, source = rest_per_example(case.model, settings)
  rest = per_example * case.per_core
  replicated = _replicated(w, topology, rest)
  if settings.group_size:
    bucket = costmodel.choose_bucket_bytes(w, topology, settings.group_size)
    sharded = costmodel.predict_sharded(w, topology, settings.group_size, rest, bucket)
  else:
    sharded = costmodel.best_sharded(w, topology, rest)
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


# Variants of the assumptions: (name, changes to the settings); "group_size": None
# stands for G = N of each case.
SENSITIVITY = (
    ("as above", {}),
    ("alpha / 10", {"alpha": lambda s: s.alpha / 10}),
    ("alpha x 10", {"alpha": lambda s: s.alpha * 10}),
    ("core-to-core at one ICI link (100 GB/s)", {"core_bandwidth": lambda s: LINK_BANDWIDTH}),
    ("all-gather in float32 (no Fig. 7)", {"gather_bytes": lambda s: 4}),
    ("no tile padding", {"tile_elements": lambda s: 1}),
    ("full sharding, G = N", {"group_size": None}),
)


def sensitivity(settings: Settings = Settings()) -> list[dict]:
  """The predicted change of each case under each variant of the assumptions."""
  rows = []
  for name, changes in SENSITIVITY:
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


def hardware(settings: Settings = Settings()) -> dict:
  """The TPU v3 figures used, with their sources."""
  return {
      "cores_per_chip": {"value": CORES_PER_CHIP, "source": "cloud-tpu-v3"},
      "hbm_bytes_per_second_per_core": {
          "value": HBM_PER_CHIP / CORES_PER_CHIP,
          "source": "cloud-tpu-v3: 900 GBps per chip / 2 cores"},
      "ici_link_bytes_per_second_per_direction": {
          "value": LINK_BANDWIDTH,
          "source": "cloud-tpu-v3: bisection 6.4 TB/s / (32 rows x 2 links cut in a 32 x 32 "
                    "torus); convention from cloud-tpu-v5e"},
      "topology": {"value": "2D torus of 32 x 32 chips (1024 chips); 16 chips: 4 x 4 mesh",
                   "source": "cloud-tpu-v3; paper §6"},
      "tile_elements": {"value": TILE_ELEMENTS, "source": "perf-guide: 8 x 128 tiles"},
      "alpha_seconds": {"value": settings.alpha, "source": "ASSUMED (see assumptions)"},
  }


def _pct(x: float | None) -> str:
  return "-" if x is None else f"{100 * x:+.1f}%"


def _value(v) -> str:
  if isinstance(v, float) and v >= 1e6:
    return f"{v / 1e9:g} GB/s"
  return f"{v:g}" if isinstance(v, float) else str(v)


def markdown(out: dict) -> str:
  """`results` as text: predictions beside the paper, the 2048-replica plan, hardware,
  assumptions, sensitivity, sources."""
  rows, sens = out["rows"], out["sensitivity"]
  main = []
  for r in rows:
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
    sharded_comm = sh["step_ms"] - sh["rest_ms"] - sh["update_ms"]
    main.append([r["model"], r["optimizer"], f"{r['cores']} ({r['cores'] // 2})",
                 r["per_core"], f"{r['params'] / 1e6:.1f}", f"{rep['rest_ms']:.2f}",
                 f"{rep['step_ms']:.2f} = {rep['all_reduce_ms']:.2f} + {rep['update_ms']:.2f}",
                 f"{sh['step_ms']:.2f} = {sharded_comm:.2f} + {sh['update_ms']:.3f}",
                 sh["group_size"], _pct(-r["predicted_reduction"]), published, error])
  plan = []
  for r in (r for r in rows if r["cores"] == 2048):
    for mode in ("replicated", "sharded"):
      p = r[mode]
      c = p["collectives"]
      plan.append([r["model"], mode, p["group_size"], p["bucket_bytes"] / MIB,
                   c["reduce-scatter"], c["all-reduce"], c["all-gather"],
                   p["reduce_scatter_ms"], p["all_reduce_ms"] + p["norm_all_reduce_ms"],
                   p["all_gather_ms"], p["update_ms"], p["wire_bytes"] / MIB])
  sens_rows = [[s["variant"], *(f"{_pct(-c['predicted_reduction'])} (G={c['group_size']})"
                                for c in s["cases"])] for s in sens]
  parts = [
      "PREDICTED by the alpha-beta cost model (wus.analysis.costmodel), beside the paper's "
      "published results (Xu et al. 2020, §6.1, Fig. 11). Times in ms per step: the rest "
      "of the step (derived, see below), the predicted replicated step = rest + all-reduce "
      "+ update, the predicted sharded step = rest + collectives + update; G the sharding "
      "group size the model chose; change = sharded / replicated - 1; relative error = "
      "predicted change / published change - 1. No parameter is fitted to the published "
      "results.",
      report.table(["model", "optimizer", "cores (chips)", "examples/core", "params M",
                    "rest ms", "replicated ms = AR + update", "sharded ms = comm + update",
                    "G", "predicted change", "published (§6.1)", "relative error"], main),
      "Other statements of the paper, beside the PREDICTED figure:\n" + "\n".join(
          f"  {c['section']} '{c['claim']}': predicted {c['predicted']}" for c in out["checks"]),
      "Rest of the step:\n" + "\n".join(f"  {r['model']}, {r['cores']} cores: "
                                        f"{r['rest_source']}" for r in rows),
      "At 2048 replicas, PREDICTED: the group size G and bucket limit chosen, and the "
      "collectives per step (one per bucket; a multi-phase collective counts once; the "
      "sharded all-reduces are those across groups, plus one of the LARS norms).",
      report.table(["model", "mode", "G", "bucket MiB", "reduce-scatters", "all-reduces",
                    "all-gathers", "RS ms", "AR ms", "AG ms", "update ms",
                    "wire MiB/device"], plan),
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
                           f"({rep['update_ms']:.2f} of {rep['step_ms']:.2f} ms)"})
  for case in (c for c in CASES if c.cores == 2048):
    by_g = {g: predict_case(case, dataclasses.replace(settings, group_size=g))["sharded"]
            for g in (64, case.cores)}
    out.append({"claim": f"{case.model}: sharding 2048 ways saves nothing observable over 64 "
                         "ways", "section": "§5.2",
                "predicted": f"G=64 {by_g[64]['step_ms']:.2f} ms, G=2048 "
                             f"{by_g[case.cores]['step_ms']:.2f} ms"})
  return out


def results(settings: Settings = Settings()) -> dict:
  """Everything `wus-scale` prints, JSON-ready."""
  return {"label": "predictions of wus.analysis.costmodel, not measurements",
          "rows": [predict_case(c, settings) for c in CASES],
          "checks": checks(settings),
          "sensitivity": sensitivity(settings), "hardware": hardware(settings),
          "assumptions": ASSUMPTIONS, "citations": CITATIONS}


def _define_flags() -> None:
  if "alpha_us" in flags.FLAGS:  # already defined (tests call main in-process)
    return
  flags.DEFINE_float("alpha_us", ALPHA * 1e6, "Latency of one ring step, microseconds "
                     "(an assumption: no published TPU v3 figure).", lower_bound=0)
  flags.DEFINE_integer("group_size", 0, "Sharding group size G; 0: the cost model chooses.",
                       lower_bound=0)
  if "output" not in flags.FLAGS:
    flags.DEFINE_string("output", None, "If set, a JSON file for the predictions, the "
                        "published results, the sources and the assumptions.")


def predict_all() -> None:
  """`wus-scale` on the parsed flags: the predictions printed (and written, --output).

  Raises:
    errors.InputError: a --group_size that does not divide every case's cores.
  """
  f = flags.FLAGS
  settings = Settings(alpha=f.alpha_us * 1e-6, group_size=f.group_size)
  if settings.group_size and any(c.cores % settings.group_size for c in CASES):
    raise errors.InputError(f"--group_size={settings.group_size} must divide "
                            f"{sorted({c.cores for c in CASES})}")
  out = results(settings)
  print(markdown(out))
  if f.output:
    pathlib.Path(f.output).write_text(json.dumps(out, indent=2))
    print(f"\nWrote {f.output}")


COMMAND = console.Command("wus-scale", predict_all, __doc__, __name__, _define_flags)
main, run = COMMAND.main, COMMAND.run  # absl's main; the console script's entry point.


if __name__ == "__main__":
  run()
