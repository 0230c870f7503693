"""Checkpoints with Orbax: sharded state saved in place, restored at any device count.

A checkpoint holds the training state (params, model state such as batch-norm
averages, optimizer state) and a JSON record of what it is: the model and
optimizer it belongs to (`identity`) and the sharding format of every tensor
that was saved sharded.

Saving. A `wus.ShardedArray` is saved as its `.data`, the global array that
wus keeps laid out across the mesh: Orbax writes each device's rows from the
process that holds them, so nothing is gathered, on one process or several.
`.data` is the tensor's logical elements in row-major order (its `merged_shape`
rows) followed by fewer than N rows of padding (§4.1); the record keeps the
logical `shape` and `merged_shape`. Whole arrays are saved as they are.

Restoring. Each saved-sharded tensor is read back as exactly its logical
elements, with Orbax truncating the padding rows (`ArrayRestoreArgs` with the
unpadded `global_shape`), and reshaped to its logical shape. All state comes
back whole and replicated on the new mesh, as a freshly initialized run's
state is, whatever the device count it was saved from; the step shards it
again for its own N on its first call. The padding, whose size depends on N,
is never read.

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
from jax.sharding import NamedSharding

import wus
from wus.harness import errors

_ITEMS = {"state": ocp.PyTreeCheckpointHandler, "meta": ocp.JsonCheckpointHandler}


def _manager(directory: pathlib.Path, **options) -> ocp.CheckpointManager:
  return ocp.CheckpointManager(directory.absolute(),
                               options=ocp.CheckpointManagerOptions(**options),
                               item_handlers={k: h() for k, h in _ITEMS.items()})


class Checkpointer:
  """Saves and restores training state in `directory` (one sub-folder per step).

  Args:
    directory: the checkpoint folder, created if missing.
    identity: JSON-ready record of the model and optimizer; a checkpoint whose
      identity differs is refused.
    max_to_keep: how many of the latest checkpoints to keep.

  Raises:
    errors.InputError: `directory` holds a checkpoint of another identity.
      Nothing in `directory` has been changed then.
  """

  def __init__(self, directory: pathlib.Path, identity: dict, *, max_to_keep: int):
    self._identity = json.loads(json.dumps(identity))  # as it reads back from JSON
    # Look before writing anything: this manager changes nothing. Every process
    # opens it (Orbax synchronizes processes in the constructor), whether or not
    # another process has already created `directory`.
    with _manager(directory, create=False) as peek:
      step = peek.latest_step()
      if step is not None:
        self._check(directory, step, self._meta(peek, step)["identity"])
    self._manager = _manager(directory, max_to_keep=max_to_keep, create=True,
                             cleanup_tmp_directories=True)

  def _check(self, directory: pathlib.Path, step: int, saved: dict) -> None:
    if saved != self._identity:
      diff = ", ".join(f"{k}: {saved.get(k)!r} here, {self._identity.get(k)!r} in this run"
                       for k in sorted(saved.keys() | self._identity.keys())
                       if saved.get(k) != self._identity.get(k))
      raise errors.InputError(
          f"the checkpoint at step {step} in {directory} is of another model or optimizer "
          f"({diff}); use another --output_dir, or the flags it was trained with")

  @staticmethod
  def _meta(manager: ocp.CheckpointManager, step: int) -> dict:
    return manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

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
        return x.data
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
      errors.InputError: the checkpoint's tensors do not fit `target`.
    """
    formats = self._meta(self._manager, step)["formats"]
    template = flax.serialization.to_state_dict(target)

    def restore_args(path, x):
      fmt = formats.get(jax.tree_util.keystr(path))
      if fmt is not None and tuple(fmt["shape"]) != tuple(x.shape):
        raise errors.InputError(f"checkpoint step {step}: {jax.tree_util.keystr(path)} has "
                                f"shape {fmt['shape']}, this run expects {x.shape}")
      shape = tuple(fmt["merged_shape"]) if fmt else tuple(x.shape)
      return ocp.ArrayRestoreArgs(sharding=sharding, global_shape=shape, dtype=x.dtype,
                                  strict=fmt is None)

    args = jax.tree_util.tree_map_with_path(restore_args, template)
    abstract = jax.tree.map(lambda x, a: jax.ShapeDtypeStruct(a.global_shape, x.dtype,
                                                              sharding=sharding), template, args)
    try:
      restored = self._manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.PyTreeRestore(abstract, restore_args=args)))["state"]
    except ValueError as e:  # Orbax: tree structure or saved shapes differ
      raise errors.InputError(f"checkpoint step {step} does not fit this run: {e}") from e
    whole = jax.tree.map(lambda x, t: x.reshape(t.shape), restored, template)
    return flax.serialization.from_state_dict(target, whole)

  def close(self) -> None:
    """Waits for the last save to finish."""
    self._manager.wait_until_finished()
    self._manager.close()
