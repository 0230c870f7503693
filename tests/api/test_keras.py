"""Keras 3 on the JAX backend (issue 40 item 6): the training steps of Keras's guides,
shrunk, with the one line `jax.jit(train_step)` swapped for `wus.jit(train_step)`.

* "Writing a training loop from scratch in JAX"
  (keras.io/guides/writing_a_custom_training_loop_in_jax/): `compute_loss_and_updates`
  with `model.stateless_call`, `jax.value_and_grad(..., has_aux=True)`,
  `optimizer.stateless_apply`, state = (trainable, non-trainable, optimizer variables),
  and the guide's second step, which carries a metric's variables too. The guide feeds
  one device; here the batch is placed over a ("batch",) mesh, as the next guide does.
* "Multi-GPU distributed training with JAX"
  (keras.io/guides/distributed_training_with_jax/): its convnet (batch normalization,
  dropout), the variables replicated on a mesh with an axis "_", the batch split on
  another mesh ("batch") over the same devices, the labels passed as NumPy arrays.

Each runs beside the unmodified step (`jax.jit`) from the same state over 3 steps:
losses and variables bit for bit under the suite's flags (Adam is elementwise), the
optimizer variables per device at most 1.15 x 1/8 of a copy (`wus.bytes_per_device`; the
scalars and the biases of 10 or fewer elements stay whole).

The guides pass the lists of `keras.Variable` themselves to the jitted step and to
`jax.device_put`; JAX 0.10 no longer converts such objects (`__jax_array__`) there, so the
state here is their values (`[v.value for v in ...]`), with `jax.jit` as with `wus.jit`.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "jax")  # Before keras is imported, as the guides do.

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import wus  # noqa: E402
from helpers import assert_trees_equal  # noqa: E402

keras = pytest.importorskip("keras")
if keras.backend.backend() != "jax":
  pytest.skip(f"Keras runs on {keras.backend.backend()}, not JAX", allow_module_level=True)

N = 8


def _values(variables) -> list:
  return [v.value for v in variables]


def _run_both(train_step, state, batches, non_trainable_rtol=0.0):
  """The unmodified step and wus's from the same state; both final states (wus's whole)
  and wus's Plan. Losses, trainable and optimizer variables bit for bit; the non-trainable
  ones within `non_trainable_rtol`."""
  ref, ws = jax.jit(train_step), wus.jit(train_step)
  plan = ws.plan(state, *batches[0])
  ours = state
  for batch in batches:
    ref_loss, state = ref(state, *batch)
    loss, ours = ws(ours, *batch)
    assert_trees_equal(ref_loss, loss)
  whole = wus.unshard(ours)
  assert_trees_equal(state[0], whole[0])
  assert_trees_equal(state[2:], whole[2:])
  assert_trees_equal(state[1], whole[1], rtol=non_trainable_rtol)
  return state, ours, plan


def _assert_served(plan, ref_state, state):
  assert not plan.unchanged, plan.unchanged
  assert plan.clusters and all(c.sharded for c in plan.clusters), plan
  whole = wus.bytes_per_device(ref_state[2])
  assert whole.fraction == 1.0, whole  # The unmodified step keeps a copy on every device.
  ours = wus.bytes_per_device(state[2])
  assert ours.whole == whole.whole and ours.fraction <= 1.15 / N, ours


# --- "Writing a training loop from scratch in JAX". -----------------------------------


def get_model():
  inputs = keras.Input(shape=(784,), name="digits")
  x1 = keras.layers.Dense(64, activation="relu")(inputs)
  x2 = keras.layers.Dense(64, activation="relu")(x1)
  outputs = keras.layers.Dense(10, name="predictions")(x2)
  return keras.Model(inputs=inputs, outputs=outputs)


def _mnist_like_batches(mesh, n, batch_size=32):
  """The guide's batches (784 float32 pixels, one-hot labels of 10), split over "batch"."""
  rng = np.random.default_rng(0)
  data = NamedSharding(mesh, P("batch"))
  return [(jax.device_put((rng.uniform(0, 255, (batch_size, 784)).astype("float32"),
                           keras.utils.to_categorical(rng.integers(0, 10, batch_size), 10)),
                          data),) for _ in range(n)]


def test_custom_training_loop_guide_adam():
  keras.utils.set_random_seed(0)
  model = get_model()
  loss_fn = keras.losses.CategoricalCrossentropy(from_logits=True)
  optimizer = keras.optimizers.Adam(learning_rate=1e-3)

  def compute_loss_and_updates(trainable_variables, non_trainable_variables, x, y):
    y_pred, non_trainable_variables = model.stateless_call(
        trainable_variables, non_trainable_variables, x)
    loss = loss_fn(y, y_pred)
    return loss, non_trainable_variables

  grad_fn = jax.value_and_grad(compute_loss_and_updates, has_aux=True)

  def train_step(state, data):
    trainable_variables, non_trainable_variables, optimizer_variables = state
    x, y = data
    (loss, non_trainable_variables), grads = grad_fn(
        trainable_variables, non_trainable_variables, x, y)
    trainable_variables, optimizer_variables = optimizer.stateless_apply(
        optimizer_variables, grads, trainable_variables)
    return loss, (trainable_variables, non_trainable_variables, optimizer_variables)

  optimizer.build(model.trainable_variables)
  state = (_values(model.trainable_variables), _values(model.non_trainable_variables),
           _values(optimizer.variables))
  mesh = Mesh(np.array(jax.devices()[:N]), ("batch",))
  ref, ours, plan = _run_both(train_step, state, _mnist_like_batches(mesh, 3))
  _assert_served(plan, ref, ours)
  assert int(wus.unshard(ours[2][0])) == 3  # Keras's iteration counter, whole.


def test_custom_training_loop_guide_with_a_metric():
  """The guide's step with `CategoricalAccuracy`'s variables in the state: their next
  values sum over the batch, beside the gradients."""
  keras.utils.set_random_seed(0)
  model = get_model()
  optimizer = keras.optimizers.Adam(learning_rate=1e-3)
  loss_fn = keras.losses.CategoricalCrossentropy(from_logits=True)
  train_acc_metric = keras.metrics.CategoricalAccuracy()

  def compute_loss_and_updates(trainable_variables, non_trainable_variables,
                               metric_variables, x, y):
    y_pred, non_trainable_variables = model.stateless_call(
        trainable_variables, non_trainable_variables, x)
    loss = loss_fn(y, y_pred)
    metric_variables = train_acc_metric.stateless_update_state(metric_variables, y, y_pred)
    return loss, (non_trainable_variables, metric_variables)

  grad_fn = jax.value_and_grad(compute_loss_and_updates, has_aux=True)

  def train_step(state, data):
    (trainable_variables, non_trainable_variables, optimizer_variables,
     metric_variables) = state
    x, y = data
    (loss, (non_trainable_variables, metric_variables)), grads = grad_fn(
        trainable_variables, non_trainable_variables, metric_variables, x, y)
    trainable_variables, optimizer_variables = optimizer.stateless_apply(
        optimizer_variables, grads, trainable_variables)
    return loss, (trainable_variables, non_trainable_variables, optimizer_variables,
                  metric_variables)

  optimizer.build(model.trainable_variables)
  state = (_values(model.trainable_variables), _values(model.non_trainable_variables),
           _values(optimizer.variables), _values(train_acc_metric.variables))
  mesh = Mesh(np.array(jax.devices()[:N]), ("batch",))
  ref, ours, plan = _run_both(train_step, state, _mnist_like_batches(mesh, 3))
  _assert_served(plan, ref, ours)
  total, count = wus.unshard(ours[3])
  assert float(count) == 3 * 32 and 0 <= float(total) <= float(count)


# --- "Multi-GPU distributed training with JAX". ---------------------------------------


def get_convnet():
  """The guide's convnet (batch normalization, dropout), its widths shrunk."""
  inputs = keras.Input(shape=(28, 28, 1))
  x = keras.layers.Rescaling(1.0 / 255.0)(inputs)
  x = keras.layers.Conv2D(filters=4, kernel_size=3, padding="same", use_bias=False)(x)
  x = keras.layers.BatchNormalization(scale=False, center=True)(x)
  x = keras.layers.ReLU()(x)
  x = keras.layers.Conv2D(filters=8, kernel_size=6, use_bias=False, strides=2)(x)
  x = keras.layers.BatchNormalization(scale=False, center=True)(x)
  x = keras.layers.ReLU()(x)
  x = keras.layers.Conv2D(filters=16, kernel_size=6, padding="same", strides=2,
                          name="large_k")(x)
  x = keras.layers.BatchNormalization(scale=False, center=True)(x)
  x = keras.layers.ReLU()(x)
  x = keras.layers.GlobalAveragePooling2D()(x)
  x = keras.layers.Dense(32, activation="relu")(x)
  x = keras.layers.Dropout(0.5)(x)
  outputs = keras.layers.Dense(10)(x)
  return keras.Model(inputs, outputs)


@pytest.mark.parametrize("training", [False, True], ids=["as_written", "training"])
def test_distributed_training_guide(training):
  """As the guide writes it (`stateless_call` in inference mode: the moving statistics
  normalize, dropout is off), and with `training=True` (batch statistics, whose moving
  averages are non-trainable state summed over the batch, and dropout's seed state)."""
  keras.utils.set_random_seed(0)
  batch_size = 64
  model = get_convnet()
  optimizer = keras.optimizers.Adam(1e-3)
  loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  rng = np.random.default_rng(0)
  batches = [(rng.uniform(0, 255, (batch_size, 28, 28, 1)).astype("float32"),
              rng.integers(0, 10, batch_size)) for _ in range(3)]
  model.build(batches[0][0])
  optimizer.build(model.trainable_variables)

  def compute_loss(trainable_variables, non_trainable_variables, x, y):
    y_pred, updated_non_trainable_variables = model.stateless_call(
        trainable_variables, non_trainable_variables, x, training=training)
    loss_value = loss(y, y_pred)
    return loss_value, updated_non_trainable_variables

  compute_gradients = jax.value_and_grad(compute_loss, has_aux=True)

  def train_step(train_state, x, y):
    trainable_variables, non_trainable_variables, optimizer_variables = train_state
    (loss_value, non_trainable_variables), grads = compute_gradients(
        trainable_variables, non_trainable_variables, x, y)
    trainable_variables, optimizer_variables = optimizer.stateless_apply(
        optimizer_variables, grads, trainable_variables)
    return loss_value, (trainable_variables, non_trainable_variables, optimizer_variables)

  devices = np.array(jax.devices()[:N])
  var_replication = NamedSharding(Mesh(devices, axis_names=("_",)), P())
  train_state = (jax.device_put(_values(model.trainable_variables), var_replication),
                 jax.device_put(_values(model.non_trainable_variables), var_replication),
                 jax.device_put(_values(optimizer.variables), var_replication))
  data_sharding = NamedSharding(Mesh(devices, axis_names=("batch",)), P("batch"))
  batches = [(jax.device_put(x, data_sharding), y) for x, y in batches]
  ref, ours, plan = _run_both(train_step, train_state, batches,
                              non_trainable_rtol=1e-6 if training else 0.0)
  _assert_served(plan, ref, ours)
  moving = wus.unshard(ours[1])
  assert any(np.any(np.asarray(a) != np.asarray(b)) for a, b in
             zip(moving, train_state[1], strict=True)) == training
