"""Tests of wus.harness.training.checkpoint: sharded state saved in place, restored whole or
sharded."""

import json
import shutil

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import wus
from helpers import assert_trees_equal
from wus.harness.training import checkpoint
from wus.harness import errors

IDENTITY = {"model": "toy", "config": {"width": 7}}


TX = optax.adam(0.1)


def mesh_of(num_devices):
  return jax.make_mesh((num_devices,), ("data",), devices=jax.devices()[:num_devices])


def step_fn(params, opt_state, x):
  def loss(p):  # the mean over replicas (AD at the replicated params all-reduces the grads)
    return jax.lax.pmean(sum(jnp.sum(jnp.sin(v) * x.mean()) for v in jax.tree.leaves(p)), "data")
  updates, opt_state = TX.update(jax.grad(loss)(params), opt_state, params)
  return optax.apply_updates(params, updates), opt_state


def mapped(mesh):
  return wus.shard_map(step_fn, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P()))


def batch(mesh):
  return jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("data")))


def wus_step(mesh, state):
  """{"params", "opt_state"} after one wus step on `mesh` from `state` (whole or sharded)."""
  params, opt_state = mapped(mesh)(state["params"], state["opt_state"], batch(mesh))
  return {"params": params, "opt_state": opt_state}


def sharded_target(mesh, like):
  """The restore target of `mapped(mesh)`: optimizer state sharded for its N."""
  params, opt_state, _ = mapped(mesh).state_target(like["params"], like["opt_state"], batch(mesh))
  return {"params": params, "opt_state": opt_state}


@pytest.fixture(scope="module")
def mesh():
  return mesh_of(8)


@pytest.fixture(scope="module")
def trained(mesh):
  """After one wus step on 8 devices: Adam's moments of w [2, 5] are sharded, 10 elements
  as 8 x 2 rows (6 rows of padding)."""
  params = {"w": jnp.arange(10.0).reshape(2, 5), "b": jnp.ones(5)}
  state = wus_step(mesh, jax.device_put({"params": params, "opt_state": TX.init(params)},
                                        NamedSharding(mesh, P())))
  mu = state["opt_state"][0].mu["w"]
  assert isinstance(mu, wus.ShardedArray) and mu.data.shape == (16,)
  return state


def saved_shapes(directory, step):
  """{keystr: shape} of the arrays of checkpoint `step`, as Orbax's metadata records them."""
  with checkpoint._manager(directory, create=False) as manager:
    tree = manager.item_metadata(step)["state"].tree
  return {jax.tree_util.keystr(k): tuple(v.shape)
          for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def snapshot(directory):
  return {str(p): (p.stat().st_mtime_ns, p.read_bytes() if p.is_file() else None)
          for p in sorted(directory.rglob("*"))}


def save(directory, step, state):
  saver = checkpoint.Checkpointer(directory, IDENTITY, max_to_keep=2)
  saver.save(step, state)
  saver.close()


def whole_target(like, mesh):
  """`like` whole, abstract, replicated on `mesh`: what plain JAX code restores into."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                     sharding=NamedSharding(mesh, P())),
                      jax.eval_shape(lambda: wus.unshard(like)))


def load(directory, step, target):
  loader = checkpoint.Checkpointer(directory, IDENTITY, max_to_keep=2)
  restored = loader.restore(step, target)
  loader.close()
  return restored


def test_sharded_state_round_trips_whole(tmp_path, mesh, trained):
  save(tmp_path, 1, trained)
  meta = json.loads((tmp_path / "1" / "meta" / "metadata").read_text())
  assert meta == {"identity": IDENTITY}

  restored = load(tmp_path, 1, whole_target(trained, mesh))
  assert_trees_equal(restored, wus.unshard(trained))
  replicated = NamedSharding(mesh, P())
  assert all(x.sharding.is_equivalent_to(replicated, x.ndim) for x in jax.tree.leaves(restored))


def test_sharded_state_is_saved_at_its_logical_shape(tmp_path, trained):
  save(tmp_path, 1, trained)
  shapes = saved_shapes(tmp_path, 1)
  # The logical tensor, not the 16 padded rows of `.data` nor the merged [10].
  mu, nu = "['opt_state']['0']['mu']['w']", "['opt_state']['0']['nu']['w']"
  assert shapes[mu] == shapes[nu] == (2, 5)
  assert shapes["['params']['w']"] == (2, 5)  # whole arrays as they are


def test_restores_sharded_at_other_device_counts(tmp_path, trained):
  """Saved at 8 devices, restored sharded at 4 (2 padding rows), trained, saved, and
  restored at 8: each restore gives exactly what was saved, as the step's own state."""
  save(tmp_path / "at8", 1, trained)
  at4 = load(tmp_path / "at8", 1, sharded_target(mesh_of(4), trained))
  mu = at4["opt_state"][0].mu["w"]
  assert isinstance(mu, wus.ShardedArray) and mu.data.shape == (12,)
  assert_trees_equal(wus.unshard(at4), wus.unshard(trained))

  trained4 = wus_step(mesh_of(4), at4)
  save(tmp_path / "at4", 2, trained4)
  assert saved_shapes(tmp_path / "at4", 2)["['opt_state']['0']['mu']['w']"] == (2, 5)
  at8 = load(tmp_path / "at4", 2, sharded_target(mesh_of(8), trained))
  assert at8["opt_state"][0].mu["w"].data.shape == (16,)
  assert_trees_equal(wus.unshard(at8), wus.unshard(trained4))


def test_checkpoint_of_another_identity_is_refused_untouched(tmp_path, trained):
  save(tmp_path, 3, trained)
  before = snapshot(tmp_path)
  with pytest.raises(errors.InputError, match=r"step 3 .* of another model or optimizer "
                     r"\(config: \{'width': 7\} here, \{'width': 8\} in this run\)"):
    checkpoint.Checkpointer(tmp_path, {**IDENTITY, "config": {"width": 8}}, max_to_keep=2)
  assert snapshot(tmp_path) == before


def test_an_unfinished_save_is_ignored_and_cleaned_up(tmp_path, trained):
  save(tmp_path, 1, trained)
  unfinished = tmp_path / "2.orbax-checkpoint-tmp-1234"  # as a save killed midway leaves it
  (unfinished / "state").mkdir(parents=True)
  (unfinished / "state" / "junk").write_bytes(b"\0" * 10)

  resumed = checkpoint.Checkpointer(tmp_path, IDENTITY, max_to_keep=2)
  assert resumed.latest_step() == 1
  resumed.save(2, trained)  # Orbax deletes the unfinished save before its next one
  resumed.close()
  assert not unfinished.exists() and (tmp_path / "2" / "state").is_dir()


@pytest.mark.parametrize("sharded", [False, True], ids=["whole", "sharded"])
def test_tensor_of_another_shape_is_refused(tmp_path, mesh, trained, sharded):
  save(tmp_path, 1, trained)
  if sharded:
    other = {"params": {"w": jnp.zeros((5, 2)), "b": jnp.ones(5)}}
    target = sharded_target(mesh, {**other, "opt_state": TX.init(other["params"])})
  else:
    target = whole_target(trained, mesh)
    target["opt_state"][0].mu["w"] = jax.ShapeDtypeStruct((5, 2), jnp.float32,
                                                          sharding=NamedSharding(mesh, P()))
  with pytest.raises(errors.InputError, match=r"^checkpoint step 1: \['opt_state'\]\['0'\]"
                     r"\['mu'\]\['w'\] has shape \[2, 5\], this run expects \(5, 2\)$"):
    load(tmp_path, 1, target)


@pytest.mark.parametrize("damage", [
    lambda meta: shutil.rmtree(meta),
    lambda meta: (meta / "metadata").write_text('{"identity": {"model"'),
    lambda meta: (meta / "metadata").write_text('{"identity": [], "formats": {}}'),
], ids=["missing", "truncated", "identity_not_a_record"])
def test_checkpoint_without_a_readable_record_is_refused_untouched(tmp_path, trained, damage):
  save(tmp_path, 1, trained)
  save(tmp_path, 2, trained)
  damage(tmp_path / "2" / "meta")
  before = snapshot(tmp_path)
  with pytest.raises(errors.InputError, match=r"the checkpoint at step 2 in .* has no readable "
                     r"record of its model and optimizer \(meta: .*\); it is damaged"):
    checkpoint.Checkpointer(tmp_path, IDENTITY, max_to_keep=2)
  assert snapshot(tmp_path) == before


def test_check_looks_without_writing(tmp_path, trained):
  assert checkpoint.check(tmp_path / "none", IDENTITY) == IDENTITY
  assert not (tmp_path / "none").exists()
  save(tmp_path, 1, trained)
  with pytest.raises(errors.InputError, match="of another model or optimizer"):
    checkpoint.check(tmp_path, {**IDENTITY, "model": "other"})


def halve(path):
  path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])


def largest_data_file(item):
  """The largest array data file of an Orbax item folder: of the OCDBT tree all processes'
  writes are merged into (`d/*`), where arrays this small are stored inline."""
  return max((p for p in item.glob("d/*") if p.is_file()), key=lambda p: p.stat().st_size)


@pytest.mark.parametrize("damage, status", [
    (lambda state: halve(largest_data_file(state)), "OUT_OF_RANGE"),
    (lambda state: halve(state / "manifest.ocdbt"), "DATA_LOSS"),
    (lambda state: halve(state / "_METADATA"), "(Unterminated string|Expecting)"),  # JSON
], ids=["array_data_halved", "manifest_halved", "tree_metadata_halved"])
def test_damaged_checkpoint_is_one_line_error_and_left_untouched(tmp_path, mesh, trained,
                                                                 damage, status):
  save(tmp_path, 1, trained)
  save(tmp_path, 2, trained)
  damage(tmp_path / "2" / "state")
  before = snapshot(tmp_path)
  message = (rf"^the checkpoint at step 2 in {tmp_path} is unreadable \({status}[^\n]*\); it "
             rf"is damaged: delete {tmp_path / '2'} to resume from the checkpoint before it")
  with pytest.raises(errors.InputError, match=message):  # found before anything trains
    checkpoint.check(tmp_path, IDENTITY)
  with pytest.raises(errors.InputError, match=message):  # and if restored without a check
    load(tmp_path, 2, sharded_target(mesh, trained))
  assert snapshot(tmp_path) == before
  assert_trees_equal(wus.unshard(load(tmp_path, 1, sharded_target(mesh, trained))),
                     wus.unshard(trained))  # still there
