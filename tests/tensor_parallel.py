"""Shared by the tensor-parallel tests (tests/api/test_tensor_parallel*.py): a
("data", "model") mesh, the unmodified and the wus step run side by side, and the
steps users write for it (the JAX shard_map tutorial's Megatron MLP; a GELU MLP
column- then row-parallel)."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import wus

TX = optax.adam(1e-2)


def two_axis_mesh(n_data: int, n_model: int):
  return jax.make_mesh((n_data, n_model), ("data", "model"),
                       devices=jax.devices()[:n_data * n_model])


def put(mesh, tree, specs):
  return jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), tree, specs,
                      is_leaf=lambda x: isinstance(x, P))


def opt_specs(pspec):
  return (optax.ScaleByAdamState(count=P(), mu=pspec, nu=pspec), optax.EmptyState())


def use_tx(monkeypatch, tx, params) -> None:
  """Runs the steps here with optimizer `tx` (for `params`, a dict of weights): its
  state's specs split a leaf shaped like a weight as the weight."""
  monkeypatch.setattr(sys.modules[__name__], "TX", tx)

  def specs(pspec):
    by_shape = {v.shape: pspec[k] for k, v in params.items()}
    return jax.tree.map(lambda x: by_shape.get(getattr(x, "shape", None), P()), tx.init(params))
  monkeypatch.setattr(sys.modules[__name__], "opt_specs", specs)


def run(mesh, step, pspec, params, batches, *, batch_spec=P("data"), wus_kw=None, **kw):
  """Both steps on the same inputs: (unmodified results, wus results, the wus step, the
  last batch)."""
  kw = dict(mesh=mesh, in_specs=(pspec, opt_specs(pspec), batch_spec),
            out_specs=(pspec, opt_specs(pspec), P()), **kw)
  ref, ws = jax.jit(jax.shard_map(step, **kw)), wus.shard_map(step, **kw, **(wus_kw or {}))
  a = b = (put(mesh, params, pspec), put(mesh, TX.init(params), opt_specs(pspec)))
  for batch in batches:
    batch = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, batch_spec)), batch)
    a, b = ref(*a, batch)[:2], ws(*b, batch)[:2]
  return a, b, ws, batch


# --- The JAX shard_map tutorial's Megatron-style MLP ("Tensor parallelism"), trained. ----
# Copied from the tutorial (feature axis "feats" named "model" here), with a data axis
# beside it and the training step around its loss.


def predict_tp(params, inputs):
  for W, b in params:
    outputs = gemm_tp(inputs, W, b)
    inputs = jax.nn.relu(outputs)
  return outputs


def gemm_tp(inputs, W, b):
  block_result = jnp.dot(inputs, W)
  return jax.lax.psum_scatter(block_result, "model", scatter_dimension=1, tiled=True) + b


def loss_tp(params, batch):
  inputs, targets = batch
  predictions = predict_tp(params, inputs)
  sq_err = jax.lax.psum(jnp.sum((predictions - targets) ** 2, axis=-1), "model")
  return jnp.mean(sq_err)


def megatron_step(params, opt_state, batch):
  loss, grads = jax.value_and_grad(loss_tp)(params, batch)
  grads = lax.pmean(grads, "data")
  updates, opt_state = TX.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, lax.pmean(loss, "data")


MEGATRON_SPEC = [(P("model", None), P("model"))] * 3  # Rows of W and b split over features.


def megatron_inputs(n_data, steps=3, width=16):
  r = np.random.RandomState(0)
  params = [(jnp.asarray(r.randn(width, width) / np.sqrt(width), jnp.float32),
             jnp.asarray(0.1 * r.randn(width), jnp.float32)) for _ in range(3)]
  batches = [tuple(jnp.asarray(r.randn(4 * n_data, width), jnp.float32) for _ in range(2))
             for _ in range(steps)]
  return params, batches



# --- A step with a GELU MLP, column- then row-parallel (w1 P(None, "model"), w2 P("model", None)).


def gelu_step(params, opt_state, batch, tp=True):
  x, y = batch

  def loss_fn(p):
    h = jax.nn.gelu(x @ p["w1"]) @ p["w2"]
    return jnp.mean(((lax.psum(h, "model") if tp else h) - y) ** 2)
  loss, grads = jax.value_and_grad(loss_fn)(params)
  grads = lax.pmean(grads, "data")
  updates, opt_state = TX.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, lax.pmean(loss, "data")


GELU_SPEC = {"w1": P(None, "model"), "w2": P("model", None)}


def gelu_inputs(n_data, steps=3, hidden=32):
  r = np.random.RandomState(0)
  params = {"w1": jnp.asarray(0.1 * r.randn(16, hidden), jnp.float32),
            "w2": jnp.asarray(0.1 * r.randn(hidden, 16), jnp.float32)}
  batches = [tuple(jnp.asarray(r.randn(4 * n_data, 16), jnp.float32) for _ in range(2))
             for _ in range(steps)]
  return params, batches
