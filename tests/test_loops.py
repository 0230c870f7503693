"""A training loop inside the step (§4.2, Fig. 4): state sharded across iterations."""

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import wus
from helpers import (assert_trees_equal, collective_bytes, hlo_computations, loop_bodies,
                     loss_fn, make_params)

K = 3  # Steps per call.


def _one_step(tx, params, opt_state, x):
  loss, grads = jax.value_and_grad(loss_fn)(params, x)
  grads = jax.lax.pmean(grads, "data")
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, "data")


def make_train(tx, form: str, wrap_state: bool = False):
  """K steps in one program, as a scan, a fori_loop or a while_loop."""
  def train(params, opt_state, xs):  # xs: [K, b, 16] per replica.
    if form == "scan":
      def body(c, x):
        p, s, loss = _one_step(tx, *c, x)
        return (p, s), loss
      (params, opt_state), losses = jax.lax.scan(body, (params, opt_state), xs)
    elif form == "fori":
      def body(i, c):
        return _one_step(tx, c[0], c[1], xs[i])[:2]
      params, opt_state = jax.lax.fori_loop(0, K, body, (params, opt_state))
      losses = jnp.zeros((K,))
    else:
      def body(c):
        i, p, s = c
        return (i + 1, *_one_step(tx, p, s, xs[i])[:2])
      _, params, opt_state = jax.lax.while_loop(lambda c: c[0] < K, body, (0, params, opt_state))
      losses = jnp.zeros((K,))
    return params, ({"state": opt_state} if wrap_state else opt_state), losses
  return train


def _setup(mesh, tx, form, wrap_state=False):
  params = make_params()
  xs = jax.device_put(jax.random.normal(jax.random.key(5), (K, 2 * mesh.shape["data"], 16)),
                      NamedSharding(mesh, P(None, "data")))
  kw = dict(mesh=mesh, in_specs=(P(), P(), P(None, "data")), out_specs=(P(), P(), P()))
  fn = make_train(tx, form, wrap_state)
  return params, tx.init(params), xs, jax.jit(jax.shard_map(fn, **kw)), wus.shard_map(fn, **kw)


FORMS = ["scan", "fori", "while"]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("name,make_tx,tol", [
    ("adam", lambda: optax.adam(1e-2), {}),
    ("lars", lambda: optax.lars(0.1), dict(rtol=2e-6, atol=1e-7)),
])
def test_loop_matches_unmodified_and_keeps_state_sharded(form, name, make_tx, tol):
  mesh = jax.make_mesh((8,), ("data",))
  params, state, xs, ref, ws = _setup(mesh, make_tx(), form)
  a, b = (params, state), (params, state)
  for _ in range(2):  # Two calls: state stays sharded between them too.
    a, b = ref(*a, xs)[:2], ws(*b, xs)[:2]
  assert_trees_equal(a[0], b[0], **tol)
  assert_trees_equal(a[1], wus.unshard(b[1]), **tol)
  leaves = jax.tree.leaves(b[1], is_leaf=lambda x: isinstance(x, wus.ShardedArray))
  assert sum(isinstance(x, wus.ShardedArray) for x in leaves) >= 4  # Per big weight.


def test_optimizer_state_gathered_after_the_loop_only():
  """Fig. 4 left: in the loop, only the weights are all-gathered; state after it."""
  mesh = jax.make_mesh((8,), ("data",))
  params, state, xs, ref, ws = _setup(mesh, optax.adam(1e-2), "scan", wrap_state=True)
  out_ref, out = ref(params, state, xs), ws(params, state, xs)
  assert_trees_equal(out_ref[1], out[1])  # Returned whole: gathered after the loop.
  hlo = ws.lower(params, state, xs).compile().as_text()
  comps, bodies = hlo_computations(hlo), loop_bodies(hlo)
  inside = [n for name in bodies for n in collective_bytes(comps.get(name, []), "all-gather")]
  outside = [n for name in comps if name not in bodies
             for n in collective_bytes(comps[name], "all-gather")]
  big = 1024 * 1024 * 4
  assert sorted(inside)[-1] == big and inside.count(big) == 1  # The weight, once per step.
  assert outside.count(big) == 2  # mu and nu of `big`, once per call.
