"""Flax NNX on a (4, 2) data x model mesh: tensor-parallel weights, `nnx.jit` -> `wus.nnx_jit`.

Shrunk from Flax's "Scale up on multiple devices" guide: `DotReluDot`'s weights are
annotated with `nnx.with_partitioning` (the first split over "model" by columns, the
second by rows), `create_sharded_model` places them, and the batch is placed over
"data". `nnx.jit` keeps each model rank's half of Adam's state whole on its 4 data
replicas (1/2 of a copy per device); `wus.nnx_jit` shards each half over them (1/8).
Run: python examples/nnx_tensor_parallel.py
"""

import os

if __name__ == "__main__":  # 8 CPU devices for this demo; set before JAX starts.
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import wus


class DotReluDot(nnx.Module):
  def __init__(self, depth: int, rngs: nnx.Rngs):
    init_fn = nnx.initializers.lecun_normal()
    self.dot1 = nnx.Linear(depth, depth, use_bias=False, rngs=rngs,
                           kernel_init=nnx.with_partitioning(init_fn, (None, "model")))
    self.w2 = nnx.Param(init_fn(rngs.params(), (depth, depth)), sharding=("model", None))

  def __call__(self, x: jax.Array):
    y = jax.nn.relu(self.dot1(x))
    y = jax.lax.with_sharding_constraint(y, P("data", "model"))
    return jnp.dot(y, self.w2[...])


@nnx.jit
def create_sharded_model():
  model = DotReluDot(256, rngs=nnx.Rngs(0))
  state = nnx.state(model)
  pspecs = nnx.get_partition_spec(state)
  nnx.update(model, jax.lax.with_sharding_constraint(state, pspecs))
  return model


def train_step(model, optimizer, x, y):
  def loss_fn(model):
    return jnp.mean((model(x) - y) ** 2)
  loss, grads = nnx.value_and_grad(loss_fn)(model)
  optimizer.update(model, grads)
  return loss


mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
rng = np.random.default_rng(0)
data = [jax.device_put((rng.normal(size=(32, 256)).astype(np.float32),
                        rng.normal(size=(32, 256)).astype(np.float32)),
                       NamedSharding(mesh, P("data", None))) for _ in range(3)]


def train(jit):
  with jax.set_mesh(mesh):
    model = create_sharded_model()
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    step = jit(train_step)
    losses = [float(step(model, optimizer, x, y)) for x, y in data]
  return losses, wus.bytes_per_device(nnx.state(optimizer, nnx.optimizer.OptState))


ref_losses, ref_state = train(nnx.jit)
losses, state = train(wus.nnx_jit)
print("optimizer state per device, nnx.jit:    ", ref_state)
print("optimizer state per device, wus.nnx_jit:", state)
print("losses, nnx.jit:    ", np.round(ref_losses, 6))
print("losses, wus.nnx_jit:", np.round(losses, 6))
np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
