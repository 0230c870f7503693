"""Users' own checkpoints: wus state saved and restored with stock Orbax, at any replica count.

The model (`checkpoint_worker`): Adam on params of shapes [3,3,5,7], [7], [130]
and a scalar, which 8, 6 and 4 do not divide, trained by the step as users
write it, with a global batch of 24 at every replica count. Exactness: a
restored state equals the saved one bit for bit (`wus.unshard`), and training
from it equals training from the saved state handed over in memory bit for
bit; at another replica count the mean over replicas sums in another order, so
against an uninterrupted run at 8 it agrees to a tolerance.
"""

import json
import shutil
import subprocess
import sys
import textwrap

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import checkpoint_worker as W
import wus
from helpers import (PMAP_TX, assert_trees_equal, free_port, mesh, pmap_params, pmap_step, pmap_xs,
                     stack)
from wus import checkpoint

SAVED_AT = 2  # updates before the save
MORE = 2      # updates after each restore
TOLERANCE = dict(rtol=2e-6, atol=1e-7)
WORKER = W.__file__


def fresh():
  return W.init_params(), W.TX.init(W.init_params())


def on(m, tree):
  """Whole values of `tree` placed on mesh `m` (replicated), as a restored plain state is."""
  host = jax.tree.map(lambda x: np.asarray(x.addressable_data(0) if isinstance(x, jax.Array)
                                           else x), wus.unshard(tree))
  return jax.device_put(host, NamedSharding(m, P()))


def target(m, like=None):
  """The restore target of a wus step on mesh `m`: {"params", "opt_state"}."""
  params, opt_state, _ = W.wus_step(m).state_target(*(like or W.abstract_state()), W.batch(0, m))
  return {"params": params, "opt_state": opt_state}


def save(path, params, opt_state):
  ckptr = ocp.StandardCheckpointer()
  ckptr.save(path, wus.checkpointable({"params": params, "opt_state": opt_state}))
  ckptr.wait_until_finished()


def restore(path, m):
  restored = ocp.StandardCheckpointer().restore(path, target(m))
  return restored["params"], restored["opt_state"]


def snapshot(root):
  return {str(p): (p.stat().st_mtime_ns, p.read_bytes() if p.is_file() else None)
          for p in sorted(root.rglob("*"))}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """SAVED_AT wus updates at N = 8, saved; (folder, state, what each shard wrote)."""
  m = mesh(8)
  state = W.run(W.wus_step(m), fresh(), m, 0, SAVED_AT)
  original = checkpoint.handler._Write.__dict__["of"]
  records = W.spy_on_writes()
  path = tmp_path_factory.mktemp("saved") / "ckpt"
  try:
    save(path, *state)
  finally:
    checkpoint.handler._Write.of = original
  return path, state, records


@pytest.fixture(scope="module")
def uninterrupted():
  """The run at N = 8 without checkpoints, after SAVED_AT + 2 * MORE updates."""
  m = mesh(8)
  return W.run(W.wus_step(m), fresh(), m, 0, SAVED_AT + 2 * MORE)


# --- Ranges as boxes; chunks. ------------------------------------------------------


@pytest.mark.parametrize("shape", [(3, 3, 5, 7), (130,), (2, 1, 6), (4, 4)])
def test_boxes_cover_a_range_in_row_major_order(shape):
  size = int(np.prod(shape))
  flat = np.arange(size).reshape(shape)
  for start in range(0, size, 3):
    for stop in range(start, size + 1, 5):
      got = [flat[box].reshape(-1) for box in checkpoint.boxes(shape, start, stop)]
      np.testing.assert_array_equal(np.concatenate(got) if got else [], np.arange(start, stop))
      assert len(got) <= 2 * len(shape) - 1


def test_chunks_never_span_a_boundary():
  assert checkpoint.chunk_shape((3, 3, 5, 7), 40) == (1, 1, 5, 7)  # one process: largest <= shard
  assert checkpoint.chunk_shape((3, 3, 5, 7), 40, [160]) == (1, 1, 1, 1)  # 160 = 105 + 35 + 20
  assert checkpoint.chunk_shape((130,), 17, [68]) == (2,)
  assert checkpoint.chunk_shape((1024, 1024), 131072, [524288]) == (128, 1024)


# --- Saving. -----------------------------------------------------------------------


def test_saved_as_ordinary_arrays_of_logical_shape(saved):
  path, state, _ = saved
  shapes = {k: tuple(v.shape) for k, v in
            ocp.tree.to_flat_dict(ocp.StandardCheckpointer().metadata(path).item_metadata.tree,
                                  sep=".").items()}
  assert shapes["opt_state.0.mu.conv"] == shapes["params.conv"] == (3, 3, 5, 7)
  assert shapes["opt_state.0.nu.bias"] == (130,) and shapes["opt_state.0.count"] == ()
  sharded = {x.format.shape for x in jax.tree.leaves(state[1], is_leaf=wus.sharded.is_sharded)
             if wus.sharded.is_sharded(x)}
  assert sharded == {(3, 3, 5, 7), (130,)}  # [7] < 8 elements stays whole at N = 8


def test_each_device_writes_only_its_shard(saved):
  """Per-device bytes while saving are the shard's: each device's piece is at most one
  shard (the logical part of it), the pieces tile the tensor once, and are what is written."""
  _, state, records = saved
  assert {r["name"] for r in records} == {f"opt_state.0.{m}.{k}" for m in ("mu", "nu")
                                          for k in ("conv", "bias")}
  for r in records:
    size = int(np.prod(W.SHAPES[r["name"].split(".")[-1]]))
    assert all(n <= r["shard_size"] for _, _, _, n in r["pieces"])
    assert len({d for d, _, _, _ in r["pieces"]}) == len(r["pieces"])  # one piece per device
    covered = sorted((s, n) for _, _, s, n in r["pieces"])
    assert [s for s, _ in covered] == list(np.cumsum([0] + [n for _, n in covered])[:-1])
    assert sum(n for _, n in covered) == size
    assert r["runs"] == [[0, size]]  # one process: its pieces, in one run


def test_code_without_wus_restores_whole_arrays(saved, tmp_path):
  """In a process that never imports wus, on the same 8 devices, Orbax restores the
  checkpoint without a target: every tensor whole, replicated as it records them."""
  path, state, _ = saved
  script = textwrap.dedent(f"""
      import sys
      import jax, numpy as np, orbax.checkpoint as ocp
      jax.config.update("jax_num_cpu_devices", 8)
      restored = ocp.StandardCheckpointer().restore({str(path)!r})
      assert not [m for m in sys.modules if m == "wus" or m.startswith("wus.")]
      assert all(x.is_fully_replicated for x in jax.tree.leaves(restored))
      np.savez({str(tmp_path / "plain.npz")!r}, *map(np.asarray, jax.tree.leaves(restored)))
  """)
  subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, timeout=300)
  plain = np.load(tmp_path / "plain.npz")
  want = jax.tree.leaves(wus.unshard({"params": state[0], "opt_state": state[1]}))
  assert len(plain.files) == len(want)
  for k, w in enumerate(want):
    np.testing.assert_array_equal(plain[f"arr_{k}"], np.asarray(w))


def test_plain_jax_code_restores_and_trains_on_whole_arrays(saved, uninterrupted):
  path, state, _ = saved
  m = mesh(8)
  replicated = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                           sharding=NamedSharding(m, P())),
                            W.abstract_state())
  restored = ocp.StandardCheckpointer().restore(path, {"params": replicated[0],
                                                       "opt_state": replicated[1]})
  assert not [x for x in jax.tree.leaves(restored) if not isinstance(x, jax.Array)]
  plain = W.run(W.plain_step(m), (restored["params"], restored["opt_state"]), m, SAVED_AT, 2 * MORE)
  assert_trees_equal(plain, wus.unshard(uninterrupted))


# --- Restoring at any replica count. -----------------------------------------------


@pytest.mark.parametrize("n", [8, 4])
def test_restores_sharded_for_the_step_and_continues(saved, uninterrupted, n):
  path, state, _ = saved
  m = mesh(n)
  params, opt_state = restore(path, m)
  assert_trees_equal(wus.unshard((params, opt_state)), wus.unshard(state))
  mu = opt_state[0].mu["conv"]
  assert isinstance(mu, wus.ShardedArray) and mu.format.num_shards == n and mu.mesh == m
  step = W.wus_step(m)
  resumed = W.run(step, (params, opt_state), m, SAVED_AT, 2 * MORE)
  assert_trees_equal(wus.unshard(resumed),
                     wus.unshard(W.run(step, on(m, state), m, SAVED_AT, 2 * MORE)))
  assert_trees_equal(wus.unshard(resumed), wus.unshard(uninterrupted),
                     **({} if n == 8 else TOLERANCE))


def test_8_to_6_to_8(saved, uninterrupted, tmp_path):
  path, state, _ = saved
  m6, m8 = mesh(6), mesh(8)
  at6 = restore(path, m6)
  assert wus.sharded.is_sharded(at6[1][0].mu["v7"])  # [7] is sharded at 6, was whole at 8
  at6 = W.run(W.wus_step(m6), at6, m6, SAVED_AT, MORE)
  save(tmp_path / "at6", *at6)
  at8 = restore(tmp_path / "at6", m8)
  assert_trees_equal(wus.unshard(at8), wus.unshard(at6))
  at8 = W.run(W.wus_step(m8), at8, m8, SAVED_AT + MORE, MORE)

  handed = W.run(W.wus_step(m6), on(m6, state), m6, SAVED_AT, MORE)
  handed = W.run(W.wus_step(m8), on(m8, handed), m8, SAVED_AT + MORE, MORE)
  assert_trees_equal(wus.unshard(at8), wus.unshard(handed))
  assert_trees_equal(wus.unshard(at8), wus.unshard(uninterrupted), **TOLERANCE)


def test_plain_shard_map_checkpoint_restores_into_a_wus_step(tmp_path):
  """Whole optimizer state saved by `jax.jit(jax.shard_map(...))` training, restored sharded."""
  m8, m6 = mesh(8), mesh(6)
  plain = W.run(W.plain_step(m8), fresh(), m8, 0, SAVED_AT)
  ckptr = ocp.StandardCheckpointer()
  ckptr.save(tmp_path / "plain", {"params": plain[0], "opt_state": plain[1]})
  ckptr.wait_until_finished()
  params, opt_state = restore(tmp_path / "plain", m6)
  assert wus.sharded.is_sharded(opt_state[0].nu["conv"])
  assert_trees_equal(wus.unshard((params, opt_state)), plain)
  step = W.wus_step(m6)
  assert_trees_equal(wus.unshard(W.run(step, (params, opt_state), m6, SAVED_AT, MORE)),
                     wus.unshard(W.run(step, on(m6, plain), m6, SAVED_AT, MORE)))


# --- Several processes. ------------------------------------------------------------


def workers(mode, folder, *, processes, start=0, steps=0):
  """Runs `checkpoint_worker` in `processes` processes over 8 devices in all."""
  address = f"127.0.0.1:{free_port()}"
  procs = [subprocess.Popen(
      [sys.executable, WORKER, json.dumps(dict(
          mode=mode, dir=str(folder), devices=8 // processes, num_processes=processes,
          process_id=i, address=address, start=start, steps=steps))],
      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for i in range(processes)]
  for proc in procs:
    _, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-3000:]


def leaves_of(npz) -> dict:
  data = np.load(npz)
  return {k: data[k] for k in data.files}


def test_two_processes_save_one_restores(tmp_path):
  workers("save", tmp_path, processes=2, steps=SAVED_AT)
  saved = leaves_of(tmp_path / "save_saved.npz")
  # Each process wrote only what its own 4 devices hold, one shard per device at most.
  for process in (0, 1):
    for r in json.loads((tmp_path / f"writes_{process}.json").read_text()):
      assert {p for _, p, _, _ in r["pieces"]} == {process}
      assert len(r["pieces"]) == 4 and all(n <= r["shard_size"] for *_, n in r["pieces"])
  m = mesh(8)
  params, opt_state = restore(tmp_path / "ckpt", m)
  assert W.whole((params, opt_state)).keys() == saved.keys()
  for k, v in W.whole((params, opt_state)).items():
    np.testing.assert_array_equal(v, saved[k], err_msg=k)
  step = W.wus_step(m)
  from_saved = jax.tree.unflatten(jax.tree.structure(wus.unshard((params, opt_state))),
                                  [saved[k] for k in W.whole((params, opt_state))])
  assert_trees_equal(wus.unshard(W.run(step, (params, opt_state), m, SAVED_AT, MORE)),
                     wus.unshard(W.run(step, on(m, from_saved), m, SAVED_AT, MORE)))


def test_one_process_saves_two_restore(saved, uninterrupted, tmp_path):
  path, state, _ = saved
  shutil.copytree(path, tmp_path / "ckpt")
  workers("resume", tmp_path, processes=2, start=SAVED_AT, steps=2 * MORE)
  restored = leaves_of(tmp_path / "resume_restored.npz")
  for k, v in W.whole(state).items():
    np.testing.assert_array_equal(restored[k], v, err_msg=k)
  final = leaves_of(tmp_path / "resume_final.npz")
  for k, v in W.whole(uninterrupted).items():  # gloo sums in another order
    np.testing.assert_allclose(final[k], v, err_msg=k, **TOLERANCE)


# --- Bad checkpoints. --------------------------------------------------------------


def test_checkpoint_of_another_model_is_one_line_and_changes_nothing(saved, tmp_path):
  path, _, _ = saved
  shutil.copytree(path, tmp_path / "ckpt")
  before = snapshot(tmp_path)
  other = {**W.init_params(), "conv": np.zeros((3, 3, 5, 8), np.float32)}
  like = jax.eval_shape(lambda: (other, W.TX.init(other)))
  with pytest.raises(wus.CheckpointError) as e:
    ocp.StandardCheckpointer().restore(tmp_path / "ckpt", target(mesh(8), like))
  assert str(e.value) == (f"array 'opt_state.0.mu.conv' of the checkpoint in {tmp_path / 'ckpt'} "
                          "has shape (3, 3, 5, 7); the target expects (3, 3, 5, 8)")
  assert snapshot(tmp_path) == before


def halve(path):
  path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])


@pytest.mark.parametrize("damage, status", [
    (lambda ckpt: halve(max(ckpt.glob("d/*"), key=lambda p: p.stat().st_size)), "OUT_OF_RANGE"),
    (lambda ckpt: halve(ckpt / "manifest.ocdbt"), "DATA_LOSS"),
], ids=["array_data_halved", "manifest_halved"])
def test_damaged_checkpoint_is_one_line_and_changes_nothing(saved, tmp_path, damage, status):
  path, _, _ = saved
  shutil.copytree(path, tmp_path / "ckpt")
  damage(tmp_path / "ckpt")
  before = snapshot(tmp_path)
  with pytest.raises(wus.CheckpointError) as e:
    restore(tmp_path / "ckpt", mesh(8))
  message = str(e.value)
  assert "\n" not in message and len(message) < 600, message
  assert message.startswith("cannot open array 'opt_state.0.mu.bias' of the checkpoint in "
                            f"{tmp_path / 'ckpt'}: {status}: "), message
  assert snapshot(tmp_path) == before


def readme_loop(path, m, num_steps):
  """The loop of docs/checkpoints.md, on mesh `m`, saving every 2 updates."""
  step = W.wus_step(m)
  params, opt_state = fresh()
  batches = [W.batch(i, m) for i in range(num_steps)]
  manager = ocp.CheckpointManager(path)
  start = 0
  if (last := manager.latest_step()) is not None:    # resume, at this run's replica count
    params_t, opt_state_t, _ = step.state_target(params, opt_state, batches[0])
    state = manager.restore(last, args=ocp.args.StandardRestore(
        {"params": params_t, "opt_state": opt_state_t}))
    params, opt_state, start = state["params"], state["opt_state"], last
  for i in range(start, num_steps):
    params, opt_state, _ = step(params, opt_state, batches[i])   # the same global batch
    if (i + 1) % 2 == 0:
      manager.save(i + 1, args=ocp.args.StandardSave(
          wus.checkpointable({"params": params, "opt_state": opt_state})))
  manager.wait_until_finished()
  manager.close()
  return start, (params, opt_state)


def test_checkpoint_manager_loop_resumes_at_another_replica_count(tmp_path):
  m8, m6 = mesh(8), mesh(6)
  assert readme_loop(tmp_path, m8, SAVED_AT)[0] == 0
  start, at6 = readme_loop(tmp_path, m6, SAVED_AT + MORE)
  assert start == SAVED_AT
  handed = W.run(W.wus_step(m8), fresh(), m8, 0, SAVED_AT)
  handed = W.run(W.wus_step(m6), on(m6, handed), m6, SAVED_AT, MORE)
  assert_trees_equal(wus.unshard(at6), wus.unshard(handed))


def test_pmap_state_saves_one_replicas_value(tmp_path):
  """`wus.pmap` state (stacked copies) is saved as `flax.jax_utils.unreplicate` would give it."""
  state = (stack(pmap_params()), stack(PMAP_TX.init(pmap_params())))
  step = wus.pmap(pmap_step, axis_name="batch")
  for x in pmap_xs():
    state = step(*state, x)[:2]
  assert wus.sharded.is_sharded(state[1][0].mu["w"])
  ckptr = ocp.StandardCheckpointer()
  ckptr.save(tmp_path / "ckpt", wus.checkpointable({"opt_state": state[1]}))
  ckptr.wait_until_finished()
  restored = ckptr.restore(tmp_path / "ckpt")["opt_state"][0]
  whole = wus.unshard(state[1])[0]
  for name in ("mu", "nu"):
    for k in ("w", "b"):
      np.testing.assert_array_equal(restored[name][k], np.asarray(getattr(whole, name)[k])[0])
