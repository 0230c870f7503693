"""XLA:CPU's rewrite of divisions by a scalar, which owners reproduce to stay bit for bit.

XLA:CPU rewrites `A / broadcast(B)` as `A * broadcast(1 / B)` when B has one
use; the two round differently. An owner runs its units alone, so a division
by a scalar that several tensors divide by in the unmodified step (a bias
correction) would see B with one use on its owner. `rewritten_divides`
models which of those divisions XLA rewrites in the unmodified step;
`pinned` makes the rewrite (`wus.transforms.owned`) keep B used twice on
every owner except the one whose division the model says XLA rewrote
(`Ownership.pins`; DESIGN.md, Ownership; issue 21, exactness).
"""

from __future__ import annotations

import dataclasses

import numpy as np
from jax import lax

from wus.analysis import compat, primitives
from wus.analysis.compat import Jaxpr
from wus.analysis.graph import Graph
from wus.analysis.owned import Ownership


def rewritten_divides(jaxpr: Jaxpr) -> frozenset[int]:
  """The divisions by a scalar that XLA:CPU rewrites as multiplications by its reciprocal.

  XLA's algebraic simplifier rewrites `A / broadcast(B)` as `A * broadcast(1 / B)` on
  the CPU when B has one use (openxla `AlgebraicSimplifierVisitor::HandleDivide`,
  "A / broadcast(B) => A * broadcast(1 / B)"; the two round differently). It visits
  instructions in post order from the root. When every reader of a scalar B
  broadcasts it to one shape (one broadcast after CSE: B has one use), the
  first division visited is rewritten and no other, since B's reciprocal is
  then a second use. An owner that runs such a division alone would see B
  with one use and rewrite it too: the rewrite (`transforms.owned`) keeps B
  used twice on every owner and writes the reciprocal itself where this
  predicts XLA does in the unmodified step.

  Args:
    jaxpr: the step's flat jaxpr (the unmodified step, as XLA compiles it).

  Returns:
    Indices of the `div` equations rewritten, by this model of XLA's rule.
  """
  order: dict[int, int] = {}
  graph = Graph(jaxpr)
  producer = graph.producer
  for root in jaxpr.outvars:  # Post order from the root tuple, operands in order.
    stack = [] if compat.is_literal(root) or root not in producer else [(producer[root], 0)]
    while stack:
      i, k = stack.pop()
      if i in order:
        continue
      atoms = jaxpr.eqns[i].invars
      while k < len(atoms) and (compat.is_literal(atoms[k]) or atoms[k] not in producer
                                or producer[atoms[k]] in order):
        k += 1
      if k == len(atoms):
        order[i] = len(order)
      else:
        stack += [(i, k + 1), (producer[atoms[k]], 0)]
  scalars = dict.fromkeys(v for eqn in jaxpr.eqns for v in eqn.invars
                          if not compat.is_literal(v) and not v.aval.shape)
  out = set()
  for b in scalars:
    rs = graph.readers(b)
    shapes = {tuple(jaxpr.eqns[r].outvars[0].aval.shape) for r in rs}
    divides = [r for r in rs if jaxpr.eqns[r].primitive is lax.div_p
               and jaxpr.eqns[r].invars[1] is b and r in order]
    if (divides and b not in graph.outputs and len(shapes) == 1 and () not in shapes
        and all(jaxpr.eqns[r].primitive in primitives.ELEMENTWISE for r in rs)
        and np.issubdtype(b.aval.dtype, np.floating)):
      out.add(min(divides, key=order.__getitem__))
  return frozenset(out)


def pinned(jaxpr: Jaxpr, ownership: Ownership, rewritten: frozenset) -> Ownership:
  """`ownership` with the scalars owned divisions divide by pinned (`Ownership.pins`)."""
  eqns = {i for u in ownership.units for i in u.eqns}
  made = {v for i in eqns for v in jaxpr.eqns[i].outvars}
  divides = [i for i in sorted(eqns) if jaxpr.eqns[i].primitive is lax.div_p]
  pins = tuple(dict.fromkeys(
      b for i in divides for b in jaxpr.eqns[i].invars[1:] if not compat.is_literal(b)
      and not b.aval.shape and b not in made and np.issubdtype(b.aval.dtype, np.floating)))
  floats = [d for d in sorted(ownership.out_rows) if np.issubdtype(np.dtype(d), np.floating)]
  if not pins or not floats:
    return ownership
  rows = dict(ownership.out_rows)
  rows[floats[0]] += len(pins)
  unpinned: dict = {}
  for u in ownership.units:
    for i in rewritten.intersection(u.eqns):
      if jaxpr.eqns[i].invars[1] in pins:
        unpinned.setdefault(u.owner, set()).add(jaxpr.eqns[i].invars[1])
  return dataclasses.replace(ownership, out_rows=rows, pins=pins, pin_dtype=floats[0],
                             unpinned={r: frozenset(b) for r, b in unpinned.items()})
