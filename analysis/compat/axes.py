"""Mesh axes in equations and types: collectives' axes, renaming them, varying types."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jax._src import mesh as _mesh_lib
from jax.sharding import NamedSharding, PartitionSpec as P

from wus.analysis.compat.handles import Jaxpr, JaxprEqn, is_literal, reshard_p, sub_jaxprs
from wus.analysis.compat.source import source_line


def without_result_layout(eqn: JaxprEqn) -> dict[str, Any]:
  """Params that drop an equation's result layout (jax 0.10: `sharding` of
  elementwise ops describes the whole value; a shard has none); {} if none."""
  return {"sharding": None} if eqn.params.get("sharding") is not None else {}


def has_result_layout(eqn: JaxprEqn) -> bool:
  """Whether the equation fixes its result's layout (`sharding` / `out_sharding`)."""
  return any(eqn.params.get(k) is not None for k in ("sharding", "out_sharding"))


def collective_axes(eqn: JaxprEqn) -> tuple[Any, ...]:
  """The mesh axes a collective runs over, as a tuple of names."""
  p = eqn.params
  axes = p.get("axes", p.get("axis_name"))
  return tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)


def has_axis_index_groups(eqn: JaxprEqn) -> bool:
  return eqn.params.get("axis_index_groups") is not None


# The params that name the mesh axes of a collective (jax 0.10: psum, pvary and
# psum_invariant say `axes`; all_gather, ppermute, axis_index `axis_name`).
_AXIS_PARAMS = ("axes", "axis_name")


def renamed_axes(eqn: JaxprEqn, rename: dict[Any, tuple]) -> dict[str, Any]:
  """The params of `eqn` naming mesh axes, with each axis of `rename` replaced
  by its tuple of axes ({} when `eqn` names none of them).

  `psum[axes=(data,)]` with `{"data": ("g", "i")}` gives `{"axes": ("g", "i")}`.
  Collectives over a tuple of axes index its devices row-major, so a
  permutation, a source index or a gathered order over the pair is the one
  over the axis it replaces when the pair splits it row-major.

  Raises:
    NotImplementedError: a renamed axis appears elsewhere in the params
      (`axis_index_groups`, a primitive of another kind), so renaming could
      change what the equation computes.
  """
  out = {}
  for key, value in eqn.params.items():
    if key in _AXIS_PARAMS and value is not None:
      names = tuple(value) if isinstance(value, (tuple, list)) else (value,)
      if any(n in rename for n in names):
        out[key] = tuple(r for n in names for r in rename.get(n, (n,)))
    elif isinstance(value, NamedSharding):
      # A result's layout (`sharding`, `out_sharding`): on the current mesh.
      out[key] = value.update(mesh=_mesh_lib.get_abstract_mesh(),
                              spec=P(*[_renamed_entry(e, rename) for e in value.spec]))
    elif _mentions(value, rename):
      raise NotImplementedError(
          f"{eqn.primitive} at {source_line(eqn)} names mesh axis "
          f"{sorted(n for n in rename if _mentions(value, {n: ()}))} in its {key!r}; "
          "shard_group_size cannot split that axis into groups here. Use a mesh with the "
          "groups as an axis of their own and axis_name= (partial sharding, §5.2)")
  if out and has_axis_index_groups(eqn):
    raise NotImplementedError(f"{eqn.primitive} at {source_line(eqn)} uses axis_index_groups; "
                              "shard_group_size cannot regroup it")
  return out


def _renamed_entry(entry: Any, rename: dict) -> Any:
  """A PartitionSpec entry with the renamed axes replaced."""
  if entry is None or entry is P.UNCONSTRAINED:
    return entry
  names = tuple(r for n in (entry if isinstance(entry, tuple) else (entry,))
                for r in rename.get(n, (n,)))
  return names[0] if len(names) == 1 else names


def _mentions(value: Any, names: dict) -> bool:
  """Whether a param value (not a jaxpr) holds one of `names`."""
  if isinstance(value, str):
    return value in names
  if isinstance(value, (tuple, list, frozenset, set)):
    return any(_mentions(v, names) for v in value)
  return False


def names_axes(jaxpr: Jaxpr, names: dict) -> bool:
  """Whether `jaxpr` (nested jaxprs included) refers to a mesh axis of `names`:
  in an equation's params or in a value's varying-axes type. One that does
  not (a scatter's combiner, a custom rule's scalar function) runs the same
  on any mesh."""
  for v in (*jaxpr.invars, *jaxpr.outvars, *jaxpr.constvars):
    if not is_literal(v) and varying_axes(v.aval) & set(names):
      return True
  for eqn in jaxpr.eqns:
    if any(_mentions(p, names) for k, p in eqn.params.items()
           if k in _AXIS_PARAMS or not isinstance(p, str)):
      return True
    if any(varying_axes(v.aval) & set(names) for v in eqn.outvars):
      return True
    if any(names_axes(sub, names) for sub in sub_jaxprs(eqn)):
      return True
  return False


def varying_axes(aval: Any) -> frozenset:
  """JAX's own varying-manual-axes type of an aval (empty with check_vma=False)."""
  mat = getattr(aval, "mat", None)
  return frozenset(mat.varying) if mat is not None else frozenset()


def match_varying(values: Sequence[Any], keys: Sequence[Any] | None = None,
                  cache: dict | None = None) -> list[Any]:
  """Casts values to the union of their varying axes, as jax.numpy does.

  With check_vma=True a primitive's operands must agree on which manual axes
  they vary over; a shard (varying) meeting a scalar (invariant) needs the
  scalar cast with `lax.pcast(..., to="varying")`, which moves no data.

  Args:
    values: the operands.
    keys: optionally a hashable key per value (None: not cached) naming what
      it is, for example its jaxpr variable.
    cache: with `keys`, casts made so far under the current trace, by key and
      axes; each value is cast once.
  """
  import jax
  from jax import lax
  types = [varying_axes(jax.typeof(x)) for x in values]
  union = frozenset().union(*types)
  out = []
  for x, t, key in zip(values, types, keys or [None] * len(values), strict=True):
    axes = tuple(sorted(union - t))
    if not axes:
      out.append(x)
    elif key is None or cache is None:
      out.append(lax.pcast(x, axes, to="varying"))
    else:
      if (key, axes) not in cache:
        cache[key, axes] = lax.pcast(x, axes, to="varying")
      out.append(cache[key, axes])
  return out


def to_varying(x: Any, axes: Sequence[Any]) -> Any:
  """`x` cast to vary over `axes` (with check_vma; a no-op without), moving no data."""
  import jax
  from jax import lax
  missing = tuple(a for a in axes if a not in varying_axes(jax.typeof(x)))
  return lax.pcast(x, missing, to="varying") if missing else x


def sharding_spec(aval: Any) -> tuple[tuple, frozenset]:
  """(the PartitionSpec entries, the unreduced axes) of a value's type: empty
  on a mesh with Auto axes, where the types carry no sharding."""
  sharding = getattr(aval, "sharding", None)
  if sharding is None or getattr(sharding, "spec", None) is None:
    return (), frozenset()
  spec = sharding.spec
  return tuple(spec), frozenset(getattr(spec, "unreduced", ()) or ())


def type_axes(aval: Any) -> tuple:
  """The (name, type) of each axis of the mesh in a value's type: `jax.sharding.auto_axes`
  retypes a value onto Auto axes without moving it; () when its type carries no mesh."""
  mesh = getattr(getattr(aval, "sharding", None), "mesh", None)
  if mesh is None or not getattr(mesh, "axis_names", ()):
    return ()
  return tuple(zip(mesh.axis_names, mesh.axis_types, strict=True))


def explicit_axes(mesh: Any) -> frozenset:
  """The mesh axes of type Explicit (sharding in types, `jax.make_mesh`'s default)."""
  from jax.sharding import AxisType
  return frozenset(a for a, t in zip(mesh.axis_names, mesh.axis_types, strict=True)
                   if t == AxisType.Explicit)


def legacy_mesh() -> Any:
  """The mesh of the legacy `with mesh:` context (pjit's resource environment), None outside
  one or where a `jax.set_mesh` mesh is set (`jax.jit` then resolves PartitionSpecs itself).

  pjit resolves the PartitionSpecs of its `in_shardings` / `out_shardings` on this mesh at
  call time; `jax.jit` does not read it. The context lives in jax._src.mesh
  (`thread_resources.env.physical_mesh`) in every release wus supports.
  """
  if not _mesh_lib.get_concrete_mesh().empty or not _mesh_lib.get_abstract_mesh().empty:
    return None
  mesh = _mesh_lib.thread_resources.env.physical_mesh
  return None if mesh.empty else mesh


def is_sharding_constraint(eqn: JaxprEqn) -> bool:
  """Whether `eqn` only lays its value out (`with_sharding_constraint`, `reshard`)."""
  from jax import lax
  return eqn.primitive in (lax.sharding_constraint_p, reshard_p)


def lays_out(eqn: JaxprEqn) -> bool:
  """Whether a sharding constraint constrains the layout when lowered: a `reshard` over a
  mesh whose axes are all Auto lowers to nothing (JAX >= 0.11 inserts them on Auto meshes
  as sharding-in-types bookkeeping, e.g. in `broadcast_in_dim`; `mlir.lower_with_sharding_
  in_types` returns its operand)."""
  if eqn.primitive is not reshard_p:
    return True
  mesh = getattr(eqn.params.get("dst_sharding"), "mesh", None)
  return not getattr(mesh, "are_all_axes_auto", False)


def constraint_spec(eqn: JaxprEqn) -> P | None:
  """The PartitionSpec a sharding constraint lays its value out by; None for other
  equations or a constraint wus cannot read (not a NamedSharding or PartitionSpec)."""
  if not is_sharding_constraint(eqn):
    return None
  sharding = eqn.params.get("sharding", eqn.params.get("dst_sharding"))
  spec = sharding.spec if isinstance(sharding, NamedSharding) else sharding
  return spec if isinstance(spec, P) else None


def placement_axes(eqn: JaxprEqn) -> frozenset | None:
  """The mesh axes a sharding constraint (`with_sharding_constraint`, `reshard`,
  `eqx.filter_shard` inside jit) lays its value out over; None for other equations or
  a constraint wus cannot read (not a NamedSharding or PartitionSpec)."""
  spec = constraint_spec(eqn)
  if spec is None:
    return None
  names = set(getattr(spec, "unreduced", ()) or ()) | set(getattr(spec, "reduced", ()) or ())
  for entry in spec:
    names.update(() if entry is None else entry if isinstance(entry, tuple) else (entry,))
  return frozenset(names)


def laid_out(x: Any, spec: P) -> Any:
  """`x` resharded to `spec` where its type lays it out otherwise (a mesh with Explicit
  axes: `jax.sharding.reshard`, which moves data only where the layouts differ: not for
  an axis of size 1); `x` itself on Auto axes, where types carry no layout."""
  import jax
  aval = jax.typeof(x)
  have, _ = sharding_spec(aval)
  if not any(t == jax.sharding.AxisType.Explicit for _, t in type_axes(aval)):
    return x
  ndim = len(aval.shape)
  if _entries(have, ndim) == _entries(tuple(spec), ndim):
    return x
  return jax.sharding.reshard(x, spec)


def _entries(spec: tuple, ndim: int) -> tuple:
  """Per dim, the tuple of axes a PartitionSpec's entry names."""
  padded = (*spec, *(None,) * (ndim - len(spec)))[:ndim]
  return tuple(() if e is None else e if isinstance(e, tuple) else (e,) for e in padded)
