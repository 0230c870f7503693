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
dim) nodes, joined by the rule of each equation's primitive (`analysis.dims`,
the table sharding propagation reads too: an elementwise op joins the same dims
of its operands and result, a transpose permutes them, a reduction keeps its
kept dims, a dot_general pairs batch, contracting and free dims, a reshape its
major factors). Seeds are the placements
of the step's inputs over the model axes (and, on a mesh with Explicit axes,
the types of every value) and the model axes a sharding constraint in the
region names. A dim that a primitive without a rule reads or writes, or that
a rule says must be whole (an iota's, a size-1 dim broadcast), stays whole;
a class seeded with two splits, a value split twice over one axis, or a split
dim its axes do not divide is a conflict: the region cannot run on blocks, and
the caller says why in the Plan (a `reasons.Reason`, its verdict one of `refusals`').
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import Any


from wus.analysis import compat, refusals, region_dims
from wus.analysis.compat import JaxprEqn, Var
from wus.analysis.reasons import Reason


def _shape(v) -> tuple:
  return tuple(getattr(v.aval, "shape", ()))


@dataclasses.dataclass(frozen=True)
class ModelSplits:
  """The model splits of a region's values.

  Attributes:
    of: value -> per dim, None or the tuple of model axes splitting it; values
      split over no model axis are absent.
    reduced: equation position (its `region_dims.nested` key inside a conditional's
      branch) -> the model axes its result is a partial
      reduction over (a reduce or a dot_general over a split dim), which an
      all-reduce over those axes completes.
    scattered: gradient sum position -> per dim of its result, None or the
      batch axes a reduce-scatter splits it over: the gradient of a weight the
      step places over a batch axis itself (FSDP), whose sum is computed whole
      on this replica's rows and reduce-scattered to its block.
  """

  of: Mapping[Var, tuple]
  reduced: Mapping[Any, tuple]
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
          seeds: Mapping[Var, tuple], axis_sizes: Mapping[str, int],
          typed: frozenset = frozenset()) -> ModelSplits | Reason:
  """The model splits of `values` that the equations' rules and the seeds imply.

  Args:
    eqns: (position, equation) of the region, in order.
    values: every value the region reads or computes.
    seeds: value -> per dim, None or the model axes a placement splits it over.
    axis_sizes: mesh axis -> size.
    typed: the axes (Explicit) whose splits every value's type states. Where two
      splits meet, an equation that joins dims its operand and result types lay out
      differently there (a `dot_general` with an `out_sharding`: a reshard) is the one
      that cannot run on blocks.

  Returns:
    The `ModelSplits`, or why the region cannot run on model blocks (a `Reason`; its
    verdict `refusals.NeedsWhole` or `refusals.Reshards`, naming the equation and its
    position, for one that needs a split dim whole or reshards where splits meet).
  """
  eqns = region_dims.nested(eqns)  # A conditional's branches run on blocks too.
  values = [*values, *(v for _, e in eqns for v in e.outvars),
            *(v for _, e in eqns if e.primitive is compat.cond_p
              for b in compat.cond(e).branches for v in b.jaxpr.invars)]
  classes, whole, by_class, edges = _Classes(), [], {}, []
  for i, eqn in eqns:
    joins, must, _ = region_dims.of(eqn)
    for a, b in joins:
      classes.join(a, b)
    edges += [(i, eqn, a, b) for a, b in joins]
    whole += [(n, i, eqn) for n in must]
  for v, split in seeds.items():
    for d, entry in enumerate(split):
      if entry:
        root = classes.find((v, d))
        if by_class.setdefault(root, entry) != entry:
          return _resharded(edges, classes, {root}, typed) or Reason(
              refusals.PlacedApart(v.aval.str_short(), entry, by_class[root]))
  for (v, d), i, eqn in whole:
    if (entry := by_class.get(classes.find((v, d)))):
      return Reason(refusals.NeedsWhole(str(eqn.primitive), compat.source_line(eqn), d,
                                        v.aval.str_short(), tuple(entry), region_dims.top(i)))
  out = {}
  for v in dict.fromkeys(values):
    split = tuple(by_class.get(classes.find((v, d))) for d in range(len(_shape(v))))
    if not any(split):
      continue
    names = [a for e in split if e for a in e]
    if len(set(names)) != len(names):
      return _resharded(edges, classes, {classes.find((v, d)) for d, e in enumerate(split)
                                         if e}, typed) or Reason(
          refusals.SplitTwice(v.aval.str_short(), split))
    for n, e in zip(_shape(v), split, strict=True):
      if e and n % math.prod(axis_sizes[a] for a in e):
        return Reason(refusals.Indivisible(n, v.aval.str_short(), tuple(e)))
    out[v] = split
  return ModelSplits(out, _reduced(eqns, out))


def _resharded(edges: list, classes: _Classes, roots: set, typed: frozenset) -> Reason | None:
  """The first equation joining two dims of the classes `roots` whose types (over the
  `typed` axes) lay them out differently: it reshards there (JAX's Explicit axes), so it
  runs outside the region with what it reads; None if there is none."""
  def entry(node):
    v, d = node
    if not typed or not compat.type_axes(v.aval):
      return None, False
    spec, _ = compat.sharding_spec(v.aval)
    split = _restricted(spec, len(_shape(v)), typed)
    return (split[d] if split else None), True
  for i, eqn, a, b in edges:
    (ta, known_a), (tb, known_b) = entry(a), entry(b)
    if known_a and known_b and ta != tb and classes.find(a) in roots:
      return Reason(refusals.Reshards(
          str(eqn.primitive), compat.source_line(eqn), a[1], a[0].aval.str_short(), b[1],
          b[0].aval.str_short(), tuple(ta or ()), tuple(tb or ()), region_dims.top(i)))
  return None


def _reduced(eqns, splits: Mapping[Var, tuple]) -> dict:
  """Per equation (its `region_dims.nested` key) that sums (or maxes) over a split dim
  (`Dims.summed`), the axes of those dims."""
  out = {}
  for i, eqn in eqns:
    summed = region_dims.of(eqn).summed
    axes = tuple(dict.fromkeys(a for v, d in summed if (s := splits.get(v)) and s[d]
                               for a in s[d]))
    if axes:
      out[i] = axes
  return out


def merged(parts: Iterable[ModelSplits],
           scattered: Mapping[int, tuple]) -> ModelSplits | Reason:
  """One `ModelSplits` of splits solved over disjoint axes (the model axes, and the
  batch axes the state is placed over: FSDP), or why a dim is split by both."""
  of: dict = {}
  reduced: dict = {}
  for part in parts:
    for v, split in part.of.items():
      old = of.get(v, (None,) * len(split))
      if any(a and b for a, b in zip(old, split, strict=True)):
        return Reason(refusals.SplitBothWays(v.aval.str_short(), old, split))
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
