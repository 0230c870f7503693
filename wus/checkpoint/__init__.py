"""Checkpoints of wus state with stock Orbax: saved in place at logical shapes, restored at any N.

Saving. `checkpointable(tree)` replaces every `wus.ShardedArray` by a
`LogicalView`: to Orbax, a `jax.Array` of the tensor's logical shape
(`format.shape`, unpadded). Orbax's `StandardCheckpointer` /
`ocp.args.StandardSave` save it like any array, through the handler Orbax
keeps for `jax.Array`, which wus wraps (`register`): a `LogicalView` is
written by `ArrayHandler` below, every other array by the handler it wraps.
On disk it is an ordinary zarr array of the logical shape, so code without
wus restores it as a whole array.

Each process writes only the shards its own devices hold (§4.1: replica r
holds merged rows [r * shard_rows, (r + 1) * shard_rows), which are the
row-major elements [r * E, (r + 1) * E) of the logical tensor, E =
`format.shard_size`), copied to the host as they are: nothing is gathered
and no program runs on the devices. A contiguous range of a row-major tensor
is in general not a box of its shape; it is a few boxes (`boxes`: the rest of
a partial first row, whole rows, the start of a last row, recursively), and
TensorStore writes and reads box by box. The array's chunks are boxes of the
form (1, ..., 1, c, d_{j+1}, ..., d_{n-1}) (`chunk_shape`), at most one shard
long, chosen so that no chunk spans the ranges of two processes: every
process writes whole chunks of its own, never a chunk another process writes
(on shapes where the ranges of two processes meet inside a row, chunks get
small; one process has no such constraint).

Restoring. `ShardedStep.state_target(*args)` gives the step's arguments as
abstract values: `jax.ShapeDtypeStruct`s with the step's shardings for what
the step reads whole, and `LogicalView`s without data (their `sharding` is a
`ShardedLayout`: the step's format, axes, spec, mesh and groups) for the state it
keeps sharded. `StandardCheckpointer().restore(path, target)` then reads, on
each process, the boxes of the ranges its devices hold for this step's
format (any replica count), pads them with zeros as the step's own sharding
program does, and returns `wus.ShardedArray`s the step accepts as they are.
The saved array may have been written by anything (a wus checkpoint at
another N, or whole arrays from plain `jax.shard_map` training).

Errors in reading a `LogicalView` (a tensor of another shape, a damaged or
missing file) are a one-line `CheckpointError` naming the array and the
checkpoint, and so are TensorStore's errors on the other arrays of the same
restore; restoring writes nothing.

Why so, and not otherwise:
  * Orbax cannot see a `ShardedArray` as a leaf: it flattens trees with
    `jax.tree` (a registered node is descended into, and `ShardedArray` must
    stay one to cross `jax.jit` boundaries), so the state is shown to it
    explicitly (`checkpointable`). `StandardCheckpointHandler` accepts only
    int, float, np.ndarray and jax.Array leaves, and Orbax picks a leaf's
    handler by the first registered type it is an instance of, so the view is
    a `jax.Array` subclass and its handler is the one for `jax.Array`, wrapped.
  * Re-laying the shards out as a standard GSPMD sharding of the logical
    shape (an all-to-all) and saving that with Orbax's own handler does not
    keep per-device bytes at the shard's: JAX 0.10 refuses shardings that do
    not divide a dimension evenly, so a [3,3,5,7] tensor over 8 devices has no
    even layout under 45 elements per device (40 is the shard), and [130] over
    8 none under 65 (17); it also costs a collective and a second copy of the
    state on the devices at every save.
  * Exchanging the few elements of a chunk that two processes share (a
    collective per save) would keep chunks large where process ranges meet
    inside a row; chunks shrink instead, since real shapes rarely do that.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import NamedSharding
from wus.checkpoint.boxes import boxes, chunk_shape
from wus.checkpoint.handler import ArrayHandler, register
from wus.checkpoint.views import LogicalView, ShardedLayout, StackedLayout
from wus.sharded import check_alive, is_sharded, unshard
from wus.transforms import programs

__all__ = ["ArrayHandler", "LogicalView", "ShardedLayout", "StackedLayout", "boxes",
           "checkpointable", "chunk_shape", "register", "restore_target",
           "stacked_target"]


def checkpointable(tree: Any) -> Any:
  """`tree` to save with stock Orbax: sharded state written in place at its logical shapes.

  Pass the result to `ocp.StandardCheckpointer().save` or `ocp.args.StandardSave`
  (e.g. in a `CheckpointManager`). Each `wus.ShardedArray` becomes a
  `wus.checkpoint.LogicalView`, which Orbax saves as an ordinary array of the
  tensor's logical (unpadded) shape, each process writing only the shards its
  own devices hold: nothing is gathered. Code without wus restores it as a
  whole array; `ShardedStep.state_target` restores it sharded, at any replica
  count. State a tensor-parallel step keeps split over data x model (its spec
  splits it over a model axis too) is saved whole instead, laid out by its spec
  (gathered over the replica axes first): `state_target` restores it whole on any
  mesh and the step shards it at its first call. Other leaves pass through
  unchanged. (Checkpoints are beyond the paper; the shards saved are §4.1's:
  replica r's range of the row-major tensor.) `wus.checkpointable` is this
  function (it imports Orbax when first used).

  Args:
    tree: any pytree (e.g. `{"params": params, "opt_state": opt_state}` as a
      wus step returned them).

  Returns:
    The same structure with every ShardedArray replaced by a LogicalView (or,
    split over other axes too, its whole array).

  Raises:
    TypeError: a ShardedArray holds a tracer (inside `jax.jit`).
    ValueError: a leaf's buffer was donated to an earlier call and is gone, or
      the tree holds only part of a bank of owned state (save the whole
      optimizer state together).
    ImportError: Orbax is not installed (`pip install orbax-checkpoint`).

  Example:
    >>> ckptr = ocp.StandardCheckpointer()  # doctest: +SKIP
    >>> state = {"params": params, "opt_state": opt_state}  # doctest: +SKIP
    >>> ckptr.save(path, wus.checkpointable(state))  # doctest: +SKIP
  """
  register()

  leaves = jax.tree.leaves(tree, is_leaf=is_sharded)
  banks = programs.banks([x.format if is_sharded(x) else None for x in leaves])
  members = {b: [leaves[k] for k in ks] for b, ks in banks.items()}  # Raises if one is missing.

  # State whose spec splits it over other axes too (tensor parallelism): saved whole, as
  # the step's spec lays it out (gathered over the replica axes, one program), so that
  # any mesh restores it (`restore_target`).
  split = [x for x in leaves if is_sharded(x) and x.layout.num_blocks > 1
           and not isinstance(x.data, jax.core.Tracer)]
  wholes = {id(x): w for x, w in zip(split, unshard(split), strict=True)}

  def view(path, x):
    check_alive(x, jax.tree_util.keystr(path), "wus.checkpointable")
    if not is_sharded(x):
      return x
    if isinstance(x.data, jax.core.Tracer):
      raise TypeError(f"{x!r} holds a tracer: checkpoints are saved outside jax.jit")
    if id(x) in wholes:
      return wholes[id(x)]
    return LogicalView(x.layout, x.dtype, x, members.get(getattr(x.format, "bank", None)))

  return jax.tree_util.tree_map_with_path(view, tree, is_leaf=is_sharded)


def stacked_target(target: jax.ShapeDtypeStruct, axis: int) -> LogicalView:
  """The restore target of a whole tensor a `wus.pmap` step reads as stacked copies.

  Args:
    target: the stacked tensor as the step reads it (shape with the mapped
      axis, dtype, and its sharding over the step's devices).
    axis: the mapped axis of `target` the copies are stacked along.

  Returns:
    A `LogicalView` of the saved (unreplicated) shape, `target.shape` without
    `axis`: restored from a checkpoint of one copy, it is put on every device
    stacked along `axis`, as `flax.jax_utils.replicate` would.
  """
  register()
  shape = tuple(d for k, d in enumerate(target.shape) if k != axis)
  return LogicalView(StackedLayout(shape, axis, target.sharding), target.dtype)


def restore_target(layout: ShardedLayout, dtype) -> LogicalView | jax.ShapeDtypeStruct:
  """The restore target of one tensor a step keeps sharded in `layout`.

  `ShardedStep.state_target` makes one for each tensor a step keeps sharded. A
  tensor its spec splits over other axes too (tensor parallelism,
  `ShardedLayout.split_axes`) is saved whole (`checkpointable`) and restored
  whole, laid out by the spec: the step shards it at its first call.

  Args:
    layout: the step's layout of the tensor: its format (§4.1: logical shape,
      merged dims, N), replica axes, spec, mesh and sharding groups (§5.2).
    dtype: the tensor's dtype.

  Returns:
    A `LogicalView` without data, of the logical shape `layout.format.shape`:
    Orbax restores it as a `wus.ShardedArray` in `layout`, each process
    reading only the elements its devices hold, from a checkpoint saved at
    any replica count (or of a whole array). For a tensor split over other
    axes too, a `jax.ShapeDtypeStruct` of the whole tensor with the spec's
    `NamedSharding`.
  """
  register()
  if layout.num_blocks > 1:
    return jax.ShapeDtypeStruct(layout.shape, dtype,
                                sharding=NamedSharding(layout.user_mesh, layout.user_spec))
  return LogicalView(layout, dtype)
