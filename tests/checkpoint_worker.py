"""The model of test_checkpoint.py, and a worker that trains, saves or restores it in a process.

As a script (one per process; several processes use jax.distributed with gloo
on 127.0.0.1), with one JSON argument:
  {"mode": "save" | "resume", "dir": folder, "devices": devices per process,
   "num_processes": P, "process_id": i, "address": "127.0.0.1:port",
   "start": first update, "steps": updates to run}
"save" trains updates [0, steps) from `init_params()` and saves
`{"params", "opt_state"}` with `wus.checkpointable` into `<dir>/ckpt`; "resume"
restores `<dir>/ckpt` into this step (`state_target`) and trains updates
[start, start + steps). Process 0 writes the whole state (`wus.unshard`)
before saving (`save_saved.npz`), after restoring (`resume_restored.npz`) and at the end
(`resume_final.npz`),
and every process writes what it wrote of each tensor while saving to
`<dir>/writes_<process>.json` (see `spy_on_writes`).
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

# Sizes that 8, 6 and 4 do not divide; a scalar (stays whole); Adam adds a scalar count.
SHAPES = {"conv": (3, 3, 5, 7), "v7": (7,), "bias": (130,), "scale": ()}
TX = optax.adam(1e-2)
GLOBAL_BATCH = 24  # 3, 4 and 6 examples per replica at N = 8, 6 and 4
FEATURES = 4
SPECS = dict(in_specs=(P(), P(), P("data")), out_specs=(P(), P(), P()))


def init_params() -> dict:
  keys = jax.random.split(jax.random.key(0), len(SHAPES))
  return {k: 0.1 * jax.random.normal(kk, s) for (k, s), kk in zip(SHAPES.items(), keys)}


def train_step(params, opt_state, batch):
  """One replica's step, as users write it under check_vma=True: the loss is the mean over
  all replicas (`pmean`), so AD's gradient of the replicated params is the global mean
  and does not depend on the replica count."""
  def loss_fn(p):
    s = jnp.tanh(batch).mean(axis=1)  # one number per example
    per_example = sum(jnp.sum(jnp.sin(leaf[None] * s.reshape((-1,) + (1,) * leaf.ndim)),
                              axis=tuple(range(1, leaf.ndim + 1)))
                      for leaf in jax.tree.leaves(p))
    return jax.lax.pmean(jnp.mean(per_example), "data")

  loss, grads = jax.value_and_grad(loss_fn)(params)
  updates, opt_state = TX.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss


def mesh_of(devices) -> jax.sharding.Mesh:
  return jax.make_mesh((len(devices),), ("data",), devices=devices)


def batch(i: int, mesh) -> jax.Array:
  """Update i's global batch, laid out over the mesh (on one process or several)."""
  x = np.random.default_rng(i).normal(size=(GLOBAL_BATCH, FEATURES)).astype(np.float32)
  return jax.make_array_from_callback(x.shape, NamedSharding(mesh, P("data")), lambda idx: x[idx])


def wus_step(mesh):
  import wus  # noqa: PLC0415
  return wus.shard_map(train_step, mesh=mesh, **SPECS)


def plain_step(mesh):
  return jax.jit(jax.shard_map(train_step, mesh=mesh, **SPECS))


def run(step, state: tuple, mesh, start: int, steps: int) -> tuple:
  params, opt_state = state
  for i in range(start, start + steps):
    params, opt_state, _ = step(params, opt_state, batch(i, mesh))
  return params, opt_state


def abstract_state() -> tuple:
  return jax.eval_shape(lambda: (init_params(), TX.init(init_params())))


def whole(tree) -> dict[str, np.ndarray]:
  """{keystr: whole value} of a state (sharded or not), on the host, on any process."""
  import wus  # noqa: PLC0415
  leaves = jax.tree_util.tree_flatten_with_path(wus.unshard(tree))[0]
  return {jax.tree_util.keystr(k): np.asarray(x.addressable_data(0) if isinstance(x, jax.Array)
                                              else x) for k, x in leaves}


def spy_on_writes() -> list[dict]:
  """Records, per tensor this process saves sharded, what it copied off each device and wrote.

  Returns a list that fills as `wus.checkpoint` saves: {"name", "shard_size",
  "pieces": [[device id, process of the device, first element, elements]],
  "runs": [[first element, elements]], "chunk"}.
  """
  from wus import checkpoint  # noqa: PLC0415
  records, of = [], checkpoint.handler._Write.of.__func__

  def recording(cls, view, info, arg):
    write = of(cls, view, info, arg)
    devices = {d.id: d for d in jax.devices()}
    records.append({"name": info.name, "shard_size": view.layout.format.shard_size,
                    "pieces": [[i, devices[i].process_index, s, n] for i, s, n in write.pieces],
                    "runs": [[s, len(x)] for s, x in write.runs],
                    "chunk": list(write.spec.metadata.chunk_shape)})
    return write

  checkpoint.handler._Write.of = classmethod(recording)
  return records


def main(config: dict) -> None:
  jax.config.update("jax_num_cpu_devices", config["devices"])
  if config["num_processes"] > 1:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(config["address"], num_processes=config["num_processes"],
                               process_id=config["process_id"])
  import orbax.checkpoint as ocp  # noqa: PLC0415

  import wus  # noqa: PLC0415
  out = config["dir"]
  mesh = mesh_of(jax.devices())
  step = wus_step(mesh)
  first = jax.process_index() == 0
  if config["mode"] == "save":
    state = run(step, (init_params(), TX.init(init_params())), mesh, 0, config["steps"])
    saved = whole(state)
    records = spy_on_writes()
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(os.path.join(out, "ckpt"), wus.checkpointable(
        {"params": state[0], "opt_state": state[1]}))
    ckptr.wait_until_finished()
    with open(os.path.join(out, f"writes_{jax.process_index()}.json"), "w") as f:
      json.dump(records, f)
    if first:
      np.savez(os.path.join(out, "save_saved.npz"), **saved)
  else:
    params, opt_state, _ = step.state_target(*abstract_state(), batch(0, mesh))
    restored = ocp.StandardCheckpointer().restore(
        os.path.join(out, "ckpt"), {"params": params, "opt_state": opt_state})
    state = restored["params"], restored["opt_state"]
    restored = whole(state)  # A program every process runs.
    if first:
      np.savez(os.path.join(out, "resume_restored.npz"), **restored)
    state = run(step, state, mesh, config["start"], config["steps"])
    final = whole(state)
    if first:
      np.savez(os.path.join(out, "resume_final.npz"), **final)


if __name__ == "__main__":
  main(json.loads(sys.argv[1]))
