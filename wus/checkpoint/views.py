"""What Orbax sees of wus state: `LogicalView`s, arrays of the logical shape (§4.1).

A `LogicalView` is a `jax.Array` to Orbax, so that it is saved through the
handler Orbax keeps for `jax.Array` (`handler.ArrayHandler`, which wus
registers in its place); its `sharding` is a `ShardedLayout` (the one layout
type of sharded state, `wus.transforms.layout`: a step's format, replica axes,
spec, mesh and sharding groups) or a `StackedLayout` (the copies `wus.pmap`
stacks).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import NamedSharding

from wus.sharded import ShardedArray, WholeShape
from wus.transforms.layout import ShardedLayout


@dataclasses.dataclass(frozen=True)
class StackedLayout:
  """Where a whole tensor a `wus.pmap` step reads as stacked per-device copies goes.

  The `sharding` of a restore target `LogicalView` from `wus.pmap`'s `state_target`:
  the checkpoint holds one copy (saved unreplicated, as Flax's pmap examples save
  `flax.jax_utils.unreplicate(state)`); restoring puts it on every device of the
  step, stacked along the mapped axis, as `flax.jax_utils.replicate` would.

  Attributes:
    saved_shape: the saved shape (one copy).
    axis: the mapped axis the copies are stacked along.
    stacked: the sharding of the stacked array the step reads.
  """

  saved_shape: tuple[int, ...]
  axis: int
  stacked: NamedSharding


_UNREGISTERED = ("wus.checkpoint: Orbax's handler for jax.Array is not wus's, so it cannot "
                 "save or restore wus state; another handler was registered after wus's. "
                 "Call wus.checkpoint.register() after registering yours.")


class LogicalView(WholeShape, jax.Array):
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
    return self.layout.saved_shape

  @property
  def dtype(self) -> np.dtype:
    return self._dtype

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
