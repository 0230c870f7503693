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
from collections.abc import Callable
from typing import Any

import jax
from jax import lax

from wus.analysis import compat
from wus.transforms import interpret


def parts(eqn, hoist: bool = False) -> list[list[int]]:
  """The outputs of `cond` equation `eqn` in groups that can be computed apart.

  Two outputs are in one group when, in some branch, both depend on one operand
  or intermediate value of more than one element (directly, or through scalars
  computed from it): a global norm joins every tensor it reads, a step count does
  not. Outputs that depend on no such value form one group.

  Args:
    eqn: a `cond` equation.
    hoist: the groups once each branch's reductions to scalars (`hoisted`) run before
      the conditional: their results are then operands, a global norm one scalar.

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
    outside = hoisted(jaxpr) if hoist else frozenset()
    # Per value: the nodes (large operands and intermediates) it depends on.
    reach = {v: (frozenset({("operand", j)}) if _large(v.aval) else frozenset())
             for j, v in enumerate(jaxpr.invars)}
    reach.update((v, frozenset()) for v in jaxpr.constvars)
    for i, e in enumerate(jaxpr.eqns):
      if not all(_is_array(v.aval) for v in e.outvars):
        return everything
      if i in outside:  # Computed before the conditional: an operand of it.
        reach.update((o, frozenset({("operand", b, i, k)}) if _large(o.aval) else frozenset())
                     for k, o in enumerate(e.outvars))
        continue
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
  operands = {find(n) for n in parent if n[0] == "operand"}
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


def hoisted(jaxpr) -> frozenset[int]:
  """The equations of a branch that run before the conditional when it is split with
  `parts(..., hoist=True)`: each reduction of a large value to a scalar or tiny value (a
  global norm's sum of squares, an all-finite test) and the equations it reads from; none
  if one of them has effects.

  Run every step instead of only when the branch is taken, they cost a reduction over
  the tensors (MultiSteps' emit branch: a norm of the accumulated gradients at every
  micro-step), and the branch, and so each part, reads their scalar results.
  """
  producer = {o: i for i, e in enumerate(jaxpr.eqns) for o in e.outvars}
  todo = [i for i, e in enumerate(jaxpr.eqns)
          if not any(_large(o.aval) for o in e.outvars)
          and any(not compat.is_literal(v) and _large(v.aval) for v in e.invars)]
  found: set = set()
  while todo:
    i = todo.pop()
    if i not in found:
      found.add(i)
      todo += [producer[v] for v in jaxpr.eqns[i].invars
               if not compat.is_literal(v) and v in producer]
  if any(jaxpr.eqns[i].effects for i in found):
    return frozenset()
  return frozenset(found)


def _hoist(eqn, ins: list) -> list:
  """`eqn` (a `cond`) bound on `ins` with each branch's `hoisted` equations run before
  it: their results that the rest of the branch reads become operands."""
  cond = compat.cond(eqn)
  index, ops = cond.split(ins)
  outsides = [hoisted(closed.jaxpr) for closed in cond.branches]
  extras, reads = [], []
  for closed, outside in zip(cond.branches, outsides, strict=True):
    jaxpr = closed.jaxpr
    env = dict(zip(jaxpr.constvars, closed.consts, strict=True))
    env.update(zip(jaxpr.invars, ops, strict=True))
    interpret.eval_eqns(jaxpr, env, order=sorted(outside))
    inside = [e for i, e in enumerate(jaxpr.eqns) if i not in outside]
    read = {v for v in (*(v for e in inside for v in e.invars), *jaxpr.outvars)
            if not compat.is_literal(v)}
    made = [o for i in sorted(outside) for o in jaxpr.eqns[i].outvars if o in read]
    reads.append((len(extras), made))
    extras += [env[o] for o in made]

  def branch(b: int):
    closed, outside, (start, made) = cond.branches[b], outsides[b], reads[b]
    jaxpr = closed.jaxpr

    def fn(*args):
      env = dict(zip(jaxpr.constvars, closed.consts, strict=True))
      env.update(zip(jaxpr.invars, args[:len(ops)], strict=True))
      env.update(zip(made, args[len(ops) + start:len(ops) + start + len(made)], strict=True))
      interpret.eval_eqns(jaxpr, env, order=[i for i in range(len(jaxpr.eqns))
                                             if i not in outside])
      return [interpret.read(env, v) for v in jaxpr.outvars]
    return fn
  with compat.source_of(eqn):
    return list(lax.switch(index, [branch(b) for b in range(len(cond.branches))],
                           *ops, *extras))


def _retraced(closed, which, hook):
  """`closed` traced again, `hook(eqn, ins)` in place of each top-level `cond` `which`
  selects; the same jaxpr when it selects none."""
  jaxpr = closed.jaxpr
  if not any(e.primitive is compat.cond_p and which(e) for e in jaxpr.eqns):
    return closed

  def on(i, eqn, ins):
    if eqn.primitive is compat.cond_p and which(eqn):
      return hook(eqn, ins)
    return compat.bind(eqn, *ins)
  return jax.make_jaxpr(lambda *a: interpret.eval_jaxpr(jaxpr, closed.consts, a, on))(
      *closed.in_avals)


def _is_array(aval) -> bool:
  return hasattr(aval, "shape") and hasattr(aval, "dtype")


def _large(aval) -> bool:
  return math.prod(aval.shape) > 1


def split(closed, select: Callable[[Any], bool] = lambda eqn: True):
  """`closed` (a flat closed jaxpr) traced again with each `cond` at its top level that
  `select` takes as its independent parts (`parts`), its reductions to scalars run
  before it (`hoisted`) where they join parts, and the conditionals in its branches
  split first, the same way (`optax.MultiSteps` around `optax.apply_if_finite`); the
  same jaxpr when no such `cond` has more than one part.

  `select` (a top-level `cond` equation of `closed` -> bool) is asked once per equation,
  of `closed` itself: `wus.jit` splits the conditionals of the update (those reading a
  gradient sum) and leaves the forward pass's as the user wrote them.
  """
  alone: dict = {}

  def split_alone(eqn):  # The conditional as a closed jaxpr of its own, split; None if whole.
    if id(eqn) not in alone:
      alone[id(eqn)] = _split_alone(eqn) if select(eqn) else None
    return alone[id(eqn)]

  def hook(eqn, ins):
    parted = split_alone(eqn)
    return interpret.eval_jaxpr(parted.jaxpr, parted.consts,
                                [x for x, v in zip(ins, eqn.invars, strict=True)
                                 if not compat.is_literal(v)])
  return _retraced(closed, lambda e: split_alone(e) is not None, hook)


def _split_alone(eqn):
  """`eqn` (a `cond`) as a closed jaxpr of its operands that are not literals, split
  (`_split_all`); None if neither it nor a conditional in its branches splits."""
  ins = [v for v in eqn.invars if not compat.is_literal(v)]

  def fn(*args):
    it = iter(args)
    return compat.bind(eqn, *[v.val if compat.is_literal(v) else next(it) for v in eqn.invars])
  closed = jax.make_jaxpr(fn)(*[v.aval for v in ins])
  parted = _split_all(closed)
  return None if parted is closed else parted


def _split_all(closed):
  """`split` of every top-level `cond` of `closed`."""
  nested: dict = {}

  def inner(eqn):  # The conditional with its branches split (the same one if none is).
    if id(eqn) not in nested:
      branches = compat.cond(eqn).branches
      new = tuple(_split_all(b) for b in branches)
      nested[id(eqn)] = (eqn if all(n is b for n, b in zip(new, branches, strict=True))
                         else compat.with_branches(eqn, new))
    return nested[id(eqn)]
  closed = _retraced(closed, lambda e: inner(e) is not e,
                     lambda e, ins: compat.bind(inner(e), *ins))
  closed = _retraced(closed, lambda e: len(parts(e, hoist=True)) > len(parts(e)), _hoist)
  return _retraced(closed, lambda e: len(parts(e)) > 1, _split)


def _split(eqn, ins: list) -> list:
  """`eqn` (a `cond`) bound on `ins` as its parts, one `cond` each."""
  outs: list = [None] * len(eqn.outvars)
  for group in parts(eqn):
    read, sub = part(eqn, group)
    for k, x in zip(group, compat.bind(sub, *[x for x, r in zip(ins, read, strict=True) if r]),
                    strict=True):
      outs[k] = x
  return outs
