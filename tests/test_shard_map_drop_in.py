"""`wus.shard_map` is a drop-in for `jax.shard_map`: the ways people call it work unchanged."""

import jax
import optax
from jax.sharding import PartitionSpec as P

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


def test_without_a_mesh_says_how_to_give_one():
  params, xs = dense_inputs(mesh())
  step = wus.shard_map(dense_step(TX), out_specs=(P(), P()))
  try:
    step(params, TX.init(params), xs[0])
  except ValueError as e:
    assert "jax.set_mesh" in str(e)
  else:
    raise AssertionError("expected a ValueError")
