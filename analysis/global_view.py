"""The weight update of a global-view step (`wus.jit`): where the batch ends (§3 for jax.jit).

A `jax.jit` step written on global arrays has no collectives in its jaxpr:
the partitioner (GSPMD) adds them where a value split over the batch axes is
summed into one that is not. Its weight update is still the computation every
replica repeats: the equations that read no value split over the batch. This
module finds, in the step's global jaxpr (calls inlined),

* given which values are split over the data-parallel (batch) mesh axes, and
  on which dims (`Splits`, propagated from the user's placements by
  `analysis.propagation`), the gradient sums: equations that sum a split value
  over every dim it is split on (`propagation.sum_rules`: `reduce_sum`, a
  `dot_general` or convolution contracting those dims, a scatter-add of split
  updates into zeros). Computed on this replica's rows, each gives this
  replica's part of the sum, which an all-reduce completes: where GSPMD puts
  its all-reduce;
* the update region (`find_region`): the sums whose results only the update
  reads, and the equations that read no split value and whose results no
  other equation needs (the forward and backward pass never read them);
* placements (`is_placement`): sharding constraints that lay a value out
  whole over every mesh axis of size > 1 (`eqx.filter_shard(x, replicated)`,
  `with_sharding_constraint(x, P())`, a spec naming only size-1 axes). They
  change no value; inside the region the update reads and writes whole values
  anyway, so the region runs them as the identity: the all-gathered weights
  are whole, as asked, and the optimizer state takes wus's sharded layout
  instead (issue 28 item 2).

`wus.jit` runs the region as a shard_map over the batch axes, each sum on its
rows followed by a `psum`; the pipeline of `wus.shard_map` then finds its
weight-update clusters at those all-reduces and turns them into
reduce-scatters (§3.2, Fig. 3). Which values are split changes only where the
region is cut, never what it computes: a sum computed on any rows and
all-reduced is the sum.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence

from jax import lax
from jax.sharding import PartitionSpec as P

from wus.analysis import compat, propagation, refusals
from wus.analysis.compat import Jaxpr, JaxprEqn, Var
from wus.analysis.graph import Graph
from wus.analysis.reasons import Reason

# Per value split over the batch axes: one entry per dim, None (not split) or
# the tuple of mesh axes the dim is split over. A value not in the map is
# whole; one mapped to all-None entries is not whole on every replica either
# (unreduced, or split in a way the rules do not follow).
Splits = Mapping[Var, tuple]


def spec_of(split: tuple | None) -> P:
  """The PartitionSpec of a value's split (P() for a whole value)."""
  if split is None:
    return P()
  return P(*[None if e is None else (e[0] if len(e) == 1 else e) for e in split])


# --- The update region. ----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Region:
  """The part of a global step that runs as a shard_map: the sums and the update.

  Attributes:
    eqns: positions in the jaxpr's equations, in order.
    sums: those that are gradient sums (run on this replica's rows, then
      all-reduced over the batch axes).
    invars: the values it reads from the rest of the step (inputs, constants,
      results of the forward and backward pass).
    in_specs: per invar, its split over the batch axes (P() when whole).
    outvars: its results that the step returns, and the state it reads that the step
      returns unchanged (optax's `init_params` of DoG, prodigy's `params0`): the
      region passes it on, so the Plan may keep it sharded between steps.
    moved: sums whose all-reduce runs after equations that only move their
      elements (`sums` holds the last of those): XLA must not fold those
      into the sum (a transpose into a `dot_general` swaps its operands and
      changes its rounding), so the sum's result passes an
      `optimization_barrier`, as the partitioner's all-reduce stops the
      fold in the unmodified step.
    placements: placements (`is_placement`) among `eqns`: run as the identity.
    sum_axes: per sum, the mesh axes its operands are split over (`splits`): it is
      all-reduced over those alone. A batch axis another value is split over (a feature
      dim of the batch laid out over "tensor") holds copies of these operands, which an
      all-reduce over it would add up.
  """

  eqns: tuple[int, ...]
  sums: frozenset[int]
  invars: tuple[Var, ...]
  in_specs: tuple[P, ...]
  outvars: tuple[Var, ...]
  moved: frozenset[int] = frozenset()
  placements: frozenset[int] = frozenset()
  sum_axes: Mapping[int, frozenset] = dataclasses.field(default_factory=dict)


def is_placement(eqn: JaxprEqn, axis_sizes: Mapping[str, int]) -> bool:
  """Whether `eqn` is a sharding constraint that lays its value out whole over every mesh
  axis of size > 1 (it changes no value, only where it lies)."""
  axes = compat.placement_axes(eqn)
  return axes is not None and all(axis_sizes.get(a, 1) == 1 for a in axes)


def reads_sum(jaxpr: Jaxpr, splits: Splits) -> Callable[[JaxprEqn], bool]:
  """Whether an equation of `jaxpr` reads a value computed from a gradient sum (a sum of
  every batch split of its operands, `propagation.is_sum`, the sum's result included):
  the update's equations do, the forward pass's do not."""
  is_zero = Graph(jaxpr).is_zero
  summed: set = set()
  for eqn in jaxpr.eqns:
    ins = [None if compat.is_literal(v) else splits.get(v) for v in eqn.invars]
    if (any(not compat.is_literal(v) and v in summed for v in eqn.invars)
        or (all(v not in splits for v in eqn.outvars)
            and propagation.is_sum(eqn, ins, is_zero))):
      summed.update(eqn.outvars)
  return lambda eqn: any(not compat.is_literal(v) and v in summed for v in eqn.invars)


def find_region(jaxpr: Jaxpr, splits: Splits, axis_sizes: Mapping[str, int],
                model_axes: frozenset = frozenset(),
                outside: frozenset = frozenset(),
                state_out: frozenset = frozenset()) -> Region | Reason:
  """The sums and the update of a global step.

  An equation joins the region if it is a gradient sum (`sum_rules`, its
  split dims divisible by their axes' sizes) or reads and writes only whole
  values with no effect, no collective and no shard_map inside (a placement
  among them runs as the identity: `Region.placements`); then every
  equation whose results an equation outside the region reads leaves it
  (outside, the forward and backward pass run as GSPMD partitions them, before
  the region).

  Args:
    jaxpr: the step's global jaxpr, calls inlined.
    splits: its values' splits over the batch axes.
    axis_sizes: mesh axis -> size.
    model_axes: the mesh axes the step's state is placed over (tensor
      parallelism): a constraint that names only those lays out a block the
      region computes (`Region.placements`, `analysis.model_splits` reads its
      spec), not a split over the batch.
    outside: equation positions that run outside the region, whatever they read
      (an update that cannot run on model blocks: `wus.jit` runs it, and what
      it reads, as GSPMD partitions it).
    state_out: the output positions that are the next values of the step's state: with
      the sums, the region holds what computes them, what feeds that and what reads
      it (`_joined`); the rest runs outside. Empty: every whole-value equation.

  Returns:
    The Region, or why the step has none (a `Reason`, `refusals.NoUpdate`). A region
    without gradient sums (the gradients summed inside a loop, which GSPMD all-reduces
    there) still runs as a shard_map: the planner's roots slice its whole gradients
    locally.
  """
  kind = _kinds(jaxpr, splits, axis_sizes, model_axes, outside)
  moved = _move_sums(jaxpr, kind)
  _pull_needed(jaxpr, kind)
  _moves_outside(jaxpr, kind)
  inside = [i for i, k in enumerate(kind) if k is not None]
  sums = frozenset(i for i in inside if kind[i] == "sum")
  state_vars = {v for v in (jaxpr.outvars[k] for k in state_out) if not compat.is_literal(v)}
  if state_out:
    producer = Graph(jaxpr).producer
    inside = _joined(jaxpr, inside, sums | {producer.get(v) for v in state_vars})
  made = {v for i in inside for v in jaxpr.eqns[i].outvars}
  outvars = tuple(dict.fromkeys(v for v in jaxpr.outvars
                                if not compat.is_literal(v) and v in made))
  used = _used(jaxpr, inside, outvars)
  if not used:
    return Reason(refusals.NoUpdate())
  inside = [i for i in inside if i in used]
  invars = tuple(dict.fromkeys(
      v for i in inside for v in jaxpr.eqns[i].invars
      if not compat.is_literal(v) and v not in made))
  passed = state_vars & set(invars) & set(jaxpr.invars)
  outvars += tuple(dict.fromkeys(v for v in jaxpr.outvars
                                 if not compat.is_literal(v) and v in passed))
  placements = frozenset(i for i in inside if is_placement(jaxpr.eqns[i], axis_sizes)
                         or compat.is_sharding_constraint(jaxpr.eqns[i]))
  sums &= set(inside)
  return Region(tuple(inside), sums, invars,
                tuple(spec_of(None if compat.is_literal(v) else splits.get(v)) for v in invars),
                outvars, frozenset(moved) & set(inside),
                placements, {i: _split_axes(summing_eqn(jaxpr, i), splits) for i in sums})


def _kinds(jaxpr: Jaxpr, splits: Splits, axis_sizes: Mapping[str, int],
           model_axes: frozenset, outside: frozenset) -> list:
  """Per equation: "sum" (a gradient sum, `sum_rules`, its split dims divisible by their
  axes' sizes), "update" (reads and writes only whole values, no effect, no manual
  code, no constraint splitting over the batch) or None (outside the region)."""
  is_zero = Graph(jaxpr).is_zero

  def split(v):
    return None if compat.is_literal(v) else splits.get(v)

  def divisible(v) -> bool:
    s = split(v)
    return s is None or all(
        e is None or n % math.prod(axis_sizes[a] for a in e) == 0
        for n, e in zip(v.aval.shape, s, strict=True))

  kind = []
  for i, eqn in enumerate(jaxpr.eqns):
    ins = [split(v) for v in eqn.invars]
    outs_whole = all(v not in splits for v in eqn.outvars)
    if i in outside:
      kind.append(None)
    elif (outs_whole and propagation.is_sum(eqn, ins, is_zero)
          and all(divisible(v) for v in eqn.invars)):
      kind.append("sum")
    elif (outs_whole and all(s is None for s in ins) and not compat.side_effects(eqn)
          and not compat.has_manual_code(eqn)
          and not _splits_over_mesh(eqn, axis_sizes, model_axes)):
      kind.append("update")
    else:
      kind.append(None)
  return kind


def _move_sums(jaxpr: Jaxpr, kind: list) -> set[int]:
  """Moves each sum's all-reduce past the equations that only move its elements (the
  transpose of a kernel's gradient), so the region reduce-scatters the tensor the update
  reads: marks them in `kind` ("partial" before the new sum); the sums moved."""
  graph = Graph(jaxpr)
  moved = set()
  for i in [i for i, k in enumerate(kind) if k == "sum"]:
    start, v = i, jaxpr.eqns[i].outvars[0]
    while (len(jaxpr.eqns[i].outvars) == 1 and v not in graph.outputs
           and len(readers := graph.readers(v)) == 1
           and kind[j := readers[0]] == "update" and moves_elements(jaxpr.eqns[j])):
      kind[i], kind[j], i = "partial", "sum", j
      v = jaxpr.eqns[j].outvars[0]
      moved.add(start)
  return moved


def _joined(jaxpr: Jaxpr, inside: list[int], seeds: set) -> list[int]:
  """The equations of `inside` joined to `seeds` (the sums, and what computes the state's
  next values): after one (reading what a seed, or such an equation, computes), feeding
  one, or after such a feeding one. The rest read and write whole values the update never
  meets (a metric, `loss_a + loss_b`): they run outside, as GSPMD partitions them, so the
  region changes nothing there."""
  graph = Graph(jaxpr)

  def after(seed: set) -> set:
    out = set(seed)
    for i in inside:  # In jaxpr order: what an equation reads is computed before it.
      if any(graph.producer.get(v) in out for v in jaxpr.eqns[i].invars
             if not compat.is_literal(v)):
        out.add(i)
    return out

  def feeding(seed: set) -> set:
    out = set(seed)
    for i in reversed(inside):
      if any(r in out for v in jaxpr.eqns[i].outvars for r in graph.readers(v)):
        out.add(i)
    return out

  joined = after(feeding(after(set(seeds) & set(inside))))
  return [i for i in inside if i in joined]


def _moves_outside(jaxpr: Jaxpr, kind: list) -> None:
  """Marks outside each update equation that only moves the elements (`moves_elements`)
  of a value the forward and backward pass compute (a stacked gradient transposed to its
  weight's layout): the region then reads the moved value, which GSPMD can hand it split
  (`analysis.presliced`), split inside the loop that computes it, rather than build it whole
  on every device."""
  producer = Graph(jaxpr).producer
  for i, eqn in enumerate(jaxpr.eqns):
    if kind[i] == "update" and moves_elements(eqn):
      j = producer.get(eqn.invars[0])
      if j is not None and kind[j] is None:
        kind[i] = None


def _pull_needed(jaxpr: Jaxpr, kind: list) -> None:
  """Marks outside (None in `kind`) every equation whose result an equation outside
  reads: it is computed outside, before the region."""
  needed: set = set()
  for i in reversed(range(len(jaxpr.eqns))):
    eqn = jaxpr.eqns[i]
    if kind[i] is not None and any(v in needed for v in eqn.outvars):
      kind[i] = None
    if kind[i] is None:
      needed.update(v for v in eqn.invars if not compat.is_literal(v))


def partial_eqns(jaxpr: Jaxpr, region: Region, splits: Splits) -> frozenset[int]:
  """The region's equations that compute each replica's part of a gradient sum: those
  reading a value split over the batch, or a result of such an equation before its
  sum (the sums included). Their results differ across replicas; a split over the batch
  axes that the state carries (FSDP) does not pass through them."""
  partial = {v for v in region.invars if v in splits}
  out = set()
  for i in region.eqns:
    eqn = jaxpr.eqns[i]
    if any(not compat.is_literal(v) and v in partial for v in eqn.invars):
      out.add(i)
      if i not in region.sums:
        partial.update(eqn.outvars)
  return frozenset(out)


def summing_eqn(jaxpr: Jaxpr, i: int) -> JaxprEqn:
  """The equation that sums at gradient sum `i`: itself, or, for a sum moved past
  equations that only move elements (`Region.moved`), the one before them."""
  graph, eqn = Graph(jaxpr), jaxpr.eqns[i]
  while moves_elements(eqn) and (p := graph.producing(eqn.invars[0])) is not None:
    eqn = p
  return eqn


def summing_primitive(jaxpr: Jaxpr, i: int) -> compat.Primitive:
  """The primitive that sums at gradient sum `i` (`summing_eqn`)."""
  return summing_eqn(jaxpr, i).primitive


def _split_axes(eqn: JaxprEqn, splits: Splits) -> frozenset:
  """The mesh axes some operand of `eqn` is split over."""
  return frozenset(a for v in eqn.invars if not compat.is_literal(v)
                   for e in splits.get(v, ()) if e for a in e)


def _splits_over_mesh(eqn: JaxprEqn, axis_sizes: Mapping[str, int],
                      model_axes: frozenset) -> bool:
  """A sharding constraint that is no placement: it splits its value over a batch axis (a
  ZeRO written by hand), which a shard_map over the batch axes cannot honour, so it runs
  where GSPMD partitions the step, with what computes its operand. One naming only
  model axes (besides size-1 ones) stays in the region: its block is laid out so."""
  if not compat.is_sharding_constraint(eqn) or is_placement(eqn, axis_sizes):
    return False
  axes = compat.placement_axes(eqn)
  return axes is None or not {a for a in axes if axis_sizes.get(a, 1) > 1} <= model_axes


def moves_elements(eqn: JaxprEqn) -> bool:
  """Whether each result element is one operand element: an all-reduce commutes with it
  (a transpose, a reshape, a squeeze)."""
  if len(eqn.invars) != 1 or compat.is_literal(eqn.invars[0]):
    return False
  if eqn.primitive in (lax.transpose_p, lax.reshape_p, lax.squeeze_p, lax.rev_p):
    return eqn.primitive is not lax.reshape_p or eqn.params.get("dimensions") is None
  return (eqn.primitive is lax.broadcast_in_dim_p
          and math.prod(eqn.invars[0].aval.shape) == math.prod(eqn.outvars[0].aval.shape))


def _used(jaxpr: Jaxpr, eqns: Sequence[int], outvars: Sequence[Var]) -> set[int]:
  """The region's equations whose results reach one of its outputs."""
  live = set(outvars)
  used = set()
  for i in reversed(eqns):
    eqn = jaxpr.eqns[i]
    if any(v in live for v in eqn.outvars) or compat.side_effects(eqn):
      used.add(i)
      live.update(v for v in eqn.invars if not compat.is_literal(v))
  return used
