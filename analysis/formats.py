"""Sharding formats: how a tensor is cut into one shard per replica (§4.1, Fig. 6).

A format is a sequence of cheap reformatting steps followed by a split:

  1. reshape the logical `shape` to `merged_shape` by merging runs of adjacent
     dimensions (row-major, so no data moves);
  2. pad the leading merged dimension up to a multiple of `num_shards`;
  3. split the leading dimension evenly: replica r holds rows
     [r * shard_rows, (r + 1) * shard_rows).

Every replica's shard has the same shape, `shard_shape`, and the padding is
fewer than `num_shards` rows. The data movement itself (pad, slice, reduce-
scatter, all-gather with the format fused in) lives in `wus.collectives`.

`Format` is what every format of a tensor held across replicas answers: a
`ShardFormat`, or an owned tensor's row in its bank (`owned.OwnedFormat`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class Format(Protocol):
  """How a tensor of `shape` lies across `num_shards` replicas, as the runtime, the
  programs and checkpoints ask it: each replica holds `shard_shape` (`shard_rows` rows of
  `shard_size` elements in all) of a global array of `padded_shape`.

  Implemented by `ShardFormat` (§4.1: a range of the row-major tensor per replica) and
  `owned.OwnedFormat` (ownership: the whole tensor on its owner, in its bank's row).
  """

  @property
  def shape(self) -> tuple[int, ...]: ...

  @property
  def num_shards(self) -> int: ...

  @property
  def shard_rows(self) -> int: ...

  @property
  def shard_shape(self) -> tuple[int, ...]: ...

  @property
  def padded_shape(self) -> tuple[int, ...]: ...

  @property
  def shard_size(self) -> int: ...

  def shard_bytes(self, dtype) -> int: ...


@dataclasses.dataclass(frozen=True)
class ShardFormat:
  """The sharding format of one tensor (§4.1).

  The tensor's dims are merged into `merged_shape` so that the dims a
  reduction in the update keeps stay apart from those it reduces; the leading
  merged dim is padded with zeros to a multiple of `num_shards` (N) and split
  into N equal shards, replica r holding merged rows [r * shard_rows,
  (r + 1) * shard_rows). Elementwise updates use the flat format (`flat`: one
  merged dim, each replica holding `shard_size` elements). Shapes count
  elements, not bytes. A `Format`.

  Attributes:
    shape: the logical shape, as the user's step sees it.
    merged_shape: `shape` with runs of adjacent dimensions merged; same size.
    num_shards: the number of replicas the leading merged dim is split over.
    copy_axes: the other mesh axes (`Plan.copy_axes`) among those replicas, after the
      plan's own, when they are some of the plan's copy axes only (an FSDP block
      repeated over "model" but not over "data"); () for the plan's rule (`shard_axes`).
    blocks: the plan's own axes split the tensor into blocks rather than shards (FSDP:
      each of their replicas updates its own block, `analysis/fsdp_blocks.py`), so its
      shards lie over `copy_axes` alone, within each block.

  Raises:
    ValueError: `merged_shape` is not `shape` with runs of adjacent dims
      merged, or `num_shards` < 1.
  """

  shape: tuple[int, ...]
  merged_shape: tuple[int, ...]
  num_shards: int
  copy_axes: tuple[str, ...] = ()
  blocks: bool = False

  def __post_init__(self):
    if not self.merged_shape or not _merges_adjacent(self.shape, self.merged_shape):
      raise ValueError(f"merged shape {self.merged_shape} is not {self.shape} with runs "
                       "of adjacent dims merged")
    if self.num_shards < 1:
      raise ValueError(f"num_shards must be positive, got {self.num_shards}")

  @classmethod
  def flat(cls, shape: tuple[int, ...], num_shards: int) -> ShardFormat:
    """All dimensions merged into one: the format of elementwise updates."""
    return cls(tuple(shape), (math.prod(shape),), num_shards)

  @property
  def shard_rows(self) -> int:
    """Rows of the leading merged dimension each replica holds."""
    return -(-self.merged_shape[0] // self.num_shards)

  @property
  def padding(self) -> int:
    """Rows of padding appended to the leading merged dimension (< num_shards)."""
    return self.shard_rows * self.num_shards - self.merged_shape[0]

  @property
  def padded_shape(self) -> tuple[int, ...]:
    """Shape of the padded merged tensor; its leading dim splits evenly."""
    return (self.shard_rows * self.num_shards, *self.merged_shape[1:])

  @property
  def shard_shape(self) -> tuple[int, ...]:
    """Shape of one replica's shard."""
    return (self.shard_rows, *self.merged_shape[1:])

  @property
  def shard_size(self) -> int:
    """Elements in one replica's shard."""
    return math.prod(self.shard_shape)

  def shard_bytes(self, dtype) -> int:
    """Bytes one replica holds of a tensor of `dtype` in this format."""
    return self.shard_size * np.dtype(dtype).itemsize

  def __str__(self) -> str:
    dims = lambda s: "[" + ",".join(map(str, s)) + "]"  # noqa: E731
    steps = [dims(self.shape)]
    if self.merged_shape != self.shape:
      steps.append(dims(self.merged_shape))
    if self.padding:
      steps.append(f"pad {self.padding}")
    steps.append(f"{self.num_shards}x{dims(self.shard_shape)}")
    return "→".join(steps)


def _merges_adjacent(shape: tuple[int, ...], merged: tuple[int, ...]) -> bool:
  """Whether `merged` is `shape` with runs of adjacent dims merged (size-1 dims anywhere)."""
  dims = [d for d in shape if d != 1]
  runs = [m for m in merged if m != 1]
  for m in runs:
    size = 1
    while dims and size < m:
      size *= dims.pop(0)
    if size != m:
      return False
  return not dims and math.prod(merged) == math.prod(shape)


def is_shardable_shape(shape: tuple[int, ...], num_shards: int, min_size: int) -> bool:
  """Whether a tensor is big enough to shard: rank ≥ 1, ≥ `min_size` elements,
  and more elements than replicas.

  Scalars and tiny tensors stay replicated (DESIGN.md §3, Formats): their
  shards would be mostly padding and their collectives pure latency. A
  tensor of exactly N elements would give one-element shards, which XLA's
  CPU backend computes by another code path than the whole tensor (Adam's
  update then differs in the last bit).
  """
  return len(shape) >= 1 and math.prod(shape) > max(min_size - 1, num_shards, 0)


def nonunit_dims(shape: tuple[int, ...]) -> list[int]:
  """Positions of the dims of `shape` that are not 1 (size-1 dims never matter to a format)."""
  return [i for i, d in enumerate(shape) if d != 1]


def format_from_bounds(shape: tuple[int, ...], bounds: frozenset, num_shards: int) -> ShardFormat:
  """The format merging the non-unit dims of `shape` into runs split at `bounds`.

  `bounds` holds positions p in the list of non-unit dims: a boundary between
  non-unit dims p-1 and p. No bounds is the flat format.
  """
  dims = [shape[i] for i in nonunit_dims(shape)]
  merged, size = [], 1
  for p, d in enumerate(dims):
    if p in bounds:
      merged.append(size)
      size = 1
    size *= d
  merged.append(size)
  return ShardFormat(tuple(shape), tuple(merged), num_shards)


def merged_dims(fmt: ShardFormat) -> list[tuple[int, ...]]:
  """The logical dims (non-unit) merged into each dim of `fmt.merged_shape`."""
  out, dims = [], nonunit_dims(fmt.shape)
  for m in fmt.merged_shape:
    group, size = [], 1
    while dims and size < m:
      size *= fmt.shape[dims[0]]
      group.append(dims.pop(0))
    out.append(tuple(group))
  return out
