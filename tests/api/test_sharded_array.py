"""`wus.ShardedArray` answers what an array answers about itself (issue 23 item 3): a new
user's `print(jax.tree.map(lambda x: x.shape, opt_state))`, `.sharding`, sizes without
padding; pickling says to call `wus.unshard`. Used as an array (their own jitted step, an
optax call, jnp, NumPy), it is its whole tensor, gathered on demand (issue 28 item 4):
the same results as with `wus.unshard`'s whole state."""

import copy
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import wus
from helpers import assert_trees_equal, dense_inputs, dense_step, mesh, sharded_leaves

TX = optax.adam(1e-2)
SPECS = dict(in_specs=(P(), P(), P("data")), out_specs=(P(), P()))


@pytest.fixture(scope="module")
def trained():
  """(params, sharded opt_state, whole opt_state, a batch) after one wus step."""
  m = mesh()
  params, xs = dense_inputs(m, steps=1)
  step = wus.shard_map(dense_step(TX), mesh=m, **SPECS)
  params, opt_state = step(params, TX.init(params), xs[0])
  assert sharded_leaves(opt_state)
  return params, opt_state, wus.unshard(opt_state), xs[0]


def test_inspection_is_of_the_whole_tensor(trained):
  """shape, dtype, ndim, size and nbytes are the whole (unpadded) tensor's; the per-device
  bytes are one padded shard's; `sharding` lays the shards out over the mesh."""
  _, sharded, whole, _ = trained
  mu, mu_whole = sharded[0].mu["b"], whole[0].mu["b"]  # [40] over 8: 5 each, no padding
  w, w_whole = sharded[0].mu["w"], whole[0].mu["w"]   # [24, 40]
  for x, y in ((mu, mu_whole), (w, w_whole)):
    assert (x.shape, x.dtype, x.ndim, x.size, x.nbytes) == (y.shape, y.dtype, y.ndim, y.size,
                                                             y.nbytes)
    assert x.nbytes_per_device == x.format.shard_size * 4
    assert x.sharding.mesh == mesh() and x.sharding.spec == P("data")
    assert x.sharding.is_equivalent_to(x.data.sharding, x.data.ndim)
  assert w.nbytes_per_device * 8 >= w.nbytes


def test_tree_map_over_the_shards_prints(trained):
  """`lambda x: x.shape` maps over the padded shards (a ShardedArray is a pytree node, so
  that it crosses jax.jit); the result prints and says so; with is_leaf=wus.is_sharded the
  map sees whole tensors' shapes."""
  _, sharded, whole, _ = trained
  shapes = jax.tree.map(lambda x: x.shape, sharded)
  text = repr(shapes)
  assert "ShardedArray(float32[24,40]" in text and "mapped: (960,)" in text
  logical = jax.tree.map(lambda x: x.shape, sharded, is_leaf=wus.is_sharded)
  assert logical == jax.tree.map(lambda x: x.shape, whole)
  sizes = jax.tree.map(lambda x: x.size, sharded, is_leaf=wus.is_sharded)
  assert sum(jax.tree.leaves(sizes)) == sum(x.size for x in jax.tree.leaves(whole))


def test_pickle_says_what_to_call_and_copies_work(trained):
  _, sharded, _, _ = trained
  with pytest.raises(TypeError, match=r"wus\.unshard\(tree\)"):
    pickle.dumps(sharded)
  assert copy.deepcopy(sharded)[0].mu["w"].data is sharded[0].mu["w"].data
  pickle.loads(pickle.dumps(wus.unshard(sharded)))  # What the message says works.


def test_a_plain_jitted_shard_map_step_reads_the_whole_tensors(trained):
  """The user's own `jax.jit(jax.shard_map(step))` given sharded state computes what it
  computes on the whole state: the shards are gathered inside that program."""
  params, sharded, whole, x = trained
  plain = jax.jit(jax.shard_map(dense_step(TX), mesh=mesh(), **SPECS))
  assert_trees_equal(plain(params, sharded, x), plain(params, whole, x))


@pytest.mark.parametrize("call", [
    pytest.param(lambda g, s, p: jax.jit(TX.update)(g, s, p), id="jit(tx.update)"),
    pytest.param(lambda g, s, p: TX.update(g, s, p), id="tx.update"),
    pytest.param(lambda g, s, p: jax.jit(optax.tree_utils.tree_norm)(s[0].mu), id="jit(norm)"),
    pytest.param(lambda g, s, p: jax.jit(lambda s: jax.tree.map(lambda x: 2 * x, s))(s),
                 id="jit(tree.map)"),
    pytest.param(lambda g, s, p: jax.tree.map(lambda w, m: w + np.asarray(m), p, s[0].mu),
                 id="numpy"),
    pytest.param(lambda g, s, p: jax.tree.map(lambda w, m: jnp.dot(w.T, m), p, s[0].mu),
                 id="jnp.dot"),
])
def test_optax_and_jax_outside_wus_see_the_whole_tensors(trained, call):
  params, sharded, whole, _ = trained
  grads = jax.tree.map(np.zeros_like, params)
  assert_trees_equal(call(grads, sharded, params), call(grads, whole, params))


def test_use_as_an_array_of_donated_state_says_it_is_gone(trained):
  params, _, _, x = trained
  step = wus.shard_map(dense_step(TX), mesh=mesh(), **SPECS)
  _, opt_state = step(params, TX.init(params), x)
  mu = opt_state[0].mu["w"]
  mu.data.delete()  # As donate_argnums does.
  with pytest.raises(ValueError, match="donated"):
    mu + 1


def test_orbax_save_of_raw_sharded_state_fails_at_save_time(trained, tmp_path):
  """Orbax flattens a ShardedArray into its padded shards: saving those would write no
  tensor of the step's ([24, 40] as [960]), so the save fails with one line saying to save
  wus.checkpointable(tree) (issue 23 item 4); that one restores."""
  import orbax.checkpoint as ocp  # noqa: PLC0415
  params, sharded, whole, _ = trained
  state = {"params": params, "opt_state": sharded}
  with pytest.raises(TypeError, match=r"^Orbax was given the padded shards of ShardedArray\("
                     r"float32\[.*save wus\.checkpointable\(tree\) instead") as e:
    ocp.StandardCheckpointer().save(tmp_path / "raw", state)
  assert "\n" not in str(e.value)
  with ocp.CheckpointManager(tmp_path / "managed") as manager:
    with pytest.raises(TypeError, match=r"save wus\.checkpointable\(tree\) instead"):
      manager.save(1, args=ocp.args.StandardSave(state))
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(tmp_path / "ok", wus.checkpointable(state))
  restored = ocp.StandardCheckpointer().restore(tmp_path / "ok")
  np.testing.assert_array_equal(restored["opt_state"][0]["mu"]["w"], whole[0].mu["w"])


def test_a_key_path_into_sharded_state_says_it_reaches_padded_shards(trained):
  """A key path into a ShardedArray ends in `.data`, a `ShardsKey` carrying the array's
  layout and dtype: what a saver handed only the leaves (Orbax) reads to refuse them."""
  _, sharded, _, _ = trained
  mu = sharded[0].mu["w"]
  (path, leaf), = jax.tree_util.tree_flatten_with_path(mu)[0]
  assert leaf is mu.data and jax.tree_util.keystr(path) == ".data"
  assert isinstance(path[-1], wus.sharded.ShardsKey)
  assert (path[-1].layout, path[-1].dtype) == (mu.layout, mu.dtype)
  whole = jax.tree_util.tree_flatten_with_path(wus.unshard(mu))[0]
  assert whole[0][0] == ()
