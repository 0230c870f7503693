"""End to end: kill and resume, other device counts, two processes, bad input.

One uninterrupted reference run (8 devices, in this process) is compared with
runs of `wus-train` in subprocesses: killed with SIGKILL while saving and
resumed; resumed at 4 devices and back at 8; run by 2 processes x 4 devices.
The subprocesses inherit XLA_FLAGS from conftest.py, so that a run at the same
device count is bit for bit the same program.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import wus
from helpers import assert_trees_equal
from wus.harness.training import config, loop, steps, train

pytestmark = pytest.mark.slow  # Minutes of training each (docs/tests.md).

# resnet_small + LARS on the digits, in wus mode.
FLAGS = {"model": "resnet_small", "steps": 20, "batch_size": 8, "checkpoint_every": 5,
         "eval_every": 10}
# Another device count or the gloo collectives sum in another order; training
# amplifies those rounding differences, so states agree to a tolerance.
TOLERANCE = dict(rtol=1e-3, atol=1e-5)


def run_config(output_dir, **overrides) -> config.RunConfig:
  return config.RunConfig.for_model(**{**FLAGS, **overrides}, mode="wus", output_dir=output_dir)


def cli(output_dir, **overrides) -> list[str]:
  """`wus-train` with FLAGS (and overrides); its checkpoints go to output_dir/wus."""
  flags = {**FLAGS, **overrides, "modes": "wus", "output_dir": output_dir}
  return [sys.executable, "-m", "wus.harness.training.train",
          *(f"--{k}={v}" for k, v in flags.items())]


def checkpoint_steps(run_dir) -> list[int]:
  """Steps of the complete checkpoints of a mode's folder (Orbax renames a step when done)."""
  return sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())


def saved_state(run_dir, step: int):
  """The state saved as `step` in a mode's folder, whole, as numpy arrays."""
  cfg = run_config(run_dir)
  dataset, task, tx, _ = train.build(cfg)
  checkpoints = train.open_checkpoints(cfg, task)
  mesh = jax.make_mesh((8,), (steps.AXIS_NAME,))
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                       sharding=NamedSharding(mesh, P())),
                        jax.eval_shape(lambda: loop.init_state(task, tx, dataset, cfg.seed)))
  state = checkpoints.restore(step, target)  # whole, as code without wus restores it
  checkpoints.close()
  return jax.tree.map(np.asarray, state)


def records(run_dir, kind: str) -> list[dict]:
  """The metrics of one kind, without wall times."""
  lines = (run_dir / "metrics.jsonl").read_text().splitlines()
  return [{k: v for k, v in r.items() if k != "step_seconds"}
          for r in map(json.loads, lines) if r["kind"] == kind]


def whole(state):
  return jax.tree.map(np.asarray, wus.unshard(state))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """The uninterrupted run; returns its mode folder and result."""
  run_dir = tmp_path_factory.mktemp("reference") / "wus"
  return run_dir, train.fit(run_config(run_dir))


def test_killed_during_a_save_resumes_as_if_uninterrupted(reference, tmp_path):
  ref_dir, ref = reference
  run_dir = tmp_path / "wus"
  with open(tmp_path / "stderr.txt", "w") as stderr:
    proc = subprocess.Popen(cli(tmp_path), stdout=subprocess.DEVNULL, stderr=stderr)
    # Kill as soon as a save is under way (Orbax writes into a temporary folder)
    # after at least one complete checkpoint.
    while proc.poll() is None:
      names = os.listdir(run_dir / "checkpoints") if (run_dir / "checkpoints").exists() else []
      if any(n.isdigit() for n in names) and any("tmp" in n for n in names):
        proc.send_signal(signal.SIGKILL)
        break
      time.sleep(0.001)
    assert proc.wait() == -signal.SIGKILL, (tmp_path / "stderr.txt").read_text()
  last = checkpoint_steps(run_dir)[-1]
  assert 0 < last < FLAGS["steps"]

  resumed = train.fit(run_config(run_dir))
  assert resumed.summary["start_step"] == last  # nothing lost beyond the last checkpoint
  assert_trees_equal(whole(resumed.state), whole(ref.state))
  assert records(run_dir, "train") == records(ref_dir, "train")
  assert records(run_dir, "eval") == records(ref_dir, "eval")
  assert not [n for n in os.listdir(run_dir / "checkpoints") if "tmp" in n]


def test_restores_at_another_device_count(reference, tmp_path):
  """8 devices -> 4 devices -> 8 devices; the global batch stays 64."""
  ref_dir, ref = reference
  run_dir = tmp_path / "wus"
  shutil.copytree(ref_dir, run_dir)
  for step in checkpoint_steps(run_dir):
    if step > 10:
      shutil.rmtree(run_dir / "checkpoints" / str(step))
  subprocess.run(cli(tmp_path, num_devices=4, batch_size=16), check=True,
                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  assert checkpoint_steps(run_dir)[-1] == FLAGS["steps"]
  shutil.rmtree(run_dir / "checkpoints" / str(FLAGS["steps"]))

  resumed = train.fit(run_config(run_dir))
  assert resumed.summary["start_step"] == 15
  assert_trees_equal(whole(resumed.state), whole(ref.state), **TOLERANCE)


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_two_processes_equal_one(tmp_path):
  """2 processes x 4 devices (gloo) against 1 process x 8 devices, 6 steps.

  The gloo all-reduces sum in another order, and training amplifies that
  about tenfold every three steps (losses: equal at step 1, 1e-7 apart at
  step 2, 1e-5 at step 20), so the runs are short enough for TOLERANCE to
  mean "the same run".
  """
  short = dict(steps=6, eval_every=0, checkpoint_every=0)
  ref = train.fit(run_config(tmp_path / "one" / "wus", **short))
  address = f"127.0.0.1:{free_port()}"
  procs = [subprocess.Popen(cli(tmp_path, num_devices=4, num_processes=2, process_id=i,
                                coordinator_address=address, **short),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
           for i in range(2)]
  for proc in procs:
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
  run_dir = tmp_path / "wus"
  assert checkpoint_steps(run_dir) == [short["steps"]]
  assert_trees_equal(saved_state(run_dir, short["steps"]), whole(ref.state), **TOLERANCE)
  losses = [r["loss"] for r in records(run_dir, "train")]
  np.testing.assert_allclose(losses, ref.summary["losses"], rtol=1e-6)


def snapshot(root):
  return {str(p): (p.stat().st_mtime_ns, p.read_bytes() if p.is_file() else None)
          for p in sorted(root.rglob("*"))}


def first_error_line(tmp_path, **flags) -> str:
  """The first stderr line of `wus-train` with `flags`, which must fail with status 1,
  without a traceback, changing nothing under tmp_path."""
  before = snapshot(tmp_path)
  proc = subprocess.run(cli(tmp_path, **flags), capture_output=True, text=True, timeout=300)
  assert proc.returncode == 1, proc.stderr
  assert "Traceback" not in proc.stderr, proc.stderr
  assert snapshot(tmp_path) == before
  return proc.stderr.strip().splitlines()[0]


@pytest.mark.parametrize("flags, message", [
    ({"model": "transformer_small"}, "wus-train: error: the checkpoint at step 20 in "),
    ({"optimizer": "adam"}, "'lars' here, 'adam' in this run"),
    ({"data": "/no/such/digits.npz"}, "wus-train: error: --data=/no/such/digits.npz: no such "
                                      "file or directory"),
    ({"no_such_flag": 1}, "FATAL Flags parsing error: Unknown command line flag"),
    ({"steps": 0}, "FATAL Flags parsing error: flag --steps=0"),
], ids=["other_model", "other_optimizer", "missing_data", "unknown_flag", "bad_value"])
def test_bad_input_is_one_line_and_leaves_checkpoints_intact(reference, tmp_path, flags,
                                                             message):
  ref_dir, _ = reference
  shutil.copytree(ref_dir, tmp_path / "wus")
  assert message in first_error_line(tmp_path, **flags)


def test_unreadable_data_or_checkpoint_record_is_one_line_and_left_intact(reference, tmp_path):
  ref_dir, _ = reference
  shutil.copytree(ref_dir, tmp_path / "wus")
  data = tmp_path / "digits.npz"
  np.savez(data, images=np.zeros((50, 8, 8), np.uint8), labels=np.zeros(50, np.int64))
  data.write_bytes(data.read_bytes()[:100])
  assert first_error_line(tmp_path, data=data).startswith(
      f"wus-train: error: --data={data}: cannot read it as a .npz file")

  shutil.rmtree(tmp_path / "wus" / "checkpoints" / str(FLAGS["steps"]) / "meta")
  assert first_error_line(tmp_path).startswith(
      f"wus-train: error: the checkpoint at step {FLAGS['steps']} in "
      f"{tmp_path / 'wus' / 'checkpoints'} has no readable record")
