"""Checkpoints with stock Orbax: sharded state saved in place, restored at any device count.

A checkpoint holds the training state (params, model state such as batch-norm
averages, optimizer state) as one Orbax `StandardCheckpointHandler` item, and a
JSON record of the model and optimizer it belongs to (`identity`).

Saving. The state goes through `wus.checkpointable`, so that Orbax writes each
`wus.ShardedArray` as an ordinary array of the tensor's logical shape, each
process writing only the shards its own devices hold (`wus.checkpoint`):
nothing is gathered, on one process or several. Whole arrays are saved as
Orbax saves them.

Restoring. `restore_target` gives the state as the run's step reads it
(`ShardedStep.state_target` in wus mode): Orbax then reads, on each process,
what its devices hold, and the optimizer state comes back sharded for this
run's N, whatever the device count it was saved from.

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

import json
import pathlib
from typing import Any

import flax.serialization
import jax
import orbax.checkpoint as ocp
import tensorstore as ts
from jax.sharding import NamedSharding

import wus
from wus.harness import errors


def _manager(directory: pathlib.Path, **options) -> ocp.CheckpointManager:
  return ocp.CheckpointManager(
      directory.absolute(), options=ocp.CheckpointManagerOptions(**options),
      item_handlers={"state": ocp.StandardCheckpointHandler(),
                     "meta": ocp.JsonCheckpointHandler()})


def restore_target(train_step, abstract_state: Any, batch: Any, sharding: NamedSharding) -> Any:
  """The state as `train_step` reads it, abstract: what `Checkpointer.restore` restores into.

  Args:
    train_step: the mapped step (`steps.map_train_step`): a `wus.ShardedStep`,
      or `jax.jit(jax.shard_map(...))`.
    abstract_state: a `steps.TrainState` of `jax.ShapeDtypeStruct`s (whole).
    batch: the step's batch argument (its shape and sharding are what matter).
    sharding: where the replicated step keeps its state: one NamedSharding
      (replicated on the mesh), or a tree of them shaped like `abstract_state`
      (weights split over a "model" axis).
  """
  if isinstance(train_step, wus.ShardedStep):
    return type(abstract_state)(*train_step.state_target(*abstract_state, batch)[:-1])
  if isinstance(sharding, NamedSharding):
    sharding = jax.tree.map(lambda _: sharding, abstract_state)
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      abstract_state, sharding)


def _read_meta(manager: ocp.CheckpointManager, directory: pathlib.Path, step: int) -> dict:
  """The JSON record {"identity"} of checkpoint `step`.

  Raises:
    errors.InputError: it is missing or unreadable.
  """
  try:
    meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
  except (KeyError, ValueError, OSError) as e:  # no meta item; not JSON; no file
    meta = repr(e)
  if not (isinstance(meta, dict) and isinstance(meta.get("identity"), dict)):
    raise errors.InputError(
        f"the checkpoint at step {step} in {directory} has no readable record of its model "
        f"and optimizer (meta: {meta}); it is damaged or was not written by wus-train: move "
        "it away to resume from an earlier one, or use another --output_dir")
  return meta


def _unreadable(directory: pathlib.Path, step: int, error: BaseException) -> errors.InputError:
  # TensorStore names files by absolute path: shown relative to the step's folder.
  detail = wus.errors.first_line(error).replace(f"{directory.absolute() / str(step)}/", "")
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


def saved_schedule(directory: pathlib.Path) -> tuple[int, dict] | None:
  """(step, schedule record) of the latest checkpoint in `directory`, or None if there is
  none or it has no schedule record (written before they were kept).

  Every process must call it (Orbax synchronizes processes when it opens a folder).

  Raises:
    errors.InputError: the latest checkpoint has no readable record.
  """
  with _manager(directory, create=False) as peek:
    step = peek.latest_step()
    if step is None:
      return None
    schedule = _read_meta(peek, directory, step).get("schedule")
  return None if schedule is None else (step, schedule)


class Checkpointer:
  """Saves and restores training state in `directory` (one sub-folder per step).

  Args:
    directory: the checkpoint folder, created if missing.
    identity: JSON-ready record of the model and optimizer; a checkpoint whose
      identity differs is refused.
    max_to_keep: how many of the latest checkpoints to keep.
    schedule: JSON-ready record of the optimizer's schedule (`RunConfig.schedule`),
      saved with every checkpoint, so that a resumed run continues it.

  Raises:
    errors.InputError: the latest checkpoint in `directory` is of another
      identity or has no readable record (`check`). Nothing in `directory`
      has been changed then.
  """

  def __init__(self, directory: pathlib.Path, identity: dict, *, max_to_keep: int,
               schedule: dict | None = None):
    # Look before writing anything, with a manager that changes nothing. The
    # arrays are read when restored (`restore` reports damage as `check` does).
    self._identity = check(directory, identity, read_arrays=False)
    self._directory, self._schedule = directory, schedule
    self._manager = _manager(directory, max_to_keep=max_to_keep, create=True,
                             cleanup_tmp_directories=True)

  @property
  def directory(self) -> pathlib.Path:
    return self._directory

  def latest_step(self) -> int | None:
    """The step of the newest complete checkpoint, or None."""
    return self._manager.latest_step()

  def save(self, step: int, state: Any) -> None:
    """Starts saving `state` (a pytree; may hold wus.ShardedArray) as `step`.

    Returns once the arrays are copied off the devices; Orbax writes them in
    the background. Every process must call it.
    """
    self._manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(wus.checkpointable(flax.serialization.to_state_dict(state))),
        meta=ocp.args.JsonSave({"identity": self._identity,
                                **({"schedule": self._schedule} if self._schedule else {})})))

  def restore(self, step: int, target: Any) -> Any:
    """The state saved as `step`, laid out as `target` says.

    Args:
      step: a step with a complete checkpoint.
      target: the state abstract, as the run's step reads it (`restore_target`):
        `jax.ShapeDtypeStruct`s with their shardings, and for sharded state
        the targets of `ShardedStep.state_target`.

    Returns:
      `target`'s structure with the saved values: jax.Arrays, and
      `wus.ShardedArray`s sharded for this run's step.

    Raises:
      errors.InputError: the checkpoint's tensors do not fit `target`, or its
        record or a file is missing or unreadable (damaged). Nothing on disk
        has been changed then.
    """
    _read_meta(self._manager, self._directory, step)
    if (self._directory.absolute(), step) not in _READABLE:  # unless `check` just read it
      _check_readable(self._manager, self._directory, step)
    template = flax.serialization.to_state_dict(target)
    try:
      tree = self._manager.item_metadata(step)["state"]
    except Exception as e:  # noqa: BLE001 -- damaged since `check` read it
      raise _unreadable(self._directory, step, e) from e
    saved = {jax.tree_util.keystr(k): tuple(v.shape) for k, v in
             jax.tree_util.tree_flatten_with_path(getattr(tree, "tree", tree))[0]
             if hasattr(v, "shape")}
    for path, x in jax.tree_util.tree_flatten_with_path(template)[0]:
      name = jax.tree_util.keystr(path)
      if name in saved and saved[name] != tuple(x.shape):
        raise errors.InputError(f"checkpoint step {step}: {name} has shape {list(saved[name])}, "
                                f"this run expects {tuple(x.shape)}")
    try:
      restored = self._manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(template)))["state"]
    except Exception as e:  # noqa: BLE001 -- Orbax and TensorStore raise many kinds
      # A tree structure or saved shapes other than `target`'s, or files damaged
      # since they were read.
      _check_readable(self._manager, self._directory, step)
      raise errors.InputError(f"the checkpoint at step {step} in {self._directory} does not "
                              f"fit this run: {wus.errors.first_line(e)}") from e
    return flax.serialization.from_state_dict(target, restored)

  def close(self) -> None:
    """Waits for the last save to finish."""
    self._manager.wait_until_finished()
    self._manager.close()
