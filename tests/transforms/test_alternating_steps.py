"""Two steps alternating on one state (a GAN's discriminator and generator
steps, actor-critic): each updates its own part and returns the other's
unchanged. The part a step passes through stays sharded, in the format it
came in, instead of being gathered and re-sharded by every call (found by a
user-program sweep: half the optimizer state came back whole)."""

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state

import wus
from helpers import assert_trees_equal
from wus.analysis import reasons
from wus.analysis.reasons import Reason


class Generator(nn.Module):
  @nn.compact
  def __call__(self, z):
    return jnp.tanh(nn.Dense(12)(nn.relu(nn.Dense(32)(z))))


class Discriminator(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(1)(nn.leaky_relu(nn.Dense(32)(x), 0.2))[..., 0]


G, D = Generator(), Discriminator()
BCE = optax.sigmoid_binary_cross_entropy


def d_step(state, real, rng):
  z = jax.random.normal(jax.random.fold_in(rng, jax.lax.axis_index("batch")), (real.shape[0], 8))
  fake = G.apply({"params": state["g"].params}, z)

  def loss_fn(p):
    on_real, on_fake = D.apply({"params": p}, real), D.apply({"params": p}, fake)
    return jnp.mean(BCE(on_real, jnp.ones_like(on_real)) + BCE(on_fake, jnp.zeros_like(on_fake)))
  loss, grads = jax.value_and_grad(loss_fn)(state["d"].params)
  grads = jax.lax.pmean(grads, "batch")
  return {"g": state["g"], "d": state["d"].apply_gradients(grads=grads)}, loss


def g_step(state, rng):
  z = jax.random.normal(jax.random.fold_in(rng, jax.lax.axis_index("batch")), (4, 8))

  def loss_fn(p):
    on_fake = D.apply({"params": state["d"].params}, G.apply({"params": p}, z))
    return jnp.mean(BCE(on_fake, jnp.ones_like(on_fake)))
  loss, grads = jax.value_and_grad(loss_fn)(state["g"].params)
  grads = jax.lax.pmean(grads, "batch")
  return {"g": state["g"].apply_gradients(grads=grads), "d": state["d"]}, loss


def _big(tree):
  return [x for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, wus.ShardedArray))
          if np.size(x) > 16]


def test_state_passed_through_stays_sharded_and_matches_jax_pmap():
  tx = optax.adam(2e-3, b1=0.5)
  state = {"g": train_state.TrainState.create(
               apply_fn=G.apply, params=G.init(jax.random.key(0), jnp.ones((1, 8)))["params"],
               tx=tx),
           "d": train_state.TrainState.create(
               apply_fn=D.apply, params=D.init(jax.random.key(1), jnp.ones((1, 12)))["params"],
               tx=tx)}
  reals = np.random.RandomState(0).randn(3, 8, 4, 12).astype(np.float32)
  out = {}
  for name, pmap in (("jax", jax.pmap), ("wus", wus.pmap)):
    dstep = pmap(d_step, axis_name="batch", in_axes=(0, 0, None))
    gstep = pmap(g_step, axis_name="batch", in_axes=(0, None))
    st = flax.jax_utils.replicate(state)
    for s in range(3):
      st, _ = dstep(st, reals[s], jax.random.key(s))
      st, _ = gstep(st, jax.random.key(100 + s))
    out[name] = st
  for part in ("g", "d"):
    big = _big(out["wus"][part].opt_state)
    assert big and all(isinstance(x, wus.ShardedArray) for x in big), part
  plan = dstep.plan(out["wus"], reals[0], jax.random.key(0))
  # The discriminator's step returns the generator's Adam state as it came: kept sharded,
  # as the generator's step left it, for that reason (and nothing else is).
  passed = {i.name for i in plan.inputs if i.why == Reason(reasons.PassedThrough())}
  assert passed == {f"state['g'].opt_state[0].{m}['{layer}']['{k}']" for m in ("mu", "nu")
                    for layer in ("Dense_0", "Dense_1") for k in ("bias", "kernel")}, passed
  assert all(i.sharded for i in plan.inputs if i.name in passed)
  assert_trees_equal(out["jax"], wus.unshard(out["wus"]))
