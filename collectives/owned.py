"""Rows of whole tensors, one row per replica: the layout of owned updates.

Ownership (DESIGN.md) runs each tensor's update on one replica, its owner.
Tensors of one dtype are laid out in N rows of `length` elements, replica r's
row holding the tensors r owns, each whole at its slot (`slot.owner`,
`slot.offset`, `slot.size`: anything with those attributes). A reduce-scatter
of the flat rows lands each summed gradient whole on its owner; an all-gather
of the rows gives every replica every tensor. The functions marked "per
replica" run inside `shard_map`; `axis_name` names the replica axes, major
first, as in `wus.collectives.formatted`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax.numpy as jnp
from jax import lax

from wus.collectives.formatted import _replica


def replica(axis_name) -> jnp.ndarray:
  """Per replica: this replica's index along `axis_name` (the owner of its row)."""
  return _replica(axis_name)


def row(values: Sequence[jnp.ndarray], offsets: Sequence[int], length: int, dtype) -> jnp.ndarray:
  """One row: `values` flattened at `offsets`, zeros elsewhere.

  Args:
    values: tensors of `dtype`, any shapes, at offsets that do not overlap.
    offsets: where each starts.
    length: elements of the row.
    dtype: the row's dtype.

  Returns:
    shape [length].
  """
  pieces, end = [], 0
  for x, offset in sorted(zip(values, offsets, strict=True), key=lambda p: p[1]):
    if offset < end:
      raise ValueError(f"row pieces overlap: one starts at {offset}, before {end}")
    if offset > end:
      pieces.append(jnp.zeros((offset - end,), dtype))
    pieces.append(jnp.ravel(x).astype(dtype))
    end = offset + x.size
  if length > end:
    pieces.append(jnp.zeros((length - end,), dtype))
  return jnp.concatenate(pieces) if len(pieces) > 1 else pieces[0]


def rows(values: Sequence[jnp.ndarray], slots: Sequence, num_shards: int, length: int,
         dtype) -> jnp.ndarray:
  """All N rows, flat: value k in row `slots[k].owner` at `slots[k].offset`.

  Per replica, the reduce-scatter input of owned gradients: each replica puts
  its local gradient of every owned tensor in its owner's row.

  Returns:
    shape [num_shards * length], row r at [r * length, (r + 1) * length).
  """
  per_row: list[list] = [[] for _ in range(num_shards)]
  for x, s in zip(values, slots, strict=True):
    per_row[s.owner].append((x, s.offset))
  return jnp.concatenate([row([x for x, _ in p], [o for _, o in p], length, dtype)
                          for p in per_row])


def cut(every: jnp.ndarray, slots: Sequence, shapes: Sequence[tuple[int, ...]],
        length: int) -> list[jnp.ndarray]:
  """The tensors of gathered rows: `every` is [N * length], tensor k at `slots[k]`.

  Returns:
    One tensor per slot, of its shape.
  """
  return [jnp.reshape(lax.slice_in_dim(every, s.owner * length + s.offset,
                                       s.owner * length + s.offset + s.size), shape)
          for s, shape in zip(slots, shapes, strict=True)]


def piece(x: jnp.ndarray, offset: int, shape: tuple[int, ...]) -> jnp.ndarray:
  """The tensor of `shape` at `offset` of a row `x`."""
  return jnp.reshape(lax.slice_in_dim(x, offset, offset + math.prod(shape)), shape)


def columns(x: jnp.ndarray, widths: Sequence[int]) -> list[jnp.ndarray]:
  """A row cut into consecutive columns of `widths` (a bank's members' shards)."""
  out, start = [], 0
  for w in widths:
    out.append(lax.slice_in_dim(x, start, start + w))
    start += w
  return out


def shard_bank(wholes: Sequence[jnp.ndarray], slots: Sequence, widths: Sequence[int],
               axis_name) -> list[jnp.ndarray]:
  """Per replica: the bank columns of whole values every replica holds: no communication.

  Args:
    wholes: the members' whole values (identical on every replica), member order.
    slots: each member's slot in the rows.
    widths: each member's column width; their sum is the row length.
    axis_name: the replica axes.

  Returns:
    Per member, this replica's column: shape [widths[t]].
  """
  length = sum(widths)
  names = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
  num_shards = math.prod(lax.axis_size(a) for a in names)
  every = rows(list(wholes), slots, num_shards, length, wholes[0].dtype)
  mine = lax.dynamic_slice_in_dim(every, replica(axis_name) * length, length)
  return columns(mine, widths)


def bank_wholes(gathered: Sequence[jnp.ndarray], slots: Sequence, widths: Sequence[int],
                shapes: Sequence[tuple[int, ...]]) -> list[jnp.ndarray]:
  """The members' whole values from their gathered columns.

  Args:
    gathered: per member, every replica's column, replica r's at [r * w, (r + 1) * w).
    slots, widths: as for `shard_bank`.
    shapes: each member's shape.

  Returns:
    Per member, its whole value.
  """
  num_shards = gathered[0].size // widths[0]
  every = jnp.concatenate([jnp.reshape(g, (num_shards, w)) for g, w in
                           zip(gathered, widths, strict=True)], axis=1)
  return cut(jnp.ravel(every), slots, shapes, sum(widths))
