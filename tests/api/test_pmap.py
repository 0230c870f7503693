"""`wus.pmap` is a drop-in for `jax.pmap`: same arguments, same meaning, same results."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import wus
from helpers import (PMAP_TX as TX, assert_trees_equal, pmap_params, pmap_step, pmap_xs,
                     sharded_leaves, stack)
from wus.analysis import causes, reasons
from wus.analysis.reasons import Reason


def test_keyword_arguments_are_mapped():
  ref, ws = jax.pmap(pmap_step, axis_name="batch"), wus.pmap(pmap_step, axis_name="batch")
  a = b = (stack(pmap_params()), stack(TX.init(pmap_params())))
  for i, x in enumerate(pmap_xs()):
    rngs = jax.random.split(jax.random.key(i), 8)
    a, b = ref(*a, x, dropout_rng=rngs)[:2], ws(*b, x, dropout_rng=rngs)[:2]
  assert_trees_equal(a[0], b[0])
  assert_trees_equal(a[1], wus.unshard(b[1]))
  assert sharded_leaves(b[1])


def test_in_axes_none_and_out_axes_none_as_the_flax_imagenet_example():
  """`pmap(step, in_axes=(None, 0), out_axes=(None, 0))`: unreplicated state in, out."""
  def step(state, x):
    params, opt_state = state
    params, opt_state, metrics = pmap_step(params, opt_state, x)
    return (params, opt_state), metrics

  kw = dict(axis_name="batch", in_axes=(None, 0), out_axes=(None, 0))
  ref, ws = jax.pmap(step, **kw), wus.pmap(step, **kw)
  a = b = (pmap_params(), TX.init(pmap_params()))
  for x in pmap_xs():
    (a, ma), (b, mb) = ref(a, x), ws(b, x)
  assert_trees_equal(a[0], b[0])
  assert_trees_equal(a[1], wus.unshard(b[1]))
  assert_trees_equal(ma, mb)
  assert b[0]["w"].shape == (24, 40) and sharded_leaves(b[1])


def test_static_broadcasted_and_donated_arguments():
  def step(params, opt_state, x, scale):
    return pmap_step(params, opt_state, x * scale)

  kw = dict(axis_name="batch", static_broadcasted_argnums=3)
  ref, ws = jax.pmap(step, **kw), wus.pmap(step, donate_argnames=("opt_state",), **kw)
  a = b = (stack(pmap_params()), stack(TX.init(pmap_params())))
  for x in pmap_xs():
    a, b = ref(*a, x, 2.0)[:2], ws(*b, x, 2.0)[:2]
  assert_trees_equal(a[1], wus.unshard(b[1]))
  old = b
  b = ws(*b, pmap_xs(1)[0], 2.0)[:2]
  with pytest.raises(ValueError, match="donated"):
    ws(*old, pmap_xs(1)[0], 2.0)


def test_copies_are_checked_on_every_call_wus_did_not_produce():
  """Equal copies on the first call, different on a later one (per-device values
  loaded by the user): the later call is planned for what it gets, and matches."""
  ref, ws = jax.pmap(pmap_step, axis_name="batch"), wus.pmap(pmap_step, axis_name="batch")
  a = b = (stack(pmap_params()), stack(TX.init(pmap_params())))
  x1, x2 = pmap_xs(2)
  a, b = ref(*a, x1)[:2], ws(*b, x1)[:2]
  a, b = jax.tree.map(np.array, a), jax.tree.map(np.array, wus.unshard(b))
  a[0]["w"][3] += 1.0  # Device 3's copy differs now.
  b[0]["w"][3] += 1.0
  a, b = ref(*a, x2)[:2], ws(*b, x2)[:2]
  assert_trees_equal(a[0], b[0])
  assert_trees_equal(a[1], wus.unshard(b[1]))
  assert sharded_leaves(b[1])  # Adam's moments are still equal copies: sharded.


def test_replicated_argnums_is_an_assertion_checked_on_every_new_argument():
  ws = wus.pmap(pmap_step, axis_name="batch", replicated_argnums=(0, 1))
  params, state = stack(pmap_params()), stack(TX.init(pmap_params()))
  x1, x2 = pmap_xs(2)
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
    params, opt_state, metrics = pmap_step(params, opt_state, x)
    return (params, stats, opt_state), metrics

  ref, ws = jax.pmap(step, axis_name="batch"), wus.pmap(step, axis_name="batch")
  stats = jax.random.normal(jax.random.key(3), (8, 24))  # Per device from the start.
  a = b = (stack(pmap_params()), stats, stack(TX.init(pmap_params())))
  for x in pmap_xs():
    a, b = ref(a, x)[0], ws(b, x)[0]
  assert_trees_equal(a, wus.unshard(b))
  assert sharded_leaves(b[2]) and not sharded_leaves(b[1])
  plan = ws.plan(b, pmap_xs(1)[0])
  stat = next(i for i in plan.inputs if i.name == "train_state[1]")
  differs = reasons.Differs(("batch",), causes.MAPPED_COPIES_DIFFER)
  assert not stat.sharded and stat.why == Reason(differs), stat.why


def test_typed_key_arguments():
  def step(params, opt_state, x, key):
    return pmap_step(params, opt_state, x, key)

  ref, ws = jax.pmap(step, axis_name="batch", in_axes=(0, 0, 0, None)), wus.pmap(
      step, axis_name="batch", in_axes=(0, 0, 0, None))
  a = b = (stack(pmap_params()), stack(TX.init(pmap_params())))
  for i, x in enumerate(pmap_xs()):
    a, b = ref(*a, x, jax.random.key(i))[:2], ws(*b, x, jax.random.key(i))[:2]
  assert_trees_equal(a[1], wus.unshard(b[1]))
