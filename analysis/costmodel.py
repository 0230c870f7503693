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
  and writes (`Optimizer.bytes_per_element` per weight element) divided by
  the device's memory bandwidth; sharded in groups of G it touches 1/G of
  every tensor.
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


# --- The weight update's memory traffic (§2.2) -----------------------------------


@dataclasses.dataclass(frozen=True)
class Optimizer:
  """The memory traffic of an optimizer's update, per weight element.

  Attributes:
    name: as printed.
    reads: the tensors read per weight element, one pass each ("w" weight,
      "g" gradient, "m", "v" moments); a tensor read twice appears twice (the
      norms of LARS and LAMB read before the update can use them).
    writes: the tensors written.
    norms: per-tensor norms the update needs (LARS: |w|, |g|; LAMB: |w|,
      |u|). On shards each is a partial sum, all-reduced within the group,
      batched (§4.1, Fig. 6).
  """

  name: str
  reads: tuple[str, ...]
  writes: tuple[str, ...]
  norms: int = 0

  def bytes_per_element(self, state_bytes: int = 4, copy_bytes: int = 0) -> int:
    """Bytes read and written per weight element.

    Args:
      state_bytes: bytes per element of the weights, gradients and moments.
      copy_bytes: bytes per element of a narrow copy of the weight the update
        also writes for the next forward pass (2 for bfloat16, §4.2 Fig. 7; 0
        for none).
    """
    return (len(self.reads) + len(self.writes)) * state_bytes + copy_bytes


OPTIMIZERS = {
    # w -= lr g
    "sgd": Optimizer("sgd", reads=("w", "g"), writes=("w",)),
    # m = mu m + g; w -= lr m
    "momentum": Optimizer("momentum", reads=("w", "g", "m"), writes=("w", "m")),
    # m, v moving averages of g and g^2; w -= lr m^ / (sqrt(v^) + eps)
    "adam": Optimizer("adam", reads=("w", "g", "m", "v"), writes=("w", "m", "v")),
    # You et al. 2017: momentum with a per-tensor trust ratio |w| / |g|; the two
    # norms are a first pass over w and g.
    "lars": Optimizer("lars", reads=("w", "g", "w", "g", "m"), writes=("w", "m"), norms=2),
    # You et al. 2019: Adam's direction u, then a trust ratio |w| / |u|; the
    # second pass recomputes u from m, v and w for its norm.
    "lamb": Optimizer("lamb", reads=("w", "g", "m", "v", "w", "m", "v"),
                      writes=("w", "m", "v"), norms=2),
}


@dataclasses.dataclass(frozen=True)
class Workload:
  """What a step reduces and updates.

  Attributes:
    tensors: elements of each weight tensor, in the order the collectives
      see them.
    optimizer: the update's memory traffic.
    grad_bytes: bytes per element of the reduced gradients.
    gather_bytes: bytes per element of the weights all-gathered after a
      sharded update (2: bfloat16, when the forward pass reads the weights in
      bfloat16 and they stay sharded across steps, §4.2 Fig. 7).
    state_bytes: bytes per element of weights and optimizer state.
    copy_bytes: bytes per element of a narrow copy of the weights the update
      writes for the forward pass (see `Optimizer.bytes_per_element`).
  """

  tensors: tuple[int, ...]
  optimizer: Optimizer
  grad_bytes: int = 4
  gather_bytes: int = 4
  state_bytes: int = 4
  copy_bytes: int = 0

  def __post_init__(self):
    object.__setattr__(self, "tensors", tuple(int(n) for n in self.tensors))

  @property
  def num_elements(self) -> int:
    return sum(self.tensors)


def padded_elements(n: int, tile: int) -> int:
  """Elements a tensor of `n` elements occupies in whole tiles of `tile`."""
  return -(-n // tile) * tile


def shard_elements(n: int, group_size: int, tile: int = 1) -> int:
  """Elements of one of `group_size` shards of a tensor of `n` elements.

  A shard is a whole number of tiles: ceil(ceil(n / tile) / G) tiles (§4.1:
  padding to a multiple of the shard count; §5.2: small shards padded).
  """
  return -(-(-(-n // tile)) // group_size) * tile


def update_seconds(workload: Workload, topology: Topology, group_size: int = 1) -> float:
  """Seconds of the weight update on 1/G of every tensor: its bytes / memory bandwidth (§2.2).

  With group_size = 1 the replicated update. Each tensor's shard is padded
  to whole tiles (`shard_elements`).
  """
  elements = sum(shard_elements(n, group_size, topology.tile_elements) for n in workload.tensors)
  per_element = workload.optimizer.bytes_per_element(workload.state_bytes, workload.copy_bytes)
  return elements * per_element / topology.memory_bandwidth


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
      (`choose_group_size`), the batching for that G on collectives and
      copies (`choose_batching`); `with_copies` adds them.
    alone_bytes: the `alone_bytes` of the batched collectives (None: the
      bucket limit).
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

  @property
  def communication(self) -> float:
    """Seconds of all collectives."""
    return self.reduce_scatter + self.all_reduce + self.norm_all_reduce + self.all_gather

  @property
  def total(self) -> float:
    """Predicted seconds per step: rest + collectives + update (nothing overlaps)."""
    return self.rest + self.communication + self.update

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
  + the whole update on every replica (§2.2, Fig. 2).

  Args:
    workload: tensors and optimizer.
    topology: devices.
    rest: seconds of the rest of the step.
    bucket_bytes: bucket limit of the batched all-reduce, bytes.
  """
  tile = topology.tile_elements
  sizes = [padded_elements(n, tile) * workload.grad_bytes for n in workload.tensors]
  seconds, count = network.batched(network.all_reduce, sizes, topology.axes, bucket_bytes)
  return StepPrediction(
      group_size=1, bucket_bytes=bucket_bytes, rest=rest, reduce_scatter=0.0,
      all_reduce=seconds, norm_all_reduce=0.0, update=update_seconds(workload, topology),
      all_gather=0.0, collectives={"reduce-scatter": 0, "all-reduce": count, "all-gather": 0},
      wire_bytes=wire_bytes(sum(sizes), topology.axes, "all-reduce"))


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
  + all-gather of the new weights within the group, in `gather_bytes`.
  The optimizer state stays sharded between steps: it is never gathered.
  Beside them, `copies`: what batching copies (`copied`, at the memory
  bandwidth).

  G = N: full sharding, no all-reduce across groups. G = 1: equals
  `predict_replicated`.

  Args:
    workload: tensors and optimizer.
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
  shards = [shard_elements(n, g, tile) for n in workload.tensors]
  padded = [g * s != n for s, n in zip(shards, workload.tensors, strict=True)]
  scatter = [g * s * workload.grad_bytes for s in shards]   # input of the reduce-scatter
  reduced = [s * workload.grad_bytes for s in shards]       # what each device keeps
  gather = [g * s * workload.gather_bytes for s in shards]  # output of the all-gather
  rs, rs_count = network.batched(network.reduce_scatter, scatter, inner, bucket_bytes,
                                 alone_bytes, padded)
  ar, ar_count = network.batched(network.all_reduce, reduced, outer, bucket_bytes)
  ag, ag_count = network.batched(network.all_gather, gather, inner, bucket_bytes, alone_bytes,
                                 padded)
  # The copies move the tensors' own bytes (wus pads a tensor by fewer than G
  # elements; the tiles' padding is the layout's, copied or not).
  grads = [n * workload.grad_bytes for n in workload.tensors]
  weights = [n * workload.gather_bytes for n in workload.tensors]
  copies = (network.copied(scatter, bucket_bytes, alone_bytes, padded, grads)  # G = 1: none.
            + network.copied(gather, bucket_bytes, alone_bytes, padded, weights)
            + (network.copied(reduced, bucket_bytes) if outer else 0.0)) if inner else 0.0
  norms = workload.optimizer.norms * len(workload.tensors) * _SCALAR_BYTES
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
      copies=network.copy_seconds(copies, topology), alone_bytes=alone_bytes)


# The bucket limit of batched collectives the cost model did not choose (a
# step with no sharded update; `wus.unshard`'s all-gathers).
DEFAULT_BUCKET_BYTES = 4 * 2 ** 20

# Candidate bucket limits of `choose_bucket_bytes`: 64 KiB to 1 GiB, powers of 2.
BUCKET_CANDIDATES = tuple(2 ** k for k in range(16, 31))


def choose_bucket_bytes(workload: Workload, topology: Topology, group_size: int = 1, *,
                        tolerance: float = 0.01,
                        candidates: Sequence[int] = BUCKET_CANDIDATES) -> int:
  """The smallest bucket limit whose collectives are within `tolerance` of one bucket's.

  Fewer buckets pay fewer latency terms (§5.2), so in this model one bucket
  holding everything is fastest. Smaller buckets have costs the model does
  not price (a collective cannot start before its last gradient exists; the
  combined buffer takes memory), so the smallest limit whose predicted
  communication is at most (1 + tolerance) x that of a single bucket is
  taken: bandwidth-bound buckets, no larger than needed.

  Args:
    workload: tensors and optimizer.
    topology: devices.
    group_size: G (1: the replicated all-reduce).
    tolerance: allowed relative excess over a single bucket.
    candidates: bucket limits to try, bytes.

  Returns:
    A limit from `candidates` (the largest if none is within tolerance).
  """
  def communication(limit: float) -> float:
    if group_size == 1:
      return predict_replicated(workload, topology, bucket_bytes=limit).communication
    return predict_sharded(workload, topology, group_size, bucket_bytes=limit).communication

  best = communication(math.inf)
  ordered = sorted(candidates)
  for limit in ordered:
    if communication(limit) <= best * (1 + tolerance):
      return limit
  return ordered[-1]


# Candidate `alone_bytes` of `choose_batching`: 1 KiB to 1 GiB, powers of 2.
ALONE_CANDIDATES = tuple(2 ** k for k in range(10, 31))


def choose_batching(workload: Workload, topology: Topology, group_size: int, *,
                    tolerance: float = 0.01, candidates: Sequence[int] = BUCKET_CANDIDATES,
                    alone_candidates: Sequence[int] = ALONE_CANDIDATES
                    ) -> tuple[int, int | None]:
  """(bucket limit, alone_bytes) of the sharded step's batched collectives (§5.2).

  Batching trades latency for copies (`buckets`): a tensor alone pays a
  reduce-scatter's and an all-gather's latency, a tensor batched the copy
  of its bytes into and out of the bucket. `alone_bytes` is the candidate
  (or None: every tensor under the limit batched) with the least predicted
  collectives and copies with one bucket for the rest; the limit is then the
  smallest candidate within `tolerance` of that (as `choose_bucket_bytes`).
  Where memory is fast next to the collectives' latency (accelerators), few
  tensors are worth a collective of their own; where a collective is a
  memory copy behind a thread rendezvous (CPU devices), most are.

  Args:
    workload: tensors and optimizer.
    topology: devices.
    group_size: G > 1.
    tolerance: allowed relative excess over the best.
    candidates: bucket limits to try, bytes.
    alone_candidates: alone_bytes to try, bytes (None is always tried).

  Returns:
    (a limit from `candidates`, an alone_bytes from `alone_candidates` or None).
  """
  def seconds(limit: float, alone: int | None) -> float:
    p = predict_sharded(workload, topology, group_size, bucket_bytes=limit, alone_bytes=alone)
    return p.communication + p.copies

  options = [None, *sorted(alone_candidates, reverse=True)]
  alone = min(options, key=lambda a: seconds(math.inf, a))  # First (largest) of equals.
  best = seconds(math.inf, alone)
  ordered = sorted(candidates)
  limit = next((c for c in ordered if seconds(c, alone) <= best * (1 + tolerance)), ordered[-1])
  return limit, alone


def choose_group_size(workload: Workload, topology: Topology, rest: float = 0.0,
                      bucket_bytes: float | None = None) -> int:
  """The sharding group size G with the lowest predicted step time (§5.2).

  Every G of `topology.group_sizes()` (divisors of N whose groups follow the
  axes) is priced by `predict_sharded`; ties go to the smaller G. G = N wins
  when latency is negligible (the update shrinks most); a smaller G when
  latency terms dominate (tiny tensors, many devices: rings within and
  across groups are shorter than one ring over all) or when small shards pad.

  Args:
    workload: tensors and optimizer.
    topology: devices.
    rest: seconds of the rest of the step (the same for every G).
    bucket_bytes: bucket limit, bytes; None: `choose_bucket_bytes` per G.

  Returns:
    G (1 if no sharding is predicted faster than none).
  """
  return best_sharded(workload, topology, rest, bucket_bytes).group_size


def best_sharded(workload: Workload, topology: Topology, rest: float = 0.0,
                 bucket_bytes: float | None = None) -> StepPrediction:
  """The prediction of `choose_group_size`'s G (see there)."""
  best = None
  for g in topology.group_sizes():
    limit = (choose_bucket_bytes(workload, topology, g) if bucket_bytes is None
             else bucket_bytes)
    p = predict_sharded(workload, topology, g, rest, limit)
    if best is None or p.total < best.total:
      best = p
  return best
