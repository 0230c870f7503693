"""optax + `jax.shard_map`: a per-replica step, with `jax.shard_map` -> `wus.shard_map`.

Shrunk from the JAX docs' shard_map tutorial ("Neural networks": the loss pmean'd over
the batch axis inside the mapped function) with optax's training loop
(`tx.update`, `optax.apply_updates`). Each replica sees its slice of the batch; the
weights and optimizer state are replicated (`P()`).
Run: python examples/optax_shard_map.py
"""

import os

if __name__ == "__main__":  # 8 CPU devices for this demo; set before JAX starts.
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8")


import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import wus


def init_layer(key, n_in, n_out):
  k1, k2 = jax.random.split(key)
  return jax.random.normal(k1, (n_in, n_out)) / jnp.sqrt(n_in), jnp.zeros(n_out)


def init(key, layer_sizes):
  keys = jax.random.split(key, len(layer_sizes) - 1)
  return [init_layer(k, n_in, n_out)
          for k, n_in, n_out in zip(keys, layer_sizes[:-1], layer_sizes[1:])]


def predict(params, inputs):
  for W, b in params:
    outputs = jnp.dot(inputs, W) + b
    inputs = jnp.tanh(outputs)
  return outputs


def loss(params, batch):
  inputs, targets = batch
  local_loss = jnp.mean(jnp.sum((predict(params, inputs) - targets) ** 2, axis=-1))
  return jax.lax.pmean(local_loss, "batch")  # The mean over every replica's slice.


tx = optax.adamw(1e-3)


def train_step(params, opt_state, batch):
  value, grads = jax.value_and_grad(loss)(params, batch)
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, value


mesh = jax.make_mesh((8,), ("batch",), axis_types=(AxisType.Auto,))
specs = dict(mesh=mesh, in_specs=(P(), P(), P("batch")), out_specs=(P(), P(), P()))
rng = np.random.default_rng(0)
batches = [jax.device_put((rng.normal(size=(64, 128)).astype(np.float32),
                           rng.normal(size=(64, 8)).astype(np.float32)),
                          NamedSharding(mesh, P("batch"))) for _ in range(3)]


def train(step):
  params = init(jax.random.key(0), [128, 256, 256, 8])
  opt_state, losses = tx.init(params), []
  for batch in batches:
    params, opt_state, value = step(params, opt_state, batch)
    losses.append(float(value))
  return losses, wus.bytes_per_device(opt_state)


ref_losses, ref_state = train(jax.jit(jax.shard_map(train_step, **specs)))
losses, state = train(wus.shard_map(train_step, **specs))
print("optimizer state per device, jax.shard_map:", ref_state)
print("optimizer state per device, wus.shard_map:", state)
print("losses, jax.shard_map:", np.round(ref_losses, 6))
print("losses, wus.shard_map:", np.round(losses, 6))
np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
