"""Sharded state: what `wus` returns for tensors it keeps sharded between steps."""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from wus.analysis.formats import ShardFormat
from wus.transforms import programs


@jax.tree_util.register_pytree_node_class
class ShardedArray:
  """A tensor kept sharded across replicas between steps (§4.2), e.g. Adam's `mu`.

  It stands where the user's pytree had a whole array. `data` is a global
  `jax.Array` laid out across the mesh; `wus.checkpointable` saves it with
  Orbax without gathering, at its logical shape; `wus.unshard` gives the whole
  array back, laid out as the step's out_spec laid it out (`spec`).

  Attributes:
    data: global array, shape `format.padded_shape`, dtype of the tensor,
      leading dim split over `axes` (each device holds `format.shard_shape`).
    format: how one replica's whole value (shape `format.shape`) maps to
      `data` (§4.1).
    axes: the mesh axes it is sharded over.
    spec: the PartitionSpec of the whole value in the user's program: P() for
      a `wus.shard_map` step, P(axis_name) (stacked copies) for `wus.pmap`.
    mesh: the mesh `data` is laid out on (kept also under `jax.jit`, where
      `data` is a tracer).
  """

  __slots__ = ("data", "format", "axes", "spec", "mesh")

  def __init__(self, data: jax.Array, format: ShardFormat, axes: tuple, spec: P,  # noqa: A002
               mesh: Mesh):
    self.data, self.format, self.axes, self.spec, self.mesh = data, format, tuple(axes), spec, mesh

  @property
  def shape(self) -> tuple[int, ...]:
    """Global shape of the whole value, as the user's program sees it."""
    shape = list(self.format.shape)
    for d, entry in enumerate(self.spec):
      names = entry if isinstance(entry, tuple) else (entry,) if entry else ()
      shape[d] *= math.prod(self.mesh.shape[n] for n in names)
    return tuple(shape)

  @property
  def dtype(self) -> np.dtype:
    return self.data.dtype

  @property
  def ndim(self) -> int:
    return len(self.format.shape)

  @property
  def size(self) -> int:
    return math.prod(self.shape)

  def tree_flatten(self):
    return (self.data,), (self.format, self.axes, self.spec, self.mesh)

  @classmethod
  def tree_unflatten(cls, aux, children):
    data, fmt = children[0], aux[0]
    if (isinstance(data, (jax.Array, np.ndarray, np.generic))
        and tuple(np.shape(data)) != fmt.padded_shape):
      # A per-leaf function reached the shards (flax.jax_utils.unreplicate,
      # `tree_map(lambda x: x[0], state)`): its result would be no tensor.
      raise TypeError(
          f"a function mapped over a pytree turned the shards of a wus.ShardedArray (global "
          f"shape {fmt.padded_shape}, the padded shards of a {list(fmt.shape)} tensor that wus "
          f"keeps sharded between steps) into shape {tuple(np.shape(data))}. Call "
          "wus.unshard(tree) first for whole arrays (e.g. before flax.jax_utils.unreplicate "
          "or a checkpoint), or save wus.checkpointable(tree) with Orbax to keep it sharded.")
    return cls(data, *aux)

  def __repr__(self) -> str:
    return f"ShardedArray({self.dtype}{list(self.format.shape)}, {self.format}, axes={self.axes})"

  def _needs_whole(self, *args, **kwargs):
    raise TypeError(
        f"{self!r} is a shard of a tensor that wus keeps sharded between steps (optimizer "
        "state); it cannot be used as an array. Pass it back to the wus step that returned "
        "it, or call wus.unshard(tree) for whole arrays.")

  # Used as an array (jax.numpy, NumPy, arithmetic, indexing): say what to do.
  __jax_array__ = __array__ = __getitem__ = __iter__ = __len__ = _needs_whole
  __bool__ = __float__ = __int__ = __index__ = _needs_whole
  __neg__ = __pos__ = __abs__ = __invert__ = _needs_whole
  __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _needs_whole
  __truediv__ = __rtruediv__ = __floordiv__ = __rfloordiv__ = _needs_whole
  __mod__ = __rmod__ = __pow__ = __rpow__ = __matmul__ = __rmatmul__ = _needs_whole
  __lt__ = __le__ = __gt__ = __ge__ = _needs_whole


def is_sharded(x: Any) -> bool:
  return isinstance(x, ShardedArray)


def unshard(tree: Any) -> Any:
  """Whole arrays back from any pytree holding sharded state.

  Each `ShardedArray` becomes a `jax.Array` of its logical shape and dtype,
  laid out as the step returned whole values (replicated on every device for
  `wus.shard_map` with out_spec P(); stacked copies for `wus.pmap`). The
  tensors of one mesh are gathered by one program with batched all-gathers
  (§5.2). Other leaves, and trees without sharded state, pass through
  unchanged.

  Args:
    tree: any pytree.

  Returns:
    The same structure with every ShardedArray replaced by its whole array.
  """
  leaves, treedef = jax.tree.flatten(tree, is_leaf=is_sharded)
  groups: dict = {}
  for k, x in enumerate(leaves):
    if is_sharded(x):
      groups.setdefault((x.mesh, x.axes), []).append(k)
  for (mesh, axes), ks in groups.items():
    xs = [leaves[k] for k in ks]
    gather = programs.unshard_program(tuple(x.format for x in xs), mesh, axes,
                                      tuple(x.spec for x in xs))
    for k, whole in zip(ks, gather(*[x.data for x in xs]), strict=True):
      leaves[k] = whole
  return jax.tree.unflatten(treedef, leaves)


def checkpointable(tree: Any) -> Any:
  """`tree` to save with stock Orbax: sharded state written in place at its logical shapes.

  Pass the result to `ocp.StandardCheckpointer().save` or `ocp.args.StandardSave`
  (e.g. in a `CheckpointManager`). Each `wus.ShardedArray` becomes a
  `wus.checkpoint.LogicalView`, which Orbax saves as an ordinary array of the
  tensor's logical (unpadded) shape, each process writing only the shards its
  own devices hold: nothing is gathered. Code without wus restores it as a
  whole array; `ShardedStep.state_target` restores it sharded, at any replica
  count. Other leaves pass through unchanged.

  Args:
    tree: any pytree (e.g. `{"params": params, "opt_state": opt_state}` as a
      wus step returned them).

  Returns:
    The same structure with every ShardedArray replaced by a LogicalView.

  Raises:
    TypeError: a ShardedArray holds a tracer (inside `jax.jit`).

  Example:
    >>> ckptr = ocp.StandardCheckpointer()  # doctest: +SKIP
    >>> state = {"params": params, "opt_state": opt_state}  # doctest: +SKIP
    >>> ckptr.save(path, wus.checkpointable(state))  # doctest: +SKIP
  """
  from wus import checkpoint  # noqa: PLC0415 -- imports Orbax only when checkpoints are used
  return checkpoint.checkpointable(tree)
