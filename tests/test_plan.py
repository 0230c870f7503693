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


@pytest.mark.parametrize("name,make_tx", [
    ("lars", lambda: optax.lars(0.1)),
    ("clip_adam", lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))),
])
def test_update_with_a_reduction_stays_replicated_and_exact(name, make_tx):
  """Norms have no shard rule yet: those clusters stay replicated, with the reason."""
  ref, got, step = both(make_tx(), _mesh())
  assert_trees_equal(ref[0], got[0])
  assert_trees_equal(ref[1], wus.unshard(got[1]))
  plan = _plan(step, make_tx())
  replicated = [c for c in plan.clusters if not c.sharded]
  assert replicated and all("no shard rule" in c.reason for c in replicated)
  assert any("reduce_sum" in c.reason for c in replicated)
  big = [c for c in plan.clusters if any(t.shape == (1024, 1024) for t in c.tensors)]
  assert big and not any(c.sharded for c in big)
