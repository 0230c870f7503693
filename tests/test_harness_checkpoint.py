"""Tests of wus.harness.checkpoint: sharded state saved in place, restored whole."""

import json

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import wus
from helpers import assert_trees_equal
from wus.harness import checkpoint, errors

IDENTITY = {"model": "toy", "config": {"width": 7}}


@pytest.fixture(scope="module")
def mesh():
  return jax.make_mesh((8,), ("data",))


@pytest.fixture(scope="module")
def trained(mesh):
  """{"params", "opt_state"} after one wus step: Adam's moments of w [3, 7] are sharded."""
  tx = optax.adam(0.1)
  params = {"w": jnp.arange(21.0).reshape(3, 7), "b": jnp.ones(5)}

  def step(params, opt_state, x):
    local = jax.lax.pcast(params, "data", to="varying")
    grads = jax.grad(lambda p: sum(jnp.sum(jnp.sin(v) * x.mean()) for v in jax.tree.leaves(p)))(
        local)
    updates, opt_state = tx.update(jax.lax.pmean(grads, "data"), opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  mapped = wus.shard_map(step, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P()))
  x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("data")))
  params, opt_state = mapped(*jax.device_put((params, tx.init(params)),
                                             NamedSharding(mesh, P())), x)
  assert isinstance(opt_state[0].mu["w"], wus.ShardedArray)
  return {"params": params, "opt_state": opt_state}


def snapshot(directory):
  return {str(p): (p.stat().st_mtime_ns, p.read_bytes() if p.is_file() else None)
          for p in sorted(directory.rglob("*"))}


def test_sharded_state_round_trips_whole(tmp_path, mesh, trained):
  saver = checkpoint.Checkpointer(tmp_path, IDENTITY, max_to_keep=2)
  saver.save(1, trained)
  saver.close()

  meta = json.loads((tmp_path / "1" / "meta" / "metadata").read_text())
  assert meta["identity"] == IDENTITY
  assert meta["formats"]["['opt_state']['0']['mu']['w']"] == {"shape": [3, 7],
                                                               "merged_shape": [21]}
  assert "['params']['w']" not in meta["formats"]

  loader = checkpoint.Checkpointer(tmp_path, IDENTITY, max_to_keep=2)
  assert loader.latest_step() == 1
  replicated = NamedSharding(mesh, P())
  target = jax.eval_shape(lambda: wus.unshard(trained))
  restored = loader.restore(1, target, replicated)
  loader.close()
  assert_trees_equal(restored, wus.unshard(trained))
  assert all(x.sharding.is_equivalent_to(replicated, x.ndim) for x in jax.tree.leaves(restored))


def test_checkpoint_of_another_identity_is_refused_untouched(tmp_path, trained):
  saver = checkpoint.Checkpointer(tmp_path, IDENTITY, max_to_keep=2)
  saver.save(3, trained)
  saver.close()
  before = snapshot(tmp_path)
  with pytest.raises(errors.InputError, match=r"step 3 .* of another model or optimizer "
                     r"\(config: \{'width': 7\} here, \{'width': 8\} in this run\)"):
    checkpoint.Checkpointer(tmp_path, {**IDENTITY, "config": {"width": 8}}, max_to_keep=2)
  assert snapshot(tmp_path) == before


def test_an_unfinished_save_is_ignored_and_cleaned_up(tmp_path, trained):
  saver = checkpoint.Checkpointer(tmp_path, IDENTITY, max_to_keep=2)
  saver.save(1, trained)
  saver.close()
  unfinished = tmp_path / "2.orbax-checkpoint-tmp-1234"  # as a save killed midway leaves it
  (unfinished / "state").mkdir(parents=True)
  (unfinished / "state" / "junk").write_bytes(b"\0" * 10)

  resumed = checkpoint.Checkpointer(tmp_path, IDENTITY, max_to_keep=2)
  assert resumed.latest_step() == 1
  resumed.save(2, trained)  # Orbax deletes the unfinished save before its next one
  resumed.close()
  assert not unfinished.exists() and (tmp_path / "2" / "state").is_dir()


def test_tensor_of_another_shape_is_refused(tmp_path, mesh, trained):
  saver = checkpoint.Checkpointer(tmp_path, IDENTITY, max_to_keep=2)
  saver.save(1, trained)
  saver.close()
  target = jax.eval_shape(lambda: wus.unshard(trained))
  target["opt_state"][0].mu["w"] = jax.ShapeDtypeStruct((7, 3), jnp.float32)
  with pytest.raises(errors.InputError, match=r"has shape \[3, 7\], this run expects \(7, 3\)"):
    checkpoint.Checkpointer(tmp_path, IDENTITY, max_to_keep=2).restore(
        1, target, NamedSharding(mesh, P()))
