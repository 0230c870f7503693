"""Equinox: the data-parallel example's step, with `eqx.filter_jit` -> `wus.filter_jit`.

Shrunk from Equinox's examples/parallelism.ipynb: an `eqx.nn.MLP` fit to sin(x), the
batch placed over the mesh's "batch" axis, the model and optimizer state kept replicated
by `eqx.filter_shard` inside the step, `donate="all"`; the step also returns its loss.
Run: python examples/equinox_filter_jit.py
"""

import os

if __name__ == "__main__":  # 8 CPU devices for this demo; set before JAX starts.
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8")

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import wus

# Hyperparameters
dataset_size = 64
channel_size = 64
hidden_size = 256
depth = 2
learning_rate = 3e-4
num_steps = 3
batch_size = 16  # must be a multiple of our number of devices.

xs = np.random.default_rng(0).normal(size=(dataset_size, channel_size)).astype(np.float32)
ys = np.sin(xs)
optim = optax.adam(learning_rate)


def compute_loss(model, x, y):
  pred_y = jax.vmap(model)(x)
  return jnp.mean((y - pred_y) ** 2)


def train_step(model, opt_state, x, y, sharding):
  replicated = NamedSharding(sharding.mesh, P())
  model, opt_state = eqx.filter_shard((model, opt_state), replicated)
  x, y = eqx.filter_shard((x, y), sharding)
  loss, grads = eqx.filter_value_and_grad(compute_loss)(model, x, y)
  updates, opt_state = optim.update(grads, opt_state)
  model = eqx.apply_updates(model, updates)
  model, opt_state = eqx.filter_shard((model, opt_state), replicated)
  return model, opt_state, loss


mesh = jax.make_mesh((8,), ("batch",), axis_types=(AxisType.Auto,))
sharding = NamedSharding(mesh, P("batch"))


def train(filter_jit):
  model = eqx.nn.MLP(channel_size, channel_size, hidden_size, depth, key=jr.key(6789))
  opt_state = optim.init(eqx.filter(model, eqx.is_inexact_array))
  step, losses = filter_jit(train_step, donate="all"), []
  for k in range(num_steps):
    x, y = jax.device_put((xs[k * batch_size:(k + 1) * batch_size],
                           ys[k * batch_size:(k + 1) * batch_size]), sharding)
    model, opt_state, loss = step(model, opt_state, x, y, sharding)
    losses.append(float(loss))
  return losses, wus.bytes_per_device(opt_state)


ref_losses, ref_state = train(eqx.filter_jit)
losses, state = train(wus.filter_jit)
print("optimizer state per device, eqx.filter_jit:", ref_state)
print("optimizer state per device, wus.filter_jit:", state)
print("losses, eqx.filter_jit:", np.round(ref_losses, 6))
print("losses, wus.filter_jit:", np.round(losses, 6))
np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
