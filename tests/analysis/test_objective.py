"""The objective of the cluster decisions: memory (the default) or time, by the cost model (§3.2).

`costmodel.cluster_seconds` prices a cluster's collectives and update with the
alpha-beta model of `wus.analysis.costmodel`; `cost.decide(objective="time")` keeps a
cluster replicated where that prediction is slower, `objective="memory"`
shards it for the optimizer state it keeps sharded. The topologies below are
made up so that the answer is obvious.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import wus
from helpers import (PMAP_TX, analysed_body, assert_trees_equal, mesh, pmap_params, pmap_step,
                     pmap_xs, sharded_leaves, stack)
from wus.analysis import clusters, cost, costmodel, layouts, network, verdicts
from wus.analysis.graph import Graph
from wus.analysis.reasons import Reason

N = 8
AXES = frozenset({"data"})
R, X = P(), P("data")


def topology(bandwidth: float, memory_bandwidth: float) -> network.Topology:
  return network.Topology((network.Axis("x", N, 1e-3, bandwidth),), memory_bandwidth)


SLOW_LINKS = topology(bandwidth=1e9, memory_bandwidth=1e12)  # Gathers are dear.
SLOW_MEMORY = topology(bandwidth=1e12, memory_bandwidth=1e9)  # The update is dear.


def test_predict_by_hand():
  """Ring all-reduce of D over 8 at B: 2 * 7/8 D / B; reduce-scatter and
  all-gather 7/8 D / B each; the update io / M, sharded io / (8 M); latency
  (alpha 1 ms here) is left out."""
  t = topology(bandwidth=1e9, memory_bandwidth=2e9)
  # 8000 B of gradients, 16000 B gathered, 40000 B read and written by the update.
  w = costmodel.Workload(((2000, 4),), ((2000, 4), (2000, 4)), ((5000, 4), (5000, 4)))
  replicated, sharded = costmodel.cluster_seconds(w, t)
  assert replicated == pytest.approx(2 * 7 / 8 * 8000 / 1e9 + 40000 / 2e9)
  assert sharded == pytest.approx(7 / 8 * 8000 / 1e9 + 7 / 8 * 16000 / 1e9 + 5000 / 2e9)


def ema_target(w, m, target, x):
  """Momentum SGD with an EMA of the weights (a BYOL-style target network):
  the new weight and the target are both returned whole, so sharding gathers
  two tensors where the all-reduce it replaces moved one."""
  g = lax.pmean(x * 2.0, "data")
  m = 0.9 * m + g
  w = w - 0.1 * m
  return w, m, 0.99 * target + 0.01 * w


def _decide(objective, t):
  jaxpr, facts = analysed_body(ema_target, [R, R, R, X], [(4000,)] * 4, (R, R, R), mesh=mesh(N))
  (c,) = clusters.find_clusters(jaxpr, facts, AXES, N)
  layout = layouts.assign(jaxpr, c, N, Graph(jaxpr, N).big)
  return cost.decide(c, layout, jaxpr, facts, AXES, {1}, N, objective=objective, topology=t)


def test_memory_objective_shards_for_the_state_whatever_the_links_cost():
  for t in (SLOW_LINKS, SLOW_MEMORY):
    d = _decide("memory", t)
    # 32000 B gathered against the 16000 + 16000 / 8 B the reduce-scatter leaves room for.
    assert d.shard and d.why == Reason(verdicts.KeepsStateSharded(14000))
    assert d.all_gather_bytes == 2 * d.all_reduce_bytes == 32000


def test_time_objective_refuses_an_extra_gather_on_slow_links():
  d = _decide("time", SLOW_LINKS)
  assert not d.shard and d.sharded_seconds > d.replicated_seconds
  assert d.why == Reason(verdicts.SlowerSharded(d.sharded_seconds, d.replicated_seconds))


def test_time_objective_takes_it_when_the_update_dominates():
  d = _decide("time", SLOW_MEMORY)
  assert d.shard and d.sharded_seconds < d.replicated_seconds


def test_bad_objective_and_topology_are_refused():
  with pytest.raises(ValueError, match="objective='speed'"):
    _decide("speed", SLOW_LINKS)
  with pytest.raises(ValueError, match="4 devices"):
    _decide("time", network.default_topology(4))


# --- Through wus.shard_map and wus.pmap. ---------------------------------------

TX = optax.sgd(0.1, momentum=0.9)


def byol_step(params, opt_state, target, x):
  """A BYOL-style step: the forward pass reads an EMA target network, so the
  new target is gathered every step beside the new weights."""
  want = jnp.tanh(x @ target["w"] + target["b"])
  loss = lambda p: jnp.mean((jnp.tanh(x @ p["w"] + p["b"]) - want) ** 2)
  grads = lax.pmean(jax.grad(loss)(params), "data")
  updates, opt_state = TX.update(grads, opt_state, params)
  params = optax.apply_updates(params, updates)
  target = jax.tree.map(lambda t, w: 0.99 * t + 0.01 * w, target, params)
  return params, opt_state, target


def _byol(objective, **kw):
  m = mesh(N)
  params = {"w": 0.1 * jax.random.normal(jax.random.key(0), (16, 96)), "b": jnp.zeros(96)}
  args = (params, TX.init(params), params)
  x = jax.device_put(jax.random.normal(jax.random.key(1), (2 * N, 16)), NamedSharding(m, X))
  specs = dict(mesh=m, in_specs=(R, R, R, X), out_specs=(R, R, R))
  ref = jax.jit(jax.shard_map(byol_step, **specs))(*args, x)
  ws = wus.shard_map(byol_step, objective=objective, **specs, **kw)
  got = ws(*args, x)
  assert_trees_equal(ref, wus.unshard(got))  # Elementwise update: bit for bit either way.
  return ws.plan(*args, x), got


def test_memory_objective_keeps_the_momentum_sharded_at_the_cost_of_a_gather():
  plan, got = _byol("memory")
  assert len(sharded_leaves(got[1])) == 2 and all(c.sharded for c in plan.clusters)
  assert all(isinstance(c.why.verdict, verdicts.KeepsStateSharded) for c in plan.clusters)
  assert plan.objective == "memory"


def test_time_objective_keeps_it_replicated_where_predicted_slower():
  """Accelerator-class devices (`network.ACCELERATOR`): links 50 GB/s, memory 1 TB/s:
  the second gather costs more than the 7/8 of the update it saves."""
  plan, got = _byol("time", topology=network.default_topology(N, platform="tpu"))
  assert not sharded_leaves(got[1]) and not any(c.sharded for c in plan.clusters)
  assert all(c.sharded_seconds > c.replicated_seconds for c in plan.clusters)
  assert all(isinstance(c.why.verdict, verdicts.SlowerSharded) for c in plan.clusters)


def test_time_objective_shards_when_the_update_dominates():
  plan, got = _byol("time", topology=topology(bandwidth=1e15, memory_bandwidth=1e9))
  assert len(sharded_leaves(got[1])) == 2 and all(c.sharded for c in plan.clusters)


def test_bad_objective_or_topology_raises_a_clear_error():
  with pytest.raises(ValueError, match="objective='fast'.*memory"):
    wus.shard_map(byol_step, mesh=mesh(N), in_specs=(R, R, R, X), out_specs=(R, R, R),
                  objective="fast")
  with pytest.raises(ValueError, match="objective='fast'"):
    wus.pmap(byol_step, axis_name="data", objective="fast")
  with pytest.raises(ValueError, match="topology= describes 4 devices.*sharded over 8"):
    _byol("time", topology=network.default_topology(4))


def test_pmap_passes_the_objective_and_topology_on():
  params = pmap_params()
  args = (stack(params), stack(PMAP_TX.init(params)), pmap_xs(1)[0])
  fast_memory = topology(bandwidth=1e9, memory_bandwidth=1e15)
  plan = wus.pmap(pmap_step, axis_name="batch", objective="time", topology=fast_memory).plan(*args)
  assert plan.objective == "time"
  assert all(c.sharded_seconds and c.replicated_seconds for c in plan.clusters)
