"""Which equations of a weight update can run on shards, keyed by primitive (§4.1).

A rule looks at one equation whose outputs are identical on every replica and
answers with the `Kind` of shard computation that reproduces it exactly, or
None when it cannot (the tensor must then be whole, DESIGN.md §4 invariant 2).
Some kinds constrain the sharding formats of the tensors involved (a reduce
never lets a reduced dim merge with a kept one); `layouts.assign` solves those
constraints, and `wus.transforms.rewrite` implements each kind.

Every rule is registered at its definition (`rules.registrar`): a primitive here by
`@shardable_rule(prim)` (a family by `register_elementwise(prim)`), a Kind as a member
of `Kind`, its layout rule by `@layouts.layout_rule(Kind.X)` and its shard rule by
`@rewrite.shard_rule(Kind.X)` (tests/analysis/test_layouts.py names a missing one).
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable

from jax import lax

from wus.analysis import compat, primitives, rules
from wus.analysis.compat import JaxprEqn
from wus.analysis.redundancy import Redundancy


@dataclasses.dataclass(frozen=True)
class Traits:
  """What the passes ask of a `Kind`, besides its layout rule (`@layouts.layout_rule`)
  and its shard rule (`@wus.transforms.rewrite.shard_rule`), each registered at the rule.

  Attributes:
    doc: how the equation runs on shards.
    big: which of its values must be big (worth sharding) for the equation
      to run on shards: "outputs"; "operand", its first operand (a reduction
      of a big tensor may return a small result); or "any" (a conditional).
    partial: it leaves partial results over the shards that an all-reduce
      combines (Fig. 6): the end of a phase of the schedule (§5.2).
    update: it is part of the weight update, not the gradient all-reduce the
      update reads (the two are scheduled apart, §5.2).
  """

  doc: str
  big: str = "outputs"
  partial: bool = False
  update: bool = True


class Kind(enum.Enum):
  """How an equation runs on shards; each member's value is its `Traits`."""

  ELEMENTWISE = Traits("elementwise: the same op on the shards; rank-0 operands broadcast")
  LAYOUT = Traits("layout: same elements in the same row-major order; the shard is unchanged")
  REDUCE_UNIT = Traits("reduce over size-1 dims: each output element reduces one input element")
  REDUCE_ALL = Traits("reduce to a scalar: masked local reduce, all-reduced partial results",
                      big="operand", partial=True)
  REDUCE = Traits("reduce over some dims: local if the shard dim is kept, else as REDUCE_ALL",
                  big="operand", partial=True)
  DOT_ALL = Traits("inner product: masked local dot, all-reduced sum",
                   big="operand", partial=True)
  BROADCAST = Traits("broadcast scalar: a one-element operand broadcast to a big shape")
  BROADCAST_DIMS = Traits("broadcast along new dims: local from the operand's shard or whole")
  COND = Traits("conditional: big operands enter every branch as shards, big results leave "
                "as shards", big="any")
  LOOP = Traits("loop: the body runs by its own plan; carried state stays sharded (§4.2)")
  REDUCE_SCATTER = Traits("reduce-scatter: psum over (at least) the replica axes of a value "
                          "that differs", update=False)
  SCATTER_BLOCKS = Traits("reduce-scatter over other mesh axes (HSDP's fsdp axis) of a value "
                          "identical across the replica axes (a gradient all-reduced there): "
                          "the all-reduce and it become reduce-scatters over the replica axes "
                          "then the others, each replica's part of every block", update=False)
  SUM_OF_COPIES = Traits("psum of equal values: a local sum")
  IDENTITY = Traits("pmax/pmin of equal values")
  OWNED_SCATTER = Traits("owned gradient: reduce-scattered in rows, summed whole on the replica "
                         "that owns its update (`ownership`)", update=False)
  OWNED = Traits("owned: the replica that owns the tensor runs the equation on the whole "
                 "tensor, in a switch on the replica index (`ownership`)")

  @property
  def partial(self) -> bool:
    return self.value.partial

  @property
  def update(self) -> bool:
    return self.value.update

  def big_values(self, eqn: JaxprEqn) -> list:
    """The atoms of `eqn` of which one must be big for it to run on shards."""
    return {"outputs": eqn.outvars, "operand": eqn.invars[:1],
            "any": [*eqn.invars, *eqn.outvars]}[self.value.big]


# Kinds that leave partial results over the shards, combined by an all-reduce
# (Fig. 6); they read a big operand and may return a small result.
REDUCING = frozenset(k for k in Kind if k.partial)


@dataclasses.dataclass(frozen=True)
class Context:
  """What a rule may ask about the program.

  Attributes:
    facts: the redundancy analysis of the jaxpr.
    axes: the replica (data-parallel) mesh axes the weight update is sharded over.
  """

  facts: Redundancy
  axes: frozenset


ShardableRule = Callable[[JaxprEqn, Context], Kind | None]
shardable_rules: dict[compat.Primitive, ShardableRule] = {}
shardable_rule = rules.registrar(shardable_rules, "shardable rule")


def _shape(atom) -> tuple[int, ...]:
  return tuple(atom.aval.shape)


def _elementwise_rule(eqn: JaxprEqn, ctx: Context) -> Kind | None:
  shape = _shape(eqn.outvars[0])
  if any(_shape(v) != shape for v in eqn.outvars):
    return None
  if all(_fits(_shape(v), shape) for v in eqn.invars):
    return Kind.ELEMENTWISE
  return None


def _fits(operand: tuple[int, ...], out: tuple[int, ...]) -> bool:
  """Whether lax broadcasts `operand` to `out` implicitly: rank 0, or size-1 dims."""
  return not operand or (len(operand) == len(out)
                         and all(a in (b, 1) for a, b in zip(operand, out, strict=True)))


def register_elementwise(*prims: compat.Primitive) -> None:
  """Declares primitives elementwise (`primitives.ELEMENTWISE`'s family): on shards as
  `Kind.ELEMENTWISE` when every operand has the result's shape, size-1 dims or rank 0."""
  shardable_rule(*prims)(_elementwise_rule)


register_elementwise(*primitives.ELEMENTWISE)


@shardable_rule(lax.reshape_p)
def _reshape_rule(eqn: JaxprEqn, ctx: Context) -> Kind | None:
  return Kind.LAYOUT if eqn.params.get("dimensions") is None else None


@shardable_rule(lax.squeeze_p, compat.pvary_p)  # pvary: a shard already varies.
def _same_elements_rule(eqn: JaxprEqn, ctx: Context) -> Kind | None:
  return Kind.LAYOUT


@shardable_rule(lax.broadcast_in_dim_p)
def _broadcast_in_dim_rule(eqn: JaxprEqn, ctx: Context) -> Kind | None:
  operand = _shape(eqn.invars[0])
  if math.prod(operand) == 1:
    return Kind.BROADCAST
  if math.prod(operand) == math.prod(eqn.params["shape"]):
    return Kind.LAYOUT  # Only size-1 dims added (broadcast_dimensions increase).
  return Kind.BROADCAST_DIMS


@shardable_rule(*primitives.REDUCE_OVER_UNIT_DIMS)
def _reduce_rule(eqn: JaxprEqn, ctx: Context) -> Kind | None:
  operand = _shape(eqn.invars[0])
  axes = tuple(sorted(eqn.params["axes"]))
  if all(operand[a] == 1 for a in axes):
    return Kind.REDUCE_UNIT
  if eqn.primitive not in primitives.REDUCTIONS:
    return None
  return Kind.REDUCE_ALL if axes == tuple(range(len(operand))) else Kind.REDUCE


@shardable_rule(lax.dot_general_p)
def _dot_rule(eqn: JaxprEqn, ctx: Context) -> Kind | None:
  # An inner product (jnp.vdot, optax.tree.vdot): both operands of one shape,
  # every dim contracted in order, no batch dims.
  (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
  lhs, rhs = (_shape(v) for v in eqn.invars)
  everything = tuple(range(len(lhs)))
  if (lhs == rhs and not lb and not rb and tuple(lc) == tuple(rc) == everything
      and not compat.has_result_layout(eqn)):
    return Kind.DOT_ALL
  return None


@shardable_rule(*rules.distinct(compat.psum_p, compat.psum_invariant_p))  # Maybe one object.
def _psum_rule(eqn: JaxprEqn, ctx: Context) -> Kind | None:
  # Over more axes than the sharding axes A (A ∪ B, §5.2 partial sharding):
  # reduce-scatter over A, then all-reduce the shards over B (Fig. 10).
  axes = frozenset(compat.collective_axes(eqn))
  if compat.has_axis_index_groups(eqn) or len(eqn.invars) != 1 or not ctx.axes <= axes:
    return None
  if ctx.facts.is_redundant(eqn.invars[0], axes):
    return Kind.SUM_OF_COPIES
  return Kind.REDUCE_SCATTER


@shardable_rule(compat.reduce_scatter_p)
def _reduce_scatter_rule(eqn: JaxprEqn, ctx: Context) -> Kind | None:
  # Tiled over dim 0 (blocks of rows, the transpose of an FSDP weight's all_gather),
  # over axes disjoint from the replica axes, of a value identical across those.
  axes = frozenset(compat.collective_axes(eqn))
  if (axes & ctx.axes or compat.has_axis_index_groups(eqn) or not eqn.params.get("tiled")
      or eqn.params.get("scatter_dimension") != 0
      or not ctx.facts.is_redundant(eqn.invars[0], ctx.axes)):
    return None
  return Kind.SCATTER_BLOCKS


@shardable_rule(compat.pmax_p, compat.pmin_p)
def _pmax_rule(eqn: JaxprEqn, ctx: Context) -> Kind | None:
  same = frozenset(compat.collective_axes(eqn)) == ctx.axes
  if (same and not compat.has_axis_index_groups(eqn)
      and ctx.facts.is_redundant(eqn.invars[0], ctx.axes)):
    return Kind.IDENTITY
  return None


@shardable_rule(compat.cond_p)
def _cond_rule(eqn: JaxprEqn, ctx: Context) -> Kind | None:
  # The predicate is redundant (the outputs are); branches run on shards and
  # gather inside only what they read whole (a callback of the full state).
  return Kind.COND


def whole(eqn: JaxprEqn, ctx: Context) -> Kind | None:
  """The default rule: a primitive with no rule sees whole tensors (its cluster stays
  replicated)."""
  del eqn, ctx


def shard_kind(eqn: JaxprEqn, ctx: Context) -> Kind | None:
  """The kind of shard computation for `eqn`, or None if it must see whole tensors."""
  return shardable_rules.get(eqn.primitive, whole)(eqn, ctx)
