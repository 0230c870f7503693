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

from wus.analysis.formats import Format
from wus.transforms.groups import Groups


def shard_spec(axes: Sequence[str]) -> P:
  """The PartitionSpec of a sharded tensor's padded shards: leading dim split over `axes`."""
  return P(axes[0] if len(axes) == 1 else tuple(axes))


def spec_axes(spec: P) -> frozenset:
  """The mesh axes a PartitionSpec splits over."""
  out = set()
  for entry in spec:
    if entry is None:
      continue
    out.update(entry if isinstance(entry, tuple) else (entry,))
  return frozenset(out)


def split_axes(spec: P, axes: Sequence[str], mesh: Mesh, groups: Groups | None = None) -> tuple:
  """The axes that `spec` splits a whole value over besides the replica axes `axes` (and
  the groups' outer axis): tensor parallelism's model axes, in mesh order.

  Each of their ranks holds its own block of the value (one replica's whole value,
  `format.shape`), which every replica of `axes` repeats; wus shards each block over
  `axes` (DESIGN.md §1, meshes with more than a data axis). An axis of size 1 is kept:
  it splits nothing, and the padded shards lie as without it, but the spec that names
  it says the shards are not copies over it (`check_vma`).
  """
  used = spec_axes(spec) - set(axes) - ({groups.outer} if groups is not None else set())
  return tuple(a for a in mesh.axis_names if a in used)


def padded_spec(spec: P, axes: Sequence[str], mesh: Mesh, groups: Groups | None = None) -> P:
  """The PartitionSpec of the global array of a tensor's padded shards: the leading dim
  split over the split axes of `spec` (the blocks, `split_axes`), then over `axes` (each
  block's shards, §4.1). P(("model", "data")) for a weight P(None, "model") sharded over
  "data": device (data=d, model=m) holds shard d of block m."""
  return shard_spec((*split_axes(spec, axes, mesh, groups), *axes))


@dataclasses.dataclass(frozen=True)
class ShardedLayout:
  """How one tensor wus keeps sharded lies on the devices (§4.1, §5.2).

  Not a `jax.sharding.Sharding`: a device's shard is a range of the row-major
  tensor, in general not a box of it.

  Attributes:
    format: how one replica's whole value (shape `format.shape`: the local block
      of a tensor its spec splits over other axes) maps to the padded shards
      (shape `format.padded_shape`, §4.1).
    axes: the mesh axes the padded shards' leading dim is split over.
    spec: the PartitionSpec of the whole value in the step, over `mesh`: P()
      for a `wus.shard_map` step's replicated weights, P(None, "model") for a
      column-parallel one (its blocks, `split_axes`), the mapped axis for
      `wus.pmap`'s copies.
    mesh: the mesh the shards live on (derived from the user's for groups).
    groups: the sharding groups `mesh` was derived for (`shard_group_size`,
      §5.2), or None: `mesh` is the user's.
  """

  format: Format
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
  def split_axes(self) -> tuple:
    """The mesh axes `spec` splits the whole value over besides `axes` (tensor
    parallelism's model axis): one block (`format.shape`) per rank, each sharded
    over `axes`. () on a 1-D mesh; an axis of size 1 makes one block."""
    return split_axes(self.spec, self.axes, self.mesh, self.groups)

  @property
  def num_blocks(self) -> int:
    """The blocks the user's spec splits the value into over `split_axes`."""
    return math.prod(self.mesh.shape[a] for a in self.split_axes)

  @property
  def padded_shape(self) -> tuple[int, ...]:
    """Shape of the global array of padded shards: every block's `format.padded_shape`
    stacked on the leading dim (block-major)."""
    rows, *rest = self.format.padded_shape
    return (rows * self.num_blocks, *rest)

  @property
  def data_sharding(self) -> NamedSharding:
    """How the padded shards lie on `mesh`: the leading dim split over `split_axes`,
    then `axes` (`padded_spec`)."""
    return NamedSharding(self.mesh, padded_spec(self.spec, self.axes, self.mesh, self.groups))

  @property
  def user_mesh(self) -> Mesh:
    """The user's mesh: whole values enter and leave on it."""
    return self.mesh if self.groups is None else self.groups.mesh

  @property
  def user_spec(self) -> P:
    """`spec` over the user's mesh."""
    return self.spec if self.groups is None else self.groups.user_spec(self.spec)
