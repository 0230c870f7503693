"""Tensor parallel x data parallel (the shard_map tutorial's Megatron style): on
a ("data", "model") mesh, weights split over "model" and gradients pmean-ed over
"data". The state stays whole between steps, with the reason in the Plan
(sharded state is laid out over the replica axes only), instead of failing in
the program that shards it (a user-program sweep found the crash); the step
equals the unmodified one."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import wus
from helpers import assert_trees_equal

TX = optax.adam(1e-2)
PSPEC = {"w1": P(None, "model"), "w2": P("model", None)}
OSPEC = (optax.ScaleByAdamState(count=P(), mu=PSPEC, nu=PSPEC), optax.EmptyState())


def train_step(params, opt_state, x, y):
  def loss_fn(p):
    return jnp.mean((lax.psum(jax.nn.gelu(x @ p["w1"]) @ p["w2"], "model") - y) ** 2)
  loss, grads = jax.value_and_grad(loss_fn)(params)
  grads = lax.pmean(grads, "data")
  updates, opt_state = TX.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, lax.pmean(loss, "data")


@pytest.mark.parametrize("check_vma", [False, True])
def test_tensor_parallel_state_stays_whole_and_the_step_matches(check_vma):
  mesh = jax.make_mesh((4, 2), ("data", "model"))
  r = np.random.RandomState(0)
  params = {"w1": jnp.asarray(0.1 * r.randn(16, 64), jnp.float32),
            "w2": jnp.asarray(0.1 * r.randn(64, 16), jnp.float32)}

  def put(tree, specs):
    return jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), tree, specs,
                        is_leaf=lambda x: isinstance(x, P))

  kw = dict(mesh=mesh, in_specs=(PSPEC, OSPEC, P("data"), P("data")),
            out_specs=(PSPEC, OSPEC, P()), check_vma=check_vma)
  ref, ws = jax.jit(jax.shard_map(train_step, **kw)), wus.shard_map(train_step, **kw)
  a = b = (put(params, PSPEC), put(TX.init(params), OSPEC))
  for _ in range(3):
    x, y = (jax.device_put(r.randn(32, 16).astype(np.float32), NamedSharding(mesh, P("data")))
            for _ in range(2))
    a, b = ref(*a, x, y)[:2], ws(*b, x, y)[:2]
  assert_trees_equal(a, b)
  plan = ws.plan(*b, x, y)
  mu = [i for i in plan.inputs if ".mu[" in i.name]
  assert mu and all(not i.sharded and "split over ['model']" in i.reason for i in mu), str(plan)
