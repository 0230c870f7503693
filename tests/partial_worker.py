"""Partial sharding on a ("host", "local") mesh of 2 x 4 devices, in one process or two.

The model of test_multiprocess_partial.py: a two-layer MLP (Dense with bias, tanh,
Dense with bias), gradients `pmean`-ed over both mesh axes as users write them,
trained 3 steps with Adam and with `clip_by_global_norm` then Adam, unmodified
(`jax.jit(jax.shard_map(step))`) and under `wus.shard_map(step, axis_name="local")`:
shard within each row of the mesh (one process's 4 devices in a 2-process run),
all-reduce the shards across rows.

As a script (one per process; 2 processes use jax.distributed with gloo on
127.0.0.1), with one JSON argument:
  {"out": folder, "num_processes": P, "process_id": i, "address": "127.0.0.1:port"}
Every process writes `<out>/result_<process>.npz` ({"<case>/<variant>/<leaf>": whole
value}, from `results`) and `<out>/info_<process>.json` (`facts`).
"""

from __future__ import annotations

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

MESH_SHAPE, AXES = (2, 4), ("host", "local")
BATCH_SPEC = P(AXES)
SPECS = dict(in_specs=(P(), P(), BATCH_SPEC), out_specs=(P(), P(), P()))
# Sizes 4 does not divide (padding), one that it does.
IN, HIDDEN, OUT = 6, 13, 3
GLOBAL_BATCH = 16  # 2 examples per device
STEPS = 3
CASES = {"adam": optax.adam(1e-2),
         "clip_adam": optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))}


def make_mesh() -> jax.sharding.Mesh:
  """The (2, 4) mesh whose rows are consecutive devices: one process's devices each
  in a 2-process run (checked by `facts`)."""
  return jax.sharding.Mesh(np.array(jax.devices()).reshape(MESH_SHAPE), AXES)


def init_params() -> dict:
  k = jax.random.split(jax.random.key(0), 4)
  return {"dense1": {"w": 0.5 * jax.random.normal(k[0], (IN, HIDDEN)),
                     "b": 0.1 * jax.random.normal(k[1], (HIDDEN,))},
          "dense2": {"w": 0.5 * jax.random.normal(k[2], (HIDDEN, OUT)),
                     "b": 0.1 * jax.random.normal(k[3], (OUT,))}}


def loss_fn(params: dict, batch: jax.Array) -> jax.Array:
  """One replica's mean squared error on its rows of [x | y]."""
  x, y = batch[:, :IN], batch[:, IN:]
  h = jnp.tanh(x @ params["dense1"]["w"] + params["dense1"]["b"])
  return jnp.mean((h @ params["dense2"]["w"] + params["dense2"]["b"] - y) ** 2)


def make_step(tx):
  def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    grads = jax.lax.pmean(grads, AXES)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, AXES)
  return step


def global_batch(i: int) -> np.ndarray:
  """Step i's global batch, [x | y], the same on every process."""
  return np.random.default_rng(i).normal(size=(GLOBAL_BATCH, IN + OUT)).astype(np.float32)


def batch(i: int, mesh) -> jax.Array:
  """Step i's global batch laid out over the mesh from the rows this process holds."""
  sharding = NamedSharding(mesh, BATCH_SPEC)
  x = global_batch(i)
  rows = sorted({idx[0].indices(GLOBAL_BATCH)[:2]
                 for idx in sharding.addressable_devices_indices_map(x.shape).values()})
  lo, hi = rows[0][0], rows[-1][1]  # this process's rows are contiguous
  return jax.make_array_from_process_local_data(sharding, x[lo:hi], x.shape)


def host_value(x) -> np.ndarray:
  """A replicated array's whole value, on any process."""
  return np.asarray(x.addressable_data(0) if isinstance(x, jax.Array) else x)


def whole(tree) -> dict[str, np.ndarray]:
  import wus  # noqa: PLC0415
  leaves = jax.tree_util.tree_flatten_with_path(wus.unshard(tree))[0]
  return {jax.tree_util.keystr(k): host_value(x) for k, x in leaves}


def run(step, tx, mesh) -> tuple:
  params = jax.device_put(init_params(), NamedSharding(mesh, P()))
  state = params, tx.init(params)
  for i in range(STEPS):
    *state, loss = step(*state, batch(i, mesh))
  return tuple(state), loss


def results(mesh) -> tuple[dict, dict]:
  """Trains every case both ways: ({"<case>/<variant>/<leaf>": whole value}, facts)."""
  import wus  # noqa: PLC0415
  out, facts = {}, {"cases": {}}
  for name, tx in CASES.items():
    plain = jax.jit(jax.shard_map(make_step(tx), mesh=mesh, **SPECS))
    sharded = wus.shard_map(make_step(tx), mesh=mesh, axis_name="local", **SPECS)
    for variant, step in (("plain", plain), ("wus", sharded)):
      state, loss = run(step, tx, mesh)
      for k, v in whole(state).items():
        out[f"{name}/{variant}/{k}"] = v
      out[f"{name}/{variant}/loss"] = host_value(loss)
    facts["cases"][name] = case_facts(sharded, state, batch(0, mesh))
  devices = list(mesh.devices.flat)
  facts["process_of_position"] = [d.process_index for d in devices]  # the programs' logical ids
  facts["process_of_row"] = [sorted({d.process_index for d in row}) for row in mesh.devices]
  facts["process_count"] = jax.process_count()
  return out, facts


def case_facts(step, state, x) -> dict:
  """What one process sees of the sharded state and the compiled step's collectives."""
  import wus  # noqa: PLC0415
  params, opt_state = state
  leaves = [s for s in jax.tree.leaves(opt_state, is_leaf=lambda s: isinstance(s, wus.ShardedArray))
            if isinstance(s, wus.ShardedArray)]
  sharded = [{"size": int(np.prod(s.format.shape, dtype=int)),
              "padded": int(np.prod(s.format.padded_shape, dtype=int)),
              "num_shards": s.format.num_shards, "axes": list(s.axes),
              "shards": [[d.data.size, d.device.process_index] for d in s.data.addressable_shards]}
             for s in leaves]
  return {"sharded": sharded,
          "hlo": step.lower(params, opt_state, x).compile().as_text()}


def main(config: dict) -> None:
  processes = config["num_processes"]
  jax.config.update("jax_num_cpu_devices", 8 // processes)
  if processes > 1:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(config["address"], num_processes=processes,
                               process_id=config["process_id"])
  out, facts = results(make_mesh())
  np.savez(os.path.join(config["out"], f"result_{jax.process_index()}.npz"), **out)
  with open(os.path.join(config["out"], f"info_{jax.process_index()}.json"), "w") as f:
    json.dump(facts, f)


if __name__ == "__main__":
  main(json.loads(sys.argv[1]))
