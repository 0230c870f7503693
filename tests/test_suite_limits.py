"""The suite ends red instead of hanging (issue 41): a test that kills its pytest-xdist worker,
or blocks forever, ends the run with the test named as failed.

Each case runs one of tests/dying.py's tests, then a test that would pass, in a subprocess
under pytest-xdist as the README's command runs the suite (`--dist loadfile`, tests/conftest.py's
settings; one worker: a crash takes the same path with one start-up less), with a per-test limit
of LIMIT seconds. The last test checks the XLA flag tests/conftest.py raises for issue 41's
suspect, XLA:CPU ending a process whose device is late at a collective.
"""

import os
import pathlib
import signal
import subprocess
import sys

import pytest

import dying

ROOT = pathlib.Path(__file__).resolve().parents[1]
LIMIT = 5  # Seconds: the per-test limit of the runs below (--timeout).


@pytest.mark.parametrize("name,says", [
    pytest.param("test_aborts", "Fatal Python error: Aborted", id="aborts"),
    pytest.param("test_blocks_forever_holding_the_gil", f"Timeout (0:00:{LIMIT:02d})!",
                 id="blocks")])
def test_a_test_that_kills_its_worker_ends_the_run_red_naming_it(name, says):
  """The worker dies (it aborts, or the watchdog ends it after LIMIT s, printing its stacks) and
  the run ends: the test reported failed once, the worker not replaced (xdist would re-run the
  file in a new worker, the dying test first), the next test not run."""
  run = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "1", "--dist",
       "loadfile", f"--timeout={LIMIT}", f"tests/dying.py::{name}",
       "tests/dying.py::test_after_them"],
      cwd=ROOT, env=dict(os.environ, WUS_DYING=name), capture_output=True, text=True,
      timeout=300)  # Hung: TimeoutExpired.
  out = run.stdout + run.stderr
  assert run.returncode == 1, out
  # Reported failed once (the short summary's line; how much of its reason it shows depends
  # on the terminal's width, COLUMNS), with xdist's reason.
  assert out.count(f"FAILED tests/dying.py::{name} - ") == 1, out
  assert f"crashed while running 'tests/dying.py::{name}'" in out, out
  assert says in out and f" in {name}\n" in out, out  # Its frame in the stacks printed.
  assert "\n1 failed in " in run.stdout, out
  if name == "test_aborts":  # What it wrote to fd 2 last, as XLA's LOG(FATAL) does.
    assert dying.LAST_WORDS.decode() in out, out


@pytest.mark.parametrize("terminate", [1, 30])
def test_xla_cpu_ends_the_process_when_a_device_is_late_at_a_collective(terminate):
  """tests/repro/late_device.py, device 0 4 s late at an all-reduce, with XLA:CPU's wait shortened
  to 1 s before its warning plus `terminate` s (tests/conftest.py raises the latter): after 1 + 1 s
  XLA ends the process with its message; given 1 + 30 s the program completes."""
  flags = ["--xla_cpu_collective_call_warn_stuck_timeout_seconds=1",
           f"--xla_cpu_collective_call_terminate_timeout_seconds={terminate}"]
  run = subprocess.run([sys.executable, "tests/repro/late_device.py", "4"], cwd=ROOT,
                       env=dict(os.environ, XLA_FLAGS=" ".join(flags)), capture_output=True,
                       text=True, timeout=300)
  if terminate == 1:
    assert run.returncode == -signal.SIGABRT, run.stderr[-3000:]
    assert "Termination timeout for `all reduce" in run.stderr, run.stderr[-3000:]
  else:
    assert run.returncode == 0 and run.stdout.split() == ["28.0"], run.stderr[-3000:]
