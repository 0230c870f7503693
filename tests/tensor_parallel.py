"""Shared by the tensor-parallel tests (tests/api/test_tensor_parallel*.py): a
("data", "model") mesh, the unmodified and the wus step run side by side, and the
steps users write for it (the JAX shard_map tutorial's Megatron MLP; a GELU MLP
column- then row-parallel; Megatron-LM's MLP with LayerNorm and biases)."""

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


# --- Megatron-LM's transformer MLP: LayerNorm, column-parallel Dense (its bias split),
# GELU, row-parallel Dense (its bias replicated), residual. LayerNorm's scale and bias and
# the row-parallel bias are in no spec's "model": every model rank repeats their update.
# Under check_vma=True JAX's AD sums the replicated activations' cotangents over "model"
# itself; under check_vma=False the step says it with Megatron's f and g
# (megatron/core/tensor_parallel/mappings.py: copy_to_tensor_model_parallel_region and
# reduce_from_tensor_model_parallel_region).


@jax.custom_vjp
def copy_to_model_region(x):
  """Megatron's f: identity forward, all-reduce over "model" backward."""
  return x


copy_to_model_region.defvjp(lambda x: (x, None), lambda _, g: (lax.psum(g, "model"),))


@jax.custom_vjp
def reduce_from_model_region(x):
  """Megatron's g: all-reduce over "model" forward, identity backward."""
  return lax.psum(x, "model")


reduce_from_model_region.defvjp(lambda x: (lax.psum(x, "model"), None), lambda _, g: (g,))


def layer_norm(x, scale, bias, eps=1e-5):
  mean = jnp.mean(x, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
  return (x - mean) * lax.rsqrt(var + eps) * scale + bias


def ln_mlp_step(params, opt_state, batch, f=lambda x: x, g=lambda x: lax.psum(x, "model")):
  """The step for check_vma=True; check_vma=False passes Megatron's f and g."""
  x, y = batch

  def loss_fn(p):
    h = f(layer_norm(x, p["ln_scale"], p["ln_bias"]))
    h = jax.nn.gelu(h @ p["w1"] + p["b1"])
    return jnp.mean((x + g(h @ p["w2"]) + p["b2"] - y) ** 2)
  loss, grads = jax.value_and_grad(loss_fn)(params)
  grads = lax.pmean(grads, "data")
  updates, opt_state = TX.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, lax.pmean(loss, "data")


LN_MLP_SPEC = {"ln_scale": P(), "ln_bias": P(), "w1": P(None, "model"), "b1": P("model"),
               "w2": P("model", None), "b2": P()}
LN_MLP_REPLICATED = ("ln_scale", "ln_bias", "b2")  # In no spec's "model".


def ln_mlp_inputs(n_data, steps=3, width=16):
  """Blocks of one shape ([width, width]: hidden 2 x width over 2 model ranks)."""
  r = np.random.RandomState(2)
  params = {"ln_scale": jnp.asarray(1 + 0.1 * r.randn(width), jnp.float32),
            "ln_bias": jnp.asarray(0.1 * r.randn(width), jnp.float32),
            "w1": jnp.asarray(r.randn(width, 2 * width) / np.sqrt(width), jnp.float32),
            "b1": jnp.asarray(0.1 * r.randn(2 * width), jnp.float32),
            "w2": jnp.asarray(r.randn(2 * width, width) / np.sqrt(2 * width), jnp.float32),
            "b2": jnp.asarray(0.1 * r.randn(width), jnp.float32)}
  batches = [tuple(jnp.asarray(r.randn(4 * n_data, width), jnp.float32) for _ in range(2))
             for _ in range(steps)]
  return params, batches


# --- HSDP: weights split over "fsdp" (all-gathered in the forward pass), replicated over
# "replica"; the tutorial's FSDP layers on a ("replica", "fsdp") mesh.


def hsdp_predict(params_frag, inputs):
  for W_frag, b_frag in params_frag:
    W = jax.lax.all_gather(W_frag, "fsdp", tiled=True)
    b = jax.lax.all_gather(b_frag, "fsdp", tiled=True)
    inputs = jax.nn.relu(jnp.dot(inputs, W) + b)
  return inputs


def hsdp_step(params, opt_state, batch):
  def loss(p):
    inputs, targets = batch
    return jnp.mean(jnp.sum((hsdp_predict(p, inputs) - targets) ** 2, axis=-1))
  value, grads = jax.value_and_grad(loss)(params)
  grads = jax.tree.map(lambda g: g / lax.axis_size("fsdp"), lax.pmean(grads, "replica"))
  updates, opt_state = TX.update(grads, opt_state, params)
  return (optax.apply_updates(params, updates), opt_state,
          lax.pmean(value, ("replica", "fsdp")))


HSDP_SPEC = [(P("fsdp"), P("fsdp"))] * 3
