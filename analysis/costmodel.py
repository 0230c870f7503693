r"""An alpha-beta model of a data-parallel step, with and without weight-update sharding.

Pure Python, no JAX: every function takes sizes and hardware figures and
returns a time. Everything this module returns is a **prediction** from the
model, never a measurement.

Units throughout: bytes, seconds, bytes per second; tensor sizes in elements.

The pieces (section numbers are those of Xu et al. 2020, arXiv:2004.13336):

* Collectives are ring algorithms (Thakur, Rabenseifner, Gropp 2005, the
  paper's ref [22]). On a ring of n devices, each holding D bytes, with a
  latency of alpha seconds per step and a bandwidth of B bytes per second:

    reduce-scatter  (n - 1) (alpha + D / (n B))       D: whole input per device
    all-gather      (n - 1) (alpha + D / (n B))       D: whole output per device
    all-reduce      2 (n - 1) (alpha + D / (n B))     = reduce-scatter + all-gather

* A `Topology` is a sequence of mesh axes, **fast to slow**: `axes[0]` is the
  fastest (consecutive device ids, e.g. the cores of one chip or the devices
  of one process), the last the slowest. Over several axes a collective runs
  in phases (§5.1, BlueConnect, the paper's ref [4]): a reduce-scatter runs
  along the fastest axis on the whole D, then along the next one on D / n_0,
  and so on; an all-gather runs the phases in the opposite order. So the
  most bytes cross the fastest links.
* Batched collectives (§5.2): tensors are grouped into buckets of at most
  `bucket_bytes`; a bucket is one collective, and so pays one latency term.
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
from collections.abc import Callable, Sequence

# Bytes of one float32 scalar: the partial norms LARS and LAMB all-reduce
# when they run on shards (§4.1, Fig. 6).
_SCALAR_BYTES = 4


@dataclasses.dataclass(frozen=True)
class Axis:
  """One mesh axis: a ring of `size` devices.

  Attributes:
    name: as printed, e.g. "core", "x".
    size: devices along the axis.
    alpha: seconds of latency per ring step (one send to a neighbour and the
      synchronization around it).
    bandwidth: bytes per second one device sends to its ring neighbour along
      this axis while receiving as much (per device, per direction of the
      ring): with two counter-rotating rings on a torus, both links' worth;
      shared links divided among the devices that share them.
  """

  name: str
  size: int
  alpha: float
  bandwidth: float

  def __post_init__(self):
    if self.size < 1 or self.alpha < 0 or self.bandwidth <= 0:
      raise ValueError(f"axis {self.name!r}: size >= 1, alpha >= 0 and bandwidth > 0 "
                       f"needed, got size={self.size}, alpha={self.alpha}, "
                       f"bandwidth={self.bandwidth}")


@dataclasses.dataclass(frozen=True)
class Topology:
  """The devices of a data-parallel step: mesh axes and memory.

  Attributes:
    axes: the mesh axes, fast to slow (`axes[0]` the fastest: consecutive
      devices). The devices number prod(size).
    memory_bandwidth: bytes per second one device reads and writes its own
      memory at (the weight update's bound).
    tile_elements: elements of one tile of the device's memory layout; a
      shard is a whole number of tiles (1: no padding).
  """

  axes: tuple[Axis, ...]
  memory_bandwidth: float
  tile_elements: int = 1

  def __post_init__(self):
    object.__setattr__(self, "axes", tuple(self.axes))
    if self.memory_bandwidth <= 0 or self.tile_elements < 1:
      raise ValueError("memory_bandwidth > 0 and tile_elements >= 1 needed")

  @property
  def num_devices(self) -> int:
    return math.prod(a.size for a in self.axes)

  def split(self, group_size: int) -> tuple[tuple[Axis, ...], tuple[Axis, ...]]:
    """The axes of a group of `group_size` consecutive devices, and the rest.

    The group takes the fastest axes whole (the paper's groups are the rows
    of an N x M array, §5.2). Where it ends inside an axis, that axis is split
    into a ring of k consecutive devices inside the group, which keeps the
    axis's alpha and bandwidth, and a ring of size / k across groups whose
    neighbours are k devices apart: each of its steps crosses k links (k
    alphas) and the k such rings share the axis's links (bandwidth / k). So
    splitting an axis never saves latency by itself (a ring of n and the two
    rings of k and n / k cross as many links), and it costs bandwidth. Axes
    of size 1 are dropped.

    Args:
      group_size: G, a divisor of the number of devices.

    Returns:
      (inner, outer): the axes within a group, fast to slow, and the axes
      across groups, fast to slow.

    Raises:
      ValueError: G does not divide the devices, or would cut an axis into
        pieces that do not divide it (e.g. G = 6 on axes of sizes 4 and 3).
    """
    n = self.num_devices
    if group_size < 1 or n % group_size:
      raise ValueError(f"group size {group_size} does not divide {n} devices")
    inner, outer, left = [], [], group_size
    for a in self.axes:
      if left == 1:
        outer.append(a)
      elif left % a.size == 0:
        inner.append(a)
        left //= a.size
      elif a.size % left == 0:
        inner.append(dataclasses.replace(a, name=f"{a.name}[:{left}]", size=left))
        outer.append(dataclasses.replace(a, name=f"{a.name}/{left}", size=a.size // left,
                                         alpha=a.alpha * left, bandwidth=a.bandwidth / left))
        left = 1
      else:
        raise ValueError(f"a group of {group_size} consecutive devices cuts axis "
                         f"{a.name!r} of size {a.size} unevenly")
    return (tuple(a for a in inner if a.size > 1), tuple(a for a in outer if a.size > 1))

  def group_sizes(self) -> list[int]:
    """Every G for which `split(G)` holds, increasing: the candidates of `choose_group_size`."""
    out = []
    for g in range(1, self.num_devices + 1):
      if self.num_devices % g == 0:
        try:
          self.split(g)
        except ValueError:
          continue
        out.append(g)
    return out


# Defaults of `default_topology`: order-of-magnitude figures, not measured.
# Within a process: an accelerator interconnect (NVLink, TPU ICI class).
DEFAULT_INTRA_ALPHA = 5e-6        # seconds per ring step
DEFAULT_INTRA_BANDWIDTH = 50e9    # bytes/s per device per direction
# Across processes: a 100 Gbit/s data-center network.
DEFAULT_INTER_ALPHA = 25e-6       # seconds per ring step
DEFAULT_INTER_BANDWIDTH = 12.5e9  # bytes/s per device per direction
DEFAULT_MEMORY_BANDWIDTH = 1e12   # bytes/s, HBM class


def format_seconds(seconds: float) -> str:
  """`seconds` in the unit that keeps 1-999 before the point: "71.3 us", "1.17 ms"."""
  for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
    if abs(seconds) >= scale:
      return f"{seconds / scale:.3g} {unit}"
  return f"{seconds / 1e-9:.3g} ns"


def resolution(topology: Topology) -> float:
  """The shortest time the model tells apart: one ring step's latency on the fastest axis.

  Its per-cluster predictions leave latency out (batched collectives share it), so a
  cluster's predicted time below this says only that the cluster is small.
  """
  return min((a.alpha for a in topology.axes), default=0.0)


def default_topology(num_devices: int, devices_per_process: int | None = None, *,
                     intra_alpha: float = DEFAULT_INTRA_ALPHA,
                     intra_bandwidth: float = DEFAULT_INTRA_BANDWIDTH,
                     inter_alpha: float = DEFAULT_INTER_ALPHA,
                     inter_bandwidth: float = DEFAULT_INTER_BANDWIDTH,
                     memory_bandwidth: float = DEFAULT_MEMORY_BANDWIDTH) -> Topology:
  """A topology from device counts alone, for when the user describes none.

  The devices of one process are the fast axis ("process"); the processes
  the slow one ("host"). The figures are generic defaults (the module's
  DEFAULT_* constants), to be replaced by the user's or by measurements.

  Args:
    num_devices: N, all devices.
    devices_per_process: devices of one process; None or N: one process.
    intra_alpha, intra_bandwidth: seconds per ring step and bytes per second
      per device within a process.
    inter_alpha, inter_bandwidth: the same across processes.
    memory_bandwidth: bytes per second of one device's memory.

  Returns:
    A topology of one or two axes, fast to slow.

  Raises:
    ValueError: devices_per_process does not divide num_devices.
  """
  local = devices_per_process or num_devices
  if num_devices < 1 or num_devices % local:
    raise ValueError(f"{local} devices per process do not divide {num_devices} devices")
  axes = [Axis("process", local, intra_alpha, intra_bandwidth)]
  if num_devices > local:
    axes.append(Axis("host", num_devices // local, inter_alpha, inter_bandwidth))
  return Topology(tuple(axes), memory_bandwidth)


# --- Ring collectives (Thakur et al. 2005, the paper's ref [22]) ------------------


def ring_reduce_scatter(nbytes: float, axis: Axis) -> float:
  """Seconds to reduce-scatter `nbytes` (whole input per device) along one ring.

  (n - 1) steps, each sending one shard of nbytes / n: (n - 1)(alpha + D/(n B)).
  """
  n = axis.size
  return (n - 1) * (axis.alpha + nbytes / (n * axis.bandwidth)) if n > 1 else 0.0


def ring_all_gather(nbytes: float, axis: Axis) -> float:
  """Seconds to all-gather `nbytes` (whole output per device) along one ring.

  (n - 1) steps, each forwarding one shard of nbytes / n: (n - 1)(alpha + D/(n B)).
  """
  return ring_reduce_scatter(nbytes, axis)


def ring_all_reduce(nbytes: float, axis: Axis) -> float:
  """Seconds to all-reduce `nbytes` along one ring: a reduce-scatter then an all-gather.

  2 (n - 1)(alpha + D/(n B)).
  """
  return ring_reduce_scatter(nbytes, axis) + ring_all_gather(nbytes, axis)


def reduce_scatter(nbytes: float, axes: Sequence[Axis]) -> float:
  """Seconds of a multi-phase reduce-scatter of `nbytes` per device (§5.1).

  Phases run fast to slow: along axes[0] on the whole nbytes, along axes[1]
  on nbytes / n_0, and so on; each device ends with nbytes / prod(n).
  """
  total, left = 0.0, nbytes
  for a in axes:
    total += ring_reduce_scatter(left, a)
    left /= a.size
  return total


def all_gather(nbytes: float, axes: Sequence[Axis]) -> float:
  """Seconds of a multi-phase all-gather to `nbytes` per device (§5.1).

  The phases of `reduce_scatter` in reverse, slow to fast: along the slowest
  axis on nbytes / prod(faster sizes), ..., along axes[0] on the whole
  nbytes. The same sum as `reduce_scatter`, hence the same time.
  """
  total, left = 0.0, nbytes
  for a in axes:
    total += ring_all_gather(left, a)
    left /= a.size
  return total


def all_reduce(nbytes: float, axes: Sequence[Axis]) -> float:
  """Seconds of a multi-phase all-reduce of `nbytes` per device.

  A reduce-scatter over `axes` then an all-gather over them (§2.2, Fig. 3).
  """
  return reduce_scatter(nbytes, axes) + all_gather(nbytes, axes)


def latency(axes: Sequence[Axis], kind: str = "reduce-scatter") -> float:
  """Seconds of latency (alpha terms) of one collective over `axes`.

  What one more collective costs beyond its bytes: sum of (n - 1) alpha over
  the axes, twice for an all-reduce.
  """
  steps = sum((a.size - 1) * a.alpha for a in axes)
  return 2 * steps if kind == "all-reduce" else steps


def buckets(sizes: Sequence[float], limit: float) -> list[list[int]]:
  """Groups positions 0..len(sizes)-1 into buckets of at most `limit` bytes.

  The rule of `wus.collectives.batched.buckets`: a tensor of `limit` bytes or
  more gets a bucket of its own; the others fill buckets in order.

  Args:
    sizes: bytes of each tensor.
    limit: bytes per bucket (math.inf: one bucket).

  Returns:
    Lists of positions, every position in exactly one.
  """
  out: list[list[int]] = []
  current: list[int] = []
  total = 0.0
  for i, size in enumerate(sizes):
    if size >= limit:
      out.append([i])
      continue
    if current and total + size > limit:
      out.append(current)
      current, total = [], 0.0
    current.append(i)
    total += size
  if current:
    out.append(current)
  return out


def batched(collective: Callable[[float, Sequence[Axis]], float], sizes: Sequence[float],
            axes: Sequence[Axis], bucket_bytes: float = math.inf) -> tuple[float, int]:
  """Seconds and count of `collective` over tensors of `sizes` bytes, batched (§5.2).

  Each bucket (`buckets(sizes, bucket_bytes)`) is one collective on the sum of
  its tensors' bytes: k tensors in one bucket pay one latency term instead of k.

  Args:
    collective: `reduce_scatter`, `all_gather` or `all_reduce`.
    sizes: bytes per device of each tensor, as the collective takes them.
    axes: the axes it runs over, fast to slow.
    bucket_bytes: the bucket limit, bytes.

  Returns:
    (seconds, number of collectives); (0, 0) with no axis to cross or no tensor.
  """
  if not axes or not sizes:
    return 0.0, 0
  groups = buckets(sizes, bucket_bytes)
  return sum(collective(sum(sizes[i] for i in b), axes) for b in groups), len(groups)


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

  @property
  def communication(self) -> float:
    """Seconds of all collectives."""
    return self.reduce_scatter + self.all_reduce + self.norm_all_reduce + self.all_gather

  @property
  def total(self) -> float:
    """Predicted seconds per step: rest + collectives + update (nothing overlaps)."""
    return self.rest + self.communication + self.update


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

  rest + all-reduce of the gradients over every axis (batched, multi-phase)
  + the whole update on every replica (§2.2, Fig. 2).

  Args:
    workload: tensors and optimizer.
    topology: devices.
    rest: seconds of the rest of the step.
    bucket_bytes: bucket limit of the batched all-reduce, bytes.
  """
  tile = topology.tile_elements
  sizes = [padded_elements(n, tile) * workload.grad_bytes for n in workload.tensors]
  seconds, count = batched(all_reduce, sizes, topology.axes, bucket_bytes)
  return StepPrediction(
      group_size=1, bucket_bytes=bucket_bytes, rest=rest, reduce_scatter=0.0,
      all_reduce=seconds, norm_all_reduce=0.0, update=update_seconds(workload, topology),
      all_gather=0.0, collectives={"reduce-scatter": 0, "all-reduce": count, "all-gather": 0},
      wire_bytes=wire_bytes(sum(sizes), topology.axes, "all-reduce"))


def predict_sharded(workload: Workload, topology: Topology, group_size: int,
                    rest: float = 0.0, bucket_bytes: float = math.inf) -> StepPrediction:
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

  G = N: full sharding, no all-reduce across groups. G = 1: equals
  `predict_replicated`.

  Args:
    workload: tensors and optimizer.
    topology: devices; `topology.split(group_size)` gives the axes.
    group_size: G.
    rest: seconds of the rest of the step.
    bucket_bytes: bucket limit of every batched collective, bytes.

  Raises:
    ValueError: from `Topology.split`.
  """
  inner, outer = topology.split(group_size)
  tile, g = topology.tile_elements, group_size
  shards = [shard_elements(n, g, tile) for n in workload.tensors]
  scatter = [g * s * workload.grad_bytes for s in shards]   # input of the reduce-scatter
  reduced = [s * workload.grad_bytes for s in shards]       # what each device keeps
  gather = [g * s * workload.gather_bytes for s in shards]  # output of the all-gather
  rs, rs_count = batched(reduce_scatter, scatter, inner, bucket_bytes)
  ar, ar_count = batched(all_reduce, reduced, outer, bucket_bytes)
  ag, ag_count = batched(all_gather, gather, inner, bucket_bytes)
  norms = workload.optimizer.norms * len(workload.tensors) * _SCALAR_BYTES
  nar, nar_count = batched(all_reduce, [norms] if norms else [], inner)
  return StepPrediction(
      group_size=g, bucket_bytes=bucket_bytes, rest=rest, reduce_scatter=rs, all_reduce=ar,
      norm_all_reduce=nar, update=update_seconds(workload, topology, g), all_gather=ag,
      collectives={"reduce-scatter": rs_count, "all-reduce": ar_count + nar_count,
                   "all-gather": ag_count},
      wire_bytes=(wire_bytes(sum(scatter), inner, "reduce-scatter")
                  + wire_bytes(sum(reduced), outer, "all-reduce")
                  + wire_bytes(norms, inner, "all-reduce")
                  + wire_bytes(sum(gather), inner, "all-gather")))


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
