"""The one interpreter loop every rewrite of a jaxpr runs on (`jax.core.eval_jaxpr`'s).

An environment maps each variable to its value; literals are read by value;
each equation's inputs are read, a per-equation hook returns its outputs, and
they are written back. The default hook binds the equation as it is, under the
current trace, so `eval_jaxpr(jaxpr, consts, args)` retraces `jaxpr` unchanged.
The rewrites differ only in their hook, in which equations they run (and in
which order), and in what a value is: the inliner's hook inlines calls, the
rewrite's holds each value whole or as shards (`transforms.values.Held`).

Example (the inliner's hook, `transforms.inline`):

  def hook(i, eqn, ins):
    if eqn.primitive in INLINED:  # Recurse through the same entry point.
      inner = compat.call_jaxpr(eqn)
      return eval_jaxpr(inner.jaxpr, inner.consts, ins, hook)
    return compat.bind(eqn, *ins)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from wus.analysis import compat
from wus.analysis.compat import Jaxpr, JaxprEqn

Hook = Callable[[int, JaxprEqn, list[Any]], Sequence[Any]]
"""(position of the equation in its jaxpr, the equation, its input values) -> its outputs."""

Literal = Callable[[Any], Any]
"""A literal atom -> its value in the evaluation."""


def bind(i: int, eqn: JaxprEqn, ins: list[Any]) -> list[Any]:
  """The default hook: `eqn` bound as it is on `ins` under the current trace."""
  del i
  return compat.bind(eqn, *ins)


def value(atom) -> Any:
  """A literal's value as the jaxpr holds it (the default `Literal`)."""
  return atom.val


def retyped(atom) -> Any:
  """A literal's value typed under the current mesh (`compat.retyped`), for jaxprs retraced
  inside a shard_map other than the one they were traced in."""
  return compat.retyped(atom.val)


def read(env: dict, atom, literal: Literal = value) -> Any:
  """The value of `atom` (a variable in `env`, or a literal)."""
  return literal(atom) if compat.is_literal(atom) else env[atom]


def eval_eqns(jaxpr: Jaxpr, env: dict, hook: Hook = bind, order: Iterable[int] | None = None,
              literal: Literal = value) -> dict:
  """Evaluates equations of `jaxpr`, writing their outputs into `env`.

  Args:
    jaxpr: the jaxpr (open or closed) whose equations to run.
    env: variable -> value, holding at least every variable the equations read
      before the equation that makes it; updated in place.
    hook: returns one equation's outputs (`Hook`), one per outvar.
    order: the positions of the equations to run, in the order to run them
      (default: all of them, in order).
    literal: the value of a literal input.

  Returns:
    `env`.

  Raises:
    ValueError: a hook returned another number of outputs than the equation has.
    KeyError: an equation read a variable `env` does not hold (`order` not topological).
  """
  for i in range(len(jaxpr.eqns)) if order is None else order:
    eqn = jaxpr.eqns[i]
    outs = hook(i, eqn, [read(env, v, literal) for v in eqn.invars])
    env.update(zip(eqn.outvars, outs, strict=True))
  return env


def eval_jaxpr(jaxpr: Jaxpr, consts: Sequence[Any], args: Sequence[Any], hook: Hook = bind,
               literal: Literal = value) -> list[Any]:
  """Evaluates `jaxpr` on `args`, each equation by `hook` (`jax.core.eval_jaxpr` with a hook).

  Args:
    jaxpr: an open jaxpr.
    consts: one value per constvar.
    args: one value per invar.
    hook: returns one equation's outputs (default: the equation bound as it is).
    literal: the value of a literal input or output.

  Returns:
    One value per outvar.

  Raises:
    ValueError: `consts` or `args` do not match the constvars or invars in number, or a
      hook returned another number of outputs than its equation has.
  """
  env = dict(zip(jaxpr.constvars, consts, strict=True))
  env.update(zip(jaxpr.invars, args, strict=True))
  eval_eqns(jaxpr, env, hook, literal=literal)
  return [read(env, v, literal) for v in jaxpr.outvars]
