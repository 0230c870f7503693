"""transforms/schedule.py's `schedule` alone, on a per-replica jaxpr and hand-made shard
plans: the order that batches the update's collectives (§5.2; issue 31 item 7)."""

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from helpers import analysed_body, mesh
from wus.analysis import compat
from wus.analysis.graph import Graph
from wus.analysis.plan import JaxprPlan
from wus.analysis.shardable import Kind
from wus.transforms.schedule import schedule


def _step(w1, w2, x):
  """Two weights, each summed and updated (normalized by its gradient's norm) in turn, as
  Python writes it: the second sum after the first update."""
  loss = lambda w1, w2: jnp.sum(jnp.tanh(x @ w1 @ w2))
  g1, g2 = jax.grad(loss, argnums=(0, 1))(w1, w2)
  g1 = lax.psum(g1, "data")
  w1 = w1 - g1 / jnp.sum(g1 * g1)
  g2 = lax.psum(g2, "data")
  w2 = w2 - g2 / jnp.sum(g2 * g2)
  return w1, w2


def _jaxpr_and_plan():
  """The jaxpr, and a plan running both sums as reduce-scatters and both updates on shards
  (the norms' reductions partial: all-reduced)."""
  # Read as the analysis reads it, outside `jax_enable_checks` (which type-checks the body's
  # psums outside the mesh axes they name).
  with jax.enable_checks(False):
    jaxpr, _ = analysed_body(_step, (P(), P(), P("data")), ((8, 16), (16, 4), (2, 8)),
                             (P(), P()), mesh=mesh(), check_vma=False)
  sums = [i for i, e in enumerate(jaxpr.eqns) if e.primitive is lax.psum_p]
  kinds = {lax.psum_p: Kind.REDUCE_SCATTER, lax.reduce_sum_p: Kind.REDUCE_ALL}
  shard_eqns = {i: kinds.get(e.primitive, Kind.ELEMENTWISE)
                for i, e in enumerate(jaxpr.eqns) if i >= sums[0]}
  return jaxpr, JaxprPlan(shard_eqns, {}, {}), sums


def _respects_data_dependence(jaxpr, order) -> bool:
  at = {i: k for k, i in enumerate(order)}
  graph = Graph(jaxpr, 8)
  return all(at[graph.producer[v]] < at[i] for i, e in enumerate(jaxpr.eqns)
             for v in e.invars if not compat.is_literal(v) and v in graph.producer)


def test_every_gradient_sum_runs_before_the_update_reads_any():
  jaxpr, plan, sums = _jaxpr_and_plan()
  assert sums[1] > sums[0] + 1  # As traced, the first update runs between the sums.
  order = schedule(jaxpr, plan)
  assert sorted(order) == list(range(len(jaxpr.eqns)))
  assert _respects_data_dependence(jaxpr, order)
  update = [order.index(i) for i, k in plan.shard_eqns.items() if k.update]
  assert max(order.index(i) for i in sums) < min(update)


def test_the_reductions_of_one_phase_run_before_anything_reads_their_results():
  """Both norms (partial: one batched all-reduce) before either division reads one."""
  jaxpr, plan, _ = _jaxpr_and_plan()
  order = schedule(jaxpr, plan)
  norms = [i for i, e in enumerate(jaxpr.eqns) if e.primitive is lax.reduce_sum_p
           and i in plan.shard_eqns]
  assert len(norms) == 2
  readers = [i for i, e in enumerate(jaxpr.eqns)
             if any(v in e.invars for n in norms for v in jaxpr.eqns[n].outvars)]
  assert max(order.index(i) for i in norms) < min(order.index(i) for i in readers)


def test_with_nothing_on_shards_the_order_is_the_jaxpr_s():
  jaxpr, _, _ = _jaxpr_and_plan()
  assert schedule(jaxpr, JaxprPlan({}, {}, {})) == list(range(len(jaxpr.eqns)))


def test_owned_updates_run_together_last():
  """Equations marked owned (`transforms.owned` runs them in one switch) are consecutive,
  after every other equation of the update."""
  jaxpr, plan, sums = _jaxpr_and_plan()
  owned = {i: Kind.OWNED_SCATTER if i in sums else Kind.OWNED for i in plan.shard_eqns}
  order = schedule(jaxpr, JaxprPlan(owned, {}, {}))
  assert _respects_data_dependence(jaxpr, order)
  at = sorted(order.index(i) for i, k in owned.items() if k is Kind.OWNED)
  assert at == list(range(at[0], at[0] + len(at)))
  assert at[0] > max(order.index(i) for i in sums)
