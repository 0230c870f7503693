"""The planner's decision for one weight-update cluster (§3.2, §4.1, §4.2).

`plan_cluster` takes a cluster `clusters.find_clusters` found in the jaxpr a
`Scope` names and records, into the jaxpr's `Planning`, its `ClusterPlan`, the
reasons it proposes for the inputs it reads (`input_reasons`) and, sharded, its
formats and equations: layout (`layouts`) -> decision (`cost.decide`, state kept
sharded by `kept_state`) -> notes -> tensors -> reasons.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence

import numpy as np

from wus.analysis import clusters as clusters_lib
from wus.analysis import causes, compat, cost, kept_state, layouts, loops, reasons
from wus.analysis.compat import Jaxpr, Var, source_line
from wus.analysis.formats import Format
from wus.analysis.graph import Graph
from wus.analysis.input_reasons import InputReasons
from wus.analysis.plan import ClusterPlan, JaxprPlan, TensorPlan
from wus.analysis.planning import PlanningContext
from wus.analysis.shardable import Kind


@dataclasses.dataclass(frozen=True)
class Scope:
  """The jaxpr being planned (the step, or a loop body) and what the planner knows of it.

  Attributes:
    graph: its `Graph` (`graph.jaxpr` is the jaxpr).
    state_pairs: output position -> input position of the state it returns.
    in_names, out_names: a name per input / output.
    label: where a loop body sits, for its clusters' reasons ("" for the step).
    in_loop: a loop body's.
    rare: its conditionals taken every k iterations (`loops.rare_conds`).
    held: values a loop leaves as shards -> their format.
    computed: positions of inputs the step computes rather than takes (`wus.jit`'s region
      reads its gradients summed in a loop so): a cluster reads them as roots.
  """

  graph: Graph
  state_pairs: Mapping[int, int]
  in_names: Sequence[str]
  out_names: Sequence[str]
  label: str = ""
  in_loop: bool = False
  rare: frozenset = frozenset()
  held: Mapping = dataclasses.field(default_factory=dict)
  computed: frozenset = frozenset()

  @property
  def jaxpr(self) -> Jaxpr:
    return self.graph.jaxpr

  @functools.cached_property
  def invar_pos(self) -> dict:
    return {v: k for k, v in enumerate(self.jaxpr.invars)}


@dataclasses.dataclass
class Planning:
  """What the planning of one jaxpr has found so far, written by the planner's stages in
  turn (loops, clusters, FSDP blocks, whole readers, ownership, state kept sharded).

  Attributes:
    cluster_plans: the plans of its clusters so far, a loop body's among them (each
      `ClusterPlan.index` its position here).
    shard_eqns: equation index -> how it runs on shards (`JaxprPlan.shard_eqns`).
    sharded_in: input position -> its format, for the inputs kept sharded.
    sharded_out: output position -> its format, for the outputs returned sharded.
    formats: value -> its shard format, for the values held as shards.
    bodies: conditional or loop equation index -> the JaxprPlans of its branches or body.
    gather_dtypes: value -> the narrower float it is all-gathered in.
    reasons: each input's candidate reasons, kept sharded or whole (`InputReasons`).
    read_whole: values a sharded cluster reads whole.
    candidates: (cluster index, Cluster, ClusterPlan) of the clusters kept replicated
      that ownership may take (`ownership.plan_ownership`).
    continued: equations of the rest of a replicated cluster's update
      (`kept_state.continued`), each listed with the first cluster whose update it
      continues: one update several clusters feed (Muon's Newton-Schulz `scan` over
      stacked momenta) lists its tensors once.
  """

  cluster_plans: list[ClusterPlan] = dataclasses.field(default_factory=list)
  shard_eqns: dict[int, Kind] = dataclasses.field(default_factory=dict)
  sharded_in: dict[int, Format] = dataclasses.field(default_factory=dict)
  sharded_out: dict[int, Format] = dataclasses.field(default_factory=dict)
  formats: dict[Var, Format] = dataclasses.field(default_factory=dict)
  bodies: dict[int, tuple[JaxprPlan, ...]] = dataclasses.field(default_factory=dict)
  gather_dtypes: dict[Var, np.dtype] = dataclasses.field(default_factory=dict)
  reasons: InputReasons = dataclasses.field(default_factory=InputReasons)
  read_whole: set[Var] = dataclasses.field(default_factory=set)
  candidates: list[tuple[int, clusters_lib.Cluster, ClusterPlan]] = dataclasses.field(
      default_factory=list)
  continued: set[int] = dataclasses.field(default_factory=set)


@dataclasses.dataclass
class _Decided:
  """A cluster's decision and what it keeps sharded (`_decide`)."""

  c: clusters_lib.Cluster
  layout: layouts.Layout
  decision: cost.Decision
  verdict: object
  pairs: dict                 # Output position -> input position of state kept sharded.
  narrow: dict | None = None  # Inputs kept sharded and gathered in a narrower float.
  gathers: dict = dataclasses.field(default_factory=dict)  # Value -> its gather dtype.
  why_whole: dict = dataclasses.field(default_factory=dict)  # Weights kept whole, why.
  members: set = dataclasses.field(default_factory=set)


def plan_cluster(s: Scope, ctx: PlanningContext, acc: Planning, c: clusters_lib.Cluster,
                 clustered: set) -> None:
  """Plans cluster `c` of `s.jaxpr` into `acc` (its index: the next ClusterPlan's)."""
  idx = len(acc.cluster_plans)
  layout, over_copies = _layout(s, ctx, c)
  d = _decide(s, ctx, acc, c, layout)
  notes = _notes(s, ctx, d, over_copies)
  fmt = d.layout.formats.get if d.decision.shard else (lambda v: None)
  tensors = tensor_plans(d.c, s, d.pairs, fmt)
  if not d.decision.shard:
    # The update goes on past the equation that stopped the cluster: name
    # what it reads and returns there as kept whole with this cluster.
    rest, rest_pairs = kept_state.continued(s.graph, d.c, clustered, s.state_pairs, ctx,
                                            acc.continued)
    tensors += tensor_plans(rest, s, rest_pairs, fmt)
    for v in rest.reads:
      acc.reasons.whole(s.invar_pos[v], reasons.ClusterReplicated(idx))
  decision = d.decision
  acc.cluster_plans.append(ClusterPlan(
      idx, tensors, decision.shard, reasons.Reason(d.verdict, tuple(notes), s.label),
      decision.all_reduce_bytes, decision.all_gather_bytes, decision.saved_bytes,
      decision.replicated_seconds, decision.sharded_seconds, workload=decision.workload))
  _propose(s, acc, d, idx)
  if not decision.shard and not s.in_loop and (d.c.seeds or d.c.kept_whole):
    acc.candidates.append((idx, d.c, acc.cluster_plans[-1]))
  if decision.shard:
    acc.shard_eqns.update(d.c.kinds)
    acc.formats.update(d.layout.formats)
    acc.read_whole.update(d.layout.whole_reads)
    acc.bodies.update(_bodies(s.jaxpr, d.c, d.layout, ctx.big))
    acc.gather_dtypes.update(d.gathers if s.in_loop or d.narrow else {})
    for out_pos, in_pos in d.pairs.items():
      acc.sharded_in[in_pos] = acc.sharded_out[out_pos] = d.layout.formats[
          s.jaxpr.invars[in_pos]]


def _layout(s: Scope, ctx: PlanningContext, c) -> tuple[layouts.Layout | object, object]:
  """The cluster's layout, or the verdict that stops it (words, or the parts that run
  whole); and whether it is sharded over copies too (`layouts.assign_repeated`)."""
  layout, over_copies = layouts.assign_repeated(s.jaxpr, c, ctx, s.in_loop, s.in_names)
  if not c.eqns:
    layout = kept_whole(s.jaxpr, c)
  if isinstance(layout, layouts.Layout) and (mismatch := [
      v for v in c.reads if v in s.held and layout.formats.get(v) != s.held[v]]):
    layout = causes.LoopFormat(mismatch[0].aval.str_short())
  return layout, over_copies


def _decide(s: Scope, ctx: PlanningContext, acc: Planning, c, layout) -> _Decided:
  """Shard or not (`cost.decide`), with the state the cluster keeps sharded."""
  if not isinstance(layout, layouts.Layout):
    return _Decided(c, layouts.Layout({}, frozenset(), frozenset()),
                    cost.Decision(False, reasons.Reason(layout), 0, 0, 0), layout, {},
                    members=set(c.eqns))
  d = _Decided(c, layout, None, None, {},
               narrow={} if s.in_loop or ctx.shard_weights else None, members=set(c.eqns))
  weights = ctx.shard_weights and not s.in_loop
  through = frozenset()
  if weights:
    d.c, d.layout, through = kept_state.through_copies(c, layout, s.graph, s.state_pairs, ctx,
                                                       d.why_whole)
    d.members = set(d.c.eqns)
  d.pairs = kept_state.pairs(d.c, d.layout, s.graph, d.members, s.state_pairs, d.narrow,
                             d.gathers, d.why_whole if weights else None, through)
  narrow_gathers = tuple((x.aval.size, t.itemsize) for x, t in (d.narrow or {}).items())
  d.decision = cost.decide(d.c, d.layout, s.jaxpr, ctx.facts, ctx.axes, set(d.pairs),
                           ctx.num_shards, s.rare, objective=ctx.objective,
                           topology=ctx.topology,
                           extra_gather=() if s.in_loop else narrow_gathers,
                           sliced=_sliced(d.c, s, d.pairs), names=s.in_names)
  d.verdict = d.decision.why.verdict
  # A value the rewrite holds as shards has one format: a cluster that
  # needs another format of a value an earlier cluster shards stays whole.
  if d.decision.shard and (clash := next((v for v, f in d.layout.formats.items()
                                          if acc.formats.get(v, f) != f), None)) is not None:
    d.decision = dataclasses.replace(d.decision, shard=False)
    d.verdict = reasons.FormatClash(
        loops.outer_name(clash, s.invar_pos, s.in_names, clash.aval.str_short()))
    d.pairs = {}
  return d


def _notes(s: Scope, ctx: PlanningContext, d: _Decided, over_copies) -> list:
  """What the passes add to the cluster's verdict (`reasons`)."""
  c, shard, notes = d.c, d.decision.shard, []
  if shard and s.rare & set(c.nested):
    notes.append(reasons.RareConditionals(tuple(
        source_line(s.jaxpr.eqns[i]) for i in sorted(s.rare & set(c.nested)))))
  if shard and s.in_loop:
    notes.append(loops.placements(c, s.graph, d.members, s.state_pairs, d.pairs, d.narrow,
                                  s.in_names))
  elif shard and d.narrow:
    notes.append(reasons.KeptShardedWeights(tuple(
        reasons.Gather(s.in_names[s.invar_pos[x]], dtype.name, x.aval.size * dtype.itemsize,
                       x.aval.size * x.aval.dtype.itemsize, True)
        for x, dtype in d.narrow.items())))
  across = sorted({a for i in c.seeds for a in compat.collective_axes(s.jaxpr.eqns[i])}
                  - ctx.axes - set(over_copies.copy_axes if over_copies and over_copies.summed
                                   else ()))
  if across and shard:
    notes.append(reasons.PartialSharding(tuple(sorted(ctx.axes)), tuple(across)))
  if over_copies is not None and shard:
    notes.append(over_copies)
  if c.kept_whole and c.eqns:
    notes.append(kept_whole(s.jaxpr, c))
  return notes


def _propose(s: Scope, acc: Planning, d: _Decided, idx: int) -> None:
  """The reasons the cluster proposes for the inputs it reads (`InputReasons`)."""
  shard = d.decision.shard
  for v in d.c.reads:
    if v in s.invar_pos:
      k = s.invar_pos[v]
      if shard and d.narrow and v in d.narrow and not s.in_loop:
        acc.reasons.shard(k, reasons.NarrowWeight(idx, d.narrow[v].name))
      elif shard and k in d.pairs.values():
        acc.reasons.shard(k, reasons.OnlyCluster(idx))
      elif shard:
        acc.reasons.whole(k, reasons.SlicedLocally(idx))
      else:
        acc.reasons.whole(k, reasons.ClusterReplicated(idx))
  for k, why in d.why_whole.items():
    acc.reasons.note(k, idx, reasons.NotKeptByShardWeights(why))


def kept_whole(jaxpr: Jaxpr, c: clusters_lib.Cluster) -> reasons.KeptWhole:
  """Which equations of the update run whole, and the readers that make them."""
  parts = []
  for r in sorted(set(c.kept_whole.values())):
    whole = [i for i, reader in c.kept_whole.items() if reader == r]
    collectives = [i for i in whole if jaxpr.eqns[i].primitive in (compat.psum_p,
                                                                    compat.psum_invariant_p)]
    first = jaxpr.eqns[collectives[0] if collectives else max(whole)]
    parts.append(reasons.RunsWhole(causes.Eqn.of(first, source_line(first)), len(whole) - 1,
                                   causes.Eqn.of(jaxpr.eqns[r], source_line(jaxpr.eqns[r])),
                                   all_reduce=bool(collectives)))
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


def _sliced(c: clusters_lib.Cluster, s: Scope, pairs) -> list[str]:
  """What a cluster grown from roots reads by a local slice: its roots and the
  weights it reads (not the state it keeps sharded), named for the Plan."""
  if not c.roots:
    return []
  state = {s.jaxpr.invars[k] for k in pairs.values()}
  return [_value_name(v, s) for v in c.reads if v not in state]


def _value_name(v, s: Scope) -> str:
  """An input's pytree path, or the equation that computes `v`."""
  if v in (invar_pos := s.invar_pos):
    return s.in_names[invar_pos[v]]
  eqn = s.graph.producing(v)
  return f"{eqn.primitive} at {source_line(eqn)}"


def tensor_plans(c, s: Scope, pairs, fmt) -> tuple[TensorPlan, ...]:
  """The cluster's tensors for the Plan: gradients, roots, weights and state, outputs."""
  jaxpr, invar_pos = s.jaxpr, s.invar_pos

  def entry(name, v, role):
    return TensorPlan(name, tuple(v.aval.shape), v.aval.dtype.name, role, fmt(v),
                      v.aval.dtype.itemsize)

  state_positions = set(pairs.values())
  out = [entry(f"all-reduce at {source_line(jaxpr.eqns[i])}", jaxpr.eqns[i].outvars[0], "gradient")
         for i in c.seeds]
  # A cluster grown from roots reads them, and what they are computed from
  # whole, by a local slice.
  roots = [v for v in c.reads if v in c.roots or (c.roots and v not in invar_pos)]
  out += [entry(_value_name(v, s), v, "root") for v in roots]
  for v in c.reads:
    if v in invar_pos and v not in roots:
      k = invar_pos[v]
      out.append(entry(s.in_names[k], v, "state" if k in state_positions
                       else "root" if k in s.computed else "weight"))
  for v, positions in c.returned.items():
    for p in positions:
      if p not in pairs:
        out.append(entry(s.out_names[p], v, "output"))
  return tuple(out)
