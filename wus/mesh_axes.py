"""What each mesh axis is to a step (§3.2, §5.2): the roles a front end derives
(`Roles`: batch, model, FSDP, update and copy axes), the replica (data-parallel) axes
of a shard_map step, the other axes an update repeated on every replica of them is
sharded over too, the sharding groups of `shard_group_size`, and the cost model's
devices over the update's axes.

What a step's specs split of each operand, for the Plan, is `wus.spec_splits`.
"""

from __future__ import annotations

import dataclasses
import math

from jax.sharding import Mesh

from wus.analysis import clusters, network
from wus.analysis.causes import GroupsOfOne, words
from wus.transforms import groups


@dataclasses.dataclass(frozen=True)
class Roles:
  """What each mesh axis is to a step, as its front end derives it (DESIGN.md §1).

  Only axes of size > 1 have a role (`Roles.of` drops the others: an axis of size 1
  splits nothing); each tuple is in mesh order.

  Attributes:
    batch: the axes the batch is split over (data parallelism).
    model: the axes the state is placed over besides them (tensor parallelism).
    fsdp: the batch axes the state is placed over itself (FSDP).
    update: the axes each update is sharded over (§3.2): the batch axes no weight's
      gradient is reduce-scattered over to its block (HSDP's "replica" beside "fsdp"),
      or every batch axis.
    copy_axes: the other axes an update identical on all their replicas is sharded over
      too (`Plan.copy_axes`).
  """

  batch: tuple[str, ...]
  model: tuple[str, ...] = ()
  fsdp: tuple[str, ...] = ()
  update: tuple[str, ...] = ()
  copy_axes: tuple[str, ...] = ()

  @staticmethod
  def of(mesh: Mesh, batch, placed=(), blocked=()) -> Roles:
    """The roles on `mesh` of the axes the batch is split over (`batch`), the state is
    placed over (`placed`) and FSDP gradients are reduce-scattered over to their blocks
    (`blocked`); each an iterable of axis names."""
    def ordered(names) -> tuple:
      names = set(names)
      return tuple(a for a in mesh.axis_names if a in names and mesh.shape[a] > 1)
    batch, placed = ordered(batch), ordered(placed)
    update = tuple(a for a in batch if a not in set(blocked)) or batch
    return Roles(batch, tuple(a for a in placed if a not in batch),
                 tuple(a for a in placed if a in batch), update,
                 ordered(a for a in mesh.axis_names if a not in update))


def copy_sizes(allowed: bool, mesh: Mesh, manual: frozenset, axes: tuple, home) -> dict:
  """The other manual axes (size > 1, mesh order) an update repeated on all their replicas
  is sharded over too, with their sizes (`PlanRequest.copy_sizes`, `Plan.copy_axes`): none
  unless `allowed` (a `wus.shard_map` step without `axis_name`), nor with sharding
  groups."""
  if not allowed or home is not None:
    return {}
  return {a: mesh.shape[a] for a in mesh.axis_names
          if a in manual and a not in axes and mesh.shape[a] > 1}


def sharding_groups(mesh: Mesh, axes: tuple, group_size: int) -> tuple[groups.Groups | None, str]:
  """The sharding groups of `shard_group_size` (§5.2): (the Groups, None for
  G = N or G = 1; the grouping in words, for the Plan, for G = 1 the reason the
  update stays replicated).

  Raises:
    ValueError: several sharding axes, or a G that does not divide N.
  """
  if len(axes) != 1:
    raise ValueError(
        f"shard_group_size groups the replicas of one mesh axis, but the update would be "
        f"sharded over {list(axes)}; pass axis_name= one of them, or drop shard_group_size "
        "and name the sharding axes of a mesh with the groups as an axis (partial sharding, "
        "§5.2)")
  (axis,) = axes
  size, g = mesh.shape[axis], group_size
  found = groups.derive(mesh, axis, g)  # Raises for a G that does not divide N.
  if g == 1:
    why = words(GroupsOfOne(axis))
    return None, why
  if g == size:
    return None, (f"shard_group_size={g}: one group of all {size} replicas of {axis!r} "
                  "(plain sharding)")
  return found, found.describe()


def topology_for(topology: network.Topology | None, mesh: Mesh, axes: tuple,
                  num_shards: int) -> network.Topology:
  """The cost model's devices: the user's topology (of a sharding group's devices
  when it describes all of the axis; of one data group, `Topology.strided`, when it
  describes every device of the mesh, listed in the mesh's order), or one from the
  mesh's processes."""
  t = topology
  if t is not None:
    if t.num_devices == num_shards:
      return t
    names = list(mesh.axis_names)
    first, last = min(map(names.index, axes)), max(map(names.index, axes))
    between = [a for a in names[first:last + 1] if a not in axes and mesh.shape[a] > 1]
    stride = math.prod(mesh.shape[a] for a in names[last + 1:])
    try:  # Sharding groups, or the data groups of a data x model mesh.
      if t.num_devices == mesh.size and not between:
        return t.strided(stride, num_shards)
      return dataclasses.replace(t, axes=t.split(num_shards)[0])
    except ValueError:
      raise ValueError(f"topology= describes {t.num_devices} devices, but the update is "
                       f"sharded over {num_shards} ({list(axes)}); describe those (or all "
                       "the devices of the axis, for shard_group_size, or of the mesh, in "
                       "the mesh's order)") from None
  # The devices of one sharding group (the other axes at 0), fast axis last.
  group = mesh.devices[tuple(slice(None) if a in axes else 0 for a in mesh.axis_names)]
  first = group.flat[0].process_index
  local = sum(d.process_index == first for d in group.flat)
  host = sum(d.process_index == first for d in mesh.devices.flat)
  return network.default_topology(num_shards, local if num_shards % local == 0 else None,
                                  platform=group.flat[0].platform, host_devices=host)


def replica_axes(axis_name, mesh: Mesh, manual: frozenset, jaxpr, state: list) -> tuple:
  """The data-parallel axes, in mesh order."""
  if axis_name is None:
    wanted = clusters.gradient_axes(jaxpr, {tuple(v.aval.shape) for v in state}) or manual
  else:
    wanted = frozenset([axis_name] if isinstance(axis_name, str) else axis_name)
    if not wanted <= manual:
      raise ValueError(f"axis_name {sorted(wanted)} must be manual axes of the shard_map; "
                       f"they are {sorted(manual)}")
  return tuple(a for a in mesh.axis_names if a in wanted)
