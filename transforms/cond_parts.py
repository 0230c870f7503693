"""A conditional as independent parts, one `cond` each.

An optimizer wrapper puts every tensor's update under one `cond`
(`optax.MultiSteps` emits or skips the inner update; `optax.apply_if_finite`
applies or drops it). To the analysis that one equation joins all the tensors:
were one of them computed differently on each replica (an FSDP weight's block),
the whole conditional would be, and no tensor's update under it could be sharded.
Its outputs, though, usually share nothing but scalars (the step count, Adam's
bias correction): split into one `cond` per group of outputs, on the same index,
each tensor's update is a part of its own, as it would be without the wrapper.

The split keeps every value: each part is the conditional restricted to some
outputs by JAX's own dead-code rule for `cond`, the scalars they share computed
again in each part. It is not free in every program: XLA's algebraic simplifier
rewrites Adam's divisions (`a / b / c` as `a / (b * c)`, or a division by a
scalar as a product with its reciprocal) by what it sees of each branch, so the
split program can round an element 1 ulp away from the whole one. `wus.jit`
therefore splits only a step whose state is placed over a batch axis (FSDP,
HSDP), where the whole conditional would leave nothing to shard.
"""

from __future__ import annotations

import math

import jax

from wus.analysis import compat
from wus.transforms import interpret


def parts(eqn) -> list[list[int]]:
  """The outputs of `cond` equation `eqn` in groups that can be computed apart.

  Two outputs are in one group when, in some branch, both depend on one operand
  or intermediate value of more than one element (directly, or through scalars
  computed from it): a global norm joins every tensor it reads, a step count does
  not. Outputs that depend on no such value form one group.

  Args:
    eqn: a `cond` equation.

  Returns:
    The groups, each a sorted list of output positions, by first position; one
    group (no split) for a conditional with effects or non-array values.
  """
  everything = [list(range(len(eqn.outvars)))]
  cond = compat.cond(eqn)
  if eqn.effects or not all(_is_array(v.aval) for b in cond.branches
                            for v in (*b.jaxpr.invars, *b.jaxpr.outvars)):
    return everything
  parent: dict = {}

  def find(n):
    while parent.get(n, n) != n:
      parent[n] = parent.get(parent[n], parent[n])
      n = parent[n]
    return n

  def union(a, nodes):
    for b in nodes:
      ra, rb = find(a), find(b)
      if ra != rb:
        parent[rb] = ra

  for b, closed in enumerate(cond.branches):
    jaxpr = closed.jaxpr
    # Per value: the nodes (large operands and intermediates) it depends on.
    reach = {v: (frozenset({("operand", j)}) if _large(v.aval) else frozenset())
             for j, v in enumerate(jaxpr.invars)}
    reach.update((v, frozenset()) for v in jaxpr.constvars)
    for i, e in enumerate(jaxpr.eqns):
      if not all(_is_array(v.aval) for v in e.outvars):
        return everything
      read = frozenset().union(*(reach[v] for v in e.invars if not compat.is_literal(v)))
      for k, o in enumerate(e.outvars):
        if _large(o.aval):
          union((b, i, k), read)
          reach[o] = frozenset({(b, i, k)})
        else:
          reach[o] = read
    for k, v in enumerate(jaxpr.outvars):
      union(("output", k), () if compat.is_literal(v) else reach[v])
  groups: dict = {}
  free = []
  operands = {find(("operand", j)) for j in range(len(cond.operands))}
  for k in range(len(eqn.outvars)):
    root = find(("output", k))
    (groups.setdefault(root, []) if root in operands else free).append(k)
  out = sorted(groups.values()) + ([free] if free else [])
  return sorted(out) if len(out) > 1 else everything


def part(eqn, outputs: list[int]):
  """(operand mask, equation): `eqn` computing only `outputs`, by JAX's dead-code rule for
  `cond` (every branch restricted to them and to the operands any branch reads for them;
  the index always kept)."""
  used = set(outputs)
  return compat.dce_eqn(eqn, [k in used for k in range(len(eqn.outvars))])


def _is_array(aval) -> bool:
  return hasattr(aval, "shape") and hasattr(aval, "dtype")


def _large(aval) -> bool:
  return math.prod(aval.shape) > 1


def split(closed):
  """`closed` (a flat closed jaxpr) traced again with each `cond` at its top level as its
  independent parts (`parts`); the same jaxpr when none has more than one."""
  jaxpr = closed.jaxpr
  if all(len(parts(e)) == 1 for e in jaxpr.eqns if e.primitive is compat.cond_p):
    return closed

  def hook(i, eqn, ins):
    groups = parts(eqn) if eqn.primitive is compat.cond_p else []
    if len(groups) <= 1:
      return compat.bind(eqn, *ins)
    outs: list = [None] * len(eqn.outvars)
    for group in groups:
      read, sub = part(eqn, group)
      for k, x in zip(group, compat.bind(sub, *[x for x, r in zip(ins, read, strict=True) if r]),
                      strict=True):
        outs[k] = x
    return outs
  return jax.make_jaxpr(lambda *a: interpret.eval_jaxpr(jaxpr, closed.consts, a, hook))(
      *closed.in_avals)
