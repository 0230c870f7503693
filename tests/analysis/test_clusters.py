"""Unit tests of `wus.analysis.clusters` (DESIGN.md §3, Clusters; paper §3.2, Fig. 5).

Each step computes a gradient that differs per replica from its batch `x`
(`x * 2`), all-reduces it with `pmean` (under check_vma: `psum_invariant`,
then `div` by N) and updates replicated state with it; the tests look at
which equations of the per-replica jaxpr each cluster holds.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from helpers import analysed_body, mesh
from wus.analysis import compat, clusters
from wus.analysis.shardable import Kind

N = 8
AXES = frozenset({"data"})
R, X = P(), P("data")  # A replicated input (weights, state); a per-replica batch.


def find(f, in_specs, shapes, out_specs, *, min_size=0):
  jaxpr, facts = analysed_body(f, in_specs, shapes, out_specs, mesh=mesh(N))
  return jaxpr, clusters.find_clusters(jaxpr, facts, AXES, N, min_size)


def index(jaxpr, prim, nth=0) -> int:
  """The index of the nth equation of `jaxpr` that binds `prim`."""
  return [i for i, e in enumerate(jaxpr.eqns) if e.primitive is prim][nth]


def momentum(w, m, x):
  g = lax.pmean(x * 2.0, "data")
  m = 0.9 * m + g
  return w - 0.1 * m, m


def test_cluster_holds_the_update_downstream_of_its_seed_all_reduce():
  jaxpr, (c,) = find(momentum, [R, R, X], [(64,)] * 3, (R, R))
  seed = index(jaxpr, compat.psum_invariant_p)
  assert c.seeds == (seed,) and c.kinds[seed] is Kind.REDUCE_SCATTER
  # Everything after the all-reduce (div by N, the momentum, the weight), and
  # nothing before it: the local gradient `x * 2` differs across replicas.
  assert c.eqns == tuple(range(seed, len(jaxpr.eqns)))
  assert all(c.kinds[i] is Kind.ELEMENTWISE for i in c.eqns if i != seed)
  w, m, x = jaxpr.invars
  assert {w, m} <= set(c.reads) and x not in c.reads
  assert jaxpr.eqns[seed].invars[0] in c.reads  # The local gradient, reduce-scattered.
  assert set(c.sharded) == {v for i in c.eqns for v in jaxpr.eqns[i].outvars}
  assert c.returned == {jaxpr.outvars[0]: (0,), jaxpr.outvars[1]: (1,)}
  assert c.outside_readers == {} and c.kept_whole == {} and c.nested == {}


def test_elementwise_chain_of_several_state_tensors_is_one_cluster_per_weight():
  def adam(w, m, v, b, x, y):
    g, gb = lax.pmean(x * 2.0, "data"), lax.pmean(y * 3.0, "data")
    m = 0.9 * m + 0.1 * g
    v = 0.99 * v + 0.01 * g * g
    return w - 0.1 * m / (jnp.sqrt(v) + 1e-8), m, v, b - gb

  jaxpr, found = find(adam, [R, R, R, R, X, X], [(64,)] * 3 + [(40,), (64,), (40,)], (R,) * 4)
  w, m, v, b, _, _ = jaxpr.invars
  assert len(found) == 2
  first, second = found
  # w, m and v meet in elementwise operations: one cluster, one seed.
  assert first.seeds == (index(jaxpr, compat.psum_invariant_p, 0),)
  assert {w, m, v} <= set(first.reads) and b not in first.reads
  assert sorted(p for ps in first.returned.values() for p in ps) == [0, 1, 2]
  # The other weight's update meets them nowhere: its own cluster.
  assert second.seeds == (index(jaxpr, compat.psum_invariant_p, 1),)
  assert b in second.reads and not {w, m, v} & set(second.reads)
  assert list(second.returned.values()) == [(3,)]
  assert not set(first.eqns) & set(second.eqns)


def test_matmul_reading_the_gradient_stops_growth_and_records_the_reader():
  """g @ w has no shard rule and every replica repeats it: the all-reduce and
  `div` it reads run whole (kept_whole names the matmul), the momentum that
  also reads g still runs on shards (sliced locally), and nothing past the
  matmul joins."""
  def preconditioned(w, m, x):
    g = lax.pmean(x * 2.0, "data")
    return w - 0.1 * (g @ w), 0.9 * m + g

  jaxpr, (c,) = find(preconditioned, [R, R, X], [(16, 16)] * 3, (R, R))
  seed, dot = index(jaxpr, compat.psum_invariant_p), index(jaxpr, lax.dot_general_p)
  assert c.kept_whole == {seed: dot, seed + 1: dot}
  assert c.seeds == () and seed not in c.eqns and dot not in c.eqns
  assert all(i > dot for i in c.eqns)  # No equation after the matmul joins...
  momentum_out = jaxpr.outvars[1]
  assert c.returned == {momentum_out: (1,)}  # ... except the momentum's.
  assert jaxpr.outvars[0] not in c.sharded


def test_momentum_read_by_a_matmul_keeps_its_whole_update_whole():
  def preconditioned(w, m, pc, x):
    g = lax.pmean(x * 2.0, "data")
    m = 0.9 * m + g
    return w - 0.1 * (m @ pc), m

  jaxpr, (c,) = find(preconditioned, [R, R, R, X], [(16, 16)] * 4, (R, R))
  seed, dot = index(jaxpr, compat.psum_invariant_p), index(jaxpr, lax.dot_general_p)
  assert c.eqns == () and c.kept_whole == {i: dot for i in range(seed, dot)}


def test_norm_of_the_weight_joins_the_cluster_on_shards():
  """LARS's ‖w‖: the update reads it only through a scalar, so growth through
  big tensors misses it; it joins with the `w * w` it reduces."""
  def lars(w, x):
    g = lax.pmean(x * 2.0, "data")
    return (w - 0.1 * jnp.sqrt(jnp.sum(w * w)) * g,)

  jaxpr, (c,) = find(lars, [R, X], [(64,)] * 2, (R,))
  reduce = index(jaxpr, lax.reduce_sum_p)
  assert c.kinds[reduce] is Kind.REDUCE_ALL
  square = reduce - 1
  assert jaxpr.eqns[square].primitive is lax.mul_p and square in c.eqns
  # The scalar sqrt and scaling run whole, on every replica.
  sqrt = index(jaxpr, lax.sqrt_p)
  assert sqrt not in c.eqns and sqrt + 1 not in c.eqns


def test_value_read_by_computation_that_differs_is_an_outside_reader():
  def step(w, x):
    g = lax.pmean(x * 2.0, "data")
    return w - 0.1 * g, x * g

  jaxpr, (c,) = find(step, [R, X], [(64,)] * 2, (R, X))
  reader = len(jaxpr.eqns) - 1  # x * g, the last equation: differs across replicas.
  assert reader not in c.eqns
  ((v, readers),) = c.outside_readers.items()
  assert readers == (reader,) and v in jaxpr.eqns[reader].invars and v in c.sharded


def test_all_reduce_of_a_value_already_equal_everywhere_is_not_a_seed():
  def step(w):
    return (lax.psum(w, "data") * 0.5,)

  jaxpr, found = find(step, [R], [(64,)], (R,))
  assert compat.psum_invariant_p in {e.primitive for e in jaxpr.eqns} and found == []


def test_gradients_of_at_most_n_elements_or_below_min_size_seed_nothing():
  def step(w, x):
    return (w - 0.1 * lax.pmean(x * 2.0, "data"),)

  assert find(step, [R, X], [(N,)] * 2, (R,))[1] == []
  assert len(find(step, [R, X], [(N + 1,)] * 2, (R,))[1]) == 1
  assert find(step, [R, X], [(64,)] * 2, (R,), min_size=65)[1] == []
  assert len(find(step, [R, X], [(64,)] * 2, (R,), min_size=64)[1]) == 1


def test_producer_read_outside_the_update_stays_out_of_the_cluster():
  """Backward growth takes a producer only when the cluster alone reads it:
  sin(w), also read by computation that differs across replicas, runs whole
  and the update slices it."""
  def step(w, x):
    g = lax.pmean(x * 2.0, "data")
    h = jnp.sin(w)
    return w - 0.1 * g * h, x * h

  jaxpr, (c,) = find(step, [R, X], [(64,)] * 2, (R, X))
  sin = index(jaxpr, lax.sin_p)
  (h,) = jaxpr.eqns[sin].outvars
  assert sin not in c.eqns and h in c.reads and h not in c.sharded
  assert c.outside_readers == {}
