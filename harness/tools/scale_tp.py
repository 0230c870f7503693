r"""`wus-scale --model_parallel=M`: the paper's Transformer on a data x model mesh, predicted.

The cores of a case form a (cores / M) data x M model mesh, the model axis the
faster (M consecutive cores: for M = 2 the two cores of a chip). Each model rank
holds its blocks of the Transformer split Megatron-style
(`paper_model.transformer_big_tensors`); its gradients are reduced over its data
group, the cores M apart (`network.Topology.strided`: on the torus the group's
rings run along x and y, and an axis cut by the model blocks keeps a ring of
k-apart cores sharing the links). Two steps are priced on that group, with the
same rest of the step (the forward and backward pass per core of the 1-D case:
each core computes 1/M of its data replica's examples; the model axis's own
collectives in the forward and backward pass are not priced, the same in both):

  * tensor parallelism with the optimizer state replicated over data: an
    all-reduce of each rank's gradient blocks, the update of whole blocks;
  * wus: reduce-scatter over the data group (groups of G, §5.2), the update on
    1/G of each block, the all-gather of the new blocks over the data group.

Printed: the optimizer state per device (bytes, and the fraction of one whole
copy) and the step-time change. Predictions of the cost model, not measurements.
"""

from __future__ import annotations

from wus.analysis import costmodel, network, sizing
from wus.harness.tools import paper_model, report, tpu_v3

MS = 1e3
MIB = 2 ** 20


def data_group(chips: tuple[int, int], torus: bool, cores: int, model_parallel: int,
               settings: tpu_v3.Settings) -> network.Topology:
  """The devices of one model rank's data group: `cores / M` cores, M apart."""
  topology = tpu_v3.topology(*chips, torus=torus, settings=settings)
  return topology.strided(model_parallel, cores // model_parallel)


def state_bytes(tensors, optimizer: str, group_size: int = 1, tile: int = 1) -> int:
  """Bytes of optimizer state per device for weight blocks of `tensors` elements, each
  sharded in `group_size` tile-padded shards (`costmodel.shard_elements`), float32."""
  per_element = 4 * len(paper_model.OPTIMIZERS[optimizer].state)
  return sum(costmodel.shard_elements(n, group_size, tile) * per_element for n in tensors)


def predict(case, model_parallel: int, rest: float, workload: costmodel.Workload,
            settings: tpu_v3.Settings) -> dict:
  """The TP and wus steps of `case` (a `scale.Case`) on a data x model mesh, JSON-ready.

  Args:
    case: the paper's setting (cores, chips, optimizer).
    model_parallel: M, dividing the cores.
    rest: seconds of the rest of the step per core.
    workload: one model rank's blocks (`scale.workload(..., model_parallel=M)`).
    settings: the hardware assumptions; its group_size, if set, is G.
  """
  m, data = model_parallel, case.cores // model_parallel
  group = data_group(case.chips, case.torus, case.cores, m, settings)
  bucket = sizing.choose_bucket_bytes(workload, group)
  tp = costmodel.predict_replicated(workload, group, rest, bucket)
  g = settings.group_size
  wus = (costmodel.predict_sharded(workload, group, g, rest,
                                   sizing.choose_bucket_bytes(workload, group, g))
         if g else sizing.best_sharded(workload, group, rest))
  blocks = [n for n, _ in workload.gradients]
  whole = state_bytes(paper_model.transformer_big_tensors(), case.optimizer)
  tile = group.tile_elements

  def state(g: int) -> dict:
    b = state_bytes(blocks, case.optimizer, g, tile if g > 1 else 1)
    return {"group_size": g, "bytes": b, "fraction_of_a_copy": b / whole}
  return {"label": case.label, "cores": case.cores, "data": data, "model": m,
          "data_ring": " x ".join(f"{a.name}={a.size}" for a in group.axes),
          "rest_ms": rest * MS, "whole_state_bytes": whole,
          "tp": {"step_ms": tp.total * MS, "all_reduce_ms": tp.communication * MS,
                 "update_ms": tp.update * MS, "cast_ms": tp.cast * MS, "state": state(1)},
          "wus": {"step_ms": wus.total * MS, "communication_ms": wus.communication * MS,
                  "update_ms": wus.update * MS, "cast_ms": wus.cast * MS,
                  "group_size": wus.group_size, "state": state(wus.group_size),
                  "state_full_sharding": state(data)},
          "predicted_change": wus.total / tp.total - 1}


def markdown(rows: list[dict]) -> str:
  """The data x model predictions as a titled table."""
  table = []
  for r in rows:
    tp, wus = r["tp"], r["wus"]
    table.append([
        r["label"], f"{r['data']} x {r['model']}", r["data_ring"],
        f"{tp['state']['bytes'] / MIB:.1f} ({tp['state']['fraction_of_a_copy']:.3f})",
        f"{wus['state']['bytes'] / MIB:.2f} ({wus['state']['fraction_of_a_copy']:.4f})",
        f"{wus['state_full_sharding']['bytes'] / MIB:.3f} "
        f"({wus['state_full_sharding']['fraction_of_a_copy']:.5f})",
        f"{tp['step_ms']:.2f} = {r['rest_ms']:.2f} + {tp['all_reduce_ms']:.2f} + "
        f"{tp['update_ms']:.2f} + {tp['cast_ms']:.2f}",
        f"{wus['step_ms']:.2f} = {r['rest_ms']:.2f} + {wus['communication_ms']:.2f} + "
        f"{wus['update_ms']:.3f} + {wus['cast_ms']:.3f}",
        wus["group_size"], f"{100 * r['predicted_change']:+.1f}%"])
  return "\n\n".join([
      "Data x model, PREDICTED (--model_parallel): the Transformer split Megatron-style "
      "over M consecutive cores, each rank's gradients reduced over its data group (the "
      "cores M apart). Optimizer state per device in MiB (fraction of one whole copy): "
      "TP with state replicated over data, wus with the G chosen, wus with G = N_data. "
      "Steps in ms = rest + collectives over data + update + bfloat16 copy; the model "
      "axis's collectives in the forward and backward pass are not priced (the same in "
      "both). change = wus / TP - 1.",
      report.table(["case", "data x model", "data ring", "TP state MiB", "wus state MiB",
                    "G = N_data state MiB", "TP ms", "wus ms", "G", "predicted change"],
                   table)])


def check(cases, model_parallel: int) -> str | None:
  """Why `model_parallel` cannot split these cases (None: it can)."""
  m = model_parallel
  try:
    paper_model.transformer_big_tensors(model_parallel=m)
  except ValueError as e:
    return f"--model_parallel={m}: {e}"
  bad = [c.cores for c in cases if c.cores % m]
  if bad:
    return f"--model_parallel={m} must divide the cores {sorted(set(bad))}"
  for c in cases:
    try:
      data_group(c.chips, c.torus, c.cores, m, tpu_v3.Settings())
    except ValueError as e:
      return f"--model_parallel={m} on {c.label}: {e}"
  return None
