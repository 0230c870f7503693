"""`wus.pmap` is a drop-in for `jax.pmap`: same arguments, same meaning, same results."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import wus
from helpers import assert_trees_equal, sharded_leaves


def _stack(tree, n=8):
  return jax.tree.map(lambda x: jnp.broadcast_to(x, (n,) + jnp.shape(x)), tree)


def _params():
  k = jax.random.split(jax.random.key(0), 2)
  return {"w": 0.1 * jax.random.normal(k[0], (24, 40)), "b": 0.1 * jax.random.normal(k[1], (40,))}


def _loss(params, x, rng=None):
  if rng is not None:
    x = jnp.where(jax.random.bernoulli(rng, 0.9, x.shape), x, 0.0)
  return jnp.mean(jnp.tanh(x @ params["w"] + params["b"]) ** 2)


TX = optax.adam(1e-2)


def _step(params, opt_state, x, dropout_rng=None):
  """Flax WMT style: the dropout key is a keyword argument."""
  rng = None if dropout_rng is None else jax.random.fold_in(dropout_rng, jax.lax.axis_index("batch"))
  loss, grads = jax.value_and_grad(_loss)(params, x, rng)
  grads = jax.lax.pmean(grads, "batch")
  updates, opt_state = TX.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, {"loss": jax.lax.pmean(loss, "batch")}


def _xs(steps=3, n=8):
  return [jax.random.normal(jax.random.key(10 + i), (n, 2, 24)) for i in range(steps)]


def test_keyword_arguments_are_mapped():
  ref, ws = jax.pmap(_step, axis_name="batch"), wus.pmap(_step, axis_name="batch")
  a = b = (_stack(_params()), _stack(TX.init(_params())))
  for i, x in enumerate(_xs()):
    rngs = jax.random.split(jax.random.key(i), 8)
    a, b = ref(*a, x, dropout_rng=rngs)[:2], ws(*b, x, dropout_rng=rngs)[:2]
  assert_trees_equal(a[0], b[0])
  assert_trees_equal(a[1], wus.unshard(b[1]))
  assert sharded_leaves(b[1])


def test_in_axes_none_and_out_axes_none_as_the_flax_imagenet_example():
  """`pmap(step, in_axes=(None, 0), out_axes=(None, 0))`: unreplicated state in, out."""
  def step(state, x):
    params, opt_state = state
    params, opt_state, metrics = _step(params, opt_state, x)
    return (params, opt_state), metrics

  kw = dict(axis_name="batch", in_axes=(None, 0), out_axes=(None, 0))
  ref, ws = jax.pmap(step, **kw), wus.pmap(step, **kw)
  a = b = (_params(), TX.init(_params()))
  for x in _xs():
    (a, ma), (b, mb) = ref(a, x), ws(b, x)
  assert_trees_equal(a[0], b[0])
  assert_trees_equal(a[1], wus.unshard(b[1]))
  assert_trees_equal(ma, mb)
  assert b[0]["w"].shape == (24, 40) and sharded_leaves(b[1])


def test_static_broadcasted_and_donated_arguments():
  def step(params, opt_state, x, scale):
    return _step(params, opt_state, x * scale)

  kw = dict(axis_name="batch", static_broadcasted_argnums=3)
  ref, ws = jax.pmap(step, **kw), wus.pmap(step, donate_argnames=("opt_state",), **kw)
  a = b = (_stack(_params()), _stack(TX.init(_params())))
  for x in _xs():
    a, b = ref(*a, x, 2.0)[:2], ws(*b, x, 2.0)[:2]
  assert_trees_equal(a[1], wus.unshard(b[1]))
  old = b
  b = ws(*b, _xs(1)[0], 2.0)[:2]
  with pytest.raises(ValueError, match="donated"):
    ws(*old, _xs(1)[0], 2.0)


def test_copies_are_checked_on_every_call_wus_did_not_produce():
  """Equal copies on the first call, different on a later one (per-device values
  loaded by the user): the later call is planned for what it gets, and matches."""
  ref, ws = jax.pmap(_step, axis_name="batch"), wus.pmap(_step, axis_name="batch")
  a = b = (_stack(_params()), _stack(TX.init(_params())))
  x1, x2 = _xs(2)
  a, b = ref(*a, x1)[:2], ws(*b, x1)[:2]
  a, b = jax.tree.map(np.array, a), jax.tree.map(np.array, wus.unshard(b))
  a[0]["w"][3] += 1.0  # Device 3's copy differs now.
  b[0]["w"][3] += 1.0
  a, b = ref(*a, x2)[:2], ws(*b, x2)[:2]
  assert_trees_equal(a[0], b[0])
  assert_trees_equal(a[1], wus.unshard(b[1]))
  assert sharded_leaves(b[1])  # Adam's moments are still equal copies: sharded.


def test_replicated_argnums_is_an_assertion_checked_on_every_new_argument():
  ws = wus.pmap(_step, axis_name="batch", replicated_argnums=(0, 1))
  params, state = _stack(_params()), _stack(TX.init(_params()))
  x1, x2 = _xs(2)
  ws(params, state, x1)
  differ = jax.tree.map(lambda p: p.at[3].add(1.0), params)
  with pytest.raises(ValueError, match="per-device copies differ"):
    ws(differ, state, x2)


def test_one_state_argument_with_per_device_statistics():
  """The Haiku ImageNet example keeps params, per-device BatchNorm statistics and
  optimizer state in one argument: the statistics stay whole, the rest shards."""
  def step(train_state, x):
    params, stats, opt_state = train_state
    stats = 0.9 * stats + 0.1 * jnp.mean(x, axis=0)  # Not all-reduced: differs per device.
    params, opt_state, metrics = _step(params, opt_state, x)
    return (params, stats, opt_state), metrics

  ref, ws = jax.pmap(step, axis_name="batch"), wus.pmap(step, axis_name="batch")
  stats = jax.random.normal(jax.random.key(3), (8, 24))  # Per device from the start.
  a = b = (_stack(_params()), stats, _stack(TX.init(_params())))
  for x in _xs():
    a, b = ref(a, x)[0], ws(b, x)[0]
  assert_trees_equal(a, wus.unshard(b))
  assert sharded_leaves(b[2]) and not sharded_leaves(b[1])
  plan = ws.plan(b, _xs(1)[0])
  stat = next(i for i in plan.inputs if i.name == "[0][1]")
  assert not stat.sharded and "per-device copies differ" in stat.reason


def test_typed_key_arguments():
  def step(params, opt_state, x, key):
    return _step(params, opt_state, x, key)

  ref, ws = jax.pmap(step, axis_name="batch", in_axes=(0, 0, 0, None)), wus.pmap(
      step, axis_name="batch", in_axes=(0, 0, 0, None))
  a = b = (_stack(_params()), _stack(TX.init(_params())))
  for i, x in enumerate(_xs()):
    a, b = ref(*a, x, jax.random.key(i))[:2], ws(*b, x, jax.random.key(i))[:2]
  assert_trees_equal(a[1], wus.unshard(b[1]))
