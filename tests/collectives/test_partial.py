"""Partial sharding (§5.2, Fig. 10): shard within groups, all-reduce across them."""

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import wus
from helpers import assert_trees_equal, collectives, dense_step, sharded_leaves, two_axis_run
from wus.analysis import reasons

BATCH = P(("replica", "data"))


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "novma"])
@pytest.mark.parametrize("shape", [(2, 4), (4, 2)], ids=["2x4", "4x2"])
def test_sharded_within_the_data_axis_all_reduced_across_replica(shape, check_vma):
  """A ("replica", "data") mesh with gradients all-reduced over both and
  axis_name="data": state is 1/|data| per device, the gradient is one batched
  reduce-scatter within groups plus one batched all-reduce of the shards."""
  mesh, a, b, ws, x = two_axis_run(shape, check_vma, 40, wus_kw=dict(axis_name="data"))
  # The gradient sums run in another order (within groups, then across): rounding only.
  assert_trees_equal(a[0], b[0], rtol=1e-6, atol=1e-7)
  assert_trees_equal(a[1], wus.unshard(b[1]), rtol=1e-6, atol=1e-7)
  group = mesh.shape["data"]
  assert {x.format.num_shards for x in sharded_leaves(b[1])} == {group}
  mu = b[1][0].mu["w"].data
  assert {s.data.shape for s in mu.addressable_shards} == {(24 * 40 // group,)}
  plan = ws.plan(*b, x)
  assert plan.clusters and all(
      c.sharded and c.why.notes == (reasons.PartialSharding(("data",), ("replica",)),)
      for c in plan.clusters), [c.why for c in plan.clusters]
  found = collectives(ws.lower(*b, x).compile().as_text())
  assert found["reduce-scatter"].count == 1 and found["all-gather"].count == 1
  assert found["all-reduce"].count == 1 and found["all-reduce"].bytes == 4 * (960 + 40) // group


def test_default_axis_name_shards_over_every_gradient_axis():
  mesh = jax.make_mesh((2, 4), ("replica", "data"))
  tx = optax.adam(1e-2)
  params = {"w": jnp.ones((24, 40)), "b": jnp.zeros((40,))}
  x = jax.device_put(jnp.ones((16, 24)), NamedSharding(mesh, BATCH))
  ws = wus.shard_map(dense_step(tx, ("replica", "data")), mesh=mesh, in_specs=(P(), P(), BATCH),
                     out_specs=(P(), P()))
  plan = ws.plan(params, tx.init(params), x)
  assert plan.axes == ("replica", "data") and plan.num_shards == 8
