"""Which values of a global step's update region are split over the model axes (`wus.jit`
on a data x model mesh, DESIGN.md §1).

On a ("data", "model") mesh a `jax.jit` step places its weights over "model"
(tensor parallelism: a NamedSharding, `in_shardings`, `nnx.with_partitioning`,
linen's logical axis rules) and its batch over "data". `analysis.global_view`
cuts the update region at the batch axes; the region then runs as a shard_map
manual over every mesh axis, so each model rank updates its own block of each
model-split tensor, and wus shards that block's update over the data groups
(Megatron's distributed-optimizer layout). This module says, for every value
the region reads or computes, which of its dims each model axis splits, so the
region's equations can run on those blocks (`transforms.model_local`).

The splits are solved as equalities between dims: a union-find over (value,
dim) nodes, joined by the rule of each equation's primitive (`split_rules`,
keyed by primitive: an elementwise op joins the same dims of its operands and
result, a transpose permutes them, a reduction keeps its kept dims, a
dot_general pairs batch, contracting and free dims). Seeds are the placements
of the step's inputs over the model axes (and, on a mesh with Explicit axes,
the types of every value) and the model axes a sharding constraint in the
region names. A dim that a primitive without a rule reads or writes, or that
a rule says must be whole (an iota's, a size-1 dim broadcast), stays whole;
a class seeded with two splits, a value split twice over one axis, or a split
dim its axes do not divide is a conflict: the region cannot run on blocks, and
the caller says why in the Plan.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping

from jax import lax

from wus.analysis import compat, primitives, rules
from wus.analysis.compat import JaxprEqn, Var

Node = tuple  # (value, dim)
# A split rule: the dim pairs an equation makes equal, and the dims it needs whole.
Joins = tuple[list[tuple[Node, Node]], list[Node]]
split_rules: dict[compat.Primitive, Callable[[JaxprEqn], Joins]] = {}
split_rule = rules.registrar(split_rules, "split rule")

# Reductions whose result over a split dim is completed by an all-reduce over its axes.
REDUCE_OPS = {lax.reduce_sum_p: "sum", lax.reduce_max_p: "max", lax.reduce_min_p: "min"}


def _var(v) -> bool:
  return not compat.is_literal(v)


def _shape(v) -> tuple:
  return tuple(getattr(v.aval, "shape", ()))


@split_rule(*primitives.ELEMENTWISE)
def _elementwise(eqn) -> Joins:
  joins, whole = [], []
  for out in eqn.outvars:
    for v in filter(_var, eqn.invars):
      if len(_shape(v)) != len(_shape(out)):
        continue
      for d, (m, n) in enumerate(zip(_shape(v), _shape(out), strict=True)):
        (joins.append(((v, d), (out, d))) if m == n else whole.append((v, d)))
  return joins, whole


@split_rule(lax.optimization_barrier_p)
def _same_dims(eqn) -> Joins:
  """Operand k's dims are result k's (optimization_barrier, sharding constraints)."""
  return ([((v, d), (o, d)) for v, o in zip(eqn.invars, eqn.outvars, strict=True) if _var(v)
           for d in range(len(_shape(o)))], [])


@split_rule(*rules.distinct(lax.sharding_constraint_p, compat.reshard_p))
def _constraint(eqn) -> Joins:
  """A sharding constraint: its result's dims are its operand's, and a dim its spec leaves
  None is whole (a block the constraint replicates cannot be laid out so: the region then
  does not run on blocks, and the step keeps the constraint's meaning under jax.jit)."""
  joins, _ = _same_dims(eqn)
  spec = compat.constraint_spec(eqn)
  if spec is None or not compat.lays_out(eqn):  # JAX's own reshards on Auto axes: none.
    return joins, []
  out = eqn.outvars[0]
  entries = (*spec, *(None,) * (len(_shape(out)) - len(spec)))
  return joins, [(out, d) for d, e in enumerate(entries[:len(_shape(out))]) if e is None]


@split_rule(lax.broadcast_in_dim_p)
def _broadcast(eqn) -> Joins:
  (v,), (out,) = eqn.invars, eqn.outvars
  if not _var(v):
    return [], []
  joins, whole = [], []
  for d, e in enumerate(eqn.params["broadcast_dimensions"]):
    (joins.append(((v, d), (out, e))) if _shape(v)[d] == _shape(out)[e]
     else whole.append((v, d)))
  return joins, whole


@split_rule(*REDUCE_OPS)
def _reduce(eqn) -> Joins:
  (v,), (out,) = eqn.invars, eqn.outvars
  kept = [d for d in range(len(_shape(v))) if d not in eqn.params["axes"]]
  return [((v, d), (out, e)) for e, d in enumerate(kept)], []


@split_rule(lax.transpose_p)
def _transpose(eqn) -> Joins:
  (v,), (out,) = eqn.invars, eqn.outvars
  return [((v, d), (out, e)) for e, d in enumerate(eqn.params["permutation"])], []


@split_rule(lax.dot_general_p)
def _dot_general(eqn) -> Joins:
  (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
  lhs, rhs = eqn.invars
  (out,) = eqn.outvars
  joins = [((lhs, d), (rhs, e)) for d, e in zip((*lc, *lb), (*rc, *rb), strict=True)]
  joins += [((lhs, d), (out, k)) for k, d in enumerate(lb)]
  lfree = [d for d in range(len(_shape(lhs))) if d not in (*lc, *lb)]
  rfree = [d for d in range(len(_shape(rhs))) if d not in (*rc, *rb)]
  joins += [((lhs, d), (out, len(lb) + k)) for k, d in enumerate(lfree)]
  joins += [((rhs, d), (out, len(lb) + len(lfree) + k)) for k, d in enumerate(rfree)]
  return [(a, b) for a, b in joins if _var(a[0]) and _var(b[0])], []


@split_rule(lax.reshape_p)
def _reshape(eqn) -> Joins:
  """A dim keeps its split through a reshape where it stays whole: the same size after
  the same number of elements (merged or split dims stay whole)."""
  v, out = eqn.invars[0], eqn.outvars[0]
  if eqn.params.get("dimensions") is not None or not _var(v):
    return [], []
  def starts(shape):
    return {(math.prod(shape[:d]), n): d for d, n in enumerate(shape) if n > 1}
  a, b = starts(_shape(v)), starts(_shape(out))
  joins = [((v, a[k]), (out, b[k])) for k in a.keys() & b.keys()]
  whole = [(v, a[k]) for k in a.keys() - b.keys()] + [(out, b[k]) for k in b.keys() - a.keys()]
  return joins, whole


@split_rule(lax.squeeze_p)
def _squeeze(eqn) -> Joins:
  (v,), (out,) = eqn.invars, eqn.outvars
  kept = [d for d in range(len(_shape(v))) if d not in eqn.params["dimensions"]]
  return [((v, d), (out, e)) for e, d in enumerate(kept) if _var(v)], []


def _whole(eqn) -> Joins:
  return [], [(v, d) for v in (*filter(_var, eqn.invars), *eqn.outvars)
              for d in range(len(_shape(v)))]


@dataclasses.dataclass(frozen=True)
class ModelSplits:
  """The model splits of a region's values.

  Attributes:
    of: value -> per dim, None or the tuple of model axes splitting it; values
      split over no model axis are absent.
    reduced: equation position -> the model axes its result is a partial
      reduction over (a reduce or a dot_general over a split dim), which an
      all-reduce over those axes completes.
    scattered: gradient sum position -> per dim of its result, None or the
      batch axes a reduce-scatter splits it over: the gradient of a weight the
      step places over a batch axis itself (FSDP), whose sum is computed whole
      on this replica's rows and reduce-scattered to its block.
  """

  of: Mapping[Var, tuple]
  reduced: Mapping[int, tuple]
  scattered: Mapping[int, tuple] = dataclasses.field(default_factory=dict)

  def split(self, v) -> tuple | None:
    return None if compat.is_literal(v) else self.of.get(v)

  def axes(self) -> tuple[str, ...]:
    """The mesh axes splitting some value, in order of first appearance."""
    return tuple(dict.fromkeys(a for s in self.of.values() for e in s if e for a in e))

  def computed(self, position: int, v) -> tuple | None:
    """The split of `v` as the equation at `position` computes it: before the
    reduce-scatter of a scattered sum."""
    split, scatter = self.split(v), self.scattered.get(position)
    if not split or not scatter:
      return split
    return tuple(None if e == s else e for e, s in zip(split, scatter, strict=True))


class Refusal(str):
  """Why a region cannot run on model blocks (a `str`, as every refusal is), and the
  position of the equation that needs a split dim whole, where one does: the caller
  may run that equation, and what it reads, outside the region instead."""

  position: int | None

  def __new__(cls, why: str, position: int | None = None) -> Refusal:
    out = super().__new__(cls, why)
    out.position = position
    return out


class _Classes:
  """Union-find over (value, dim) nodes."""

  def __init__(self):
    self.parent: dict = {}

  def find(self, n):
    self.parent.setdefault(n, n)
    while self.parent[n] != n:
      self.parent[n] = self.parent[self.parent[n]]
      n = self.parent[n]
    return n

  def join(self, a, b) -> None:
    self.parent[self.find(a)] = self.find(b)


def solve(eqns: Iterable[tuple[int, JaxprEqn]], values: Iterable[Var],
          seeds: Mapping[Var, tuple], axis_sizes: Mapping[str, int]) -> ModelSplits | str:
  """The model splits of `values` that the equations' rules and the seeds imply.

  Args:
    eqns: (position, equation) of the region, in order.
    values: every value the region reads or computes.
    seeds: value -> per dim, None or the model axes a placement splits it over.
    axis_sizes: mesh axis -> size.

  Returns:
    The `ModelSplits`, or why the region cannot run on model blocks (a `Refusal`
    naming the equation, for one that needs a split dim whole).
  """
  eqns = list(eqns)
  classes, whole, by_class = _Classes(), [], {}
  for i, eqn in eqns:
    rule = split_rules.get(eqn.primitive, _whole)
    joins, must = rule(eqn)
    for a, b in joins:
      classes.join(a, b)
    whole += [(n, i, eqn) for n in must]
  for v, split in seeds.items():
    for d, entry in enumerate(split):
      if entry:
        root = classes.find((v, d))
        if by_class.setdefault(root, entry) != entry:
          return (f"a tensor {v.aval.str_short()} is placed over {entry} where what it meets "
                  f"is placed over {by_class[root]}")
  for (v, d), i, eqn in whole:
    if (entry := by_class.get(classes.find((v, d)))):
      return Refusal(f"{eqn.primitive} at {compat.source_line(eqn)} needs dim {d} of "
                     f"{v.aval.str_short()} whole, which is split over {list(entry)}", i)
  out = {}
  for v in values:
    split = tuple(by_class.get(classes.find((v, d))) for d in range(len(_shape(v))))
    if not any(split):
      continue
    names = [a for e in split if e for a in e]
    if len(set(names)) != len(names):
      return f"a value {v.aval.str_short()} would be split twice over one axis ({split})"
    for n, e in zip(_shape(v), split, strict=True):
      if e and n % math.prod(axis_sizes[a] for a in e):
        return (f"a dim of {n} of {v.aval.str_short()} does not divide over {list(e)}, which "
                "its placement splits it over")
    out[v] = split
  return ModelSplits(out, _reduced(eqns, out))


def _reduced(eqns, splits: Mapping[Var, tuple]) -> dict[int, tuple]:
  """Per equation that sums (or maxes) over a split dim, the axes of those dims."""
  out = {}
  for i, eqn in eqns:
    dims: list = []
    if eqn.primitive in REDUCE_OPS:
      dims = [(eqn.invars[0], d) for d in eqn.params["axes"]]
    elif eqn.primitive is lax.dot_general_p:
      (lc, _), _ = eqn.params["dimension_numbers"]
      dims = [(eqn.invars[0], d) for d in lc]
    axes = tuple(a for v, d in dims if _var(v) and (s := splits.get(v)) and s[d] for a in s[d])
    if axes:
      out[i] = axes
  return out


def merged(parts: Iterable[ModelSplits], scattered: Mapping[int, tuple]) -> ModelSplits | str:
  """One `ModelSplits` of splits solved over disjoint axes (the model axes, and the
  batch axes the state is placed over: FSDP), or why a dim is split by both."""
  of: dict = {}
  reduced: dict = {}
  for part in parts:
    for v, split in part.of.items():
      old = of.get(v, (None,) * len(split))
      if any(a and b for a, b in zip(old, split, strict=True)):
        return (f"a dim of {v.aval.str_short()} is split over the model axes and over the "
                f"batch axes at once ({old}, {split})")
      of[v] = tuple(a or b for a, b in zip(old, split, strict=True))
    for i, axes in part.reduced.items():
      reduced[i] = tuple(dict.fromkeys((*reduced.get(i, ()), *axes)))
  return ModelSplits(of, reduced, dict(scattered))


def spec_with(batch: tuple | None, model: tuple | None) -> tuple | None:
  """Per dim, the batch split then the model split of one value; None if a dim is split
  both ways (the region cannot pair such blocks with the others'), else the merged split
  (None entries where neither splits, () for a value split by neither)."""
  n = len(batch or model or ())
  batch, model = batch or (None,) * n, model or (None,) * n
  if any(b and m for b, m in zip(batch, model, strict=True)):
    return None
  return tuple(b or m for b, m in zip(batch, model, strict=True))


def seeds_of_types(values: Iterable[Var], model_axes: frozenset) -> dict[Var, tuple]:
  """The model splits a mesh with Explicit axes writes in the values' types."""
  out = {}
  for v in values:
    spec, _ = compat.sharding_spec(v.aval)
    split = _restricted(spec, len(_shape(v)), model_axes)
    if split:
      out[v] = split
  return out


def seeds_of_constraints(eqns: Iterable[tuple[int, JaxprEqn]],
                         model_axes: frozenset) -> dict[Var, tuple]:
  """The model splits the sharding constraints among `eqns` lay their results out by."""
  out = {}
  for _, eqn in eqns:
    spec = compat.constraint_spec(eqn)
    if spec is not None:
      for v in eqn.outvars:
        if (split := _restricted(tuple(spec), len(_shape(v)), model_axes)):
          out[v] = split
  return out


def restricted(spec, ndim: int, model_axes: frozenset) -> tuple | None:
  """A PartitionSpec's entries restricted to `model_axes`, one per dim; None if it
  names none of them."""
  return _restricted(tuple(spec), ndim, model_axes)


def _restricted(spec: tuple, ndim: int, model_axes: frozenset) -> tuple | None:
  entries = []
  for e in (*spec, *(None,) * (ndim - len(spec)))[:ndim]:
    names = tuple(n for n in (() if e is None else e if isinstance(e, tuple) else (e,))
                  if n in model_axes)
    entries.append(names or None)
  return tuple(entries) if any(entries) else None
