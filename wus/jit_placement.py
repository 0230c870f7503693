"""What `wus.jit` derives from the placements of a step's arguments: the mesh the step
runs on, the batch axes, the batch's splits of every value, and where the program takes
a leaf it keeps whole.

A `jax.jit` step says where its batch lies by where its arguments are placed (each
leaf's `NamedSharding`, or the one `in_shardings` declares for it: `jit_arguments.
declared`): the mesh is the largest such placement's (or the one set with
`jax.set_mesh`), the batch axes are the axes some argument is split over, and the
batch's splits are those placements carried through the step
(`analysis.propagation`). Sharded state (`ShardedArray`) is no placement of the batch.
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from wus.analysis import compat, propagation
from wus.sharded import is_sharded


def mesh_of(leaves: list, declared: list) -> Mesh | None:
  """The mesh of the arguments (of the largest NamedSharding, `in_shardings` included), or
  the one set with `jax.set_mesh` (or the legacy `with mesh:`); None for a single device.

  Of meshes of one size, the first some leaf is split over: Keras's guide to data
  parallelism replicates the variables on a mesh with an axis "_" and splits the batch
  on one with an axis "batch", both over the same devices, and jax.jit takes both."""
  shardings = [getattr(x, "sharding", None) for x in leaves if not is_sharded(x)] + declared
  named = [s for s in shardings if isinstance(s, NamedSharding)]
  meshes = [x.mesh for x in leaves if is_sharded(x)] + [s.mesh for s in named]
  meshes = [m for m in meshes if isinstance(m, Mesh) and m.size > 1]
  if meshes:
    split = {s.mesh for s in named if any(e is not None for e in s.spec)}
    return max(meshes, key=lambda m: (m.size, m in split))
  current = jax.sharding.get_mesh()
  if current.empty:
    current = compat.legacy_mesh() or current
  return None if current.empty or current.size == 1 else current


def batch_axes(leaves: list, declared: list, mesh: Mesh | None, among=None) -> tuple:
  """The mesh axes some argument is split over (among `among`, if given), in mesh order.

  An axis of size 1 splits nothing (DESIGN.md §1): Flax's `("data", "model")` meshes
  of shape (N, 1), with weights annotated for the unused axis, are the N-device
  data-parallel mesh.
  """
  if mesh is None:
    return ()
  used = set()
  for x, d in zip(leaves, declared, strict=True):
    sharding = d or getattr(x, "sharding", None)
    if not is_sharded(x) and isinstance(sharding, NamedSharding) and sharding.mesh == mesh:
      for e in sharding.spec:
        used.update(() if e is None else e if isinstance(e, tuple) else (e,))
  return tuple(a for a in mesh.axis_names if a in used and mesh.shape[a] > 1
               and (among is None or a in among))


def batch_splits(jaxpr, leaves: list, declared: list, mesh: Mesh,
                 state: frozenset) -> dict:
  """The batch's splits of the flat jaxpr's values (`analysis.propagation`): seeded by the
  placements of the arguments that are not state (`state`: flat positions of the leaves
  with a next value), carried through the step with its sharding constraints and, on a
  mesh with Explicit axes, its types."""
  seeds = {}
  for k, (x, d, v) in enumerate(zip(leaves, declared, jaxpr.invars, strict=True)):
    sharding = d or getattr(x, "sharding", None)
    if (k in state or is_sharded(x) or not isinstance(sharding, NamedSharding)
        or sharding.mesh != mesh):  # On another mesh: read as unplaced (batch_axes too).
      continue
    entries = (*sharding.spec, *(None,) * (v.aval.ndim - len(sharding.spec)))[:v.aval.ndim]
    seeds[v] = tuple(tuple(a for a in (e if isinstance(e, tuple) else (e,))
                           if e is not None and mesh.shape[a] > 1) or None for e in entries)
  return propagation.batch_splits(jaxpr, seeds, frozenset(jaxpr.invars[k] for k in state),
                                  dict(mesh.shape), types=bool(compat.explicit_axes(mesh)))


def placement(x, mesh: Mesh) -> NamedSharding:
  """Where the program takes a whole leaf: as placed on the mesh, else replicated."""
  sharding = getattr(x, "sharding", None)
  if isinstance(sharding, NamedSharding) and sharding.mesh == mesh and not is_sharded(x):
    return sharding
  return NamedSharding(mesh, P())
