"""Gradient all-reduces that AD leaves inside a sub-jaxpr (check_vma=True, the
default): a weight read inside `jax.checkpoint` (nn.remat), inside a `lax.cond`
(LayerDrop, stochastic depth), or stacked and scanned over (nn.scan over
layers) has its pvary's transpose, the psum, inside that construct's backward
pass. wus hoists it out (`transforms.inline`), so the update beside it shards:
found by a user-program sweep, where these weights kept their Adam state whole."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import wus
from helpers import assert_trees_equal, mesh, run_both

N = 8
TX = optax.adam(1e-2)


def control_flow_step(check_vma):
  def train_step(params, opt_state, x, y, drop):
    def loss_fn(p):
      h = jax.checkpoint(lambda w, h: jnp.tanh(h @ w))(p["remat"], x)
      h = lax.cond(drop, lambda h: h, lambda h: h + jnp.tanh(h @ p["cond"]), h)
      h, _ = lax.scan(lambda h, w: (jnp.tanh(h @ w), None), h, p["scan"])
      loss = jnp.mean((h @ p["head"] - y) ** 2)
      return lax.pmean(loss, "data") if check_vma else loss
    loss, grads = jax.value_and_grad(loss_fn)(params)
    if not check_vma:
      grads = lax.pmean(grads, "data")
    updates, opt_state = TX.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss
  return train_step


def _control_flow_inputs():
  r = np.random.RandomState(0)
  params = {"remat": r.randn(32, 32), "cond": r.randn(32, 32), "scan": r.randn(3, 32, 32),
            "head": r.randn(32, 4)}
  params = jax.tree.map(lambda a: jnp.asarray(0.1 * a, jnp.float32), params)
  data = NamedSharding(mesh(N), P("data"))
  xs = [tuple(jax.device_put(r.randn(2 * N, d).astype(np.float32), data) for d in (32, 4))
        + (jnp.bool_(k == 1),) for k in range(3)]  # The cond skips the layer in step 1.
  return params, xs


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("group_size", [None, 4])
def test_weights_read_in_remat_cond_and_scan_shard_their_state(check_vma, group_size):
  params, xs = _control_flow_inputs()
  step = control_flow_step(check_vma)
  ref = jax.jit(jax.shard_map(step, mesh=mesh(N), check_vma=check_vma,
                              in_specs=(P(), P(), P("data"), P("data"), P()),
                              out_specs=(P(), P(), P())))
  ws = wus.shard_map(step, mesh=mesh(N), check_vma=check_vma, shard_group_size=group_size,
                     in_specs=(P(), P(), P("data"), P("data"), P()), out_specs=(P(), P(), P()))
  a = b = (params, TX.init(params))
  for x in xs:
    a, b = ref(*a, *x)[:2], ws(*b, *x)[:2]
  mu = b[1][0].mu
  assert all(isinstance(mu[k], wus.ShardedArray) for k in params), {
      k: type(v).__name__ for k, v in mu.items()}
  # Groups sum in another order (test_partial.py), and Adam divides by tiny second moments.
  rounding = {} if group_size is None else dict(rtol=1e-5, atol=1e-5)
  assert_trees_equal(a, wus.unshard(b), **rounding)


class Block(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    y = nn.LayerNorm()(x)
    return x + nn.Dense(16)(jnp.tanh(y)), None


class ScannedNet(nn.Module):
  """Layers stacked with nn.scan over a remat'd block, as scan_layers models write it."""

  @nn.compact
  def __call__(self, x):
    block = nn.scan(nn.remat(Block), variable_axes={"params": 0}, split_rngs={"params": True},
                    length=3)
    x, _ = block(name="layers")(x, None)
    return nn.Dense(4)(x)


def test_flax_scan_over_remat_layers_shards_every_layer_state():
  model = ScannedNet()
  r = np.random.RandomState(1)
  params = model.init(jax.random.key(0), jnp.zeros((2, 16)))["params"]

  def train_step(params, opt_state, batch):
    x, y = batch

    def loss_fn(params):
      return lax.pmean(jnp.mean((model.apply({"params": params}, x) - y) ** 2), "data")
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = TX.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  data = NamedSharding(mesh(N), P("data"))
  xs = [tuple(jax.device_put(r.randn(2 * N, d).astype(np.float32), data) for d in (16, 4))
        for _ in range(3)]
  want, got, ws = run_both(train_step, (params, TX.init(params)), xs, mesh=mesh(N),
                           in_specs=(P(), P(), P("data")), out_specs=(P(), P()))
  assert_trees_equal(want, wus.unshard(got))
  layers = jax.tree.leaves(got[1][0].mu["layers"],
                           is_leaf=lambda x: isinstance(x, wus.ShardedArray))
  assert len(layers) == 4 and all(isinstance(x, wus.ShardedArray) for x in layers), str(
      ws.plan(*want, xs[0]))
