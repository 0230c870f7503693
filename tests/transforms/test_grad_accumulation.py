"""Gradient accumulation over micro-batches in a `lax.scan`, as big_vision-style
steps write it (§4.2: training loops inside the program).

Under check_vma=True, AD all-reduces each micro-batch's gradient inside the
loop (the replicated params are invariant), so the loop accumulates the
gradient on shards: each iteration reduce-scatters, and the accumulator
leaves the loop as shards. The update after the loop then runs on those
shards with its optimizer state sharded, like any weight update; under
check_vma=False the all-reduce comes after the loop, as the user wrote it.
"""

import jax
import jax.numpy as jnp
import optax
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import wus
from helpers import assert_trees_equal, mesh, run_both, sharded_leaves

MICRO = 4


def _loss(params, x):
  return jnp.mean(jnp.tanh(x @ params["w"] + params["b"]) ** 2)


def accumulating_step(tx):
  def step(params, opt_state, xs):
    def add(acc, x):
      return jax.tree.map(jnp.add, acc, jax.grad(_loss)(params, x)), None

    grads, _ = lax.scan(add, jax.tree.map(jnp.zeros_like, params), xs)
    grads = lax.pmean(jax.tree.map(lambda g: g / xs.shape[0], grads), "data")
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state
  return step


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "novma"])
@pytest.mark.parametrize("n", [8, 6])
def test_update_after_an_accumulation_loop_runs_on_shards(check_vma, n):
  m = mesh(n)
  tx = optax.adam(1e-2)
  k = jax.random.split(jax.random.key(0), 2)
  params = {"w": 0.1 * jax.random.normal(k[0], (64, 96)), "b": jnp.zeros(96)}
  kw = dict(mesh=m, in_specs=(P(), P(), P(None, "data")), out_specs=(P(), P()),
            check_vma=check_vma)
  batches = [jax.device_put(jax.random.normal(jax.random.key(i), (MICRO, 2 * n, 64)),
                            NamedSharding(m, P(None, "data"))) for i in range(3)]
  a, b, ws = run_both(accumulating_step(tx), (params, tx.init(params)), batches, **kw)
  xs = batches[-1]
  assert_trees_equal(a[0], b[0])  # Elementwise update: bit for bit.
  assert_trees_equal(a[1], wus.unshard(b[1]))
  assert {x.format.shape for x in sharded_leaves(b[1])} == {(64, 96), (96,)}
  assert all(c.sharded for c in ws.plan(*b, xs).clusters)
