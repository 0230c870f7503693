"""Control flow as records: `cond`, `while` and `scan` equations read and re-bound.

jax 0.10 params: cond has `branches` and operands `index, *ops`; while has
`cond_jaxpr, cond_nconsts, body_jaxpr, body_nconsts` and operands
`cond_consts, body_consts, carry`; scan has `jaxpr, num_consts, num_carry,
length, reverse, unroll` and operands `consts, carry, xs`. Nothing outside
this module reads them."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from jax import lax

from wus.analysis.compat.handles import (ClosedJaxpr, JaxprEqn, Literal, Var, is_literal,
                                         scan_p, while_p)

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


def with_branches(eqn: JaxprEqn, branches: Sequence[ClosedJaxpr]) -> JaxprEqn:
  """`cond` equation `eqn` with `branches` in place of its branches (each taking its
  operands and returning its results)."""
  return eqn.replace(params={**eqn.params, "branches": tuple(branches)})


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


def _scan_counts(params: dict[str, Any]) -> tuple[int, int]:
  """Where a scan's carry starts and ends among its operands: from `num_consts`
  and `num_carry` (jax 0.10), or the lengths of `ft_in`'s three parts, the
  flattened (consts, carry, xs) that replaced them in JAX 0.12."""
  if "num_consts" in params:
    return params["num_consts"], params["num_consts"] + params["num_carry"]
  consts, carry, _ = params["ft_in"].unpack()
  return len(consts), len(consts) + len(carry)


def loop(eqn: JaxprEqn) -> Loop:
  """The parts of a `while` or `scan` equation."""
  p, ops = eqn.params, tuple(eqn.invars)
  if eqn.primitive is scan_p:
    n, m = _scan_counts(p)
    return Loop("scan", p["jaxpr"], None, (), ops[:n], ops[n:m], ops[m:],
                {k: p[k] for k in ("length", "reverse", "unroll")})
  if eqn.primitive is while_p:
    n, m = p["cond_nconsts"], p["cond_nconsts"] + p["body_nconsts"]
    return Loop("while", p["body_jaxpr"], p["cond_jaxpr"], ops[:n], ops[n:m], ops[m:], (), {})
  raise ValueError(f"not a loop: {eqn.primitive}")
