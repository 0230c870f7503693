"""The dims of a region's equations, as the passes read them: each equation's `Dims` from
the complete rule table (`analysis.dims` and `analysis.dims_indexing`), and the
equations of its conditionals' branches, keyed by where they sit.

Two passes read them:
  * `analysis.propagation` carries the batch's splits forward through the whole
    step (`wus.jit`): which values the batch axes split, and which equations sum
    them;
  * `analysis.model_splits` solves the model splits of the update region as
    equalities between joined dims (a union-find), each summed dim an all-reduce
    over the model axes.
"""

from __future__ import annotations

from wus.analysis import compat
from wus.analysis import dims_indexing  # noqa: F401  (registers its rules in `dim_rules`)
from wus.analysis.compat import JaxprEqn
from wus.analysis.dims import Dims, dim_rules, whole


def of(eqn: JaxprEqn) -> Dims:
  """The rule's `Dims` of `eqn` (every dim whole for a primitive without a rule)."""
  return dim_rules.get(eqn.primitive, whole)(eqn)


def nested(eqns) -> list:
  """(key, equation) of `eqns` (pairs of key and equation) and, after each conditional,
  its branches' equations, keyed (key, branch, position), recursively: what one pass over
  the dims of a region with conditionals reads."""
  out = []
  for key, eqn in eqns:
    out.append((key, eqn))
    if eqn.primitive is compat.cond_p:
      for b, branch in enumerate(compat.cond(eqn).branches):
        out += nested(((key, b, j), e) for j, e in enumerate(branch.jaxpr.eqns))
  return out


def top(key) -> int:
  """The position in the region of the equation a `nested` key belongs to."""
  while isinstance(key, tuple):
    key = key[0]
  return key
