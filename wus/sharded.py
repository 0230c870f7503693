"""Sharded state: what `wus` returns for tensors it keeps sharded between steps."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from wus.analysis.formats import ShardFormat
from wus.transforms import programs


@jax.tree_util.register_pytree_node_class
class ShardedArray:
  """A tensor kept sharded across replicas between steps (§4.2), e.g. Adam's `mu`.

  It stands where the user's pytree had a whole array. `data` is a global
  `jax.Array` laid out across the mesh, so it can be saved without gathering;
  `wus.unshard` gives the whole array back.

  Attributes:
    data: global array, shape `format.padded_shape`, dtype of the tensor,
      leading dim split over `axes` (each device holds `format.shard_shape`).
    format: how the logical tensor maps to `data` (§4.1).
    axes: the mesh axes it is sharded over.
  """

  __slots__ = ("data", "format", "axes")

  def __init__(self, data: jax.Array, format: ShardFormat, axes: tuple):  # noqa: A002
    self.data, self.format, self.axes = data, format, tuple(axes)

  @property
  def shape(self) -> tuple[int, ...]:
    """Logical shape, as the user's program sees the tensor."""
    return self.format.shape

  @property
  def dtype(self) -> np.dtype:
    return self.data.dtype

  @property
  def ndim(self) -> int:
    return len(self.format.shape)

  @property
  def size(self) -> int:
    return int(np.prod(self.format.shape))

  def tree_flatten(self):
    return (self.data,), (self.format, self.axes)

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(children[0], *aux)

  def __repr__(self) -> str:
    return f"ShardedArray({self.dtype}{list(self.shape)}, {self.format}, axes={self.axes})"


def is_sharded(x: Any) -> bool:
  return isinstance(x, ShardedArray)


def unshard(tree: Any) -> Any:
  """Whole arrays back from any pytree holding sharded state.

  Each `ShardedArray` becomes a `jax.Array` of its logical shape and dtype,
  replicated on every device of its mesh (one all-gather per tensor). Other
  leaves, and trees without sharded state, pass through unchanged.

  Args:
    tree: any pytree.

  Returns:
    The same structure with every ShardedArray replaced by its whole array.
  """
  def whole(x):
    if not is_sharded(x):
      return x
    return programs.unshard_program(x.format, x.data.sharding.mesh, x.axes)(x.data)
  return jax.tree.map(whole, tree, is_leaf=is_sharded)
