"""The cost model's batching choice, predicted beside measured (issue 30).

A planned step batches its gradients' reduce-scatters and its weights'
all-gathers (§5.2) as the cost model chose (`wus.analysis.cost.bucket_bytes`:
a bucket limit and `alone_bytes`), pricing latency against the copies into
and out of buckets. A misprice shows when the choice is run: for the
workload of the Plan's sharded clusters (`cost.step_workload`), three ways
of batching, each a program of exactly those collectives made with the calls
the rewritten step makes (`wus.collectives.batched`, flat formats):

  plan       the Plan's bucket limit and alone_bytes.
  one_bucket one bucket (per dtype) for every tensor: fewest collectives,
             every byte copied.
  alone      every tensor its own collective: no copies but padded tensors'.

`wus-bench` times them in the same interleaved rounds as the steps and prints
each beside `costmodel.predict_sharded`'s reduce-scatter + all-gather +
copies for the topology the step was planned with.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from wus.analysis import costmodel, formats, network
from wus.collectives import batched

_DTYPES = {4: jnp.float32, 2: jnp.bfloat16, 8: jnp.float64}


def choices(plan_bucket_bytes: int, plan_alone_bytes: int | None) -> dict[str, tuple]:
  """name -> (bucket limit in bytes, alone_bytes) of the three batchings (module docstring)."""
  return {"plan": (plan_bucket_bytes, plan_alone_bytes), "one_bucket": (2 ** 62, None),
          "alone": (1, 1)}


def predicted_seconds(workload: costmodel.Workload, topology: network.Topology,
                      num_shards: int, limit: int, alone: int | None) -> float:
  """Predicted seconds of the batched reduce-scatter and all-gather with their copies."""
  p = costmodel.predict_sharded(workload, topology, num_shards, bucket_bytes=limit,
                                alone_bytes=alone)
  return p.reduce_scatter + p.all_gather + p.copies


def program(workload: costmodel.Workload, mesh: Mesh, axis: str, limit: int,
            alone: int | None) -> tuple[Callable, tuple]:
  """The batched collectives of `workload` as a jitted program and its arguments.

  Each device reduce-scatters its own gradients (every tensor flat, padded
  to a multiple of N as its format pads it) and all-gathers its shards, in
  the buckets `limit` and `alone` make. `run(*args)` returns (the reduced
  shards, the gathered tensors), each a list of global arrays split over
  `axis`: [N shard elements] and [N elements].
  """
  n = mesh.shape[axis]
  fmts = [formats.ShardFormat.flat((e,), n) for e, _ in workload.gradients]
  dtypes = [_DTYPES[b] for _, b in workload.gradients]
  split = NamedSharding(mesh, P(axis))
  grads = [jax.device_put(jnp.ones((n * e,), d), split)
           for (e, _), d in zip(workload.gradients, dtypes, strict=True)]
  shards = [jax.device_put(jnp.ones((n * f.shard_rows,), d), split)
            for f, d in zip(fmts, dtypes, strict=True)]

  def collectives(grads, shards):
    return (batched.reduce_scatter(grads, fmts, axis, limit, alone),
            batched.all_gather(shards, fmts, axis, limit, alone))

  run = jax.jit(jax.shard_map(collectives, mesh=mesh, in_specs=P(axis), out_specs=P(axis),
                              check_vma=False))
  return run, (grads, shards)


def collective_counts(workload: costmodel.Workload, num_shards: int, limit: int,
                      alone: int | None) -> int:
  """Reduce-scatters (= all-gathers) the batching makes: its buckets (`batched.dtype_buckets`)."""
  sizes = [e * b for e, b in workload.gradients]
  padded = [num_shards * -(-e // num_shards) != e for e, _ in workload.gradients]
  return len(batched.dtype_buckets([b for _, b in workload.gradients], sizes, limit, alone,
                                   padded))


def rows(result: dict) -> list[list]:
  """The table rows of one regime's `choices` result: name, collectives each way,
  predicted ms, measured ms (median), measured / predicted."""
  out = []
  for name, c in result["choices"].items():
    measured = statistics.median(c["seconds"])
    out.append([name, c["collectives"], 1e3 * c["predicted"], 1e3 * measured,
                measured / c["predicted"] if c["predicted"] else math.inf])
  return out
