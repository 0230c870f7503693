"""Inlining of calls, so the analysis sees flat jaxprs.

`jit`, `closed_call`, `custom_jvp_call` and `custom_vjp_call` equations are
replaced by the equations of their inner jaxpr, also inside the branches and
bodies of `cond`, `while` and `scan` (which are retraced with the public lax
functions). XLA inlines calls anyway, and after AD the custom derivative rules
are dead, so the program computes exactly what it computed before.
`checkpoint` (remat) is kept: it tells XLA what to recompute in the backward
pass.

One more exact rewrite happens on the way: an all-reduce whose only reader
is a transpose or reshape runs after it instead, `transpose(psum(x))` ->
`psum(transpose(x))` (the same sums of the same elements). AD writes that
pattern for a weight read transposed (a tied embedding's output projection);
sunk, the all-reduce starts the weight-update cluster and becomes a
reduce-scatter (§3.2) rather than a whole all-reduce.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from jax import lax

from wus.analysis import compat
from wus.analysis.compat import ClosedJaxpr, Jaxpr

INLINED = frozenset({compat.jit_p, compat.closed_call_p, compat.custom_jvp_call_p,
                     compat.custom_vjp_call_p})
# Primitives that only move the elements of their one operand.
_MOVES = frozenset({lax.transpose_p, lax.reshape_p, lax.squeeze_p})
_ALL_REDUCE = frozenset({compat.psum_p, compat.psum_invariant_p})


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
  sunk = _sinks(jaxpr)
  for i, eqn in enumerate(jaxpr.eqns):
    if i in sunk.values():
      continue  # Ran before the all-reduce it reads.
    if i in sunk:
      mover = jaxpr.eqns[sunk[i]]
      (moved,) = compat.bind(mover, read(eqn.invars[0]))
      (env[mover.outvars[0]],) = compat.bind(eqn, moved)
      continue
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


def _sinks(jaxpr: Jaxpr) -> dict[int, int]:
  """All-reduces to run after their one reader, an element move: index -> reader index."""
  readers: dict = {}
  for i, eqn in enumerate(jaxpr.eqns):
    for v in eqn.invars:
      if not compat.is_literal(v):
        readers.setdefault(v, []).append(i)
  outputs = {v for v in jaxpr.outvars if not compat.is_literal(v)}
  out = {}
  for i, eqn in enumerate(jaxpr.eqns):
    if (eqn.primitive in _ALL_REDUCE and len(eqn.invars) == 1
        and not compat.has_axis_index_groups(eqn) and eqn.outvars[0] not in outputs):
      r = readers.get(eqn.outvars[0], [])
      if len(r) == 1 and jaxpr.eqns[r[0]].primitive in _MOVES:
        out[i] = r[0]
  return out


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
