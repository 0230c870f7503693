"""Building jaxprs: re-binding equations under a new trace, dead-code elimination,
`jax.jit`'s static arguments and staging tracers."""

from __future__ import annotations

import contextlib
import inspect as _inspect
from collections.abc import Callable, Sequence
from typing import Any

import numpy as _np
from jax._src import api_util as _api_util
from jax._src import config as _config
from jax._src import core as _core
from jax._src import linear_util as _lu
from jax._src import literals as _literals
from jax._src import mesh as _mesh_lib
from jax._src import source_info_util as _source_info
from jax._src.interpreters import partial_eval as _pe
from jax._src.lax import lax as _lax
from jax._src.lax import slicing as _slicing

from wus.analysis.compat.handles import (CALL_JAXPR_PARAM, Jaxpr, JaxprEqn, Literal,
                                         side_effects)

# The configuration holding the abstract mesh of the current trace: jax.sharding's
# module has its own since JAX 0.11; jax 0.10 keeps it with the other configs.
_ABSTRACT_MESH = getattr(_mesh_lib, "abstract_mesh_context_manager", None)
if _ABSTRACT_MESH is None:
  _ABSTRACT_MESH = _config.abstract_mesh_context_manager


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


def bind_elementwise(eqn: JaxprEqn, *args: Any, **new_params: Any) -> list[Any]:
  """`bind` of an elementwise equation (results of its operands' shape) on operands
  of another shape, as the rewrite binds one on shards.

  Where every operand has the equation's dtype and weak type, and the operands
  that are not scalars share one type but for the dtype, the results take that
  type with the equation's dtypes, as JAX's elementwise rules give them, and
  are staged without abstract evaluation (`_stage`); else `rebind`.
  """
  avals = _elementwise_avals(eqn, args)
  out = None if avals is None else _stage(eqn, args, {**eqn.params, **new_params}, avals)
  return out if out is not None else rebind(eqn, *args, **new_params)


def _elementwise_avals(eqn: JaxprEqn, args: Sequence[Any]) -> list | None:
  """The result types of elementwise `eqn` bound on `args`, or None if not derived here:
  every operand but its scalar literals is an array of the equation's dtype and weak type,
  those of the result's shape all of one type but for the dtype, the scalars varying over
  the same mesh axes (or, where every operand is a scalar, all of one type but for the
  dtype, typed on the current trace's mesh)."""
  shape = eqn.outvars[0].aval.shape
  if any(v.aval.shape != shape for v in eqn.outvars):
    return None
  like, scalars = None, []
  for v, x in zip(eqn.invars, args, strict=True):
    if isinstance(v, Literal) and x is v.val and not v.aval.shape:
      continue
    aval = getattr(x, "aval", None)
    if (not isinstance(aval, _core.ShapedArray) or aval.dtype != v.aval.dtype
        or aval.weak_type != v.aval.weak_type or v.aval.shape not in ((), shape)
        or bool(aval.shape) != bool(v.aval.shape)):
      return None
    if not aval.shape:
      scalars.append(aval)
    elif like is None:
      like = aval
    elif not _same_but_dtype(aval, like):
      return None
  if like is None:  # Scalars only: all of one type but for the dtype, on the current mesh.
    if (not scalars or getattr(scalars[0].sharding, "mesh", None) != _mesh_lib.get_abstract_mesh()
        or not all(_same_but_dtype(a, scalars[0]) for a in scalars)):
      return None
    like = scalars[0]
  elif any(a != like and a.update(shape=like.shape, dtype=like.dtype, weak_type=like.weak_type,
                                  sharding=like.sharding) != like for a in scalars):
    return None
  return [like if (like.dtype, like.weak_type) == (v.aval.dtype, v.aval.weak_type)
          else like.update(dtype=v.aval.dtype, weak_type=v.aval.weak_type) for v in eqn.outvars]


def _same_but_dtype(a, b) -> bool:
  """Whether types `a` and `b` differ at most in their dtype and weak type."""
  return a is b or a == b or a.update(dtype=b.dtype, weak_type=b.weak_type) == b


def _stage(eqn: JaxprEqn, args: Sequence[Any], params: dict | None = None,
           out_avals: list | None = None) -> list[Any] | None:
  """`bind` under a jaxpr trace when every operand has the equation's own type.

  The outputs then have the equation's types too, so the equation is staged as
  `DynamicJaxprTrace.default_process_primitive` stages it, without abstract
  evaluation: a replayed equation costs a fraction of a bind. Literal operands
  must be passed as their `.val`. None (bind instead) under any other trace,
  for other operand types, effects, a primitive with its own staging rule, or
  a type of JAX's hijax layer. With `out_avals` (and `params`), operands of
  other shapes are staged with those result types (`bind_elementwise`).
  """
  trace = _core.trace_ctx.trace
  params = eqn.params if params is None else params
  if (not isinstance(trace, _pe.DynamicJaxprTrace) or side_effects(eqn)
      or (eqn.primitive in _pe.custom_staging_rules and eqn.primitive not in _PLAIN_STAGING)
      or eqn.primitive.is_high(*[v.aval for v in eqn.invars], **eqn.params)):
    return None
  src = eqn.source_info.replace(
      name_stack=_source_info.current_name_stack() + eqn.source_info.name_stack)
  tracers = []
  for v, x in zip(eqn.invars, args, strict=True):
    if isinstance(v, Literal) and x is v.val:
      # Replayed with results typed anew (`bind_elementwise`), inside another shard_map.
      if (literal := v if out_avals is None else _on_current_mesh(v)) is None:
        return None
      tracers.append(_pe.DynamicJaxprTracer(trace, literal.aval, literal, src))
    elif (isinstance(x, _pe.DynamicJaxprTracer) and x._trace is trace
          and (out_avals is not None or x.aval == v.aval)):
      tracers.append(x)
    else:
      return None
  if out_avals is None:
    out_avals = [v.aval for v in eqn.outvars]
  if _pe.try_constant_folding(eqn.primitive, tracers, params, out_avals) is not None:
    return None
  staged, outs = trace.make_eqn(tracers, out_avals, eqn.primitive, params, eqn.effects,
                                src, eqn.ctx)
  if eqn.primitive in _pe.forwarding_rules:
    forwarded, staged = _pe.forwarding_rules[eqn.primitive](staged)
    outs = [t if k is None else tracers[k] for k, t in zip(forwarded, outs, strict=True)]
  if staged is not None:
    trace.frame.add_eqn(staged)
  return outs


def _on_current_mesh(literal: Literal) -> Literal | None:
  """`literal`, typed on the current trace's mesh as JAX types a constant it stages (an
  equation of a global jaxpr replayed inside a shard_map); None for a literal laid out
  over mesh axes."""
  sharding = getattr(literal.aval, "sharding", None)
  if sharding is None or sharding.mesh == _mesh_lib.get_abstract_mesh():
    return literal
  if any(sharding.spec):
    return None
  return Literal(literal.val, literal.aval.update(sharding=_core.get_cur_mesh_sharding()))


@contextlib.contextmanager
def source_of(eqn: JaxprEqn):
  """Attributes equations traced in this context to `eqn`'s place in user code."""
  name_stack = _source_info.current_name_stack() + eqn.source_info.name_stack
  with (_source_info.user_context(eqn.source_info.traceback, name_stack=name_stack),
        eqn.ctx.manager):
    yield


def in_current_mesh(eqn: JaxprEqn) -> JaxprEqn:
  """`eqn` with the abstract mesh of its context replaced by the current one,
  to re-bind it inside a shard_map over another mesh (renamed axes).

  The context is built as JAX builds one, from the configuration its manager
  sets, so every other field (their number grows with JAX's version) is the
  equation's own.
  """
  mesh = _mesh_lib.get_abstract_mesh()
  with eqn.ctx.manager:  # Its exit restores the abstract mesh set below.
    _ABSTRACT_MESH.set_local(mesh)
    ctx = _core.JaxprEqnContext()
  return eqn.replace(ctx=ctx)


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


def dce_eqn(eqn: JaxprEqn, used_outputs: Sequence[bool]) -> tuple[list[bool], JaxprEqn]:
  """JAX's own dead-code rule for `eqn` (`pe.dce_rules`, which `cond`, `while`, `scan` and
  calls have): (per operand, whether the used outputs read it; the equation computing
  only the used outputs, from only those operands)."""
  rule = _pe.dce_rules[eqn.primitive]
  if len(_inspect.signature(rule).parameters) == 3:  # jax >= 0.11: (used, live_ins, eqn).
    return rule(list(used_outputs), [True] * len(eqn.invars), eqn)
  return rule(list(used_outputs), eqn)


def without_refs(closed: _core.ClosedJaxpr) -> _core.ClosedJaxpr:
  """`closed` with the refs it creates itself (`jax.new_ref` inside the step) discharged
  into values (JAX's `discharge_state`): a pure jaxpr that computes the same, each read a
  value and each write a new one; unchanged when it creates none. (Refs it takes as inputs
  stay: their writes are the caller's to see.)"""
  from jax._src.state import discharge as _discharge  # noqa: PLC0415
  from jax._src.state.types import AbstractRef  # noqa: PLC0415
  made = any(isinstance(v.aval, AbstractRef) for e in closed.jaxpr.eqns for v in e.outvars)
  if not made or any(isinstance(a, AbstractRef) for a in closed.in_avals):
    return closed
  return _discharge.discharge_state(closed)


def attributed(eqn: JaxprEqn, caller: JaxprEqn) -> JaxprEqn:
  """`eqn` attributed to `caller`'s place in user code, for an equation of a
  call being inlined whose own traceback ends inside JAX (`jnp.where`'s jit)."""
  return eqn.replace(source_info=eqn.source_info.replace(traceback=caller.source_info.traceback))


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
