r"""`wus-bench`: wus beside the alternatives a JAX user has, measured in one run.

Variants, all on the same model, optimizer (Adam), data and N simulated
devices, with the state donated:

  replicated   `jax.jit(jax.shard_map(step))` of `steps.make_train_step`: every
               replica updates every weight (`steps.map_train_step`).
  gspmd_zero1  `jax.jit` of the global step with the optimizer state given a
               `NamedSharding` over the data axis (`zero.gspmd_step`).
  handwritten  `jax.shard_map` ZeRO with `psum_scatter` / `all_gather` by hand
               (`zero.handwritten_step`): what a careful person achieves, one
               collective per tensor each way.
  handwritten_flat  the same with one flat buffer (`zero.flat_step`): every
               gradient concatenated, one reduce-scatter, one all-gather, the
               weights sliced out of it.
  wus          `wus.shard_map(step)` with its defaults, as a user runs it (the
               cost model's figures for the platform, `network.default_topology`;
               `--topology=measured` tells it this machine's, `calibrate.measure`).
               Its batching of collectives is also run alone beside two others
               (`choices`), each predicted and measured.
  wus_undonated  the same without donating the state.
  wus_gG       `wus.shard_map(step, shard_group_size=G)`: partial sharding within
               groups of G devices (§5.2), in the partial-sharding regime.

What a `jax.jit` user has (weight-update-bound regime), on the step written on
global arrays (`steps.make_train_step(..., "jit")`), the batch placed on
P("data"):

  jit          `jax.jit(step)`: the state replicated, GSPMD all-reduces the
               gradients.
  gspmd_zero1  (above) the ZeRO-1 such a user writes by hand.
  wus_jit      `wus.jit(step)`: the same step, one changed line.

Regimes:

  weight-update-bound  large weights, a small per-replica batch.
  many-small-tensors   the same on a Transformer-like model of 100 tensors of
                       mixed sizes (`--small_tensors_model`), where batching
                       small tensors' collectives matters (§5.2).
  compute-bound        the same model, a large per-replica batch.
  partial-sharding     the weight-update-bound setting with replicated and wus_gG
                       for each G of --group_sizes (§5.2, Fig. 10).
  bf16-loop            k updates per call in a `lax.fori_loop`, the forward and
                       backward pass reading the weights in bfloat16 (Fig. 4
                       right, Fig. 7); replicated and wus only: the alternatives
                       have no loop form here.
  muon                 Muon on a Transformer-like model and on an imbalanced one:
                       replicated, a hand-written owner-computes Muon and wus
                       (ownership; `harness/tools/bench/muon.py`, its own models).
  tensor-parallel      --tp_model split Megatron-style over a "model" axis of
                       --model_parallel devices, on a (N / M) x M mesh: the TP step
                       with its state replicated over data, the GSPMD ZeRO-1
                       MaxText users write, and wus
                       (`harness/tools/bench/tensor_parallel.py`).

The variants of a regime run interleaved, so that they share the machine's
noise: a new random order every round, each timed update after an untimed
one of the same program (`timing`: a fixed order of neighbours biased the
ratios by up to 1.25x). In the
regimes with one update per call, the parts of a sharded step are timed
alone in the same rounds (`limit`: the forward and backward pass, one
reduce-scatter and one all-gather of every byte into reused buffers, the
update of a 1/N shard); the sum of their medians is the limit wus is
compared with, beside the data movement (copies, concatenates, slices) of
its compiled step; the same parts composed by hand in one program, whole
and by pairs (`compose`), say what running them together costs. On simulated
CPU devices a collective is a memory copy on the same two cores, not a
network transfer; the "wire" bytes are what each device would send by ring
algorithms, read from the compiled HLO, and nothing here derives an ideal time
from them.

Example:
  wus-bench                       # all regimes
  wus-bench --regimes=weight-update-bound --regimes=many-small-tensors --rounds=20
  wus-bench --regimes=tensor-parallel --rounds=2   # checks that it runs
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import platform
import sys

import jax
from absl import flags

from wus.harness import console, errors
from wus.harness.models import tasks
from wus.harness.tools.bench import calibrate, muon, tensor_parallel
from wus.harness.tools.bench.regimes import run_regime
from wus.harness.tools.bench.summary import markdown, predict, prediction_markdown
from wus.harness.tools.bench.variants import Regime
from wus.harness.training import steps


def _define_flags() -> None:
  flags.DEFINE_string("model", "mlp_deep", "Model (tasks.MODELS; not the ResNets, whose "
                      "batch norm needs the mesh axis the GSPMD variant has not). Adam, "
                      "synthetic data.")
  flags.DEFINE_string("small_tensors_model", "transformer_mixed", "Model of the "
                      "many-small-tensors regime (as --model).")
  flags.DEFINE_enum("topology", "default", ["default", "measured"], "What the wus variants' "
                    "cost model is told about the devices: nothing (default: what a user "
                    "gets, `network.default_topology` for the platform), or this machine, "
                    "measured before the regimes run (calibrate.measure).")
  flags.DEFINE_integer("update_bound_batch", 1, "Examples per replica per update, "
                       "weight-update-bound regime.", lower_bound=1)
  flags.DEFINE_integer("compute_bound_batch", 32, "Examples per replica per update, "
                       "compute-bound regime.", lower_bound=1)
  flags.DEFINE_integer("steps_per_call", 4, "Updates per call in the bf16-loop regime.",
                       lower_bound=2)
  regimes = ["weight-update-bound", "many-small-tensors", "compute-bound", "partial-sharding",
             "bf16-loop"]
  flags.DEFINE_multi_enum("regimes", regimes, regimes + ["muon", "tensor-parallel"],
                          "Regimes to run (muon and tensor-parallel: only when named).")
  flags.DEFINE_string("tp_model", "transformer_wide", "Transformer of the tensor-parallel "
                      "regime (its heads and MLP width divisible by --model_parallel).")
  flags.DEFINE_integer("model_parallel", 2, "Devices of the 'model' axis in the "
                       "tensor-parallel regime (M; the mesh is (N / M) x M).", lower_bound=2)
  flags.DEFINE_integer("rounds", 15, "Timed updates per variant and regime.", lower_bound=1)
  flags.DEFINE_multi_integer("group_sizes", [2, 4], "G of the partial-sharding variants "
                             "(shard_group_size, §5.2) in the partial-sharding regime; each "
                             "must divide --num_devices.")
  flags.DEFINE_integer("num_devices", 8, "Simulated CPU devices (N).", lower_bound=2)
  flags.DEFINE_string("output", None, "If set, a JSON file for the measurements.")


def regimes_from_flags() -> list[Regime]:
  f = flags.FLAGS
  every = {"weight-update-bound": Regime("weight-update-bound", f.update_bound_batch, jit=True),
           "many-small-tensors": Regime(
               "many-small-tensors", f.update_bound_batch, model=f.small_tensors_model,
               skip=("gspmd_zero1",) if tasks.MODELS[f.small_tensors_model][0] == tasks.TEXT
               else ()),
           "partial-sharding": Regime("partial-sharding", f.update_bound_batch,
                                      group_sizes=tuple(f.group_sizes)),
           "compute-bound": Regime("compute-bound", f.compute_bound_batch),
           "bf16-loop": Regime("bf16-loop", f.update_bound_batch, f.steps_per_call)}
  return [every[name] for name in f.regimes if name in every]


def bench() -> None:
  """`wus-bench` on the parsed flags: this machine calibrated, each regime measured, the
  tables printed (and written, --output).

  Raises:
    errors.InputError: a model the variants cannot run.
  """
  import tqdm  # pylint: disable=g-import-not-at-top

  f = flags.FLAGS
  for name, model in (("model", f.model), ("small_tensors_model", f.small_tensors_model)):
    if model not in tasks.MODELS or model.startswith("resnet"):
      raise errors.InputError(f"--{name}={model}: choose one of "
                              f"{[m for m in tasks.MODELS if not m.startswith('resnet')]}")
  if "tensor-parallel" in f.regimes and (
      why := tensor_parallel.unusable(f.tp_model, f.model_parallel, f.num_devices)):
    raise errors.InputError(f"the tensor-parallel regime: {why}")
  jax.config.update("jax_num_cpu_devices", f.num_devices)
  mesh = jax.make_mesh((f.num_devices,), (steps.AXIS_NAME,))
  regimes = regimes_from_flags()
  load = os.getloadavg()
  # This machine's costs, measured first: the wus variants' cost model plans
  # for them (--topology=measured), and the predictions are printed beside
  # the measured step times at the end.
  topology, raw = calibrate.measure(mesh, steps.AXIS_NAME)
  results = []
  with tqdm.tqdm(total=sum(f.rounds * len(r.variants) for r in regimes), unit="step",
                 file=sys.stderr) as bar:
    for regime in regimes:
      bar.set_description(regime.name)
      results.append(run_regime(regime, model=f.model, rounds=f.rounds, mesh=mesh,
                                progress=bar.update,
                                topology=topology if f.topology == "measured" else None))
  print(f"JAX {jax.__version__}, {jax.device_count()} simulated CPU devices on "
        f"{os.cpu_count()} cores ({platform.processor() or platform.machine()}); load average "
        f"{load[0]:.2f} at the start, {os.getloadavg()[0]:.2f} at the end; wus planned for the "
        f"{f.topology} topology\n")
  if results:
    print(markdown(results))
  muon_results = muon.run_regime(mesh, f.rounds) if "muon" in f.regimes else []
  if muon_results:
    print("\n" + muon.markdown(muon_results))
  tp_result = None
  if "tensor-parallel" in f.regimes:
    tp_result = tensor_parallel.run(mesh, rounds=f.rounds, model=f.tp_model,
                                    model_parallel=f.model_parallel,
                                    topology=topology if f.topology == "measured" else None)
    print("\n" + tensor_parallel.markdown(tp_result))
  if results:
    print("\n" + prediction_markdown(results, topology, raw))
  for r in results:
    p = predict(r, topology)
    if p:
      r["predicted"] = {v: dataclasses.asdict(x) for v, x in p.items()}
  calibration = {"topology": dataclasses.asdict(topology), "measured": raw}
  if f.output:
    pathlib.Path(f.output).write_text(json.dumps({"regimes": results, "calibration": calibration,
                                                  "muon": muon_results,
                                                  "tensor_parallel": tp_result}, indent=2))
    print(f"\nWrote {f.output}")


COMMAND = console.Command("wus-bench", bench, __doc__, __name__, _define_flags)
main, run = COMMAND.main, COMMAND.run  # absl's main; the console script's entry point.


if __name__ == "__main__":
  run()
