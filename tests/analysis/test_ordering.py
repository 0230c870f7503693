"""analysis/ordering.py's `gather_after` alone, on a per-replica jaxpr and hand-made shard
plans: what the writes into donated buffers must follow (issue 31 item 7)."""

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from helpers import analysed_body, mesh
from wus.analysis import ordering
from wus.analysis.graph import Graph
from wus.analysis.shardable import Kind


def _step(w, x):
  """SGD on a weight the forward pass reads (a matmul) and a metric reads (its max)."""
  g = jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w)
  g = lax.psum(g, "data")
  return w - 0.1 * g, jnp.max(w)


def _jaxpr():
  jaxpr, _ = analysed_body(_step, (P(), P("data")), ((8, 16), (2, 8)), (P(), P()),
                           mesh=mesh(), check_vma=False)
  return jaxpr


def _at(jaxpr, prim) -> int:
  (i,) = [i for i, e in enumerate(jaxpr.eqns) if e.primitive is prim]
  return i


def _sharded_update(jaxpr):
  """The plan of the sharded step: the gradient psum reduce-scattered, the update on shards,
  the new weight all-gathered (in the formats, returned whole)."""
  psum = _at(jaxpr, lax.psum_p)
  shard_eqns = {psum: Kind.REDUCE_SCATTER, psum + 1: Kind.ELEMENTWISE,
                psum + 2: Kind.ELEMENTWISE}
  formats = {jaxpr.eqns[i].outvars[0]: "shards" for i in shard_eqns}
  return shard_eqns, formats


def _two_weights(w1, w2, x):
  """Two weights of one shape, each read only by its own loss term (and w1 by a metric)."""
  loss = lambda w1, w2: jnp.sum(jnp.tanh(x @ w1)) + jnp.sum(jnp.sin(x @ w2))
  g1, g2 = jax.grad(loss, argnums=(0, 1))(w1, w2)
  g1, g2 = lax.psum(g1, "data"), lax.psum(g2, "data")
  return w1 - 0.1 * g1, w2 - 0.1 * g2, jnp.max(w1)


def test_each_all_gather_follows_the_reads_of_the_buffers_it_may_take():
  """JAX pairs donated inputs with outputs of one shape in order, so the new w1 may take
  w1's or w2's buffer, the new w2 only w2's. The forward pass's read of w2 precedes its
  gradient sum but not the new w1: the new w1 follows that sum (not w1's own, which its
  read precedes anyway). The metric's max reads w1 with no sum after it: its result is a
  token the new w1 follows too (unless tokens are off). The new w2 follows nothing: every
  read of w2 precedes it (issue 42: no all-gather waits for every reduce-scatter)."""
  jaxpr, _ = analysed_body(_two_weights, (P(), P(), P("data")), ((8, 16), (8, 16), (2, 8)),
                           (P(), P(), P()), mesh=mesh(), check_vma=False)
  sums = [i for i, e in enumerate(jaxpr.eqns) if e.primitive is lax.psum_p]
  shard_eqns = {i: Kind.REDUCE_SCATTER if i in sums else Kind.ELEMENTWISE
                for i, e in enumerate(jaxpr.eqns)
                if i >= sums[0] and e.primitive is not lax.reduce_max_p}
  formats = {jaxpr.eqns[i].outvars[0]: "shards" for i in shard_eqns}
  graph = Graph(jaxpr, 8)
  g2 = next(jaxpr.eqns[i].outvars[0] for i in sums
            if jaxpr.eqns[i].invars[0] in _from(jaxpr, jaxpr.invars[1]))
  max_out = jaxpr.eqns[_at(jaxpr, lax.reduce_max_p)].outvars[0]
  values, tied = ordering.gather_after(graph, shard_eqns, formats, {})
  assert values == ((g2, max_out), (), ())
  assert tied == frozenset()  # The outputs in a donated buffer's shape are all-gathered.
  values, _ = ordering.gather_after(graph, shard_eqns, formats, {}, read_tokens=False)
  assert values == ((g2,), (), ())
  # An input that arrives as shards holds no whole output: the new w1 is free of w2's reads.
  values, _ = ordering.gather_after(graph, shard_eqns, formats, {}, sharded_in={1: "shards"})
  assert values == ((max_out,), (), ())


def _from(jaxpr, x) -> set:
  """The variables computed from `x`, itself included."""
  seen = {x}
  for e in jaxpr.eqns:
    if any(v in seen for v in e.invars if not hasattr(v, "val")):
      seen.update(e.outvars)
  return seen


def test_with_one_weight_its_reads_precede_its_write_but_a_metric_s():
  """One weight: the forward pass's read flows into its own new value, so the all-gather
  needs no reduce-scatter to follow; the max of the old weight does not, so only it is."""
  jaxpr = _jaxpr()
  max_out = jaxpr.eqns[_at(jaxpr, lax.reduce_max_p)].outvars[0]
  assert ordering.gather_after(Graph(jaxpr, 8), *_sharded_update(jaxpr), {}) == (
      ((max_out,), ()), frozenset())


def test_a_replicated_update_ties_its_output_to_the_reads_that_do_not_precede_it():
  """Nothing on shards: the new weight, computed whole by an elementwise `sub`, may take the
  donated weight's buffer; the max reads the old weight and does not precede the `sub`, so
  the output is tied to the max's result."""
  jaxpr = _jaxpr()
  max_out = jaxpr.eqns[_at(jaxpr, lax.reduce_max_p)].outvars[0]
  assert ordering.gather_after(Graph(jaxpr, 8), {}, {}, {}) == (((max_out,), ()), frozenset({0}))


def test_nothing_to_order_when_no_output_may_take_a_donated_buffer():
  """The new weight returned as shards (`sharded_out`) and a scalar metric: no output shares
  an input's shape and dtype, so nothing is ordered."""
  jaxpr = _jaxpr()
  shard_eqns, formats = _sharded_update(jaxpr)
  got = ordering.gather_after(Graph(jaxpr, 8), shard_eqns, formats, {0: "shards"})
  assert got == ((), frozenset())
