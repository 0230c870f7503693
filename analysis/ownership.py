"""Which weight updates can run whole on one replica each, and their Plan (DESIGN.md, Ownership).

A weight-update cluster stays replicated when an equation of its update
needs the whole tensor (Muon's Newton-Schulz matmuls, a Shampoo-style root,
a product over the shard dim). If the update of each tensor reads only that
tensor's gradient, state and weight (and values every replica holds whole:
step counts, learning rates), one replica can run it on the whole tensor:
ownership. The owner computes exactly what every replica computed before.

1. Units (`_unit`). From each such cluster's gradient all-reduces, the
   update is every equation all replicas repeat that reads its results,
   transitively, and the repeated equations feeding it that nothing else
   reads (the squeeze of its state under `wus.pmap`). Updates that share an
   equation are one unit. A unit is owned only if nothing outside it reads
   its values except as the step's outputs, every value it reads from
   outside is identical on every replica, and its equations run on a
   replica of their own (no collectives but all-reduces of equal values).
2. Worth (`owners.worth`). Owning moves the same bytes (a reduce-scatter and
   an all-gather of rows for the all-reduce) and saves (N - 1) / N of the
   update; the rows cost copies. A unit whose predicted update is too cheap
   to pay for them stays replicated, and the Plan says so.
3. Assignment (`owners`): stacks of one (shapes, dtypes, update), k
   contiguous members per replica, remainders balanced largest predicted
   cost first; tensors too large to balance (rows as long as the busiest
   replica's) stay replicated, largest first, until the rest is predicted
   no slower owned.
4. Exactness (`divides`): the divisions XLA:CPU would round differently on
   an owner than in the unmodified step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from jax import lax

from wus.analysis import causes, compat, divides, owners, primitives, reasons, shardable
from wus.analysis.compat import Jaxpr, source_line
from wus.analysis.graph import Graph
from wus.analysis.owned import Ownership, Placement
from wus.analysis.plan import ClusterPlan, TensorPlan
from wus.analysis.planning import PlanningContext
from wus.analysis.shardable import Kind

# Primitives an owner may run (with their sub-jaxprs): pure ones, and loops
# and conditionals of them. regularized_incomplete_beta lowers to a loop whose
# carries break check_vma on the owner's (varying) values (primitives.py).
_RUNS_ON_OWNER = (primitives.ELEMENTWISE | primitives.PURE
                  | {compat.scan_p, compat.while_p, compat.cond_p}) - {
                      lax.regularized_incomplete_beta_p}
_LOCAL = (Kind.SUM_OF_COPIES, Kind.IDENTITY)  # Collectives of equal values: local.


@dataclasses.dataclass
class OwnershipPart:
  """What `plan_ownership` adds to a step's plan.

  Attributes:
    ownership: the Plan's ownership part (None: nothing owned).
    kinds: equation index -> OWNED or OWNED_SCATTER.
    sharded_in, sharded_out: input / output position -> OwnedFormat (`JaxprPlan`'s).
    clusters: cluster index -> its ClusterPlan, owned or with why not.
    input_reason: input position -> (kept sharded, why: a `reasons` verdict).
  """

  ownership: Ownership | None = None
  kinds: dict = dataclasses.field(default_factory=dict)
  sharded_in: dict = dataclasses.field(default_factory=dict)
  sharded_out: dict = dataclasses.field(default_factory=dict)
  clusters: dict = dataclasses.field(default_factory=dict)
  input_reason: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class _Unit:
  """A candidate owned update, before assignment."""

  clusters: list            # (index, ClusterPlan) of the clusters it merges.
  eqns: set
  seeds: tuple = ()
  pairs: dict = dataclasses.field(default_factory=dict)  # out_pos -> in_pos, owned state.
  exits: tuple = ()         # Values read whole after it (new weights): gathered.
  weights: tuple = ()       # Big inputs it reads whole.
  cost: float = 0.0         # Predicted seconds of its update.
  predicted: tuple = (0.0, 0.0)  # (replicated, owned) seconds of collectives and update.
  owner: int = 0
  stack: int = 0

  @property
  def index(self) -> int:
    return self.clusters[0][0]


def plan_ownership(graph: Graph, ctx: PlanningContext, candidates: list, taken: Mapping[int, Kind],
                   state_pairs: Mapping[int, int], in_names, out_names) -> OwnershipPart:
  """Plans ownership for the replicated clusters `candidates` of a step (module docstring).

  Args:
    graph: the graph of the step's flat per-replica jaxpr (not a loop body).
    ctx: the planning's context (facts, axes, num_shards, big, topology).
    candidates: (cluster index, Cluster, ClusterPlan) of clusters kept
      replicated for a reason of structure, not cost.
    taken: equations that already run on shards (JaxprPlan.shard_eqns).
    state_pairs: output position -> input position of the step's state.
    in_names, out_names: names of the flat inputs and outputs.

  Returns:
    The additions to the plan.
  """
  out, jaxpr = OwnershipPart(), graph.jaxpr
  units: list[_Unit] = []
  kind_ctx = shardable.Context(ctx.facts, ctx.axes)
  for idx, c, cp in candidates:
    seeds = [i for i in (*c.eqns, *c.kept_whole)
             if shardable.shard_kind(jaxpr.eqns[i], kind_ctx) is Kind.REDUCE_SCATTER]
    eqns = _unit(graph, seeds, ctx, taken)
    merged = [u for u in units if u.eqns & eqns]
    for u in merged:
      units.remove(u)
    units.append(_Unit([(idx, cp)] + [x for u in merged for x in u.clusters],
                       eqns.union(*(u.eqns for u in merged))))
  owned = []
  for u in units:
    why = _check(graph, u, ctx, state_pairs) or owners.worth(jaxpr, u, ctx.topology, ctx.num_shards)
    if why:
      for idx, cp in u.clusters:
        out.clusters[idx] = dataclasses.replace(cp, why=cp.why.noted(reasons.NotOwned(why)))
    else:
      owned.append(u)
  if not owned:
    return out
  rewritten = divides.rewritten_divides(jaxpr)
  while True:
    # Rows are as long as the busiest replica's: a tensor too large to balance
    # (one matrix of most of the bytes) pads every row to its size. Largest first,
    # such tensors stay replicated until the rest is predicted no slower owned.
    stacks = owners.assign(jaxpr, owned, ctx.num_shards)
    ownership, state = owners.rows(jaxpr, owned, stacks, ctx.num_shards, rewritten)
    rep, own = owners.whole_prediction(jaxpr, owned, ownership, ctx.topology,
                                       ctx.num_shards)
    if own <= rep:
      break
    largest = max(owned, key=lambda u: (owners.unit_bytes(jaxpr, u), -min(u.eqns)))
    owned.remove(largest)
    why = causes.TooLargeToBalance(own, rep, ownership.imbalance)
    for idx, cp in largest.clusters:
      out.clusters[idx] = dataclasses.replace(cp, why=cp.why.noted(reasons.NotOwned(why)))
    if not owned:
      return out
  out.ownership = divides.pinned(
      jaxpr, dataclasses.replace(ownership, predicted=(rep, own)), rewritten)
  invar_pos = {v: k for k, v in enumerate(jaxpr.invars)}
  for u in owned:
    for i in u.eqns:
      out.kinds[i] = Kind.OWNED_SCATTER if i in u.seeds else Kind.OWNED
    for out_pos, in_pos in u.pairs.items():
      out.sharded_in[in_pos] = state[jaxpr.invars[in_pos]]
      out.sharded_out[out_pos] = state[jaxpr.invars[in_pos]]
      out.input_reason[in_pos] = (True, reasons.OnOwner(u.owner, u.index, True))
    for v in u.weights:
      out.input_reason[invar_pos[v]] = (False, reasons.OnOwner(u.owner, u.index, False))
    out.clusters.update(_cluster_plans(jaxpr, u, ownership, state, stacks, in_names, out_names))
  return out


def _unit(graph: Graph, seeds, ctx: PlanningContext, taken) -> set[int]:
  """The equations of the update that the all-reduces `seeds` start (module docstring, 1)."""
  eqns, outputs = graph.jaxpr.eqns, graph.outputs

  def repeated(i: int) -> bool:
    return i not in taken and ctx.facts.repeats(eqns[i], ctx.axes)

  unit, todo = set(seeds), list(seeds)
  while todo:
    for v in eqns[todo.pop()].outvars:
      for r in graph.readers(v):
        if r not in unit and repeated(r):
          unit.add(r)
          todo.append(r)
  grown = True
  while grown:
    grown = False
    for i in sorted(unit):
      for v in eqns[i].invars:
        p = None if compat.is_literal(v) else graph.producer.get(v)
        if (p is None or p in unit or not repeated(p)
            or any(o in outputs for o in eqns[p].outvars)):
          continue
        if all(graph.only_read_by(o, unit) for o in eqns[p].outvars):
          unit.add(p)
          grown = True
  return unit


def _runs_on_owner(eqn, ctx: PlanningContext) -> bool:
  """Whether one replica can run `eqn` alone: pure, or a collective of equal values."""
  if eqn.primitive is compat.pvary_p:
    return True
  kind = shardable.shard_kind(eqn, shardable.Context(ctx.facts, ctx.axes))
  if eqn.primitive in (compat.psum_p, compat.psum_invariant_p, compat.pmax_p, compat.pmin_p):
    return kind in _LOCAL
  return eqn.primitive in _RUNS_ON_OWNER and all(
      _runs_on_owner(e, ctx) for sub in compat.sub_jaxprs(eqn) for e in sub.eqns)


def _split_over(eqn, ctx: PlanningContext) -> list[str]:
  """The manual axes besides the sharding axes over which the operands of a gradient
  all-reduce differ (a weight its spec splits over a model axis), sorted."""
  other = ctx.facts.all_axes - ctx.axes
  return sorted({a for v in eqn.invars if not compat.is_literal(v)
                 for a in other - ctx.facts.of(v)})


def _check(graph: Graph, u: _Unit, ctx: PlanningContext,
           state_pairs: Mapping[int, int]) -> str | None:
  """Why `u` cannot be owned, or None; fills its seeds, state pairs, exits and weights."""
  jaxpr = graph.jaxpr
  eqns = jaxpr.eqns
  kind_ctx = shardable.Context(ctx.facts, ctx.axes)
  seeds, operands = [], set()
  for i in sorted(u.eqns):
    eqn = eqns[i]
    if shardable.shard_kind(eqn, kind_ctx) is Kind.REDUCE_SCATTER:
      if frozenset(compat.collective_axes(eqn)) != ctx.axes:
        return causes.SpansMoreAxes(source_line(eqn), tuple(sorted(ctx.axes)))
      seeds.append(i)
      operands.update(v for v in eqn.invars if not compat.is_literal(v))
      if split := _split_over(eqn, ctx):
        return causes.BlockOfSplit(source_line(eqn), tuple(split))
    elif not _runs_on_owner(eqn, ctx):
      return causes.NotOnOneReplica(causes.Eqn.of(eqn, source_line(eqn)))
  # In equation order (not a set's), so that the reason printed is the same every run.
  made = dict.fromkeys(v for i in sorted(u.eqns) for v in eqns[i].outvars)
  outputs = [v for v in jaxpr.outvars if not compat.is_literal(v)]
  for v in made:
    outside = [r for r in graph.readers(v) if r not in u.eqns]
    if outside:
      eqn = eqns[outside[0]]
      return causes.ReadOutside(causes.Eqn.of(eqn, source_line(eqn)), v.aval.str_short())
  reads = dict.fromkeys(v for i in sorted(u.eqns) for v in eqns[i].invars
                        if not compat.is_literal(v) and v not in made)
  for v in (v for v in reads if v not in operands):
    if not ctx.facts.is_redundant(v, ctx.axes):
      return causes.ReadsVarying(v.aval.str_short())
  pairs = {}
  for out_pos, in_pos in state_pairs.items():
    x, y = jaxpr.invars[in_pos], jaxpr.outvars[out_pos]
    if (not compat.is_literal(y) and y in made and x in reads and ctx.big(x)
        and graph.only_read_by(x, u.eqns) and x not in outputs and outputs.count(y) == 1
        and x.aval.shape == y.aval.shape and x.aval.dtype == y.aval.dtype):
      pairs[out_pos] = in_pos
  paired = {jaxpr.outvars[o] for o in pairs}
  u.seeds, u.pairs = tuple(seeds), pairs
  u.exits = tuple(dict.fromkeys(v for v in outputs if v in made and v not in paired))
  u.weights = tuple(v for v in jaxpr.invars if v in reads and ctx.big(v)
                    and v not in {jaxpr.invars[k] for k in pairs.values()})
  if not seeds:
    return causes.NoOwnAllReduce()
  if not any(ctx.big(v) for v in [*(eqns[i].outvars[0] for i in seeds), *u.exits]):
    return causes.TinyTensors()
  return None


def _cluster_plans(jaxpr: Jaxpr, u: _Unit, ownership: Ownership, state: dict, stacks,
                   in_names, out_names) -> dict[int, ClusterPlan]:
  """The ClusterPlan of an owned unit (its first cluster; clusters merged into it say so)."""
  n = ownership.num_shards

  def entry(name, v, role, fmt):
    return TensorPlan(name, tuple(v.aval.shape), v.aval.dtype.name, role, fmt,
                      v.aval.dtype.itemsize)

  invar_pos = {v: k for k, v in enumerate(jaxpr.invars)}
  tensors = []
  for i in u.seeds:
    v = jaxpr.eqns[i].outvars[0]
    dtype, slot = ownership.grads[v]
    tensors.append(entry(f"all-reduce at {source_line(jaxpr.eqns[i])}", v, "gradient",
                         Placement(tuple(v.aval.shape), slot, n, ownership.grad_rows[dtype])))
  for in_pos in sorted(u.pairs.values()):
    x = jaxpr.invars[in_pos]
    tensors.append(entry(in_names[in_pos], x, "state", state[x]))
  for v in u.weights:
    tensors.append(entry(in_names[invar_pos[v]], v, "weight", None))
  for v in u.exits:
    dtype, slot = ownership.outputs[v]
    for p, y in enumerate(jaxpr.outvars):
      if y is v:
        tensors.append(entry(out_names[p], v, "output",
                             Placement(tuple(v.aval.shape), slot, n, ownership.out_rows[dtype])))
  members = stacks[u.stack]
  position = members.index(u)
  k = len(members) // n
  where = (f"slot {position} of stack {u.stack} ({k} contiguous per replica)" if position < k * n
           else f"stack {u.stack} remainder, balanced by predicted cost")
  rep, own = u.predicted
  idx, cp = u.clusters[0]
  why = reasons.Reason(reasons.Owned(u.owner, where, len(u.eqns), u.cost,
                                     tuple(i for i, _ in u.clusters[1:])))
  out = {idx: dataclasses.replace(cp, tensors=tuple(tensors), why=why, owner=u.owner,
                                  replicated_seconds=rep, sharded_seconds=own)}
  for j, other in u.clusters[1:]:
    out[j] = dataclasses.replace(other, why=reasons.Reason(reasons.OwnedWith(idx)),
                                 owner=u.owner, tensors=())
  return out
