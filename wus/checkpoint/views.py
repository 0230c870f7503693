"""What Orbax sees of wus state: `LogicalView`s, arrays of the logical shape (§4.1).

A `LogicalView` is a `jax.Array` to Orbax, so that it is saved through the
handler Orbax keeps for `jax.Array` (`handler.ArrayHandler`, which wus
registers in its place); its `sharding` is a `ShardedLayout` (a step's format,
mesh and replica axes) or a `StackedLayout` (the copies `wus.pmap` stacks).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from wus.analysis.formats import ShardFormat
from wus.sharded import ShardedArray
from wus.transforms import programs


@dataclasses.dataclass(frozen=True)
class ShardedLayout:
  """Where a tensor restored as wus state goes: its format on a mesh (§4.1).

  The `sharding` of a restore target `LogicalView`. Not a `jax.sharding.Sharding`:
  a device's shard is a range of the row-major tensor, not a box.

  Attributes:
    format: the tensor's sharding format (its logical shape is `format.shape`).
    axes: the mesh axes the leading merged dim is split over.
    spec: the PartitionSpec of the whole value in the step (`ShardedArray.spec`).
    mesh: the step's mesh.
  """

  format: ShardFormat
  axes: tuple
  spec: P
  mesh: Mesh

  @property
  def shape(self) -> tuple[int, ...]:
    """The shape saved: one replica's value (`format.shape`), without the size-1 dims that
    the spec stacks over replicas (`wus.pmap`'s leading dim; the unreplicated value)."""
    shape = self.format.shape
    return tuple(d for d, entry in zip(shape, _entries(self.spec, len(shape)), strict=True)
                 if not (entry and d == 1))

  @property
  def data_sharding(self) -> NamedSharding:
    """The sharding of the padded array (`ShardedArray.data`)."""
    return NamedSharding(self.mesh, programs.shard_spec(self.axes))


@dataclasses.dataclass(frozen=True)
class StackedLayout:
  """Where a whole tensor a `wus.pmap` step reads as stacked per-device copies goes.

  The `sharding` of a restore target `LogicalView` from `wus.pmap`'s `state_target`:
  the checkpoint holds one copy (saved unreplicated, as Flax's pmap examples save
  `flax.jax_utils.unreplicate(state)`); restoring puts it on every device of the
  step, stacked along the mapped axis, as `flax.jax_utils.replicate` would.

  Attributes:
    shape: the saved shape (one copy).
    axis: the mapped axis the copies are stacked along.
    stacked: the sharding of the stacked array the step reads.
  """

  shape: tuple[int, ...]
  axis: int
  stacked: NamedSharding


def _entries(spec: P, ndim: int) -> list:
  return [*spec, *(None,) * (ndim - len(spec))]


_UNREGISTERED = ("wus.checkpoint: Orbax's handler for jax.Array is not wus's, so it cannot "
                 "save or restore wus state; another handler was registered after wus's. "
                 "Call wus.checkpoint.register() after registering yours.")


class LogicalView(jax.Array):
  """A tensor wus keeps sharded, as Orbax sees it: an array of its logical shape.

  Made by `checkpointable` (to save: `shards` is the `wus.ShardedArray`) and by
  `ShardedStep.state_target` (a restore target: `shards` is None). Only wus's
  Orbax handler reads or writes it; it is not an array anywhere else.

  Attributes:
    layout: the tensor's format, replica axes, spec and mesh.
    shards: the sharded value to save, or None in a restore target.
    bank: for owned state (`wus.analysis.owned`) to save, every member of its
      bank in member order (its elements lie in their arrays); else None.
  """

  __slots__ = ("layout", "shards", "_dtype", "bank")

  def __init__(self, layout: ShardedLayout | StackedLayout, dtype,
               shards: ShardedArray | None = None, bank: list | None = None):
    self.layout, self.shards, self._dtype, self.bank = layout, shards, np.dtype(dtype), bank

  @property
  def shape(self) -> tuple[int, ...]:
    return self.layout.shape

  @property
  def dtype(self) -> np.dtype:
    return self._dtype

  @property
  def ndim(self) -> int:
    return len(self.shape)

  @property
  def size(self) -> int:
    return math.prod(self.shape)

  @property
  def nbytes(self) -> int:
    return self.size * self._dtype.itemsize

  @property
  def sharding(self) -> ShardedLayout | StackedLayout:  # Orbax passes it to the handler.
    return self.layout

  @property
  def weak_type(self) -> bool:
    return False

  def __repr__(self) -> str:
    kind = "to save" if self.shards is not None else "restore target"
    where = getattr(self.layout, "format", "stacked per device")
    return f"LogicalView({self._dtype}{list(self.shape)}, {where}, {kind})"

  def _unregistered(self, *args, **kwargs):
    raise TypeError(_UNREGISTERED)

  addressable_shards = global_shards = property(_unregistered)
  is_fully_addressable = is_fully_replicated = property(_unregistered)
  __array__ = __jax_array__ = copy_to_host_async = _unregistered


def layout_of(x: ShardedArray) -> ShardedLayout:
  return ShardedLayout(x.format, tuple(x.axes), x.spec, x.mesh)
