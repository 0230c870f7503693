"""Sharded state handled as pmap trainers handle replicated state fails loudly,
saying what to do, instead of losing the state: a user-program sweep found
`flax.jax_utils.unreplicate`, big_vision's `tree_map(lambda x: np.array(x[0]))`
and flax's serialization silently turning shards into scalars."""

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import wus
from helpers import assert_trees_equal

N = 8
TX = optax.adam(1e-2)


def train_step(params, opt_state, x):
  grads = lax.pmean(jax.grad(lambda p: jnp.mean(jnp.tanh(x @ p["w"]) ** 2))(params), "batch")
  updates, opt_state = TX.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state


@pytest.fixture(scope="module")
def trained():
  params = {"w": jnp.asarray(np.random.RandomState(0).randn(16, 64), jnp.float32)}
  state = flax.jax_utils.replicate((params, TX.init(params)))
  x = np.random.RandomState(1).randn(N, 2, 16).astype(np.float32)
  ref = jax.pmap(train_step, axis_name="batch")(*state, x)
  got = wus.pmap(train_step, axis_name="batch")(*state, x)
  assert isinstance(got[1][0].mu["w"], wus.ShardedArray)
  return ref, got


@pytest.mark.parametrize("per_leaf", [
    pytest.param(lambda t: jax.tree.map(lambda x: np.array(x[0]), t), id="tree_map x[0]"),
    pytest.param(lambda t: jax.tree.map(lambda x: x.reshape(-1)[:3], t), id="tree_map reshape"),
])
def test_per_leaf_functions_on_sharded_state_say_to_unshard(trained, per_leaf):
  with pytest.raises(TypeError, match=r"wus\.unshard\(tree\) first"):
    per_leaf(trained[1][1])


def test_unreplicate_of_sharded_state_fails(trained):
  """flax.jax_utils.unreplicate squeezes each device's shard inside JAX, before
  wus sees the result: it fails there (JAX's own error), not silently."""
  with pytest.raises(ValueError, match="squeeze"):
    flax.jax_utils.unreplicate(trained[1][1])


def test_flax_msgpack_serialization_of_sharded_state_fails(trained):
  """flax.serialization.to_bytes (msgpack checkpoints) cannot encode it: loud."""
  with pytest.raises(TypeError, match="ShardedArray"):
    flax.serialization.to_bytes(trained[1][1])


def test_unshard_then_unreplicate_gives_the_state(trained):
  ref, got = trained
  assert_trees_equal(flax.jax_utils.unreplicate(ref),
                     flax.jax_utils.unreplicate(wus.unshard(got)))


def test_shape_preserving_maps_keep_the_sharded_array(trained):
  """Casts and copies keep the padded shards: they stay ShardedArrays."""
  out = jax.tree.map(lambda x: x.astype(jnp.float32), trained[1][1])
  assert isinstance(out[0].mu["w"], wus.ShardedArray)
