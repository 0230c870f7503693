"""Checkpoints with Orbax: sharded state saved in place, restored at any device count.

A checkpoint holds the training state (params, model state such as batch-norm
averages, optimizer state) and a JSON record of what it is: the model and
optimizer it belongs to (`identity`) and the sharding format of every tensor
that was saved sharded.

Saving. A `wus.ShardedArray`'s `.data` is the tensor's logical elements in
row-major order as `merged_shape` rows, followed by fewer than N rows of
padding (§4.1), laid out across the mesh. It is saved in its logical,
unpadded size: an array of shape `merged_shape` on disk, which each process
writes from the rows its own devices hold, clipped at `merged_shape[0]`
(`_LogicalRowsHandler`), so nothing is gathered, on one process or several.
A jax.Array cannot hold those rows itself (it must split evenly over the
devices), hence the handler. The record keeps the logical `shape` and
`merged_shape`. Whole arrays are saved as they are.

Restoring. Each saved-sharded tensor is read back as its `merged_shape` array
and reshaped to its logical shape. All state comes back whole and replicated
on the new mesh, as a freshly initialized run's state is, whatever the device
count it was saved from; the step shards it again for its own N on its first
call.

Damage. Before a run trains, `check` reads the latest checkpoint's record,
the tree metadata and every array (`_read_arrays`, with TensorStore directly,
one array at a time), so that a truncated or corrupted file is reported as a
one-line `errors.InputError` naming the checkpoint and what to do, before any
mode trains or writes. `Checkpointer.restore` reads a checkpoint the same way
first unless `check` already did in this process. Reading changes nothing on
disk.

Atomicity. Orbax's CheckpointManager writes a step into a temporary folder
(`<step>.orbax-checkpoint-tmp-<time>`) and renames it when complete, so a
process killed during a save leaves the previous checkpoints as they were and
the unfinished one is never restored (a later run deletes it before its first
save).
"""

from __future__ import annotations

import asyncio
import json
import pathlib
from typing import Any

import flax.serialization
import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from jax.sharding import NamedSharding

import wus
from wus.harness import errors


class _LogicalRows:
  """A `wus.ShardedArray`'s `.data`, to be saved as its first `rows` rows only."""

  __slots__ = ("data", "rows")

  def __init__(self, data: jax.Array, rows: int):
    self.data, self.rows = data, rows


class _LogicalRowsHandler(ocp.type_handlers.ArrayHandler):
  """Saves a `_LogicalRows` as an array of shape `(rows, *data.shape[1:])`.

  Each process writes the rows of its own devices' shards that lie below
  `rows`, into the chunks (one per shard) of one zarr array, as Orbax's
  ArrayHandler writes a jax.Array's shards; it reads back as a jax.Array.
  """

  async def serialize(self, values, infos, args=None):
    del args  # no per-array save options are used
    # Copied off the devices now: the caller may reuse (donate) the arrays.
    pieces = [self._own_rows(v) for v in values]
    return [ocp.future.CommitFutureAwaitingContractedSignals(
        self._write(values, infos, pieces), name="logical_rows")]

  @staticmethod
  def _own_rows(value: _LogicalRows) -> list[tuple[int, np.ndarray]]:
    """(first row, rows below `value.rows`) of each shard on this process, on the host."""
    own = []
    for shard in value.data.addressable_shards:
      start = shard.index[0].start or 0
      if shard.replica_id == 0 and start < value.rows:
        own.append((start, np.asarray(shard.data)[:value.rows - start]))
    return own

  @staticmethod
  async def _write(values, infos, pieces) -> None:
    for value, info, own in zip(values, infos, pieces, strict=True):
      await info.await_path_creation()
      data = value.data
      spec = ts.Spec(ocp.type_handlers.get_json_tspec_write(
          info, use_ocdbt=info.is_ocdbt_checkpoint, global_shape=(value.rows, *data.shape[1:]),
          local_shape=data.sharding.shard_shape(data.shape), dtype=data.dtype,
          process_index=jax.process_index() if info.is_ocdbt_checkpoint else None))
      if jax.process_index() == 0:  # creates the array, as Orbax's primary host does
        await ts.open(spec, create=True, open=True, context=info.ts_context)
      store = await ts.open(spec, open=True, assume_metadata=True, context=info.ts_context)
      await asyncio.gather(*(store[start:start + len(rows)].write(rows) for start, rows in own))


def _type_handlers() -> ocp.type_handlers.TypeHandlerRegistry:
  """Orbax's standard type handlers and `_LogicalRowsHandler`.

  Neither array handler writes a sharding file (every restore names its
  sharding) nor Orbax's per-array metadata (which knows no `_LogicalRows`).
  `_LogicalRows` comes first, so that the type name "jax.Array" they share
  reads back with the plain ArrayHandler.
  """
  handlers = {t: ocp.type_handlers.get_type_handler(t)
              for t in ocp.type_handlers.supported_types()}
  handlers[jax.Array] = ocp.type_handlers.ArrayHandler(enable_write_sharding_file=False)
  return ocp.type_handlers.create_type_handler_registry(
      (_LogicalRows, _LogicalRowsHandler(enable_write_sharding_file=False)), *handlers.items())


def _manager(directory: pathlib.Path, **options) -> ocp.CheckpointManager:
  return ocp.CheckpointManager(
      directory.absolute(), options=ocp.CheckpointManagerOptions(**options),
      item_handlers={"state": ocp.PyTreeCheckpointHandler(type_handler_registry=_type_handlers()),
                     "meta": ocp.JsonCheckpointHandler()})


def _read_meta(manager: ocp.CheckpointManager, directory: pathlib.Path, step: int) -> dict:
  """The JSON record {"identity", "formats"} of checkpoint `step`.

  Raises:
    errors.InputError: it is missing or unreadable.
  """
  try:
    meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
  except (KeyError, ValueError, OSError) as e:  # no meta item; not JSON; no file
    meta = repr(e)
  if not (isinstance(meta, dict) and isinstance(meta.get("identity"), dict) and
          isinstance(meta.get("formats"), dict)):
    raise errors.InputError(
        f"the checkpoint at step {step} in {directory} has no readable record of its model "
        f"and optimizer (meta: {meta}); it is damaged or was not written by wus-train: move "
        "it away to resume from an earlier one, or use another --output_dir")
  return meta


def _brief(error: BaseException) -> str:
  """The first line of `error`'s message without TensorStore's spec dump, at most 300 chars."""
  text = (str(error).strip().splitlines() or [type(error).__name__])[0]
  text = text.split(" [tensorstore_spec")[0].split(" [source locations")[0]
  return text if len(text) <= 300 else text[:297] + "..."


def _unreadable(directory: pathlib.Path, step: int, error: BaseException) -> errors.InputError:
  # TensorStore names files by absolute path: shown relative to the step's folder.
  detail = _brief(error).replace(f"{directory.absolute() / str(step)}/", "")
  return errors.InputError(
      f"the checkpoint at step {step} in {directory} is unreadable ({detail}); it is "
      f"damaged: delete {directory / str(step)} to resume from the checkpoint before it (or "
      "from scratch if none), or use another --output_dir")


def _read_arrays(item: pathlib.Path) -> int:
  """Reads every array of an Orbax PyTree item folder (e.g. `<step>/state`) and discards it.

  The arrays are zarr arrays in one OCDBT database (Orbax's default) or, without
  `manifest.ocdbt`, in sub-folders. They are read with TensorStore's
  synchronous calls, one at a time, so that a failure leaves no read pending
  (Orbax's own restore, on an error, closes its event loop under reads still
  in flight). Writes nothing.

  Returns:
    The names of the arrays read.

  Raises:
    Exception: whatever TensorStore raises for an unreadable file (ValueError
      with a status such as DATA_LOSS or OUT_OF_RANGE).
  """
  base = {"driver": "file", "path": f"{item.absolute()}/"}
  kvstore = {"driver": "ocdbt", "base": base} if (item / "manifest.ocdbt").exists() else base
  keys = [k.decode() for k in ts.KvStore.open(kvstore).result().list().result()]
  drivers = {"/.zarray": "zarr", "/zarr.json": "zarr3"}
  arrays = [(k[:-len(suffix)], driver) for k in keys for suffix, driver in drivers.items()
            if k.endswith(suffix)]
  for path, driver in sorted(arrays):
    store = ts.open({"driver": driver, "kvstore": {**kvstore, "path": f"{path}/"}},
                    open=True, read=True).result()
    store.read().result()
  return {path for path, _ in arrays}


# (folder, step) of the checkpoints `_check_readable` read whole in this process.
_READABLE: set[tuple[pathlib.Path, int]] = set()


def _check_readable(manager: ocp.CheckpointManager, directory: pathlib.Path, step: int) -> None:
  """Reads every array and the tree metadata of checkpoint `step`; checks that every
  array of the tree has data.

  Raises:
    errors.InputError: something is missing or unreadable.
  """
  try:
    # Arrays first: Orbax's metadata reads the arrays' zarr metadata too, and
    # on an error leaves reads pending on a closed event loop (tracebacks at exit).
    names = _read_arrays(directory / str(step) / "state")
    tree = manager.item_metadata(step)["state"]
    missing = sorted(name for leaf in jax.tree.leaves(getattr(tree, "tree", tree))
                     if (name := getattr(leaf, "name", None)) and name not in names)
    if missing:
      raise ValueError(f"no data for {len(missing)} of its arrays, e.g. {missing[0]}")
  except Exception as e:  # noqa: BLE001 -- TensorStore, JSON and Orbax errors alike
    raise _unreadable(directory, step, e) from e
  _READABLE.add((directory.absolute(), step))


def check(directory: pathlib.Path, identity: dict, *, read_arrays: bool = True) -> dict:
  """Checks that the latest checkpoint in `directory`, if any, is of `identity` and readable.

  Changes nothing on disk. Every process must call it (Orbax synchronizes
  processes when it opens a folder).

  Args:
    directory: the checkpoint folder (need not exist).
    identity: JSON-ready record of the model and optimizer.
    read_arrays: also read every array of the latest checkpoint, so that a
      damaged file is found now rather than when it is restored.

  Returns:
    `identity` as it reads back from JSON.

  Raises:
    errors.InputError: the latest checkpoint is of another identity, or its
      record, tree metadata or (with read_arrays) an array is missing or
      unreadable.
  """
  identity = json.loads(json.dumps(identity))
  with _manager(directory, create=False) as peek:
    step = peek.latest_step()
    saved = None if step is None else _read_meta(peek, directory, step)["identity"]
    if saved == identity and read_arrays:
      _check_readable(peek, directory, step)
  if saved is not None and saved != identity:
    diff = ", ".join(f"{k}: {saved.get(k)!r} here, {identity.get(k)!r} in this run"
                     for k in sorted(saved.keys() | identity.keys())
                     if saved.get(k) != identity.get(k))
    raise errors.InputError(
        f"the checkpoint at step {step} in {directory} is of another model or optimizer "
        f"({diff}); use another --output_dir, or the flags it was trained with")
  return identity


class Checkpointer:
  """Saves and restores training state in `directory` (one sub-folder per step).

  Args:
    directory: the checkpoint folder, created if missing.
    identity: JSON-ready record of the model and optimizer; a checkpoint whose
      identity differs is refused.
    max_to_keep: how many of the latest checkpoints to keep.

  Raises:
    errors.InputError: the latest checkpoint in `directory` is of another
      identity or has no readable record (`check`). Nothing in `directory`
      has been changed then.
  """

  def __init__(self, directory: pathlib.Path, identity: dict, *, max_to_keep: int):
    # Look before writing anything, with a manager that changes nothing. The
    # arrays are read when restored (`restore` reports damage as `check` does).
    self._identity = check(directory, identity, read_arrays=False)
    self._directory = directory
    self._manager = _manager(directory, max_to_keep=max_to_keep, create=True,
                             cleanup_tmp_directories=True)

  def latest_step(self) -> int | None:
    """The step of the newest complete checkpoint, or None."""
    return self._manager.latest_step()

  def save(self, step: int, state: Any) -> None:
    """Starts saving `state` (a pytree; may hold wus.ShardedArray) as `step`.

    Returns once the arrays are copied off the devices; Orbax writes them in
    the background. Every process must call it.
    """
    formats = {}

    def unwrap(path, x):
      if isinstance(x, wus.ShardedArray):
        formats[jax.tree_util.keystr(path)] = {"shape": x.format.shape,
                                               "merged_shape": x.format.merged_shape}
        return _LogicalRows(x.data, x.format.merged_shape[0])
      return x

    arrays = jax.tree_util.tree_map_with_path(unwrap, flax.serialization.to_state_dict(state),
                                              is_leaf=lambda x: isinstance(x, wus.ShardedArray))
    self._manager.save(step, args=ocp.args.Composite(
        state=ocp.args.PyTreeSave(arrays),
        meta=ocp.args.JsonSave({"identity": self._identity, "formats": formats})))

  def restore(self, step: int, target: Any, sharding: NamedSharding) -> Any:
    """The state saved as `step`, whole, in the structure of `target`.

    Args:
      step: a step with a complete checkpoint.
      target: state of the same structure, shapes and dtypes, whole (e.g. a
        fresh initialization, or its `jax.eval_shape`).
      sharding: where to place every array (replicated on the mesh).

    Returns:
      `target`'s structure with the saved values as jax.Arrays of their logical
      shapes with `sharding`.

    Raises:
      errors.InputError: the checkpoint's tensors do not fit `target`, or its
        record or a file is missing or unreadable (damaged). Nothing on disk
        has been changed then.
    """
    formats = _read_meta(self._manager, self._directory, step)["formats"]
    if (self._directory.absolute(), step) not in _READABLE:  # unless `check` just read it
      _check_readable(self._manager, self._directory, step)
    template = flax.serialization.to_state_dict(target)

    def restore_args(path, x):
      fmt = formats.get(jax.tree_util.keystr(path))
      if fmt is not None and tuple(fmt["shape"]) != tuple(x.shape):
        raise errors.InputError(f"checkpoint step {step}: {jax.tree_util.keystr(path)} has "
                                f"shape {fmt['shape']}, this run expects {x.shape}")
      shape = tuple(fmt["merged_shape"]) if fmt else tuple(x.shape)
      return ocp.ArrayRestoreArgs(sharding=sharding, global_shape=shape, dtype=x.dtype)

    args = jax.tree_util.tree_map_with_path(restore_args, template)
    abstract = jax.tree.map(lambda x, a: jax.ShapeDtypeStruct(a.global_shape, x.dtype,
                                                              sharding=sharding), template, args)
    try:
      restored = self._manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.PyTreeRestore(abstract, restore_args=args)))["state"]
    except Exception as e:  # noqa: BLE001 -- Orbax and TensorStore raise many kinds
      # A tree structure or saved shapes other than `target`'s, or files damaged
      # since they were read.
      _check_readable(self._manager, self._directory, step)
      raise errors.InputError(f"the checkpoint at step {step} in {self._directory} does not "
                              f"fit this run: {_brief(e)}") from e
    whole = jax.tree.map(lambda x, t: x.reshape(t.shape), restored, template)
    return flax.serialization.from_state_dict(target, whole)

  def close(self) -> None:
    """Waits for the last save to finish."""
    self._manager.wait_until_finished()
    self._manager.close()
