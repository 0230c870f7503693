"""The pipeline's stages, each called alone on the value the stage before it made
(issue 31 item 2): trace -> match -> group -> flatten -> analyse -> plan -> build.

The step is momentum SGD on 8 replicas: the forward pass reads w (so w stays whole),
only the update reads m (so m is kept sharded, §4.2). Each stage's value is checked
against what that stage decides; the whole chain against `compile_step`.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from helpers import mesh
from wus import pipeline, stages
from wus.analysis import network, reasons
from wus.analysis.formats import ShardFormat
from wus.analysis.planning import PlanningContext
from wus.analysis.reasons import Reason
from wus.matching import Signature
from wus.options import Options


def _step(w, m, x):
  g = lax.pmean(jnp.cos(w) * x.mean(), "data")
  m = 0.9 * m + g
  return w - 0.1 * m, m


def _call(**options) -> pipeline.Call:
  args = (jnp.ones(64), jnp.zeros(64),
          jax.device_put(jnp.ones((16, 4)), NamedSharding(mesh(8), P("data"))))
  leaves, treedef = jax.tree.flatten(args)
  step = pipeline.Step(_step, (P(), P(), P("data")), (P(), P()), signature=Signature.of(_step))
  return pipeline.Call(step, Options(**options), args, tuple(leaves), treedef, frozenset(),
                       mesh(8), frozenset())


def test_trace_takes_the_shard_map_apart():
  traced = pipeline.trace(_call())
  assert traced.origin.sources == (("arg", 0), ("arg", 1), ("arg", 2))
  assert traced.in_specs == (P(), P(), P("data")) and traced.manual == {"data"}
  assert [x.shape for x in traced.operand_avals] == [(64,), (64,), (16, 4)]
  assert [x.shape for x in traced.origin.out_shape] == [(64,), (64,)]
  assert traced.origin.body_pos == {0: 0, 1: 1, 2: 2}


@pytest.mark.parametrize("size, request_size", [(None, None), (2, 2), ("auto", None)])
def test_match_pairs_state_and_reads_the_group_size_asked(size, request_size):
  matched = pipeline.match(pipeline.trace(_call(shard_group_size=size)))
  assert matched.pairs == {0: 0, 1: 1}
  assert matched.matched == {0: "next value [0] (by position)", 1: "next value [1] (by position)"}
  assert matched.out_names == ("[0]", "[1]")
  assert matched.request == stages.GroupRequest(request_size)


def test_group_without_groups_keeps_the_users_mesh_and_leaves_the_axes_to_find():
  grouped = pipeline.group(pipeline.match(pipeline.trace(_call())))
  on = grouped.placement
  assert on.home is None and grouped.axes is None and on.grouping is None
  assert on.mesh is mesh(8) and on.manual == {"data"} and on.group_size is None


def test_group_of_two_derives_the_mesh_and_says_the_groups():
  grouped = pipeline.group(pipeline.match(pipeline.trace(_call(shard_group_size=2))))
  on = grouped.placement
  assert dict(on.mesh.shape) == {"data.groups": 4, "data.in_group": 2}
  assert grouped.axes == ("data.in_group",) and on.grouping.num_groups == 4
  assert on.in_specs[2] == P(("data.groups", "data.in_group")) and on.group_size == 2
  assert on.manual == {"data.groups", "data.in_group"}


def test_group_of_one_runs_on_the_users_mesh_with_the_reason_in_the_grouping():
  grouped = pipeline.group(pipeline.match(pipeline.trace(_call(shard_group_size=1))))
  assert grouped.placement.home is None and grouped.axes == ("data",)
  assert grouped.placement.grouping.layout.startswith("shard_group_size=1: groups of one replica")


def test_flatten_inlines_and_finds_the_replica_axes():
  flat = pipeline.flatten(pipeline.group(pipeline.match(pipeline.trace(_call()))))
  assert flat.axes == ("data",) and flat.pairs == {0: 0, 1: 1} and flat.split_state == {}
  assert all(e.primitive.name not in ("pjit", "jit", "closed_call") for e in flat.jaxpr.eqns)


def test_analyse_names_the_arguments_and_finds_the_gradient_redundant():
  analysed = pipeline.analyse(pipeline.flatten(pipeline.group(pipeline.match(
      pipeline.trace(_call())))))
  assert analysed.names == ("w", "m", "x") and analysed.in_names == ["w", "m", "x"]
  assert analysed.num_shards == 8 and analysed.topology.num_devices == 8
  w, m, x = analysed.flat.jaxpr.invars
  assert analysed.facts.is_redundant(w, {"data"}) and not analysed.facts.is_redundant(x, {"data"})


@pytest.mark.parametrize("size", [None, 2])
def test_plan_request_is_what_the_stages_before_it_found(size):
  """`plan_request`: one value with everything the planner is asked; the context its stages
  read is derived from it (a topology of N devices when the request names none)."""
  analysed = pipeline.analyse(pipeline.flatten(pipeline.group(pipeline.match(
      pipeline.trace(_call(shard_group_size=size))))))
  request = pipeline.plan_request(analysed)
  assert request.jaxpr is analysed.flat.jaxpr and request.facts is analysed.facts
  assert tuple(request.axes) == (("data",) if size is None else ("data.in_group",))
  assert request.num_shards == (8 if size is None else size)
  assert request.in_names == ["w", "m", "x"] and request.out_names == ["[0]", "[1]"]
  assert request.state_pairs == {0: 0, 1: 1} and request.group_size == size
  assert request.matched == {0: "next value [0] (by position)", 1: "next value [1] (by position)"}
  assert request.arguments is None and request.topology is analysed.topology
  ctx = PlanningContext.of(dataclasses.replace(request, topology=None, roots=(2,)), bool)
  assert ctx.axes == frozenset(request.axes) and ctx.num_shards == request.num_shards
  assert ctx.topology == network.default_topology(request.num_shards)
  assert ctx.roots == {request.jaxpr.invars[2]}


@pytest.mark.parametrize("size", [None, 2])
def test_plan_and_build_keep_m_sharded(size):
  planned = pipeline.plan(pipeline.analyse(pipeline.flatten(pipeline.group(pipeline.match(
      pipeline.trace(_call(shard_group_size=size)))))))
  n = 8 if size is None else size
  assert planned.plan.state_inputs == {1: ShardFormat((64,), (64,), n)}
  assert planned.plan.group_size == size
  compiled = pipeline.build(planned, {"trace": 1.0, "analysis": 2.0})
  assert compiled.plan is planned.plan
  assert set(compiled.sharded_leaves) == {1} and set(compiled.sharded_outputs) == {1}
  assert compiled.out_replicated == (True, True) and compiled.user_mesh is mesh(8)
  assert compiled.in_names == ("w", "m", "x")


@pytest.mark.parametrize("size", [None, 2, "auto"])
def test_compile_step_is_the_chain(size):
  call = _call(shard_group_size=size)
  compiled = pipeline.compile_step(call)
  if size != "auto":
    chained = pipeline.plan(pipeline.analyse(pipeline.flatten(pipeline.group(pipeline.match(
        pipeline.trace(call))))))
    assert str(compiled.plan) == str(chained.plan)
  else:  # One process: one group of all 8, the choice said in the Plan.
    assert compiled.plan.group_size is None
    assert compiled.plan.groups.chosen.group_size == 8, compiled.plan.groups
    assert str(compiled.plan.groups).startswith("shard_group_size='auto'")
  assert set(compiled.timings) >= {"trace", "analysis"}


def test_timings_are_the_stages_and_the_rewrite_once_lowered():
  """The stages' seconds are fixed when `Compiled` is made; the rewrite's appear when the
  program is lowered, recorded by the program, and nothing else changes."""
  call = _call()
  compiled = pipeline.compile_step(call)
  before = compiled.timings
  assert set(before) == {"trace", "analysis"} and min(before.values()) >= 0
  with pytest.raises(TypeError):
    compiled.seconds["trace"] = 0.0  # A read-only view.
  layout = compiled.sharded_leaves[1]
  ops = [call.leaves[0], jax.ShapeDtypeStruct(layout.padded_shape, jnp.float32,
                                              sharding=layout.data_sharding), call.leaves[2]]
  compiled.step.lower(*ops)
  after = compiled.timings
  assert set(after) == {"trace", "analysis", "rewrite"} and after["rewrite"] > 0
  assert {k: after[k] for k in before} == before


def test_adam_over_a_flax_dense_plan_then_build():
  """The usual subject, through the stages: optax.adam over a Flax Dense's kernel and bias.
  The plan keeps each mu and nu sharded for the one cluster that updates its leaf
  (`reasons.OnlyCluster`) and the params whole (the forward pass reads them); build passes
  exactly those leaves sharded and returns their next values sharded."""
  model, tx = nn.Dense(16), optax.adam(1e-2)
  params = model.init(jax.random.key(0), jnp.zeros((1, 32)))["params"]

  def step(params, opt_state, x):
    loss = lambda p: jnp.mean(model.apply({"params": p}, x) ** 2)  # noqa: E731
    grads = lax.pmean(jax.grad(loss)(params), "data")
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  args = (params, tx.init(params),
          jax.device_put(jnp.ones((16, 32)), NamedSharding(mesh(8), P("data"))))
  leaves, treedef = jax.tree.flatten(args)
  call = pipeline.Call(
      pipeline.Step(step, (P(), P(), P("data")), (P(), P()), signature=Signature.of(step)),
      Options(), args, tuple(leaves), treedef, frozenset(), mesh(8), frozenset())
  planned = pipeline.plan(pipeline.analyse(pipeline.flatten(pipeline.group(pipeline.match(
      pipeline.trace(call))))))
  plan = planned.plan
  moments = {k for k, i in enumerate(plan.inputs) if ".mu[" in i.name or ".nu[" in i.name}
  assert len(moments) == 4 and set(plan.state_inputs) == moments
  for k in moments:
    i = plan.inputs[k]
    leaf = i.name.split("]", 1)[1].split("[", 1)[1]  # "'bias']" or "'kernel']"
    (c,) = [c for c in plan.clusters if f"params[{leaf}" in {t.name for t in c.tensors}]
    assert c.sharded and i.why == Reason(reasons.OnlyCluster(c.index)), i
  assert not any(i.sharded for i in plan.inputs if i.name.startswith("params"))
  compiled = pipeline.build(planned, {"trace": 0.0, "analysis": 0.0})
  assert set(compiled.sharded_leaves) == moments
  assert {compiled.sharded_leaves[k].format for k in moments} == {
      plan.state_inputs[k] for k in moments}


def test_each_stage_holds_what_the_next_reads_not_the_chain():
  """Issue 38 item 2: a stage holds the one before it whole only where its reader reads all
  of it (`group` reads stage 1, `plan_request` stage 4); what later stages read travels as
  `Origin` and `Placement`, so that no reader reaches more than one stage back."""
  chain = ("Traced", "Matched", "Grouped", "Flat", "Analysed", "Planned")
  held = {name: {f.type for f in dataclasses.fields(getattr(stages, name)) if f.type in chain}
          for name in chain}
  assert held == {"Traced": set(), "Matched": {"Traced"}, "Grouped": set(), "Flat": set(),
                  "Analysed": {"Flat"}, "Planned": set()}
  planned = pipeline.plan(pipeline.analyse(pipeline.flatten(pipeline.group(pipeline.match(
      pipeline.trace(_call(shard_group_size=2)))))))
  assert planned.placement.group_size == 2 and planned.origin.call.mesh is mesh(8)
  assert planned.axes == ("data.in_group",) and planned.names == ("w", "m", "x")
