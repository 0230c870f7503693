"""pjit-era programs (issue 40 item 3): `jax.experimental.pjit.pjit` with PartitionSpec
shardings, called under the legacy `with mesh:` context, with `with_sharding_constraint`
inside, served by `wus.pjit` (`from wus import pjit`) and by `wus.jit` given the same
keywords. Each runs beside the unmodified pjit step from the same inputs: bit for bit under
the suite's flags, the optimizer state sharded (1/8 of each tensor per device).
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.experimental import mesh_utils
from jax.lax import with_sharding_constraint
from jax.sharding import Mesh, PartitionSpec as P

import wus
from helpers import assert_trees_equal
from wus.sharded import is_sharded

with warnings.catch_warnings():  # Deprecated in JAX, and what pjit-era code imports.
  warnings.simplefilter("ignore", DeprecationWarning)
  from jax.experimental.pjit import pjit

pytestmark = [pytest.mark.filterwarnings("ignore:.*context manager has been deprecated"),
              pytest.mark.filterwarnings("ignore:jax.experimental.pjit.pjit has been deprecated")]

TX = optax.adamw(1e-2)


def _init(key=jax.random.key(0), sizes=(16, 64, 64, 10)):
  keys = jax.random.split(key, len(sizes) - 1)
  return {f"layer{i}": {"w": jax.random.normal(k, (m, n)) / np.sqrt(m), "b": jnp.zeros(n)}
          for i, (k, m, n) in enumerate(zip(keys, sizes[:-1], sizes[1:], strict=True))}


def train_step(params, opt_state, batch):
  """A pjit-era step (the shape of EasyLM's and the pjit tutorials'): the batch constrained
  to the data axis inside, the weights and optimizer state replicated."""
  batch = with_sharding_constraint(batch, P("data"))

  def loss_fn(params):
    x = batch["x"]
    for i in range(len(params)):
      x = x @ params[f"layer{i}"]["w"] + params[f"layer{i}"]["b"]
      x = jax.nn.gelu(x) if i < len(params) - 1 else x
    return optax.softmax_cross_entropy_with_integer_labels(x, batch["y"]).mean()
  loss, grads = jax.value_and_grad(loss_fn)(params)
  updates, opt_state = TX.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss


def _batches(n, batch=32):
  rng = np.random.default_rng(0)
  return [{"x": rng.normal(size=(batch, 16)).astype(np.float32),
           "y": rng.integers(0, 10, batch).astype(np.int32)} for _ in range(n)]


def _mesh():
  return Mesh(mesh_utils.create_device_mesh((8,)), ("data",))


def _run(step, mesh, batches, place):
  params = _init()
  opt_state = TX.init(params)
  losses = []
  with mesh:
    for b in batches:
      params, opt_state, loss = step(params, opt_state, place(b))
      losses.append(loss)
  return params, opt_state, losses


SHARDINGS = {"specs": ((P(), P(), P("data")), (P(), P(), P())),
             "none is replicated": ((None, None, P("data")), (None, None, None))}
PLACES = {
    "global batch": lambda mesh: lambda b: jax.device_put(
        b, jax.sharding.NamedSharding(mesh, P("data"))),
    "host batch": lambda mesh: lambda b: b,  # NumPy arrays, placed by in_shardings.
}


@pytest.mark.parametrize("place", PLACES.values(), ids=PLACES.keys())
@pytest.mark.parametrize("shardings", SHARDINGS.values(), ids=SHARDINGS.keys())
def test_wus_pjit_under_with_mesh(shardings, place):
  """`from jax.experimental.pjit import pjit` becomes `from wus import pjit`."""
  mesh, batches = _mesh(), _batches(3)
  in_s, out_s = shardings
  ref = _run(pjit(train_step, in_s, out_s), mesh, batches, place(mesh))
  step = wus.pjit(train_step, in_s, out_s)
  out = _run(step, mesh, batches, place(mesh))
  assert_trees_equal(ref, wus.unshard(out))
  big = [x for x in jax.tree.leaves(out[1], is_leaf=is_sharded) if x.size > 8]
  assert big and all(is_sharded(x) for x in big), [type(x).__name__ for x in big]
  with mesh:
    plan = step.plan(*out[:2], place(mesh)(batches[0]))
  assert not plan.unchanged, plan.unchanged


def test_wus_jit_takes_partition_specs_under_with_mesh():
  """`wus.jit` with pjit's PartitionSpec keywords under `with mesh:`, where `jax.jit` itself
  needs `jax.set_mesh`: resolved on the context's mesh at call time, as pjit does; the
  same step under another mesh context resolves there."""
  batches = _batches(2)
  step = wus.jit(train_step, in_shardings=SHARDINGS["specs"][0],
                 out_shardings=SHARDINGS["specs"][1])
  mesh = _mesh()
  place = PLACES["global batch"]
  ref = _run(pjit(train_step, *SHARDINGS["specs"]), mesh, batches, place(mesh))
  assert_trees_equal(ref, wus.unshard(_run(step, mesh, batches, place(mesh))))
  other = Mesh(np.array(jax.devices()[::-1]), ("data",))
  out = _run(step, other, batches, place(other))
  assert_trees_equal(ref, wus.unshard(out))
  assert out[1][0].mu["layer1"]["w"].mesh == other


def test_wus_pjit_outside_a_mesh_context_raises_as_pjit_does():
  params, batch = _init(), _batches(1)[0]
  with pytest.raises(RuntimeError, match="non-empty mesh"):
    pjit(train_step, *SHARDINGS["specs"])(params, TX.init(params), batch)
  with pytest.raises(RuntimeError, match="non-empty mesh"):
    wus.pjit(train_step, *SHARDINGS["specs"])(params, TX.init(params), batch)
