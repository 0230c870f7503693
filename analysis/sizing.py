"""The cost model's choices: the group size G, the batched collectives' buckets (§5.2).

Each choice prices its candidates with `costmodel`'s predictions and takes the
fastest, or the smallest within a tolerance of it. Like `costmodel`, these are
decisions from a model, never from a measurement; units are bytes and seconds.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from wus.analysis.costmodel import (StepPrediction, Workload, predict_replicated,
                                    predict_sharded, shard_elements)
from wus.analysis.network import Topology
from wus.collectives.batched import has_own

# The bucket limit of batched collectives the cost model did not choose (a
# step with no sharded update; `wus.unshard`'s all-gathers).
DEFAULT_BUCKET_BYTES = 4 * 2 ** 20

# Candidate bucket limits of `choose_bucket_bytes`: 64 KiB to 1 GiB, powers of 2.
BUCKET_CANDIDATES = tuple(2 ** k for k in range(16, 31))


def choose_bucket_bytes(workload: Workload, topology: Topology, group_size: int = 1, *,
                        tolerance: float = 0.01,
                        candidates: Sequence[int] = BUCKET_CANDIDATES) -> int:
  """The smallest bucket limit whose collectives are within `tolerance` of one bucket's.

  Fewer buckets pay fewer latency terms (§5.2), so in this model one bucket
  holding everything is fastest. Smaller buckets have costs the model does
  not price (a collective cannot start before its last gradient exists; the
  combined buffer takes memory), so the smallest limit whose predicted
  communication is at most (1 + tolerance) x that of a single bucket is
  taken: bandwidth-bound buckets, no larger than needed.

  Args:
    workload: gradients, gathered tensors, the update's traffic.
    topology: devices.
    group_size: G (1: the replicated all-reduce).
    tolerance: allowed relative excess over a single bucket.
    candidates: bucket limits to try, bytes.

  Returns:
    A limit from `candidates` (the largest if none is within tolerance).
  """
  def communication(limit: float) -> float:
    if group_size == 1:
      return predict_replicated(workload, topology, bucket_bytes=limit).communication
    return predict_sharded(workload, topology, group_size, bucket_bytes=limit).communication

  best = communication(math.inf)
  ordered = sorted(candidates)
  for limit in ordered:
    if communication(limit) <= best * (1 + tolerance):
      return limit
  return ordered[-1]


# Candidate `alone_bytes` of `choose_batching`: 1 KiB to 1 GiB, powers of 2.
ALONE_CANDIDATES = tuple(2 ** k for k in range(10, 31))


def choose_batching(workload: Workload, topology: Topology, group_size: int, *,
                    tolerance: float = 0.01, candidates: Sequence[int] = BUCKET_CANDIDATES,
                    alone_candidates: Sequence[int] = ALONE_CANDIDATES
                    ) -> tuple[int, int | None]:
  """(bucket limit, alone_bytes) of the sharded step's batched collectives (§5.2).

  Batching trades latency for copies (`buckets`): a tensor alone pays a
  reduce-scatter's and an all-gather's latency, a tensor batched the copy
  of its bytes into and out of the bucket. `alone_bytes` is the candidate
  (or None: every tensor under the limit batched) with the least predicted
  collectives and copies with one bucket for the rest, wherever the tensors
  alone sit (`_own_last`: the bucket a tensor alone splits off runs behind
  its backward pass); the limit is then the smallest candidate within
  `tolerance` of that (as `choose_bucket_bytes`), in the tensors' order.
  Where memory is fast next to the collectives' latency (accelerators), few
  tensors are worth a collective of their own; where a collective is a
  memory copy behind a thread rendezvous (CPU devices), most are.

  Args:
    workload: gradients, gathered tensors, the update's traffic.
    topology: devices.
    group_size: G > 1.
    tolerance: allowed relative excess over the best.
    candidates: bucket limits to try, bytes.
    alone_candidates: alone_bytes to try, bytes (None is always tried).

  Returns:
    (a limit from `candidates`, an alone_bytes from `alone_candidates` or None).
  """
  def seconds(limit: float, alone: int | None, work: Workload = workload) -> float:
    p = predict_sharded(work, topology, group_size, bucket_bytes=limit, alone_bytes=alone)
    return p.communication + p.copies

  options = [None, *sorted(alone_candidates, reverse=True)]
  alone = min(options, key=lambda a: seconds(
      math.inf, a, _own_last(workload, topology, group_size, a)))  # First (largest) of equals.
  best = seconds(math.inf, alone)
  ordered = sorted(candidates)
  limit = next((c for c in ordered if seconds(c, alone) <= best * (1 + tolerance)), ordered[-1])
  return limit, alone


def _own_last(workload: Workload, topology: Topology, group_size: int,
              alone: int | None) -> Workload:
  """`workload` with the tensors that have a collective of their own last (`has_own`).

  A tensor alone closes the bucket before it (`buckets`); the bucket it splits
  off no longer waits for its backward pass, an overlap the model leaves out,
  so the latency that bucket adds is not priced against it. In this order a
  tensor alone adds its own collectives' latency and saves its copies, nothing
  else.
  """
  def last(tensors):
    own = [has_own(n * b, math.inf, alone,
                   group_size * shard_elements(n, group_size, topology.tile_elements) != n)
           for n, b in tensors]
    return tuple(t for _, t in sorted(zip(own, tensors, strict=True), key=lambda x: x[0]))
  return dataclasses.replace(workload, gradients=last(workload.gradients),
                             gathered=last(workload.gathered))


def choose_group_size(workload: Workload, topology: Topology, rest: float = 0.0,
                      bucket_bytes: float | None = None) -> int:
  """The sharding group size G with the lowest predicted step time (§5.2).

  Every G of `topology.group_sizes()` (divisors of N whose groups follow the
  axes) is priced by `predict_sharded`; ties go to the smaller G. G = N wins
  when latency is negligible (the update shrinks most); a smaller G when
  latency terms dominate (tiny tensors, many devices: rings within and
  across groups are shorter than one ring over all) or when small shards pad.

  Args:
    workload: gradients, gathered tensors, the update's traffic.
    topology: devices.
    rest: seconds of the rest of the step (the same for every G).
    bucket_bytes: bucket limit, bytes; None: `choose_bucket_bytes` per G.

  Returns:
    G (1 if no sharding is predicted faster than none).
  """
  return best_sharded(workload, topology, rest, bucket_bytes).group_size


def best_sharded(workload: Workload, topology: Topology, rest: float = 0.0,
                 bucket_bytes: float | None = None) -> StepPrediction:
  """The prediction of `choose_group_size`'s G (see there)."""
  best = None
  for g in topology.group_sizes():
    limit = (choose_bucket_bytes(workload, topology, g) if bucket_bytes is None
             else bucket_bytes)
    p = predict_sharded(workload, topology, g, rest, limit)
    if best is None or p.total < best.total:
      best = p
  return best
