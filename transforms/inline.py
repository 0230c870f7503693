"""Inlining of calls, so the analysis sees flat jaxprs.

`jit`, `closed_call`, `custom_jvp_call` and `custom_vjp_call` equations are
replaced by the equations of their inner jaxpr, also inside the branches and
bodies of `cond`, `while` and `scan` (which are retraced with the public lax
functions). XLA inlines calls anyway, and after AD the custom derivative rules
are dead, so the program computes exactly what it computed before.
`checkpoint` (remat) is kept: it tells XLA what to recompute in the backward
pass.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from jax import lax

from wus.analysis import compat
from wus.analysis.compat import ClosedJaxpr, Jaxpr

INLINED = frozenset({compat.jit_p, compat.closed_call_p, compat.custom_jvp_call_p,
                     compat.custom_vjp_call_p})


def inlined(jaxpr: ClosedJaxpr) -> Callable[..., list[Any]]:
  """A function evaluating `jaxpr` with its calls inlined; trace it to get the flat jaxpr.

  Example (inside shard_map, as `wus` retraces the step body):

    { lambda ; a:f32[3]. let b:f32[3] = jit[name=f jaxpr={... c = sin a ...}] a in (b,) }
    becomes
    { lambda ; a:f32[3]. let b:f32[3] = sin a in (b,) }
  """
  return lambda *args: _eval(jaxpr.jaxpr, jaxpr.consts, args)


def _eval(jaxpr: Jaxpr, consts: Sequence[Any], args: Sequence[Any],
          caller=None) -> list[Any]:
  """Evaluates `jaxpr` with calls inlined. Equations of an inlined call that
  keep no user frame are attributed to `caller`, the call's equation."""
  env: dict = {}

  def read(v):
    return v.val if compat.is_literal(v) else env[v]

  for v, x in zip(jaxpr.constvars, consts, strict=True):
    env[v] = x
  for v, x in zip(jaxpr.invars, args, strict=True):
    env[v] = x
  for eqn in jaxpr.eqns:
    ins = [read(v) for v in eqn.invars]
    if caller is not None and not compat.has_user_frame(eqn):
      eqn = compat.attributed(eqn, caller)
    if eqn.primitive in INLINED:
      inner = compat.call_jaxpr(eqn)
      outs = _eval(inner.jaxpr, inner.consts, ins,
                   eqn if compat.has_user_frame(eqn) else caller)
    elif eqn.primitive in _CONTROL:
      with compat.source_of(eqn):
        outs = _CONTROL[eqn.primitive](eqn, ins)
    else:
      outs = compat.bind(eqn, *ins)
    for v, x in zip(eqn.outvars, outs, strict=True):
      env[v] = x
  return [read(v) for v in jaxpr.outvars]


def _closed(jaxpr: ClosedJaxpr) -> Callable[..., list[Any]]:
  return lambda *args: _eval(jaxpr.jaxpr, jaxpr.consts, args)


def _cond(eqn, ins):
  branches = [lambda *a, f=_closed(b): f(*a) for b in compat.cond_branches(eqn)]
  return lax.switch(ins[0], branches, *ins[1:])


def _while(eqn, ins):
  cond, cond_nconsts, body, body_nconsts = compat.while_parts(eqn)
  cond_consts, body_consts = ins[:cond_nconsts], ins[cond_nconsts:cond_nconsts + body_nconsts]
  init = ins[cond_nconsts + body_nconsts:]
  return lax.while_loop(lambda c: _closed(cond)(*cond_consts, *c)[0],
                        lambda c: _closed(body)(*body_consts, *c), list(init))


def _scan(eqn, ins):
  body, num_consts, num_carry = compat.scan_parts(eqn)
  consts, init, xs = ins[:num_consts], ins[num_consts:num_consts + num_carry], \
      ins[num_consts + num_carry:]

  def step(carry, x):
    out = _closed(body)(*consts, *carry, *x)
    return out[:num_carry], out[num_carry:]

  carry, ys = lax.scan(step, list(init), list(xs), length=eqn.params["length"],
                       reverse=eqn.params["reverse"], unroll=eqn.params["unroll"])
  return [*carry, *ys]


_CONTROL = {compat.cond_p: _cond, compat.while_p: _while, compat.scan_p: _scan}
