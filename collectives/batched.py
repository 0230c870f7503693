"""Batched collectives: many small tensors in one collective (§5.2, Fig. 10)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax.numpy as jnp
from jax import lax

from wus.collectives import formatted

_ALL_REDUCE = {"sum": lax.psum, "max": lax.pmax, "min": lax.pmin,
               # Booleans travel as int32: all is the min, any the max.
               "and": lambda x, axes: lax.pmin(x.astype(jnp.int32), axes).astype(x.dtype),
               "or": lambda x, axes: lax.pmax(x.astype(jnp.int32), axes).astype(x.dtype)}


def all_reduce(values: Sequence[jnp.ndarray], op: str, axis_name) -> list[jnp.ndarray]:
  """Per replica: all-reduces several same-dtype tensors with one collective.

  A combined all-reduce need not respect any sharding of its inputs: they are
  flattened, concatenated, reduced once and split back (§5.2). Used for the
  partial results of sharded reductions (Fig. 6), which are small.

  Args:
    values: tensors of one dtype, any shapes.
    op: "sum", "max", "min", or for booleans "and" (all) or "or" (any).
    axis_name: the replica axes.

  Returns:
    The all-reduced tensors, shapes and dtype as given.
  """
  flat = jnp.concatenate([jnp.ravel(v) for v in values])
  out = _ALL_REDUCE[op](flat, axis_name)
  parts, start = [], 0
  for v in values:
    parts.append(jnp.reshape(out[start:start + v.size], v.shape))
    start += v.size
  return parts


# Tensors of at most this many bytes (whole) share a collective, in buckets of
# at most this size; larger ones keep their own, which needs no copy (§5.2).
BUCKET_BYTES = 4 * 2 ** 20


def buckets(sizes: Sequence[int], limit: int = BUCKET_BYTES) -> list[list[int]]:
  """Groups positions 0..len(sizes)-1 into buckets of at most `limit` bytes.

  Tensors of `limit` bytes or more get a bucket of their own; the others
  fill buckets in order.
  """
  out: list[list[int]] = []
  current: list[int] = []
  total = 0
  for k, size in enumerate(sizes):
    if size >= limit:
      out.append([k])
      continue
    if current and total + size > limit:
      out.append(current)
      current, total = [], 0
    current.append(k)
    total += size
  return out + [current] if current else out


def reduce_scatter(values: Sequence[jnp.ndarray], fmts: Sequence, axis_name) -> list[jnp.ndarray]:
  """Per replica: `formatted.reduce_scatter` of several tensors in one collective.

  Each padded tensor is viewed as [N, its shard's elements] (replica r's rows
  are row r), the views are concatenated along the second dim and
  reduce-scattered over the first, so that this replica's part of the result
  holds its shard of every tensor (§5.2, Fig. 10). Every element sums the
  same values in the same order as the single-tensor collective.

  Args:
    values: tensors of one dtype, shapes `fmt.shape`, different on every replica.
    fmts: a `ShardFormat` per tensor, all with the same `num_shards` (N).
    axis_name: the replica axes.

  Returns:
    One shard per tensor: shape `fmt.shard_shape`, dtype of the values.
  """
  if len(values) == 1:
    return [formatted.reduce_scatter(values[0], fmts[0], axis_name)]
  rows = [jnp.reshape(formatted.pad(x, f), (f.num_shards, -1)) for x, f in zip(values, fmts)]
  mine = lax.psum_scatter(jnp.concatenate(rows, axis=1), axis_name, scatter_dimension=0,
                          tiled=True)[0]
  return _split(mine, fmts, lambda part, f: jnp.reshape(part, f.shard_shape))


def all_gather(shards: Sequence[jnp.ndarray], fmts: Sequence, axis_name) -> list[jnp.ndarray]:
  """Per replica: `formatted.all_gather` of several shards in one collective.

  Args:
    shards: one dtype, shapes `fmt.shard_shape`.
    fmts: a `ShardFormat` per shard, all with the same `num_shards` (N).
    axis_name: the replica axes.

  Returns:
    The whole tensors: shapes `fmt.shape`, identical on every replica.
  """
  if len(shards) == 1:
    return [formatted.all_gather(shards[0], fmts[0], axis_name)]
  flat = jnp.concatenate([jnp.ravel(s) for s in shards])
  every = formatted.gather(flat, axis_name, tiled=False)  # [N, total]: replica r's shards in row r.
  return _split(every, fmts, lambda part, f: formatted.unpad(
      jnp.reshape(part, f.padded_shape), f), axis=1)


def _split(x: jnp.ndarray, fmts: Sequence, finish, axis: int = 0) -> list[jnp.ndarray]:
  """Cuts `x` along `axis` into one part per format (shard sizes), each `finish`ed."""
  out, start = [], 0
  for f in fmts:
    size = math.prod(f.shard_shape)
    out.append(finish(lax.slice_in_dim(x, start, start + size, axis=axis), f))
    start += size
  return out
