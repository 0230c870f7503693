"""Partial sharding across processes (§5.2; issue 13 item 7): groups = one process's devices.

Two processes of 4 CPU devices (jax.distributed, gloo on 127.0.0.1) train the
model of `partial_worker` on a ("host", "local") mesh of 2 x 4 whose rows are
the processes, with `wus.shard_map(step, axis_name="local")`: the gradient is
reduce-scattered within each process, the shards all-reduced across the two,
the update runs on 1/4 of each tensor, and the new weights are all-gathered
within each process. The same model runs in this process on 8 devices with the
same mesh and axis_name.

Both runs compile the same programs (compared below), but they are not equal bit
for bit, and neither are the unmodified steps: a run of 2 processes does its
collectives with gloo, which sums the 8 (or 2) contributions in another order
than XLA's in-process CPU collectives do. So the two runs are compared within a
few ulps of each tensor's largest magnitude (measured: at most 2.5), and each is
compared with the unmodified step within rtol 1e-6.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import partial_worker as W
from test_checkpoint import free_port
from wus.harness import report

WORKER = os.path.join(os.path.dirname(__file__), "partial_worker.py")
ULPS = 4  # of each tensor's largest magnitude; measured at most 2.5
GROUP = 4  # devices per process: the "local" axis


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
  """[(results, facts)] of each of 2 processes of 4 devices."""
  out = tmp_path_factory.mktemp("partial2")
  address = f"127.0.0.1:{free_port()}"
  procs = [subprocess.Popen(
      [sys.executable, WORKER, json.dumps(dict(out=str(out), num_processes=2, process_id=i,
                                               address=address))],
      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for i in range(2)]
  for proc in procs:
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
  runs = []
  for i in range(2):
    data = np.load(out / f"result_{i}.npz")
    runs.append(({k: data[k] for k in data.files},
                 json.loads((out / f"info_{i}.json").read_text())))
  return runs


@pytest.fixture(scope="module")
def one_process():
  """(results, facts) of this process, 8 devices, the same (2, 4) mesh."""
  return W.results(W.make_mesh())


def ulps(a, b) -> float:
  """|a - b| in units of the last place of b's largest magnitude."""
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.max(np.abs(a - b)) / np.spacing(np.max(np.abs(b))))


def variant(results, case, name) -> dict:
  prefix = f"{case}/{name}/"
  return {k[len(prefix):]: v for k, v in results.items() if k.startswith(prefix)}


def instructions(hlo: str) -> list[str]:
  """The computations of compiled HLO text without metadata (source lines and the
  tables of file names and stack frames differ between a script and pytest)."""
  return [re.sub(r", metadata=\{.*?\}", "", line) for line in hlo.splitlines()
          if re.match(r"\s*(ROOT |ENTRY )?%", line)]


def replica_groups(line: str) -> list[list[int]]:
  """The groups of one collective's HLO line, explicit or iota form."""
  m = re.search(r"replica_groups=\{(\{[\d,{}]*\})\}", line)
  if m:
    return [[int(i) for i in g.split(",")] for g in re.findall(r"\{([\d,]+)\}", m[1])]
  m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
  assert m, line
  ids = np.arange(int(m[1]) * int(m[2])).reshape([int(d) for d in m[3].split(",")])
  if m[4]:
    ids = ids.transpose([int(d) for d in m[4].split(",")])
  return ids.reshape(int(m[1]), int(m[2])).tolist()


def collectives(hlo: str) -> list[tuple[str, list[list[int]], str]]:
  """(kind, replica groups, result shape) of each collective of the compiled step."""
  found = []
  for line in hlo.splitlines():
    m = re.search(r"= (.+?) (all-reduce|reduce-scatter|all-gather)\(", line)
    if m:
      found.append((m[2], replica_groups(line), m[1]))
  assert found and "-start(" not in hlo  # the CPU runs them synchronously
  return found


def test_each_row_of_the_mesh_is_one_process(two_processes, one_process):
  for i, (_, facts) in enumerate(two_processes):
    assert facts["process_count"] == 2
    assert facts["process_of_row"] == [[0], [1]], i
    assert facts["process_of_position"] == [0] * GROUP + [1] * GROUP
  assert one_process[1]["process_count"] == 1


def test_the_processes_agree(two_processes):
  (a, _), (b, _) = two_processes
  assert a.keys() == b.keys()
  for k in a:
    np.testing.assert_array_equal(a[k], b[k], err_msg=k)


@pytest.mark.parametrize("case", list(W.CASES))
def test_two_processes_run_the_programs_of_one(two_processes, one_process, case):
  for _, facts in two_processes:
    ours = instructions(one_process[1]["cases"][case]["hlo"])
    assert len(ours) > 100 and instructions(facts["cases"][case]["hlo"]) == ours


@pytest.mark.parametrize("case", list(W.CASES))
def test_two_processes_equal_one_process(two_processes, one_process, case):
  """Params, unsharded optimizer state and loss after 3 steps, within a few ulps of
  each tensor's scale (gloo sums in another order); the unmodified step differs
  between the two runs as much."""
  for name in ("wus", "plain"):
    two, one = variant(two_processes[0][0], case, name), variant(one_process[0], case, name)
    assert two.keys() == one.keys() and len(one) > 10
    for k in one:
      assert two[k].shape == one[k].shape and two[k].dtype == one[k].dtype, k
      assert ulps(two[k], one[k]) <= ULPS, (name, k, ulps(two[k], one[k]))


@pytest.mark.parametrize("case", list(W.CASES))
@pytest.mark.parametrize("run", ["2 processes", "1 process"])
def test_matches_the_unmodified_step(two_processes, one_process, case, run):
  results = two_processes[0][0] if run == "2 processes" else one_process[0]
  plain, ws = variant(results, case, "plain"), variant(results, case, "wus")
  assert plain.keys() == ws.keys()
  for k in plain:
    np.testing.assert_allclose(ws[k], plain[k], rtol=1e-6, atol=1e-7, err_msg=k)


@pytest.mark.parametrize("case", list(W.CASES))
def test_each_device_holds_a_quarter_of_the_state(two_processes, case):
  """Adam's mu and nu of the three tensors of 13, 78 and 39 elements are sharded 4
  ways over "local"; each process holds 4 shards of ceil(size / 4) elements (padded),
  all on its own devices. dense2's bias (3 elements) stays whole."""
  for process, (_, facts) in enumerate(two_processes):
    sharded = facts["cases"][case]["sharded"]
    assert sorted(s["size"] for s in sharded) == sorted([W.IN * W.HIDDEN, W.HIDDEN,
                                                         W.HIDDEN * W.OUT] * 2)
    for s in sharded:
      assert s["num_shards"] == GROUP and s["axes"] == ["local"]
      assert s["shards"] == [[-(-s["size"] // GROUP), process]] * GROUP, s
    # Per device: 2 x (4 + 20 + 10) elements of the 2 x (13 + 78 + 39) whole.
    assert sum(s["shards"][0][0] for s in sharded) == 68


@pytest.mark.parametrize("case", list(W.CASES))
def test_one_process_shards_the_same(one_process, case):
  sharded = one_process[1]["cases"][case]["sharded"]
  assert len(sharded) == 6
  for s in sharded:
    assert s["num_shards"] == GROUP and s["shards"] == [[-(-s["size"] // GROUP), 0]] * 8, s


@pytest.mark.parametrize("case", list(W.CASES))
def test_collectives_within_a_process_and_across(two_processes, case):
  """The compiled step's reduce-scatter and all-gather have groups of 4 devices of one
  process; the shards are all-reduced across the processes by one batched all-reduce
  in groups of 2, one device of each process."""
  for _, facts in two_processes:
    process_of = facts["process_of_position"]  # the programs' logical device ids
    hlo = facts["cases"][case]["hlo"]
    found = collectives(hlo)
    within = [(kind, g) for kind, g, _ in found if kind in ("reduce-scatter", "all-gather")]
    assert sorted(kind for kind, _ in within) == ["all-gather", "reduce-scatter"]
    for kind, groups in within:
      assert sorted(map(len, groups)) == [GROUP, GROUP], kind
      assert all(len({process_of[d] for d in g}) == 1 for g in groups), (kind, groups)
    across = [(g, shape) for kind, g, shape in found if kind == "all-reduce" and len(g[0]) == 2]
    assert len(across) == 1
    groups, shape = across[0]
    assert len(groups) == GROUP and all(sorted(process_of[d] for d in g) == [0, 1] for g in groups)
    # The batched shards: (16 + 80 + 40) / 4 float32 per device.
    assert report.shape_bytes(shape) == 4 * 34
    # The other all-reduces: whole tensors left unsharded and the loss over all 8, and
    # clip_by_global_norm's partial norms within a process.
    for kind, groups, _ in found:
      if kind == "all-reduce" and len(groups[0]) != 2:
        assert len(groups[0]) in (8, GROUP)
        assert len(groups[0]) == 8 or all(len({process_of[d] for d in g}) == 1 for g in groups)
