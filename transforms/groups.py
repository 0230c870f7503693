"""Sharding groups of G consecutive replicas of one mesh axis (§5.2, Fig. 10).

`shard_group_size=G` on a data-parallel axis of N = M x G replicas: wus
compiles its programs on a mesh it derives from the same devices, the axis
split row-major into two, `<axis>.groups` (M) x `<axis>.in_group` (G), so a
group is G consecutive devices of the axis (in multi-process runs, devices of
one process). The traced step is renamed onto it (`inline.inlined`'s
`rename`): a collective over the axis runs over the pair, `axis_index` is
group * G + index in group, and in/out specs split over the pair lay out
exactly as over the axis. Sharding over `<axis>.in_group` alone is then the
partial sharding of a mesh with several data-parallel axes: reduce-scatter
within each group, the shards all-reduced across the groups, the update on
1/G, all-gather within the group.

Values enter the compiled programs on the derived mesh and leave on the
user's (`place`), so users never see it; sharded state lives on it, and its
layout (`transforms.layout.ShardedLayout`) carries the Groups with it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import numpy as np
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P


@dataclasses.dataclass(frozen=True)
class Groups:
  """One mesh axis split into sharding groups of consecutive replicas.

  Attributes:
    mesh: the user's mesh.
    axis: the axis split (size N).
    group_size: G, replicas per group; M = N / G groups.
    derived: the mesh the programs run on: `mesh` with `axis` replaced by
      (`outer`, `inner`) of sizes (M, G), the same devices in the same order.
    outer, inner: the new axes' names: across groups and within a group.
  """

  mesh: Mesh
  axis: str
  group_size: int
  derived: Mesh
  outer: str
  inner: str

  @property
  def size(self) -> int:
    """N, the replicas along `axis`."""
    return self.mesh.shape[self.axis]

  @property
  def num_groups(self) -> int:
    return self.size // self.group_size

  @property
  def rename(self) -> dict[str, tuple[str, str]]:
    """The axis -> the pair that replaces it."""
    return {self.axis: (self.outer, self.inner)}

  def derived_spec(self, spec: P) -> P:
    """`spec` (over the user's mesh) over the derived mesh: the axis becomes the pair."""
    return _respec(spec, lambda n: self.rename.get(n, (n,)))

  def user_spec(self, spec: P) -> P:
    """The inverse of `derived_spec`."""
    pair = (self.outer, self.inner)

    def back(entry: tuple) -> tuple:
      for k in range(len(entry) - 1):
        if entry[k:k + 2] == pair:
          return (*entry[:k], self.axis, *entry[k + 2:])
      return entry
    return P(*[None if e is None else _entry(back(e if isinstance(e, tuple) else (e,)))
               for e in spec])

  def describe(self) -> str:
    return (f"shard_group_size={self.group_size}: partial sharding (§5.2) of mesh axis "
            f"{self.axis!r} ({self.size} replicas) in {self.num_groups} groups of "
            f"{self.group_size} consecutive replicas")


def _entry(names: tuple) -> Any:
  return names[0] if len(names) == 1 else names


def _respec(spec: P, f) -> P:
  out = []
  for e in spec:
    if e is None:
      out.append(None)
    else:
      out.append(_entry(tuple(r for n in (e if isinstance(e, tuple) else (e,)) for r in f(n))))
  return P(*out)


def check_group_size(group_size: Any) -> None:
  """Raises ValueError unless `group_size` is None, "auto" or a positive int."""
  if group_size is None or group_size == "auto":
    return
  if (isinstance(group_size, bool) or not isinstance(group_size, (int, np.integer))
      or group_size < 1):
    raise ValueError(f"shard_group_size must be a positive int, the replicas per sharding group "
                     f"(§5.2), \"auto\" for the cost model's choice, or None for one group of all "
                     f"replicas; got {group_size!r}")


@functools.lru_cache(maxsize=None)
def derive(mesh: Mesh, axis: str, group_size: int) -> Groups:
  """The sharding groups of `group_size` consecutive replicas of `mesh`'s `axis`.

  Args:
    mesh: the user's mesh.
    axis: one of its axes.
    group_size: G; it must divide the axis size N.

  Returns:
    The Groups, with the derived mesh (the same devices, reshaped).

  Raises:
    ValueError: G does not divide N or exceeds it.
  """
  size = mesh.shape[axis]
  if group_size > size or size % group_size:
    divisors = [g for g in range(1, size + 1) if size % g == 0]
    raise ValueError(f"shard_group_size={group_size} must divide the {size} replicas of mesh "
                     f"axis {axis!r}: pass one of {divisors} ({size}: one group, plain "
                     "sharding; 1: no sharding)")
  k = mesh.axis_names.index(axis)
  outer, inner = _fresh(f"{axis}.groups", mesh), _fresh(f"{axis}.in_group", mesh)
  shape = (*mesh.devices.shape[:k], size // group_size, group_size, *mesh.devices.shape[k + 1:])
  types = tuple(mesh.axis_types)
  derived = Mesh(mesh.devices.reshape(shape),
                 (*mesh.axis_names[:k], outer, inner, *mesh.axis_names[k + 1:]),
                 axis_types=(*types[:k], types[k], types[k], *types[k + 1:]))
  return Groups(mesh, axis, int(group_size), derived, outer, inner)


def _fresh(name: str, mesh: Mesh) -> str:
  while name in mesh.axis_names:
    name += "_"
  return name


def on(mesh: Mesh):
  """A context in which to trace a shard_map over the derived `mesh`, also
  inside the user's `jax.set_mesh` (whose mesh must otherwise match)."""
  return jax.sharding.use_abstract_mesh(mesh.abstract_mesh)


def place(x: jax.Array, sharding: NamedSharding) -> jax.Array:
  """`x` laid out by `sharding`, inside `jax.jit`, where the layout is the same
  on another mesh of the same devices: moves no data.

  Explicit mesh axes are part of a value's type (`jax.reshard`); Auto ones
  only a constraint on it.
  """
  if all(t == AxisType.Explicit for t in sharding.mesh.axis_types):
    return jax.reshard(x, sharding)
  return lax.with_sharding_constraint(x, sharding)
