"""The planner takes the sharding groups as inputs (issue 31 item 3): `make_plan` with a
request's `group_size` and `grouping` returns the Plan complete, groups and all (§5.2, Fig. 10).

Analysis only: each Plan is checked against what `shard_group_size` means.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from helpers import analysed_body, mesh
from wus.analysis import causes, planner, reasons, refusals
from wus.analysis.plan import Grouping
from wus.analysis.planning import PlanRequest

N = 8


def _step(w, m, b, x):
  """Momentum SGD on a float32 w and a bfloat16 b: two dtype buckets of gradients."""
  gw = lax.pmean(jnp.cos(w) * x.mean(), "data")
  gb = lax.pmean(jnp.sin(b) * x.mean().astype(jnp.bfloat16), "data")
  m = 0.9 * m + gw
  return w - 0.1 * m, m, b - jnp.bfloat16(0.1) * gb


def _plan(**groups):
  shapes = [jax.ShapeDtypeStruct((64,), d) for d in (jnp.float32, jnp.float32, jnp.bfloat16)]
  jaxpr, facts = analysed_body(_step, [P(), P(), P(), P("data")], [*shapes, (1, 4)],
                               (P(), P(), P()), mesh=mesh(N))
  return planner.make_plan(PlanRequest(jaxpr, facts, axes=("data",), num_shards=N,
                                       in_names=["w", "m", "b", "x"], out_names=["w", "m", "b"],
                                       state_pairs={0: 0, 1: 1, 2: 2}, **groups))


def test_without_groups_the_plan_has_none():
  plan = _plan()
  assert plan.group_size is None and plan.groups is None and plan.across_groups == 0
  assert all(c.sharded for c in plan.clusters)


def test_groups_the_programs_run_in_count_the_all_reduces_across_them():
  """G = 2 of 8: four groups; the gradient shards are all-reduced across them once per
  dtype bucket (float32, bfloat16), as the batched collectives group them."""
  plan = _plan(group_size=2, grouping=Grouping(None, "groups of 2", 4))
  assert plan.group_size == 2 and plan.across_groups == 2
  assert plan.groups == Grouping(None, "groups of 2", 4, 2)
  assert [c.sharded for c in plan.clusters] == [c.sharded for c in _plan().clusters]


@pytest.mark.parametrize("size", [None, N])
def test_auto_choice_is_an_input_said_in_the_plan(size):
  """"auto" that kept one group of all N (G = None), or G = N named: the choice and its
  why come in with the grouping, and nothing is counted across groups."""
  grouping = Grouping(causes.AutoOneGroup(N, several=False), "" if size is None else "one group")
  plan = _plan(group_size=size, grouping=grouping)
  assert plan.groups == grouping and plan.across_groups == 0


def test_groups_of_one_replica_keep_every_update_replicated_for_the_grouping_reason():
  """G = 1: nothing is sharded; every cluster and every input that would have been
  sharded says why in the grouping's words."""
  why = reasons.Reason(causes.GroupsOfOne("data"))
  assert str(why) == ("shard_group_size=1: groups of one replica of 'data', so nothing is "
                      "sharded; the update runs replicated as in the original step")
  plan = _plan(group_size=1, grouping=Grouping(None, str(why)))
  sharded = _plan()
  assert plan.group_size == 1 and not plan.state_inputs and not plan.formats
  assert all(not c.sharded and c.why == why for c in plan.clusters)
  for i, j in zip(plan.inputs, sharded.inputs, strict=True):
    assert not i.sharded
    assert i.why == (why if j.sharded else j.why)


def test_what_splits_inputs_over_model_axes_is_a_planner_input():
  """`wus.jit` says its placement splits a weight over "model", `wus.shard_map` its spec:
  the Plan says it as the front end told the planner."""
  for split_by in ("its spec", "its placement"):
    plan = _plan(split={0: (("model", 2),)}, split_by=split_by)
    assert plan.split_by == split_by and plan.inputs[0].split == (("model", 2),)
    assert not any(i.split for i in plan.inputs[1:])


def test_a_step_run_unchanged_is_planned_with_every_input_whole_for_the_reason():
  jaxpr, _ = analysed_body(_step, [P(), P(), P(), P("data")],
                           [(64,), (64,), (64,), (1, 4)], (P(), P(), P()), mesh=mesh(N))
  why = reasons.Reason(refusals.NoBatchSplit())
  plan = planner.unchanged_plan(jaxpr, ["w", "m", "b", "x"], ("data",), N, why)
  assert plan.unchanged == why and not plan.clusters and not plan.state_inputs
  assert [i.name for i in plan.inputs] == ["w", "m", "b", "x"]
  assert all(not i.sharded and i.why == why for i in plan.inputs)
