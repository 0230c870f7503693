"""The rewritten step computes what the unmodified step computes (DESIGN.md §4, invariant 1)."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import parity_worker
import wus
from helpers import (REDUCING, SPECS, assert_trees_equal, both, first_args, inputs, make_step,
                     mesh, run, sharded_leaves)


OPTIMIZERS = [
    ("sgd", lambda: optax.sgd(0.1)),
    ("momentum", lambda: optax.sgd(0.1, momentum=0.9)),
    ("nesterov", lambda: optax.sgd(0.1, momentum=0.9, nesterov=True)),
    ("adam", lambda: optax.adam(1e-2)),
    ("adamw", lambda: optax.adamw(1e-2, weight_decay=0.1)),
    ("rmsprop", lambda: optax.rmsprop(1e-2)),
    ("adagrad", lambda: optax.adagrad(1e-2)),
    ("lion", lambda: optax.lion(1e-3)),
    ("adabelief", lambda: optax.adabelief(1e-2)),
    ("schedule", lambda: optax.chain(
        optax.scale_by_adam(mu_dtype=jnp.float32),
        optax.scale_by_schedule(optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10)),
        optax.scale(-1.0))),
]


# The default profile runs every optimizer under check_vma=True (jax.shard_map's default)
# and adam under both; the other check_vma=False cases are opt-in (--slow).
@pytest.mark.parametrize("name,make_tx,check_vma", [
    pytest.param(name, make, vma, id=f"{name}-{'vma' if vma else 'novma'}",
                 marks=() if vma or name == "adam" else pytest.mark.slow)
    for vma in (True, False) for name, make in OPTIMIZERS])
def test_matches_unmodified_step(name, make_tx, check_vma):
  ref, got, step = both(make_tx(), mesh(), check_vma=check_vma)
  params, state, extra, loss = got
  assert sharded_leaves(state) or name == "sgd", "optimizer state should stay sharded"
  assert_trees_equal(ref[0], params)
  assert_trees_equal(ref[1], wus.unshard(state))
  assert_trees_equal(ref[2], extra)
  assert_trees_equal(ref[3], loss)


def test_sharded_state_keeps_tree_structure_and_global_layout():
  ref, (params, state, _, _), step = both(optax.adam(1e-2), mesh())
  assert jax.tree.structure(wus.unshard(state)) == jax.tree.structure(ref[1])
  mu = state[0].mu
  assert isinstance(mu["big"], wus.ShardedArray) and mu["big"].shape == (1024, 1024)
  assert isinstance(mu["conv"], wus.ShardedArray) and mu["conv"].shape == (3, 3, 5, 7)
  # Global jax.Array laid out across the mesh: 315 elements -> 8 shards of 40.
  data = mu["conv"].data
  assert data.shape == (320,) and len(data.sharding.device_set) == 8
  assert {s.data.shape for s in data.addressable_shards} == {(40,)}
  assert not isinstance(state[0].count, wus.ShardedArray)  # Scalars stay whole.
  assert not isinstance(mu["v7"], wus.ShardedArray)        # Fewer elements than replicas.


def test_with_default_xla_flags_within_a_few_ulps():
  """Under XLA's default flags (FMA contraction, excess precision: see
  conftest) the two programs may round differently: `parity_worker` runs
  Adam in a process whose XLA_FLAGS set only the device count."""
  env = dict(os.environ, XLA_FLAGS=parity_worker.FLAGS)
  done = subprocess.run([sys.executable, parity_worker.__file__], env=env, capture_output=True,
                        text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]


def test_unshard_passes_plain_trees_through():
  tree = {"a": jnp.ones(3), "b": [1, None]}
  out = wus.unshard(tree)
  assert out["a"] is tree["a"] and out["b"] == [1, None]


def _stack(tree, n=8):
  return jax.tree.map(lambda x: jnp.broadcast_to(x, (n,) + jnp.shape(x)), tree)


@pytest.mark.parametrize("name,make_tx", [
    pytest.param(*OPTIMIZERS[1], id="momentum", marks=pytest.mark.slow),
    pytest.param(*OPTIMIZERS[3], id="adam")])
def test_pmap_matches_jax_pmap(name, make_tx):
  from helpers import make_params, make_step
  tx = make_tx()
  params = make_params()
  counter = {"counter": jnp.arange(16, dtype=jnp.int32)}
  args = (_stack(params), _stack(tx.init(params)), _stack(counter))
  step = make_step(tx, axis="batch")
  ref = jax.pmap(step, axis_name="batch")
  ws = wus.pmap(step, axis_name="batch", replicated_argnums=(0, 1, 2))
  a = b = args
  for i in range(3):
    x = jax.random.normal(jax.random.key(i), (8, 2, 16))
    a, b = ref(*a, x)[:3], ws(*b, x)[:3]
  big = [x for x in sharded_leaves(b[1]) if x.format.shape == (1, 1024, 1024)]
  assert big and big[0].shape == (8, 1024, 1024)  # Sharded, in pmap's stacked layout.
  assert_trees_equal(a[0], b[0])
  assert_trees_equal(a[1], wus.unshard(b[1]))
  assert_trees_equal(a[2], b[2])


def test_pmap_rejects_replicated_argument_with_differing_copies():
  from helpers import make_step
  tx = optax.sgd(0.1)
  params = {"w": jnp.arange(8 * 64, dtype=jnp.float32).reshape(8, 64)}  # Copies differ.
  ws = wus.pmap(lambda p, s, e, x: make_step(tx, "b")(p, s, e, x), axis_name="b",
                replicated_argnums=(0, 1))
  with pytest.raises(ValueError, match="per-device copies differ"):
    ws(params, _stack(tx.init({"w": jnp.zeros(64)})), _stack({"counter": jnp.zeros(16, jnp.int32)}),
       jnp.ones((8, 2, 16)))


# Every optimizer of helpers.REDUCING (norms: lars, lamb, clip_by_global_norm,
# adafactor's factored moments, adaptive_grad_clip, scale_by_trust_ratio) runs
# there at N = 8; here at N = 6 too.
SIX = [OPTIMIZERS[1], OPTIMIZERS[3], *REDUCING]


@pytest.mark.parametrize("name,make_tx", [
    pytest.param(name, make, id=name, marks=() if name in ("adam", "lars") else pytest.mark.slow)
    for name, make in SIX])
def test_six_replicas(name, make_tx):
  """A replica count that is not a power of two: every shape pads differently
  ([7], [3,3,5,7], [64] and [1024,1024] are not multiples of 6)."""
  ref, got, step = both(make_tx(), mesh(6))
  tol = dict(rtol=2e-6, atol=1e-7) if (name, make_tx) in REDUCING else {}
  assert_trees_equal(ref[0], got[0], **tol)
  assert_trees_equal(ref[1], wus.unshard(got[1]), **tol)
  state = sharded_leaves(got[1])
  assert all(x.format.num_shards == 6 for x in state)
  assert state or not jax.tree.leaves(got[1])  # adaptive_grad_clip then sgd: no state.
  plan = step.plan(*first_args(make_tx(), mesh(6)))
  big = [c for c in plan.clusters if any(t.shape == (1024, 1024) for t in c.tensors)]
  assert plan.num_shards == 6 and big and all(c.sharded for c in big), str(plan)


@pytest.mark.parametrize("n", [8, 6])
def test_multisteps_update_inside_a_cond_is_sharded(n):
  """optax.MultiSteps runs the update inside a cond: branches run on shards."""
  tx = optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2)
  ref, got, step = both(tx, mesh(n), steps=4)  # Both branches taken.
  assert_trees_equal(ref[0], got[0])
  assert_trees_equal(ref[1], wus.unshard(got[1]))
  acc = got[1].acc_grads["big"]
  assert isinstance(acc, wus.ShardedArray) and isinstance(got[1].inner_opt_state[0].mu["big"],
                                                          wus.ShardedArray)
  assert acc.format.num_shards == n


@pytest.mark.parametrize("n", [8, 6])
def test_apply_if_finite_skips_the_step_only_one_shard_sees(n):
  """`optax.apply_if_finite`: all(isfinite(g)) per tensor is a masked local
  reduce_and on the shard, combined across replicas (as an all-reduce min).
  The one NaN of step 2 sits in rows of `big` that a single replica's shard
  holds, so a shard-local answer would update on the other replicas."""
  tx = optax.apply_if_finite(optax.adam(1e-2), max_consecutive_errors=3)
  params, state, extra, data = inputs(tx, mesh(n), steps=4)
  bad = np.array(data[1])
  bad[0, 0] = np.inf  # Replica 0's first example.
  data[1] = jax.device_put(bad, data[1].sharding)
  step = make_step(tx)
  ref = jax.jit(jax.shard_map(step, mesh=mesh(n), **SPECS))
  ws = wus.shard_map(step, mesh=mesh(n), **SPECS)
  want, got = run(ref, params, state, extra, data), run(ws, params, state, extra, data)
  assert int(want[1].total_notfinite) == 1  # The reference skipped step 2.
  assert_trees_equal(want[0], got[0])
  assert_trees_equal(want[1], wus.unshard(got[1]))
  assert isinstance(got[1].inner_state[0].mu["big"], wus.ShardedArray)
