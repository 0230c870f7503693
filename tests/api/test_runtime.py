"""wus/runtime.py alone (issue 31 item 7): `operands` on a `runtime.Compiled` and the leaves a
caller passes (whole state sharded, sharded state passed as its shards, state of another
group size re-sharded, donated or foreign state refused), and the front ends' shared
helpers (`donated_positions`, `leaf_signature`, `normal`).

The step is momentum SGD on 8 replicas (the forward pass reads w, only the update reads m,
so m is kept sharded: `sharded_leaves == {1: ...}`); m has 60 elements, padded to 8 x 8.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import wus
from helpers import mesh
from wus import pipeline, runtime
from wus.errors import StateMismatchError
from wus.matching import Signature
from wus.options import Options

N = 8


def _step(w, m, x):
  g = lax.pmean(jnp.cos(w) * x.mean(), "data")
  m = 0.9 * m + g
  return w - 0.1 * m, m


def _leaves(n=N):
  return [jnp.ones(60), jnp.arange(60.0),
          jax.device_put(jnp.ones((2 * n, 4)), NamedSharding(mesh(n), P("data")))]


def _compiled(shard_group_size=None) -> runtime.Compiled:
  leaves = _leaves()
  step = pipeline.Step(_step, (P(), P(), P("data")), (P(), P()), signature=Signature.of(_step))
  call = pipeline.Call(step, Options(shard_group_size=shard_group_size), tuple(leaves),
                       tuple(leaves), jax.tree.structure(tuple(leaves)), frozenset(), mesh(N),
                       frozenset())
  return pipeline.compile_step(call)


def _sharded_m(n=N):
  """m after one step of `wus.shard_map` on `n` replicas: a ShardedArray."""
  ws = wus.shard_map(_step, mesh=mesh(n), in_specs=(P(), P(), P("data")), out_specs=(P(), P()))
  _, m = ws(*_leaves(n))
  assert isinstance(m, wus.ShardedArray)
  return m


def test_whole_state_is_sharded_and_the_rest_passes_as_it_came():
  compiled = _compiled()
  assert set(compiled.sharded_leaves) == {1}
  leaves = _leaves()
  w, m, x = runtime.operands(list(leaves), compiled)
  assert w is leaves[0] and x is leaves[2]
  # m as its 8 padded shards of 8, replica r holding elements 8r..8r+7, split over "data".
  assert m.shape == (64,) and m.sharding.spec == P("data")
  np.testing.assert_array_equal(np.asarray(m), np.concatenate([np.arange(60.0), np.zeros(4)]))
  for shard in m.addressable_shards:
    r = shard.index[0].start // 8
    np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(m)[8 * r:8 * r + 8])


def test_state_sharded_as_the_step_expects_passes_its_shards_with_no_copy():
  compiled = _compiled()
  m = _sharded_m()
  leaves = _leaves()
  ops = runtime.operands([leaves[0], m, leaves[2]], compiled)
  assert ops[1] is m.data


def test_state_sharded_in_groups_of_another_size_is_gathered_and_sharded_again():
  """m sharded 8 ways, passed to a step sharded in groups of 2 on the same devices: one
  program gathers it, one shards it in the groups' layout; its value is unchanged."""
  compiled = _compiled(shard_group_size=2)
  layout = compiled.sharded_leaves[1]
  m = _sharded_m()
  leaves = _leaves()
  ops = runtime.operands([leaves[0], m, leaves[2]], compiled)
  assert ops[1] is not m.data and ops[1].sharding.mesh == compiled.mesh
  assert ops[1].sharding.is_equivalent_to(layout.data_sharding, 1)
  assert ops[1].shape == (60,)  # 2 shards of 30: no padding.
  np.testing.assert_array_equal(np.asarray(ops[1]), np.asarray(m.whole()))


def test_a_donated_argument_is_refused_by_name():
  compiled = _compiled()
  leaves = _leaves()
  leaves[1].delete()
  with pytest.raises(ValueError, match=r"\bm\b"):
    runtime.operands(leaves, compiled)


def test_state_sharded_on_another_mesh_is_refused():
  compiled = _compiled()
  m = _sharded_m(4)
  leaves = _leaves()
  with pytest.raises(StateMismatchError, match="argument m was sharded on another mesh"):
    runtime.operands([leaves[0], m, leaves[2]], compiled)


def test_a_call_returns_the_outputs_with_the_state_kept_sharded():
  """`runtime.call`: operands in, the step's outputs out, as `jax.shard_map` computes them,
  the state the step keeps sharded as a ShardedArray in its layout."""
  compiled = _compiled()
  w, m = runtime.call(_leaves(), compiled)
  assert isinstance(m, wus.ShardedArray) and m.layout == compiled.sharded_outputs[1]
  assert not isinstance(w, wus.ShardedArray)
  want = jax.jit(jax.shard_map(_step, mesh=mesh(N), in_specs=(P(), P(), P("data")),
                               out_specs=(P(), P())))(*_leaves())
  np.testing.assert_allclose(np.asarray(w), np.asarray(want[0]), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(m.whole()), np.asarray(want[1]), rtol=1e-6)


def test_lowering_takes_the_state_kept_sharded_as_its_padded_shards():
  compiled = _compiled()
  leaves = _leaves()
  w, m, x = runtime.abstract_operands(leaves, compiled)
  assert w is leaves[0] and x is leaves[2]  # Read whole: as given.
  layout = compiled.sharded_leaves[1]
  assert (m.shape, m.sharding) == ((64,), layout.data_sharding)
  assert runtime.lower(leaves, compiled).compile() is not None


def test_a_restore_target_is_a_logical_view_for_state_kept_sharded():
  compiled = _compiled()
  replicated = NamedSharding(mesh(N), P())
  w, m, x = runtime.state_target(_leaves(), compiled, [replicated] * 3)
  assert isinstance(w, jax.ShapeDtypeStruct) and (w.shape, w.sharding) == ((60,), replicated)
  assert not isinstance(m, jax.ShapeDtypeStruct) and m.shape == (60,)
  assert isinstance(x, jax.ShapeDtypeStruct) and x.shape == (16, 4)


def test_each_signature_is_compiled_once():
  compiled, built = _compiled(), []

  def build():
    built.append(1)
    return compiled
  cache: dict = {}
  for _ in range(2):
    assert runtime.compiled_once(cache, "signature", build, None) is compiled
  assert built == [1]


def test_donated_positions_from_numbers_and_names_as_jax_jit():
  def f(params, opt_state, batch, *, rng=None):
    del rng
    return params, opt_state, batch
  assert runtime.donated_positions(f, (0, 1), ()) == {0, 1}
  assert runtime.donated_positions(f, 0, "opt_state") == {0, 1}
  assert runtime.donated_positions(f, (), ("batch", "params")) == {0, 2}
  with pytest.raises(ValueError, match="'rng' is not a positional parameter of f"):
    runtime.donated_positions(f, (), "rng")


def test_a_leaf_keys_the_cache_alike_sharded_or_whole():
  """After the first call state comes back sharded: the same key, so the same program."""
  m = _sharded_m()
  assert runtime.leaf_signature(m) == runtime.leaf_signature(m.whole())
  assert runtime.leaf_signature(m) != runtime.leaf_signature(jnp.arange(61.0))
  assert runtime.leaf_signature(jnp.float32(1)) != runtime.leaf_signature(1.0)  # Weak type.
  assert runtime.normal(P(None,)) == runtime.normal(P()) != runtime.normal(P("data"))


def test_mesh_roles_drop_size_1_axes_and_shard_the_update_where_nothing_is_blocked():
  """`mesh_axes.Roles`: what each axis is to a step, size-1 axes none (built once)."""
  from wus.mesh_axes import Roles  # noqa: PLC0415
  mesh = jax.make_mesh((2, 2, 2, 1), ("replica", "data", "model", "one"))
  roles = Roles.of(mesh, batch={"replica", "data", "one"}, placed={"data", "model", "one"},
                   blocked={"data"})
  assert roles == Roles(batch=("replica", "data"), model=("model",), fsdp=("data",),
                        update=("replica",), copy_axes=("data", "model"))
  # Every batch axis blocked (FSDP alone): the update is sharded over them all.
  assert Roles.of(mesh, {"data"}, {"data"}, {"data"}).update == ("data",)
