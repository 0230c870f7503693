"""A training loop inside a `wus.pmap` step (PPO's epochs x minibatches, as
nested `lax.scan`s or a `fori_loop`): the optimizer state is sharded before the
loop and stays sharded between calls, as under `wus.shard_map`. pmap's squeeze
of the mapped axis and its expand_dims of the result sit between the state and
the loop; they run on the shards (found by a user-program sweep: 0 of 5 leaves
sharded)."""

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import wus
from helpers import assert_trees_equal, sharded_leaves

TX = optax.adam(1e-3)


def _minibatch(carry, xy):
  params, opt_state = carry
  x, y = xy
  grads = jax.grad(lambda p: jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2))(params)
  grads = jax.lax.pmean(grads, "batch")
  updates, opt_state = TX.update(grads, opt_state, params)
  return (optax.apply_updates(params, updates), opt_state), None


def nested_scans(params, opt_state, x, y):  # x: [epochs, minibatches, batch, 12]
  def epoch(carry, xy):
    return jax.lax.scan(_minibatch, carry, xy)
  (params, opt_state), _ = jax.lax.scan(epoch, (params, opt_state), (x, y))
  return params, opt_state


def fori(params, opt_state, x, y):
  x, y = x.reshape(-1, *x.shape[2:]), y.reshape(-1, *y.shape[2:])
  return jax.lax.fori_loop(0, x.shape[0], lambda i, c: _minibatch(c, (x[i], y[i]))[0],
                           (params, opt_state))


@pytest.mark.parametrize("train", [nested_scans, fori], ids=["nested scans", "fori_loop"])
def test_pmap_loop_keeps_optimizer_state_sharded(train):
  r = np.random.RandomState(0)
  params = {"w1": jnp.asarray(0.1 * r.randn(12, 64), jnp.float32),
            "w2": jnp.asarray(0.1 * r.randn(64, 4), jnp.float32)}
  x = r.randn(8, 3, 2, 4, 12).astype(np.float32)
  y = r.randn(8, 3, 2, 4, 4).astype(np.float32)
  out = {}
  for name, pmap in (("jax", jax.pmap), ("wus", wus.pmap)):
    step = pmap(train, axis_name="batch")
    state = flax.jax_utils.replicate((params, TX.init(params)))
    for _ in range(2):
      state = step(*state, x, y)
    out[name] = state
  assert len(sharded_leaves(out["wus"][1])) == 4, str(step.plan(*out["wus"], x, y))
  assert_trees_equal(out["jax"], wus.unshard(out["wus"]))
