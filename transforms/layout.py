"""Where a tensor wus keeps sharded between steps lies: one layout type (§4.1, §5.2).

A `ShardedLayout` is everything about a sharded tensor but its values: its
format, the replica axes it is split over, the spec of its whole value in the
user's step, the mesh its shards live on and, for `shard_group_size`, the
sharding groups that mesh was derived for. `wus.ShardedArray` holds one, the
runtime compares them, the shard and unshard programs are made from them, and
checkpoints save and restore by them. The groups travel with the layout: no
table maps a derived mesh back to the user's.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from wus.analysis.formats import ShardFormat
from wus.transforms.groups import Groups


def shard_spec(axes: Sequence[str]) -> P:
  """The PartitionSpec of a sharded tensor's padded shards: leading dim split over `axes`."""
  return P(axes[0] if len(axes) == 1 else tuple(axes))


@dataclasses.dataclass(frozen=True)
class ShardedLayout:
  """How one tensor wus keeps sharded lies on the devices (§4.1, §5.2).

  Not a `jax.sharding.Sharding`: a device's shard is a range of the row-major
  tensor, in general not a box of it.

  Attributes:
    format: how one replica's whole value (shape `format.shape`) maps to the
      padded shards (shape `format.padded_shape`, §4.1).
    axes: the mesh axes the padded shards' leading dim is split over.
    spec: the PartitionSpec of the whole value in the step, over `mesh`: P()
      for a `wus.shard_map` step, the mapped axis for `wus.pmap`'s copies.
    mesh: the mesh the shards live on (derived from the user's for groups).
    groups: the sharding groups `mesh` was derived for (`shard_group_size`,
      §5.2), or None: `mesh` is the user's.
  """

  format: ShardFormat
  axes: tuple
  spec: P
  mesh: Mesh
  groups: Groups | None = None

  @property
  def shape(self) -> tuple[int, ...]:
    """Global shape of the whole value, as the user's step sees it."""
    shape = list(self.format.shape)
    for d, entry in enumerate(self.spec):
      names = entry if isinstance(entry, tuple) else (entry,) if entry else ()
      shape[d] *= math.prod(self.mesh.shape[n] for n in names)
    return tuple(shape)

  @property
  def saved_shape(self) -> tuple[int, ...]:
    """The shape a checkpoint holds: one replica's value (`format.shape`) without the
    size-1 dims the spec stacks over replicas (`wus.pmap`'s leading dim: the
    unreplicated value)."""
    shape = self.format.shape
    entries = [*self.spec, *(None,) * (len(shape) - len(self.spec))]
    return tuple(d for d, entry in zip(shape, entries, strict=True) if not (entry and d == 1))

  @property
  def data_sharding(self) -> NamedSharding:
    """How the padded shards lie on `mesh`: the leading dim split over `axes`."""
    return NamedSharding(self.mesh, shard_spec(self.axes))

  @property
  def user_mesh(self) -> Mesh:
    """The user's mesh: whole values enter and leave on it."""
    return self.mesh if self.groups is None else self.groups.mesh

  @property
  def user_spec(self) -> P:
    """`spec` over the user's mesh."""
    return self.spec if self.groups is None else self.groups.user_spec(self.spec)
