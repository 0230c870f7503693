"""Test set-up: 8 simulated CPU devices, XLA rounding every operation, JAX's checks.

Both must be fixed before JAX initializes its backend, so they live here.

Three XLA choices round differently in two different programs computing the
same elementwise formula (the unmodified step and the rewritten one), because
they depend on how each program happens to be fused:
  * `--xla_cpu_max_isa=AVX`: no FMA instructions, so `a * b + c` is never
    contracted into a fused multiply-add;
  * `--xla_allow_excess_precision=false`: bfloat16 arithmetic, which the CPU
    computes in float32, is rounded back to bfloat16 after every operation
    instead of wherever a fusion happens to end;
  * `--xla_cpu_experimental_ynn_fusion_type=` (empty: none): no YNNPACK library
    fusions. XLA:CPU hands some reductions of the entry computation to
    YNNPACK, which sums in another order than XLA's own code, but not those in
    a conditional's branch, where an owned update runs (ownership, DESIGN.md).
With these, "bit for bit" (DESIGN.md §4, invariant 1) is a strict test of the
rewrite itself. The flags hold for the whole test process; the one parity
case that runs with XLA's defaults at a tolerance of a few ulps
(`test_parity.py::test_with_default_xla_flags_within_a_few_ulps`) runs in a
subprocess (`parity_worker.py`) whose XLA_FLAGS set only the device count.

A fourth flag is about time: `--xla_cpu_collective_call_terminate_timeout_seconds`.
XLA:CPU ends the process (LOG(FATAL), abort()) when a device has waited at a
collective for another for 20 s plus this timeout, 40 s by default, however
valid the program (tests/repro/late_device.py; a suspect of issue 41's aborts
under load, docs/tests.md). Here 20 + 600 s: a collective that never completes
is still stopped, by XLA with its message naming it, before the per-test limit.

Profiles. `python -m pytest -q tests` runs the default profile; `--slow` (or
WUS_SLOW=1) also runs the tests marked `slow`, the slowest end-to-end runs and
the larger parametrizations of the parity families (each family keeps cases in
the default profile), and turns the fuzzer's 8 fixed-seed cases into 100
(tests/equivalence/test_fuzz.py). .ci/run runs both. docs/tests.md
gives the measured times.

Time limits (docs/tests.md). pytest-timeout's per-test limit (pyproject's
`timeout`, a test's `@pytest.mark.timeout`, `--timeout`; setup and teardown
included) is armed here with faulthandler's watchdog, a C thread: it fires even
while the test blocks in a C++ call that holds the GIL, where pytest-timeout's
own methods never do (its timer thread needs the GIL; its signal handler runs
only when the call returns). It prints every thread's Python stack to the
terminal and ends the process. Under pytest-xdist that is a worker that died
while running the test: xdist reports the test as failed, and since
`--max-worker-restart` is 0 here unless given, the run then ends red instead of
re-running the file in a new worker (issue 41).
"""

import faulthandler
import os
import signal

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_cpu_max_isa=AVX --xla_allow_excess_precision=false"
                           + " --xla_cpu_experimental_ynn_fusion_type="
                           + " --xla_cpu_collective_call_terminate_timeout_seconds=600").strip()

import jax  # noqa: E402
import pytest  # noqa: E402
from pytest_timeout import is_debugging  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)


def pytest_addoption(parser):
  parser.addoption("--slow", action="store_true", default=False,
                   help="also run the tests marked slow and the fuzzer's 100-case profile "
                        "(as WUS_SLOW=1)")


def pytest_configure(config):
  config.addinivalue_line("markers", "slow: opt-in (--slow or WUS_SLOW=1): a long end-to-end "
                                     "run or a larger parametrization")
  config.addinivalue_line("markers", "fuzz: the differential fuzzer (20 cases; 100 with --slow)")
  if config.getoption("--slow"):
    os.environ["WUS_SLOW"] = "1"  # Read by test_fuzz.py at import, after this hook.
  _time_limits(config)


# Time limits (the docstring above; docs/tests.md).
_terminal = None  # The terminal: during a test, fd 2 is pytest's capture file.


def _time_limits(config):
  global _terminal
  _terminal = open(os.dup(2), "w")  # Capture is suspended in pytest_configure: fd 2 is the tty.
  # .ci/run's bound on a whole run ends it with SIGTERM: each pytest process (under xdist, each
  # worker, in its test) prints its threads' Python stacks first.
  faulthandler.register(signal.SIGTERM, file=_terminal, chain=True)
  if getattr(config.option, "maxworkerrestart", 0) is None:  # pytest-xdist's, not given.
    config.option.maxworkerrestart = "0"


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item, settings):
  if not is_debugging():
    faulthandler.dump_traceback_later(settings.timeout, exit=True, file=_terminal)
  return True


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_cancel_timer(item):
  faulthandler.cancel_dump_traceback_later()
  return True


def pytest_enter_pdb():
  faulthandler.cancel_dump_traceback_later()


# Folders whose tests run with `jax_enable_checks`: JAX then type-checks every
# jaxpr it builds (the rewritten step's included) and its tracing invariants, so
# a rewrite that emits an ill-typed equation fails even where its numbers come
# out right (issue 19 item 7).
CHECKED = ("equivalence", "api", "transforms")


@pytest.fixture(autouse=True)
def _jax_checks(request):
  with jax.enable_checks(request.node.path.parent.name in CHECKED):
    yield


def pytest_collection_modifyitems(config, items):
  if os.environ.get("WUS_SLOW"):
    return
  skip = pytest.mark.skip(reason="slow: run with --slow (or WUS_SLOW=1)")
  for item in items:
    if "slow" in item.keywords:
      item.add_marker(skip)
