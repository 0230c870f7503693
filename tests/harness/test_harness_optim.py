"""Tests of wus.harness.training.optim: the schedules and what LARS decays."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from wus.harness.training import optim
from wus.harness.models import tasks


def test_lars_schedule_warms_up_then_decays_polynomially():
  schedule = optim.lars_schedule(2.0, warmup_steps=10, total_steps=110)
  assert float(schedule(0)) == 0.0
  assert float(schedule(5)) == pytest.approx(1.0)
  assert float(schedule(10)) == pytest.approx(2.0)
  assert float(schedule(60)) == pytest.approx(2.0 * 0.5**2)  # power 2, halfway
  assert float(schedule(110)) == pytest.approx(0.0)


def test_rsqrt_schedule_warms_up_then_decays_with_inverse_square_root():
  schedule = optim.rsqrt_schedule(1e-3, warmup_steps=100)
  assert float(schedule(50)) == pytest.approx(5e-4)
  assert float(schedule(100)) == pytest.approx(1e-3)
  assert float(schedule(400)) == pytest.approx(5e-4)


def test_lars_leaves_biases_and_scales_out_of_weight_decay():
  tx, _ = optim.lars(learning_rate=1.0, warmup_steps=0, total_steps=10, weight_decay=0.1,
                     momentum=0.0)
  params = {"kernel": jnp.ones((3, 4)), "bias": jnp.ones(4)}
  grads = {"kernel": jnp.zeros((3, 4)), "bias": jnp.zeros(4)}
  updates, _ = tx.update(grads, tx.init(params), params)
  np.testing.assert_array_equal(updates["bias"], 0)
  assert np.all(np.asarray(updates["kernel"]) < 0)


def test_make_by_name():
  tx, schedule = optim.make("adam", learning_rate=1e-3, warmup_steps=4, b1=0.9, b2=0.98,
                            eps=1e-9)
  assert float(schedule(4)) == pytest.approx(1e-3)
  assert "mu" in tx.init({"w": jnp.ones(2)})[0]._fields


@pytest.mark.slow  # Trains a ResNet (45 s when loaded).
def test_lars_on_a_resnet_decays_and_scales_kernels_only():
  """MLPerf's LARS: kernels get weight decay and the trust ratio; biases and batch-norm
  scales and offsets get neither (their update is -learning_rate * gradient)."""
  task = tasks.make("resnet_small", num_classes=10, seq_len=1, axis_name="data")
  params, _ = task.init(0, {"image": np.zeros((1, 8, 8, 1), np.float32)})
  tx, schedule = optim.lars(learning_rate=0.5, warmup_steps=0, total_steps=10,
                            weight_decay=0.1, momentum=0.0)
  grads = jax.tree.map(jnp.ones_like, params)
  updates, _ = tx.update(grads, tx.init(params), params)
  plain = dict(jax.tree_util.tree_flatten_with_path(
      jax.tree.map(lambda g: -float(schedule(0)) * g, grads))[0])

  counts = collections.Counter()
  for path, update in jax.tree_util.tree_flatten_with_path(updates)[0]:
    name = path[-1].key
    counts[name] += 1
    assert np.allclose(update, plain[path], rtol=1e-6) == (name != "kernel"), path
  assert counts.keys() == {"kernel", "bias", "scale"} and min(counts.values()) > 1, counts
