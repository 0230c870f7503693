"""Inlining of calls, so the analysis sees flat jaxprs.

`jit`, `closed_call`, `custom_jvp_call` and `custom_vjp_call` equations are
replaced by the equations of their inner jaxpr, also inside the branches and
bodies of `cond`, `while` and `scan` (which are retraced with the public lax
functions). XLA inlines calls anyway, and after AD the custom derivative rules
are dead, so the program computes exactly what it computed before.
`checkpoint` (remat) is kept: it tells XLA what to recompute in the backward
pass.

With `rename`, mesh axes are renamed on the way (`shard_group_size`, §5.2):
each collective over a renamed axis runs over its tuple of axes instead and
`axis_index` of it is the row-major index over the tuple, so the step runs
unchanged on a mesh that splits the axis in two (`transforms.groups`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jax import lax

from wus.analysis import compat
from wus.analysis.compat import ClosedJaxpr, Jaxpr

INLINED = frozenset({compat.jit_p, compat.closed_call_p, compat.custom_jvp_call_p,
                     compat.custom_vjp_call_p})


def inlined(jaxpr: ClosedJaxpr, rename: Mapping[Any, tuple] | None = None
            ) -> Callable[..., list[Any]]:
  """A function evaluating `jaxpr` with its calls inlined; trace it to get the flat jaxpr.

  Args:
    jaxpr: a shard_map body.
    rename: optionally, mesh axis -> the tuple of axes that replaces it (trace
      the function inside a shard_map over a mesh with those axes).

  Example (inside shard_map, as `wus` retraces the step body):

    { lambda ; a:f32[3]. let b:f32[3] = jit[name=f jaxpr={... c = sin a ...}] a in (b,) }
    becomes
    { lambda ; a:f32[3]. let b:f32[3] = sin a in (b,) }

    and with rename={"data": ("data.groups", "data.in_group")}

    { lambda ; a:f32[3]. let b:f32[3] = psum[axes=(data,)] a in (b,) }
    becomes
    { lambda ; a:f32[3]. let b:f32[3] = psum[axes=(data.groups, data.in_group)] a in (b,) }
  """
  return lambda *args: _eval(jaxpr.jaxpr, jaxpr.consts, args, rename=rename or None)


def _eval(jaxpr: Jaxpr, consts: Sequence[Any], args: Sequence[Any],
          caller=None, rename: Mapping[Any, tuple] | None = None) -> list[Any]:
  """Evaluates `jaxpr` with calls inlined (and axes renamed). Equations of an
  inlined call that keep no user frame are attributed to `caller`, the call's
  equation."""
  env: dict = {}

  def read(v):
    if compat.is_literal(v):
      return v.val if rename is None else compat.retyped(v.val)
    return env[v]

  for v, x in zip(jaxpr.constvars, consts, strict=True):
    env[v] = x
  for v, x in zip(jaxpr.invars, args, strict=True):
    env[v] = x
  for eqn in jaxpr.eqns:
    ins = [read(v) for v in eqn.invars]
    if caller is not None and not compat.has_user_frame(eqn):
      eqn = compat.attributed(eqn, caller)
    if rename is not None:
      eqn = compat.in_current_mesh(eqn)
    if eqn.primitive in INLINED:
      inner = compat.call_jaxpr(eqn)
      outs = _eval(inner.jaxpr, inner.consts, ins,
                   eqn if compat.has_user_frame(eqn) else caller, rename)
    elif eqn.primitive in _CONTROL:
      with compat.source_of(eqn):
        outs = _CONTROL[eqn.primitive](eqn, ins, rename)
    elif rename is not None:
      outs = _renamed(eqn, ins, rename)
    else:
      outs = compat.bind(eqn, *ins)
    for v, x in zip(eqn.outvars, outs, strict=True):
      env[v] = x
  return [read(v) for v in jaxpr.outvars]


def _renamed(eqn, ins, rename):
  """Re-binds `eqn` with the renamed axes (`inlined`'s `rename`)."""
  params = compat.renamed_axes(eqn, rename)
  if eqn.primitive is compat.axis_index_p and params:
    with compat.source_of(eqn):  # Row-major over the tuple: group * G + index in group.
      return [lax.axis_index(params["axis_name"])]
  if eqn.primitive is compat.remat_p:
    inner = compat.call_jaxpr(eqn)
    return compat.rebind_call(eqn, lambda *a: _eval(inner.jaxpr, inner.consts, a, eqn, rename),
                              ins)
  if any(compat.names_axes(sub, rename) for sub in compat.sub_jaxprs(eqn)):
    raise NotImplementedError(f"{eqn.primitive} at {compat.source_line(eqn)} holds a jaxpr "
                              "that names the data-parallel axis; shard_group_size cannot "
                              "rename the mesh axes inside it")
  return compat.rebind(eqn, *ins, **params)


def _closed(jaxpr: ClosedJaxpr, rename=None) -> Callable[[list[Any]], list[Any]]:
  return lambda args: _eval(jaxpr.jaxpr, jaxpr.consts, args, rename=rename)


def _cond(eqn, ins, rename):
  cond = compat.cond(eqn)
  return cond.bind(ins, [_closed(b, rename) for b in cond.branches])


def _loop(eqn, ins, rename):
  loop = compat.loop(eqn)
  cond = None if loop.cond is None else _closed(loop.cond, rename)
  return loop.bind(ins, _closed(loop.body, rename), cond)


_CONTROL = {compat.cond_p: _cond, compat.while_p: _loop, compat.scan_p: _loop}
