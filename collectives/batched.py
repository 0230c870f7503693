"""Batched collectives: many small tensors in one collective (§5.2, Fig. 10)."""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
from jax import lax

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
  parts, start = [], 0
  for v in values:
    parts.append(jnp.reshape(out[start:start + v.size], v.shape))
    start += v.size
  return parts
