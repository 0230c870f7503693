"""Flax linen: a TrainState step under `jax.jit` with `in_shardings` -> `wus.jit`.

Shrunk from Flax's "Scale up Flax Modules on multiple devices" guide and its examples'
`train_step(state, batch)`: the state made replicated by a jitted `create_state`, the
batch placed over "data" (`jax.device_put`), both said again by `in_shardings`. The one
change is `jax.jit` -> `wus.jit`; the arguments are the same.
Run: python examples/linen_jit.py
"""

import os

if __name__ == "__main__":  # 8 CPU devices for this demo; set before JAX starts.
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8")

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import wus


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(256)(x))
    x = nn.relu(nn.Dense(256)(x))
    return nn.Dense(10)(x)


def train_step(state: train_state.TrainState, batch):
  def loss_fn(params):
    logits = state.apply_fn({"params": params}, batch["image"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), loss


def create_state(key):
  model = MLP()
  params = model.init(key, jnp.ones((1, 784)))["params"]
  return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-3))


mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
replicated, data_sharding = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
rng = np.random.default_rng(0)
batches = [jax.device_put({"image": rng.normal(size=(64, 784)).astype(np.float32),
                           "label": rng.integers(0, 10, size=64)}, data_sharding)
           for _ in range(3)]


def train(jit):
  state = jax.jit(create_state, out_shardings=replicated)(jax.random.key(0))
  step = jit(train_step, in_shardings=(replicated, data_sharding),
             out_shardings=(replicated, replicated))
  losses = []
  for batch in batches:
    state, loss = step(state, batch)
    losses.append(float(loss))
  return losses, wus.bytes_per_device(state.opt_state)


ref_losses, ref_state = train(jax.jit)
losses, state = train(wus.jit)
print("optimizer state per device, jax.jit:", ref_state)
print("optimizer state per device, wus.jit:", state)
print("losses, jax.jit:", np.round(ref_losses, 6))
print("losses, wus.jit:", np.round(losses, 6))
np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
