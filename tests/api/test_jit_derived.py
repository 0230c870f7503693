"""`wus.jit` derives the step's shardings from one trace at the user's shapes (issue 37).

Trainers fix their batch in their configuration: MaxText slices every batch input to
its configured micro-batch (`v[:micro_batch_size_to_train_on]`, a no-op at the real
size) and accumulates gradients over micro-batches with a `lax.scan` when the batch is
larger; pjit-era programs pass the batch whole and split it with a sharding constraint
inside the step. Each step here is written so, shrunk, and compared with the unmodified
`jax.jit` step on the same inputs (bit for bit: the updates are elementwise).
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import wus
from helpers import assert_trees_equal, classifier_batches
from wus.analysis import refusals
from wus.sharded import is_sharded


@dataclasses.dataclass(frozen=True)
class Config:
  """As a trainer's config fixes them (MaxText's names)."""
  micro_batch_size_to_train_on: int
  gradient_accumulation_steps: int = 1


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(32)(x))
    return nn.Dense(10)(x)


def _mesh(n=8):
  return jax.make_mesh((n,), ("data",), axis_types=(AxisType.Auto,))


def _loss_fn(model, config, data, params):
  """MaxText's `loss_fn` shape: every batch input sliced to the configured micro-batch."""
  for k, v in data.items():
    data[k] = v[:config.micro_batch_size_to_train_on]
  logits = model.apply(params, data["x"])
  return optax.softmax_cross_entropy_with_integer_labels(logits, data["y"]).mean()


def _grads(model, config, params, data):
  """MaxText's gradient accumulation: the batch reshaped to [steps, micro, ...] (its
  `reshape_to_microbatch_accumulations`) and the gradients summed in a `lax.scan`."""
  steps = config.gradient_accumulation_steps
  grad_fn = jax.value_and_grad(lambda p, d: _loss_fn(model, config, d, p))
  if steps == 1:
    return grad_fn(params, dict(data))

  def reshape(x):
    x = jnp.reshape(x, (x.shape[0] // steps, steps) + x.shape[1:])
    return jnp.swapaxes(x, 0, 1)

  def accumulate(acc, micro):
    loss, grads = grad_fn(params, micro)
    return {"loss": acc["loss"] + loss,
            "grad": jax.tree.map(jnp.add, acc["grad"], grads)}, None
  init = {"loss": 0.0, "grad": jax.tree.map(jnp.zeros_like, params)}
  acc, _ = jax.lax.scan(accumulate, init, jax.tree.map(reshape, data), length=steps)
  return acc["loss"] / steps, jax.tree.map(lambda g: g / steps, acc["grad"])


def _step(model, tx, config, constrain=None):
  def train_step(params, opt_state, data):
    if constrain is not None:  # pjit-era: the batch enters whole, split here.
      data = jax.lax.with_sharding_constraint(data, constrain)
    loss, grads = _grads(model, config, params, data)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, {"loss": loss}
  return train_step


def _run(step, mesh, batches, tx, model=MLP()):
  params = jax.device_put(model.init(jax.random.key(0), jnp.ones((1, 12))),
                          NamedSharding(mesh, P()))
  out = (params, tx.init(params))
  for b in batches:
    out = step(*out[:2], b)
  return out


def _check(train_step, mesh, batches, tx=optax.adam(1e-2)):
  """The wus.jit step equals jax.jit's, and keeps Adam's state sharded."""
  ref = _run(jax.jit(train_step), mesh, batches, tx)
  got = _run(wus.jit(train_step), mesh, batches, tx)
  assert_trees_equal(ref, wus.unshard(got))
  mu = got[1][0].mu["params"]
  assert all(is_sharded(x) for x in jax.tree.leaves(mu, is_leaf=is_sharded)), mu


def test_a_batch_sliced_to_its_configured_micro_batch_is_served():
  mesh, model = _mesh(), MLP()
  _check(_step(model, optax.adam(1e-2), Config(64)), mesh, classifier_batches(mesh, 2, 64))


def test_gradient_accumulation_above_the_configured_micro_batch_is_served():
  """The micro-batches' gradients are summed inside the scan (GSPMD all-reduces there);
  the update reads the sum whole and runs on shards."""
  mesh, model = _mesh(), MLP()
  step = _step(model, optax.adam(1e-2), Config(32, gradient_accumulation_steps=2))
  _check(step, mesh, classifier_batches(mesh, 2, 64))


def test_a_batch_split_by_a_constraint_inside_the_step_is_served():
  mesh, model = _mesh(), MLP()
  batches = [{k: np.asarray(v) for k, v in b.items()}
             for b in classifier_batches(mesh, 2, 64)]  # Whole, on the host.
  step = _step(model, optax.adam(1e-2), Config(64), constrain=NamedSharding(mesh, P("data")))
  _check(step, mesh, batches)


def test_the_step_is_traced_once_per_signature():
  """As `jax.jit` traces it: once for each new signature, never again at other shapes."""
  mesh, model, tx, traces = _mesh(), MLP(), optax.adam(1e-2), []
  inner = _step(model, tx, Config(64))

  def train_step(params, opt_state, data):
    traces.append(jax.tree.map(jnp.shape, data))
    return inner(params, opt_state, data)
  step = wus.jit(train_step)
  _run(step, mesh, classifier_batches(mesh, 3, 64), tx)
  assert len(traces) == 1, traces
  _run(step, mesh, classifier_batches(mesh, 2, 32), tx)
  assert len(traces) == 2, traces


def test_an_error_of_wus_own_runs_the_step_as_jax_jit_with_the_reason(monkeypatch):
  """Nothing wus does while analysing reaches the user's program as an exception."""
  from wus import jit_region  # noqa: PLC0415

  def broken(*args, **kwargs):
    raise RuntimeError("injected")
  monkeypatch.setattr(jit_region, "update_region", broken)
  mesh, model, tx = _mesh(), MLP(), optax.adam(1e-2)
  step, batches = _step(model, tx, Config(64)), classifier_batches(mesh, 2, 64)
  ws = wus.jit(step)
  with pytest.warns(wus.NotShardedWarning, match="error of its own.*To fix: nothing in your "
                    "program: the error is wus's own, a bug; please report it"):
    assert_trees_equal(_run(jax.jit(step), mesh, batches, tx), _run(ws, mesh, batches, tx))
  params = jax.device_put(model.init(jax.random.key(0), jnp.ones((1, 12))),
                          NamedSharding(mesh, P()))
  plan = ws.plan(params, tx.init(params), batches[0])
  error = plan.unchanged.verdict
  assert isinstance(error, refusals.OwnError), plan.unchanged
  assert (error.kind, error.message) == ("RuntimeError", "injected"), error
  assert error.where.startswith("wus/jit.py:"), error
  assert str(plan.unchanged) == (f"wus could not shard this step (an error of its own, at "
                                 f"{error.where}: RuntimeError: injected); it runs as jax.jit "
                                 "runs it")


@pytest.mark.parametrize("shape,names,batch,specs", [
    ((2, 4), ("replica", "fsdp"), ("replica", "fsdp"),
     {"w1": P("fsdp", None), "b1": P(), "w2": P("fsdp", None), "scale": P()}),
    ((2, 2, 2), ("data", "fsdp", "tensor"), ("data", "fsdp"),
     {"w1": P("fsdp", "tensor"), "b1": P("tensor"), "w2": P("tensor", "fsdp"), "scale": P()}),
], ids=["hsdp", "data_fsdp_tensor"])
def test_a_constraint_split_batch_on_hsdp_and_3d_meshes_shards_to_an_eighth(
    shape, names, batch, specs):
  """pjit-era HSDP and data x fsdp x tensor: weights placed (FSDP over "fsdp", TP over
  "tensor"), the batch passed whole and split by a constraint inside the step. The state
  per device is at most 1.15 x 1/8 of a copy (the issue measured 0.25 before); the sums
  over two batch axes within summation order (Adam's eps raised, as in
  test_jit_explicit)."""
  mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))
  rng = np.random.default_rng(0)
  shapes = {"w1": (32, 32), "b1": (32,), "w2": (32, 16), "scale": (16,)}
  params = {k: jax.device_put(rng.normal(size=s).astype(np.float32) * 0.1,
                              NamedSharding(mesh, specs[k])) for k, s in shapes.items()}
  tx = optax.adam(1e-2, eps=1e-3)

  def step(p, s, b):
    b = jax.lax.with_sharding_constraint(b, NamedSharding(mesh, P(batch)))

    def loss(p):
      h = jnp.tanh(b["x"] @ p["w1"] + p["b1"])
      return jnp.mean(((h @ p["w2"]) * p["scale"]) ** 2)
    value, grads = jax.value_and_grad(loss)(p)
    updates, s = tx.update(grads, s, p)
    return optax.apply_updates(p, updates), s, value
  batches = [{"x": rng.normal(size=(32, 32)).astype(np.float32)} for _ in range(2)]
  ws, ref = wus.jit(step), (params, tx.init(params))
  out = ref
  for b in batches:
    ref, out = jax.jit(step)(*ref, b)[:2], ws(*out, b)[:2]
  assert_trees_equal(ref, wus.unshard(out), rtol=1e-6, atol=1e-8)
  assert wus.bytes_per_device(out[1]).fraction <= 1.15 / 8, wus.bytes_per_device(out[1])


class CNN(nn.Module):
  """Flax's linen MNIST example's CNN (examples/mnist/train.py), shrunk, with its
  `avg_pool` and a `max_pool`: windows over the spatial dims, the batch dim untouched."""

  @nn.compact
  def __call__(self, x):
    x = nn.avg_pool(nn.relu(nn.Conv(features=4, kernel_size=(3, 3))(x)), (2, 2), (2, 2))
    x = nn.max_pool(nn.relu(nn.Conv(features=8, kernel_size=(3, 3))(x)), (2, 2), (2, 2))
    return nn.Dense(10)(x.reshape((x.shape[0], -1)))


def test_pooling_carries_the_batch_split():
  """Regression: the batch split passes through pooling (`reduce_window_*`) and its
  gradients; before, the split was lost there, no gradient was seen as a sum over the
  batch and the step ran unchanged, silently (examples/nnx_mnist.py)."""
  mesh, model, tx = _mesh(), CNN(), optax.adam(1e-2)
  rng = np.random.default_rng(0)
  batches = [jax.device_put({"x": rng.normal(size=(16, 8, 8, 1)).astype(np.float32),
                             "y": rng.integers(0, 10, size=16)}, NamedSharding(mesh, P("data")))
             for _ in range(2)]

  def train_step(params, opt_state, data):
    def loss_fn(p):
      logits = model.apply(p, data["x"])
      return optax.softmax_cross_entropy_with_integer_labels(logits, data["y"]).mean()
    grads = jax.grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  def run(step):
    params = jax.device_put(model.init(jax.random.key(0), jnp.ones((1, 8, 8, 1))),
                            NamedSharding(mesh, P()))
    out = (params, tx.init(params))
    for b in batches:
      out = step(*out, b)
    return out
  ref, ws = run(jax.jit(train_step)), wus.jit(train_step)
  got = run(ws)
  jaxpr = str(jax.make_jaxpr(train_step)(*ref, batches[0]))
  assert all(p in jaxpr for p in ("reduce_window_sum", "reduce_window_max",
                                  "select_and_scatter_add")), jaxpr
  assert_trees_equal(ref, wus.unshard(got), rtol=1e-6, atol=1e-7)
  assert wus.bytes_per_device(got[1]).fraction <= 1.15 / 8, wus.bytes_per_device(got[1])


def test_a_step_whose_split_ends_at_a_primitive_without_a_rule_says_where():
  """The batch's split ends at an FFT (no dims rule): no gradient is seen as a sum over
  the batch, the step runs as jax.jit runs it, and the Plan names the FFT and its line."""
  mesh, tx = _mesh(), optax.adam(1e-2)
  w = jax.device_put(jnp.ones((6, 3)), NamedSharding(mesh, P()))
  x = jax.device_put(jnp.ones((8, 6)), NamedSharding(mesh, P("data")))

  def step(w, s, x):
    def loss(w):
      spectrum = jax.lax.fft(x.astype(jnp.complex64), jax.lax.FftType.FFT, (6,))
      return jnp.mean((spectrum.real @ w) ** 2)
    updates, s = tx.update(jax.grad(loss)(w), s, w)
    return optax.apply_updates(w, updates), s
  ws = wus.jit(step)
  with pytest.warns(wus.NotShardedWarning, match="split ends at fft"):
    assert_trees_equal(jax.jit(step)(w, tx.init(w), x), ws(w, tx.init(w), x))
  plan = ws.plan(w, tx.init(w), x)
  (ends,) = plan.unchanged.notes
  assert isinstance(ends, refusals.SplitEnds) and ends.primitive == "fft", plan.unchanged
  assert "test_jit_derived.py:" in ends.line, ends
  assert f"; the batch's split ends at fft ({ends.line}): " in str(plan.unchanged)
