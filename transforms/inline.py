"""Inlining of calls, so the analysis sees one flat jaxpr.

`jit`, `closed_call`, `custom_jvp_call` and `custom_vjp_call` equations are
replaced by the equations of their inner jaxpr. XLA inlines calls anyway, and
after AD the custom derivative rules are dead, so the program computes exactly
what it computed before. `checkpoint` (remat) is kept: it tells XLA what to
recompute in the backward pass.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

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


def _eval(jaxpr: Jaxpr, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
  env: dict = {}

  def read(v):
    return v.val if compat.is_literal(v) else env[v]

  for v, x in zip(jaxpr.constvars, consts, strict=True):
    env[v] = x
  for v, x in zip(jaxpr.invars, args, strict=True):
    env[v] = x
  for eqn in jaxpr.eqns:
    ins = [read(v) for v in eqn.invars]
    if eqn.primitive in INLINED:
      inner = compat.call_jaxpr(eqn)
      outs = _eval(inner.jaxpr, inner.consts, ins)
    else:
      outs = compat.bind(eqn, *ins)
    for v, x in zip(eqn.outvars, outs, strict=True):
      env[v] = x
  return [read(v) for v in jaxpr.outvars]
