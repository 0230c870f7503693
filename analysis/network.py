r"""The network in the alpha-beta model: mesh axes, topologies and collective times.

Pure Python (no JAX computation): every function takes sizes and hardware
figures and returns a time. Everything this module returns is a **prediction** from the
model, never a measurement. Units: bytes, seconds, bytes per second.

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
  Batching copies: a tensor sharing a bucket is copied into the bucket's
  buffer before a reduce-scatter and out of the gathered buffer after an
  all-gather (`wus.collectives.batched`), each a read and a write of its
  bytes at the memory bandwidth (`copy_seconds`). A tensor of `alone_bytes`
  or more that needs no padding keeps its own collective and is not copied;
  a padded tensor is copied either way.

Section numbers are those of Xu et al. 2020, arXiv:2004.13336. The step
built on these times (the update's memory traffic, partial sharding, the
choices of group and bucket size) is `costmodel`'s and `sizing`'s.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

from wus.collectives.batched import buckets  # The rule the batched collectives follow.


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

  def without_latency(self) -> Topology:
    """The same devices with every axis's alpha 0: what bytes alone cost."""
    return dataclasses.replace(
        self, axes=tuple(dataclasses.replace(a, alpha=0.0) for a in self.axes))

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

  def strided(self, stride: int, size: int) -> Topology:
    """The devices of one group of `size` devices `stride` apart: 0, stride, 2 stride, ...

    The data groups of a data x model mesh whose model axis is the faster
    (stride = the model size M; DESIGN.md §1, issue 29): each model shard's
    gradients are reduce-scattered, and its new weights all-gathered, over
    such a group, all M groups at once. Their rings are the axes across
    groups of M consecutive devices (`split(stride)`'s outer axes: an axis cut
    inside keeps alpha x k and bandwidth / k, its links shared by the k rings
    beside it), of which the group takes the fastest `size` devices
    (`split(size)`'s inner axes). On a TPU torus with the model axis over
    the cores and one ring dimension, the data group is the other ring
    dimension. stride = 1 is a group of consecutive devices.

    Args:
      stride: devices between neighbours of the group (the product of the
        sizes of the mesh axes faster than the group's).
      size: devices in the group.

    Returns:
      The group's topology (the same memory and tile).

    Raises:
      ValueError: the stride or the size cuts an axis unevenly (`split`).
    """
    across = dataclasses.replace(self, axes=self.split(stride)[1])
    return dataclasses.replace(self, axes=across.split(size)[0])

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


@dataclasses.dataclass(frozen=True)
class Figures:
  """A kind of device's costs for `default_topology` (bytes, seconds, bytes per second).

  Attributes:
    intra_alpha, intra_bandwidth: seconds per ring step and bytes per second
      per device per direction between the devices of one process.
    inter_alpha, inter_bandwidth: the same across processes.
    memory_bandwidth: bytes per second one device reads and writes its memory at.
    shared: the bandwidths are the host's, shared by the devices of one process
      (XLA:CPU devices are threads on the host's cores and memory), so each
      device gets 1/k of them with k devices per process.
    source: where the figures come from, as the Plan's reader needs to know.
  """

  intra_alpha: float
  intra_bandwidth: float
  inter_alpha: float
  inter_bandwidth: float
  memory_bandwidth: float
  shared: bool = False
  source: str = ""


# Accelerators (TPU ICI, GPU NVLink class within a process, a 100 Gbit/s
# data-center network across processes, HBM): order-of-magnitude figures, not
# measured here (no accelerator); `topology=` or wus-bench's calibration
# replaces them.
ACCELERATOR = Figures(5e-6, 50e9, 25e-6, 12.5e9, 1e12,
                      source="accelerator-class figures, not measured")
# XLA:CPU: measured by `wus-bench`'s calibration (harness/tools/bench/calibrate.py)
# on a 2-core x86_64 host with 8 simulated devices, all busy (2026-11-28, two runs
# agreeing within 4%): alpha 12.3-12.8 us per ring step inside a program; 2.0 GB/s
# per device of ring all-reduce and 1.84 GB/s per device of elementwise traffic,
# i.e. 16 GB/s and 14.7 GB/s for the host. Across processes (gloo over TCP)
# unmeasured: a loopback-class guess.
CPU = Figures(12.5e-6, 16e9, 50e-6, 1e9, 14.7e9, shared=True,
              source="XLA:CPU figures measured on a 2-core host (network.CPU)")
# By `jax.Device.platform`; any other platform takes ACCELERATOR.
PLATFORMS = {"cpu": CPU, "gpu": ACCELERATOR, "tpu": ACCELERATOR}


def format_seconds(seconds: float) -> str:
  """`seconds` in the unit that keeps 1-999 before the point: "71.3 us", "1.17 ms"."""
  for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
    if abs(seconds) >= scale:
      return f"{seconds / scale:.3g} {unit}"
  return f"{seconds / 1e-9:.3g} ns"


def format_bytes(n: int) -> str:
  """`n` bytes in binary units: "512 B", "75.1 KiB", "6.25 MiB"."""
  for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
    if n >= scale:
      return f"{n / scale:.3g} {unit}"
  return f"{n} B"


def resolution(topology: Topology) -> float:
  """The shortest time the model tells apart: one ring step's latency on the fastest axis.

  Its per-cluster predictions leave latency out (batched collectives share it), so a
  cluster's predicted time below this says only that the cluster is small.
  """
  return min((a.alpha for a in topology.axes), default=0.0)


def default_topology(num_devices: int, devices_per_process: int | None = None,
                     platform: str | None = None, host_devices: int | None = None) -> Topology:
  """A topology from device counts and the kind of device, for when the user describes none.

  The devices of one process are the fast axis ("process"); the processes
  the slow one ("host"). The figures are the platform's (`PLATFORMS`): on
  CPU devices, measured on this project's machines, a bandwidth shared by
  the devices of a process (so a bucket's copies cost what they cost there:
  issue 30); elsewhere accelerator-class defaults. Pass `topology=` to a
  front end to describe the real devices.

  Args:
    num_devices: N, all devices.
    devices_per_process: devices of one process; None or N: one process.
    platform: `jax.Device.platform` ("cpu", "gpu", "tpu"); None or another:
      the accelerator figures.
    host_devices: devices of the mesh in one process, all busy in a step
      (more than `devices_per_process` when a sharding group is a part of
      them); None: devices_per_process. Only for platforms whose bandwidth
      is the host's.

  Returns:
    A topology of one or two axes, fast to slow.

  Raises:
    ValueError: devices_per_process does not divide num_devices.
  """
  local = devices_per_process or num_devices
  if num_devices < 1 or num_devices % local:
    raise ValueError(f"{local} devices per process do not divide {num_devices} devices")
  f = PLATFORMS.get(platform, ACCELERATOR)
  share = (host_devices or local) if f.shared else 1
  axes = [Axis("process", local, f.intra_alpha, f.intra_bandwidth / share)]
  if num_devices > local:
    axes.append(Axis("host", num_devices // local, f.inter_alpha, f.inter_bandwidth / share))
  return Topology(tuple(axes), f.memory_bandwidth / share)


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


def _phases(ring: Callable[[float, Axis], float], nbytes: float,
            axes: Sequence[Axis]) -> float:
  """Seconds of `ring` along each axis in turn, on nbytes / (sizes of the axes before)."""
  total, left = 0.0, nbytes
  for a in axes:
    total += ring(left, a)
    left /= a.size
  return total


def reduce_scatter(nbytes: float, axes: Sequence[Axis]) -> float:
  """Seconds of a multi-phase reduce-scatter of `nbytes` per device (§5.1).

  Phases run fast to slow: along axes[0] on the whole nbytes, along axes[1]
  on nbytes / n_0, and so on; each device ends with nbytes / prod(n).
  """
  return _phases(ring_reduce_scatter, nbytes, axes)


def all_gather(nbytes: float, axes: Sequence[Axis]) -> float:
  """Seconds of a multi-phase all-gather to `nbytes` per device (§5.1).

  The phases of `reduce_scatter` in reverse, slow to fast: along the slowest
  axis on nbytes / prod(faster sizes), ..., along axes[0] on the whole
  nbytes. The same sum as `reduce_scatter`, hence the same time.
  """
  return _phases(ring_all_gather, nbytes, axes)


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


def batched(collective: Callable[[float, Sequence[Axis]], float], sizes: Sequence[float],
            axes: Sequence[Axis], bucket_bytes: float = math.inf,
            alone_bytes: float | None = None, padded: Sequence[bool] = (),
            closes: bool = True) -> tuple[float, int]:
  """Seconds and count of `collective` over tensors of `sizes` bytes, batched (§5.2).

  Each bucket (`buckets(sizes, bucket_bytes, alone_bytes, padded, closes)`) is one
  collective on the sum of its tensors' bytes: k tensors in one bucket pay
  one latency term instead of k. The copies batching makes are `copied`'s.

  Args:
    collective: `reduce_scatter`, `all_gather` or `all_reduce`.
    sizes: bytes per device of each tensor, as the collective takes them.
    axes: the axes it runs over, fast to slow.
    bucket_bytes, alone_bytes, padded, closes: as for `buckets` (closes False
      for the all-gathers).

  Returns:
    (seconds, number of collectives); (0, 0) with no axis to cross or no tensor.
  """
  if not axes or not sizes:
    return 0.0, 0
  bucketed = buckets(sizes, bucket_bytes, alone_bytes, padded, closes)
  return sum(collective(sum(sizes[i] for i in b), axes) for b in bucketed), len(bucketed)


def copied(sizes: Sequence[float], bucket_bytes: float = math.inf,
           alone_bytes: float | None = None, padded: Sequence[bool] = (),
           data: Sequence[float] | None = None, closes: bool = True) -> float:
  """Bytes of the tensors a batched collective copies: those sharing a bucket, and padded ones.

  Args and buckets as for `batched`; `data`: each tensor's own bytes, which
  the copies move (default `sizes`, which may hold the layout's tile padding).
  """
  bucketed = buckets(sizes, bucket_bytes, alone_bytes, padded, closes)
  own = sizes if data is None else data
  return sum(own[i] for b in bucketed for i in b
             if len(b) > 1 or (i < len(padded) and padded[i]))


# Flops per second of one device for an update's arithmetic: an accelerator's order of
# magnitude (the topology's figures are too); only its ratio to the memory bandwidth
# matters to the decisions.
FLOPS_PER_SECOND = 100e12


def compute_seconds(nbytes: float, topology: Topology, flops: float = 0.0) -> float:
  """Seconds of a computation on one device: `flops` of arithmetic at `FLOPS_PER_SECOND`
  plus `nbytes` read and written at its memory bandwidth. The one formula for an update's
  time: an elementwise update is memory-bound (`flops` 0, §2.2); a matrix-wise one
  (ownership) counts its flops too."""
  return flops / FLOPS_PER_SECOND + nbytes / topology.memory_bandwidth


def copy_seconds(nbytes: float, topology: Topology) -> float:
  """Seconds to copy `nbytes` on each device: read and write them at its memory bandwidth."""
  return 2 * nbytes / topology.memory_bandwidth
