"""Choosing the sharding format of every tensor of a cluster (§4.1).

Tensors that meet in an elementwise operation share one format. A reduction
forbids merging a reduced dim with a kept dim: the reduced dims must form
whole merged dims, so that a kept shard dim makes the reduction local and a
reduced shard dim makes it a masked partial reduction plus an all-reduce. A
broadcast along new dims likewise keeps new dims apart from the operand's. A
reshape that really regroups elements works only on the flat format.

The formats are found by a small fixed point. Tensors are grouped (union-find)
into classes that must share a format; each class holds the boundaries its
merged dims must respect (positions in its list of non-unit dims). Relations
between a tensor and its reduction or broadcast carry boundaries both ways;
boundaries only ever grow, so the iteration ends. The most merging that
satisfies every boundary is chosen: with no reductions, that is the flat format.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable, Iterator, Sequence

from wus.analysis import causes, compat, reasons, redundancy, rules
from wus.analysis.clusters import Cluster
from wus.analysis.compat import Jaxpr, JaxprEqn, Var
from wus.analysis.formats import ShardFormat, format_from_bounds, nonunit_dims
from wus.analysis.planning import PlanningContext
from wus.analysis.shardable import Kind


@dataclasses.dataclass(frozen=True)
class Layout:
  """The formats of one cluster.

  Attributes:
    formats: format of every big tensor the cluster holds or reads as shards.
    whole_reads: big tensors the cluster reads whole (broadcast along a new
      leading dim); sharded ones among them need an all-gather.
    partial: outputs of reductions over the shard dim: whole after their
      all-reduce, never shards.
  """

  formats: dict[Var, ShardFormat]
  whole_reads: frozenset
  partial: frozenset


class _Classes:
  """Union-find over tensors that share a format, with each class's boundaries."""

  def __init__(self):
    self.parent: dict[Var, Var] = {}
    self.bounds: dict[Var, set[int]] = {}
    self.flat_only: set[Var] = set()

  def add(self, v: Var) -> Var:
    if v not in self.parent:
      self.parent[v], self.bounds[v] = v, set()
    return self.find(v)

  def find(self, v: Var) -> Var:
    while self.parent[v] is not v:
      self.parent[v] = self.parent[self.parent[v]]
      v = self.parent[v]
    return v

  def union(self, a: Var, b: Var) -> None:
    a, b = self.add(a), self.add(b)
    if a is not b:
      self.parent[a] = b
      self.bounds[b] |= self.bounds.pop(a)
      if a in self.flat_only:
        self.flat_only.add(b)


def _signature(v: Var) -> tuple[int, ...]:
  return tuple(v.aval.shape[i] for i in nonunit_dims(v.aval.shape))


class _Constraints:
  """What the layout rules of one cluster record: classes that share a format,
  relations carrying boundaries between them, whole reads, partial results."""

  def __init__(self, big):
    self.big = big
    self.classes = _Classes()
    self.relations: list[tuple[Var, Var, list[int]]] = []  # (p, q, K): q's dims are p's dims K.
    self.whole_reads: set = set()
    self.partial: set = set()

  def broadcast(self, x: Var, y: Var, dims) -> None:
    """y = x broadcast with x's dim i at y's dim dims[i]."""
    classes = self.classes
    ny = nonunit_dims(y.aval.shape)
    mapped = {dims[i] for i in nonunit_dims(x.aval.shape)}
    from_x = [d in mapped for d in ny]
    classes.bounds[classes.add(y)] |= {p for p in range(1, len(ny)) if from_x[p] != from_x[p - 1]}
    if not self.big(x):
      return  # Small: read whole (and sliced if it supplies the shard dim).
    if from_x[0]:
      self.relations.append((y, x, [p for p, f in enumerate(from_x) if f]))
    else:
      classes.add(x)
      self.whole_reads.add(x)

  def constrain(self, jaxpr: Jaxpr, cluster: Cluster) -> str | None:
    """Applies the rule of every cluster equation's Kind; a reason if one cannot hold."""
    for i in cluster.eqns:
      eqn = jaxpr.eqns[i]
      ins = [v for v in eqn.invars if self.big(v)]
      outs = [v for v in eqn.outvars if self.big(v)]
      if (why := layout_rules[cluster.kinds[i]](self, eqn, ins, outs, cluster.nested.get(i))):
        return why
    return None


# How each Kind constrains the formats of what it reads and writes (§4.1):
# rule(constraints, eqn, big operands, big results, nested clusters) -> reason or None.
LayoutRule = Callable[[_Constraints, JaxprEqn, list, list, tuple | None], str | None]
layout_rules: dict[Kind, LayoutRule] = {}
layout_rule = rules.registrar(layout_rules, "layout rule")


@layout_rule(Kind.ELEMENTWISE)
def _elementwise(c: _Constraints, eqn, ins, outs, nested) -> None:
  y = outs[0]
  for v in outs[1:]:
    c.classes.union(v, y)
  for x in eqn.invars:
    if compat.is_literal(x) or not x.aval.shape:
      continue  # Scalars broadcast anywhere.
    if x.aval.shape == y.aval.shape:
      c.classes.union(x, y)
    else:  # Implicit broadcast of size-1 dims.
      c.broadcast(x, y, range(len(y.aval.shape)))


@layout_rule(Kind.LAYOUT, Kind.REDUCE_UNIT, Kind.REDUCE_SCATTER, Kind.SUM_OF_COPIES,
             Kind.IDENTITY)
def _same_elements(c: _Constraints, eqn, ins, outs, nested) -> None:
  """One operand, one result, the same elements: one format, or flat if dims regroup."""
  (x,), (y,) = ins, outs
  if _signature(x) == _signature(y):
    c.classes.union(x, y)
  else:
    c.classes.flat_only |= {c.classes.add(x), c.classes.add(y)}


@layout_rule(Kind.REDUCE_ALL)
def _reduce_all(c: _Constraints, eqn, ins, outs, nested) -> None:
  c.classes.add(ins[0])


@layout_rule(Kind.DOT_ALL)
def _dot_all(c: _Constraints, eqn, ins, outs, nested) -> None:
  if len(ins) == 2:
    c.classes.union(*ins)
  else:
    c.classes.add(ins[0])


@layout_rule(Kind.REDUCE)
def _reduce(c: _Constraints, eqn, ins, outs, nested) -> str | None:
  (x,), (y,) = eqn.invars, eqn.outvars
  axes = set(eqn.params["axes"])
  reduced = [d in axes for d in nonunit_dims(x.aval.shape)]
  c.classes.bounds[c.classes.add(x)] |= {p for p in range(1, len(reduced))
                                         if reduced[p] != reduced[p - 1]}
  if reduced[0]:
    c.partial.add(y)  # Whole after its all-reduce; a format only if big.
    if c.big(y):
      c.classes.add(y)
  elif not c.big(y):
    return causes.SmallReduction(x.aval.str_short(), y.aval.str_short())
  else:
    c.classes.add(y)
    c.relations.append((x, y, [p for p, r in enumerate(reduced) if not r]))
  return None


@layout_rule(Kind.BROADCAST_DIMS)
def _broadcast_dims(c: _Constraints, eqn, ins, outs, nested) -> None:
  c.broadcast(eqn.invars[0], outs[0], eqn.params["broadcast_dimensions"])


@layout_rule(Kind.BROADCAST, Kind.SCATTER_BLOCKS)
def _result_alone(c: _Constraints, eqn, ins, outs, nested) -> None:
  """Its result's format alone: a broadcast scalar, or SCATTER_BLOCKS, whose operand's
  blocks are cut to it in the collective."""
  c.classes.add(outs[0])


@layout_rule(Kind.COND)
def _cond(c: _Constraints, eqn, ins, outs, nested) -> str | None:
  cond = compat.cond(eqn)
  for branch, sub in zip(cond.branches, nested, strict=True):
    inner = branch.jaxpr
    for x, v in zip(cond.operands, inner.invars, strict=True):
      if c.big(v):
        c.classes.union(x, v)
    for y, v in zip(eqn.outvars, inner.outvars, strict=True):
      if c.big(y):
        c.classes.union(y, v)
    if (why := c.constrain(inner, sub)) is not None:
      return why
  return None


# A loop's body has its own plan (planner._plan_body); owned updates run on whole tensors
# (ownership.py): no cluster holds either.
@layout_rule(Kind.LOOP, Kind.OWNED, Kind.OWNED_SCATTER)
def _unclustered(c: _Constraints, eqn, ins, outs, nested) -> None:
  return None


def assign(jaxpr: Jaxpr, cluster: Cluster, num_shards: int, big) -> Layout | str:
  """Chooses a format for every big tensor of `cluster`.

  Args:
    jaxpr: the jaxpr the cluster belongs to.
    cluster: the cluster, with the shard kind of each equation.
    num_shards: N.
    big: predicate: is this atom a tensor worth sharding.

  Returns:
    The Layout, or a string saying why no format fits every operation.
  """
  c = _Constraints(big)
  if (why := c.constrain(jaxpr, cluster)) is not None:
    return why
  classes = c.classes
  _solve(classes, c.relations)
  for v in classes.flat_only:
    if classes.bounds[classes.find(v)]:
      return causes.Regroups(v.aval.str_short())
  formats = {v: format_from_bounds(tuple(v.aval.shape), frozenset(classes.bounds[classes.find(v)]),
                                   num_shards)
             for v in classes.parent}
  return Layout(formats, frozenset(c.whole_reads), frozenset(c.partial))


def assign_repeated(jaxpr: Jaxpr, cluster: Cluster, ctx: PlanningContext, in_loop: bool = False,
                    names: Sequence[str] = ()) -> tuple[Layout | str, reasons.OverCopies | None]:
  """`assign` over the replica axes, or over the other axes `ctx.copy_axes` too.

  A cluster that every replica of `ctx.copy_axes` repeats (`redundancy.differs_over`: in
  a tensor-parallel step, the update of a weight no spec splits over "model") gets
  formats of `ctx.num_shards * copies` shards (`Plan.shard_axes`), if every tensor
  has more elements than that (`formats.is_shardable_shape`'s rule); one that only some
  of them repeat (an FSDP block over "data", repeated over "model") is sharded over
  those, which its formats name (`ShardFormat.copy_axes`). A loop body's clusters keep
  `ctx.num_shards` (their carries cross the loop in one format).

  Args:
    jaxpr, cluster: as for `assign`.
    ctx: the planning's context (`axes`, `num_shards`, `copies`: axis -> size,
      `facts`, `big`).
    in_loop: whether `jaxpr` is a loop body.
    names: a name per input of `jaxpr` (its pytree path), for the reason.

  Returns:
    (`assign`'s result, the Plan's note on the copy axes: None without them).
  """
  n, copies = ctx.num_shards, math.prod(ctx.copy_sizes.values())
  if ctx.block_axes:
    return _within_blocks(jaxpr, cluster, ctx, names)
  if copies == 1 or in_loop:
    return assign(jaxpr, cluster, n, ctx.big), None
  note = functools.partial(reasons.OverCopies, tuple(sorted(ctx.axes)))
  axes, why = _repeated_over(jaxpr, cluster, ctx, names)
  if axes:
    wide_n = n * math.prod(ctx.copy_sizes[a] for a in axes)
    wide = assign(jaxpr, cluster, wide_n, ctx.big)
    if not isinstance(wide, Layout):
      why = why or wide
    elif all(math.prod(f.shape) > wide_n for f in wide.formats.values()):
      if axes != ctx.copy_axes:
        wide = dataclasses.replace(wide, formats={
            v: dataclasses.replace(f, copy_axes=axes) for v, f in wide.formats.items()})
      return wide, note(axes, summed=redundancy.sums_over(jaxpr, cluster, frozenset(axes)))
    else:
      why = why or causes.AtMost(wide_n)
  return assign(jaxpr, cluster, n, ctx.big), note(ctx.copy_axes, why)


def _within_blocks(jaxpr: Jaxpr, cluster: Cluster, ctx: PlanningContext, names: Sequence[str]
                   ) -> tuple[Layout | str, reasons.OverCopies]:
  """`assign_repeated` of an update of blocks of the plan's axes (`ctx.block_axes`: FSDP)
  that every replica of `ctx.copy_axes` repeats (`fsdp_blocks`; there `ctx.axes` are the
  copy axes): formats of `ctx.num_shards` shards over the copy axes alone, within each
  block (`ShardFormat.blocks`), or why not."""
  note = functools.partial(reasons.OverCopies, ctx.block_axes, ctx.copy_axes, blocks=True)
  why = redundancy.differs_over(jaxpr, cluster, ctx.facts, ctx.axes, names)
  layout = assign(jaxpr, cluster, ctx.num_shards, ctx.big) if why is None else why
  if isinstance(layout, Layout):
    if all(math.prod(f.shape) > ctx.num_shards for f in layout.formats.values()):
      return dataclasses.replace(layout, formats={
          v: dataclasses.replace(f, copy_axes=ctx.copy_axes, blocks=True)
          for v, f in layout.formats.items()}), note()
    layout = f"a tensor has at most {ctx.num_shards} elements"
  return layout, note(why=layout)


def copy_axis_sets(copies: Sequence[str]) -> Iterator[tuple[str, ...]]:
  """Every nonempty set of the copy axes `copies`, the most axes first, each in mesh order:
  the order in which the planner tries to shard an update over the replicas repeating it."""
  return (a for k in range(len(copies), 0, -1) for a in itertools.combinations(copies, k))


def _repeated_over(jaxpr: Jaxpr, cluster: Cluster, ctx: PlanningContext, names: Sequence[str]
                   ) -> tuple[tuple, str | None]:
  """The most copy axes (`ctx.copy_axes`, in mesh order) every replica of which repeats the
  cluster (`redundancy.differs_over`), and why not all of them (None if all). Each set is
  checked as a whole: a gradient summed over one copy axis and not another is repeated
  over each alone, not over both at once."""
  why = None
  for axes in copy_axis_sets(ctx.copy_axes):
    differs = redundancy.differs_over(jaxpr, cluster, ctx.facts, frozenset(axes), names)
    if differs is None:
      return axes, why
    why = why or differs
  return (), why


def _solve(classes: _Classes, relations) -> None:
  """Carries boundaries across relations until nothing changes."""
  changed = True
  while changed:
    changed = False
    for p, q, dims in relations:
      bp, bq = classes.bounds[classes.find(p)], classes.bounds[classes.find(q)]
      to_q = {j for j in range(1, len(dims))
              if any(b in bp for b in range(dims[j - 1] + 1, dims[j] + 1))}
      to_p = {dims[j] for j in bq if dims[j] == dims[j - 1] + 1}
      if not (to_q <= bq and to_p <= bp):
        bq |= to_q
        bp |= to_p
        changed = True
