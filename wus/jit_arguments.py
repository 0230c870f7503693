"""`jax.jit`'s calling convention as `wus.jit` reads it: the keywords (`jax.jit` resolved
per call, static arguments, the shardings `in_shardings` / `out_shardings` declare per
leaf, what pins a step to one device, the options wus's own program takes) and each
call's dynamic leaves (their structure, cache key, value as traced, refs).

What the placements of those leaves say (the mesh, the batch axes and splits) is
`wus.jit_placement`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from wus.analysis import compat, refusals
from wus.analysis.reasons import Reason
from wus import runtime
from wus.sharded import is_sharded


class Jitted:
  """`jax.jit(fun, **jit_kwargs)` as the context of each call resolves it.

  Under the legacy `with mesh:` context (pjit's; `compat.legacy_mesh`), PartitionSpecs in
  `in_shardings` / `out_shardings` name axes of that mesh, as `pjit` resolves them at call
  time, and `REPLICATED` (`wus.pjit`'s None) is replicated on it; `jax.jit` itself takes
  PartitionSpecs only from a `jax.set_mesh` mesh. One `jax.jit` per such mesh.
  """

  def __init__(self, fun: Callable, jit_kwargs: dict):
    self._fun, self._given = fun, jit_kwargs
    self._specs = any(isinstance(s, P) or s is REPLICATED
                      for k in ("in_shardings", "out_shardings") if k in jit_kwargs
                      for s in jax.tree.leaves(jit_kwargs[k], is_leaf=_is_sharding_leaf))
    self._by_mesh: dict = {None: jax.jit(fun, **self._resolved(None))}  # Checks them now.

  def mesh(self) -> Mesh | None:
    """The mesh this call's PartitionSpecs resolve on; None where JAX resolves them."""
    return compat.legacy_mesh() if self._specs else None

  def kwargs(self) -> dict:
    """The `jax.jit` keywords as this call reads them."""
    return self._resolved(self.mesh())

  def _resolved(self, mesh: Mesh | None) -> dict:
    if not self._specs:
      return self._given

    def resolve(s):
      if s is REPLICATED:
        s = None if mesh is None else P()
      return NamedSharding(mesh, s) if isinstance(s, P) and mesh is not None else s
    return {k: jax.tree.map(resolve, v, is_leaf=_is_sharding_leaf)
            if k in ("in_shardings", "out_shardings") else v for k, v in self._given.items()}

  def jitted(self):
    """`jax.jit` of the step with this call's keywords."""
    mesh = self.mesh()
    if mesh not in self._by_mesh:
      self._by_mesh[mesh] = jax.jit(self._fun, **self._resolved(mesh))
    return self._by_mesh[mesh]


class _Replicated:
  """`pjit`'s None in `in_shardings` / `out_shardings`: replicated on the context's mesh
  (unspecified without one)."""

  def __repr__(self) -> str:
    return "REPLICATED"


REPLICATED = _Replicated()


def _is_sharding_leaf(x) -> bool:
  return x is None or isinstance(x, (jax.sharding.Sharding, P))


def static_args(fun: Callable, jit_kwargs: dict) -> tuple[frozenset, frozenset]:
  """The static argument positions and names, inferred from each other as `jax.jit` does."""
  return compat.static_args(fun, jit_kwargs.get("static_argnums"),
                            jit_kwargs.get("static_argnames"))


def pinned(jit_kwargs: dict) -> Reason | None:
  """Why a step runs as `jax.jit` runs it whatever its arguments (`device=` or `backend=`
  pins it to one device: no data parallelism, `refusals.Pinned`); None where nothing
  pins it."""
  given = tuple((k, repr(jit_kwargs[k])) for k in ("device", "backend") if k in jit_kwargs)
  return Reason(refusals.Pinned(given)) if given else None


def program_options(jit_kwargs: dict) -> dict:
  """The user's `jax.jit` options that wus's own program of the step takes as well:
  `compiler_options` (XLA's) and `keep_unused`."""
  return {k: jit_kwargs[k] for k in ("compiler_options", "keep_unused") if k in jit_kwargs}


def dyn_structure(args: tuple, kwargs: dict, static_nums: frozenset, static_names: frozenset):
  """The tree structure of the dynamic arguments, `(args, kwargs)` as `jax.jit` flattens them."""
  return jax.tree.structure(
      (tuple(x for i, x in enumerate(args) if i not in static_nums),
       {k: v for k, v in kwargs.items() if k not in static_names}), is_leaf=is_sharded)


def leaf_key(x) -> tuple:
  """The cache key of one leaf: `runtime.leaf_signature` (logical shape, dtype, weak type;
  sharded state keys as the whole value it stands for) and the mesh axes of size > 1 it is
  split over (a weight placed over an (8, 1) mesh's "model" axis is whole, and keys as such)."""
  if is_sharded(x):
    spec = x.spec
  else:
    sharding = getattr(x, "sharding", None)
    spec = (P(*[_without_size_1(e, sharding.mesh) for e in sharding.spec])
            if isinstance(sharding, NamedSharding) else None)
  return (*runtime.leaf_signature(x), (runtime.normal(spec) or None) if spec is not None else None)


def _without_size_1(entry, mesh):
  """One PartitionSpec entry without the mesh axes of size 1 (they split nothing)."""
  names = tuple(n for n in (entry if isinstance(entry, tuple) else (entry,))
                if entry is not None and mesh.shape.get(n, 2) > 1)
  return None if not names else names[0] if len(names) == 1 else names


def declared(shardings: Any, tree: Any, leaves: list) -> list:
  """Per leaf of `tree`, the sharding `in_shardings` / `out_shardings` (a pytree prefix, or
  one for all) gives it; None where it gives none."""
  if shardings is None:
    return [None] * len(leaves)

  def is_leaf(x):
    return x is _UNSPECIFIED or isinstance(x, (jax.sharding.Sharding, P))
  if is_leaf(shardings):
    return [shardings] * len(leaves)
  # The prefix's None (unspecified) is a leaf there; a None in `tree` is an empty subtree.
  prefix = jax.tree.map(lambda s: _UNSPECIFIED if s is None else s, shardings,
                        is_leaf=lambda x: x is None or is_leaf(x))
  return [None if s is _UNSPECIFIED else s for s in
          jax.tree.leaves(jax.tree.broadcast(prefix, tree, is_leaf=is_leaf), is_leaf=is_leaf)]


_UNSPECIFIED = object()  # A None of `in_shardings` / `out_shardings`, while broadcast.


def named(sharding, mesh: Mesh | None):
  """A PartitionSpec as a NamedSharding on `mesh` (other shardings as they are)."""
  if isinstance(sharding, P) and mesh is not None:
    return NamedSharding(mesh, sharding)
  return sharding


def abstract(x, mesh: Mesh | None):
  """A leaf as traced: sharded state as the whole value it stands for."""
  if is_sharded(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(x.mesh, x.spec))
  return x


def refs(closed, paths: list[str]) -> list[str]:
  """The arguments (and closed-over values) of the traced step that are JAX refs."""
  out = [name for name, a in zip(paths, closed.in_avals, strict=True) if compat.is_ref_type(a)]
  return out + [f"a ref the step closes over, {v.aval.str_short()}"
                for v in closed.jaxpr.constvars if compat.is_ref_type(v.aval)]
