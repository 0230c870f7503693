"""The Plan names every cluster's tensors and decision; unsupported updates stay replicated."""

import jax
import optax
import pytest

import wus
from helpers import assert_trees_equal, batches, both, make_params


def _mesh():
  return jax.make_mesh((8,), ("data",))


def _plan(step, tx):
  params = make_params()
  (b,) = batches(_mesh(), 1)
  return step.plan(params, tx.init(params), {"counter": jax.numpy.zeros(16, "int32")}, b)


def test_adam_plan_lists_every_state_tensor():
  _, _, step = both(optax.adam(1e-2), _mesh(), steps=1)
  plan = _plan(step, optax.adam(1e-2))
  text = str(plan)
  for k in ("big", "conv", "bias", "half"):
    assert f"[1][0].mu['{k}']" in text and f"[1][0].nu['{k}']" in text
  assert "SHARDED" in text and "scalar or tiny" in text
  whole, shard = plan.state_bytes
  assert 0 < shard * 8 - whole < 8 * 8 * 4 * 8  # Padding is less than N rows per tensor.


REDUCING = [
    ("lars", lambda: optax.lars(0.1)),
    ("lamb", lambda: optax.lamb(1e-2)),
    ("clip_adam", lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))),
    ("adafactor", lambda: optax.adafactor(1e-2)),
    ("agc", lambda: optax.chain(optax.adaptive_grad_clip(0.1), optax.sgd(0.1))),
    ("trust_ratio", lambda: optax.chain(optax.scale_by_adam(), optax.scale_by_trust_ratio(),
                                        optax.scale(-1e-2))),
]


@pytest.mark.parametrize("name,make_tx", REDUCING, ids=[n for n, _ in REDUCING])
def test_norms_run_on_shards_within_summation_order(name, make_tx):
  """Norms: masked local sums, combined by one all-reduce per phase (§4.1, Fig. 6)."""
  ref, got, step = both(make_tx(), _mesh())
  assert_trees_equal(ref[0], got[0], rtol=2e-6, atol=1e-7)
  assert_trees_equal(ref[1], wus.unshard(got[1]), rtol=2e-6, atol=1e-7)
  plan = _plan(step, make_tx())
  big = [c for c in plan.clusters if any(t.shape == (1024, 1024) for t in c.tensors)]
  assert big and all(c.sharded and "reduction" in c.reason for c in big)


def _transform(update):
  """A stateless optax transformation applying `update` to every gradient leaf."""
  return optax.chain(optax.GradientTransformation(
      lambda params: optax.EmptyState(),
      lambda grads, state, params=None: (jax.tree.map(update, grads), state)), optax.sgd(0.1))


UNSHARDABLE = [
    ("reduce_prod", lambda: _transform(lambda g: g / jax.numpy.prod(1 + 1e-3 * g)),
     "reduce_prod"),
    ("regroup", lambda: _transform(
        lambda g: g + jax.numpy.sum(g.reshape(512, 2048), axis=0).mean() if g.shape == (1024, 1024)
        else g), "reshape"),
    ("muon", lambda: optax.contrib.muon(1e-2), "scan"),  # Newton-Schulz matmuls in a loop.
]


@pytest.mark.parametrize("name,make_tx,why", UNSHARDABLE, ids=[n for n, _, _ in UNSHARDABLE])
def test_update_the_rules_cannot_shard_stays_replicated_and_exact(name, make_tx, why):
  """A reduction with no exact shard rule, a reshape that regroups reduced dims,
  matmuls on the weight (Muon): those clusters stay replicated, with the reason."""
  ref, got, step = both(make_tx(), _mesh())
  assert_trees_equal(ref[0]["big"], got[0]["big"])  # Replicated: bit for bit.
  plan = _plan(step, make_tx())
  big = [c for c in plan.clusters if any(t.shape == (1024, 1024) for t in c.tensors)]
  assert big and not any(c.sharded for c in big)
  assert any(why in c.reason for c in big), [c.reason for c in big]
