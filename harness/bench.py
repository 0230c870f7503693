r"""`wus-bench`: wus beside the alternatives a JAX user has, measured in one run.

Variants, all on the same model, optimizer (Adam), data and N simulated
devices, with the state donated:

  replicated   `jax.jit(jax.shard_map(step))` of `steps.make_train_step`: every
               replica updates every weight (`steps.map_train_step`).
  gspmd_zero1  `jax.jit` of the global step with the optimizer state given a
               `NamedSharding` over the data axis (`zero.gspmd_step`).
  handwritten  `jax.shard_map` ZeRO with `psum_scatter` / `all_gather` by hand
               (`zero.handwritten_step`): what a careful person achieves.
  wus          `wus.shard_map(step)`.
  wus_gG       `wus.shard_map(step, shard_group_size=G)`: partial sharding within
               groups of G devices (§5.2), in the partial-sharding regime.

Regimes:

  weight-update-bound  large weights, a small per-replica batch.
  compute-bound        the same model, a large per-replica batch.
  partial-sharding     the weight-update-bound setting with replicated and wus_gG
                       for each G of --group_sizes (§5.2, Fig. 10).
  bf16-loop            k updates per call in a `lax.fori_loop`, the forward and
                       backward pass reading the weights in bfloat16 (Fig. 4
                       right, Fig. 7); replicated and wus only: the alternatives
                       have no loop form here.
  muon                 Muon on a Transformer-like model and on an imbalanced one:
                       replicated, a hand-written owner-computes Muon and wus
                       (ownership; `harness/muon_bench.py`, its own models).

The variants of a regime run interleaved, one update each in turn (the order
rotating every round), so that they share the machine's noise. On simulated
CPU devices a collective is a memory copy on the same two cores, not a
network transfer; the "wire" bytes are what each device would send by ring
algorithms, read from the compiled HLO, and nothing here derives an ideal time
from them.

Example:
  wus-bench                       # all regimes, about 5 minutes on 2 cores
  wus-bench --regimes=weight-update-bound --rounds=30
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import flags
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from wus.analysis import costmodel
from wus.harness import (batches, calibrate, config as config_lib, console, datasets, muon_bench,
                         optim, report, steps, tasks, zero)

VARIANTS = ("replicated", "gspmd_zero1", "handwritten", "wus")
ALTERNATIVES = VARIANTS[:3]
MIB = 2 ** 20

# Targets of issue 5, checked on the measurements of one run.
TIME_RATIO = 1.0         # wus / each alternative, median step time, weight-update-bound
STATE_TOLERANCE = 0.01   # |opt state per device / (V/N) - 1|
BF16_WIRE_RATIO = 0.76   # wus / replicated collective bytes, bf16 weight gather
ANALYSIS_FRACTION = 0.1  # (analysis + rewrite) / XLA compile time of the wus step


@dataclasses.dataclass(frozen=True)
class Regime:
  """One benchmark setting.

  Attributes:
    name: as printed.
    batch_size: examples per replica per update.
    steps_per_call: updates per call of the step, in a `lax.fori_loop`; more
      than 1 also reads the weights in bfloat16 in the forward pass.
    group_sizes: G of the partial-sharding variants `wus_gG` (§5.2); with
      them the regime compares replicated and those only (memory: every
      variant holds its own copy of the state).
  """

  name: str
  batch_size: int
  steps_per_call: int = 1
  group_sizes: tuple[int, ...] = ()

  @property
  def variants(self) -> tuple[str, ...]:
    if self.steps_per_call > 1:
      return ("replicated", "wus")
    if self.group_sizes:  # wus (G = N) is in the weight-update-bound regime.
      return ("replicated",) + tuple(f"wus_g{g}" for g in self.group_sizes)
    return VARIANTS


def group_size(variant: str) -> int | None:
  """G of a `wus_gG` variant, None for the others."""
  return int(variant[len("wus_g"):]) if variant.startswith("wus_g") else None


def make_loop_step(task: tasks.Task, tx, steps_per_call: int, compute_dtype=jnp.bfloat16):
  """The per-replica step running `steps_per_call` updates in a `lax.fori_loop`.

  Its batch holds `steps_per_call` batches of this replica, one after the
  other along the leading dim; each update reads the weights in
  `compute_dtype` for the forward and backward pass (mixed precision).
  Metrics are those of the last update.
  """
  def step(params, model_state, opt_state, batch):
    split = jax.tree.map(lambda x: x.reshape(steps_per_call, -1, *x.shape[1:]), batch)

    def update(i, carry):
      params, model_state, opt_state, _ = carry
      grads, model_state, metrics = steps.gradients(
          task, params, model_state, jax.tree.map(lambda x: x[i], split), compute_dtype)
      updates, opt_state = tx.update(grads, opt_state, params)
      return (optax.apply_updates(params, updates), model_state, opt_state,
              lax.pmean(metrics, steps.AXIS_NAME))

    metrics = {"loss": jnp.zeros(()), "accuracy": jnp.zeros(())}
    return lax.fori_loop(0, steps_per_call, update, (params, model_state, opt_state, metrics))

  return step


def _copy(tree):
  """A copy of every array of `tree` (each variant donates its own state)."""
  return jax.tree.map(lambda x: jax.device_put(x, x.sharding, may_alias=False), tree)


def _variant_steps(regime: Regime, task: tasks.Task, tx, mesh: Mesh, state: steps.TrainState):
  """{variant: (step, its initial state)}: each step takes (*state, batch), donating state."""
  if regime.steps_per_call > 1:
    train_step = make_loop_step(task, tx, regime.steps_per_call)
  else:
    train_step = steps.make_train_step(task, tx)
  out = {}
  for name in regime.variants:
    fresh = _copy(state)
    if name in steps.MODES or group_size(name):
      out[name] = steps.map_train_step("wus" if group_size(name) else name, train_step, mesh,
                                       group_size(name)), fresh
    else:
      make = zero.gspmd_step if name == "gspmd_zero1" else zero.handwritten_step
      step, place = make(task, tx, mesh, fresh.opt_state)
      out[name] = step, fresh._replace(opt_state=place(fresh.opt_state))
  return out


def run_regime(regime: Regime, *, model: str, rounds: int, mesh: Mesh, seed: int = 0,
               progress=None) -> dict:
  """Measures every variant of `regime` on `model` (Adam), interleaved.

  Args:
    regime: the setting.
    model: a key of `tasks.MODELS` without collectives in its model (the MLPs,
      the Transformers; see `zero`).
    rounds: timed updates per variant, after two warm-up calls.
    mesh: a 1-D mesh with the axis `steps.AXIS_NAME`.
    seed: of the initialization and the synthetic data.
    progress: called with no arguments after each timed call, or None.

  Returns:
    JSON-ready: "regime", "model", "num_devices", "batch_size",
    "steps_per_call", "opt_state_bytes" (V, whole) and per variant:
    "step_seconds" (each timed call, divided by steps_per_call), "median",
    "min", "max" (seconds per update), "memory" (`report.memory` of the
    compiled step, bytes per device), "collectives" (kind -> count, bytes,
    wire_bytes), "wire_bytes" (sum over kinds), "opt_state_per_device"
    (bytes device 0 holds), "lower_seconds", "compile_seconds",
    "wire_bytes" (bytes a device sends per update: `report.collectives`
    per run of the program, divided by steps_per_call), "loop_wire_bytes"
    (the same for the collectives inside the loop only: per update of a
    training loop, without what is gathered once per call after it),
    "max_param_difference" (max |params - replicated params| after the run);
    wus also "analysis_seconds" and "rewrite_seconds". With one update per
    call also "rest_seconds": each timed forward and backward pass alone
    (`steps.make_gradient_step`), and "tensor_elements" (of every weight).
  """
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
  variants = _variant_steps(regime, task, tx, mesh, state)
  out = {"regime": regime.name, "model": model, "num_devices": mesh.size,
         "variants": list(variants),
         "batch_size": regime.batch_size, "steps_per_call": regime.steps_per_call,
         "opt_state_bytes": sum(x.nbytes for x in jax.tree.leaves(state.opt_state)),
         "tensor_elements": [int(x.size) for x in jax.tree.leaves(params)],
         "rest_seconds": []}
  # The forward and backward pass alone (no all-reduce, no update), timed with
  # the variants: the cost model's "rest" of a one-update step.
  rest = steps.make_gradient_step(task, mesh) if regime.steps_per_call == 1 else None
  states = {}
  for name, (step, fresh) in variants.items():
    start = time.perf_counter()
    lowered = step.lower(*fresh, data[0])
    middle = time.perf_counter()
    compiled = lowered.compile()
    hlo = compiled.as_text()
    collectives = report.collectives(hlo, per_run=True)
    in_loop = report.collectives(hlo, per_run=True, only=report.in_loops(hlo))
    out[name] = {"lower_seconds": middle - start, "compile_seconds": time.perf_counter() - middle,
                 "memory": report.memory(compiled),
                 "collectives": {k: c._asdict() for k, c in collectives.items()},
                 "wire_bytes": sum(c.wire_bytes for c in collectives.values())
                               / regime.steps_per_call,
                 "loop_wire_bytes": sum(c.wire_bytes for c in in_loop.values())
                                    / regime.steps_per_call,
                 "step_seconds": []}
    if name == "wus" or group_size(name):
      timings = step.timings(*fresh, data[0])
      out[name]["analysis_seconds"] = timings["analysis"]
      out[name]["rewrite_seconds"] = timings["rewrite"]
      out[name]["bucket_bytes"] = step.plan(*fresh, data[0]).bucket_bytes
    for batch in data[:2]:  # Warm up: compile, and (wus) shard the state.
      fresh = steps.TrainState(*jax.block_until_ready(step(*fresh, batch))[:3])
    states[name] = fresh
  if rest:
    jax.block_until_ready(rest(state.params, state.model_state, data[0]))
  for r in range(rounds):
    order = list(variants)[r % len(variants):] + list(variants)[:r % len(variants)]
    if rest:
      start = time.perf_counter()
      jax.block_until_ready(rest(state.params, state.model_state, data[2 + r]))
      out["rest_seconds"].append(time.perf_counter() - start)
    for name in order:
      start = time.perf_counter()
      result = jax.block_until_ready(variants[name][0](*states[name], data[2 + r]))
      out[name]["step_seconds"].append((time.perf_counter() - start) / regime.steps_per_call)
      states[name] = steps.TrainState(*result[:3])
      if progress:
        progress()
  reference = jax.tree.map(np.asarray, states["replicated"].params)
  for name in variants:
    seconds = out[name]["step_seconds"]
    out[name].update(median=statistics.median(seconds), min=min(seconds), max=max(seconds))
    out[name]["opt_state_per_device"] = report.bytes_per_device(states[name].opt_state)
    out[name]["max_param_difference"] = max(
        float(np.max(np.abs(np.asarray(a, np.float64) - b)))
        for a, b in zip(jax.tree.leaves(states[name].params), jax.tree.leaves(reference),
                        strict=True))
  return out


def predict(result: dict, topology: costmodel.Topology) -> dict | None:
  """The cost model's step times for a regime's replicated and wus steps (seconds per update).

  Fed this machine's measured costs (`calibrate.measure`) and the measured
  median of the forward and backward pass alone as "rest"; nothing is fitted
  to the step times it is compared with. Adam, sharded N ways (G = N), the
  collectives batched in the wus step's buckets (`Plan.bucket_bytes`).

  Returns:
    {"replicated": StepPrediction, "wus": StepPrediction}, or None for a
    regime with several updates per call (no "rest" measured).
  """
  if not result.get("rest_seconds") or "wus" not in result:
    return None
  workload = costmodel.Workload(tuple(result["tensor_elements"]), costmodel.OPTIMIZERS["adam"])
  rest = statistics.median(result["rest_seconds"])
  limit = result["wus"]["bucket_bytes"]
  return {"replicated": costmodel.predict_replicated(workload, topology, rest, limit),
          "wus": costmodel.predict_sharded(workload, topology, result["num_devices"], rest, limit)}


def prediction_markdown(results: list[dict], topology: costmodel.Topology, raw: dict) -> str:
  """Predicted beside measured, per regime with one update per call."""
  axis = topology.axes[0]
  (d0, t0), (d1, t1) = raw["all_reduce"]
  rows = []
  for r in results:
    p = predict(r, topology)
    if p is None:
      continue
    for v in ("replicated", "wus"):
      rows.append([r["regime"], v, 1e3 * r[v]["median"], 1e3 * p[v].total, 1e3 * p[v].rest,
                   1e3 * p[v].communication, 1e3 * p[v].update,
                   p[v].total / p["replicated"].total if v == "wus" else "-",
                   r[v]["median"] / r["replicated"]["median"] if v == "wus" else "-"])
  return "\n\n".join([
      "### Cost model: predicted beside measured",
      f"This machine, measured just before: all-reduce over {axis.size} devices of "
      f"{d0} B in {1e3 * t0:.3f} ms and {d1} B in {1e3 * t1:.3f} ms, i.e. alpha "
      f"{1e6 * axis.alpha:.1f} us per ring step and {axis.bandwidth / 1e9:.2f} GB/s per "
      f"device; memory {topology.memory_bandwidth / 1e9:.2f} GB/s per device (all devices "
      "busy). \"rest\" is the measured forward and backward pass alone; the model adds "
      "collectives and the update to it (`wus.analysis.costmodel`, nothing fitted to "
      "the step times).",
      report.table(["regime", "variant", "measured ms", "predicted ms", "rest ms",
                    "collectives ms (pred.)", "update ms (pred.)", "wus/replicated predicted",
                    "wus/replicated measured"], rows)])


def targets(results: list[dict]) -> list[tuple[str, bool | None, str]]:
  """The targets of issue 5 on measured results: (target, met or None if not measured, detail)."""
  rows = []
  for r in results:
    name = r["regime"]
    for v in r.get("variants", ()):
      if (g := group_size(v)) is None:
        continue
      share = r[v]["opt_state_per_device"] * g / r["opt_state_bytes"]
      rows.append((f"{name}: {v} optimizer state per device within {STATE_TOLERANCE:.0%} of V/G",
                   abs(share - 1) <= STATE_TOLERANCE, f"{share:.4f} x V/{g}"))
      wire = r[v]["wire_bytes"] / r["replicated"]["wire_bytes"]
      rows.append((f"{name}: {v} collective bytes <= replicated all-reduce's (§5.2)", wire <= 1,
                   f"ratio {wire:.4f}"))
    if "wus" not in r:
      continue
    ws = r["wus"]
    if name == "weight-update-bound":
      for alt in (a for a in ALTERNATIVES if a in r):
        ratio = ws["median"] / r[alt]["median"]
        rows.append((f"{name}: wus median step time <= {alt}'s", ratio <= TIME_RATIO,
                     f"ratio {ratio:.3f}"))
    share = ws["opt_state_per_device"] * r["num_devices"] / r["opt_state_bytes"]
    rows.append((f"{name}: optimizer state per device within {STATE_TOLERANCE:.0%} of V/N",
                 abs(share - 1) <= STATE_TOLERANCE, f"{share:.4f} x V/N"))
    wire = ws["wire_bytes"] / r["replicated"]["wire_bytes"]
    if r["steps_per_call"] > 1:
      # Per step of the loop; what is gathered once after it is amortized over
      # the loop's steps (§4.2), and shown in the regime's table.
      wire = ws["loop_wire_bytes"] / r["replicated"]["loop_wire_bytes"]
      rows.append((f"{name}: collective bytes per step in the loop <= {BF16_WIRE_RATIO:.0%} of "
                   "replicated (bfloat16 weight all-gather)", wire <= BF16_WIRE_RATIO,
                   f"ratio {wire:.3f}"))
    else:
      rows.append((f"{name}: collective bytes <= replicated all-reduce's", wire <= 1,
                   f"ratio {wire:.4f}"))
    fraction = (ws["analysis_seconds"] + ws["rewrite_seconds"]) / ws["compile_seconds"]
    rows.append((f"{name}: wus analysis + rewrite < {ANALYSIS_FRACTION:.0%} of XLA compile time",
                 fraction < ANALYSIS_FRACTION, f"{fraction:.1%}"))
  return rows


def markdown(results: list[dict]) -> str:
  """The benchmark as Markdown: one table per regime, then the targets."""
  parts = []
  for r in results:
    names = r.get("variants") or [v for v in VARIANTS if v in r]
    alternatives = [v for v in names if v in ALTERNATIVES or v == "replicated"]
    best = min(alternatives, key=lambda v: r[v]["median"])
    rows = []
    for v in names:
      m = r[v]
      rows.append([v, 1e3 * m["median"], f"{1e3 * m['min']:.2f}-{1e3 * m['max']:.2f}",
                   m["median"] / r["replicated"]["median"],
                   m["median"] / r[best]["median"] if v == "wus" else "-",
                   m["memory"]["total"] / MIB, m["opt_state_per_device"] / MIB,
                   m["wire_bytes"] / MIB, m["compile_seconds"], m["max_param_difference"]])
    parts += [f"### {r['regime']}: {r['model']} + Adam, N={r['num_devices']}, "
              f"{r['batch_size']} examples per replica per update"
              + (f", {r['steps_per_call']} updates per call" if r["steps_per_call"] > 1 else "")
              + f"; {len(r['replicated']['step_seconds'])} timed calls per variant",
              report.table(["variant", "median ms/update", "min-max ms", "/ replicated",
                            f"/ best alternative ({best})", "memory MiB/device",
                            "opt state MiB/device", "collective wire MiB/update",
                            "XLA compile s",
                            "max |Δ params| vs replicated"], rows)]
    parts += [f"{v} analysis {r[v]['analysis_seconds']:.3f} s + rewrite "
              f"{r[v]['rewrite_seconds']:.3f} s, beside XLA's compile of the {v} step "
              f"{r[v]['compile_seconds']:.2f} s." for v in names if "analysis_seconds" in r[v]]
    if r["steps_per_call"] > 1:
      parts.append("Collective wire MiB per update inside the loop: " + ", ".join(
          f"{v} {r[v]['loop_wire_bytes'] / MIB:.3f}" for v in names) + " (the table's column "
          "adds what is gathered once per call after the loop, spread over its updates).")
  parts += ["### Targets", report.table(
      ["target", "", "measured"],
      [[t, {True: "met", False: "NOT MET", None: "-"}[ok], d] for t, ok, d in targets(results)])]
  return "\n\n".join(parts)


def _define_flags() -> None:
  flags.DEFINE_string("model", "mlp_large", "Model (tasks.MODELS; not the ResNets, whose "
                      "batch norm needs the mesh axis the GSPMD variant has not). Adam, "
                      "synthetic data.")
  flags.DEFINE_integer("update_bound_batch", 1, "Examples per replica per update, "
                       "weight-update-bound regime.", lower_bound=1)
  flags.DEFINE_integer("compute_bound_batch", 32, "Examples per replica per update, "
                       "compute-bound regime.", lower_bound=1)
  flags.DEFINE_integer("steps_per_call", 4, "Updates per call in the bf16-loop regime.",
                       lower_bound=2)
  regimes = ["weight-update-bound", "compute-bound", "partial-sharding", "bf16-loop"]
  flags.DEFINE_multi_enum("regimes", regimes, regimes + ["muon"], "Regimes to run (muon: "
                          "only when named).")
  flags.DEFINE_integer("rounds", 15, "Timed updates per variant and regime.", lower_bound=1)
  flags.DEFINE_multi_integer("group_sizes", [2, 4], "G of the partial-sharding variants "
                             "(shard_group_size, §5.2) in the partial-sharding regime; each "
                             "must divide --num_devices.")
  flags.DEFINE_integer("num_devices", 8, "Simulated CPU devices (N).", lower_bound=2)
  flags.DEFINE_string("output", None, "If set, a JSON file for the measurements.")


def regimes_from_flags() -> list[Regime]:
  f = flags.FLAGS
  every = {"weight-update-bound": Regime("weight-update-bound", f.update_bound_batch),
           "partial-sharding": Regime("partial-sharding", f.update_bound_batch,
                                      group_sizes=tuple(f.group_sizes)),
           "compute-bound": Regime("compute-bound", f.compute_bound_batch),
           "bf16-loop": Regime("bf16-loop", f.update_bound_batch, f.steps_per_call)}
  return [every[name] for name in f.regimes if name in every]


def main(argv) -> None:
  import tqdm  # pylint: disable=g-import-not-at-top

  if len(argv) > 1:
    sys.exit(f"wus-bench: error: unexpected arguments {argv[1:]}; flags are --name=value")
  f = flags.FLAGS
  if f.model not in tasks.MODELS or f.model.startswith("resnet"):
    sys.exit(f"wus-bench: error: --model={f.model}: choose one of "
             f"{[m for m in tasks.MODELS if not m.startswith('resnet')]}")
  jax.config.update("jax_num_cpu_devices", f.num_devices)
  mesh = jax.make_mesh((f.num_devices,), (steps.AXIS_NAME,))
  regimes = regimes_from_flags()
  results = []
  with tqdm.tqdm(total=sum(f.rounds * len(r.variants) for r in regimes), unit="step",
                 file=sys.stderr) as bar:
    for regime in regimes:
      bar.set_description(regime.name)
      results.append(run_regime(regime, model=f.model, rounds=f.rounds, mesh=mesh,
                                progress=bar.update))
  print(f"JAX {jax.__version__}, {jax.device_count()} simulated CPU devices on "
        f"{os.cpu_count()} cores ({platform.processor() or platform.machine()})\n")
  if results:
    print(markdown(results))
  muon = muon_bench.run_regime(mesh, f.rounds) if "muon" in f.regimes else []
  if muon:
    print("\n" + muon_bench.markdown(muon))
  topology, raw = calibrate.measure(mesh, steps.AXIS_NAME)
  if results:
    print("\n" + prediction_markdown(results, topology, raw))
  for r in results:
    p = predict(r, topology)
    if p:
      r["predicted"] = {v: dataclasses.asdict(x) for v, x in p.items()}
  calibration = {"topology": dataclasses.asdict(topology), "measured": raw}
  if f.output:
    pathlib.Path(f.output).write_text(json.dumps({"regimes": results, "calibration": calibration,
                                                  "muon": muon}, indent=2))
    print(f"\nWrote {f.output}")


def run() -> None:
  """Entry point of the `wus-bench` console script."""
  _define_flags()
  console.run_console(main, __doc__, __name__)


if __name__ == "__main__":
  run()
