"""The one place wus touches JAX internals (DESIGN.md §4, invariant 4).

Everything else in wus names primitives through the objects exported here and
reads control-flow equations through the accessors below, never by string.
Written against jax 0.10.2 (the range pinned in pyproject.toml); when a later
JAX moves a name, this module is the only one to change.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as _np
from jax import lax
from jax._src import core as _core
from jax._src import source_info_util as _source_info
from jax._src.interpreters import partial_eval as _pe
from jax._src import ad_util as _ad_util
from jax._src import api_util as _api_util
from jax._src import linear_util as _lu
from jax._src import literals as _literals
from jax._src import mesh as _mesh_lib
from jax._src import dispatch as _dispatch
from jax._src import pjit as _pjit
from jax._src.lax import linalg as _linalg
from jax._src.lax import ann as _ann
from jax._src.lax import lax as _lax
from jax._src.lax import slicing as _slicing
from jax._src.lax import parallel as _parallel
from jax._src.lax.control_flow import conditionals as _conditionals
from jax._src.random import core as _random_core
from jax._src.random import philox2x32 as _philox2x32
from jax._src.random import philox4x32 as _philox4x32
from jax._src.random import prng as _prng
from jax._src.random import threefry4x32 as _threefry4x32
from jax._src.shard_map import Infer as INFER  # noqa: F401  (jax.shard_map's in_specs default)
from jax._src.shard_map import shard_map_p  # noqa: F401  (re-exported)
from jax.extend import core as _ecore
from jax.sharding import NamedSharding, PartitionSpec as P
from jax.extend.core import primitives as _p

# Types.
ClosedJaxpr = _ecore.ClosedJaxpr
Jaxpr = _ecore.Jaxpr
JaxprEqn = _ecore.JaxprEqn
Literal = _ecore.Literal
Var = _ecore.Var
DropVar = _ecore.DropVar
Primitive = _ecore.Primitive

# Collectives. With check_vma=True `lax.psum` binds psum_invariant and AD
# inserts it as the transpose of pvary (DESIGN.md §5).
psum_p = _p.psum_p
psum_invariant_p = _parallel.psum_invariant_p
pmax_p = _p.pmax_p
pmin_p = _p.pmin_p
pvary_p = _core.pvary_p
all_gather_p = _p.all_gather_p
all_gather_invariant_p = _parallel.all_gather_invariant_p
reduce_scatter_p = _parallel.reduce_scatter_p
all_to_all_p = _p.all_to_all_p
ragged_all_to_all_p = _p.ragged_all_to_all_p
ppermute_p = _p.ppermute_p
pbroadcast_p = _parallel.pbroadcast_p
axis_index_p = _p.axis_index_p

# Control flow and calls.
cond_p = _p.cond_p
while_p = _p.while_p
scan_p = _p.scan_p
jit_p = _p.jit_p
closed_call_p = _p.closed_call_p
remat_p = _p.remat_p
custom_jvp_call_p = _p.custom_jvp_call_p
custom_vjp_call_p = _p.custom_vjp_call_p

# Not exported by jax.lax.
add_any_p = _p.add_jaxvals_p
random_bits_p = _p.random_bits_p
random_split_p = _p.random_split_p
random_fold_in_p = _p.random_fold_in_p
random_seed_p = _p.random_seed_p
random_wrap_p = _prng.random_wrap_p
random_unwrap_p = _prng.random_unwrap_p
threefry2x32_p = _p.threefry2x32_p
threefry4x32_p = _threefry4x32.threefry4x32_p
philox2x32_p = _philox2x32.philox2x32_p
philox4x32_p = _philox4x32.philox4x32_p
iota_2x32_shape_p = _prng.iota_2x32_shape_p
random_gamma_p = _random_core.random_gamma_p
random_clone_p = _random_core.random_clone_p
# jax.numpy's stack / unstack / tile bind primitives of their own (jax 0.10).
stack_p = _lax.stack_p
unstack_p = _lax.unstack_p
tile_p = _lax.tile_p
mulhi_p = _lax.mulhi_p
ragged_dot_general_p = _lax.ragged_dot_general_p
approx_top_k_p = _ann.approx_top_k_p
platform_index_p = _conditionals.platform_index_p
reshard_p = _pjit.reshard_p
layout_constraint_p = _pjit.layout_constraint_p
device_put_p = _dispatch.device_put_p
zeros_like_p = _ad_util.zeros_like_p
geqrf_p = _linalg.geqrf_p
geqp3_p = _linalg.geqp3_p


# Calls whose inner jaxpr is evaluated as is: (primitive, param holding it).
# After AD the custom_jvp/custom_vjp rules are dead; evaluating call_jaxpr is
# exactly what XLA runs.
CALL_JAXPR_PARAM: dict[Primitive, str] = {
    jit_p: "jaxpr",
    closed_call_p: "call_jaxpr",
    custom_jvp_call_p: "call_jaxpr",
    custom_vjp_call_p: "call_jaxpr",
    remat_p: "jaxpr",
}


def call_jaxpr(eqn: JaxprEqn) -> ClosedJaxpr:
  """The inner jaxpr of a call-like equation, closed (remat holds an open one)."""
  inner = eqn.params[CALL_JAXPR_PARAM[eqn.primitive]]
  return inner if isinstance(inner, ClosedJaxpr) else ClosedJaxpr(inner, ())


# --- Control flow: one record per equation kind. ----------------------------
#
# jax 0.10 params: cond has `branches` and operands `index, *ops`; while has
# `cond_jaxpr, cond_nconsts, body_jaxpr, body_nconsts` and operands
# `cond_consts, body_consts, carry`; scan has `jaxpr, num_consts, num_carry,
# length, reverse, unroll` and operands `consts, carry, xs`. Nothing outside
# this block reads them.

Atom = Var | Literal


@dataclasses.dataclass(frozen=True)
class Cond:
  """A `cond` equation: `lax.switch(index, branches, *operands)`.

  Every branch takes the operands and returns the equation's outputs.
  """

  index: Atom
  operands: tuple[Atom, ...]
  branches: tuple[ClosedJaxpr, ...]

  @staticmethod
  def split(values: Sequence[Any]) -> tuple[Any, list[Any]]:
    """(index, operands) of `values`, one per equation operand."""
    return values[0], list(values[1:])

  def bind(self, values: Sequence[Any],
           branches: Sequence[Callable[[list[Any]], list[Any]]]) -> list[Any]:
    """Re-binds the conditional on `values` (one per equation operand) with
    `branches[k]` (operand values -> output values) in place of branch k."""
    index, operands = self.split(values)
    return lax.switch(index, [lambda *a, f=f: f(list(a)) for f in branches], *operands)


def cond(eqn: JaxprEqn) -> Cond:
  """The parts of a `cond` equation."""
  return Cond(eqn.invars[0], tuple(eqn.invars[1:]), tuple(eqn.params["branches"]))


@dataclasses.dataclass(frozen=True)
class Loop:
  """A `while` or `scan` equation, read as one loop.

  The operands are `cond_consts + consts + carry + xs` (a scan has no
  cond_consts, a while no xs). The body takes `consts + carry + x` and returns
  `carry + y`; the equation returns `carry + ys` (a while has no ys). Output k
  < num_carry of the body and of the equation is carry k.

  `lax.scan(f, init, xs, length=3)` with one const and two carries gives
  `Loop("scan", body, None, (), (c,), (init0, init1), (xs,), {"length": 3, ...})`.
  """

  kind: str                        # "scan" or "while".
  body: ClosedJaxpr                # consts + carry + x -> carry + y.
  cond: ClosedJaxpr | None         # while: cond_consts + carry -> (predicate,); scan: None.
  cond_consts: tuple[Atom, ...]    # while only.
  consts: tuple[Atom, ...]
  carry: tuple[Atom, ...]          # The carries' initial values.
  xs: tuple[Atom, ...]             # scan only: the sequences scanned over.
  options: dict[str, Any]          # scan: `lax.scan`'s length, reverse, unroll; while: {}.

  @property
  def num_consts(self) -> int:
    return len(self.consts)

  @property
  def num_carry(self) -> int:
    return len(self.carry)

  @property
  def body_operands(self) -> tuple[Atom, ...]:
    """The operands the body's inputs receive: consts + carry + xs."""
    return self.consts + self.carry + self.xs

  @property
  def body_carry(self) -> range:
    """The positions of the carries among the body's inputs."""
    return range(self.num_consts, self.num_consts + self.num_carry)

  def split(self, values: Sequence[Any]) -> tuple[list[Any], list[Any], list[Any], list[Any]]:
    """(cond_consts, consts, carry, xs) of `values`, one per equation operand."""
    a = len(self.cond_consts)
    b = a + self.num_consts
    c = b + self.num_carry
    return list(values[:a]), list(values[a:b]), list(values[b:c]), list(values[c:])

  def cond_reads(self) -> set[int]:
    """The carries an equation of the while condition reads (none for a scan)."""
    if self.cond is None:
      return set()
    read = {v for e in self.cond.jaxpr.eqns for v in e.invars if not is_literal(v)}
    return {k for k, v in enumerate(self.cond.jaxpr.invars[len(self.cond_consts):])
            if v in read}

  def bind(self, values: Sequence[Any], body: Callable[[list[Any]], list[Any]],
           cond: Callable[[list[Any]], list[Any]] | None = None) -> list[Any]:
    """Re-binds the loop on `values` (one per equation operand) with `body`
    and, for a while, `cond` (input values -> output values) in place of its
    jaxprs, through `lax.scan` or `lax.while_loop`.

    Returns:
      One value per equation output: carry + ys.
    """
    cond_consts, consts, init, xs = self.split(values)
    if self.kind == "scan":
      def step(carry, x):
        out = body([*consts, *carry, *x])
        return out[:self.num_carry], out[self.num_carry:]

      carry, ys = lax.scan(step, init, xs, **self.options)
      return [*carry, *ys]
    if cond is None:
      raise TypeError("Loop.bind of a while loop needs its `cond`")
    return lax.while_loop(lambda c: cond([*cond_consts, *c])[0],
                          lambda c: body([*consts, *c]), init)


def loop(eqn: JaxprEqn) -> Loop:
  """The parts of a `while` or `scan` equation."""
  p, ops = eqn.params, tuple(eqn.invars)
  if eqn.primitive is scan_p:
    n, m = p["num_consts"], p["num_consts"] + p["num_carry"]
    return Loop("scan", p["jaxpr"], None, (), ops[:n], ops[n:m], ops[m:],
                {k: p[k] for k in ("length", "reverse", "unroll")})
  if eqn.primitive is while_p:
    n, m = p["cond_nconsts"], p["cond_nconsts"] + p["body_nconsts"]
    return Loop("while", p["body_jaxpr"], p["cond_jaxpr"], ops[:n], ops[n:m], ops[m:], (), {})
  raise ValueError(f"not a loop: {eqn.primitive}")


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


def rebind_call(eqn: JaxprEqn, fn: Any, args: Sequence[Any]) -> list[Any]:
  """Binds a call-like equation (remat) on `args` with its inner jaxpr
  replaced by `fn` traced on their types, other params kept (a remat after AD
  keeps its `differentiated` flag, which `jax.checkpoint` would reset).

  Constants the trace captures become leading operands, not rematerialized.
  """
  avals = [_core.typeof(x) for x in args]
  debug = _api_util.debug_info("wus rename", fn, tuple(args), {})
  jaxpr, _, consts = _pe.trace_to_jaxpr_dynamic(_lu.wrap_init(fn, debug_info=debug), avals)
  params = dict(eqn.params)
  if consts:
    jaxpr = _pe.convert_constvars_jaxpr(jaxpr)
    if isinstance(params.get("prevent_cse"), tuple):
      params["prevent_cse"] = (False,) * len(consts) + params["prevent_cse"]
  params[CALL_JAXPR_PARAM[eqn.primitive]] = jaxpr
  with source_of(eqn):
    out = eqn.primitive.bind(*consts, *args, **params)
  return list(out) if eqn.primitive.multiple_results else [out]


def sub_jaxprs(eqn: JaxprEqn) -> Iterator[Jaxpr]:
  """Every jaxpr held in an equation's params, found generically."""
  yield from _core.jaxprs_in_params(eqn.params)


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


def bind(eqn: JaxprEqn, *args: Any, **new_params: Any) -> list[Any]:
  """Re-binds `eqn` on `args` (tracers or arrays), as `jax.core.eval_jaxpr` does.

  Args:
    eqn: the equation to replay.
    *args: one value per `eqn.invars`.
    **new_params: params to override (for example a new `shape`).

  Returns:
    A list with one value per `eqn.outvars`.
  """
  if not new_params and (out := _stage(eqn, args)) is not None:
    return out
  return rebind(eqn, *args, **new_params)


def rebind(eqn: JaxprEqn, *args: Any, **new_params: Any) -> list[Any]:
  """`bind` with the types of the results worked out anew, never copied from
  `eqn` (for operands of other types: another mesh, renamed axes)."""
  params = dict(eqn.primitive.get_bind_params(eqn.params) if not new_params
                else eqn.primitive.get_bind_params({**eqn.params, **new_params}))
  with source_of(eqn):
    out = eqn.primitive.bind(*args, **params)
  return list(out) if eqn.primitive.multiple_results else [out]


# Primitives whose jaxpr staging rule is `default_process_primitive` (jax 0.10:
# the rules exist for dynamic shapes only).
_PLAIN_STAGING = frozenset({_lax.broadcast_in_dim_p, _lax.reshape_p, _lax.iota_p,
                            _slicing.dynamic_slice_p})


def _stage(eqn: JaxprEqn, args: Sequence[Any]) -> list[Any] | None:
  """`bind` under a jaxpr trace when every operand has the equation's own type.

  The outputs then have the equation's types too, so the equation is staged as
  `DynamicJaxprTrace.default_process_primitive` stages it, without abstract
  evaluation: a replayed equation costs a fraction of a bind. Literal operands
  must be passed as their `.val`. None (bind instead) under any other trace,
  for other operand types, effects, a primitive with its own staging rule, or
  a type of JAX's hijax layer.
  """
  trace = _core.trace_ctx.trace
  if (not isinstance(trace, _pe.DynamicJaxprTrace) or side_effects(eqn)
      or (eqn.primitive in _pe.custom_staging_rules and eqn.primitive not in _PLAIN_STAGING)
      or eqn.primitive.is_high(*[v.aval for v in eqn.invars], **eqn.params)):
    return None
  src = eqn.source_info.replace(
      name_stack=_source_info.current_name_stack() + eqn.source_info.name_stack)
  tracers = []
  for v, x in zip(eqn.invars, args, strict=True):
    if isinstance(v, Literal) and x is v.val:
      tracers.append(_pe.DynamicJaxprTracer(trace, v.aval, v, src))
    elif isinstance(x, _pe.DynamicJaxprTracer) and x._trace is trace and x.aval == v.aval:
      tracers.append(x)
    else:
      return None
  out_avals = [v.aval for v in eqn.outvars]
  if _pe.try_constant_folding(eqn.primitive, tracers, eqn.params, out_avals) is not None:
    return None
  staged, outs = trace.make_eqn(tracers, out_avals, eqn.primitive, eqn.params, eqn.effects,
                                src, eqn.ctx)
  if eqn.primitive in _pe.forwarding_rules:
    forwarded, staged = _pe.forwarding_rules[eqn.primitive](staged)
    outs = [t if k is None else tracers[k] for k, t in zip(forwarded, outs, strict=True)]
  if staged is not None:
    trace.frame.add_eqn(staged)
  return outs


@contextlib.contextmanager
def source_of(eqn: JaxprEqn):
  """Attributes equations traced in this context to `eqn`'s place in user code."""
  name_stack = _source_info.current_name_stack() + eqn.source_info.name_stack
  with (_source_info.user_context(eqn.source_info.traceback, name_stack=name_stack),
        eqn.ctx.manager):
    yield


def in_current_mesh(eqn: JaxprEqn) -> JaxprEqn:
  """`eqn` with the abstract mesh of its context replaced by the current one,
  to re-bind it inside a shard_map over another mesh (renamed axes)."""
  ctx = eqn.ctx
  meta = None if ctx.xla_metadata is None else tuple(sorted(ctx.xla_metadata.items()))
  return eqn.replace(ctx=_core.JaxprEqnContext._create(
      ctx.compute_type, ctx.threefry_partitionable, _mesh_lib.get_abstract_mesh(),
      ctx.remove_size_one_mesh_axis, meta))


def retyped(value: Any) -> Any:
  """A literal's value typed under the current mesh (jax 0.10: an array
  literal remembers the mesh of the trace that made it)."""
  if isinstance(value, _literals.TypedNdArray):
    aval = value.aval
    return _literals.TypedNdArray(_np.asarray(value),
                                  _core.ShapedArray(aval.shape, aval.dtype,
                                                    weak_type=aval.weak_type))
  return value


def dce(jaxpr: Jaxpr) -> Jaxpr:
  """`jaxpr` without equations whose results nothing uses (effects are kept);
  inputs and outputs unchanged."""
  return _pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars), instantiate=True)[0]


def has_user_frame(eqn: JaxprEqn) -> bool:
  """Whether `eqn`'s traceback reaches user code (not only JAX's own helpers)."""
  tb = eqn.source_info.traceback
  return tb is not None and _source_info.user_frame(tb) is not None


def attributed(eqn: JaxprEqn, caller: JaxprEqn) -> JaxprEqn:
  """`eqn` attributed to `caller`'s place in user code, for an equation of a
  call being inlined whose own traceback ends inside JAX (`jnp.where`'s jit)."""
  return eqn.replace(source_info=eqn.source_info.replace(traceback=caller.source_info.traceback))


def shard_map_eqn(jaxpr: ClosedJaxpr) -> JaxprEqn:
  """The single shard_map equation of a traced `jax.shard_map(f)` call.

  Raises:
    ValueError: if `jaxpr` is not exactly one shard_map equation.
  """
  eqns = [e for e in jaxpr.eqns if e.primitive is shard_map_p]
  if len(eqns) != 1:
    raise ValueError(f"expected one shard_map equation, found {len(eqns)}")
  return eqns[0]


def shard_map_params(eqn: JaxprEqn) -> tuple[Jaxpr, Any, tuple, tuple, frozenset, bool]:
  """(body jaxpr, mesh, in_specs, out_specs, manual axes, check_vma)."""
  p = eqn.params
  return (p["jaxpr"], p["mesh"], p["in_specs"], p["out_specs"],
          frozenset(p["newly_manual_axes"]), p["check_vma"])


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


def is_literal(atom: Any) -> bool:
  return isinstance(atom, Literal)


# Libraries whose frames are not the user's code: a gradient all-reduce that AD makes from a
# Flax layer's broadcast is located at the user's call of the layer, not inside Flax.
_LIBRARIES = ("flax", "optax", "chex", "orbax", "wus")


def _library_roots() -> tuple[str, ...]:
  """The folders of the `_LIBRARIES` imported (and wus's sub-packages, installed apart)."""
  names = (*_LIBRARIES, "wus.analysis", "wus.transforms", "wus.collectives", "wus.harness")
  modules = [sys.modules.get(name) for name in names]
  return tuple(os.path.dirname(m.__file__) + os.sep for m in modules
               if m is not None and getattr(m, "__file__", None))


def source_line(eqn: JaxprEqn) -> str:
  """Where in the user's code `eqn` came from, as "file:line:column (function)": the
  innermost frame outside JAX and the libraries of `_LIBRARIES` (or JAX's own choice, or
  the name stack, "jit(_where)", when tracing kept no such frame)."""
  roots = _library_roots()
  for frame in _source_info.user_frames(eqn.source_info.traceback):
    if not frame.file_name.startswith(roots):
      return f"{frame.file_name}:{frame.start_line}:{frame.start_column} ({frame.function_name})"
  return (_source_info.summarize(eqn.source_info) or str(eqn.source_info.name_stack)
          or "an unknown place")


def side_effects(eqn: JaxprEqn) -> set:
  """An equation's effects, without the axis-name bookkeeping of collectives.

  Collectives carry a `NamedAxisEffect` that only records which axis names
  they use; it is not I/O, state or randomness.
  """
  return {e for e in eqn.effects if not isinstance(e, _core.NamedAxisEffect)}


# --- Global-view steps (`wus.jit`). ---------------------------------------------

# Equations that communicate between devices or enter manual (per-device) code:
# an update region run inside a shard_map must not hold one.
_MANUAL = frozenset({shard_map_p, psum_p, psum_invariant_p, pmax_p, pmin_p, pvary_p,
                     all_gather_p, all_gather_invariant_p, reduce_scatter_p, all_to_all_p,
                     ragged_all_to_all_p, ppermute_p, pbroadcast_p, axis_index_p})


def has_manual_code(eqn: JaxprEqn) -> bool:
  """Whether `eqn` is, or holds in a nested jaxpr, a collective or a shard_map."""
  return eqn.primitive in _MANUAL or any(
      has_manual_code(e) for sub in sub_jaxprs(eqn) for e in sub.eqns)


def sharding_spec(aval: Any) -> tuple[tuple, frozenset]:
  """(the PartitionSpec entries, the unreduced axes) of a value's type: empty
  on a mesh with Auto axes, where the types carry no sharding."""
  sharding = getattr(aval, "sharding", None)
  if sharding is None or getattr(sharding, "spec", None) is None:
    return (), frozenset()
  spec = sharding.spec
  return tuple(spec), frozenset(getattr(spec, "unreduced", ()) or ())


def is_zero_literal(atom: Any) -> bool:
  """Whether a literal is zero (every element)."""
  return is_literal(atom) and not _np.any(_np.asarray(atom.val))


def explicit_axes(mesh: Any) -> frozenset:
  """The mesh axes of type Explicit (sharding in types, `jax.make_mesh`'s default)."""
  from jax.sharding import AxisType
  return frozenset(a for a, t in zip(mesh.axis_names, mesh.axis_types, strict=True)
                   if t == AxisType.Explicit)


def static_args(fun: Callable, argnums: Any, argnames: Any) -> tuple[frozenset, frozenset]:
  """`jax.jit`'s static argument positions and names, each inferred from the other."""
  nums = () if argnums is None else (argnums,) if isinstance(argnums, int) else tuple(argnums)
  names = () if argnames is None else (argnames,) if isinstance(argnames, str) else tuple(argnames)
  sig = _api_util.fun_signature(fun)
  if sig is not None:
    nums, names = _api_util.infer_argnums_and_argnames(sig, nums or None, names or None)
  return frozenset(nums), frozenset(names)


def is_staging_tracer(x: Any) -> bool:
  """Whether `x` is a tracer of `jax.jit` staging a jaxpr (not of `jax.grad` or `jax.vmap`)."""
  return isinstance(x, _pe.DynamicJaxprTracer)
