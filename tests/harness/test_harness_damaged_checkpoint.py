"""`wus-train` on a damaged checkpoint: one line, before any mode trains, nothing changed.

A short real run of both modes writes checkpoints; then a file of the wus
mode's latest checkpoint is halved, as a full disk or an interrupted copy
leaves it, and `wus-train` is run again (in a subprocess, to see all it
prints, including what threads print at exit).
"""

import shutil
import subprocess
import sys

import pytest

from wus.harness.training import config, steps, train

pytestmark = pytest.mark.slow  # Trains, then runs wus-train twice (docs/tests.md).

# decay_steps: the LARS schedule the 4-step resume continues (it would refuse one ending at 2).
FLAGS = {"model": "resnet_small", "steps": 2, "decay_steps": 4, "batch_size": 2,
         "eval_examples": 16, "eval_every": 0, "checkpoint_every": 0}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
  """The output folder of a 2-step run of both modes (one checkpoint each, at step 2)."""
  out = tmp_path_factory.mktemp("written")
  train.fit_modes([config.RunConfig.for_model(**FLAGS, mode=mode, output_dir=out / mode)
                   for mode in steps.MODES])
  return out


def snapshot(root):
  return {str(p): (p.stat().st_mtime_ns, p.read_bytes() if p.is_file() else None)
          for p in sorted(root.rglob("*"))}


def halve(path):
  assert path.is_file(), path
  path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])


def largest_data_file(state):
  """The largest array data file of an Orbax item folder (OCDBT: `ocdbt.process_0/d/*`)."""
  return max((p for p in state.rglob("ocdbt.process_*/d/*") if p.is_file()),
             key=lambda p: p.stat().st_size)


@pytest.mark.parametrize("damage, status", [
    (lambda state: halve(largest_data_file(state)), "OUT_OF_RANGE: "),
    (lambda state: halve(state / "manifest.ocdbt"), "DATA_LOSS: "),
], ids=["array_data_halved", "manifest_halved"])
def test_damaged_checkpoint_stops_the_run_in_one_line_and_is_left_untouched(
    written, tmp_path, damage, status):
  out = tmp_path / "out"
  shutil.copytree(written, out)
  damage(out / "wus" / "checkpoints" / "2" / "state")
  before = snapshot(out)
  flags = {**FLAGS, "steps": 4, "output_dir": out}
  proc = subprocess.run([sys.executable, "-m", "wus.harness.training.train",
                         *(f"--{k}={v}" for k, v in flags.items())],
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 1, proc.stderr
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1, proc.stderr  # no traceback, no progress: the replicated mode
  checkpoints = out / "wus" / "checkpoints"  # did not start either
  assert lines[0].startswith(f"wus-train: error: the checkpoint at step 2 in {checkpoints} "
                             f"is unreadable ({status}"), lines[0]
  assert lines[0].endswith(f"; it is damaged: delete {checkpoints / '2'} to resume from the "
                           "checkpoint before it (or from scratch if none), or use another "
                           "--output_dir"), lines[0]
  assert len(lines[0]) < 600, lines[0]
  assert not proc.stdout
  assert snapshot(out) == before
