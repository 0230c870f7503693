r"""An alpha-beta model of a data-parallel step, with and without weight-update sharding.

Pure Python, no JAX: every function takes sizes and hardware figures and
returns a time. Everything this module returns is a **prediction** from the
model, never a measurement.

Units throughout: bytes, seconds, bytes per second; tensor sizes in elements.

The pieces (section numbers are those of Xu et al. 2020, arXiv:2004.13336):

* The network (mesh axes, ring collectives, batching and its copies) is
  `network`'s; this module builds a step from its times.
* Partial sharding in groups of G consecutive devices (§5.2, Fig. 10): the
  group spans the fastest axes (an axis may be split, see `Topology.split`);
  a reduce-scatter within the group, an all-reduce of the shards across the
  groups (over the remaining, slower axes; batched on the small shards), the
  update on 1/G of each tensor, an all-gather of the new weights within the
  group. G = N is full sharding (no all-reduce across groups); G = 1 is the
  replicated baseline (no reduce-scatter or all-gather).
* The weight update is memory bound (§2.2): its time is the bytes it reads
  and writes (`Workload.updated`) divided by the device's memory bandwidth;
  sharded in groups of G it touches 1/G of every tensor.
* The forward pass's bfloat16 copy of the weights (§4.2, Fig. 7):
  `cast_seconds`.
* A tiled memory layout pads shards (§4.1, §5.2): with `tile_elements` > 1, a
  tensor of n elements is ceil(n / tile) tiles, a shard ceil(tiles / G) tiles.
  Combined all-reduces need not respect shard boundaries (§5.2), so the
  replicated all-reduce pads whole tensors only.

What the model leaves out, on purpose: overlap of collectives with the
backward pass or with each other; contention between collectives running
at once; the exact embedding of split rings in the network (see
`Topology.split` for the rule used); compute in the update (it is memory
bound); the reformatting steps of §4.1 (fused, hence free); hosts, input
pipelines.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from wus.analysis import network
from wus.analysis.network import Axis, Topology

# Bytes of one float32 scalar: the partial norms LARS and LAMB all-reduce
# when they run on shards (§4.1, Fig. 6).
_SCALAR_BYTES = 4

# A tensor as the model sees it: (elements, bytes per element).
Tensor = tuple[int, int]


@dataclasses.dataclass(frozen=True)
class Workload:
  """What an update reduces, reads and writes, and gathers: a whole step's, or one cluster's.

  Built from facts: the planner's from a cluster's tensors (`wus.analysis.cost`),
  the paper-scale harness's from a model's tensors and a named optimizer
  (`wus.harness.tools.paper_model`). Every tensor is (elements, bytes per element).

  Attributes:
    gradients: the gradients reduced (all-reduced replicated, reduce-scattered
      sharded), in the order the collectives see them.
    gathered: the tensors all-gathered after a sharded update (the new
      weights, in the dtype they are gathered in: 2 bytes for bfloat16 when
      the forward pass reads them in bfloat16, §4.2 Fig. 7).
    updated: the tensors the update reads and writes, bytes per element
      being all it moves per element (a tensor read in two passes counts
      twice; the memory bound of §2.2).
    norms: per-gradient scalars the update all-reduces when it runs on
      shards (LARS: |w|, |g|; LAMB: |w|, |u|; batched, §4.1 Fig. 6).
    cast: the new weights the forward pass reads in a narrower dtype: (elements,
      bytes read, bytes written) per element, (n, 4, 2) for float32 read as
      bfloat16 (§4.2, Fig. 7; `cast_seconds`). Empty: read as stored.
  """

  gradients: tuple[Tensor, ...]
  gathered: tuple[Tensor, ...] = ()
  updated: tuple[Tensor, ...] = ()
  norms: int = 0
  cast: tuple[tuple[int, int, int], ...] = ()

  def __post_init__(self):
    for name in ("gradients", "gathered", "updated"):
      object.__setattr__(self, name, tuple((int(n), int(b)) for n, b in getattr(self, name)))
    object.__setattr__(self, "cast", tuple((int(n), int(r), int(w)) for n, r, w in self.cast))

  @property
  def num_elements(self) -> int:
    """Elements of the gradients (of the weights they update)."""
    return sum(n for n, _ in self.gradients)


def padded_elements(n: int, tile: int) -> int:
  """Elements a tensor of `n` elements occupies in whole tiles of `tile`."""
  return -(-n // tile) * tile


def shard_elements(n: int, group_size: int, tile: int = 1) -> int:
  """Elements of one of `group_size` shards of a tensor of `n` elements.

  A shard is a whole number of tiles: ceil(ceil(n / tile) / G) tiles (§4.1:
  padding to a multiple of the shard count; §5.2: small shards padded).
  """
  return -(-(-(-n // tile)) // group_size) * tile


def _shards(tensors, group_size: int, tile: int) -> tuple[list[int], list[bool]]:
  """Each tensor's shard elements (`shard_elements`), and whether G shards pad it."""
  shards = [shard_elements(n, group_size, tile) for n, _ in tensors]
  return shards, [group_size * s != n for s, (n, _) in zip(shards, tensors, strict=True)]


def update_seconds(workload: Workload, topology: Topology, group_size: int = 1) -> float:
  """Seconds of the weight update on 1/G of every tensor: its bytes / memory bandwidth (§2.2).

  With group_size = 1 the replicated update. Each tensor's shard is padded
  to whole tiles (`shard_elements`); a tensor smaller than G shards still
  moves one element (tiny tensors stay whole).
  """
  tile = topology.tile_elements
  moved = sum(shard_elements(n, group_size, tile) * b for n, b in workload.updated)
  return network.compute_seconds(moved, topology)


def cast_seconds(workload: Workload, topology: Topology, group_size: int = 1) -> float:
  """Seconds of making the forward pass's narrow copy of the new weights (§4.2, Fig. 7).

  G = 1 (Fig. 7 left): every replica reads each whole weight wide and writes it
  narrow. Sharded (right): the update writes 1/G of it narrow, holding the wide
  value already; the all-gather sends the narrow shards (`Workload.gathered`).
  """
  tile = topology.tile_elements
  moved = (sum(padded_elements(n, tile) * (r + w) for n, r, w in workload.cast)
           if group_size == 1 else
           sum(shard_elements(n, group_size, tile) * w for n, _, w in workload.cast))
  return network.compute_seconds(moved, topology)


# --- Step predictions ----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StepPrediction:
  """A predicted step time and its terms (a prediction of the model, not a measurement).

  Attributes:
    group_size: G, the replicas that share one copy of the sharded update
      (1: replicated, N: full sharding).
    bucket_bytes: the bucket limit of the batched collectives, bytes.
    rest: seconds of everything else in the step (forward, backward, input),
      as given.
    reduce_scatter: seconds of the reduce-scatters within the groups.
    all_reduce: seconds of the gradient all-reduces (replicated) or of the
      all-reduces of the shards across groups (sharded).
    norm_all_reduce: seconds of the all-reduce of partial norms (LARS, LAMB
      on shards).
    update: seconds of the weight update.
    all_gather: seconds of the all-gathers of the new weights within the groups.
    collectives: {"reduce-scatter", "all-reduce", "all-gather"}: collectives
      per step (one per bucket; a multi-phase collective counts once).
    wire_bytes: bytes each device sends per step, by the ring algorithms.
    copies: seconds of the copies batching makes (into buckets before
      reduce-scatters, out of gathered buffers after all-gathers; padding):
      `copy_seconds` of `copied`. The replicated all-reduce copies nothing
      (XLA combines it into one instruction of many buffers). Not in
      `total`: the group size G is chosen on collectives and the update
      (`sizing.choose_group_size`), the batching for that G on collectives and
      copies (`sizing.choose_batching`); `with_copies` adds them.
    alone_bytes: the `alone_bytes` of the batched collectives (None: the
      bucket limit).
    cast: seconds of the forward pass's narrow copy of the weights
      (`cast_seconds`; 0 without `Workload.cast`).
  """

  group_size: int
  bucket_bytes: float
  rest: float
  reduce_scatter: float
  all_reduce: float
  norm_all_reduce: float
  update: float
  all_gather: float
  collectives: dict
  wire_bytes: float
  copies: float = 0.0
  alone_bytes: float | None = None
  cast: float = 0.0

  @property
  def communication(self) -> float:
    """Seconds of all collectives."""
    return self.reduce_scatter + self.all_reduce + self.norm_all_reduce + self.all_gather

  @property
  def total(self) -> float:
    """Predicted seconds per step: rest + collectives + update + cast (nothing overlaps)."""
    return self.rest + self.communication + self.update + self.cast

  @property
  def with_copies(self) -> float:
    """`total` with the copies batching makes."""
    return self.total + self.copies


def wire_bytes(nbytes: float, axes: Sequence[Axis], kind: str) -> float:
  """Bytes one device sends in one multi-phase collective of `nbytes` per device.

  Per ring phase of n devices on D bytes: (n - 1) D / n for a reduce-scatter
  (D its input) or an all-gather (D its output), twice that for an all-reduce
  (the counting of `wus.harness.report`'s wire bytes).
  """
  sent, left = 0.0, nbytes
  for a in axes:
    sent += (a.size - 1) * left / a.size
    left /= a.size
  return 2 * sent if kind == "all-reduce" else sent


def predict_replicated(workload: Workload, topology: Topology, rest: float = 0.0,
                       bucket_bytes: float = math.inf) -> StepPrediction:
  """Predicted step without weight-update sharding.

  rest + all-reduce of the gradients over every axis (`network.batched`, multi-phase)
  + the whole update on every replica (§2.2, Fig. 2) + the narrow copy of the
  whole weights (`cast_seconds`).

  Args:
    workload: gradients, gathered tensors, the update's traffic.
    topology: devices.
    rest: seconds of the rest of the step.
    bucket_bytes: bucket limit of the batched all-reduce, bytes.
  """
  tile = topology.tile_elements
  sizes = [padded_elements(n, tile) * b for n, b in workload.gradients]
  seconds, count = network.batched(network.all_reduce, sizes, topology.axes, bucket_bytes)
  return StepPrediction(
      group_size=1, bucket_bytes=bucket_bytes, rest=rest, reduce_scatter=0.0,
      all_reduce=seconds, norm_all_reduce=0.0, update=update_seconds(workload, topology),
      all_gather=0.0, collectives={"reduce-scatter": 0, "all-reduce": count, "all-gather": 0},
      wire_bytes=wire_bytes(sum(sizes), topology.axes, "all-reduce"),
      cast=cast_seconds(workload, topology))


def predict_sharded(workload: Workload, topology: Topology, group_size: int,
                    rest: float = 0.0, bucket_bytes: float = math.inf,
                    alone_bytes: float | None = None) -> StepPrediction:
  """Predicted step with the weight update sharded in groups of `group_size` (§5.2, Fig. 10).

  rest
  + reduce-scatter of the gradients within each group (batched by whole
    tensor bytes; the input holds G padded shards of each tensor)
  + all-reduce of the shards across groups (batched by shard bytes: the
    small shards combine into few collectives, Fig. 10 right)
  + the update on 1/G of every tensor
  + all-reduce of the partial norms within the group (LARS, LAMB; one
    batched collective)
  + all-gather of `workload.gathered` (the new weights) within the group
  + the narrow copy of the shards (`cast_seconds`).
  The optimizer state stays sharded between steps: it is never gathered.
  Beside them, `copies`: what batching copies (`copied`, at the memory
  bandwidth).

  G = N: full sharding, no all-reduce across groups. G = 1: equals
  `predict_replicated`.

  Args:
    workload: gradients, gathered tensors, the update's traffic.
    topology: devices; `topology.split(group_size)` gives the axes.
    group_size: G.
    rest: seconds of the rest of the step.
    bucket_bytes: bucket limit of every batched collective, bytes.
    alone_bytes: the reduce-scatters' and all-gathers' `alone_bytes` (`buckets`).

  Raises:
    ValueError: from `Topology.split`.
  """
  inner, outer = topology.split(group_size)
  tile, g = topology.tile_elements, group_size
  shards, padded = _shards(workload.gradients, g, tile)
  out_shards, out_padded = _shards(workload.gathered, g, tile)
  scatter = [g * s * b for s, (_, b) in zip(shards, workload.gradients, strict=True)]
  reduced = [s * b for s, (_, b) in zip(shards, workload.gradients, strict=True)]
  gather = [g * s * b for s, (_, b) in zip(out_shards, workload.gathered, strict=True)]
  rs, rs_count = network.batched(network.reduce_scatter, scatter, inner, bucket_bytes,
                                 alone_bytes, padded)
  ar, ar_count = network.batched(network.all_reduce, reduced, outer, bucket_bytes)
  ag, ag_count = network.batched(network.all_gather, gather, inner, bucket_bytes, alone_bytes,
                                 out_padded, closes=False)
  # The copies move the tensors' own bytes (wus pads a tensor by fewer than G
  # elements; the tiles' padding is the layout's, copied or not).
  grads = [n * b for n, b in workload.gradients]
  weights = [n * b for n, b in workload.gathered]
  copies = (network.copied(scatter, bucket_bytes, alone_bytes, padded, grads)  # G = 1: none.
            + network.copied(gather, bucket_bytes, alone_bytes, out_padded, weights,
                             closes=False)
            + (network.copied(reduced, bucket_bytes) if outer else 0.0)) if inner else 0.0
  norms = workload.norms * len(workload.gradients) * _SCALAR_BYTES
  nar, nar_count = network.batched(network.all_reduce, [norms] if norms else [], inner)
  return StepPrediction(
      group_size=g, bucket_bytes=bucket_bytes, rest=rest, reduce_scatter=rs, all_reduce=ar,
      norm_all_reduce=nar, update=update_seconds(workload, topology, g), all_gather=ag,
      collectives={"reduce-scatter": rs_count, "all-reduce": ar_count + nar_count,
                   "all-gather": ag_count},
      wire_bytes=(wire_bytes(sum(scatter), inner, "reduce-scatter")
                  + wire_bytes(sum(reduced), outer, "all-reduce")
                  + wire_bytes(norms, inner, "all-reduce")
                  + wire_bytes(sum(gather), inner, "all-gather")),
      copies=network.copy_seconds(copies, topology), alone_bytes=alone_bytes,
      cast=cast_seconds(workload, topology, g))


def cluster_seconds(workload: Workload, topology: Topology) -> tuple[float, float]:
  """(replicated, sharded) predicted seconds of one cluster's collectives and update (§3.2).

  `predict_replicated` and `predict_sharded` over all N devices of the
  topology, latency left out and each collective one bucket: the cluster's
  collectives share the step's batched buckets with the other clusters'
  (§5.2), so one more tensor adds bytes to a collective, not a collective.
  Copies into buckets are the step's (`sizing.choose_batching`), not counted here.

  Args:
    workload: the cluster's gradients, gathered tensors and update traffic.
    topology: the N devices the update is sharded over.
  """
  bandwidth = topology.without_latency()
  return (predict_replicated(workload, bandwidth).total,
          predict_sharded(workload, bandwidth, topology.num_devices).total)
