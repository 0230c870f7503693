"""The batch's splits in a global step: propagated from the user's placements (`wus.jit`).

A `jax.jit` step written on global arrays says where its batch lies in three
ways: the placements of its arguments that are not state (`NamedSharding(mesh,
P("data"))`, `in_shardings`), sharding constraints inside the step
(`with_sharding_constraint(batch, P("data"))`, common in pjit-era code), and, on
a mesh with Explicit axes, the types of its values. `batch_splits` carries them
forward through the jaxpr with GSPMD's semantics (§3.5 of
`papers/xu2021-gspmd.md`), one equation at a time, by the dims rule table
(`analysis.dims`, read through `analysis.region_dims`): a joined dim keeps its split
(an elementwise op, a transpose, a reshape's major factor, a slice that keeps the dim
whole, the indices' dims of an embedding lookup), a summed one ends it (`sum_rules`:
where GSPMD puts its all-reduce), and a split that reaches a dim an equation needs
whole, or that no rule follows, leaves a value that is not whole either (an *unknown*
split), as does a conflict of two splits. A constraint lays a batch dim out as its spec
says, as GSPMD reshards at it. The user's function is traced once: nothing here
runs it again.

Which dims carry the batch is part of the fact: a constraint or type splitting a
weight's dim over a batch axis (FSDP, and the constraint AD puts on its gradient)
lays out a block, not the batch, so it splits nothing here.

The result is `global_view`'s `Splits`: value -> per dim None or the mesh axes
splitting it; a value absent is whole, one mapped to all-None entries is not
whole (an unknown split, or an unreduced type).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence

from jax import lax
from jax.sharding import AxisType

from wus.analysis import compat, dims as dims_lib, region_dims, rules
from wus.analysis.compat import Jaxpr, JaxprEqn, Var
from wus.analysis.graph import Graph

# Per dim: None (not a batch dim), () (a batch dim laid out whole) or the axes splitting it.
Entry = tuple | None


@dataclasses.dataclass(frozen=True)
class Fact:
  """What one value carries of the batch.

  Attributes:
    dims: per dim, None (not the batch's), () (the batch's, whole) or the mesh axes
      splitting it; None for a value whose split is unknown (not whole).
    batch: whether it depends on an argument that is not state (the batch, a key).
    state: whether it depends on the step's state. A constraint on a value that
      depends on the batch alone lays the batch out; on any other, a block.
  """

  dims: tuple[Entry, ...] | None
  batch: bool = False
  state: bool = False

  @property
  def split(self) -> bool:
    """Whether some dim is split, or the split is unknown."""
    return self.dims is None or any(self.dims)


def _none(v, batch: bool = False, state: bool = False) -> Fact:
  return Fact((None,) * len(getattr(getattr(v, "aval", None), "shape", ())), batch, state)


def _reads(facts: Sequence[Fact]) -> tuple[bool, bool]:
  """(batch, state): what values computed from `facts` depend on."""
  return any(f.batch for f in facts), any(f.state for f in facts)


def _divides(n: int, axes, axis_sizes) -> bool:
  """Whether `axes` (a tuple of mesh axes, or None) divide a dim of size `n`."""
  return not axes or n % math.prod(axis_sizes[a] for a in axes) == 0


# --- Gradient sums. --------------------------------------------------------------

# A sum rule says whether an equation, given its operands' splits (per dim None or
# axes; None for a value neither split nor unknown), sums over every dim any
# operand is split on: its result is whole, and run on each replica's rows it gives
# that replica's part of the sum, which an all-reduce completes (where GSPMD puts
# its all-reduce). Each is registered at its definition (`rules.registrar`).
SumRule = Callable[[JaxprEqn, list, Callable[[Var], bool]], bool]
sum_rules: dict[compat.Primitive, SumRule] = {}
sum_rule = rules.registrar(sum_rules, "sum rule")


def split_dims(split) -> set[int]:
  return {d for d, e in enumerate(split or ()) if e}


@sum_rule(lax.reduce_sum_p)
def _reduce_sum(eqn, splits, is_zero) -> bool:
  (split,) = splits
  return bool(split_dims(split)) and split_dims(split) <= set(eqn.params["axes"])


def _paired(lhs, rhs, lhs_dims, rhs_dims) -> bool:
  """Some operand split, every split dim of each operand one of its `dims`, paired dims
  split alike."""
  if not (split_dims(lhs) or split_dims(rhs)):
    return False
  if not (split_dims(lhs) <= set(lhs_dims) and split_dims(rhs) <= set(rhs_dims)):
    return False
  return all((lhs or (None,) * (d + 1))[d] == (rhs or (None,) * (e + 1))[e]
             for d, e in zip(lhs_dims, rhs_dims, strict=True))


@sum_rule(lax.dot_general_p)
def _dot_general(eqn, splits, is_zero) -> bool:
  (lc, rc), _ = eqn.params["dimension_numbers"]
  return _paired(*splits, lc, rc)


@sum_rule(lax.conv_general_dilated_p)
def _conv(eqn, splits, is_zero) -> bool:
  # A kernel's gradient: the batch is the contracted feature dim of both
  # operands (JAX's transpose of a convolution with respect to its kernel).
  dn = eqn.params["dimension_numbers"]
  return (eqn.params["feature_group_count"] == 1 and eqn.params["batch_group_count"] == 1
          and _paired(*splits, (dn.lhs_spec[1],), (dn.rhs_spec[1],)))


@sum_rule(lax.scatter_add_p)
def _scatter_add(eqn, splits, is_zero) -> bool:
  # An embedding table's gradient: split rows of updates added into zeros.
  operand, indices, updates = splits
  dn = eqn.params["dimension_numbers"]
  scatter = [d for d in range(eqn.invars[2].aval.ndim) if d not in dn.update_window_dims]
  batch = [d for d in range(eqn.invars[1].aval.ndim) if d != eqn.invars[1].aval.ndim - 1]
  return (not split_dims(operand) and is_zero(eqn.invars[0]) and len(batch) == len(scatter)
          and _paired(indices, updates, batch, scatter))


def never_a_sum(eqn: JaxprEqn, splits: list, is_zero: Callable[[Var], bool]) -> bool:
  """The default rule: a primitive with no rule sums nothing over the batch."""
  del eqn, splits, is_zero
  return False


def is_sum(eqn: JaxprEqn, splits: list, is_zero: Callable[[Var], bool]) -> bool:
  """Whether `eqn` sums every split of its operands (`splits`: per operand, per dim None
  or the axes; None for a whole operand; unknown splits are never summed)."""
  return sum_rules.get(eqn.primitive, never_a_sum)(eqn, splits, is_zero)


# --- Propagation. ----------------------------------------------------------------


def batch_splits(jaxpr: Jaxpr, seeds: Mapping[Var, tuple], state: frozenset,
                 axis_sizes: Mapping[str, int], types: bool = False) -> dict[Var, tuple]:
  """The splits of `jaxpr`'s values over the batch, from its inputs' placements.

  Args:
    jaxpr: the step's global jaxpr, calls inlined (`jit_region.flat_jaxpr`).
    seeds: input -> per dim None or the mesh axes its placement splits it over (the
      arguments that are not state).
    state: the inputs that are the step's state (weights, optimizer state).
    axis_sizes: mesh axis -> size; axes of size 1 split nothing.
    types: whether the mesh has Explicit axes: each value's type then lays out the
      batch dims it carries (JAX's own per-primitive sharding rules computed them).

  Returns:
    Value -> per dim None or the axes splitting it, for every value of `jaxpr` (not of
    its sub-jaxprs) that is split over the batch or not whole; absent values are whole.
  """
  env = _Propagation(axis_sizes, types).run(jaxpr, [
      _none(v, state=True) if v in state
      else Fact(tuple(e or None for e in seeds.get(v, ())) or _none(v).dims, batch=True)
      for v in jaxpr.invars])
  out = {}
  for v, fact in env.items():
    if fact.dims is None:
      out[v] = (None,) * len(getattr(v.aval, "shape", ()))
    elif any(fact.dims):
      out[v] = tuple(e or None for e in fact.dims)
  return out


def where_lost(jaxpr: Jaxpr, splits: Mapping[Var, tuple]) -> JaxprEqn | None:
  """The first equation of `jaxpr` (not of its sub-jaxprs) where the batch's split ends:
  an operand split over the batch, none unknown, and a result unknown (`batch_splits`:
  present, split nowhere), because the primitive has no dims rule for the split or its
  rule needs the split dim whole. None if the split ends nowhere. What a Plan says when
  no gradient is seen as a sum over the batch."""
  def unknown(v) -> bool:
    return not compat.is_literal(v) and v in splits and not any(splits[v])
  for eqn in jaxpr.eqns:
    if (any(not compat.is_literal(v) and any(splits.get(v, ())) for v in eqn.invars)
        and not any(map(unknown, eqn.invars)) and any(map(unknown, eqn.outvars))):
      return eqn
  return None


def batch_axes(splits: Mapping[Var, tuple], axis_sizes: Mapping[str, int]) -> frozenset:
  """The mesh axes (size > 1) some value's batch split names."""
  return frozenset(a for s in splits.values() for e in s if e for a in e
                   if axis_sizes.get(a, 1) > 1)


class _Propagation:
  """One forward pass over a jaxpr and, recursively, its sub-jaxprs."""

  def __init__(self, axis_sizes: Mapping[str, int], types: bool):
    self.sizes = axis_sizes
    self.types = types
    self.seen: set = set()  # The axes some batch dim is split over, so far.

  def run(self, jaxpr: Jaxpr, ins: Sequence[Fact]) -> dict[Var, Fact]:
    """Every value's fact, from the facts of `jaxpr`'s inputs (constants: none)."""
    env = {v: _none(v) for v in jaxpr.constvars}
    env.update(zip(jaxpr.invars, ins, strict=True))
    self.seen.update(a for f in ins for e in f.dims or () if e for a in e)
    graph = Graph(jaxpr)
    for eqn in jaxpr.eqns:
      facts = [_none(v) if compat.is_literal(v) else env.get(v, _none(v)) for v in eqn.invars]
      outs = self.eqn(eqn, facts, graph.is_zero)
      for v, fact in zip(eqn.outvars, outs, strict=True):
        env[v] = self.typed(v, fact)
        self.seen.update(a for e in env[v].dims or () if e for a in e)
    return env

  def outputs(self, closed, ins: Sequence[Fact]) -> list[Fact]:
    jaxpr = getattr(closed, "jaxpr", closed)
    env = self.run(jaxpr, ins)
    return [_none(v) if compat.is_literal(v) else env[v] for v in jaxpr.outvars]

  def typed(self, v, fact: Fact) -> Fact:
    """On Explicit axes, the batch dims laid out as the value's type says: a value typed
    whole is whole, one typed unreduced over an axis is not."""
    if not self.types or not any(t == AxisType.Explicit for _, t in compat.type_axes(v.aval)):
      return fact
    spec, unreduced = compat.sharding_spec(v.aval)
    if unreduced & {a for a, n in self.sizes.items() if n > 1}:
      return dataclasses.replace(fact, dims=None)
    entries = (*spec, *(None,) * (len(v.aval.shape) - len(spec)))
    if fact.dims is None:
      whole = not any(self.axes(e) for e in entries)
      return dataclasses.replace(fact, dims=(None,) * len(entries)) if whole else fact
    return dataclasses.replace(fact, dims=tuple(
        None if e is None else self.axes(t) for e, t in zip(fact.dims, entries, strict=True)))

  def axes(self, entry) -> tuple:
    """A PartitionSpec entry as the tuple of its axes of size > 1."""
    names = () if entry is None else entry if isinstance(entry, tuple) else (entry,)
    return tuple(a for a in names if self.sizes.get(a, 1) > 1)

  def eqn(self, eqn: JaxprEqn, ins: list[Fact], is_zero) -> list[Fact]:
    """The facts of one equation's results."""
    batch, state = _reads(ins)
    unknown = [Fact(None, batch, state) for _ in eqn.outvars]
    if eqn.primitive in _RECURSIVE:
      return _RECURSIVE[eqn.primitive](self, eqn, ins)
    if compat.is_sharding_constraint(eqn):
      return [self.constraint(eqn, ins[0])]
    if eqn.primitive is compat.shard_map_p and any(f.split for f in ins):
      return self.manual(eqn, batch, state)
    if all(f.dims is not None and all(e is None for e in f.dims) for f in ins):
      return [_none(v, batch, state) for v in eqn.outvars]  # No batch dim: none comes out.
    if any(f.dims is None for f in ins) or (
        compat.has_manual_code(eqn) and any(f.split for f in ins)):
      return unknown
    splits = [tuple(e or None for e in f.dims) if f.split else None for f in ins]
    if is_sum(eqn, splits, is_zero):
      return [_none(v, batch, state) for v in eqn.outvars]
    if eqn.primitive is lax.reshape_p and eqn.params.get("dimensions") is None:
      return [self.reshaped(eqn, ins[0]) or unknown[0]]
    return self.joined(eqn, ins) or unknown

  def reshaped(self, eqn: JaxprEqn, fact: Fact) -> Fact | None:
    """A reshape carries the batch of each group of dims it merges or splits to the
    group's first result dim (major to minor) that the split's axes divide: GSPMD's
    major factor where it can hold the split, else the next (micro-batches as a leading
    dim, `x.reshape(2, -1)`, of a batch over 8: the split moves to the rows). The batch's
    layout, not blocks: nothing runs on it but sums, whose operands are laid out so."""
    a, b = eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape
    out: list = [None] * len(b)
    for ga, gb in dims_lib.groups(tuple(a), tuple(b)):
      carried = [fact.dims[d] for d in ga if fact.dims[d] is not None]
      if not carried:
        continue
      axes = tuple(x for e in carried for x in e)
      size = math.prod(self.sizes[x] for x in axes)
      target = next((d for d in gb if b[d] > 1 and b[d] % size == 0), None)
      if target is None:
        return None
      for d in gb:
        out[d] = axes if d == target else ()
    return dataclasses.replace(fact, dims=tuple(out))

  def joined(self, eqn: JaxprEqn, ins: list[Fact]) -> list[Fact] | None:
    """The results' facts by the dims rule: each result dim carries what the operand
    dims joined to it carry (a summed dim ends it); None (unknown results) where a split
    reaches a dim the rule needs whole or no result dim, or two splits meet."""
    joins, whole, summed = region_dims.of(eqn)
    parent: dict = {}

    def find(n):
      while parent.get(n, n) != n:
        n = parent[n]
      return n
    for a, b in joins:
      parent[find(a)] = find(b)
    reached: dict = {}
    for o in eqn.outvars:
      for d in range(len(getattr(o.aval, "shape", ()))):
        reached.setdefault(find((o, d)), []).append((o, d))
    carried: dict = {}
    for v, fact in zip(eqn.invars, ins, strict=True):
      for d, e in enumerate(fact.dims if not compat.is_literal(v) else ()):
        if e is None or (v, d) in summed:
          continue
        root = find((v, d))
        if e and ((v, d) in whole or root not in reached):
          return None
        if root in reached:
          old = carried.get(root)
          if old and e and old != e:
            return None
          carried[root] = old or e
    batch, state = _reads(ins)
    outs = []
    for o in eqn.outvars:
      shape = getattr(o.aval, "shape", ())
      entries = tuple(carried.get(find((o, d))) for d in range(len(shape)))
      if not all(_divides(n, e, self.sizes) for n, e in zip(shape, entries,
                                                                     strict=True)):
        return None
      outs.append(Fact(entries, batch, state))
    return outs

  def manual(self, eqn: JaxprEqn, batch: bool, state: bool) -> list[Fact]:
    """A shard_map inside the step reading split values: its out_specs lay its results
    out. A dim named with an axis the batch is split over carries the batch (all the axes
    it names, on a result of the batch alone: a per-replica augmentation's). On a result
    that reads the state too, a dim named with those axes and others besides (the
    residuals JAX's partial evaluation passes from a differentiated shard_map to its
    transpose, each device's own stacked over every mesh axis) is no layout of the batch:
    its split is unknown."""
    _, _, _, out_specs, _, _ = compat.shard_map_params(eqn)
    outs = []
    for v, spec in zip(eqn.outvars, out_specs, strict=True):
      entries = [self.axes(e) for e in (*spec, *(None,) * (len(v.aval.shape) - len(spec)))]
      if state and any(set(a) & self.seen and not set(a) <= self.seen for a in entries):
        outs.append(Fact(None, batch, state))
        continue
      outs.append(Fact(tuple(a if a and (not state or set(a) & self.seen) else None
                             for a in entries), batch, state))
    return outs

  def constraint(self, eqn: JaxprEqn, fact: Fact) -> Fact:
    """A sharding constraint lays the batch out by its spec: every dim it names, for a
    value that does not depend on the state (the batch itself, placed inside the step);
    only the batch dims, for one that does (a weight's dims are a block's, not the
    batch's). JAX's own reshards on Auto axes (`compat.lays_out`) change nothing."""
    spec = compat.constraint_spec(eqn)
    out = eqn.outvars[0]
    if spec is None or not compat.lays_out(eqn):
      return fact
    entries = (*spec, *(None,) * (len(out.aval.shape) - len(spec)))
    if fact.batch and not fact.state:
      base = fact.dims or (None,) * len(entries)
      return dataclasses.replace(fact, dims=tuple(
          self.axes(s) or (() if e is not None else None)
          for e, s in zip(base, entries, strict=True)))
    if fact.dims is None:
      return fact
    return dataclasses.replace(fact, dims=tuple(
        None if e is None else self.axes(s) for e, s in zip(fact.dims, entries, strict=True)))


def merge(a: Fact, b: Fact) -> Fact:
  """The fact of a value that may be either (a loop's carry, a conditional's result)."""
  batch, state = _reads((a, b))
  if a.dims is None or b.dims is None or len(a.dims) != len(b.dims):
    return Fact(None, batch, state)
  out = []
  for x, y in zip(a.dims, b.dims, strict=True):
    if x and y and x != y:
      return Fact(None, batch, state)
    out.append(x or y if (x is not None or y is not None) else None)
  return Fact(tuple(out), batch, state)


def _cond(p: _Propagation, eqn: JaxprEqn, ins: list[Fact]) -> list[Fact]:
  cond = compat.cond(eqn)
  outs = None
  for branch in cond.branches:
    got = p.outputs(branch, ins[1:])
    outs = got if outs is None else [merge(a, b) for a, b in zip(outs, got, strict=True)]
  return outs


def _loop(p: _Propagation, eqn: JaxprEqn, ins: list[Fact]) -> list[Fact]:
  """A scan or while: its carries' facts to a fixed point (at most one round per carry
  and one more), a scan's sequences less their leading dim (scanned over: a split there
  is unknown after the loop)."""
  loop = compat.loop(eqn)
  unknown = [Fact(None, *_reads(ins)) for _ in eqn.outvars]
  _, consts, carry, xs = loop.split(ins)
  if any(f.dims is None or (f.dims and f.dims[0]) for f in xs):
    return unknown
  xs = [dataclasses.replace(f, dims=f.dims[1:]) for f in xs]
  for _ in range(len(carry) + 2):
    outs = p.outputs(loop.body, [*consts, *carry, *xs])
    new = [merge(a, b) for a, b in zip(carry, outs[:len(carry)], strict=True)]
    if new == carry:
      break
    carry = new
  else:
    return unknown
  ys = [dataclasses.replace(f, dims=None if f.dims is None else (None, *f.dims))
        for f in outs[len(carry):]]
  return [*carry, *ys]


def _call(p: _Propagation, eqn: JaxprEqn, ins: list[Fact]) -> list[Fact]:
  return p.outputs(compat.call_jaxpr(eqn), ins)


_RECURSIVE: dict = {compat.cond_p: _cond, compat.while_p: _loop, compat.scan_p: _loop,
                    **dict.fromkeys(compat.CALL_JAXPR_PARAM, _call)}
