"""Batched collectives: many small tensors in one collective (§5.2, Fig. 10).

Which tensors share a collective (`buckets`): tensors of one dtype fill
buckets of at most `bucket_bytes` (of whole tensors), in order. Batching
saves a collective's latency per tensor but copies the tensor: into the
bucket's buffer before a reduce-scatter (a concatenate) and out of the
gathered buffer after an all-gather (a slice). A tensor alone reads and
writes its own buffers, with no copy. So a tensor of `alone_bytes` or more
(and every tensor of `bucket_bytes` or more) has a collective of its own,
unless its format pads it: a padded tensor is copied either way (`pad`,
`unpad`), so it stays batched while it fits a bucket. The cost model picks
both limits (`wus.analysis.cost.bucket_bytes`); with `alone_bytes=None`
every tensor under `bucket_bytes` is batched.

In a reduce-scatter, a tensor with a collective of its own also closes the
bucket before it (`closes`): a bucket's collective runs when its last
member's gradient exists, so a bucket spanning a tensor alone (in the order
given, the gradients' sums', in a model of layers the layers') would hold
its first members until the backward pass of the tensors between them is
done, and one bucket of the small tensors of every layer puts their update
after the whole backward pass. An all-gather's bucket spans them: every new
weight exists once the update has run, so closing would only add
collectives. (Issue 42, in one process, 25 rounds each: on an MLP of 5
kernels of 4 MiB and 7 small tensors, the step with the reduce-scatters'
buckets spanning the kernels took 1.14-1.15x as long as with them closed,
on a 100-tensor Transformer-like model 0.93-1.02x, within its runs'
spread; with the all-gathers' buckets closed, 0.99-1.03x and 1.01-1.02x as
long as spanning: `tests/repro/wus_beside_handwritten.py`.) The cost model
prices a tensor alone as if it split no bucket (`sizing.choose_batching`).

XLA fuses the cut of each tensor out of a bucket's result into the
tensor's update. At a constant offset, every batched tensor's update would
be a distinct fused computation, which XLA:CPU compiles into a kernel of its
own (1.9x the replicated step's compile time on a 100-tensor Transformer);
so the offsets are read from a buffer XLA cannot fold (`order.opaque`) and
the updates of tensors of equal shapes share a kernel, as they do when each
has its own collective (1.04x in wus-bench; the step as fast, issue 22).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import jax.numpy as jnp
from jax import lax

from wus.collectives import formatted, order

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
  return [jnp.reshape(part, v.shape) for part, v in zip(_cut(out, [v.size for v in values]),
                                                         values)]


def all_reduce_bucketed(values: Sequence[jnp.ndarray], axis_name,
                        bucket_bytes: int, keys: Sequence | None = None) -> list[jnp.ndarray]:
  """Per replica: psum of many tensors in few collectives (§5.2, Fig. 10).

  Tensors of one dtype share an all-reduce, in buckets of at most
  `bucket_bytes`; larger ones keep their own. Partial sharding all-reduces
  the gradient shards across the sharding groups with it.

  Args:
    values: tensors, any shapes and dtypes.
    axis_name: the mesh axes to sum over.
    bucket_bytes: bytes per bucket (`buckets`).
    keys: see `reduce_scatter`.

  Returns:
    The sums, shapes and dtypes as given.
  """
  def one(ks):
    vs = [values[k] for k in ks]
    return [lax.psum(vs[0], axis_name)] if len(vs) == 1 else all_reduce(vs, "sum", axis_name)
  return _bucketed(one, values, [None] * len(values), bucket_bytes,
                   elements=[v.size for v in values], keys=keys)


def has_own(size: int, limit: int, alone_bytes: int | None = None,
            padded: bool = False) -> bool:
  """Whether a tensor of `size` bytes gets a collective of its own (`buckets`' rule)."""
  alone = limit if alone_bytes is None else min(alone_bytes, limit)
  return size >= limit or (size >= alone and not padded)


def buckets(sizes: Sequence[int], limit: int, alone_bytes: int | None = None,
            padded: Sequence[bool] = (), closes: bool = True) -> list[list[int]]:
  """Groups positions 0..len(sizes)-1 into buckets of at most `limit` bytes.

  The rule of the module docstring. The Plan's limits are chosen by the cost
  model (`wus.analysis.cost.bucket_bytes`).

  Args:
    sizes: bytes of each tensor.
    limit: bytes per bucket.
    alone_bytes: tensors of this many bytes or more that are not `padded`
      get a bucket of their own (no copy); None: `limit`.
    padded: per tensor, whether it is copied whether batched or not (its
      format pads it); missing entries are False.
    closes: whether a tensor with a bucket of its own closes the bucket
      before it (the reduce-scatters'), or the bucket spans it (the
      all-gathers'; module docstring).

  Returns:
    Lists of positions, each in increasing order, every position in exactly
    one. Tensors of `limit` bytes or more, and unpadded ones of
    `alone_bytes` or more, get a bucket of their own (and, with `closes`,
    close the bucket before them); the others fill buckets in order.
  """
  out: list[list[int]] = []
  current: list[int] = []
  total = 0
  for k, size in enumerate(sizes):
    if has_own(size, limit, alone_bytes, k < len(padded) and padded[k]):
      if closes and current:
        out.append(current)
        current, total = [], 0
      out.append([k])
      continue
    if current and total + size > limit:
      out.append(current)
      current, total = [], 0
    current.append(k)
    total += size
  return out + [current] if current else out


def reduce_scatter(values: Sequence[jnp.ndarray], fmts: Sequence, axis_name,
                   bucket_bytes: int, alone_bytes: int | None = None,
                   keys: Sequence | None = None, copies=()) -> list[jnp.ndarray]:
  """Per replica: `formatted.reduce_scatter` of many tensors in few collectives.

  Tensors of one dtype share a collective, in buckets of `bucket_bytes`
  (`buckets`; with `alone_bytes`, large unpadded tensors keep their own and
  are not copied). In a shared one, each padded tensor is viewed as [N, its
  shard's elements] (replica r's rows are row r), the views are
  concatenated along the second dim and reduce-scattered over the first, so
  that this replica's part of the result holds its shard of every tensor
  (§5.2, Fig. 10). Every element sums the same values in the same order as
  the single-tensor collective.

  Args:
    values: tensors of shapes `fmt.shape`, different on every replica.
    fmts: a `ShardFormat` per tensor, all with the same `num_shards` (N).
    axis_name: the replica axes.
    bucket_bytes: bytes of whole tensors per bucket (`buckets`).
    alone_bytes: see `buckets`.
    keys: a hashable per tensor, or None: tensors of different keys never
      share a bucket. The callers pass the mesh axes each value varies over
      (`check_vma`): a bucket's result varies over all its tensors' axes, so a
      replicated LayerNorm scale batched with a weight split over a model axis
      would come back typed as varying over it.
    copies: see `formatted.reduce_scatter`; the formats' N counts their replicas too.

  Returns:
    One shard per tensor: shape `fmt.shard_shape`, dtype of its value.
  """
  c = formatted.num_replicas(copies) if copies else 1

  def one(ks):
    xs, fs = [values[k] for k in ks], [fmts[k] for k in ks]
    if len(ks) == 1:
      return [formatted.reduce_scatter(xs[0], fs[0], axis_name, copies)]
    rows = [formatted.reshape(formatted.pad(x, f), (f.num_shards // c, -1))
            for x, f in zip(xs, fs)]
    mine = formatted.scatter_rows(_concatenate(rows, axis=1), axis_name)[0]
    return [formatted.reshape(formatted.keep_copy(formatted.reshape(part, (c, -1)), copies),
                              f.shard_shape)
            for part, f in zip(_cut(mine, [c * math.prod(f.shard_shape) for f in fs]), fs)]
  return _bucketed(one, values, fmts, bucket_bytes, alone_bytes, keys=keys)


def all_gather(shards: Sequence[jnp.ndarray], fmts: Sequence, axis_name,
               bucket_bytes: int, alone_bytes: int | None = None,
               keys: Sequence | None = None, after: Sequence[Sequence] | None = None
               ) -> list[jnp.ndarray]:
  """Per replica: `formatted.all_gather` of many shards in few collectives.

  Shards of one dtype share a collective, in buckets of `bucket_bytes` (of
  whole tensors, `buckets`, spanning the tensors alone); each replica contributes its shards
  concatenated (§5.2), and each tensor is cut out of the result.

  Args:
    shards: shapes `fmt.shard_shape`.
    fmts: a `ShardFormat` per shard, all with the same `num_shards` (N).
    axis_name: the replica axes.
    bucket_bytes: bytes of whole tensors per bucket (`buckets`).
    alone_bytes: see `buckets`.
    keys: see `reduce_scatter`.
    after: per shard, arrays its all-gather follows, or None: each collective's
      operand is ORed with a zero computed from those of its shards
      (`order.zero_after`, `order.tied`); one tie per collective, not per shard,
      and one zero per distinct set of arrays.

  Returns:
    The whole tensors: shapes `fmt.shape`, dtypes of the shards, identical on
    every replica.
  """
  zeros: dict = {}

  def zero(ks):
    tokens = {id(t): t for k in ks for t in (after[k] if after else ())}
    if (key := frozenset(tokens)) not in zeros:
      zeros[key] = order.zero_after(list(tokens.values())) if tokens else None
    return zeros[key]

  def one(ks):
    parts, fs = [shards[k] for k in ks], [fmts[k] for k in ks]
    if len(ks) == 1:
      return [formatted.all_gather(order.tied(parts[0], zero(ks)), fs[0], axis_name)]
    flat = order.tied(_concatenate([formatted.reshape(s, (-1,)) for s in parts]), zero(ks))
    every = formatted.gather(flat, axis_name, tiled=False)  # [N, total]: replica r's in row r.
    return [formatted.unpad(formatted.reshape(part, f.padded_shape), f) for part, f in
            zip(_cut(every, [math.prod(f.shard_shape) for f in fs], axis=1), fs)]
  return _bucketed(one, shards, fmts, bucket_bytes, alone_bytes, keys=keys, closes=False)


def grouped(keys: Sequence, collective, *columns: Sequence) -> list:
  """Per replica: `collective(key, *columns)` once per distinct key (in order of first
  appearance) on the entries of that key; the results in the order given.

  The rewrite runs the collectives of tensors sharded over different mesh axes apart
  (a cluster sharded over the replica axes alone, one sharded over `copies` too).

  Args:
    keys: a hashable per entry.
    collective: (key, one list per column) -> one result per entry.
    columns: lists as long as `keys`.
  """
  out: list = [None] * len(keys)
  for key in dict.fromkeys(keys):
    ks = [k for k, x in enumerate(keys) if x == key]
    for k, y in zip(ks, collective(key, *([col[k] for k in ks] for col in columns)),
                    strict=True):
      out[k] = y
  return out


def dtype_buckets(dtypes: Sequence, sizes: Sequence[int], limit: int,
                  alone_bytes: int | None = None, padded: Sequence[bool] = (),
                  closes: bool = True) -> list[list[int]]:
  """Positions of tensors grouped as the batched collectives group them: by
  dtype (in order of first appearance), then into `buckets` of their bytes.

  `len(dtype_buckets(...))` is the number of collectives a batched call makes.

  Args:
    dtypes: a dtype per tensor.
    sizes: bytes per tensor.
    limit, alone_bytes, padded, closes: as for `buckets`.
  """
  by_dtype: dict = {}
  for k, dtype in enumerate(dtypes):
    by_dtype.setdefault(dtype, []).append(k)
  return [[ks[b] for b in bucket] for ks in by_dtype.values()
          for bucket in buckets([sizes[k] for k in ks], limit, alone_bytes,
                                [k < len(padded) and padded[k] for k in ks], closes)]


def pads(fmts: Sequence) -> list[bool]:
  """Per format, whether it pads its tensor (which is then copied whether batched or not)."""
  return [f is not None and f.padding > 0 for f in fmts]


def _bucketed(collective, values: Sequence[jnp.ndarray], fmts: Sequence, limit: int,
              alone_bytes: int | None = None, elements: Sequence[int] | None = None,
              keys: Sequence | None = None, closes: bool = True) -> list[jnp.ndarray]:
  """`collective(positions)` per bucket of one dtype and key (the bucket's positions in
  `values`, increasing), which returns one result per position; results in the order given.

  Buckets are sized by the whole tensors (`fmt.shape`), or by `elements`."""
  sizes = [(math.prod(fmts[k].shape) if elements is None else elements[k]) * x.dtype.itemsize
           for k, x in enumerate(values)]
  out: list = [None] * len(values)
  kinds = [x.dtype if keys is None else (x.dtype, keys[k]) for k, x in enumerate(values)]
  for group in dtype_buckets(kinds, sizes, limit, alone_bytes, pads(fmts), closes):
    for k, y in zip(group, collective(group), strict=True):
      out[k] = y
  return out


def _concatenate(values: Sequence[jnp.ndarray], axis: int = 0) -> jnp.ndarray:
  """`jnp.concatenate` of values of one dtype, staged as `lax.concatenate`."""
  return lax.concatenate(list(values), axis)


def _cut(x: jnp.ndarray, sizes: Sequence[int], axis: int = 0) -> list[jnp.ndarray]:
  """`x` cut along `axis` into consecutive parts of `sizes`."""
  starts = [0, *itertools.accumulate(sizes)]
  offsets = order.opaque(starts[:-1], x) if len(sizes) > 1 else None
  if offsets is None:
    return [lax.slice_in_dim(x, a, b, axis=axis) for a, b in zip(starts, starts[1:])]
  return [lax.dynamic_slice_in_dim(x, o, b - a, axis=axis, allow_negative_indices=False)
          for o, a, b in zip(offsets, starts[:-1], starts[1:], strict=True)]
