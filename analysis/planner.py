"""The planner: clusters, formats and cost decisions of a step, frozen into a Plan (§3, §4).

`make_plan` takes one `planning.PlanRequest`, builds the step's `graph.Graph` and
the `planning.PlanningContext` its stages read, and runs the passes (clusters,
formats, cost, ownership) on it, loops first: each loop body through one
memoized entry point, `_plan_body` (loops nest); each stage writes what it finds
into the jaxpr's `plan_cluster.Planning`. It returns the `plan.Plan`, whose
reasons are `reasons.Reason` values.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import numpy as np

from wus.analysis import clusters as clusters_lib
from wus.analysis import (causes, compat, cost, formats, fsdp_blocks, kept_state, loops,
                          network, ordering, ownership, presliced, reasons)
from wus.analysis.compat import Jaxpr, Var, source_line
from wus.analysis.formats import Format
from wus.analysis.graph import Graph
from wus.analysis.owned import Ownership
from wus.analysis.plan import ClusterPlan, Grouping, InputPlan, JaxprPlan, Plan
from wus.analysis.plan_cluster import Planning, Scope, plan_cluster
from wus.analysis.planning import Argument, PlanningContext, PlanRequest
from wus.analysis.shardable import Kind
from wus.collectives import batched


def make_plan(request: PlanRequest) -> Plan:
  """Plans the weight-update sharding of a flat shard_map body.

  Args:
    request: the step and everything the front end knows of it (`PlanRequest`).

  Returns:
    The frozen Plan.
  """
  r = request
  graph = Graph(r.jaxpr, r.num_shards, r.min_size)
  ctx = PlanningContext.of(r, graph.big)
  # A region's operands no argument enters are values the step computes (gradients).
  computed = (frozenset() if r.arguments is None else frozenset(
      range(len(r.jaxpr.invars))) - {a.operand for a in r.arguments})
  planned = _plan(graph, ctx, r.state_pairs, r.in_names, r.out_names, computed=computed)
  inputs, state_inputs = _inputs(r, ctx, planned)
  if split := presliced.taken_as_shards(graph, planned.jaxpr_plan, planned.formats,
                                        r.presliced):
    planned = dataclasses.replace(planned, jaxpr_plan=dataclasses.replace(
        planned.jaxpr_plan, sharded_in={**planned.jaxpr_plan.sharded_in, **split},
        presliced=frozenset(split)))
  gathered = cost.gathered_tensors(r.jaxpr, planned.jaxpr_plan.sharded_out, planned.formats,
                                   planned.gather_dtypes)
  limit, alone, buckets, collectives = cost.bucket_bytes(planned.clusters, r.num_shards,
                                                         ctx.topology, r.objective, gathered)
  # In a step with clusters grown from roots, the copy-free order of donated weights
  # (`ordering`) takes only the gradient all-reduces as tokens, never the result of a
  # read: the roots' gradients are computed whole on every replica in the same
  # program, and a token on a matmul's result there (one more consumer) changed how
  # XLA:CPU fuses and rounds it (one ulp, tests/analysis/test_roots.py).
  rooted = any(t.role == "root" for c in planned.clusters for t in c.tensors)
  after, tied = ordering.gather_after(graph, planned.jaxpr_plan.shard_eqns, planned.formats,
                                      planned.jaxpr_plan.sharded_out, read_tokens=not rooted,
                                      sharded_in=planned.jaxpr_plan.sharded_in,
                                      in_order=r.arguments is None,
                                      alone=_alone(planned.formats, limit, alone))
  jaxpr_plan = dataclasses.replace(planned.jaxpr_plan, gather_after=after, tied_outputs=tied)
  plan = Plan(tuple(r.axes), r.num_shards, r.min_size, inputs, tuple(planned.clusters),
              jaxpr_plan, planned.formats, planned.gather_dtypes, objective=r.objective,
              bucket_bytes=limit, alone_bytes=alone, buckets=buckets, collectives=collectives,
              owned=planned.owned,
              resolution=network.resolution(ctx.topology), copy_axes=tuple(ctx.copy_sizes),
              num_copies=math.prod(ctx.copy_sizes.values()), group_size=r.group_size,
              groups=_with_across(r.grouping, planned.clusters, limit), split_by=r.split_by,
              outside=tuple(r.outside), state_inputs=state_inputs)
  # G = 1: groups of one replica shard nothing; the rewrite replays the step.
  return (replicated(plan, reasons.Reason(causes.GroupsOfOne(r.axes[0])))
          if r.group_size == 1 else plan)


def _alone(formats: Mapping, limit: int, alone_bytes: int | None):
  """Whether a value held as shards has a reduce-scatter of its own (`batched.has_own`)."""
  def own(v) -> bool:
    fmt = formats.get(v)
    return batched.has_own(math.prod(v.aval.shape) * v.aval.dtype.itemsize, limit,
                           alone_bytes, batched.pads([fmt])[0])
  return own


def _inputs(r: PlanRequest, ctx: PlanningContext,
            planned: _Planned) -> tuple[tuple[InputPlan, ...], dict]:
  """The Plan's inputs, each kept sharded or whole and why, and `Plan.state_inputs`."""
  state = set(r.state_pairs.values()) | set(r.state_whole)
  inputs = []
  for k, v in enumerate(r.jaxpr.invars):
    sharded, why = planned.input_reason.get(
        k, (False, _why_whole(v, ctx, bool(planned.clusters), r.split_reason)))
    why = why if isinstance(why, reasons.Reason) else reasons.Reason(why)
    if not sharded and k in r.state_whole:
      why = reasons.Reason(r.state_whole[k], (why.verdict, *why.notes))
    inputs.append(InputPlan(r.in_names[k], tuple(v.aval.shape), v.aval.dtype.name, sharded, why,
                            k in state, v.aval.dtype.itemsize, r.matched.get(k, ""),
                            tuple(r.split.get(k, ())), tuple(r.fsdp.get(k, ()))))
  if r.arguments is None:
    return tuple(inputs), dict(planned.jaxpr_plan.sharded_in)
  return _of_arguments(inputs, r.arguments, planned.jaxpr_plan.sharded_in)


def replicated(plan: Plan, why: reasons.Reason) -> Plan:
  """`plan` with every cluster kept replicated and every input whole, for `why`.

  The rewrite then replays the step unchanged.
  """
  clusters = tuple(dataclasses.replace(
      c, sharded=False, why=why, owner=None,
      tensors=tuple(dataclasses.replace(t, format=None) for t in c.tensors)) for c in plan.clusters)
  inputs = tuple(dataclasses.replace(i, sharded=False, why=why) if i.sharded else i
                 for i in plan.inputs)
  return dataclasses.replace(plan, inputs=inputs, clusters=clusters,
                             rewrite=JaxprPlan({}, {}, {}), formats={}, gather_dtypes={},
                             owned=None, state_inputs={})


def unchanged_plan(jaxpr: Jaxpr, in_names: Sequence[str], axes: Sequence, num_shards: int,
                   reason: reasons.Reason) -> Plan:
  """The Plan of a step a front end runs unchanged (`wus.jit`'s, with no batch split or
  no update it can find), every input whole for `reason`.

  Args:
    jaxpr: the step's jaxpr (one input per argument leaf).
    in_names: a name (argument path) per input.
    axes, num_shards: the batch axes and their replicas (N = 1 without).
    reason: why the step runs unchanged, for the Plan (`Plan.unchanged`) and each input.
  """
  inputs = tuple(InputPlan(name, tuple(v.aval.shape), str(v.aval.dtype), False, reason)
                 for name, v in zip(in_names, jaxpr.invars, strict=True))
  return Plan(tuple(axes), num_shards, 0, inputs, (), JaxprPlan({}, {}, {}), unchanged=reason)


def _of_arguments(operands: list[InputPlan], arguments: Sequence[Argument],
                  sharded_in: Mapping[int, Format]) -> tuple[tuple[InputPlan, ...], dict]:
  """The Plan's inputs when the planned jaxpr is a region of the step: one per argument
  leaf, each the plan of the region input it enters as, named by its path and state if
  the step returns its next value; and `Plan.state_inputs`, `sharded_in` (by region
  operand) keyed by the argument each operand is (the first, if several enter as one).

  Raises:
    AssertionError: an input kept sharded that is no argument (the front end's state
      pairs are arguments only).
  """
  input_of: list[int | None] = [None] * len(operands)
  inputs = []
  for k, a in enumerate(arguments):
    if a.operand is None:
      outside = reasons.Reason(reasons.OutsideRegion(state=bool(a.matched)))
      inputs.append(InputPlan(a.name, tuple(a.shape), a.dtype.name, False, outside,
                              bool(a.matched), a.dtype.itemsize, a.matched))
      continue
    if input_of[a.operand] is None:
      input_of[a.operand] = k
    op = operands[a.operand]
    inputs.append(dataclasses.replace(op, name=a.name, state=op.state or bool(a.matched),
                                      matched=op.matched or a.matched))
  assert all(input_of[k] is not None for k in sharded_in), "sharded state must be an argument"
  return tuple(inputs), {input_of[k]: f for k, f in sharded_in.items()}


def _with_across(grouping: Grouping | None, cluster_plans, bucket_bytes: int) -> Grouping | None:
  """`grouping` with the batched all-reduces of the gradient shards across its groups
  per step (§5.2, Fig. 10 right), predicted: one per dtype bucket of the sharded
  gradients' shards."""
  if grouping is None or not grouping.num_groups:
    return grouping
  grads = [t for c in cluster_plans if c.sharded for t in c.tensors
           if t.role == "gradient" and t.format is not None]
  across = len(batched.dtype_buckets([t.dtype for t in grads],
                                     [t.format.shard_size * t.itemsize for t in grads],
                                     bucket_bytes))
  return dataclasses.replace(grouping, across=across)


@dataclasses.dataclass
class _Planned:
  """The plan of one jaxpr (the step, or a loop body).

  Attributes:
    jaxpr_plan: its instructions for the rewrite.
    clusters: its cluster plans, a loop body's among them.
    input_reason: input position -> (kept sharded, why), picked (`InputReasons.picked`).
    formats: value -> its shard format.
    gather_dtypes: value -> the narrower float it is all-gathered in.
    owned: the step's `owned.Ownership`, or None (never a loop body's).
  """

  jaxpr_plan: JaxprPlan
  clusters: list[ClusterPlan]
  input_reason: dict[int, tuple[bool, object]]
  formats: dict[Var, Format]
  gather_dtypes: dict[Var, np.dtype]
  owned: Ownership | None = None

  @property
  def whole_inputs(self) -> dict:
    """Input position -> why it stays whole, for a loop around this jaxpr: the
    replicated cluster that reads it, or the reader with no shard rule."""
    return {k: why for k, (sharded, why) in self.input_reason.items()
            if not sharded and isinstance(why, (reasons.ClusterReplicated, reasons.NoShardRule))}


def _plan(graph: Graph, ctx: PlanningContext, state_pairs: Mapping[int, int], in_names, out_names,
          label: str = "", in_loop: bool = False, counters: frozenset = frozenset(),
          computed: frozenset = frozenset()) -> _Planned:
  """Clusters, formats and decisions of one jaxpr (`graph.jaxpr`), in stages: its loops
  first (`_plan_loops`), then its clusters (`plan_cluster.plan_cluster`), the FSDP blocks
  repeated over copy axes (`fsdp_blocks`), the state no
  cluster reaches (`_whole_readers`), ownership (`_own`) and the state kept sharded
  after them (`_keep_state`); each input's reason picked from the candidates the stages
  propose (`input_reasons`).

  `counters` are a loop body's inputs that count iterations: a conditional
  whose predicate depends on one is taken every k steps (§3.2). `computed`: `Scope`'s.
  """
  scope = Scope(graph, state_pairs, in_names, out_names, label, in_loop,
                loops.rare_conds(graph.jaxpr, counters), computed=computed)
  acc = Planning()
  planned_loops = _plan_loops(scope, ctx, acc)
  # A loop's carries held as shards after it (a gradient accumulated on shards)
  # seed clusters as the gradient all-reduces do (§4.2).
  scope = dataclasses.replace(scope, held={
      graph.jaxpr.eqns[i].outvars[k]: f for i, loop in planned_loops.items()
      for k, f in loop.carries.items()})
  found = _find_clusters(scope, ctx, acc)
  clustered = {i for c in found for i in c.eqns}
  for c in found:
    plan_cluster(scope, ctx, acc, c, clustered)
  if not in_loop:
    fsdp_blocks.plan_blocks(scope, ctx, acc, clustered)
  _whole_readers(scope, ctx, acc, found, clustered)
  owned = _own(scope, ctx, acc)
  if not in_loop:
    _keep_state(scope, ctx, acc)
  return _Planned(JaxprPlan(acc.shard_eqns, acc.sharded_in, acc.sharded_out, acc.bodies),
                  acc.cluster_plans, acc.reasons.picked(), acc.formats, acc.gather_dtypes,
                  owned.ownership)


def _plan_loops(s: Scope, ctx: PlanningContext,
                acc: Planning) -> dict[int, loops.PlannedLoop]:
  """Stage 1: the loops of `s.jaxpr`, each body planned through `_plan_body`; their
  clusters numbered on from the step's, sharded or not (a body that shards nothing
  still says why); the state a loop carries as shards. Returns loop equation ->
  its `loops.PlannedLoop`."""
  jaxpr, invar_pos = s.jaxpr, s.invar_pos
  planned_loops = {}
  for i, body in loops.bodies(jaxpr, s.in_names, s.label).items():
    planned = _plan_body(body, ctx)
    offset = len(acc.cluster_plans)
    acc.cluster_plans += [dataclasses.replace(c, index=offset + c.index)
                          for c in planned.clusters]
    operands = compat.loop(jaxpr.eqns[i]).body_operands
    for k, why in planned.whole_inputs.items():
      if not compat.is_literal(operands[k]) and operands[k] in invar_pos:
        acc.reasons.whole(invar_pos[operands[k]], reasons.shifted(why, offset))
    loop = loops.planned_loop(jaxpr.eqns[i], planned)
    if loop is not None:
      planned_loops[i] = loop
  for i, loop in planned_loops.items():
    acc.shard_eqns[i], acc.bodies[i] = Kind.LOOP, (loop.jaxpr_plan,)
    acc.formats.update(loop.formats)
    acc.gather_dtypes.update(loop.gather_dtypes)
    acc.formats.update({jaxpr.eqns[i].outvars[k]: f for k, f in loop.carries.items()})
    for out_pos, in_pos in s.state_pairs.items():
      state = loops.loop_state(s.graph, i, loop, jaxpr.outvars[out_pos], jaxpr.invars[in_pos])
      if state is not None:
        acc.formats.update(state.formats)
        acc.shard_eqns.update(dict.fromkeys(state.copies, Kind.LAYOUT))
        acc.sharded_in[in_pos] = state.formats[jaxpr.invars[in_pos]]
        acc.sharded_out[out_pos] = state.formats[jaxpr.outvars[out_pos]]
        acc.reasons.shard(in_pos, reasons.LoopCarried(source_line(jaxpr.eqns[i])))
  return planned_loops


def _find_clusters(s: Scope, ctx: PlanningContext,
                   acc: Planning) -> list[clusters_lib.Cluster]:
  """Stage 2: the weight-update clusters (§3.2). Outside loops, updates no all-reduce
  reaches grow from their roots (§3.1: redundant computation, whatever feeds it)."""
  state = frozenset() if s.in_loop else frozenset(
      s.jaxpr.invars[k] for k in s.state_pairs.values() if k not in acc.sharded_in)
  return clusters_lib.find_clusters(s.jaxpr, ctx.facts, ctx.axes, ctx.num_shards,
                                    ctx.min_size, held_sharded=frozenset(s.held), state=state,
                                    roots=frozenset() if s.in_loop else ctx.roots,
                                    graph=s.graph, memo=ctx.memo)


def _whole_readers(s: Scope, ctx: PlanningContext, acc: Planning, found: list,
                   clustered: set) -> None:
  """Stage 4: state whose next value an update computes, kept whole by a reader outside
  the clusters with no shard rule (a `sort` of the momentum), for inputs no stage has
  proposed a reason for."""
  updated = {v for c in found for v in c.returned}
  for out_pos, in_pos in s.state_pairs.items():
    y = s.jaxpr.outvars[out_pos]
    if in_pos not in acc.reasons.order and not compat.is_literal(y) and y in updated and (
        reader := kept_state.whole_reader(s.graph, s.jaxpr.invars[in_pos], clustered, ctx)):
      acc.reasons.whole(in_pos, reasons.NoShardRule(reader))


def _own(s: Scope, ctx: PlanningContext, acc: Planning) -> ownership.OwnershipPart:
  """Stage 5: replicated clusters run on whole tensors by their owners (`ownership`)."""
  if not acc.candidates:
    return ownership.OwnershipPart()
  owned = ownership.plan_ownership(s.graph, ctx, acc.candidates, acc.shard_eqns,
                                   s.state_pairs, s.in_names, s.out_names)
  for idx, cluster_plan in owned.clusters.items():
    acc.cluster_plans[idx] = cluster_plan
  acc.shard_eqns.update(owned.kinds)
  acc.sharded_in.update(owned.sharded_in)
  acc.sharded_out.update(owned.sharded_out)
  acc.reasons.own(owned.input_reason)
  return owned


def _keep_state(s: Scope, ctx: PlanningContext, acc: Planning) -> None:
  """Stage 6 (the step only): state no cluster keeps sharded, kept sharded between steps
  when only sharded updates read it, or when the step passes it through unchanged."""
  jaxpr, graph = s.jaxpr, s.graph
  for out_pos, in_pos in s.state_pairs.items():
    v, y = jaxpr.invars[in_pos], jaxpr.outvars[out_pos]
    if in_pos in acc.sharded_in:
      continue
    if (v in acc.formats and v not in acc.read_whole and graph.readers(v)
        and all(acc.shard_eqns.get(j) not in (None, Kind.LOOP) for j in graph.readers(v))
        and acc.formats.get(y) == acc.formats[v] and jaxpr.outvars.count(y) == 1):
      # Read only as shards by sharded updates (several clusters: Sophia's nu, read by the
      # step and refreshed from a Hessian estimate; or returned unchanged:
      # prodigy's params0), its next value held in the same format.
      acc.sharded_in[in_pos] = acc.sharded_out[out_pos] = acc.formats[v]
      acc.reasons.keep(in_pos, reasons.OnlySharded(y is v))
      continue
    chain = kept_state.passed_through(graph, in_pos, out_pos, ctx)
    if chain is not None:
      for j in chain:
        acc.shard_eqns[j] = Kind.LAYOUT
      for u in [v, *(jaxpr.eqns[j].outvars[0] for j in chain)]:
        acc.formats[u] = formats.format_from_bounds(tuple(u.aval.shape), frozenset(),
                                                    ctx.num_shards)
      acc.sharded_in[in_pos] = acc.formats[v]
      acc.sharded_out[out_pos] = acc.formats[y]
      acc.reasons.keep(in_pos, reasons.PassedThrough())


def _plan_body(body: loops.Body, ctx: PlanningContext) -> _Planned:
  """The plan of a loop body: the one entry point of the planner's recursion into loops,
  memoized by `body` (its jaxpr, carries and names), so a body that several loops run
  is planned once and every such loop shares the same JaxprPlan (as
  `jax.experimental.key_reuse` memoizes a sub-jaxpr's signature)."""
  if body not in ctx.memo:
    ctx.memo[body] = _plan(Graph(body.jaxpr, ctx.num_shards, ctx.min_size), ctx,
                           dict(body.state_pairs), body.in_names, body.out_names, body.label,
                           in_loop=True, counters=body.counters)
  return ctx.memo[body]


def _why_whole(v, ctx: PlanningContext, any_cluster: bool, split_reason: causes.SplitBy):
  """Why an input no cluster decided on stays whole (a `reasons` verdict)."""
  if not ctx.facts.is_redundant(v, ctx.axes):
    return reasons.Differs(tuple(sorted(ctx.axes)), split_reason)
  if not ctx.big(v):
    return reasons.Tiny(ctx.num_shards, ctx.min_size)
  if not any_cluster:
    return reasons.NoGradientAllReduce(tuple(sorted(ctx.axes)))
  return reasons.NotRead()
