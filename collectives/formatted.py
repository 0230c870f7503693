"""Collectives with a sharding format fused in (§5.1, Fig. 9).

`fmt` is a `wus.analysis.formats.ShardFormat` (anything with `shape`,
`merged_shape`, `num_shards`, `padded_shape`, `shard_rows`). The functions
marked "per replica" run inside `shard_map`; `axis_name` is a mesh axis name
or a tuple of them, whose product has `fmt.num_shards` replicas. Replica r
(`lax.axis_index(axis_name)`) owns rows [r * shard_rows, (r + 1) * shard_rows)
of the padded merged tensor, the order in which `psum_scatter` and
`all_gather` (tiled) place shards.

Over several mesh axes the reduce-scatter and the all-gather run in phases
(§5.1, `scatter_rows`, `gather_rows`): the reduce-scatter along the last
(minor, fastest: consecutive devices, one process's devices in a multi-process
mesh) axis first, on the whole tensor, then along the next on what is left;
the all-gather in the reverse order. Each slower axis then moves only the
part the faster ones left, and the shard a replica ends with is still row
block r of the padded tensor, so the format is the same as with one phase.

A tensor identical across other mesh axes too (`copies`: in a tensor-parallel
step, the update of a weight no spec splits over "model") is sharded over the
replica axes and those: the reduce-scatter sums over the replica axes only, and
each replica of `copies` keeps its part of the block it receives (`keep_copy`);
the all-gather runs over all of them.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jax import lax


def pad(x: jnp.ndarray, fmt) -> jnp.ndarray:
  """Reshapes `x` (shape `fmt.shape`) to `fmt.padded_shape`, zero padded."""
  merged = reshape(x, fmt.merged_shape)
  extra = fmt.padded_shape[0] - fmt.merged_shape[0]
  if not extra:
    return merged
  return lax.pad(merged, np.zeros((), merged.dtype),
                 [(0, extra, 0)] + [(0, 0, 0)] * (len(fmt.merged_shape) - 1))


def unpad(x: jnp.ndarray, fmt) -> jnp.ndarray:
  """Inverse of `pad`: drops the padding rows and restores `fmt.shape`."""
  rows = fmt.merged_shape[0]
  if rows != x.shape[0]:
    x = lax.slice(x, (0,) * x.ndim, (rows, *x.shape[1:]))
  return reshape(x, fmt.shape)


def reshape(x: jnp.ndarray, shape) -> jnp.ndarray:
  """`jnp.reshape(x, shape)`, staged as `lax.reshape`: the collectives reshape every
  tensor of the update, and jnp's checks cost more than the equation.

  Args:
    x: any shape and dtype.
    shape: the new shape, of `x.size` elements; one dim may be -1 (inferred).

  Returns:
    `x`'s elements in row-major order, shape `shape`, dtype of `x` (`x` itself where the
    shape is its own).
  """
  shape = tuple(shape)
  if -1 in shape:
    known = math.prod(d for d in shape if d != -1)
    shape = tuple(math.prod(x.shape) // known if d == -1 else d for d in shape)
  return lax.reshape(x, shape)


def shard(x: jnp.ndarray, fmt, axis_name) -> jnp.ndarray:
  """Per replica: this replica's shard of a value every replica holds whole.

  A local dynamic slice, no communication (the sharding program of §4.2).
  Correct only when `x` is identical on every replica of `axis_name`.

  Args:
    x: shape `fmt.shape`.
    fmt: the format.
    axis_name: the replica axes.

  Returns:
    shape `fmt.shard_shape`, dtype of `x`.
  """
  start = lax.mul(_replica(axis_name), np.int32(fmt.shard_rows))  # A literal.
  return lax.dynamic_slice_in_dim(pad(x, fmt), start, fmt.shard_rows, axis=0,
                                  allow_negative_indices=False)


def row_mask(fmt, axis_name) -> jnp.ndarray:
  """Per replica: which rows of this replica's shard are data, not padding.

  Padding sits at the end of the leading merged dim; replica r's rows start at
  r * shard_rows (`iota + offset` against the true size, Fig. 6).

  Returns:
    bool [shard_rows] (shape `fmt.shard_shape[:1]`).
  """
  start = lax.mul(_replica(axis_name), np.int32(fmt.shard_rows))  # A literal.
  return start + lax.iota(jnp.int32, fmt.shard_rows) < fmt.merged_shape[0]


def _replica(axis_name):
  """This replica's index along `axis_name` (a name, or a tuple of names, major first)."""
  if isinstance(axis_name, (tuple, list)) and len(axis_name) == 1:
    axis_name = axis_name[0]  # One axis: no index arithmetic to trace.
  return lax.axis_index(axis_name)


def reduce_scatter(x: jnp.ndarray, fmt, axis_name, copies=()) -> jnp.ndarray:
  """Per replica: this replica's shard of the sum of `x` over all replicas.

  Replaces `psum(x)` when only the shard is needed (Fig. 3).

  Args:
    x: shape `fmt.shape`, different on every replica of `axis_name`.
    axis_name: the replica axes the sum runs over.
    copies: mesh axes (minor to `axis_name`) over whose replicas `x` is identical
      and which split the shards further: `fmt.num_shards` is the replicas of
      `axis_name` and `copies` together. The sum runs over `axis_name` only; each
      replica keeps its part of the block it receives, with no communication
      (`keep_copy`).

  Returns:
    shape `fmt.shard_shape`, dtype of `x`: rows [r * shard_rows, ...) of the
    padded sum (padding rows are zero), r the index along `axis_name` + `copies`.
  """
  return keep_copy(scatter_rows(pad(x, fmt), axis_name), copies)


def scatter_blocks(x: jnp.ndarray, fmt, axis_name, block_axes) -> jnp.ndarray:
  """Per replica: its shard over `axis_name`, in `fmt`, of
  `psum_scatter(psum(x, axis_name), block_axes, scatter_dimension=0, tiled=True)`.

  HSDP's gradient (an FSDP weight replicated over the replica axes): x holds one
  block of rows per replica of `block_axes`. Each block is formatted as `fmt`, the
  sum over `axis_name` scatters this replica's rows of every block, then the sum
  over `block_axes` scatters the blocks: each element sums the same values in the
  same order as the all-reduce and the reduce-scatter it replaces.

  Args:
    x: shape [B * fmt.shape[0], *fmt.shape[1:]], B the replicas of `block_axes`.
    fmt: the format of one block (the reduce-scatter's result).
    axis_name: the replica axes.
    block_axes: other mesh axes.

  Returns:
    shape `fmt.shard_shape`, dtype of `x`.
  """
  blocks, n = num_replicas(block_axes), fmt.num_shards
  merged = jnp.reshape(x, (blocks, *fmt.merged_shape))
  extra = fmt.padded_shape[0] - fmt.merged_shape[0]
  if extra:
    merged = jnp.pad(merged, [(0, 0), (0, extra)] + [(0, 0)] * (len(fmt.merged_shape) - 1))
  rows = jnp.moveaxis(jnp.reshape(merged, (blocks, n, -1)), 1, 0)  # [N, B, shard].
  mine = scatter_rows(jnp.reshape(rows, (n, -1)), axis_name)  # [1, B * shard].
  summed = lax.psum_scatter(jnp.reshape(mine, (blocks, -1)), block_axes, scatter_dimension=0,
                            tiled=True)
  return jnp.reshape(summed, fmt.shard_shape)


def keep_copy(x: jnp.ndarray, copies) -> jnp.ndarray:
  """Per replica: row block c of `x` cut into C equal blocks, C the replicas of the
  mesh axes `copies` and c this replica's index along them (major first); `x` itself
  when `copies` is (). A local slice: `x` is the same on all of them.

  Args:
    x: leading dim C * k, C the replicas of `copies`; identical across them.

  Returns:
    shape [k, *x.shape[1:]], dtype of `x`.
  """
  if not copies:
    return x
  rows = x.shape[0] // num_replicas(copies)
  return lax.dynamic_slice_in_dim(x, _replica(copies) * rows, rows, axis=0,
                                  allow_negative_indices=False)


def num_replicas(axis_name) -> int:
  """The replicas along `axis_name` (a name, or a tuple of names); per replica."""
  names = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
  size = 1
  for a in names:
    size *= lax.axis_size(a)
  return size


def _axes(axis_name) -> tuple:
  """The mesh axes of `axis_name` with more than one replica, major first."""
  names = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
  return tuple(a for a in names if lax.axis_size(a) > 1)


def scatter_rows(x: jnp.ndarray, axis_name) -> jnp.ndarray:
  """Per replica: row block r of the sum of `x` over the replicas of `axis_name`.

  `lax.psum_scatter(x, axis_name, scatter_dimension=0, tiled=True)`, in
  phases over several mesh axes (§5.1): fastest (last) axis first.

  Args:
    x: leading dim N * k (N the replicas of `axis_name`), different on every replica.
    axis_name: a mesh axis name or a tuple of them, major first.

  Returns:
    shape [k, *x.shape[1:]], dtype of `x`: rows [r * k, (r + 1) * k) of the
    sum, r this replica's index along `axis_name` (major first).
  """
  axes = _axes(axis_name)
  if len(axes) <= 1:
    return lax.psum_scatter(x, axes or axis_name, scatter_dimension=0, tiled=True)
  sizes = [lax.axis_size(a) for a in axes]
  y = jnp.reshape(x, (*sizes, -1, *x.shape[1:]))
  for j in reversed(range(len(axes))):  # y: [n_0, ..., n_j, k, ...].
    y = lax.psum_scatter(jnp.moveaxis(y, j, 0), axes[j], scatter_dimension=0, tiled=True)[0]
  return y


def gather_rows(x: jnp.ndarray, axis_name, *, tiled: bool) -> jnp.ndarray:
  """Per replica: every replica's `x`, replica r's at row r (or row block r).

  `lax.all_gather(x, axis_name, axis=0, tiled=tiled, to="invarying")`, in
  phases over several mesh axes (§5.1): slowest (first) axis first, the
  reverse of `scatter_rows`.
  """
  axes = _axes(axis_name)
  if len(axes) <= 1:
    return lax.all_gather(x, axes or axis_name, axis=0, tiled=tiled, to="invarying")
  y = x
  for j, a in enumerate(axes):  # y: [n_0, ..., n_{j-1}, *x.shape].
    y = jnp.moveaxis(lax.all_gather(y, a, axis=0, to="invarying"), 0, j)
  return jnp.reshape(y, (-1, *x.shape[1:])) if tiled else jnp.reshape(y, (-1, *x.shape))


def all_gather(x: jnp.ndarray, fmt, axis_name) -> jnp.ndarray:
  """Per replica: the whole tensor from every replica's shard.

  Args:
    x: shape `fmt.shard_shape`.

  Returns:
    shape `fmt.shape`, dtype of `x`, identical on every replica.
  """
  return unpad(gather(x, axis_name, tiled=True), fmt)


def gather(x: jnp.ndarray, axis_name, *, tiled: bool) -> jnp.ndarray:
  """Per replica: `lax.all_gather(x, axis_name, axis=0, tiled=tiled)`, invariant.

  A narrow float moves as its bits: XLA may otherwise widen the transfer back
  to float32 (the CPU backend does, moving a convert across the collective),
  and the narrow gather of Fig. 7 would move float32 again.

  Args:
    x: any shape and dtype, this replica's part.
    axis_name: the replica axes (N replicas).
    tiled: concatenate the parts along dim 0 (shape [N * x.shape[0], ...])
      rather than stack them (shape [N, *x.shape]).

  Returns:
    Every replica's `x`, dtype of `x`, identical on every replica.
  """
  if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize < 4:
    bits = lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))
    return lax.bitcast_convert_type(gather(bits, axis_name, tiled=tiled), x.dtype)
  return gather_rows(x, axis_name, tiled=tiled)


def sum_of_copies(x: jnp.ndarray, num_replicas: int) -> jnp.ndarray:
  """Per replica: `psum(x)` for an `x` identical on every replica, with no communication.

  An all-reduce of N equal values is a local computation (DESIGN.md §5). Up
  to `_MAX_UNROLLED` replicas it is summed in rank order, in float32 for
  16-bit floats, as XLA's all-reduce sums on the CPU, so the result matches it
  bit for bit there; beyond that, and for integers, it is `x * N`, which
  differs only in rounding.

  Args:
    x: any shape and dtype.
    num_replicas: N, the number of replicas the all-reduce spans.

  Returns:
    same shape and dtype as `x`.
  """
  floating = jnp.issubdtype(x.dtype, jnp.inexact)
  if not floating or num_replicas > _MAX_UNROLLED:
    return x * jnp.asarray(num_replicas, x.dtype)
  wide = x.astype(jnp.promote_types(x.dtype, jnp.float32))
  acc = wide
  for _ in range(num_replicas - 1):
    acc = acc + wide
  return acc.astype(x.dtype)


_MAX_UNROLLED = 32
