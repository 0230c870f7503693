"""What the differential fuzzer's long profile over `wus.jit` found (issue 37), each case
shrunk to the program that shows it (the fuzzer's own cases: tests/fuzz_cases.py).

Each step runs under `jax.jit` and under `wus.jit` from the same inputs, under the user's
`jax.set_mesh`, and must agree bit for bit (Adam's update is elementwise). A finding wus
does not serve yet is marked xfail(strict=True) with the reason; the test states what it
will do once served, so it fails the day it is (strict) and its mark comes off.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P, reshard

import wus
from helpers import assert_trees_equal
from wus.sharded import is_sharded


def _mesh(shape, names, kind):
  types = (AxisType.Auto if kind == "auto" else AxisType.Explicit,) * len(shape)
  return jax.make_mesh(shape, names, axis_types=types,
                       devices=jax.devices()[:int(np.prod(shape))])


def _run(mesh, step, params, specs, batch, steps=2, tolerance=0.0):
  """`step` under jax.jit and wus.jit from `params` placed by `specs` and `tx.init`'s state:
  (the unmodified step's outputs, wus's, wus's Plan); bit for bit, or within `tolerance`
  (rtol and atol)."""
  with jax.set_mesh(mesh):
    params = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}
    want = got = (params, step.tx.init(params))
    ws = wus.jit(step)
    for _ in range(steps):
      want, got = jax.jit(step)(*want, batch), ws(*got, batch)
    plan = ws.plan(*got, batch)
  assert_trees_equal(want, wus.unshard(got), rtol=tolerance, atol=tolerance)
  return want, got, plan


def _fraction(state, mesh) -> float:
  """Optimizer state per device against 1/(mesh devices) of a copy (1: ideal)."""
  return wus.bytes_per_device(state).fraction * mesh.devices.size


def _fsdp_mlp(tx, explicit):
  """A kernel placed over the batch axis "data" (FSDP; on Explicit axes resharded whole
  before use, as JAX's sharding guide writes FSDP) and a whole head of 5 columns."""
  def step(params, opt_state, x):
    def loss(p):
      w = reshard(p["w"], P()) if explicit else p["w"]
      return jnp.mean(jnp.tanh(jnp.tanh(x @ w) @ p["head"]) ** 2)
    updates, opt_state = tx.update(jax.grad(loss)(params), opt_state, params)
    return optax.apply_updates(params, updates), opt_state
  step.tx = tx
  return step


_EPS = float(jnp.finfo(jnp.float32).eps)


@pytest.mark.parametrize("kind", ["auto", "explicit"])
@pytest.mark.parametrize("tx,tolerance", [
    (optax.MultiSteps(optax.adam(1e-2), 2), 0.0),
    (optax.apply_if_finite(optax.adam(1e-2), 2), 4 * _EPS),
    (optax.MultiSteps(optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2)), 2),
     1e-5),
    (optax.MultiSteps(optax.apply_if_finite(optax.adam(1e-2), 2), 2), 4 * _EPS)],
    ids=["multi_steps", "apply_if_finite", "multi_steps_clip", "multi_steps_apply_if_finite"])
def test_fsdp_with_a_conditional_update_shards_the_whole_weights_state(tx, tolerance, kind):
  """Fuzz cases (1-D FSDP over "data", Auto and Explicit, MultiSteps and apply_if_finite
  around Adam; embedding tables and kernels over "data"): the wrapper's one `cond` around
  every update read the FSDP kernel's block, computed apart on each replica, and the
  head's gradient together, so nothing was left to shard and the whole step ran as
  jax.jit runs it (issue 37 item 4). Served since the conditional is split into its
  independent parts (`transforms.cond_parts`): the FSDP kernel's state stays as placed
  and the head's is sharded over "data".

  MultiSteps is bit for bit. Under apply_if_finite, XLA's algebraic simplifier rewrites
  Adam's divisions by what it sees of each branch (`a / b / c` as `a / (b * c)` in the
  whole conditional, a division by the bias correction as a product with its
  reciprocal in the head's part), so an element may round 1 ulp away: within 4 ulps of
  the scale (about 1). Under MultiSteps of a clipped AdamW, the global norm in the emit
  branch joined the parts too: it runs before the conditional (`cond_parts.hoisted`),
  each part reads its scalar; within summation order (the norm sums blocks and shards).
  MultiSteps around apply_if_finite: the inner conditional, in the outer one's branch,
  is split first."""
  mesh = _mesh((4,), ("data",), kind)
  rng = np.random.default_rng(0)
  params = {"w": rng.standard_normal((16, 8)).astype(np.float32),
            "head": rng.standard_normal((8, 5)).astype(np.float32)}
  x = jax.device_put(rng.standard_normal((8, 16)).astype(np.float32),
                     NamedSharding(mesh, P("data")))
  _, got, plan = _run(mesh, _fsdp_mlp(tx, kind == "explicit"), params,
                      {"w": P("data", None), "head": P()}, x, steps=4, tolerance=tolerance)
  assert not plan.unchanged, plan.unchanged
  head = [x for x in jax.tree.leaves(got[1], is_leaf=is_sharded) if np.shape(x) == (8, 5)]
  assert head and all(is_sharded(x) for x in head), plan
  kernel = [x for x in jax.tree.leaves(got[1], is_leaf=is_sharded) if np.shape(x) == (16, 8)]
  assert kernel and all(x.addressable_shards[0].data.shape == (4, 8) for x in kernel), plan


@pytest.mark.parametrize("kind", ["auto", "explicit"])
@pytest.mark.parametrize("use", ["scale", "elementwise"])
def test_hsdp_block_not_summed_by_a_matmul_sharded_over_replica(use, kind):
  """Fuzz cases: HSDP on an Explicit (2, 2) ("replica", "fsdp") mesh with a LayerNorm-style
  [12, 21] scale placed over "fsdp" and resharded before use, its gradient a reduce_sum
  over the batch ("scale"); data x fsdp x tensor (2, 2, 1) with a [512, 2049] tensor used
  elementwise, times a statistic of the batch ("elementwise"). Their state stayed at 1/2
  of a copy per device (the placement's) where 1/4 is possible, as it is for kernels
  (tests/api/test_jit_explicit.py, "hsdp"). Served since FSDP blocks repeated over some
  copy axes are sharded over those (`layouts.assign_repeated`): 1/4."""
  mesh = _mesh((2, 2), ("replica", "fsdp"), kind)
  tx = optax.adam(1e-2)

  def step(params, opt_state, x):
    def loss(p):
      scale = reshard(p["scale"], P()) if kind == "explicit" else p["scale"]
      if use == "elementwise":
        return jnp.sum(jnp.sin(scale * jnp.mean(jnp.tanh(x))))
      a = jnp.tanh(x[:, :1] * jnp.linspace(-1.0, 1.0, 96) + x[:, 1:2]).reshape(-1, 8, 12)
      return jnp.mean(jnp.tanh(a * scale) ** 2)
    updates, opt_state = tx.update(jax.grad(loss)(params), opt_state, params)
    return optax.apply_updates(params, updates), opt_state
  step.tx = tx
  rng = np.random.default_rng(0)
  x = jax.device_put(rng.standard_normal((8, 16)).astype(np.float32),
                     NamedSharding(mesh, P(("replica", "fsdp"))))
  _, got, plan = _run(mesh, step, {"scale": rng.standard_normal((8, 12)).astype(np.float32)},
                      {"scale": P("fsdp", None)}, x)
  assert not plan.unchanged, plan.unchanged
  assert _fraction(got[1], mesh) <= 1.15, wus.bytes_per_device(got[1])


def test_explicit_mesh_elementwise_update_rounds_as_jax_jit_on_auto_axes():
  """Fuzz case (an Explicit ("data", "model") mesh of (3, 2), a [12] LayerNorm scale,
  MultiSteps of scale_by_adam, simplified AdEMAMix and scale_by_adam; shrunk to a 1-D
  mesh of 2 without MultiSteps): the chain is elementwise, and the new scale differed
  from jax.jit's by 2 ulps in 2 of 12 elements after one step. The difference is jax.jit's
  own: on some machines XLA:CPU compiles its Explicit-axes program (a sharding constraint
  on every value) so that it rounds otherwise than its Auto-axes program; on others (CI's
  newest JAX) the two agree. wus's region, manual over every axis, rounds as jax.jit does
  on Auto axes, bit for bit, everywhere; it is within a few ulps of the scale of jax.jit on
  Explicit axes, and equal where jax.jit's two programs are."""
  tx = optax.chain(optax.scale_by_adam(), optax.contrib.simplified_ademamix(1e-2),
                   optax.scale_by_adam())

  def step(scale, opt_state, x):
    def loss(scale):
      a = jnp.tanh(x[:, :1] * jnp.linspace(-1.0, 1.0, 12) + x[:, 1:2])
      a = (a - a.mean(-1, keepdims=True)) / jnp.sqrt(a.var(-1, keepdims=True) + 1e-5)
      return jnp.mean(jnp.tanh(a * scale) ** 2)
    updates, opt_state = tx.update(jax.grad(loss)(scale), opt_state, scale)
    return optax.apply_updates(scale, updates), opt_state

  rng = np.random.default_rng(0)
  scale = jnp.asarray(1 + 0.1 * rng.standard_normal(12), jnp.float32)
  x = rng.standard_normal((4, 16)).astype(np.float32)
  out = {}
  for kind in ("auto", "explicit"):
    mesh = _mesh((2,), ("data",), kind)
    with jax.set_mesh(mesh):
      batch = jax.device_put(x, NamedSharding(mesh, P("data")))
      out[kind] = jax.jit(step)(scale, tx.init(scale), batch)
      if kind == "explicit":
        got = wus.unshard(wus.jit(step)(scale, tx.init(scale), batch))
  assert_trees_equal(out["auto"], got)  # wus rounds as jax.jit does on Auto axes.
  ulp = float(jnp.finfo(jnp.float32).eps)  # Of the scale (about 1); state leaves cancel it.
  assert_trees_equal(out["explicit"], got, rtol=4 * ulp, atol=4 * ulp)


@pytest.mark.parametrize("kind", ["auto", "explicit"])
@pytest.mark.parametrize("make_tx,key", [
    (lambda: optax.chain(optax.scale_by_distance_over_gradients(), optax.adam(1e-2)),
     "init_params"),
    (lambda: optax.contrib.prodigy(1e-2), "params0")], ids=["dog", "prodigy"])
def test_state_returned_unchanged_kept_sharded(make_tx, key, kind):
  """Fuzz case (8 data replicas, Explicit axes, a chain with
  scale_by_distance_over_gradients): the initial parameters DoG keeps in its state are
  read by the update (its distance from them) and returned unchanged. The region did not
  return them, so they did not pair as state: kept whole, "read whole elsewhere", 2x the
  ideal optimizer state per device, where `wus.shard_map` keeps them sharded. Now the
  region passes them on and they stay sharded. Within summation order (the distance is
  a norm)."""
  mesh = _mesh((8,), ("data",), kind)
  tx = make_tx()

  def step(params, opt_state, x):
    loss = lambda p: jnp.mean(jnp.tanh(jnp.tanh(x @ p["w"]) @ p["head"]) ** 2)
    updates, opt_state = tx.update(jax.grad(loss)(params), opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  rng = np.random.default_rng(0)
  params = {"w": 0.3 * rng.standard_normal((16, 32)).astype(np.float32),
            "head": 0.3 * rng.standard_normal((32, 8)).astype(np.float32)}
  with jax.set_mesh(mesh):
    want = got = (params, tx.init(params))
    ws = wus.jit(step)
    for _ in range(3):
      x = jax.device_put(rng.standard_normal((16, 16)).astype(np.float32),
                         NamedSharding(mesh, P("data")))
      want, got = jax.jit(step)(*want, x), ws(*got, x)
  assert_trees_equal(want, wus.unshard(got), rtol=1e-5, atol=1e-7)
  kept = [x for p, x in jax.tree_util.tree_flatten_with_path(got[1], is_leaf=is_sharded)[0]
          if key in jax.tree_util.keystr(p)]
  assert kept and all(is_sharded(x) for x in kept), kept
  assert _fraction(got[1], mesh) <= 1.15, wus.bytes_per_device(got[1])


@pytest.mark.parametrize("kind", ["auto", "explicit"])
def test_a_constant_in_the_returned_state(kind):
  """Fuzz case (8 data replicas, Explicit axes, optimistic gradient descent in a chain):
  optax's optimistic gradient state holds a flag the update returns as the constant
  False, a literal among the step's outputs. Finding the region hashed every state
  output, and the literal is unhashable: wus's own error, and the step ran unchanged.
  Served, bit for bit."""
  mesh = _mesh((8,), ("data",), kind)
  tx = optax.optimistic_gradient_descent(0.1)

  def step(params, opt_state, x):
    loss = lambda p: jnp.mean(jnp.tanh(x @ p["w"]) ** 2)
    updates, opt_state = tx.update(jax.grad(loss)(params), opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  step.tx = tx
  rng = np.random.default_rng(0)
  x = jax.device_put(rng.standard_normal((16, 16)).astype(np.float32),
                     NamedSharding(mesh, P("data")))
  _, got, plan = _run(mesh, step, {"w": rng.standard_normal((16, 32)).astype(np.float32)},
                      {"w": P()}, x)
  assert not plan.unchanged, plan.unchanged
  assert _fraction(got[1], mesh) <= 1.15, wus.bytes_per_device(got[1])
