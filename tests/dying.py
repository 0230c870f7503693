"""Tests that end their process, run only by tests/test_suite_limits.py (issue 41).

The suite does not collect this file (its name does not start with test_), and
each test here does what it is named for only when WUS_DYING names it.
"""

import ctypes
import os

import pytest


def _opted_in(request):
  if os.environ.get("WUS_DYING") != request.node.name:
    pytest.skip("run by tests/test_suite_limits.py (WUS_DYING=<this test's name>)")


LAST_WORDS = b"F0000 00:00:00.000000 0 dying.py:1] Check failed: as XLA's LOG(FATAL) writes\n"


def test_aborts(request):
  """Ends as XLA ends a process on a fatal error: LOG(FATAL) writes its line to fd 2, then
  calls abort()."""
  _opted_in(request)
  os.write(2, LAST_WORDS)
  os.abort()


def test_blocks_forever_holding_the_gil(request):
  """Blocks in a C call that holds the GIL (ctypes.PyDLL does not release it), so no Python
  thread of this process runs again: a deadlock inside a C++ call looks so."""
  _opted_in(request)
  ctypes.PyDLL(None).pause()


def test_after_them():
  """Would run next in the same worker, had the run gone on."""
