"""Whole-tensor ownership's types: where owned tensors live, and the Plan's ownership part.

An update that needs whole tensors (Muon's Newton-Schulz iteration, a
Shampoo-style root) cannot run on 1/N of each tensor, but when each tensor's
update reads only its own gradient, state and weight, one replica can run it
on the whole tensor while the others run other tensors' updates (DESIGN.md,
Ownership). `ownership` finds such updates and `owners` assigns them; this
module holds the types the rewrite, the runtime and checkpoints read.

Rows. Tensors of one dtype are laid out in N rows of `length` elements:
replica r's row holds the tensors it owns, each whole and contiguous at its
`Slot` (same-shape tensors of a stack in contiguous slots), the rest of the
row padding. A reduce-scatter of the N rows (each replica contributing its
local gradients placed in their owners' rows) lands every summed gradient
whole on its owner; an all-gather of the rows of new weights gives every
replica every new weight.

Banks. Owned optimizer state must live only on its owner, yet each state
tensor is its own pytree leaf with its own array. The rows of a bank (the
owned state of one dtype) are cut into consecutive columns, one per member:
member t's array (`wus.ShardedArray.data`, shape [N * widths[t]]) holds, on
replica r, row r's column t. Each array holds about 1/N of its own tensor's
size, so state memory is about 1/N per device; a member's own elements sit
in its owner's row, which spans the columns of the other members, so a
member is whole again only together with all of its bank.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import numpy as np


@dataclasses.dataclass(frozen=True)
class Slot:
  """Where one whole tensor lives in the rows of its dtype.

  Attributes:
    owner: the replica (index along the sharding axes) whose row holds it.
    offset: elements into that row.
    size: elements of the tensor.
  """

  owner: int
  offset: int
  size: int


def _dims(shape) -> str:
  return "[" + ",".join(map(str, shape)) + "]"


@dataclasses.dataclass(frozen=True)
class Placement:
  """An owned tensor that lives only inside the step: a gradient in the
  reduce-scattered rows, or a new weight in the all-gathered rows."""

  shape: tuple[int, ...]
  slot: Slot
  num_shards: int
  length: int  # Elements of one row of its dtype.

  def __str__(self) -> str:
    return (f"{_dims(self.shape)}→owned by {self.slot.owner} (row offset {self.slot.offset}, "
            f"{self.num_shards}x[{self.length}] rows)")


@dataclasses.dataclass(frozen=True)
class Bank:
  """Owned optimizer state of one dtype (module docstring, Banks).

  Attributes:
    dtype: numpy dtype name.
    num_shards: N.
    shapes: each member's logical shape (one replica's value).
    widths: each member's column: elements its array holds per replica.
    slots: each member's whole value in its owner's row.
  """

  dtype: str
  num_shards: int
  shapes: tuple[tuple[int, ...], ...]
  widths: tuple[int, ...]
  slots: tuple[Slot, ...]

  @property
  def length(self) -> int:
    """Elements of one row: the sum of the columns."""
    return sum(self.widths)

  def column(self, index: int) -> tuple[int, int]:
    """[start, stop) of member `index`'s column within a row."""
    start = sum(self.widths[:index])
    return start, start + self.widths[index]

  @property
  def padding(self) -> int:
    """Elements of the N rows that hold no tensor."""
    return self.num_shards * self.length - sum(s.size for s in self.slots)

  def rows(self, wholes) -> np.ndarray:
    """The N rows of the members' whole values (NumPy arrays, member order): [N, length]."""
    out = np.zeros((self.num_shards, self.length), np.dtype(self.dtype))
    for x, s in zip(wholes, self.slots, strict=True):
      out[s.owner, s.offset:s.offset + s.size] = np.asarray(x).reshape(-1)
    return out


def build_bank(dtype: str, num_shards: int, shapes, slots, length: int) -> Bank:
  """A bank whose columns are about 1/N of each member, widened to hold the longest row.

  Args:
    dtype, num_shards, shapes, slots: as the Bank's attributes.
    length: the longest row the slots need (elements).
  """
  widths = [-(-math.prod(s) // num_shards) for s in shapes]
  widths[-1] += max(0, length - sum(widths))
  return Bank(dtype, num_shards, tuple(map(tuple, shapes)), tuple(widths), tuple(slots))


@dataclasses.dataclass(frozen=True)
class OwnedFormat:
  """The format of an owned state tensor: member `index` of `bank`.

  It answers what the runtime asks of any format (`formats.Format`: `shape`,
  `num_shards`, `padded_shape` of the global array, `shard_shape` per replica), so
  owned state passes between steps as `wus.ShardedArray`s like sharded state.
  """

  bank: Bank
  index: int

  @property
  def shape(self) -> tuple[int, ...]:
    return self.bank.shapes[self.index]

  @property
  def num_shards(self) -> int:
    return self.bank.num_shards

  @property
  def slot(self) -> Slot:
    return self.bank.slots[self.index]

  @property
  def shard_rows(self) -> int:
    return self.bank.widths[self.index]

  @property
  def shard_shape(self) -> tuple[int, ...]:
    return (self.shard_rows,)

  @property
  def padded_shape(self) -> tuple[int, ...]:
    return (self.num_shards * self.shard_rows,)

  @property
  def shard_size(self) -> int:
    return self.shard_rows

  def shard_bytes(self, dtype) -> int:
    return self.shard_size * np.dtype(dtype).itemsize

  def __str__(self) -> str:
    return (f"{_dims(self.shape)}→owned by {self.slot.owner} (row offset {self.slot.offset}; "
            f"bank of {len(self.bank.shapes)} {self.bank.dtype}: {self.num_shards}x"
            f"[{self.shard_rows}] of {self.bank.length})")


def is_owned(fmt) -> bool:
  return isinstance(fmt, OwnedFormat)


@dataclasses.dataclass(frozen=True)
class OwnedUnit:
  """The update of one owned tensor (or of a few that only update together).

  Attributes:
    cluster: its index in `Plan.clusters`.
    eqns: the equations its owner runs (indices into the step's jaxpr).
    seeds: its gradient all-reduces.
    owner: the replica that runs it.
    stack: its stack's index in `Ownership.stacks`.
    cost: predicted seconds of its update (`owners.update_seconds`).
  """

  cluster: int
  eqns: tuple[int, ...]
  seeds: tuple[int, ...]
  owner: int
  stack: int
  cost: float


@dataclasses.dataclass(frozen=True)
class Ownership:
  """The Plan's ownership part: which replica updates which whole tensors.

  Attributes:
    num_shards: N.
    units: the owned updates.
    grads: each owned gradient (a seed's result) -> (dtype, its slot in the
      reduce-scattered rows).
    outputs: each owned value read whole after the update (new weights) ->
      (dtype, its slot in the all-gathered rows).
    grad_rows, out_rows: dtype -> elements of one row.
    state_vars_in, state_vars_out: owned state at the step's boundary: jaxpr variable
      -> its `OwnedFormat`.
    stacks: per stack, in words: its tensors' shape and dtype and how many.
    loads: predicted seconds of the owned updates each replica runs.
    pins: scalars read from outside that owned divisions divide by. XLA:CPU
      divides by a scalar used once as a multiplication by its reciprocal,
      which rounds otherwise (`divides.rewritten_divides`): in the
      unmodified step a scalar that several tensors divide by is used once
      and only the first division XLA visits is rewritten. Each owner writes
      the pins at the end of its row of `pin_dtype` (a second use: no
      rewrite), except those in `unpinned`.
    unpinned: replica -> the pins whose first division it owns: that owner
      visits it first (its unit leads the rows) with the pin used once, as
      XLA does in the unmodified step.
    predicted: (replicated, owned): predicted seconds per step of the owned
      updates and their collectives, run replicated as the step wrote them and
      owned (`owners.whole_prediction`), the comparison that chose ownership.
  """

  num_shards: int
  units: tuple[OwnedUnit, ...]
  grads: Mapping = dataclasses.field(repr=False)
  outputs: Mapping = dataclasses.field(repr=False)
  grad_rows: Mapping[str, int]
  out_rows: Mapping[str, int]
  state_vars_in: Mapping = dataclasses.field(repr=False)
  state_vars_out: Mapping = dataclasses.field(repr=False)
  stacks: tuple[str, ...]
  loads: tuple[float, ...]
  pins: tuple = ()
  pin_dtype: str = ""
  unpinned: Mapping = dataclasses.field(default_factory=dict)
  predicted: tuple[float, float] | None = None

  @property
  def imbalance(self) -> float:
    """The busiest replica's predicted update time over the mean (1: balanced)."""
    mean = sum(self.loads) / len(self.loads)
    return max(self.loads) / mean if mean else 1.0

  def padding_bytes(self, itemsize: Mapping[str, int]) -> tuple[int, int]:
    """(bytes of the gradient and output rows that hold no tensor, bytes of tensors)."""
    pad = used = 0
    for rows, slots in ((self.grad_rows, self.grads), (self.out_rows, self.outputs)):
      for dtype, length in rows.items():
        size = sum(s.size for d, s in slots.values() if d == dtype)
        pad += (self.num_shards * length - size) * itemsize[dtype]
        used += size * itemsize[dtype]
    return pad, used

  def __str__(self) -> str:
    itemsize = {d: np.dtype(d).itemsize for d in {*self.grad_rows, *self.out_rows}}
    pad, used = self.padding_bytes(itemsize)
    loads = ", ".join(f"{x * 1e6:.3g}" for x in self.loads)
    return (f"ownership: {len(self.units)} update(s) of whole tensors in {len(self.stacks)} "
            f"stack(s) ({'; '.join(self.stacks)}); predicted update per replica: {loads} us "
            f"(imbalance {self.imbalance:.3f} = busiest / mean); padding of the gradient and "
            f"weight rows: {pad} B beside {used} B of tensors "
            f"({pad / max(used, 1):.3f}); one reduce-scatter and one all-gather of rows per "
            "dtype, batched with the sharded tensors'")
