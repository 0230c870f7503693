"""The trainers' own train loops with their one documented line swapped for wus, against
the unmodified trainer (issue 40 item 5): MaxText on data 8 (and its own
`shard_optimizer_over_data`) and data 2 x fsdp 2 x tensor 2, Levanter on replica 8 and
data 2 x replica 2 x model 2, on 8 CPU devices (`run_maxtext.py`, `run_levanter.py`).

Each trainer needs Python >= 3.12 and its own environment (MaxText 0.2.5 pins JAX 0.12;
Levanter pins JAX < 0.12 and optax < 0.2.7), so each runs there, in a subprocess: these
tests run where `WUS_MAXTEXT_PYTHON` / `WUS_LEVANTER_PYTHON` name that environment's
Python (`.ci/trainers` makes both and sets them; docs/tests.md). Elsewhere they are skipped,
and cost the default suite nothing but this module's import.

What must hold (issue 40): losses within 1e-6 relative of the unmodified trainer, and the
optimizer state per device at most 1.15 x a whole copy / 8. Step times are printed by the
runners, side by side, never asserted. Until wus.jit derives the batch's splits without a
second trace (issue 37), MaxText's micro-batch slice and Levanter's gradient accumulation
make it run their steps unchanged (the state test then xfails, saying so), and on Levanter's
data x replica x model mesh that second trace raises inside haliax (both tests xfail); they
pass by themselves the moment that lands.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import subprocess
import tempfile

import pytest

HERE = pathlib.Path(__file__).parent
PYTHON = {"maxtext": "WUS_MAXTEXT_PYTHON", "levanter": "WUS_LEVANTER_PYTHON"}
CASES = [("maxtext", "data8", "auto"), ("maxtext", "d2f2t2", "auto"),
         ("maxtext", "data8", "explicit"), ("levanter", "r8", None),
         ("levanter", "d2r2m2", None)]
# wus's reason for running a step unchanged that issue 37 removes (its second trace).
SECOND_TRACE = "the step's equations change with the batch size"
# Where that second trace runs, in a traceback (an exception raised there reaches the user).
SECOND_TRACE_RAISED = "larger = jit_arguments.flat_jaxpr(self._trace("


@functools.cache
def run(trainer: str, mesh: str, shard_mode: str | None) -> dict:
  """The runner's records ({variant: record}); prints what it printed (pytest -s shows it)."""
  python = os.environ.get(PYTHON[trainer])
  if not python:
    pytest.skip(f"{PYTHON[trainer]} is not set: {trainer} runs in its own Python >= 3.12 "
                "environment, which .ci/trainers makes (docs/tests.md)")
  with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, "records.json")
    argv = [python, str(HERE / f"run_{trainer}.py"), "--mesh", mesh, "--json", out]
    argv += ["--shard-mode", shard_mode] if shard_mode else []
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    print(proc.stdout)
    assert os.path.exists(out), proc.stdout[-3000:] + proc.stderr[-6000:]
    with open(out, encoding="utf8") as f:
      records = json.load(f)
  failed = {k: r["output"] for k, r in records.items() if "error" in r}
  if set(failed) == {"wus"} and SECOND_TRACE_RAISED in failed["wus"]:
    pytest.xfail("issue 37: wus.jit's second trace of the step (at a larger batch) raises "
                 "inside the trainer: " + failed["wus"].strip().splitlines()[-1])
  assert not failed, failed
  return records


def _ids(case) -> str:
  return "-".join(x for x in case if x)


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_losses_and_parameters_as_the_unmodified_trainer(case):
  records = run(*case)
  ref = records["jax"]["losses"]
  for name, r in records.items():
    assert len(r["losses"]) == len(ref), name
    worst = max(abs(a - b) / abs(a) for a, b in zip(ref, r["losses"], strict=True))
    assert worst <= 1e-6, (name, ref, r["losses"])
  assert records["wus"]["param_diff"] <= 1e-5, records["wus"]["param_diff"]


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_optimizer_state_sharded_over_the_mesh(case):
  """At most 1.15 x a whole copy / 8 per device, wherever the trainer leaves more."""
  records = run(*case)
  wus_run, ref = records["wus"], records["jax"]
  bound = 1.15 * wus_run["opt_bytes_whole"] / 8
  if ref["opt_bytes_per_device"] <= bound:
    return  # The trainer's own layout already shards it (FSDP over every device).
  if wus_run["opt_bytes_per_device"] > bound and SECOND_TRACE in (wus_run["plan"] or ""):
    pytest.xfail(f"issue 37: wus.jit runs the step unchanged ({wus_run['plan']})")
  assert wus_run["opt_bytes_per_device"] <= bound, (wus_run["opt_bytes_per_device"], bound,
                                                    wus_run["plan"])
