"""The planner's stages on one jaxpr, each called alone (issue 31 item 2): the clusters
found (`_find_clusters`), one cluster planned (`plan_cluster.plan_cluster`), the state a
reader with no shard rule keeps whole (`_whole_readers`), the state kept sharded after
the clusters (`_keep_state`), and the reasons they propose (`input_reasons`).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from helpers import analysed_body, mesh
from wus.analysis import network, planner, reasons
from wus.analysis.formats import ShardFormat
from wus.analysis.graph import Graph
from wus.analysis.plan_cluster import Planning, Scope, plan_cluster
from wus.analysis.planning import PlanningContext
from wus.analysis.shardable import Kind

N = 8


def _momentum(w, m, p0, x):
  """Momentum SGD; p0 (prodigy's params0) returned unchanged, read by nothing."""
  g = lax.pmean(jnp.cos(w) * x.mean(), "data")
  m = 0.9 * m + g
  return w - 0.1 * m, m, p0


def _sorted_momentum(w, m, p0, x):
  g = lax.pmean(jnp.cos(w) * x.mean(), "data")
  m = 0.9 * jnp.sort(m) + g
  return w - 0.1 * m, m, p0


def _scope(step):
  jaxpr, facts = analysed_body(step, [P(), P(), P(), P("data")], [(64,)] * 3 + [(1, 4)],
                               (P(), P(), P()), mesh=mesh(N))
  graph = Graph(jaxpr, N)
  ctx = PlanningContext(facts, frozenset({"data"}), N, 0, graph.big, "memory",
                        network.default_topology(N))
  return Scope(graph, {0: 0, 1: 1, 2: 2}, ["w", "m", "p0", "x"], ["w", "m", "p0"]), ctx


def test_find_clusters_finds_the_update_around_the_gradient_all_reduce():
  scope, ctx = _scope(_momentum)
  (c,) = planner._find_clusters(scope, ctx, Planning())
  w, m, p0, _ = scope.jaxpr.invars
  assert len(c.seeds) == 1 and {w, m} <= set(c.reads) and p0 not in c.reads
  assert sorted(p for ps in c.returned.values() for p in ps) == [0, 1]


def test_plan_cluster_shards_the_update_and_keeps_m_sharded():
  scope, ctx = _scope(_momentum)
  acc = Planning()
  (c,) = planner._find_clusters(scope, ctx, acc)
  plan_cluster(scope, ctx, acc, c, set(c.eqns))
  (cluster,) = acc.cluster_plans
  assert cluster.sharded and cluster.index == 0
  assert acc.sharded_in == {1: ShardFormat((64,), (64,), N)} and set(acc.sharded_out) == {1}
  assert acc.reasons.picked() == {0: (False, reasons.SlicedLocally(0)),
                                  1: (True, reasons.OnlyCluster(0))}
  assert set(acc.shard_eqns.values()) <= set(Kind) and not acc.candidates


def test_whole_readers_name_the_sort_that_keeps_m_whole():
  scope, ctx = _scope(_sorted_momentum)
  acc = Planning()
  found = planner._find_clusters(scope, ctx, acc)
  planner._whole_readers(scope, ctx, acc, found, {i for c in found for i in c.eqns})
  sharded, why = acc.reasons.pick(1)
  assert not sharded and isinstance(why, reasons.NoShardRule) and why.reader.primitive == "sort"


def test_keep_state_keeps_the_passed_through_state_sharded():
  scope, ctx = _scope(_momentum)
  acc = Planning()
  planner._keep_state(scope, ctx, acc)
  assert acc.reasons.picked() == {2: (True, reasons.PassedThrough())}
  assert acc.sharded_in == {2: ShardFormat((64,), (64,), N)} == acc.sharded_out
