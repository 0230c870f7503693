"""Every program in examples/ runs as a user runs it (`python examples/x.py`, in a fresh
process that sets its own 8 CPU devices, with XLA's default flags), checks its losses
against the unmodified step's, and prints the optimizer state per device: the wus step's
at most 1.15 x 1/N of a whole copy (issue 39)."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
LINE = re.compile(r"^optimizer state per device, ([\w.]+):\s+DeviceBytes\((.*) of a copy, on "
                  r"(\d+) device\(s\)\)$", re.M)


def test_there_are_examples_for_each_front_end():
  text = "".join(p.read_text() for p in EXAMPLES)
  for front_end in ("wus.nnx_jit", "wus.jit", "wus.filter_jit", "wus.shard_map"):
    assert f"train({front_end})" in text or f"train({front_end}(" in text, front_end
  assert '("data", "model")' in text  # One on a data x model mesh.


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_an_example_runs_and_prints_its_saving(path):
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # As a user's shell has it.
  result = subprocess.run([sys.executable, str(path)], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=900)
  assert result.returncode == 0, result.stdout + result.stderr
  assert "NotShardedWarning" not in result.stderr, result.stderr
  found = {name: (text, int(n)) for name, text, n in LINE.findall(result.stdout)}
  (before,) = [v for k, v in found.items() if not k.startswith("wus.")]
  (after,) = [v for k, v in found.items() if k.startswith("wus.")]
  fraction, devices = float(after[0].rsplit(" ", 1)[1]), after[1]
  assert devices == 8 and fraction <= 1.15 / devices, result.stdout
  assert float(before[0].rsplit(" ", 1)[1]) > 2 * fraction, result.stdout
  assert len(re.findall(r"^losses, ", result.stdout, re.M)) == 2, result.stdout
