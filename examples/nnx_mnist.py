"""Flax NNX: the MNIST tutorial's CNN and step, with `@nnx.jit` -> `@wus.nnx_jit`.

Shrunk from Flax's "MNIST tutorial" (flax.readthedocs.io, nnx_basics/mnist_tutorial):
random 28x28 images instead of the data set, and 3 steps. The batch is placed over the
mesh's "data" axis; the model is left unplaced, so the mesh's axes are Auto (with JAX
0.10's default, Explicit, place the model too: docs/quickstart.md).
Run: python examples/nnx_mnist.py
"""

import os

if __name__ == "__main__":  # 8 CPU devices for this demo; set before JAX starts.
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8")

from functools import partial

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import wus


class CNN(nnx.Module):
  """A simple CNN model."""

  def __init__(self, *, rngs: nnx.Rngs):
    self.conv1 = nnx.Conv(1, 16, kernel_size=(3, 3), rngs=rngs)
    self.conv2 = nnx.Conv(16, 32, kernel_size=(3, 3), rngs=rngs)
    self.avg_pool = partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
    self.linear1 = nnx.Linear(7 * 7 * 32, 64, rngs=rngs)
    self.linear2 = nnx.Linear(64, 10, rngs=rngs)

  def __call__(self, x):
    x = self.avg_pool(nnx.relu(self.conv1(x)))
    x = self.avg_pool(nnx.relu(self.conv2(x)))
    x = x.reshape(x.shape[0], -1)  # flatten
    return self.linear2(nnx.relu(self.linear1(x)))


def loss_fn(model: CNN, batch):
  logits = model(batch["image"])
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
  return loss, logits


def train_step(model: CNN, optimizer: nnx.Optimizer, metrics: nnx.MultiMetric, batch):
  """Train for a single step."""
  grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
  (loss, logits), grads = grad_fn(model, batch)
  metrics.update(loss=loss, logits=logits, labels=batch["label"])
  optimizer.update(model, grads)


mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
rng = np.random.default_rng(0)
batches = [jax.device_put({"image": rng.normal(size=(64, 28, 28, 1)).astype(np.float32),
                           "label": rng.integers(0, 10, size=64)}, NamedSharding(mesh, P("data")))
           for _ in range(3)]


def train(jit):
  model = CNN(rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.adamw(learning_rate=0.005, b1=0.9), wrt=nnx.Param)
  metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))
  step, losses = jit(train_step), []
  for batch in batches:
    step(model, optimizer, metrics, batch)
    losses.append(float(metrics.compute()["loss"]))
    metrics.reset()
  return losses, wus.bytes_per_device(nnx.state(optimizer, nnx.optimizer.OptState))


ref_losses, ref_state = train(nnx.jit)
losses, state = train(wus.nnx_jit)
print("optimizer state per device, nnx.jit:    ", ref_state)
print("optimizer state per device, wus.nnx_jit:", state)
print("losses, nnx.jit:    ", np.round(ref_losses, 6))
print("losses, wus.nnx_jit:", np.round(losses, 6))
np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
