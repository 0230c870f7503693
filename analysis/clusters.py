"""Weight-update clusters around the gradient all-reduces (§3.2, Fig. 5).

Starting from every all-reduce over the replica axes whose operand differs
across replicas (a gradient all-reduce), the cluster grows through equations
that are identical on every replica and can run on shards (`shardable`):
forward to the readers of sharded values, and backward to the producers of
values that only the cluster reads (so `0.9 * mu` is computed on the shard of
`mu`, not whole and then sliced). Values the cluster reads that come from
outside it (weights, optimizer state, hyperparameters) are inputs: big ones
are read as shards by a local slice, scalars and tiny ones whole.
Clusters connect only through big tensors, so each weight's update is usually
its own cluster.

An update that no all-reduce reaches grows from its roots instead: values
identical on every replica that it reads together with state of their shape
(a gradient AD formed from invariant values, or that the caller all-reduced
before the region: `jax.jit`'s gradients entering a shard_map with in_spec
P()). Its shard of a root is a local slice, no communication (`roots.find_roots`).
"""

from __future__ import annotations

import collections
import dataclasses

from wus.analysis import compat
from wus.analysis.compat import Jaxpr, Var
from wus.analysis.graph import Graph
from wus.analysis.redundancy import Redundancy
from wus.analysis.reduction_joins import read_member, reached_member
from wus.analysis.roots import beside, find_roots
from wus.analysis.shardable import REDUCING, Context, Kind, shard_kind


@dataclasses.dataclass(frozen=True)
class Cluster:
  """One weight-update cluster of a jaxpr (before the cost decision).

  Attributes:
    eqns: indices into `jaxpr.eqns` of the equations that run on shards, in order.
    kinds: the shard `Kind` of each equation in `eqns`.
    seeds: indices of its gradient all-reduces (operand differs across replicas).
    sharded: variables held as shards: the big outputs of `eqns` (and, in a
      conditional's branch, its big inputs).
    reads: big variables from outside the cluster that it reads as shards.
    outside_readers: for each sharded variable, the indices of equations outside
      the cluster that read it whole.
    returned: for each sharded variable that the jaxpr returns, the
      output positions.
    nested: for each conditional in `eqns`, one cluster per branch: the
      branch's equations that run on shards, its big inputs arriving as shards.
    kept_whole: equations of the update that run whole, as in the original
      step, because a repeated equation without a shard rule reads their
      results whole: index -> that reader's index. `eqns` read their results
      by a local slice.
    roots: the roots it grew from (`roots.find_roots`): values identical on every
      replica that it reads by a local slice (or computes on shards, where
      only it reads what they are computed from).
  """

  eqns: tuple[int, ...]
  kinds: dict[int, Kind]
  seeds: tuple[int, ...]
  sharded: tuple[Var, ...]
  reads: tuple[Var, ...]
  outside_readers: dict[Var, tuple[int, ...]]
  returned: dict[Var, tuple[int, ...]]
  nested: dict[int, tuple[Cluster, ...]] = dataclasses.field(default_factory=dict)
  kept_whole: dict[int, int] = dataclasses.field(default_factory=dict)
  roots: tuple[Var, ...] = ()


def find_clusters(jaxpr: Jaxpr, facts: Redundancy, axes: frozenset,
                  num_shards: int, min_size: int = 0, *,
                  inputs_sharded: bool = False, held_sharded=frozenset(),
                  roots=frozenset(), state=frozenset(), graph: Graph | None = None,
                  memo: dict | None = None, collectives: bool = True) -> list[Cluster]:
  """Finds the weight-update clusters of a flat (call-free) shard_map body.

  Args:
    jaxpr: the per-replica jaxpr, with calls inlined.
    facts: its redundancy analysis.
    axes: the replica mesh axes; a gradient all-reduce runs over exactly these.
    num_shards: replicas along `axes` (N).
    min_size: tensors with fewer elements (and at least N) stay whole.
    held_sharded: variables the rewrite already holds as shards (a loop's
      carries kept sharded, e.g. a gradient accumulated on shards, §4.2):
      their readers seed growth as the gradient all-reduces do.
    inputs_sharded: a conditional's branch: every big input arrives as a
      shard and seeds the growth, and everything found is one cluster.
    roots: values identical on every replica that an update reads whole and
      may slice locally (a front end's gradients that arrive all-reduced):
      their readers seed growth after the all-reduces' clusters are grown.
    state: the step's state inputs (those with a next value): the updates of
      the ones no all-reduce's cluster reads grow from their roots as well
      (`roots.find_roots`).
    graph: `jaxpr`'s graph for `num_shards` and `min_size`, if the caller has it.
    memo: a conditional's branch jaxpr -> its cluster, for these `facts`, `axes`,
      `num_shards` and `min_size` (the planner's memo): each branch is
      analysed once however many conditionals run it.
    collectives: whether the sums of the update join it (all-reduces over `axes` as
      reduce-scatters, `Kind.update` False); without, they run as written and the
      update reads their results by a local slice (`fsdp_blocks`: a block's sums run
      over other axes than its shards lie over).

  Returns:
    The clusters, in the order of their first equation (with
    `inputs_sharded`, exactly one, possibly empty).
  """
  graph = graph or Graph(jaxpr, num_shards, min_size)
  growth = _Growth(graph, facts, Context(facts, frozenset(axes)), collectives)
  seeds, all_reduces = _seeds(growth, held_sharded, inputs_sharded)
  growth.grow(list(seeds))
  growth.join_reductions()
  found_roots: frozenset = frozenset()
  if (roots or state) and not inputs_sharded:
    found_roots = growth.grow_from_roots(roots, state)
  if not inputs_sharded:
    growth.join_state_updates(state)
    growth.join_read_reductions(frozenset(state))
  # Outside a conditional's branch (whose whole reads are gathered inside it),
  # equations whose big results a repeated equation without a shard rule
  # reads whole (a matmul with the gradient, the pad of a BatchNorm
  # cotangent) run whole, as in the original step, with the cluster
  # equations they read; the rest of the cluster slices their results
  # locally. Only what can run on shards is sharded (§3.2).
  kept_whole = {} if inputs_sharded else _kept_whole(growth.parent, graph, facts, growth.axes)
  members, whole = growth.groups(kept_whole, inputs_sharded)
  memo = {} if memo is None else memo

  def branch(inner: Jaxpr) -> Cluster:
    if inner not in memo:
      memo[inner] = find_clusters(inner, facts, axes, num_shards, min_size, inputs_sharded=True,
                                  memo=memo, collectives=collectives)[0]
    return memo[inner]

  def branches(i: int) -> tuple[Cluster, ...]:
    return tuple(branch(b.jaxpr) for b in compat.cond(jaxpr.eqns[i]).branches)

  inputs = [v for v in jaxpr.invars if graph.big(v)] if inputs_sharded else []
  clusters = [_make_cluster(sorted(m), graph, growth.kind, all_reduces, branches, inputs,
                            whole.get(root, {}), found_roots)
              for root, m in members.items()]
  return sorted(clusters, key=lambda c: min(c.eqns + tuple(c.kept_whole), default=-1))


def _seeds(growth: _Growth, held_sharded, inputs_sharded: bool) -> tuple[list[int], set[int]]:
  """(where growth starts, the gradient all-reduces among them): the all-reduces; the
  readers of held shards; in a conditional's branch, of its big inputs, all one cluster."""
  graph, kind = growth.graph, growth.kind
  seeds = [i for i in range(len(graph.jaxpr.eqns)) if kind(i) is Kind.REDUCE_SCATTER]
  # Cluster.seeds are all-reduces; readers of held shards and of roots only
  # seed the growth.
  all_reduces = set(seeds)
  seeds += [r for v in held_sharded for r in graph.readers(v)
            if kind(r) is not None and r not in seeds]
  if inputs_sharded:
    seeds += [r for v in graph.jaxpr.invars if graph.big(v) for r in graph.readers(v)
              if kind(r) is not None and r not in seeds]
  for i in seeds:
    growth.parent[i] = i
  if inputs_sharded and seeds:
    for i in seeds:
      growth.union(i, seeds[0])
  return seeds, all_reduces


class _Growth:
  """The clusters of one jaxpr as they grow: a union-find over their equations (`parent`)
  and each equation's shard kind, computed once."""

  def __init__(self, graph: Graph, facts: Redundancy, ctx: Context, collectives: bool = True):
    self.graph, self.facts, self.ctx, self.axes = graph, facts, ctx, ctx.axes
    self.collectives = collectives
    self.parent: dict[int, int] = {}
    self._kinds: dict[int, Kind | None] = {}

  def kind(self, i: int) -> Kind | None:
    """The shard kind of equation i, if it is redundant, shardable and big.

    Big as its Kind says (`Kind.big_values`): a big output, or for a reduction
    a big operand, or for a conditional any big value.
    """
    if i not in self._kinds:
      eqn = self.graph.jaxpr.eqns[i]
      k = (shard_kind(eqn, self.ctx)
           if all(self.facts.is_redundant(v, self.axes) for v in eqn.outvars) else None)
      k = None if k is not None and not (self.collectives or k.update) else k
      self._kinds[i] = k if k is not None and any(map(self.graph.big, k.big_values(eqn))) else None
    return self._kinds[i]

  def find(self, i: int) -> int:
    parent = self.parent
    while parent[i] != i:
      parent[i] = parent[parent[i]]
      i = parent[i]
    return i

  def union(self, a: int, b: int) -> None:
    self.parent[self.find(a)] = self.find(b)

  def add(self, new: int, to: int) -> bool:
    """Puts `new` in the cluster of `to`; whether it is new to the clusters."""
    if new in self.parent:
      self.union(new, to)
      return False
    self.parent[new] = new
    self.union(new, to)
    return True

  def grow(self, todo: list[int], reductions: bool = True) -> None:
    """Grows the clusters from `todo`: forward to the readers of big outputs, backward to
    the producers of big operands only cluster equations read.

    Each equation is grown from once. A producer that fails the backward test
    passes it when the last of its readers joins, and is found from that one.
    Without `reductions`, growth does not go backward into a reduction (the
    bias gradient a root is computed from: it stays whole, as the original).
    """
    graph, kind, big = self.graph, self.kind, self.graph.big
    while todo:
      i = todo.pop()
      eqn = graph.jaxpr.eqns[i]
      for v in filter(big, eqn.outvars):
        for r in graph.readers(v):
          if kind(r) is not None and self.add(r, i):
            todo.append(r)
      for v in filter(big, eqn.invars):
        p = graph.producer.get(v)
        if (p is not None and kind(p) is not None and v not in graph.outputs
            and (reductions or kind(p) not in REDUCING)
            and graph.only_read_by(v, self.parent) and self.add(p, i)):
          todo.append(p)

  def join_reductions(self) -> None:
    """Reductions of big tensors that the update reads only through small values
    (LARS and LAMB's ‖w‖, §4.1): growth through big tensors misses them, so
    every replica would reduce the whole weight. Each joins the first cluster
    its result reaches, and grows backward from there (`w * w` on the shard)."""
    if self.parent:
      for i in range(len(self.graph.jaxpr.eqns)):
        if i not in self.parent and self.kind(i) in REDUCING:
          member = reached_member(i, self.graph, self.parent, self.facts, self.axes)
          if member is not None:
            self.add(i, member)
            self.grow([i])

  def join_read_reductions(self, state) -> None:
    """Reductions to small values of what a cluster computes or reads, that only equations
    outside the clusters read (a gradient norm returned as a metric), not of `state`:
    each joins the cluster it reads from and grows backward from there (`square(g)` on
    the shard), so the cluster's tensors stay sharded (`reduction_joins.read_member`)."""
    eqns = self.graph.jaxpr.eqns
    for i in range(len(eqns)):
      if (i not in self.parent and self.kind(i) in REDUCING
          and not any(map(self.graph.big, eqns[i].outvars))
          and (member := read_member(i, self.graph, self.parent, self.kind, state)) is not None):
        self.add(i, member)
        self.grow([i], reductions=False)

  def join_state_updates(self, state) -> None:
    """State a cluster reads whose next value other repeated equations compute without
    the cluster (SAM's cache, from the old weights): those equations join that cluster,
    so the state stays sharded rather than read whole by them."""
    for s in state:
      member = next((r for r in self.graph.readers(s) if r in self.parent), None)
      if member is None or not self.graph.big(s):
        continue
      new = beside(s, self.graph, self.kind, self.parent)
      for i in new:
        self.add(i, member)
      self.grow(list(new), reductions=False)

  def grow_from_roots(self, roots, state) -> frozenset:
    """Grows the updates no all-reduce reaches from their roots (`roots.find_roots`, and the
    given `roots`); returns the roots."""
    graph, kind, eqns = self.graph, self.kind, self.graph.jaxpr.eqns
    before = set(self.parent)
    found_roots = frozenset(roots) | find_roots(graph, self.facts, self.axes, state, before,
                                                kind)
    grown = [r for v in found_roots for r in graph.readers(v)
             if kind(r) is not None and r not in self.parent]
    for r in grown:
      self.add(r, r)
    # The update grows back to where its roots enter: through what only it
    # reads, short of reductions (a gradient's) and of `join_reductions`,
    # which would put the backward pass's sums on shards.
    self.grow(grown, reductions=False)
    # An update that reads a value computed whole from a cluster's result (the
    # scatter-add that builds an embedding table's gradient from the
    # all-reduced rows) joins that cluster: its all-reduce runs whole
    # (`_kept_whole`), the update after it on shards.
    for i in set(self.parent) - before:
      for v in filter(graph.big, eqns[i].invars):
        p = graph.producer.get(v)
        if p is not None and p not in self.parent:
          for u in filter(graph.big, eqns[p].invars):
            if graph.producer.get(u) in before:
              self.union(i, graph.producer[u])
    return found_roots

  def groups(self, kept_whole: dict[int, int], inputs_sharded: bool):
    """(cluster root -> its equations that run on shards, root -> its equations kept
    whole and their readers), in equation order."""
    members: dict[int, list[int]] = collections.defaultdict(list)
    whole: dict[int, dict[int, int]] = collections.defaultdict(dict)
    for i in sorted(self.parent):
      if i in kept_whole:
        whole[self.find(i)][i] = kept_whole[i]
      else:
        members[self.find(i)].append(i)
    for root in whole:
      members.setdefault(root, [])
    if inputs_sharded and not members:
      members[-1] = []
    return members, whole


def _kept_whole(members, graph: Graph, facts: Redundancy, axes: frozenset) -> dict[int, int]:
  """Cluster equations that must run whole: index -> the outside reader that forces it.

  An equation outside every cluster that every replica repeats (redundant,
  no effects) reads a cluster's big result whole: that result, and every
  cluster result it is computed from, is computed whole instead of sharded
  and gathered.
  """
  eqns, big = graph.jaxpr.eqns, graph.big
  todo = [(i, r) for i in members for v in filter(big, eqns[i].outvars)
          for r in graph.readers(v) if r not in members and facts.repeats(eqns[r], axes)]
  out: dict[int, int] = {}
  while todo:
    i, r = todo.pop()
    if i in out:
      continue
    out[i] = r
    for v in filter(big, graph.jaxpr.eqns[i].invars):
      p = graph.producer.get(v)
      if p in members and p not in out:
        todo.append((p, r))
  return out


def _make_cluster(idx: list[int], graph: Graph, kind, seeds: set[int], branches,
                  inputs: list[Var], kept_whole: dict[int, int], roots=frozenset()) -> Cluster:
  eqns, big = graph.jaxpr.eqns, graph.big
  inside = set(idx)
  sharded = inputs + [v for i in idx for v in eqns[i].outvars if big(v)]
  produced = set(sharded)
  reads: list[Var] = []
  for i in idx:
    for v in eqns[i].invars:
      if big(v) and v not in produced and v not in reads:
        reads.append(v)
  outside = {v: tuple(r for r in graph.readers(v) if r not in inside) for v in sharded}
  return Cluster(
      eqns=tuple(idx),
      kinds={i: kind(i) for i in idx},
      seeds=tuple(i for i in idx if i in seeds),
      sharded=tuple(sharded),
      reads=tuple(reads),
      outside_readers={v: r for v, r in outside.items() if r},
      returned={v: tuple(graph.outputs[v]) for v in sharded if v in graph.outputs},
      nested={i: branches(i) for i in idx if kind(i) is Kind.COND},
      kept_whole=dict(kept_whole),
      roots=tuple(v for v in _in_order(graph.jaxpr, roots)
                  if any(r in inside for r in graph.readers(v))),
  )


def _in_order(jaxpr: Jaxpr, vs) -> list[Var]:
  """`vs` (variables of `jaxpr`) in the order `jaxpr` defines them."""
  if not vs:
    return []
  return [v for v in [*jaxpr.invars, *(o for e in jaxpr.eqns for o in e.outvars)] if v in vs]


def gradient_axes(jaxpr: Jaxpr, state_shapes: set) -> frozenset | None:
  """The mesh axes of the gradient all-reduces: those of the all-reduces of
  values shaped like a state input, the axes that move the most bytes (or
  None if there are none). The default data-parallel axes of `wus.shard_map`."""
  moved: collections.Counter = collections.Counter()

  def visit(jaxpr):
    for eqn in jaxpr.eqns:
      if (eqn.primitive in (compat.psum_p, compat.psum_invariant_p)
          and not compat.has_axis_index_groups(eqn)):
        for v in eqn.invars:
          if tuple(v.aval.shape) in state_shapes:
            moved[frozenset(compat.collective_axes(eqn))] += v.aval.size * v.aval.dtype.itemsize
      for sub in compat.sub_jaxprs(eqn):
        visit(sub)

  visit(jaxpr)
  return max(moved, key=moved.__getitem__) if moved else None
