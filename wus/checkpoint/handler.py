"""The Orbax handler for `LogicalView`s: each process writes and reads its own shards.

The only module of wus that touches Orbax internals (`_orbax_ts_utils`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint._src.serialization import tensorstore_utils as _orbax_ts_utils
import tensorstore as ts
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from wus.analysis.formats import ShardFormat
from wus.analysis.owned import is_owned
from wus.checkpoint.boxes import box_shape, boxes, chunk_shape
from wus.checkpoint.views import LogicalView, ShardedLayout, StackedLayout
from wus.errors import CheckpointError, first_line
from wus.sharded import ShardedArray, ShardsKey
from wus.transforms import programs


def _where(info) -> str:
  return f"array {info.name!r} of the checkpoint in {info.parent_dir}"


# --- The Orbax handler. ------------------------------------------------------------


class ArrayHandler(ocp.type_handlers.TypeHandler):
  """Orbax's `jax.Array` handler, taught `LogicalView`; other arrays go to `base`.

  `register` installs it as Orbax's global handler for `jax.Array`, wrapping the
  one that was there. Its type string is the wrapped handler's ("jax.Array"),
  so what it writes reads back anywhere as an ordinary array. An array whose key path
  ends in a `ShardsKey` (a ShardedArray's padded shards, saved without
  `wus.checkpointable`) is refused at save time.
  """

  def __init__(self, base: ocp.type_handlers.TypeHandler):
    self._base = base

  @property
  def base(self) -> ocp.type_handlers.TypeHandler:
    return self._base

  def __getattr__(self, name):  # The wrapped handler's options (e.g. its metadata store).
    if name == "_base":
      raise AttributeError(name)
    return getattr(self._base, name)

  def typestr(self) -> str:
    return self._base.typestr()

  async def metadata(self, infos):
    return await self._base.metadata(infos)

  def finalize(self, directory) -> None:
    self._base.finalize(directory)

  async def serialize(self, values, infos, args=None):
    for value, info in zip(values, infos, strict=True):
      if isinstance(key := (getattr(info, "keypath", None) or (None,))[-1], ShardsKey):
        holder = ShardedArray(value, key.layout, key.dtype)
        raise TypeError(
            f"Orbax was given the padded shards of {holder!r} as array {info.name!r}, which "
            "would restore as no tensor of the step's: save wus.checkpointable(tree) instead "
            "(each tensor at its logical shape, restored by step.state_target)")
    args = list(args) if args else [ocp.type_handlers.SaveArgs()] * len(values)
    ours = [k for k, v in enumerate(values) if isinstance(v, LogicalView)]
    rest = [k for k in range(len(values)) if k not in set(ours)]
    futures = []
    if rest:
      futures += list(await self._base.serialize([values[k] for k in rest],
                                                 [infos[k] for k in rest],
                                                 [args[k] for k in rest]))
    if ours:
      # Copied off the devices now: the caller may reuse (donate) the arrays after this.
      writes = [_Write.of(values[k], infos[k], args[k]) for k in ours]
      futures.append(ocp.future.CommitFutureAwaitingContractedSignals(
          _commit(writes, self._base, tuple(futures)), name="wus_logical_arrays"))
    return futures

  async def deserialize(self, infos, args=None):
    if args is None:
      return await self._base.deserialize(infos, args)
    ours = [k for k, a in enumerate(args)
            if isinstance(getattr(a, "sharding", None), (ShardedLayout, StackedLayout))]
    rest = [k for k in range(len(infos)) if k not in set(ours)]
    # Wus state first: a checkpoint of another model fails here, naming the tensor.
    stores = _raise_first(await asyncio.gather(*(_open(infos[k], args[k]) for k in ours),
                                               return_exceptions=True))
    owned = [k for k in ours if isinstance(args[k].sharding, ShardedLayout)
             and is_owned(args[k].sharding.format)]
    banks = programs.banks([args[k].sharding.format for k in owned])  # Raises if one is missing.
    store_of = dict(zip(ours, stores, strict=True))
    sharded = [k for k in ours if k not in set(owned)]
    jobs = [(_read_stacked if isinstance(args[k].sharding, StackedLayout) else _read)(
        store_of[k], infos[k], args[k]) for k in sharded]
    jobs += [_read_bank([(store_of[owned[j]], infos[owned[j]], args[owned[j]]) for j in js])
             for js in banks.values()]
    ours = sharded + [owned[j] for js in banks.values() for j in js]
    if rest:
      jobs.append(self._base.deserialize([infos[k] for k in rest], [args[k] for k in rest]))
    # Every read finished before an error is raised (none left pending on a closed loop).
    results = _raise_first(await asyncio.gather(*jobs, return_exceptions=True),
                           [infos[k] for k in rest])
    out: list = [None] * len(infos)
    done = [*results[:len(sharded)],
            *(x for bank in results[len(sharded):len(sharded) + len(banks)] for x in bank)]
    for k, value in zip(ours, done, strict=True):
      out[k] = value
    if rest:
      for k, value in zip(rest, results[-1], strict=True):
        out[k] = value
    return out


def _raise_first(results: list, rest_infos: Sequence = ()) -> list:
  """`results`, or the first exception among them as a one-line error."""
  for result in results:
    if isinstance(result, CheckpointError):
      raise result
    if isinstance(result, ValueError):  # TensorStore's and Orbax's, with a spec dump
      where = f"the checkpoint in {rest_infos[0].parent_dir}" if rest_infos else "a checkpoint"
      raise CheckpointError(f"cannot restore {where}: {first_line(result)}") from result
    if isinstance(result, BaseException):
      raise result
  return results


@contextlib.contextmanager
def _absl_warnings_off():
  """Orbax logs a warning whenever a handler replaces another; this one is on purpose."""
  logger = logging.getLogger("absl")
  level = logger.level
  logger.setLevel(logging.ERROR)
  try:
    yield
  finally:
    logger.setLevel(level)


def register() -> None:
  """Makes Orbax's global `jax.Array` handler save and restore wus state.

  Wraps the handler registered for `jax.Array` (Orbax's `ArrayHandler`, or one
  registered before) in `ArrayHandler`, which passes every other array to it.
  `checkpointable` and `ShardedStep.state_target` call it, and so does every key path
  made into a `wus.ShardedArray` once Orbax is imported (`wus.sharded.ShardsKey`), so
  that a save of raw sharded state reaches this handler, which refuses it; call it again
  after registering a `jax.Array` handler of your own. Idempotent.
  """
  current = ocp.type_handlers.get_type_handler(jax.Array)
  if not isinstance(current, ArrayHandler):
    with _absl_warnings_off():
      ocp.type_handlers.register_type_handler(jax.Array, ArrayHandler(current), override=True)


# --- Orbax internals (orbax-checkpoint 0.12): the only ones wus touches. ---------
#
# A leaf whose type string is "jax.Array" must be written as Orbax's ArrayHandler
# writes one: the same TensorStore spec (driver, OCDBT database of this process,
# compression, chunks; `build_array_write_spec`), and, if the wrapped handler
# keeps them, a record in its array metadata store (`_array_metadata_store`:
# Orbax refuses to finish a save without one per array) and an entry in the
# sharding file (`_enable_write_sharding_file`, `get_sharding_tensorstore_spec`).


def _write_spec(info, arg, shape: tuple, chunk: tuple, dtype):
  """Orbax's write spec (`.json`) and array metadata (`.metadata`) of an array of `shape`
  written in boxes of whole `chunk`s, as its ArrayHandler builds them."""
  ocdbt = bool(info.is_ocdbt_checkpoint)
  return _orbax_ts_utils.build_array_write_spec(
      info, arg, global_shape=shape, local_shape=chunk, dtype=dtype, use_ocdbt=ocdbt,
      process_index=jax.process_index() if ocdbt else None)


async def _orbax_records(handler, writes: list[_Write]) -> None:
  """What Orbax's ArrayHandler records of each array besides its data, if `handler` does.

  Its array metadata store (Orbax refuses to finish a save without a record of
  every "jax.Array"), and the sharding file, which reading the checkpoint's
  metadata needs for every array once it exists: the whole value, replicated
  on the step's mesh, as plain JAX code holds it.
  """
  store = getattr(handler, "_array_metadata_store", None)  # Orbax looks it up so too.
  if store is not None:
    await store.write(checkpoint_dir=writes[0].info.parent_dir,
                      array_metadatas=[w.spec.metadata for w in writes],
                      process_index=jax.process_index())
  if getattr(handler, "_enable_write_sharding_file", False) and jax.process_index() == 0:
    txn = ts.Transaction()
    for w in writes:
      file = await ts.open(_orbax_ts_utils.get_sharding_tensorstore_spec(
          w.info.parent_dir.as_posix(), w.info.name), open=True, context=w.info.ts_context)
      whole = NamedSharding(w.mesh, P())
      await file.with_transaction(txn).write(
          ocp.metadata.NamedShardingMetadata.from_jax_sharding(whole).to_serialized_string())
    await txn.commit_async()


# --- Saving. -----------------------------------------------------------------------


def _valid(fmt: ShardFormat, r: int) -> tuple[int, int]:
  """The flat range [start, stop) of the logical tensor in replica r's shard (may be empty)."""
  total = math.prod(fmt.shape)
  start = min(r * fmt.shard_size, total)
  return start, min(start + fmt.shard_size, total)


def _shard_index(index: tuple, fmt: ShardFormat) -> int:
  """The replica whose shard a device holds, from its index into the padded array."""
  return (index[0].start or 0) // fmt.shard_rows


@dataclasses.dataclass
class _Write:
  """What this process writes of one tensor: its runs of the row-major tensor, on the host."""

  info: Any
  mesh: Mesh
  shape: tuple
  runs: list  # (start, 1-D np.ndarray of the elements [start, start + len)) per run
  spec: Any   # Orbax's write spec: `.json` (TensorStore) and `.metadata`
  pieces: list  # (device id, start, elements) of each shard copied off a device

  @classmethod
  def of(cls, view: LogicalView, info, arg) -> _Write:
    """Copies this process's shards of `view` to the host (one copy per shard)."""
    x, fmt = view.shards, view.layout.format
    if is_owned(fmt):
      return cls._owned(view, info, arg)
    writer = {}  # replica -> process writing its shard (the device of replica_id 0)
    for shard in x.data.global_shards:
      if shard.replica_id == 0:
        writer[_shard_index(shard.index, fmt)] = shard.device.process_index
    bounds = sorted({_valid(fmt, r)[0] for r in writer if r and writer[r] != writer[r - 1]}
                    - {0, math.prod(fmt.shape)})
    own = [(shard, *_valid(fmt, _shard_index(shard.index, fmt)))
           for shard in x.data.addressable_shards if shard.replica_id == 0]
    own = [(shard, start, stop) for shard, start, stop in own if stop > start]
    for shard, _, _ in own:
      shard.data.copy_to_host_async()
    pieces = [(shard.device.id, start, np.asarray(shard.data).reshape(-1)[:stop - start])
              for shard, start, stop in own]
    pieces.sort(key=lambda p: p[1])
    runs: list = []
    for _, start, flat in pieces:  # Merge adjacent ranges into runs.
      if runs and runs[-1][0] + sum(map(len, runs[-1][1])) == start:
        runs[-1][1].append(flat)
      else:
        runs.append((start, [flat]))
    runs = [(start, parts[0] if len(parts) == 1 else np.concatenate(parts))
            for start, parts in runs]
    shape = view.layout.saved_shape
    chunk = chunk_shape(shape, fmt.shard_size, bounds)
    return cls(info, x.mesh, shape, runs, _write_spec(info, arg, shape, chunk, np.dtype(x.dtype)),
               [(device, start, len(flat)) for device, start, flat in pieces])

  @classmethod
  def _owned(cls, view: LogicalView, info, arg) -> _Write:
    """Owned state: the whole tensor, written by its owner's process alone from its
    owner's row (the columns of every member of its bank on that device)."""
    x, fmt = view.shards, view.layout.format
    slot, shape = fmt.slot, view.layout.saved_shape
    runs, pieces = [], []
    owner = _device_of(x, slot.owner)
    if owner.process_index == jax.process_index():
      row = np.concatenate([np.asarray(next(s.data for s in m.data.addressable_shards
                                            if s.device == owner)) for m in view.bank])
      runs = [(0, row[slot.offset:slot.offset + slot.size])]
      pieces = [(owner.id, 0, slot.size)]
    size = math.prod(shape)
    return cls(info, x.mesh, shape, runs, _write_spec(info, arg, shape, chunk_shape(shape, size),
                                                      np.dtype(x.dtype)), pieces)

  async def commit(self, transaction: ts.Transaction | None) -> None:
    """Writes the runs, box by box; every box is whole chunks (`chunk_shape`)."""
    info = self.info
    await info.await_path_creation()
    spec = ts.Spec(self.spec.json)
    if jax.process_index() == 0:  # Creates the array, as Orbax's primary host does.
      await ts.open(spec, create=True, open=True, context=info.ts_context,
                    transaction=transaction)
    store = await ts.open(spec, open=True, assume_metadata=True, context=info.ts_context,
                          transaction=transaction)
    writes = []
    for start, flat in self.runs:
      offset = 0
      for box in boxes(self.shape, start, start + len(flat)):
        size = math.prod(box_shape(box))
        writes.append(store[box].write(flat[offset:offset + size].reshape(box_shape(box)),
                                       can_reference_source_data_indefinitely=True))
        offset += size
    await asyncio.gather(*writes)


async def _commit(writes: list[_Write], handler, others: tuple) -> None:
  """Writes the arrays, then Orbax's records of them (see `_orbax_records`)."""
  # One atomic transaction for all, as Orbax writes its arrays into OCDBT.
  transaction = ts.Transaction(atomic=True) if writes[0].info.is_ocdbt_checkpoint else None
  await asyncio.gather(*(w.commit(transaction) for w in writes))
  if transaction is not None:
    await transaction.commit_async()
  # The records share a file per checkpoint (per process): after the wrapped handler's own.
  await asyncio.gather(*(asyncio.to_thread(f.result) for f in others))
  await _orbax_records(handler, writes)


def _device_of(x: ShardedArray, replica: int):
  """The device holding replica `replica`'s shard of `x` (the first, with copies)."""
  indices = x.data.sharding.devices_indices_map(x.format.padded_shape)
  return next(d for d, index in indices.items()
              if (index[0].start or 0) // x.format.shard_rows == replica)


# --- Restoring. --------------------------------------------------------------------


async def _open(info, arg) -> ts.TensorStore:
  """Opens a saved array to restore as wus state; checks its shape against the target's."""
  shape = arg.sharding.saved_shape
  try:
    spec = ocp.type_handlers.get_json_tspec_read(info, use_ocdbt=info.is_ocdbt_checkpoint)
    store = await ts.open(ts.Spec(spec), open=True, read=True, context=info.ts_context)
  except Exception as e:  # noqa: BLE001 -- TensorStore and Orbax raise many kinds
    raise CheckpointError(f"cannot open {_where(info)}: {first_line(e)}") from e
  if tuple(store.shape) != shape:
    raise CheckpointError(f"{_where(info)} has shape {tuple(store.shape)}; the target expects "
                          f"{shape}")
  return store


async def _read(store: ts.TensorStore, info, arg) -> ShardedArray:
  """Reads the shards of this process's devices for `arg.sharding` (a ShardedLayout)."""
  layout: ShardedLayout = arg.sharding
  fmt = layout.format
  dtype = np.dtype(arg.dtype if getattr(arg, "dtype", None) is not None
                   else store.dtype.numpy_dtype)
  sharding = layout.data_sharding
  indices = sharding.addressable_devices_indices_map(fmt.padded_shape)
  wanted = sorted({_shard_index(index, fmt) for index in indices.values()})

  async def read(r: int) -> np.ndarray:
    start, stop = _valid(fmt, r)
    flat = np.zeros(fmt.shard_size, dtype)  # Padding as the step's sharding program pads.
    offset = 0
    for box in boxes(layout.saved_shape, start, stop):
      part = await store[box].read()
      flat[offset:offset + part.size] = np.asarray(part).reshape(-1)
      offset += part.size
    return flat.reshape(fmt.shard_shape)

  results = await asyncio.gather(*(read(r) for r in wanted), return_exceptions=True)
  for result in results:
    if isinstance(result, BaseException):
      raise CheckpointError(f"cannot read {_where(info)}: {first_line(result)}") from result
  shards = dict(zip(wanted, results, strict=True))
  arrays = [jax.device_put(shards[_shard_index(index, fmt)], device)
            for device, index in indices.items()]
  data = jax.make_array_from_single_device_arrays(fmt.padded_shape, sharding, arrays)
  return ShardedArray(data, layout)


async def _read_bank(members: list) -> list[ShardedArray]:
  """Restores the members of one bank of owned state (`wus.analysis.owned`) together.

  Each of this process's devices gets its row: the whole tensors its replica
  owns, read from their saved arrays (at any replica count: the arrays hold
  logical tensors), cut into one column per member.

  Args:
    members: (store, info, arg) per member, in member order.

  Returns:
    One ShardedArray per member.
  """
  layout = members[0][2].sharding
  bank = layout.format.bank
  sharding = layout.data_sharding
  fmts = [arg.sharding.format for _, _, arg in members]
  indices = [sharding.addressable_devices_indices_map(f.padded_shape) for f in fmts]
  replica = {d: (index[0].start or 0) // fmts[0].shard_rows for d, index in indices[0].items()}
  wanted = sorted(set(replica.values()))
  dtype = np.dtype(bank.dtype)

  async def read(store, info, t: int) -> np.ndarray:
    try:
      return np.asarray(await store.read()).astype(dtype).reshape(bank.shapes[t])
    except Exception as e:  # noqa: BLE001 -- TensorStore raises many kinds
      raise CheckpointError(f"cannot read {_where(info)}: {first_line(e)}") from e

  mine = [t for t, s in enumerate(bank.slots) if s.owner in wanted]
  values = dict(zip(mine, await asyncio.gather(*(read(members[t][0], members[t][1], t)
                                                   for t in mine)), strict=True))
  rows = {r: np.zeros(bank.length, dtype) for r in wanted}
  for t, v in values.items():
    s = bank.slots[t]
    rows[s.owner][s.offset:s.offset + s.size] = v.reshape(-1)
  out = []
  for t, (f, index) in enumerate(zip(fmts, indices, strict=True)):
    start, stop = bank.column(t)
    arrays = [jax.device_put(rows[replica[d]][start:stop], d) for d in index]
    data = jax.make_array_from_single_device_arrays(f.padded_shape, sharding, arrays)
    out.append(ShardedArray(data, members[t][2].sharding))
  return out


async def _read_stacked(store: ts.TensorStore, info, arg) -> jax.Array:
  """Reads one saved copy and stacks it on every device of `arg.sharding` (a StackedLayout)."""
  layout: StackedLayout = arg.sharding
  dtype = np.dtype(arg.dtype if getattr(arg, "dtype", None) is not None
                   else store.dtype.numpy_dtype)
  try:
    copy = np.expand_dims(np.asarray(await store.read(), dtype), layout.axis)
  except Exception as e:  # noqa: BLE001 -- TensorStore raises many kinds
    raise CheckpointError(f"cannot read {_where(info)}: {first_line(e)}") from e
  sharding = layout.stacked
  shape = list(layout.saved_shape)
  shape.insert(layout.axis, sharding.mesh.size)
  indices = sharding.addressable_devices_indices_map(tuple(shape))
  arrays = [jax.device_put(copy, device) for device in indices]
  return jax.make_array_from_single_device_arrays(tuple(shape), sharding, arrays)
