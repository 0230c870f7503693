"""`wus.shard_map` is a drop-in for `jax.shard_map`: the ways people call it work unchanged."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import wus
from helpers import assert_trees_equal, dense_inputs, dense_step, mesh, sharded_leaves

TX = optax.adam(1e-2)


def _run(step, params, xs):
  a = (params, TX.init(params))
  for x in xs:
    a = step(*a, x)
  return a


def test_wrapped_in_jax_jit_with_donation():
  """`jax.jit(wus.shard_map(...))`, what the one-line change of
  `jax.jit(jax.shard_map(...))` gives: sharded state crosses the jit boundary."""
  m = mesh()
  params, xs = dense_inputs(m)
  kw = dict(mesh=m, in_specs=(P(), P(), P("data")), out_specs=(P(), P()))
  want = _run(jax.jit(jax.shard_map(dense_step(TX), **kw)), params, xs)
  got = _run(jax.jit(wus.shard_map(dense_step(TX), **kw), donate_argnums=(1,)), params, xs)
  assert_trees_equal(want[0], got[0])
  assert_trees_equal(want[1], wus.unshard(got[1]))
  assert sharded_leaves(got[1])


def test_mesh_from_context_and_inferred_in_specs():
  """`with jax.set_mesh(mesh)` and no in_specs: inferred from the arguments' shardings."""
  m = mesh()
  params, xs = dense_inputs(m)
  with jax.set_mesh(m):
    want = _run(jax.jit(jax.shard_map(dense_step(TX), out_specs=(P(), P()))), params, xs)
    got = _run(wus.shard_map(dense_step(TX), out_specs=(P(), P())), params, xs)
  assert_trees_equal(want[0], got[0])
  assert_trees_equal(want[1], wus.unshard(got[1]))
  assert sharded_leaves(got[1])


def _outcome(step, m, args):
  """("ran", two steps' results) or ("raised", the error's type and first line)."""
  try:
    with jax.set_mesh(m):
      a = step(*args)
      return "ran", wus.unshard(step(*a, args[2]))
  except Exception as e:  # noqa: BLE001  Whatever JAX raises, wus must raise too.
    return "raised", (type(e), str(e).splitlines()[0])


@pytest.mark.parametrize("params_spec,x_spec",
                         [(P(), P("data")), (P(), P()), (P("data"), P("data"))],
                         ids=["as_in_specs", "batch_replicated", "params_split"])
def test_explicit_mesh_arguments_against_in_specs_as_jax_shard_map(params_spec, x_spec):
  """On an Explicit mesh (jax.make_mesh's default) JAX checks the arguments' shardings
  against in_specs instead of resharding them (issue 32: JAX >= 0.9.1): wus.shard_map
  runs where jax.shard_map runs, to the same numbers, and raises what it raises."""
  m = mesh()
  params, xs = dense_inputs(m)
  args = (jax.device_put(params, jax.tree.map(lambda _: NamedSharding(m, params_spec), params)),
          jax.device_put(TX.init(params), NamedSharding(m, P())),
          jax.device_put(xs[0], NamedSharding(m, x_spec)))
  kw = dict(mesh=m, in_specs=(P(), P(), P("data")), out_specs=(P(), P()))
  want = _outcome(jax.jit(jax.shard_map(dense_step(TX), **kw)), m, args)
  got = _outcome(wus.shard_map(dense_step(TX), **kw), m, args)
  assert got[0] == want[0], (want, got)
  if want[0] == "raised":
    assert got[1] == want[1]
  else:
    assert_trees_equal(want[1], got[1])


def test_without_a_mesh_says_how_to_give_one():
  params, xs = dense_inputs(mesh())
  step = wus.shard_map(dense_step(TX), out_specs=(P(), P()))
  try:
    step(params, TX.init(params), xs[0])
  except ValueError as e:
    assert "jax.set_mesh" in str(e)
  else:
    raise AssertionError("expected a ValueError")


def test_composes_under_jax_grad_and_vmap_as_jax_shard_map():
  """The JAX parallel-programming guide's data-parallel loss: `@shard_map(out_specs=P())`
  with the mesh from jax.set_mesh and in_specs inferred, differentiated under jax.jit.
  There is no update inside to shard: it runs as jax.shard_map, with one warning."""
  mesh = jax.make_mesh((8,), ("batch",))
  params = {"w": jnp.arange(12.0).reshape(4, 3) / 10, "b": jnp.ones(3)}
  rng = np.random.default_rng(0)
  with jax.set_mesh(mesh):
    batch = jax.device_put((rng.normal(size=(16, 4)).astype(np.float32),
                            rng.normal(size=(16, 3)).astype(np.float32)),
                           NamedSharding(mesh, P("batch")))
    params = jax.device_put(params, NamedSharding(mesh, P()))

    def loss_dp(params, batch):
      inputs, targets = batch
      predictions = jnp.tanh(inputs @ params["w"] + params["b"])
      local_loss = jnp.mean(jnp.sum((predictions - targets) ** 2, axis=-1))
      return jax.lax.pmean(local_loss, "batch")

    want = jax.jit(jax.grad(jax.shard_map(out_specs=P())(loss_dp)))(params, batch)
    with pytest.warns(UserWarning, match="use wus.jit"):
      got = jax.jit(jax.grad(wus.shard_map(out_specs=P())(loss_dp)))(params, batch)
    assert_trees_equal(want, got)
    xs = jnp.stack([params["w"], 2 * params["w"]])
    with pytest.warns(UserWarning, match="use wus.jit"):
      vm = jax.vmap(lambda w: wus.shard_map(out_specs=P())(loss_dp)({"w": w, "b": params["b"]},
                                                                    batch))(xs)
    ref = jax.vmap(lambda w: jax.shard_map(out_specs=P())(loss_dp)({"w": w, "b": params["b"]},
                                                                   batch))(xs)
    assert_trees_equal(ref, vm)
