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


def test_reduction_without_a_rule_stays_replicated_and_exact():
  """adaptive_grad_clip reduces a matrix over all dims but the last: not exact on flat shards.

  (Its 1-D tensors reduce over everything, so they are sharded.)
  """
  make_tx = lambda: optax.chain(optax.adaptive_grad_clip(0.1), optax.sgd(0.1))  # noqa: E731
  ref, got, step = both(make_tx(), _mesh())
  assert_trees_equal(ref[0]["big"], got[0]["big"])  # Replicated: bit for bit.
  assert_trees_equal(ref[0], got[0], rtol=2e-6, atol=1e-7)
  plan = _plan(step, make_tx())
  big = [c for c in plan.clusters if any(t.shape == (1024, 1024) for t in c.tensors)]
  assert big and not any(c.sharded for c in big)
  assert all("reduce" in c.reason and "no shard rule" in c.reason for c in big)
