"""Updates with an equation the shard rules cannot run on shards: that part runs whole,
as in the original step; the rest of the update, and its optimizer state, still shards;
the Plan names the equation (DESIGN.md §4, invariant 2)."""

import jax.numpy as jnp
import optax
import pytest

import wus
from helpers import SPECS, assert_trees_equal, both, first_args, make_params, make_step, mesh
from wus.analysis import reasons

SHAPES = {"big": (64, 33), "conv": (3, 3, 5, 7), "v": (130,)}  # None a multiple of 6 or 8.
STATE, WEIGHT = "opt_state[1][0].trace['big']", "params['big']"  # Momentum of `big`, `big`.


def _on_big(update):
  """A stateless transformation applying `update(g, w)` to `big`'s gradient, then momentum."""
  def update_fn(grads, state, params):
    return {k: update(g, params[k]) if k == "big" else g for k, g in grads.items()}, state
  return optax.chain(optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn),
                     optax.sgd(0.1, momentum=0.9))


CASES = [
    # reduce_prod has no shard rule (no all-reduce combines partial products),
    # but `g / prod` still reads g, so the momentum after it grows from the
    # gradient and shards. The product is a reduction: in a differently fused
    # program XLA may order it differently, so the result is equal up to rounding.
    pytest.param(lambda: _on_big(lambda g, w: g / jnp.prod(1 + 1e-3 * g)), "reduce_prod",
                 dict(rtol=1e-6, atol=1e-7), True, id="reduce_prod"),
    # A Shampoo-like preconditioner, a matmul with the weight, before momentum:
    # the momentum reads only the matmul's result, which no all-reduce's growth
    # reaches. That result, identical on every replica, is the momentum's root:
    # sliced locally (`roots.find_roots`), so the momentum still shards.
    pytest.param(lambda: _on_big(lambda g, w: g @ (w.T @ w)), "dot_general", {}, True,
                 id="matmul"),
]


@pytest.mark.parametrize("make_tx,why,tol,momentum_sharded", CASES)
def test_update_with_an_unshardable_equation_is_exact_at_six_replicas(make_tx, why, tol,
                                                                     momentum_sharded):
  """The gradient all-reduce and the unshardable equation run whole, as in the
  original step; what the gradient still reaches runs on shards."""
  ref, got, step = both(make_tx(), mesh(6), params=make_params(SHAPES))
  assert_trees_equal(ref[0], got[0], **tol)
  assert_trees_equal(ref[1], wus.unshard(got[1]), **tol)
  assert isinstance(got[1][1][0].trace["big"], wus.ShardedArray) == momentum_sharded
  assert isinstance(got[1][1][0].trace["conv"], wus.ShardedArray)  # The rest shards.


@pytest.mark.parametrize("make_tx,why,tol,momentum_sharded", CASES)
def test_plan_names_the_equation_that_runs_whole(make_tx, why, tol, momentum_sharded):
  """The Plan: `big`'s cluster names the primitive that made its all-reduce run whole
  (`reasons.RunsWhole`); its momentum is kept sharded or whole accordingly, for that
  cluster, and its tensors are listed with the cluster."""
  tx = make_tx()
  step = wus.shard_map(make_step(tx), mesh=mesh(8), **SPECS)
  plan = step.plan(*first_args(tx, mesh(8), params=make_params(SHAPES)))
  (state,) = [i for i in plan.inputs if i.name == STATE]
  assert state.sharded == momentum_sharded
  kind = reasons.OnlyCluster if momentum_sharded else reasons.ClusterReplicated
  assert isinstance(state.why.verdict, kind) and not state.why.notes, state.why
  c = plan.clusters[state.why.verdict.index]
  assert c.sharded == momentum_sharded
  (kept,) = [x for x in (c.why.verdict, *c.why.notes) if isinstance(x, reasons.KeptWhole)]
  (part,) = kept.parts
  assert part.all_reduce and part.reader.primitive == why, c.why
  assert {STATE, WEIGHT} <= {t.name for t in c.tensors}
