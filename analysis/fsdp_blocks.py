"""Updates of FSDP blocks that copy axes repeat, sharded over those (DESIGN.md §1).

A weight the step places over the plan's own axes (FSDP: "fsdp" on a ("fsdp", "model")
mesh whose every batch axis holds blocks) has one block per replica of them: nothing
is repeated there, and no gradient all-reduce over them seeds a cluster (the gradient is
reduce-scattered to the block). Every replica of a copy axis ("model") may still repeat
the update of the same block (§3.1): its state is then sharded over those copy axes,
within each block. The update grows from its roots over the copy axes alone
(`clusters.find_clusters` with them as the replica axes and no collective joining it:
its sums run as written, over other axes than its shards, and it reads them by a local
slice); its formats name the copy axes (`ShardFormat.copy_axes`, `ShardFormat.blocks`),
so each replica keeps its part of its block and the new block is all-gathered over
them. A block whose update differs across a copy axis (split over it, or summed over it
on one path only) is not repeated there, and stays as the step places it.
"""

from __future__ import annotations

import dataclasses
import math

from wus.analysis import clusters as clusters_lib
from wus.analysis import network
from wus.analysis.graph import Graph
from wus.analysis.layouts import copy_axis_sets
from wus.analysis.plan_cluster import Planning, Scope, plan_cluster
from wus.analysis.planning import PlanningContext


def plan_blocks(s: Scope, ctx: PlanningContext, acc: Planning, clustered: set) -> None:
  """Plans into `acc` the updates of the step's state that differs across the plan's axes
  (`ctx.axes`: FSDP blocks) and that every replica of some copy axes (`ctx.copy_sizes`)
  repeats, over the most copy axes first (each set whole, as `layouts.assign_repeated`
  checks a cluster's). A cluster so found that stays replicated is not offered to
  ownership, whose owners are replicas of the plan's axes.

  Args:
    s: the step's scope (never a loop body's: a carry crosses its loop in one format).
    ctx: the planning's context.
    acc: the step's planning so far (its clusters planned).
    clustered: the equations of its clusters.
  """
  jaxpr, facts = s.jaxpr, ctx.facts
  taken = set(clustered) | set(acc.shard_eqns)
  blocks = [v for k in s.state_pairs.values() if k not in acc.sharded_in
            and not facts.is_redundant(v := jaxpr.invars[k], ctx.axes)]
  names = tuple(ctx.copy_sizes)
  for axes in copy_axis_sets(names):
    sub = _over(ctx, axes)
    graph = Graph(jaxpr, sub.num_shards, ctx.min_size)
    repeated = frozenset(v for v in blocks if facts.is_redundant(v, sub.axes)
                         and taken.isdisjoint(graph.readers(v)))
    if not repeated:
      continue
    sub = dataclasses.replace(sub, big=graph.big)
    found = [c for c in clusters_lib.find_clusters(
        jaxpr, facts, sub.axes, sub.num_shards, ctx.min_size, state=repeated, graph=graph,
        memo={}, collectives=False) if taken.isdisjoint((*c.eqns, *c.kept_whole))]
    scope = dataclasses.replace(s, graph=graph)
    grown = taken | {i for c in found for i in (*c.eqns, *c.kept_whole)}
    for c in found:
      offered = len(acc.candidates)
      plan_cluster(scope, sub, acc, c, grown)
      del acc.candidates[offered:]
    taken = grown


def _over(ctx: PlanningContext, axes: tuple) -> PlanningContext:
  """`ctx` for the update of blocks of `ctx.axes` sharded over the copy `axes`."""
  n = math.prod(ctx.copy_sizes[a] for a in axes)
  return dataclasses.replace(
      ctx, axes=frozenset(axes), num_shards=n, copy_sizes={a: ctx.copy_sizes[a] for a in axes},
      roots=frozenset(), topology=_topology(ctx.topology, n),
      block_axes=tuple(sorted(ctx.axes)), memo={})


def _topology(topology: network.Topology, n: int) -> network.Topology:
  """The cost model's devices of a block's n shards, for its predictions: a group of n
  consecutive devices of the plan's (the copy axes are a mesh's fast ones, "model"
  beside "fsdp"), or the platform's default ones where n cuts an axis unevenly."""
  try:
    return dataclasses.replace(topology, axes=topology.split(n)[0])
  except ValueError:
    return network.default_topology(n)
