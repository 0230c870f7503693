"""shard_group_size="auto": the cost model picks G (§5.2), and the step runs with it."""

import jax
import optax
from jax.sharding import PartitionSpec as P

import wus
from helpers import assert_trees_equal, dense_inputs, dense_step, mesh, sharded_leaves
from wus.analysis import causes, network, reasons

TX = optax.adam(1e-2)
SPECS = dict(in_specs=(P(), P(), P("data")), out_specs=(P(), P()))


def _run(topology=None):
  m = mesh(8)
  params, xs = dense_inputs(m)
  step = dense_step(TX)
  ref = jax.jit(jax.shard_map(step, mesh=m, **SPECS))
  ws = wus.shard_map(step, mesh=m, shard_group_size="auto", topology=topology, **SPECS)
  a = b = (params, TX.init(params))
  for x in xs:
    a, b = ref(*a, x), ws(*b, x)
  return a, b, ws.plan(*b, xs[0])


def test_one_process_keeps_one_group_of_all_replicas():
  """One fast axis: splitting it only costs bandwidth, so G = N."""
  a, b, plan = _run()
  assert_trees_equal(a[0], b[0])  # One group: the plain sharded step, bit for bit.
  assert {x.format.num_shards for x in sharded_leaves(b[1])} == {8}
  assert plan.group_size is None and plan.groups.num_groups == 0 and not plan.groups.layout
  chosen = plan.groups.chosen
  assert isinstance(chosen, causes.AutoGroupSize)
  assert (chosen.group_size, chosen.num_shards) == (8, 8)
  assert str(plan.groups).startswith("shard_group_size='auto': the cost model chose G=8 of 8")
  assert all(not c.why.notes for c in plan.clusters)  # No partial sharding.


def test_padded_small_shards_on_two_hosts_give_groups_of_one_host():
  """A TPU-like layout (shards are whole tiles of 256 elements) and a slow
  update (1 GB/s): sharding pays, but 8 shards of the 960- and 40-element
  tensors pad to a tile each and gather twice the bytes 4 shards do, so the
  model picks groups of one host's 4 devices (worked out in
  tests/analysis/test_costmodel.py's terms: 42.5 us at G=4, 44.7 at G=8, 63.2 at G=1)."""
  two_hosts = network.Topology((network.Axis("process", 4, 1e-6, 1e11),
                                  network.Axis("host", 2, 1e-5, 1e9)), 1e9, tile_elements=256)
  a, b, plan = _run(two_hosts)
  assert_trees_equal(a[0], b[0], rtol=1e-6, atol=1e-7)  # Summed within groups, then across.
  assert_trees_equal(a[1], wus.unshard(b[1]), rtol=1e-6, atol=1e-7)
  assert plan.group_size == 4 and (plan.groups.num_groups, plan.groups.across) == (2, 1)
  chosen = plan.groups.chosen
  assert isinstance(chosen, causes.AutoGroupSize)
  assert (chosen.group_size, chosen.num_shards) == (4, 8)
  assert str(plan.groups).startswith("shard_group_size='auto': the cost model chose G=4 of 8")
  assert {x.format.num_shards for x in sharded_leaves(b[1])} == {4}
  assert plan.clusters and all(
      c.sharded and c.why.notes == (reasons.PartialSharding(("data.in_group",), ("data.groups",)),)
      for c in plan.clusters), [c.why for c in plan.clusters]
