"""The planner: clusters, formats and cost decisions of a step, frozen into a Plan (§3, §4).

`make_plan` builds the step's `graph.Graph` and runs the passes (clusters,
formats, cost, ownership) on it, loops first: each loop body through one
memoized entry point, `_plan_body` (loops nest); it returns the `plan.Plan`,
whose reasons are `reasons.Reason` values.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from wus.analysis import clusters as clusters_lib
from wus.analysis import (compat, cost, formats, kept_state, layouts, loops, network, ordering,
                          ownership, reasons)
from wus.analysis.compat import Jaxpr, source_line
from wus.analysis.graph import Graph
from wus.analysis.plan import ClusterPlan, InputPlan, JaxprPlan, Plan, TensorPlan
from wus.analysis.redundancy import Redundancy
from wus.analysis.shardable import Kind


def make_plan(jaxpr: Jaxpr, facts: Redundancy, *, axes: Sequence, num_shards: int,
              in_names: Sequence[str], out_names: Sequence[str],
              state_pairs: Mapping[int, int], min_size: int = 0,
              split_reason: str = "its in_spec splits it", objective: str = "memory",
              topology: network.Topology | None = None, shard_weights: bool = False,
              state_whole: Mapping[int, str] | None = None,
              matched: Mapping[int, str] | None = None, roots: Sequence[int] = (),
              split: Mapping[int, tuple] | None = None,
              fsdp: Mapping[int, tuple] | None = None,
              copies: Mapping[str, int] | None = None) -> Plan:
  """Plans the weight-update sharding of a flat shard_map body.

  Args:
    jaxpr: the per-replica jaxpr, calls inlined.
    facts: its redundancy analysis.
    axes: the replica mesh axes (a gradient all-reduce runs over exactly these).
    num_shards: N, the number of replicas along `axes`.
    in_names, out_names: a name (pytree path) per flat input / output.
    state_pairs: output position -> input position for outputs that are the
      next value of an input (the step's state, matched by position, name or
      structure). Such a pair stays sharded between steps when only the
      update reads the input.
    min_size: tensors with fewer elements stay replicated (never below N).
    split_reason: why an input that differs across replicas does (shown in
      the Plan; `wus.pmap` points at replicated_argnums).
    objective, topology: as for `cost.decide` (the topology has N devices).
    shard_weights: a weight whose next value the step returns, which the
      forward pass reads only converted to one narrower float, stays sharded
      between steps like optimizer state and is all-gathered in that float at
      its first read (Fig. 4 right, Fig. 7, across calls instead of a loop).
    state_whole: input position -> why the caller keeps that state whole
      between steps (left out of `state_pairs`), for the Plan.
    matched: input position -> which output the state matching took for its
      next value and by which rule, or why it found none, for the Plan.
    roots: positions of inputs that are identical on every replica and that
      an update reads whole, to be sliced locally (`clusters.find_roots`): a
      front end's gradients that arrive all-reduced. The planner finds the
      roots of the updates of state that no all-reduce reaches itself.
    split: input position -> the mesh axes of size > 1 the user's spec splits it
      over besides `axes`, with their sizes (tensor parallelism), for the Plan.
    fsdp: input position -> the axes of `axes` its spec splits it over (FSDP), for
      the Plan.
    copies: other manual mesh axes -> their sizes (> 1): a cluster that every replica
      of them repeats (`redundancy.differs_over`) is sharded over them too
      (`Plan.copy_axes`).

  Returns:
    The frozen Plan.
  """
  graph = Graph(jaxpr, num_shards, min_size)
  ctx = _Ctx(facts, frozenset(axes), num_shards, min_size, graph.big, objective,
             topology or network.default_topology(num_shards), shard_weights,
             frozenset(jaxpr.invars[k] for k in roots), dict(copies or {}))
  planned = _plan(graph, ctx, state_pairs, in_names, out_names)
  inputs = []
  state = set(state_pairs.values()) | set(state_whole or ())
  for k, v in enumerate(jaxpr.invars):
    sharded, why = planned.input_reason.get(
        k, (False, _why_whole(v, facts, ctx, bool(planned.clusters), split_reason)))
    why = why if isinstance(why, reasons.Reason) else reasons.Reason(why)
    if not sharded and k in (state_whole or {}):
      why = reasons.Reason(state_whole[k], (why.verdict, *why.notes))
    inputs.append(InputPlan(in_names[k], tuple(v.aval.shape), v.aval.dtype.name, sharded, why,
                            k in state, v.aval.dtype.itemsize, (matched or {}).get(k, ""),
                            tuple((split or {}).get(k, ())), tuple((fsdp or {}).get(k, ()))))
  limit, alone, buckets = cost.bucket_bytes(planned.clusters, num_shards, ctx.topology,
                                            objective)
  # In a step with clusters grown from roots, the copy-free order of donated weights
  # (`ordering`) takes only the gradient all-reduces as tokens, never the result of a
  # read: the roots' gradients are computed whole on every replica in the same
  # program, and a token on a matmul's result there (one more consumer) changed how
  # XLA:CPU fuses and rounds it (one ulp, tests/analysis/test_roots.py).
  rooted = any(t.role == "root" for c in planned.clusters for t in c.tensors)
  after, tied = ordering.gather_after(graph, planned.jaxpr_plan.shard_eqns, planned.formats,
                                      planned.jaxpr_plan.sharded_out, read_tokens=not rooted)
  jaxpr_plan = dataclasses.replace(planned.jaxpr_plan, gather_after=after, tied_outputs=tied)
  return Plan(tuple(axes), num_shards, min_size, tuple(inputs), tuple(planned.clusters),
              jaxpr_plan, planned.formats, planned.gather_dtypes, objective=objective,
              bucket_bytes=limit, alone_bytes=alone, buckets=buckets, owned=planned.owned,
              resolution=network.resolution(ctx.topology), copy_axes=tuple(ctx.copies),
              copies=math.prod(ctx.copies.values()))


@dataclasses.dataclass(frozen=True)
class _Ctx:
  facts: Redundancy
  axes: frozenset
  num_shards: int
  min_size: int
  big: object
  objective: str
  topology: network.Topology
  shard_weights: bool = False
  roots: frozenset = frozenset()  # Declared roots (variables of the step's jaxpr).
  copies: dict = dataclasses.field(default_factory=dict)  # `make_plan`'s.
  # This planning's memo: a loop's `loops.Body` -> its plan (`_plan_body`), a
  # conditional's branch jaxpr -> its cluster (`clusters.find_clusters`).
  memo: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)


@dataclasses.dataclass
class _Planned:
  """The plan of one jaxpr (the step, or a loop body)."""

  jaxpr_plan: JaxprPlan
  clusters: list
  input_reason: dict
  formats: dict
  gather_dtypes: dict
  owned: object = None  # The step's `owned.Ownership` (never a loop body's).

  @property
  def whole_inputs(self) -> dict:
    """Input position -> why it stays whole, for a loop around this jaxpr: the
    replicated cluster that reads it, or the reader with no shard rule."""
    return {k: why for k, (sharded, why) in self.input_reason.items()
            if not sharded and isinstance(why, (reasons.ClusterReplicated, reasons.NoShardRule))}


def _plan(graph: Graph, ctx: _Ctx, state_pairs: Mapping[int, int], in_names, out_names,
          label: str = "", in_loop: bool = False, counters: frozenset = frozenset()) -> _Planned:
  """Clusters, formats and decisions of one jaxpr (`graph.jaxpr`); loops inside are
  planned first.

  `counters` are a loop body's inputs that count iterations: a conditional
  whose predicate depends on one is taken every k steps (§3.2).
  """
  jaxpr = graph.jaxpr
  invar_pos = {v: k for k, v in enumerate(jaxpr.invars)}
  rare = loops.rare_conds(jaxpr, counters)
  cluster_plans, shard_eqns, sharded_in, sharded_out, all_formats, bodies = [], {}, {}, {}, {}, {}
  gather_dtypes: dict = {}
  # Input position -> (kept sharded, why: a `reasons` verdict, or a `reasons.Reason`).
  input_reason: dict[int, tuple[bool, object]] = {}
  planned_loops = {}
  for i, body in loops.bodies(jaxpr, in_names, label).items():
    planned = _plan_body(body, ctx)
    # The body's clusters are the step's, numbered on from the step's, sharded or not: a
    # body that shards nothing still says why.
    offset = len(cluster_plans)
    cluster_plans += [dataclasses.replace(c, index=offset + c.index) for c in planned.clusters]
    operands = compat.loop(jaxpr.eqns[i]).body_operands
    for k, why in planned.whole_inputs.items():
      if not compat.is_literal(operands[k]) and operands[k] in invar_pos:
        input_reason.setdefault(invar_pos[operands[k]], (False, reasons.shifted(why, offset)))
    loop = loops.planned_loop(jaxpr.eqns[i], planned)
    if loop is not None:
      planned_loops[i] = loop
  for i, loop in planned_loops.items():
    shard_eqns[i], bodies[i] = Kind.LOOP, (loop.jaxpr_plan,)
    all_formats.update(loop.formats)
    gather_dtypes.update(loop.gather_dtypes)
    all_formats.update({jaxpr.eqns[i].outvars[k]: f for k, f in loop.carries.items()})
    for out_pos, in_pos in state_pairs.items():
      state = loops.loop_state(graph, i, loop, jaxpr.outvars[out_pos], jaxpr.invars[in_pos])
      if state is not None:
        all_formats.update(state.formats)
        shard_eqns.update(dict.fromkeys(state.copies, Kind.LAYOUT))
        sharded_in[in_pos] = state.formats[jaxpr.invars[in_pos]]
        sharded_out[out_pos] = state.formats[jaxpr.outvars[out_pos]]
        input_reason[in_pos] = (True, reasons.LoopCarried(source_line(jaxpr.eqns[i])))

  # A loop's carries held as shards after it (a gradient accumulated on shards)
  # seed clusters as the gradient all-reduces do (§4.2).
  held = {jaxpr.eqns[i].outvars[k]: f for i, loop in planned_loops.items()
          for k, f in loop.carries.items()}
  # Outside loops, updates no all-reduce reaches grow from their roots (§3.1:
  # redundant computation, whatever feeds it).
  state = frozenset() if in_loop else frozenset(
      jaxpr.invars[k] for k in state_pairs.values() if k not in sharded_in)
  found = clusters_lib.find_clusters(jaxpr, ctx.facts, ctx.axes, ctx.num_shards, ctx.min_size,
                                     held_sharded=frozenset(held), state=state,
                                     roots=frozenset() if in_loop else ctx.roots, graph=graph,
                                     memo=ctx.memo)
  clustered = {i for c in found for i in c.eqns}
  read_whole: set = set()  # Values a sharded cluster reads whole.
  candidates = []  # Replicated clusters of the step: ownership may run them on whole tensors.
  for c in found:
    idx = len(cluster_plans)
    members = set(c.eqns)
    # The layout, or the verdict that stops it (words, or the parts that run whole).
    layout, over_copies = layouts.assign_repeated(jaxpr, c, ctx, in_loop)
    if not c.eqns:
      layout = _kept_whole(jaxpr, c)
    notes: list = []  # What the passes below add to the verdict (`reasons`).
    narrow = None  # Inputs kept sharded and gathered in a narrower float where read.
    why_whole: dict[int, str] = {}  # shard_weights: weights this cluster updates, kept whole.
    if isinstance(layout, layouts.Layout) and (mismatch := [
        v for v in c.reads if v in held and layout.formats.get(v) != held[v]]):
      layout = (f"{mismatch[0].aval.str_short()} leaves a loop as shards of another format "
                "than this update needs")
    if not isinstance(layout, layouts.Layout):
      decision, verdict = cost.Decision(False, reasons.Reason(layout), 0, 0, 0), layout
      layout = layouts.Layout({}, frozenset(), frozenset())
      pairs = {}
    else:
      narrow = {} if in_loop or ctx.shard_weights else None
      gathers: dict = {}  # Values all-gathered in a narrower float where read -> the dtype.
      weights = ctx.shard_weights and not in_loop
      through = frozenset()
      if weights:
        c, layout, through = kept_state.through_copies(c, layout, graph, state_pairs, ctx,
                                                       why_whole)
        members = set(c.eqns)
      pairs = kept_state.pairs(c, layout, graph, members, state_pairs, narrow, gathers,
                               why_whole if weights else None, through)
      narrow_gathers = tuple((x.aval.size, d.itemsize) for x, d in (narrow or {}).items())
      decision = cost.decide(c, layout, jaxpr, ctx.facts, ctx.axes, set(pairs), ctx.num_shards,
                             rare, objective=ctx.objective, topology=ctx.topology,
                             extra_gather=() if in_loop else narrow_gathers,
                             sliced=_sliced(c, jaxpr, pairs, invar_pos, in_names))
      verdict = decision.why.verdict
      # A value the rewrite holds as shards has one format: a cluster that
      # needs another format of a value an earlier cluster shards stays whole.
      if decision.shard and (clash := next((v for v, f in layout.formats.items()
                                             if all_formats.get(v, f) != f), None)) is not None:
        decision = dataclasses.replace(decision, shard=False)
        verdict = reasons.FormatClash(
            loops.outer_name(clash, invar_pos, in_names, clash.aval.str_short()))
        pairs = {}
      if rare & set(c.nested) and decision.shard:
        notes.append(reasons.RareConditionals(tuple(
            source_line(jaxpr.eqns[i]) for i in sorted(rare & set(c.nested)))))
      if in_loop and decision.shard:
        gather_dtypes.update(gathers)
        notes.append(loops.placements(c, graph, members, state_pairs, pairs, narrow, in_names))
      elif narrow and decision.shard:
        gather_dtypes.update(gathers)
        notes.append(reasons.KeptShardedWeights(tuple(
            reasons.Gather(in_names[invar_pos[x]], dtype.name, x.aval.size * dtype.itemsize,
                           x.aval.size * x.aval.dtype.itemsize, True)
            for x, dtype in narrow.items())))
    across = sorted({a for i in c.seeds for a in compat.collective_axes(jaxpr.eqns[i])}
                    - ctx.axes - set(over_copies.copies if over_copies and over_copies.summed
                                     else ()))
    if across and decision.shard:
      notes.append(reasons.PartialSharding(tuple(sorted(ctx.axes)), tuple(across)))
    if over_copies is not None and decision.shard:
      notes.append(over_copies)
    if c.kept_whole and c.eqns:
      notes.append(_kept_whole(jaxpr, c))
    fmt = layout.formats.get if decision.shard else (lambda v: None)
    tensors = _tensors(c, jaxpr, pairs, in_names, out_names, invar_pos, fmt)
    if not decision.shard:
      # The update goes on past the equation that stopped the cluster: name
      # what it reads and returns there as kept whole with this cluster.
      rest, rest_pairs = kept_state.continued(graph, c, clustered, state_pairs, ctx)
      tensors += _tensors(rest, jaxpr, rest_pairs, in_names, out_names, invar_pos, fmt)
      for v in rest.reads:
        input_reason.setdefault(invar_pos[v], (False, reasons.ClusterReplicated(idx)))
    why = reasons.Reason(verdict, tuple(notes), label)
    cluster_plans.append(ClusterPlan(idx, tensors, decision.shard, why,
                                     decision.all_reduce_bytes, decision.all_gather_bytes,
                                     decision.saved_bytes, decision.replicated_seconds,
                                     decision.sharded_seconds, workload=decision.workload))
    for v in c.reads:
      if v in invar_pos:
        k = invar_pos[v]
        if decision.shard and narrow and v in narrow and not in_loop:
          input_reason[k] = (True, reasons.NarrowWeight(idx, narrow[v].name))
        elif decision.shard and k in pairs.values():
          input_reason[k] = (True, reasons.OnlyCluster(idx))
        elif decision.shard:
          input_reason.setdefault(k, (False, reasons.SlicedLocally(idx)))
        else:
          input_reason.setdefault(k, (False, reasons.ClusterReplicated(idx)))
    for k, why in why_whole.items():
      if not input_reason.get(k, (False,))[0]:
        before = input_reason.get(k, (False, reasons.ClusterUpdates(idx)))[1]
        before = before if isinstance(before, reasons.Reason) else reasons.Reason(before)
        input_reason[k] = (False, before.noted(reasons.NotKeptByShardWeights(why)))
    if not decision.shard and not in_loop and (c.seeds or c.kept_whole):
      candidates.append((idx, c, cluster_plans[-1]))
    if decision.shard:
      shard_eqns.update(c.kinds)
      all_formats.update(layout.formats)
      read_whole.update(layout.whole_reads)
      bodies.update(_bodies(jaxpr, c, layout, ctx.big))
      for out_pos, in_pos in pairs.items():
        sharded_in[in_pos] = sharded_out[out_pos] = layout.formats[jaxpr.invars[in_pos]]
  updated = {v for c in found for v in c.returned}
  for out_pos, in_pos in state_pairs.items():
    y = jaxpr.outvars[out_pos]
    if in_pos not in input_reason and not compat.is_literal(y) and y in updated and (
        reader := kept_state.whole_reader(graph, jaxpr.invars[in_pos], clustered, ctx)):
      input_reason[in_pos] = (False, reasons.NoShardRule(reader))
  owned = ownership.plan_ownership(graph, ctx, candidates, shard_eqns, state_pairs,
                                   in_names, out_names) if candidates else ownership.Owned()
  for idx, cluster_plan in owned.clusters.items():
    cluster_plans[idx] = cluster_plan
  shard_eqns.update(owned.kinds)
  sharded_in.update(owned.sharded_in)
  sharded_out.update(owned.sharded_out)
  input_reason.update(owned.input_reason)
  if not in_loop:
    for out_pos, in_pos in state_pairs.items():
      v = jaxpr.invars[in_pos]
      if in_pos in sharded_in:
        continue
      y = jaxpr.outvars[out_pos]
      if (v in all_formats and v not in read_whole and graph.readers(v)
          and all(shard_eqns.get(j) not in (None, Kind.LOOP) for j in graph.readers(v))
          and all_formats.get(y) == all_formats[v] and jaxpr.outvars.count(y) == 1):
        # Read only as shards by sharded updates (several clusters: Sophia's nu, read by the
        # step and refreshed from a Hessian estimate; or returned unchanged:
        # prodigy's params0), its next value held in the same format.
        sharded_in[in_pos] = sharded_out[out_pos] = all_formats[v]
        input_reason[in_pos] = (True, reasons.OnlySharded(y is v))
        continue
      chain = kept_state.passed_through(graph, in_pos, out_pos, ctx)
      if chain is not None:
        for j in chain:
          shard_eqns[j] = Kind.LAYOUT
        for u in [v, *(jaxpr.eqns[j].outvars[0] for j in chain)]:
          all_formats[u] = formats.format_from_bounds(tuple(u.aval.shape), frozenset(),
                                                      ctx.num_shards)
        sharded_in[in_pos] = all_formats[v]
        sharded_out[out_pos] = all_formats[jaxpr.outvars[out_pos]]
        input_reason[in_pos] = (True, reasons.PassedThrough())
  return _Planned(JaxprPlan(shard_eqns, sharded_in, sharded_out, bodies), cluster_plans,
                  input_reason, all_formats, gather_dtypes, owned.ownership)


def _plan_body(body: loops.Body, ctx: _Ctx) -> _Planned:
  """The plan of a loop body: the one entry point of the planner's recursion into loops,
  memoized by `body` (its jaxpr, carries and names), so a body that several loops run
  is planned once and every such loop shares the same JaxprPlan (as
  `jax.experimental.key_reuse` memoizes a sub-jaxpr's signature)."""
  if body not in ctx.memo:
    ctx.memo[body] = _plan(Graph(body.jaxpr, ctx.num_shards, ctx.min_size), ctx,
                           dict(body.state_pairs), body.in_names, body.out_names, body.label,
                           in_loop=True, counters=body.counters)
  return ctx.memo[body]


def _kept_whole(jaxpr: Jaxpr, c: clusters_lib.Cluster) -> reasons.KeptWhole:
  """Which equations of the update run whole, and the readers that make them."""
  parts = []
  for r in sorted(set(c.kept_whole.values())):
    whole = [i for i, reader in c.kept_whole.items() if reader == r]
    collectives = [i for i in whole if jaxpr.eqns[i].primitive in (compat.psum_p,
                                                                    compat.psum_invariant_p)]
    what = (f"the all-reduce at {source_line(jaxpr.eqns[collectives[0]])}" if collectives
            else f"{jaxpr.eqns[max(whole)].primitive} at {source_line(jaxpr.eqns[max(whole)])}")
    parts.append(reasons.RunsWhole(what, len(whole) - 1,
                                   f"{jaxpr.eqns[r].primitive} at {source_line(jaxpr.eqns[r])}"))
  return reasons.KeptWhole(tuple(parts))


def _bodies(jaxpr: Jaxpr, c: clusters_lib.Cluster, layout: layouts.Layout,
            big) -> dict[int, tuple[JaxprPlan, ...]]:
  """The branch JaxprPlans of the conditionals of a sharded cluster."""
  out = {}
  for i, subs in c.nested.items():
    branch_plans = []
    for branch, sub in zip(compat.cond(jaxpr.eqns[i]).branches, subs, strict=True):
      inner = branch.jaxpr
      branch_plans.append(JaxprPlan(
          dict(sub.kinds),
          {k: layout.formats[v] for k, v in enumerate(inner.invars) if big(v)},
          {k: layout.formats[v] for k, v in enumerate(inner.outvars) if big(v)},
          _bodies(inner, sub, layout, big)))
    out[i] = tuple(branch_plans)
  return out


def _sliced(c: clusters_lib.Cluster, jaxpr: Jaxpr, pairs, invar_pos, in_names) -> list[str]:
  """What a cluster grown from roots reads by a local slice: its roots and the
  weights it reads (not the state it keeps sharded), named for the Plan."""
  if not c.roots:
    return []
  state = {jaxpr.invars[k] for k in pairs.values()}
  return [_value_name(v, jaxpr, invar_pos, in_names) for v in c.reads if v not in state]


def _value_name(v, jaxpr: Jaxpr, invar_pos, in_names) -> str:
  """An input's pytree path, or the equation that computes `v`."""
  if v in invar_pos:
    return in_names[invar_pos[v]]
  eqn = next(e for e in jaxpr.eqns if v in e.outvars)
  return f"{eqn.primitive} at {source_line(eqn)}"


def _tensors(c, jaxpr, pairs, in_names, out_names, invar_pos, fmt) -> tuple[TensorPlan, ...]:
  def entry(name, v, role):
    return TensorPlan(name, tuple(v.aval.shape), v.aval.dtype.name, role, fmt(v),
                      v.aval.dtype.itemsize)

  state_positions = set(pairs.values())
  out = [entry(f"all-reduce at {source_line(jaxpr.eqns[i])}", jaxpr.eqns[i].outvars[0], "gradient")
         for i in c.seeds]
  # A cluster grown from roots reads them, and what they are computed from
  # whole, by a local slice.
  roots = [v for v in c.reads if v in c.roots or (c.roots and v not in invar_pos)]
  out += [entry(_value_name(v, jaxpr, invar_pos, in_names), v, "root") for v in roots]
  for v in c.reads:
    if v in invar_pos and v not in roots:
      k = invar_pos[v]
      out.append(entry(in_names[k], v, "state" if k in state_positions else "weight"))
  for v, positions in c.returned.items():
    for p in positions:
      if p not in pairs:
        out.append(entry(out_names[p], v, "output"))
  return tuple(out)


def _why_whole(v, facts: Redundancy, ctx: _Ctx, any_cluster: bool, split_reason: str):
  """Why an input no cluster decided on stays whole (a `reasons` verdict)."""
  if not facts.is_redundant(v, ctx.axes):
    return reasons.Differs(tuple(sorted(ctx.axes)), split_reason)
  if not ctx.big(v):
    return reasons.Tiny(ctx.num_shards, ctx.min_size)
  if not any_cluster:
    return reasons.NoGradientAllReduce(tuple(sorted(ctx.axes)))
  return reasons.NotRead()
