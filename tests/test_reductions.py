"""Updates the shard rules cannot run on shards: replicated, exact, and named in the Plan
(DESIGN.md §4, invariant 2; issue 3: "the Plan names every tensor kept replicated and why")."""

import re

import jax.numpy as jnp
import optax
import pytest

import wus
from helpers import SPECS, assert_trees_equal, both, first_args, make_params, make_step, mesh

SHAPES = {"big": (64, 33), "conv": (3, 3, 5, 7), "v": (130,)}  # None a multiple of 6 or 8.
STATE, WEIGHT = "[1][1][0].trace['big']", "[0]['big']"  # Momentum of `big`, and `big`.


def _on_big(update):
  """A stateless transformation applying `update(g, w)` to `big`'s gradient, then momentum."""
  def update_fn(grads, state, params):
    return {k: update(g, params[k]) if k == "big" else g for k, g in grads.items()}, state
  return optax.chain(optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn),
                     optax.sgd(0.1, momentum=0.9))


CASES = [
    # reduce_prod has no shard rule (no all-reduce combines partial products):
    # the cluster around it stays whole.
    pytest.param(lambda: _on_big(lambda g, w: g / jnp.prod(1 + 1e-3 * g)), "reduce_prod",
                 id="reduce_prod"),
    # A Shampoo-like preconditioner, a matmul with the weight, before momentum.
    pytest.param(lambda: _on_big(lambda g, w: g @ (w.T @ w)), "dot_general", id="matmul"),
]


@pytest.mark.parametrize("make_tx,why", CASES)
def test_update_without_shard_rule_is_exact_at_six_replicas(make_tx, why):
  ref, got, step = both(make_tx(), mesh(6), params=make_params(SHAPES))
  assert_trees_equal(ref[0], got[0])
  assert_trees_equal(ref[1], wus.unshard(got[1]))
  assert not isinstance(got[1][1][0].trace["big"], wus.ShardedArray)
  assert isinstance(got[1][1][0].trace["conv"], wus.ShardedArray)  # The rest still shards.


@pytest.mark.parametrize("make_tx,why", CASES)
def test_plan_names_each_tensor_kept_whole_and_the_primitive_why(make_tx, why):
  """The printed Plan: the replicated cluster's line gives the primitive, its
  lines list `big` and its momentum, and their input lines point at it."""
  tx = make_tx()
  step = wus.shard_map(make_step(tx), mesh=mesh(8), **SPECS)
  text = str(step.plan(*first_args(tx, mesh(8), params=make_params(SHAPES))))
  inputs = dict(re.findall(r"^    (\S+) +\[[\d, ]*\] +\w+ +(.*)$", text, re.M))
  assert inputs[STATE].startswith("whole: cluster "), text
  k = re.match(r"whole: cluster (\d+) stays replicated", inputs[STATE]).group(1)
  assert inputs[WEIGHT] == f"whole: cluster {k} stays replicated"
  block = re.search(rf"^cluster {k}: replicated: (.*)\n((?:    .*\n)+)", text, re.M)
  assert why in block.group(1) and "has no shard rule" in block.group(1)
  names = re.findall(r"^    \w+ +(\S+)", block.group(2), re.M)
  assert STATE in names and WEIGHT in names

