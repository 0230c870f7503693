"""The cost model's devices for a tensor-parallel step (issue 29 item 8): `topology=` of
every device of a ("data", "model") mesh prices each model rank's data group, whose
ring is strided by the model axis (`Topology.strided`), not the first N_data devices."""

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import wus
from tensor_parallel import (MEGATRON_SPEC, TX, megatron_inputs, megatron_step, opt_specs, put,
                             two_axis_mesh)
from wus.analysis import network


def _plan(mesh, topology):
  params, batches = megatron_inputs(4, steps=1)
  kw = dict(mesh=mesh, in_specs=(MEGATRON_SPEC, opt_specs(MEGATRON_SPEC), P("data", "model")),
            out_specs=(MEGATRON_SPEC, opt_specs(MEGATRON_SPEC), P()))
  state = (put(mesh, params, MEGATRON_SPEC), put(mesh, TX.init(params), opt_specs(MEGATRON_SPEC)))
  batch = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P("data", "model"))),
                       batches[0])
  return wus.shard_map(megatron_step, **kw, topology=topology).plan(*state, batch)


def test_a_topology_of_the_whole_mesh_prices_the_strided_data_groups():
  mesh = two_axis_mesh(4, 2)
  f = network.ACCELERATOR
  ring = network.Topology((network.Axis("chip", 8, f.intra_alpha, f.intra_bandwidth),),
                          f.memory_bandwidth)
  whole, group = _plan(mesh, ring), _plan(mesh, ring.strided(2, 4))
  first_four = _plan(mesh, network.Topology(ring.split(4)[0], f.memory_bandwidth))
  assert whole.details() == group.details()
  # The data ring crosses 2 links a step, shared by the 2 model ranks' groups: slower
  # than a ring of 4 neighbours (the topology read as its first 4 devices, as before).
  assert whole.details() != first_four.details()  # The predicted times (the summary omits them).
  assert whole.bucket_bytes == group.bucket_bytes
