"""Differential fuzzer: `wus.shard_map` against `jax.jit(jax.shard_map)` on random programs.

Each example is a training program users could write (tests/fuzz_cases.py):
a random parameter tree used the way layers use it, a random optax chain over
the transform catalogue, N in {2, 3, 4, 6, 8}, check_vma on or off, 2-3 steps;
half of them per replica under shard_map, half global-view steps under jax.jit
on Auto or Explicit meshes (data, tensor, FSDP, HSDP, data x fsdp x tensor).
The unmodified step and the wus step run from the same inputs; their
parameters, optimizer state (after `wus.unshard`), extra state and loss must
agree: bit for bit when the update is elementwise, within a tight tolerance
when its jaxpr sums floats (`fuzz_cases.reorders_sums`; `fuzz_cases.tolerance`
says why each bound). A case where the unmodified JAX step raises is rejected
(some optimizers are not defined for every tree); any exception from wus
fails, and so does a Plan that cannot print. A cluster holding a big tensor
may stay replicated ("kept replicated") if the Plan gives a reason.

Profiles (registered here, applied only to this module's test):
  python -m pytest -q tests/equivalence/test_fuzz.py                # "quick": 8, fixed seed
  python -m pytest -q tests/equivalence/test_fuzz.py --slow         # "ci": 100 (WUS_SLOW=1)
  WUS_FUZZ=long python -m pytest -q tests/equivalence/test_fuzz.py  # "long": hundreds, random
  WUS_FUZZ=long WUS_FUZZ_EXAMPLES=1000 ...                # any size (any profile)
  WUS_FUZZ_FRONTS=auto,explicit ...                       # wus.jit only (any profile)
  WUS_FUZZ_KEEP_GOING=1 ...            # every failure saved as a script; the run goes on
A failing example prints its complete standalone script (hypothesis `note`):
save it as repro.py and run `XLA_FLAGS=--xla_force_host_platform_device_count=8 python repro.py`.
Hypothesis ends the run at the first failure (and shrinks it); with WUS_FUZZ_KEEP_GOING=1 each
failing case's script is written to .pytest_cache/d/wus-fuzz/cases-<profile>/ instead, its
error in comments at the end, the run draws on, and it ends red (an error at the module's
teardown) if any failed.

On a global-view front each case also measures the optimizer state wus returns per device
(`fuzz_cases.state_bytes`): more than `fuzz_cases.UNDER` times the ideal (every big leaf
split over all the mesh's devices) counts as "under-sharded", with the Plan's reason, and
its script is saved the same way, the Plan at its end. It is counted, not failed: the Plan
gives reasons a fuzz case cannot judge (an all-gather dearer than the all-reduce it
replaces), so each is triaged by hand.

At the end of the run pytest prints one summary line (cases run, exact,
close, kept replicated, failures: failing example runs, hypothesis's shrinking
included, and how many distinct errors) and writes it, with the reasons and
the first case behind each rejection and failure, as JSON to
.pytest_cache/d/wus-fuzz/summary-<profile>.json.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import pathlib
import re
import tempfile
import time
import traceback

import jax
import pytest
from hypothesis import HealthCheck, event, given, note, reject, settings

import fuzz_cases
import wus
from helpers import mesh

PROFILE = os.environ.get("WUS_FUZZ") or ("ci" if os.environ.get("WUS_SLOW") else "quick")
_SUPPRESS = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example]

# Each example compiles the unmodified and the wus step: 20 "quick" examples took 255 s at
# load 5.5-7 on this machine's 2 shared cores (2026-11-25), so the default runs 8 and --slow
# the 100 of the "ci" profile.
_EXAMPLES = os.environ.get("WUS_FUZZ_EXAMPLES")  # Overrides either profile's count.
settings.register_profile("wus-fuzz-quick", max_examples=int(_EXAMPLES or 8), derandomize=True,
                          deadline=None, database=None, suppress_health_check=_SUPPRESS,
                          print_blob=False)
settings.register_profile("wus-fuzz-ci", max_examples=int(_EXAMPLES or 100), derandomize=True,
                          deadline=None, database=None, suppress_health_check=_SUPPRESS,
                          print_blob=False)
settings.register_profile("wus-fuzz-long", max_examples=int(_EXAMPLES or 400),
                          derandomize=False, deadline=None, database=None,
                          suppress_health_check=_SUPPRESS, print_blob=True)
if PROFILE not in ("quick", "ci", "long"):
  raise ValueError(f"WUS_FUZZ={PROFILE!r}: use 'quick' (the default), 'ci' (--slow) or 'long'")
# The per-test limit (docs/tests.md) scaled to the examples: 120 s each, 8 times what one takes
# on 2 idle cores (the 8 quick ones took 306 s in all at load 8, 2026-11-29). Set here, not on
# the test: hypothesis's derandomized seed hashes the test's source, decorators included.
pytestmark = pytest.mark.timeout(
    max(900, 120 * settings.get_profile(f"wus-fuzz-{PROFILE}").max_examples))
# WUS_FUZZ_FRONTS=auto,explicit: only the global-view steps (wus.jit); every front by default.
FRONTS = tuple(f for f in fuzz_cases.FRONTS if f in os.environ.get(
    "WUS_FUZZ_FRONTS", ",".join(fuzz_cases.FRONTS)).split(","))
KEEP_GOING = os.environ.get("WUS_FUZZ_KEEP_GOING") == "1"
if not FRONTS:
  raise ValueError(f"WUS_FUZZ_FRONTS={os.environ['WUS_FUZZ_FRONTS']!r}: name some of "
                   f"{sorted(set(fuzz_cases.FRONTS))}")


class _Summary:
  """What the run saw, across every example hypothesis ran (shrinking included)."""

  def __init__(self):
    self.start: float | None = None        # At the first example (not at collection).
    self.counts = collections.Counter()
    self.meshes = collections.Counter()     # Cases run per front and mesh (axis names).
    self.kept = collections.Counter()       # Reasons of replicated clusters holding big tensors.
    self.rejected = collections.Counter()   # Why the unmodified step raised.
    self.examples: dict[str, str] = {}      # Rejection or failure -> the first case that hit it.
    self.failures = collections.Counter()   # Distinct wus failures.
    self.worst = 0.0                        # Largest |diff| / tolerance of a "close" case.
    self.under = collections.Counter()      # Under-sharded cases, by the Plan's reason.
    self.folder: pathlib.Path | None = None  # Where the summary and cases' scripts go.
    self.saved: list[str] = []              # Scripts saved (failures, under-sharded).

  def save(self, kind: str, case, text: str) -> None:
    """Writes `case`'s script to the folder, `text` (its error, or its Plan) as comments."""
    if self.folder is None:
      return
    folder = self.folder / f"cases-{PROFILE}"
    folder.mkdir(exist_ok=True)
    path = folder / f"{kind}-{len(self.saved):03d}.py"
    path.write_text(case.script() + "\n# " + text.replace("\n", "\n# ") + "\n")
    self.saved.append(str(path))

  def line(self) -> str:
    c = self.counts
    return (f"wus fuzz [{PROFILE}]: cases run {c['run']}, exact {c['exact']}, close {c['close']}, "
            f"kept replicated {c['kept']}, under-sharded {c['under']}, "
            f"failures {c['failed']} ({len(self.failures)} distinct); "
            f"rejected {c['rejected']} (unmodified step raised); "
            f"worst close diff {self.worst:.2g} of tolerance; "
            f"{time.perf_counter() - (self.start or time.perf_counter()):.0f} s")

  def write(self) -> None:
    """Writes the summary as JSON (after every case: a run stopped early keeps its figures)."""
    if self.folder is not None:
      (self.folder / f"summary-{PROFILE}.json").write_text(json.dumps(self.as_dict(), indent=1))

  def as_dict(self) -> dict:
    return {"profile": PROFILE, "line": self.line(), "counts": dict(self.counts),
            "kept_replicated_reasons": dict(self.kept.most_common()),
            "rejected_reasons": dict(self.rejected.most_common()),
            "failures": dict(self.failures.most_common()), "worst_close_ratio": self.worst,
            "under_sharded_reasons": dict(self.under.most_common()),
            "cases_run_per_mesh": dict(self.meshes.most_common()),
            "first_case": self.examples, "saved": self.saved}


SUMMARY = _Summary()


class _SummaryPlugin:
  """Prints the summary line in pytest's terminal summary (after every test's output)."""

  def __init__(self, path: pathlib.Path):
    self.path = path

  def pytest_terminal_summary(self, terminalreporter):
    terminalreporter.write_line(SUMMARY.line())
    terminalreporter.write_line(f"wus fuzz summary written to {self.path}")


@pytest.fixture(scope="module", autouse=True)
def fuzz_summary(request):
  cache = getattr(request.config, "cache", None)
  folder = cache.mkdir("wus-fuzz") if cache is not None else pathlib.Path(tempfile.mkdtemp())
  path = folder / f"summary-{PROFILE}.json"
  if not request.config.pluginmanager.has_plugin("wus-fuzz-summary"):
    request.config.pluginmanager.register(_SummaryPlugin(path), "wus-fuzz-summary")
  # The clock starts here, right before the first example. (Not in the test:
  # hypothesis's derandomized seed hashes the test's source, so any edit there
  # changes every case the CI profile draws.)
  SUMMARY.start, SUMMARY.folder = time.perf_counter(), folder
  yield SUMMARY
  SUMMARY.write()
  if KEEP_GOING and SUMMARY.counts["failed"]:
    pytest.fail(f"{SUMMARY.counts['failed']} cases failed ({dict(SUMMARY.failures)}); their "
                f"scripts: {[p for p in SUMMARY.saved if '/failed-' in p]}")


def _signature(e: BaseException) -> str:
  """The exception's type and first line, without object ids (one entry per distinct bug)."""
  first = (str(e).strip().splitlines() or [""])[0]
  return f"{type(e).__name__}: {re.sub(r'id=[0-9]+', 'id=…', first)[:160]}"


def _reason(text: str) -> str:
  """A Plan reason without its source position (so equal reasons count together)."""
  return re.sub(r" at <wus fuzz case [0-9a-f]+>:[0-9:]+", "", text)[:120]


@pytest.mark.fuzz
@settings(settings.get_profile(f"wus-fuzz-{PROFILE}"))
@given(case=fuzz_cases.cases(FRONTS))
def test_wus_matches_unmodified_step(case):
  note(f"Standalone reproduction (repro.py):\n{case.script()}")
  ns = case.build()  # A fuzzer bug (bad source) errors here; it is not a rejection.
  m = (mesh(case.n, case.front) if case.front == "shard_map" and case.model == 1
       else ns["make_mesh"](case.front))
  kw = dict(mesh=m, in_specs=ns["IN_SPECS"], out_specs=ns["OUT_SPECS"], check_vma=case.check_vma)
  if case.front == "shard_map":
    unmodified, make_wus = jax.jit(jax.shard_map(ns["step"], **kw)), lambda: wus.shard_map(
        ns["step"], **kw)
  else:  # The global-view step under jax.jit, as the JAX sharding guide writes it.
    unmodified, make_wus = jax.jit(ns["global_step"]), lambda: wus.jit(ns["global_step"])
  with jax.set_mesh(m) if case.front != "shard_map" else contextlib.nullcontext():
    _check(case, ns, m, unmodified, make_wus)


def _failed(case, sig: str, text: str) -> None:
  SUMMARY.counts["failed"] += 1
  SUMMARY.failures[sig] += 1
  SUMMARY.examples.setdefault(sig, repr(case))
  SUMMARY.save("failed", case, text)


def _measure(case, m, opt_state, plan) -> None:
  """Counts (and saves) a case whose optimizer state wus keeps under-sharded."""
  measured, ideal = fuzz_cases.state_bytes(opt_state, m.devices.size)
  if measured <= fuzz_cases.UNDER * ideal:
    return
  kept = [c.reason.strip() for c in plan.clusters if not c.sharded]
  reason = _reason(str(plan.unchanged) if plan.unchanged is not None
                   else kept[0] if kept else "sharded less than the ideal")
  SUMMARY.counts["under"] += 1
  SUMMARY.under[reason] += 1
  SUMMARY.examples.setdefault("under-sharded: " + reason, repr(case))
  SUMMARY.save("under", case, f"under-sharded: {measured} B per device of optimizer state, "
               f"ideal {ideal} B\n{plan}")
  event("under-sharded")


def _check(case, ns, m, unmodified, make_wus):
  try:
    _check_case(case, ns, m, unmodified, make_wus)
  finally:
    SUMMARY.write()


def _check_case(case, ns, m, unmodified, make_wus):
  # The unmodified program first: if plain JAX / optax raises, the case is not a program.
  try:
    args, batches = ns["make_inputs"](m)
    want = jax.block_until_ready(ns["run"](unmodified, args, batches))
    reduces = ns["sums_reordered"](args[0])  # Exact, or within `tolerance`.
  except Exception as e:  # noqa: BLE001
    SUMMARY.counts["rejected"] += 1
    SUMMARY.rejected[_signature(e)] += 1
    SUMMARY.examples.setdefault(_signature(e), repr(case))
    event(f"rejected: {type(e).__name__}")
    reject()

  # wus: never skipped. Any exception or mismatch fails the case.
  SUMMARY.counts["run"] += 1
  SUMMARY.meshes[f"{case.front} {case.mesh.kind}"] += 1
  try:
    step = make_wus()
    got = ns["run"](step, args, batches)
    tol = dict(reduces=reduces, bf16=case.bf16, phased=case.mesh.phased)
    msgs, worst = ns["compare"](want, got, **tol)
    if case.evaluate:  # The user's own jitted evaluation reads the state wus returned.
      more, worse = ns["compare"](ns["evaluate"](*want[:2]), ns["evaluate"](*got[:2]), **tol)
      msgs, worst = msgs + more, max(worst, worse)
    plan = step.plan(*args, batches[0])
    kept, problems = fuzz_cases.replicated(plan, case.n)
    assert str(plan).startswith("wus plan")  # The Plan prints.
  except Exception as e:
    _failed(case, _signature(e), "".join(traceback.format_exception(e)))
    if KEEP_GOING:
      return
    raise
  if msgs or problems:
    _failed(case, "mismatch: " + (msgs or problems)[0].split(":")[0], "\n".join(msgs + problems))
    if KEEP_GOING:
      return
    raise AssertionError("wus differs from the unmodified step:\n" + "\n".join(msgs + problems))
  if case.front != "shard_map":
    _measure(case, m, got[1], plan)

  kind = "close" if reduces else "exact"
  SUMMARY.counts[kind] += 1
  SUMMARY.worst = max(SUMMARY.worst, worst)
  event(kind)
  if kept:
    SUMMARY.counts["kept"] += 1
    SUMMARY.kept.update({_reason(r) for r in kept})
    event("kept replicated")
  if SUMMARY.counts["run"] % 25 == 0:
    jax.clear_caches()  # Every example compiles new programs; keep a long run's memory flat.
