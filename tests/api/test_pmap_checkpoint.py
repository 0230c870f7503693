"""wus.pmap checkpoints written as Flax's pmap examples write theirs (issue 23 item 5):
save one copy (`unreplicate`), restore into the step's `state_target` at another device
count, and keep training as `jax.pmap` would from the same values."""

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax.training import train_state
from jax import lax

import wus
from helpers import assert_trees_equal

TX = optax.adam(1e-2)


class Model(flax.linen.Module):
  @flax.linen.compact
  def __call__(self, x):
    return flax.linen.Dense(3)(jnp.tanh(flax.linen.Dense(37)(x)))


MODEL = Model()


def train_step(state, x, y):
  def loss(params):
    return jnp.mean((state.apply_fn({"params": params}, x) - y) ** 2)
  grads = lax.pmean(jax.grad(loss)(state.params), "batch")
  return state.apply_gradients(grads=grads)


def create_state():
  params = MODEL.init(jax.random.key(0), jnp.zeros((1, 5)))["params"]
  return train_state.TrainState.create(apply_fn=MODEL.apply, params=params, tx=TX)


def batch(step: int, n: int):
  """Per-device batches of 2 for n devices: the same 16 examples split n ways."""
  xy = np.random.default_rng(step).normal(size=(16, 8)).astype(np.float32)
  return xy[:, :5].reshape(n, -1, 5), xy[:, 5:].reshape(n, -1, 3)


def test_save_unreplicated_restore_at_another_device_count(tmp_path):
  devices8, devices4 = jax.devices()[:8], jax.devices()[:4]
  p8 = wus.pmap(train_step, axis_name="batch", devices=devices8)
  state = flax.jax_utils.replicate(create_state(), devices8)
  for i in range(2):
    state = p8(state, *batch(i, 8))
  assert isinstance(state.opt_state[0].mu["Dense_0"]["kernel"], wus.ShardedArray)
  with ocp.StandardCheckpointer() as ckptr:  # As Flax's examples: one copy of the state.
    ckptr.save(tmp_path / "ckpt", wus.checkpointable(wus.unreplicate(state)))
  saved = ocp.StandardCheckpointer().restore(tmp_path / "ckpt")  # Without wus: whole arrays.
  one_copy = flax.jax_utils.unreplicate(wus.unshard(state))
  assert_trees_equal(one_copy.params, saved["params"])
  adam = one_copy.opt_state[0]
  assert_trees_equal((adam.count, adam.mu, adam.nu, one_copy.step),
                     (saved["opt_state"][0]["count"], saved["opt_state"][0]["mu"],
                      saved["opt_state"][0]["nu"], saved["step"]))

  p4 = wus.pmap(train_step, axis_name="batch", devices=devices4)
  fresh = flax.jax_utils.replicate(create_state(), devices4)
  (target, *_) = p4.state_target(fresh, *batch(2, 4))
  restored = ocp.StandardCheckpointer().restore(tmp_path / "ckpt", target)
  assert isinstance(restored.opt_state[0].mu["Dense_0"]["kernel"], wus.ShardedArray)
  assert restored.step.shape == (4,)
  want = flax.jax_utils.replicate(one_copy, devices4)
  assert_trees_equal(want, wus.unshard(restored))
  ref = jax.pmap(train_step, axis_name="batch", devices=devices4)(want, *batch(2, 4))
  got = p4(restored, *batch(2, 4))
  assert_trees_equal(ref, wus.unshard(got))
