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
collectives with gloo, whose ring sums the contributions in another order than
XLA's in-process CPU collectives (which add them in device order). So the runs are
compared within a bound derived from those orders (`first_order_bounds`), and each
is compared with the unmodified step within rtol 1e-6.

The bound. Every device runs the same compiled program on the same inputs, so the
runs can differ only through what a collective sums in another order, and what
follows from it:
  * the gradient: under check_vma=True AD sums the 8 replicas' gradients g_d (the
    `pmean` after it is a no-op on the sum); any order of an 8-term float32 sum is
    within 7 u sum_d |g_d| of the exact sum (u = 2^-24; Higham, Accuracy and
    Stability of Numerical Algorithms, §4.2), so two orders differ by at most
    2 x 7 u sum_d |g_d| per element. wus's reduce-scatter over 4 devices and the
    all-reduce of 2 shards is such an order too. One more u |g_d| per device: from
    the second step on, the devices' local gradients are recomputed from weights
    that already differ, and a correctly rounded result moves by at most one ulp
    besides what the change of its inputs explains;
  * the loss: an 8-term mean, 2 x 7 u mean_d |loss_d|;
  * clip_by_global_norm's squared norm: wus sums each device's shard and all-reduces
    the 4 partial sums (positive terms), 2 x 3 u |g|^2;
  * each elementwise formula after them (the clip, Adam's moments, the update) is
    evaluated on inputs that differ, and its k roundings may then round the other
    way: 2 k u times the magnitude of its terms.
Each is injected as an error into the same 3 steps computed in float64, and the
bound on each output element is sum_j |d output / d error_j| x bound_j (first order:
each error alone at its bound, all of them at once with `jax.vmap`, the change of every
output kept to about 9 digits in float64). The runs are compared in the
units the errors are relative to: the largest |difference| of each tensor against
its largest bound. Measured: the runs are within 0.05 of that bound (6 ulps of the
tensor's largest magnitude in Adam's nu under clip_by_global_norm, about 130 allowed).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import pytest

import partial_worker as W
from helpers import free_port
from wus.harness.tools import report

WORKER = W.__file__
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


U = 2.0 ** -24  # float32's unit roundoff
REPLICAS = 8
# optax.adam(1e-2)'s defaults and clip_by_global_norm(1.0) in partial_worker.CASES.
B1, B2, EPS, LR, MAX_NORM = 0.9, 0.999, 1e-8, 1e-2, 1.0


def _steps64(clip: bool, init: dict, errors: list) -> tuple:
  """The unmodified step's 3 updates in float64, with an additive error injected after
  each reordered sum and each elementwise formula (`errors[t]`, keys as `_error_bounds`).

  Returns:
    ((params, mu, nu, loss) after the last step, per step the magnitudes the bounds
    are relative to).
  """
  params = init
  mu = nu = jax.tree.map(jnp.zeros_like, init)
  sizes = []
  for t, e in enumerate(errors):
    rows = jnp.asarray(W.global_batch(t), jnp.float64).reshape(REPLICAS, -1, W.IN + W.OUT)
    losses, grads = jax.vmap(jax.value_and_grad(W.loss_fn), (None, 0))(params, rows)
    size = dict(g=jax.tree.map(lambda x: jnp.sum(jnp.abs(x), 0), grads),
                loss=jnp.mean(jnp.abs(losses)))
    g = jax.tree.map(lambda x, d: jnp.sum(x, 0) + d, grads, e["g"])
    loss = jnp.mean(losses) + e["loss"]
    if clip:
      squares = sum(jnp.sum(x ** 2) for x in jax.tree.leaves(g))
      norm = jnp.sqrt(squares + e["norm"])
      g = jax.tree.map(lambda x, d: jnp.where(norm < MAX_NORM, x, x / norm * MAX_NORM) + d,
                       g, e["clip"])
      size.update(norm=squares, clip=jax.tree.map(jnp.abs, g))
    size["mu"] = jax.tree.map(lambda x, m: (1 - B1) * jnp.abs(x) + B1 * jnp.abs(m), g, mu)
    mu = jax.tree.map(lambda x, m, d: (1 - B1) * x + B1 * m + d, g, mu, e["mu"])
    nu = jax.tree.map(lambda x, v, d: (1 - B2) * x ** 2 + B2 * v + d, g, nu, e["nu"])
    c = t + 1
    update = jax.tree.map(
        lambda m, v: -LR * (m / (1 - B1 ** c)) / (jnp.sqrt(v / (1 - B2 ** c)) + EPS), mu, nu)
    params = jax.tree.map(lambda p, x, d: p + x + d, params, update, e["params"])
    size.update(nu=nu, update=jax.tree.map(jnp.abs, update),
                params=jax.tree.map(jnp.abs, params))
    sizes.append(size)
  return (params, mu, nu, loss), sizes


def _error_bounds(size: dict) -> dict:
  """How far apart two runs' values can be after each injected error (module docstring):
  2 x (roundings of the sum or formula) x u x the magnitude of its terms."""
  bound = dict(g=jax.tree.map(lambda s: 2 * (7 + 1) * U * s, size["g"]),
               loss=2 * 7 * U * size["loss"],
               mu=jax.tree.map(lambda s: 2 * 3 * U * s, size["mu"]),           # 2 mul, add
               nu=jax.tree.map(lambda s: 2 * 4 * U * s, size["nu"]),           # square, 2 mul, add
               # The update: 2 bias corrections, sqrt, add, divide, scale (6), then the add.
               params=jax.tree.map(lambda x, p: 2 * U * (6 * x + p), size["update"],
                                   size["params"]))
  if "norm" in size:
    bound.update(norm=2 * 3 * U * size["norm"],
                 clip=jax.tree.map(lambda s: 2 * 3 * U * s, size["clip"]))  # sqrt, div, mul
  return bound


def first_order_bounds(case: str) -> dict[str, np.ndarray]:
  """{result key: elementwise bound on |two processes - one process|} (module docstring)."""
  clip = case == "clip_adam"
  init = jax.tree.map(np.asarray, W.init_params())  # float32, as the runs start
  with jax.enable_x64(True):
    init = jax.tree.map(lambda x: jnp.asarray(x, jnp.float64), init)
    zero = jax.tree.map(jnp.zeros_like, init)
    errors = [dict(g=zero, loss=jnp.zeros(()), mu=zero, nu=zero, params=zero,
                   **(dict(norm=jnp.zeros(()), clip=zero) if clip else {}))
              for _ in range(W.STEPS)]
    outputs, sizes = _steps64(clip, init, errors)
    flat_errors, unravel = jax.flatten_util.ravel_pytree(errors)
    bounds = jax.flatten_util.ravel_pytree([_error_bounds(s) for s in sizes])[0]
    # Each error alone at its bound: the change of every output is |J_ij| b_j to first order
    # (the second order is ~u^2). In float64, each difference keeps ~9 significant digits.
    steps = jax.jit(jax.vmap(lambda e: jax.flatten_util.ravel_pytree(
        _steps64(clip, init, unravel(e))[0])[0]))
    base, tree = jax.flatten_util.ravel_pytree(outputs)
    changed = steps(jnp.diag(bounds))  # row j: every output with error j at its bound
    params, mu, nu, loss = tree(jnp.sum(jnp.abs(changed - base), axis=0))
    params, mu, nu, loss = jax.tree.map(np.asarray, (params, mu, nu, loss))
  adam = "[1][1][0]" if clip else "[1][0]"  # clip_by_global_norm's state comes first
  keys = {"loss": loss}
  for prefix, tree in (("[0]", params), (f"{adam}.mu", mu), (f"{adam}.nu", nu)):
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
      keys[prefix + jax.tree_util.keystr(path)] = x
  return keys


@pytest.mark.parametrize("case", list(W.CASES))
def test_two_processes_equal_one_process(two_processes, one_process, case):
  """Params, unsharded optimizer state and loss after 3 steps, within the bound the
  summation orders allow (module docstring): for the unmodified step and wus alike."""
  bounds = first_order_bounds(case)
  for name in ("wus", "plain"):
    two, one = variant(two_processes[0][0], case, name), variant(one_process[0], case, name)
    assert two.keys() == one.keys() and len(one) > 10
    for k in one:
      assert two[k].shape == one[k].shape and two[k].dtype == one[k].dtype, k
      if k.endswith(".count"):
        assert np.array_equal(two[k], one[k]), k
        continue
      diff = np.max(np.abs(two[k].astype(np.float64) - one[k]))
      assert diff <= np.max(bounds[k]), (name, k, ulps(two[k], one[k]),
                                         np.max(bounds[k]) / np.spacing(np.max(np.abs(one[k]))))


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
