"""Sharded state: what `wus` returns for tensors it keeps sharded between steps."""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any, ClassVar

import jax
import numpy as np

from wus.transforms import programs
from wus.transforms.layout import ShardedLayout


class WholeShape:
  """`ndim`, `size` and `nbytes` of a value that stands for a whole array of
  `shape` and `dtype` (a `ShardedArray`; a checkpoint's `LogicalView`), not of
  the padded shards that hold it."""

  __slots__ = ()
  shape: tuple[int, ...]
  dtype: np.dtype

  @property
  def ndim(self) -> int:
    return len(self.shape)

  @property
  def size(self) -> int:
    """Elements of the whole value (`shape`), without the shards' padding."""
    return math.prod(self.shape)

  @property
  def nbytes(self) -> int:
    """Bytes of the whole value (`shape`), as a whole array of it would hold."""
    return self.size * np.dtype(self.dtype).itemsize


class ShardsKey(jax.tree_util.GetAttrKey):
  """The key of a `ShardedArray`'s one child in a key path: `.data`, the padded shards of
  a tensor in `layout` (dtype `dtype`).

  It is a `GetAttrKey("data")` to everything that reads key paths (`jax.tree_util.keystr`
  prints `.data`; Orbax names the array `.../data`), and tells a saver handed the leaves
  of a tree (Orbax passes each leaf's key path to its handler) that a leaf is a
  ShardedArray's padded shards, which would save as no tensor of the step's.
  """

  # Run before each key path into a ShardedArray is made: `wus/__init__` sets it to make
  # Orbax's `jax.Array` handler wus's once Orbax is imported, so that a saver reading these
  # keys is wus's (`wus.checkpoint.handler`), which refuses the shards, naming what to call.
  on_key_path: ClassVar[Callable[[], None]] = staticmethod(lambda: None)

  def __init__(self, layout: ShardedLayout, dtype: np.dtype):
    super().__init__("data")
    self.layout, self.dtype = layout, dtype


@jax.tree_util.register_pytree_with_keys_class
class ShardedArray(WholeShape):
  """A tensor kept sharded across replicas between steps (§4.2), e.g. Adam's `mu`.

  It stands where the user's pytree had a whole array, and answers what an array
  answers about itself: `shape`, `dtype`, `ndim`, `size` and `nbytes` are the
  whole (logical, unpadded) tensor's, as the step's program sees it; `sharding`
  and `nbytes_per_device` describe the shards.

  Used as an array, it is its whole value, gathered on demand (issue 28: state
  the user reads outside the step, such as optax.lookahead's slow weights or
  schedule-free's `z`): `jnp` functions (`__jax_array__`), NumPy
  (`__array__`), arithmetic, indexing and the user's own `jax.jit`, `jax.grad`,
  `jax.shard_map` or optax calls all see the whole tensor, of `shape` and
  `dtype`, laid out as the step's out_spec laid it out (`spec`); inside a
  traced function the gather is part of that program (an all-gather over
  `axes`). Each use gathers anew: for many uses, or to keep whole arrays,
  call `wus.unshard(tree)` once (one program for a whole tree). Pickling
  raises a TypeError saying to call `wus.unshard` or `wus.checkpointable`.

  It is a pytree node with one child, `data`, so that it crosses `jax.jit`
  (`jax.jit(wus.shard_map(...))`) as its shards; a function mapped over a
  pytree outside any transformation therefore sees the padded shards
  (`jax.tree.map(f, tree)`), unless it is mapped with `is_leaf=wus.is_sharded`.
  A mapped function that changes the shards' shape (`x[0]`,
  `flax.jax_utils.unreplicate`) raises; one that returns no array
  (`lambda x: x.shape`) leaves a ShardedArray holding its result, which prints.
  Inside a JAX transformation of a function that is not a wus step, the
  ShardedArray that JAX rebuilt around the shards flattens to its whole value
  (gathered), so pytree code there (`jax.tree.map`, an inner `jax.jit` or
  `shard_map`) sees whole tensors too.

  Attributes:
    data: global array, shape `layout.padded_shape` (`format.padded_shape`, or
      one per block for a tensor its spec splits over other axes too), dtype of
      the tensor, leading dim split over the layout's `split_axes` and `axes`
      (each device holds `format.shard_shape`).
    layout: where it lies (`ShardedLayout`): `format`, how one replica's whole
      value (shape `format.shape`) maps to `data` (§4.1); `axes`, the mesh
      axes it is sharded over; `spec`, the PartitionSpec of the whole value in
      the user's step (P() for a `wus.shard_map` step, P(axis_name), stacked
      copies, for `wus.pmap`); `mesh`, the mesh `data` is laid out on (kept
      also under `jax.jit`, where `data` is a tracer); `groups`, the sharding
      groups of `shard_group_size`, or None. Each is also an attribute here.
  """

  __slots__ = ("data", "layout", "_dtype", "_traced_by_jax", "__weakref__")

  def __init__(self, data: jax.Array, layout: ShardedLayout, dtype: Any = None):
    self.data, self.layout = data, layout
    self._dtype = np.dtype(data.dtype if dtype is None else dtype)
    # Rebuilt by JAX around a tracer (the argument of a traced function): not a wus step's.
    self._traced_by_jax = False

  # The layout's parts, as the array's own attributes.
  format = property(operator.attrgetter("layout.format"))
  axes = property(operator.attrgetter("layout.axes"))
  spec = property(operator.attrgetter("layout.spec"))
  mesh = property(operator.attrgetter("layout.mesh"))

  @property
  def shape(self) -> tuple[int, ...]:
    """Global shape of the whole value, as the user's step sees it."""
    return self.layout.shape

  @property
  def dtype(self) -> np.dtype:
    data = getattr(self.data, "dtype", None)
    return self._dtype if data is None else np.dtype(data)

  @property
  def nbytes_per_device(self) -> int:
    """Bytes each device holds: one shard of `format.shard_shape`, padding included."""
    return self.format.shard_size * self.dtype.itemsize

  @property
  def sharding(self) -> jax.sharding.NamedSharding:
    """How the padded shards (`data`, shape `layout.padded_shape`) lie on the mesh: the
    leading dim split over the layout's `split_axes`, then `axes`. Not a sharding of
    `shape`: one replica's shard is a range of the row-major tensor, in general not a box
    of it."""
    return self.layout.data_sharding

  def tree_flatten(self):
    if self._traced_by_jax:
      # Inside the user's own transformation: pytree code there sees the whole tensor.
      return (self.whole(),), (self.layout, self._dtype, True)
    return (self.data,), (self.layout, self._dtype, False)

  def tree_flatten_with_keys(self):
    (child,), aux = self.tree_flatten()
    if aux[2]:  # The whole tensor, inside the user's own transformation.
      return ((jax.tree_util.GetAttrKey("data"), child),), aux
    ShardsKey.on_key_path()
    return ((ShardsKey(self.layout, self._dtype), child),), aux

  def whole(self) -> jax.Array:
    """The whole tensor (shape `shape`, dtype `dtype`, laid out by `spec`), gathered.

    Outside a transformation, a new `jax.Array` (what `wus.unshard` gives);
    inside one (`data` a tracer), the gather is part of the traced program.

    Raises:
      ValueError: the shards were donated to an earlier call.
    """
    check_alive(self, repr(self), "a use of sharded state as an array")
    return programs.unshard_program((self.layout,))(self.data)[0]

  @classmethod
  def tree_unflatten(cls, aux, children):
    data, fmt, padded = children[0], aux[0].format, aux[0].padded_shape
    if aux[2]:
      return data  # Flattened whole inside a transformation: it stays the whole tensor.
    if (isinstance(data, (jax.Array, np.ndarray, np.generic))
        and tuple(np.shape(data)) != padded):
      # A per-leaf function reached the shards (flax.jax_utils.unreplicate,
      # `tree_map(lambda x: x[0], state)`): its result would be no tensor.
      raise TypeError(
          f"a function mapped over a pytree turned the shards of a wus.ShardedArray (global "
          f"shape {padded}, the padded shards of a {list(fmt.shape)} tensor that wus "
          f"keeps sharded between steps) into shape {tuple(np.shape(data))}. Call "
          "wus.unshard(tree) first for whole arrays (e.g. before flax.jax_utils.unreplicate "
          "or a checkpoint), or save wus.checkpointable(tree) with Orbax to keep it sharded. "
          "To map over ShardedArrays as leaves, pass is_leaf=wus.is_sharded.")
    out = object.__new__(cls)
    out.data, (out.layout, out._dtype, _) = data, aux
    out._traced_by_jax = isinstance(data, jax.core.Tracer)
    return out

  def __repr__(self) -> str:
    shape = ",".join(map(str, self.shape))
    where = (f"{self.format.num_shards} shards of {list(self.format.shard_shape)} over "
             f"{self.axes}")
    if self.layout.num_blocks > 1:
      where += f" per block of {list(self.format.shape)} over {self.layout.split_axes}"
    if not isinstance(self.data, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct)):
      # What a function mapped over the tree returned for the shards (`lambda x: x.shape`).
      return f"ShardedArray({self.dtype}[{shape}], {where}; mapped: {self.data!r})"
    return f"ShardedArray({self.dtype}[{shape}], {where})"

  def __reduce__(self):
    raise TypeError(f"{self!r} cannot be pickled: its shards live on devices. Pickle "
                    "wus.unshard(tree) (whole arrays), or save wus.checkpointable(tree) with "
                    "Orbax to keep it sharded.")

  def __copy__(self):
    return self

  def __deepcopy__(self, memo):  # The shards are immutable jax.Arrays: shared, as jax.Array does.
    return self

  def __jax_array__(self):
    return self.whole()

  def __array__(self, dtype=None, copy=None):
    out = np.asarray(self.whole())
    return out if dtype is None else out.astype(dtype)


def _on_whole(name: str):
  """The array method `name`, applied to the whole tensor (gathered on demand)."""
  def method(self, *args, **kwargs):
    return getattr(self.whole(), name)(*args, **kwargs)
  method.__name__ = name
  return method


# Used as an array (arithmetic, indexing, iteration, conversion): the whole tensor.
for _name in ("__getitem__", "__iter__", "__len__", "__bool__", "__float__", "__int__",
              "__index__", "__neg__", "__pos__", "__abs__", "__invert__", "__add__", "__radd__",
              "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__", "__rtruediv__",
              "__floordiv__", "__rfloordiv__", "__mod__", "__rmod__", "__pow__", "__rpow__",
              "__matmul__", "__rmatmul__", "__lt__", "__le__", "__gt__", "__ge__", "astype",
              "reshape", "sum", "mean", "T"):
  setattr(ShardedArray, _name, _on_whole(_name) if _name != "T" else
          property(lambda self: self.whole().T))
del _name


def is_sharded(x: Any) -> bool:
  """Whether `x` is a `ShardedArray`: pass as `is_leaf=` to map over whole tensors.

  Args:
    x: any value (a pytree leaf or node).

  Returns:
    True for a `wus.ShardedArray` (state a wus step keeps sharded, §4.2).

  Example:
    >>> jax.tree.map(lambda x: x.shape, opt_state, is_leaf=wus.is_sharded)  # doctest: +SKIP
  """
  return isinstance(x, ShardedArray)


def check_alive(x: Any, name: str, reader: str = "") -> None:
  """Raises ValueError if `x`'s buffers (a ShardedArray's shards) were donated to a call.

  Reading a deleted buffer crashes the process in some JAX paths (gathering it), so
  every public function that reads state checks first.
  """
  data = x.data if is_sharded(x) else x
  if isinstance(data, jax.Array) and not isinstance(data, jax.core.Tracer) and data.is_deleted():
    where = f"{reader} got " if reader else ""
    raise ValueError(
        f"{where}argument {name or 'tree'}, whose buffer was donated to an earlier call "
        "(donate_argnums) and is gone; pass the value that call returned instead")


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
    The same structure with every ShardedArray replaced by its whole array
    (`x.shape`, `x.dtype`: the logical, unpadded shape).

  Raises:
    ValueError: a leaf's buffer was donated to an earlier call and is gone.
  """
  paths, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_sharded)
  leaves = [x for _, x in paths]
  together: dict = {}  # (mesh, axes, groups) -> the leaves gathered by one program.
  for (path, x), k in zip(paths, range(len(leaves)), strict=True):
    check_alive(x, jax.tree_util.keystr(path), "wus.unshard")
    if is_sharded(x):
      together.setdefault((x.mesh, x.axes, x.layout.groups), []).append(k)
  for ks in together.values():
    xs = [leaves[k] for k in ks]
    gather = programs.unshard_program(tuple(x.layout for x in xs))
    for k, whole in zip(ks, gather(*[x.data for x in xs]), strict=True):
      leaves[k] = whole
  return jax.tree.unflatten(treedef, leaves)


def unreplicate(tree: Any) -> Any:
  """One copy of a `wus.pmap` step's state, as `flax.jax_utils.unreplicate` gives it,
  with the state wus keeps sharded left sharded.

  Every whole leaf becomes its first device's copy (`flax.jax_utils.unreplicate`);
  each `ShardedArray` stays as it is (its copies are sharded, not repeated), and
  `wus.checkpointable` saves it at the unreplicated shape. Save
  `wus.checkpointable(wus.unreplicate(state))`, as Flax's pmap examples save
  `unreplicate(state)`; restore with the step's `state_target`, at any device count.

  Args:
    tree: any pytree (e.g. a `TrainState` a `wus.pmap` step returned).

  Returns:
    The same structure: whole leaves unreplicated (the mapped leading axis
    removed), ShardedArrays unchanged.

  Raises:
    ValueError: a leaf's buffer was donated to an earlier call and is gone.
    ImportError: Flax is not installed (its rule unreplicates whole leaves).
  """
  import flax.jax_utils  # noqa: PLC0415 -- Flax's own rule for each whole leaf

  def one(path, x):
    check_alive(x, jax.tree_util.keystr(path), "wus.unreplicate")
    return x if is_sharded(x) else flax.jax_utils.unreplicate(x)

  return jax.tree_util.tree_map_with_path(one, tree, is_leaf=is_sharded)
