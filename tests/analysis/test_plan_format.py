"""A Plan people can scan (issue 23 item 7): paths under the step's argument names, each
gradient all-reduce at the user's own line (not inside Flax), one line per cluster with
the totals first (the table behind `plan.details()`), times in units, none below what the
cost model resolves."""

import dataclasses
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import test_planner_groups as planner_groups
import wus
from helpers import analysed_body, mesh
from tensor_parallel import GELU_SPEC, gelu_inputs, gelu_step, two_axis_mesh
from tensor_parallel import LN_MLP_SPEC, ln_mlp_inputs, ln_mlp_step
from tensor_parallel import run as tp_run
from wus.analysis import causes, network, planner, reasons, refusals, verdicts
from wus.analysis.plan import Grouping

TX = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(64)(x))  # The gradient all-reduces of Dense_0 are located here,
    return nn.Dense(10)(x)        # and those of Dense_1 here: AD makes them inside Flax.


MODEL = MLP()
LINES = {name: next(i for i, line in enumerate(open(__file__), 1) if f"nn.Dense({width})" in line)
         for name, width in (("Dense_0", 64), ("Dense_1", 10))}


def train_step(params, opt_state, batch):
  """As the shard_map examples write it under check_vma=True: the pmean of the loss."""
  def loss_fn(p):
    return jax.lax.pmean(jnp.mean((MODEL.apply({"params": p}, batch) - 1.0) ** 2), "data")
  loss, grads = jax.value_and_grad(loss_fn)(params)
  updates, opt_state = TX.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss


def plan_of(**kw):
  m = mesh()
  params = MODEL.init(jax.random.key(0), jnp.zeros((1, 32)))["params"]
  batch = jax.device_put(np.random.default_rng(0).normal(size=(16, 32)).astype(np.float32),
                         NamedSharding(m, P("data")))
  step = wus.shard_map(train_step, mesh=m, in_specs=(P(), P(), P("data")),
                       out_specs=(P(), P(), P()), **kw)
  return step.plan(params, TX.init(params), batch)


@pytest.fixture(scope="module")
def plan():
  return plan_of()


def test_paths_are_under_the_arguments_names(plan):
  names = {i.name for i in plan.inputs}
  assert {"params['Dense_0']['kernel']", "opt_state[1][0].mu['Dense_0']['kernel']",
          "opt_state[1][0].nu['Dense_1']['bias']", "opt_state[1][0].count", "batch"} <= names
  sharded = {i.name for i in plan.inputs if i.sharded}
  assert "opt_state[1][0].mu['Dense_0']['kernel']" in sharded


def test_each_gradient_all_reduce_is_at_the_users_line(plan):
  grads = [t for c in plan.clusters for t in c.tensors if t.role == "gradient"]
  assert grads
  for t in grads:
    layer = "Dense_0" if any("Dense_0" in u.name for c in plan.clusters if t in c.tensors
                             for u in c.tensors) else "Dense_1"
    assert re.fullmatch(rf"all-reduce at {re.escape(__file__)}:{LINES[layer]}:\d+ "
                        r"\(MLP.__call__\)", t.name), t.name


def test_compact_by_default_with_the_details_behind_a_call(plan):
  text = str(plan).splitlines()
  assert text[0].startswith(f"wus plan: {len(plan.clusters)} of {len(plan.clusters)} "
                            "weight-update clusters sharded over ('data',) (N=8)")
  assert "state kept sharded between steps" in text[1]
  cluster_lines = [line for line in text if line.startswith("cluster ")]
  assert len(cluster_lines) == len(plan.clusters)
  assert len(text) <= len(plan.clusters) + 6
  assert text[-1].startswith("inputs: ") and "plan.details()" in text[-1]
  details = plan.details()
  for c in plan.clusters:
    for t in c.tensors:
      assert t.name in details
  for i in plan.inputs:
    assert f"{i.name} " in details


def _times(text: str) -> list[float]:
  """Every time printed, in seconds; fails on a time without a unit."""
  scale = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}
  found = re.findall(r"([\d.e+-]+) (ns|us|ms|s)\b", text)
  assert not re.search(r"\b0\.0\d* (us|ms|s)\b", text), text
  return [float(v) * scale[u] for v, u in found]


def test_no_prediction_below_the_models_resolution(plan):
  # Planned with the defaults for the CPU devices the suite runs on.
  assert plan.resolution == network.resolution(network.default_topology(8, platform="cpu")) > 0
  lines = [line for line in str(plan).splitlines() if line.startswith("cluster ")]
  below = f"< {network.format_seconds(plan.resolution)}"
  for line in lines:
    for seconds in _times(line.replace(below, "")):
      assert seconds >= plan.resolution, line
  # A cluster whose sharded update the model puts below one ring step says so.
  assert any(f"predicted {below} sharded" in line for line in lines), lines
  # A topology without latency resolves every cluster: each line gives its prediction.
  fine = plan_of(topology=network.Topology((network.Axis("x", 8, 0.0, 1e10),), 1e10))
  lines = [line for line in str(fine).splitlines() if line.startswith("cluster ")]
  assert all("predicted" in line for line in lines)
  for line in lines:
    assert all(t > 0 for t in _times(line)), line
  # In the details, each resolved cluster's prediction has a line of its own.
  resolved = [c for c in fine.clusters
              if max(c.sharded_seconds, c.replicated_seconds) >= fine.resolution]
  assert resolved and fine.details().count(
      f"(collectives and update, {fine.objective} objective)") == len(resolved)
  assert network.format_seconds(1.43e-9) == "1.43 ns"
  assert network.format_seconds(7.13e-5) == "71.3 us"
  assert network.format_seconds(0.0117) == "11.7 ms"


def test_source_lines_skip_flax_optax_and_jax():
  """What a Plan names an equation by: the innermost frame of the user's code. A Dense
  layer's matmul is traced inside flax/linen/linear.py (which JAX counts as user code); the
  Plan names the model's line that calls the layer instead."""
  from wus.analysis import compat  # noqa: PLC0415
  params = MODEL.init(jax.random.key(0), jnp.zeros((1, 32)))["params"]
  jaxpr = jax.make_jaxpr(lambda p, x: MODEL.apply({"params": p}, x))(params, jnp.zeros((2, 32)))
  dots = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]
  assert len(dots) == 2
  for eqn, layer in zip(dots, ("Dense_0", "Dense_1"), strict=True):
    assert compat.source_line(eqn).startswith(f"{__file__}:{LINES[layer]}:"), \
        compat.source_line(eqn)


# --- The Plan's words, one test per kind of line (issue 31 item 7). The other tests check
# decisions on their values (`reasons`, `verdicts`, the Plan's fields); these check that the
# text says them.


def test_each_cluster_and_input_line_says_its_reason_as_render_words_it(plan):
  lines = [line for line in str(plan).splitlines() if line.startswith("cluster ")]
  for c, line in zip(plan.clusters, lines, strict=True):
    assert line.startswith(f"cluster {c.index:<3d} ") and c.reason == reasons.render(c.why)
    assert f"  {reasons.render(c.why, cite=False)}" in line, line
    assert (" SHARDED " if c.sharded else " replicated ") in line
  details = plan.details().split("\ninputs:\n")[1].splitlines()
  for i in plan.inputs:
    (line,) = [ln for ln in details if ln.split()[0] == i.name]
    assert f" {'sharded' if i.sharded else 'whole'}: {reasons.render(i.why)}" in line, line


def test_each_cluster_line_names_the_weight_and_the_state_it_updates(plan):
  """Issue 39: no "+4" after a tensor. The line names the weight, then the optimizer state
  by its paths without the end they share with the weight's ("and its opt_state[1][0].mu,
  .nu" for opt_state[1][0].mu['Dense_0']['kernel'] ...), and says nothing it does not name."""
  lines = [line for line in str(plan).splitlines() if line.startswith("cluster ")]
  for c, line in zip(plan.clusters, lines, strict=True):
    (weight,) = [t for t in c.tensors if t.role == "weight"]
    end = weight.name[len("params"):]  # ['Dense_0']['kernel']
    state = sorted(t.name for t in c.tensors if t.role == "state")
    assert state == [f"opt_state[1][0].mu{end}", f"opt_state[1][0].nu{end}"], state
    label = (f"{weight.name} float32[{','.join(map(str, weight.shape))}] and its "
             "opt_state[1][0].mu, .nu")
    assert f" {label}  " in line or line.split("  ")[0].endswith(label), line
    assert not re.search(r" \+\d", line), line
  big = plan.clusters[0].tensors[0]
  many = dataclasses.replace(plan.clusters[0], tensors=tuple(
      dataclasses.replace(big, name=f"w{k}", role="weight") for k in range(6)))
  (line,) = [ln for ln in str(dataclasses.replace(plan, clusters=(many,))).splitlines()
             if ln.startswith("cluster ")]
  assert " w0 float32[" in line and " with w1, w2, w3 and 2 more  " in line, line


def test_the_paper_and_the_cost_models_arithmetic_are_in_the_details_only():
  """Issue 39: "(§3.1)" and the bucket arithmetic are for readers of the paper: `str(plan)`
  says what runs (the collectives per step), `plan.details()` why, with the sections."""
  params, batches = ln_mlp_inputs(4, steps=1)  # The LayerNorm's weights, over data x model.
  _, b, ws, batch = tp_run(two_axis_mesh(4, 2), ln_mlp_step, LN_MLP_SPEC, params, batches)
  plan = ws.plan(*b, batch)
  cited = [c for c in plan.clusters if "(§3.1)" in c.reason]
  assert cited, [c.reason for c in plan.clusters]
  text, details = str(plan), plan.details()
  assert "§" not in text and "Fig. " not in text and "buckets of at most" not in text, text
  assert all(f"{c.reason}" in details for c in cited)
  assert plan.buckets in details and f"  {plan.collectives}" in text.splitlines()
  assert re.fullmatch(r"collectives per step: \d+ reduce-scatter\(s\) of the gradients, \d+ "
                      r"all-gather\(s\) of the new weights, batched \(predicted\)",
                      plan.collectives), plan.collectives
  assert reasons.render(reasons.Reason(reasons.PartialSharding(("data",), ("replica",))),
                        cite=False) == ("partial sharding: reduce-scatter over ['data'], the "
                                        "shards all-reduced across ['replica']")


def test_a_reason_is_worded_place_verdict_then_notes():
  """`reasons.render`: the loop it sits in, the verdict, the notes in order, "; "-separated."""
  why = reasons.Reason(verdicts.OnShards(reductions=1, gathers=2),
                       (reasons.LoopGathers((reasons.Gather("w", "bfloat16", 128, 256, True),)),
                        reasons.PartialSharding(("data",), ("replica",))),
                       where="loop at f.py:3: ")
  assert reasons.render(why) == (
      "loop at f.py:3: update on 1/N shards, 1 reduction(s); 2 all-gather(s); w kept sharded "
      "across iterations and all-gathered in bfloat16 right before the forward pass reads it: "
      "128 B per iteration instead of 256 B (Fig. 4 right, Fig. 7); partial sharding (§5.2): "
      "reduce-scatter over ['data'], the shards all-reduced across ['replica']")
  assert str(reasons.Reason(reasons.OnlyCluster(3))) == "optimizer state: only cluster 3 reads it"
  # The cost model's verdicts (test_cost, test_objective check them as values).
  assert str(reasons.Reason(verdicts.MoreAllGather(8000, 4000))) == (
      "needs 8000 B of all-gather, more than the 4000 B all-reduce it replaces")
  assert str(reasons.Reason(verdicts.KeepsStateSharded(3500))) == (
      "update on 1/N shards; optimizer state kept sharded at the cost of 3500 B more all-gather "
      "than the reduce-scatter saves")
  assert str(reasons.Reason(verdicts.SlowerSharded(2e-6, 1e-6))) == (
      "predicted slower sharded (2 us of collectives and update against 1 us replicated; "
      "objective='time'; objective='memory' shards it)")
  kept = causes.SplitDifferently("P('data',)", "P()", "[1]['m']")
  assert reasons.render(reasons.Reason(kept, (reasons.NotRead(),))) == (
      "its in_spec P('data',) and the out_spec P() of its next value [1]['m'] split it "
      "differently: kept whole between steps; no weight-update cluster reads it (read whole "
      "only, e.g. by the forward pass)")


def test_every_verdict_and_note_has_words():
  """A verdict, note or cause added without its words would raise at print time."""
  kinds = [x for m in (reasons, verdicts, causes) for x in vars(m).values()
           if dataclasses.is_dataclass(x) and x.__module__ == m.__name__
           and x not in (reasons.Reason, reasons.Gather, causes.SplitBy)]
  assert len(kinds) > 50
  for kind in [*kinds, causes.SPEC_SPLITS]:  # Empty parts render as nothing (no KeyError).
    x = kind if not isinstance(kind, type) else kind(**{
        f.name: _example(f.type) for f in dataclasses.fields(kind)})
    assert isinstance(reasons.render(reasons.Reason(x)), str), kind


def _example(annotation: str):
  """A value of a field annotated `annotation`, for `test_every_verdict_and_note_has_words`:
  a cause where the field holds one (an equation, a split, why a value differs)."""
  eqn = causes.Eqn("mul", "f.py:1")
  for key, value in (("Eqn", eqn), ("SplitBy", causes.SPEC_SPLITS),
                     ("ReadWhole", causes.ReadWhole("float32[2]", eqn, causes.VariesAcross()))):
    if key in annotation:
      return value
  if annotation in ("int", "float"):
    return 0
  return () if annotation.startswith("tuple") else causes.VariesAcross() if annotation.startswith(
      "object") else "x"


def test_totals_and_bucket_lines(plan):
  text = str(plan).splitlines()
  whole, shard = plan.state_bytes
  assert text[1].startswith(f"  state kept sharded between steps: {network.format_bytes(whole)} "
                            f"whole -> {network.format_bytes(shard)} per device")
  assert f"state kept whole: {network.format_bytes(plan.whole_state_bytes)}" in text[1]
  assert plan.buckets.startswith("collectives batched in buckets of at most")
  assert f"  {plan.collectives}" in text and f"  {plan.buckets}" not in text
  assert f"  {plan.buckets}" in plan.details().splitlines()
  assert f"state kept whole {plan.whole_state_bytes} B" in plan.details().splitlines()[-1]


def test_what_the_planner_is_told_is_said():
  """Planner inputs (test_planner_groups): the groups, what splits an input over a model
  axis, why a step runs unchanged."""
  grouped = planner_groups._plan(group_size=2, grouping=Grouping(None, "groups of 2", 4))
  assert "  groups of 2; the gradient shards are all-reduced across the 4 groups in 2 batched " \
         "all-reduce(s)" in str(grouped).splitlines()
  for split_by in ("its spec", "its placement"):
    split = planner_groups._plan(split={0: (("model", 2),)}, split_by=split_by)
    (w,) = [ln for ln in split.details().splitlines() if ln.startswith("    w ")]
    assert w.endswith(f"[split over ['model'] by {split_by}]"), w
  jaxpr = analysed_body(
      planner_groups._step, [P(), P(), P(), P("data")], [(64,)] * 3 + [(1, 4)],
      (P(), P(), P()), mesh=mesh())[0]
  why = reasons.Reason(refusals.NoMesh())
  unchanged = planner.unchanged_plan(jaxpr, ["w", "m", "b", "x"], ("data",), 8, why)
  assert ("  the step runs unchanged: no argument is placed on a mesh of more than one "
          "device, so there is no data parallelism to shard the update over"
          in str(unchanged).splitlines())


class Deep(nn.Module):
  """Eight [32,32] hidden kernels: Muon's update needs each whole, so each is owned."""

  @nn.compact
  def __call__(self, x):
    for _ in range(9):
      x = nn.tanh(nn.Dense(32)(x))
    return nn.Dense(4)(x)


def test_ownership_lines():
  model, tx, m = Deep(), optax.contrib.muon(1e-2), mesh()

  def step(params, opt_state, x):
    grads = jax.lax.pmean(jax.grad(lambda p: jnp.mean(model.apply({"params": p}, x) ** 2))(
        params), "data")
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  params = model.init(jax.random.key(0), jnp.zeros((1, 32)))["params"]
  x = jax.device_put(jnp.ones((16, 32)), NamedSharding(m, P("data")))
  plan = wus.shard_map(step, mesh=m, in_specs=(P(), P(), P("data")),
                       out_specs=(P(), P())).plan(params, tx.init(params), x)
  owned = [c for c in plan.clusters if c.owner is not None]
  assert len(owned) >= 8, plan
  text = str(plan).splitlines()
  assert f", {len(owned)} owned over " in text[0]
  assert f"  {plan.owned}" in text and "imbalance" in str(plan.owned)
  assert "padding of the gradient and weight rows" in str(plan.owned)
  for c in owned:
    (line,) = [ln for ln in text if ln.startswith(f"cluster {c.index:<3d} OWNED ")]
    assert f"OWNED by replica {c.owner}, " in line, line
  assert "optimizer state owned by replica" in plan.details()


def test_a_model_split_inputs_line_says_its_split_its_shards_and_its_bytes():
  """Tensor parallelism (test_tensor_parallel checks the values): each input line names the
  axes its spec splits it over, those wus shards it over and the bytes per device; the
  totals give the state per device as a fraction of a whole copy and of what the specs
  alone leave."""
  params, batches = gelu_inputs(4, steps=1)  # w1 [16,32], w2 [32,16]; blocks [16,16].
  _, b, ws, batch = tp_run(two_axis_mesh(4, 2), gelu_step, GELU_SPEC, params, batches)
  plan = ws.plan(*b, batch)
  lines = {ln.split()[0]: ln for ln in plan.details().split("\ninputs:\n")[1].splitlines()
           if ln.startswith("    ")}
  for name in ("opt_state[0].mu['w1']", "opt_state[0].nu['w2']"):
    assert lines[name].endswith("[split over ['model'] by its spec, sharded over ['data'] by "
                                "wus: 256 B per device of 2 KiB]"), lines[name]
  assert lines["params['w1']"].endswith("[split over ['model'] by its spec]")
  assert lines["opt_state[0].count"].endswith("(by position)")  # Replicated: no layout.
  assert "(predicted; 0.125 of a whole copy, 0.25 of what the specs alone leave" in str(plan)
