"""`wus.pmap`: a drop-in for `jax.pmap` with the weight update sharded.

As in JAX itself (DESIGN.md §5), pmap is `jit(shard_map(...))` over a 1-D mesh
of the devices: mapped arguments arrive as each device's slice, mapped outputs
leave stacked along `out_axes`.

Per-device copies of weights and optimizer state (`flax.jax_utils.replicate`)
are equal by convention, not by construction. wus finds out which are: on a
call whose arguments it did not return itself, one program compares the
per-device copies of every mapped leaf; equal ones are the paper's annotated
parameters (§3.1). Outputs the analysis proves identical on every device are
remembered, so passing them back to the next call costs no comparison.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from wus import pipeline, runtime
from wus.analysis import network
from wus.analysis.causes import MAPPED_COPIES_DIFFER
from wus.matching import Signature
from wus.options import Options
from wus.runtime import donated_positions, needs_arguments
from wus.sharded import check_alive, is_sharded


def pmap(f: Callable, axis_name: Hashable | None = None, *, in_axes: Any = 0, out_axes: Any = 0,
         static_broadcasted_argnums: int | Iterable[int] = (),
         devices: Sequence[jax.Device] | None = None, backend: str | None = None,
         axis_size: int | None = None, donate_argnums: int | Iterable[int] = (),
         donate_argnames: str | Iterable[str] = (),
         replicated_argnums: Iterable[int] = (), min_shard_size: int = 0,
         shard_group_size: int | str | None = None, objective: str = "memory",
         topology: network.Topology | None = None, shard_weights: bool = False) -> Callable:
  """Like `jax.pmap`, with the weight update sharded across devices.

  Every argument means what it means to `jax.pmap`. Optimizer state comes back
  as `wus.ShardedArray` leaves: pass it straight to the next call;
  `wus.unshard` returns the stacked copies `jax.pmap` would have returned.

  Args:
    f: the per-device step.
    axis_name: the name of the mapped axis, used by the collectives in `f`.
    in_axes: an int, None, or a pytree prefix of the positional arguments
      thereof: the axis each is mapped over (None: broadcast). Keyword
      arguments are mapped over their leading axis.
    out_axes: the same for the outputs (None: identical on every device,
      returned once).
    static_broadcasted_argnums: positional arguments that are compile-time
      constants (hashable); a new value compiles a new step.
    devices: the devices to map over; default the first `axis_size` (or the
      mapped size) of `jax.local_devices(backend=backend)`.
    backend: as for `jax.pmap`.
    axis_size: the size of the mapped axis, checked against the arguments.
    donate_argnums: positional arguments whose buffers the step may reuse for
      its outputs; passing one again raises ValueError.
    donate_argnames: the same by parameter name.
    replicated_argnums: optional assertion: positional arguments whose
      per-device copies must be identical (weights, optimizer state). They are
      found without it; with it, differing copies raise ValueError.
    min_shard_size: tensors with fewer elements stay replicated.
    shard_group_size: G, to shard within groups of G consecutive devices and
      all-reduce the gradient shards across the groups (partial sharding,
      §5.2, Fig. 10; as for `wus.shard_map`, "auto" included): optimizer
      state 1/G per device.
    objective: what the cluster decisions favour, as for `wus.shard_map`
      ("memory" or "time", §3.2).
    topology: the devices for the cost model, as for `wus.shard_map`.
    shard_weights: as for `wus.shard_map`: also keep sharded between calls,
      like optimizer state, the weights the forward pass reads only in a
      narrower float (mixed precision), all-gathered in that float at their
      first read in the next call (Fig. 4 right, Fig. 7). Off by default: the
      step returns such params as `wus.ShardedArray`s, and `wus.unshard`
      gives the whole float32 weights, stacked as `jax.pmap` returns them.

  Returns:
    A function called like the `jax.pmap` of `f`, with `.plan(*args,
    **kwargs)` and `.lower(*args, **kwargs)` as `wus.ShardedStep` has.

  Raises:
    ValueError: `shard_group_size` is not a positive int, or an unknown
      `objective`; at call time, for
      arguments jax.pmap would refuse, an argument of `replicated_argnums`
      whose copies differ, a donated buffer passed again, or a
      `shard_group_size` that does not divide the number of devices.
    NotImplementedError: several processes (use `wus.shard_map`).
  """
  static = _index_tuple(static_broadcasted_argnums)
  axis_name = "_internal_pmap_axis_name" if axis_name is None else axis_name
  options = Options(min_shard_size, shard_group_size, objective, topology, shard_weights,
                    axis_name)
  return _Pmapped(f, axis_name, in_axes, out_axes, static,
                  tuple(devices) if devices is not None else None, backend,
                  axis_size, donated_positions(f, _index_tuple(donate_argnums),
                                               _names(donate_argnames)),
                  _names(donate_argnames), frozenset(_index_tuple(replicated_argnums)), options)


def _index_tuple(x: int | Iterable[int]) -> tuple[int, ...]:
  return (x,) if isinstance(x, int) else tuple(x)


def _names(x: str | Iterable[str]) -> tuple[str, ...]:
  return (x,) if isinstance(x, str) else tuple(x)


def _spec(axis_name, axis: int | None) -> P:
  """The PartitionSpec of a leaf mapped over `axis` (None: not mapped)."""
  return P() if axis is None else P(*[None] * axis, axis_name)


class _Pmapped:
  """The callable `wus.pmap` returns: `jit(shard_map(...))` at the pipeline's level (its own
  `pipeline.Step` and `pipeline.Call`), run by the runtime."""

  def __init__(self, f, axis_name, in_axes, out_axes, static, devices, backend, axis_size,
               donated, donate_argnames, replicated_argnums, options: Options):
    self._f, self._axis, self._in_axes, self._out_axes = f, axis_name, in_axes, out_axes
    self._static, self._devices = static, devices
    self._backend, self._axis_size = backend, axis_size
    self._donated, self._donate_argnames = donated, donate_argnames
    self._replicated_argnums = replicated_argnums
    self._options = options  # Built and validated once, by `pmap`.
    # By the arguments' structure, mapped axes, static values, mesh and keywords: the
    # pipeline's Step and the donated positions among the dynamic arguments.
    self._steps: dict[tuple, tuple[pipeline.Step, frozenset]] = {}
    self._cache: dict = {}  # By that and the leaves' signatures: the compiled step.
    self._warned: set = set()  # The steps warned of running as plain jax.shard_map.
    # Outputs of the last call that are identical on every device, by id.
    self._known: dict[int, weakref.ref] = {}
    functools.update_wrapper(self, f)
    # What `saving.warn_if_not_sharded` calls the step.
    self.front_end = f"wus.pmap({getattr(f, '__name__', 'step')})"

  # --- Public. ---------------------------------------------------------------

  def __call__(self, *args, **kwargs):
    call, key = self._prepare(args, kwargs)
    if (why := runtime.inside_transform(list(call.leaves), False)) is not None:
      warn = None if key in self._warned else why
      self._warned.add(key)
      out = runtime.as_jax_shard_map(call.step, call.mesh, call.args, warn, stacklevel=3)
      self._known = {}
      return out
    compiled = self._compiled(call, key)
    out = runtime.call(list(call.leaves), compiled)
    self._known = {}
    for x, same in zip(jax.tree.leaves(out, is_leaf=is_sharded), compiled.out_replicated,
                       strict=True):
      if same and isinstance(x, jax.Array):
        self._known[id(x)] = weakref.ref(x)
    return out

  def plan(self, *args, **kwargs):
    """The wus Plan for these arguments (TypeError without any)."""
    needs_arguments((*args, *kwargs.values()), "plan")
    return self._compiled(*self._prepare(args, kwargs)).plan

  def state_target(self, *args, **kwargs) -> tuple:
    """The arguments as this step reads them, abstract, to restore a checkpoint saved as
    Flax's pmap examples save theirs: one copy (`wus.unreplicate(state)`) under
    `wus.checkpointable`.

    Pass the parts you saved to Orbax's restore (`ocp.StandardCheckpointer().restore(
    path, target)`, `ocp.args.StandardRestore(target)`): mapped whole arrays (weights,
    step counters) come back as the stacked per-device copies `flax.jax_utils.replicate`
    gives, the state the step keeps sharded as `wus.ShardedArray`s for this step's
    devices, whatever the device count the checkpoint was saved at. No `replicate` call
    is needed after it.

    Args:
      args, kwargs: the step's arguments, concrete, as for a call.

    Returns:
      A tuple like `args` (static arguments as given), or `(args, kwargs)` with keyword
      arguments: `wus.checkpoint.LogicalView`s (of the saved, unreplicated shapes) for
      what is mapped or sharded, `jax.ShapeDtypeStruct`s for what is not mapped.

    Example:
      >>> ckptr.save(path, wus.checkpointable(wus.unreplicate(state)))  # doctest: +SKIP
      >>> state, _ = ckptr.restore(path, p_train_step.state_target(state, batch))  # doctest: +SKIP
    """
    from wus import checkpoint  # noqa: PLC0415 -- imports Orbax only when checkpoints are used
    needs_arguments((*args, *kwargs.values()), "state_target")
    call, key = self._prepare(args, kwargs)
    compiled = self._compiled(call, key)
    dyn_pos = [i for i in range(len(args)) if i not in self._static]
    axes = self._leaf_axes(dyn_pos, args, kwargs, call.treedef)
    targets = runtime.state_target(list(call.leaves), compiled, [
        NamedSharding(compiled.user_mesh, _spec(self._axis, ax)) for ax in axes])
    targets = [checkpoint.stacked_target(t, ax)
               if ax is not None and isinstance(t, jax.ShapeDtypeStruct) else t
               for t, ax in zip(targets, axes, strict=True)]
    *positional, keywords = jax.tree.unflatten(call.treedef, targets)
    out = list(args)
    for i, x in zip(dyn_pos, positional, strict=True):
      out[i] = x
    return (tuple(out), keywords) if kwargs else tuple(out)

  def lower(self, *args, **kwargs) -> jax.stages.Lowered:
    """Lowers the steady-state step program, as `ShardedStep.lower`."""
    call, key = self._prepare(args, kwargs)
    return runtime.lower(list(call.leaves), self._compiled(call, key))

  # --- Calls. ----------------------------------------------------------------

  def _prepare(self, args: tuple, kwargs: dict) -> tuple[pipeline.Call, tuple]:
    """(the call's one value for the pipeline: its dynamic arguments, keyword arguments
    last as one dict, with their equal per-device copies; its step's key in `_steps`)."""
    if self._static and max(self._static) >= len(args):
      raise ValueError(f"pmapped function has static_broadcasted_argnums={self._static} but was "
                       f"called with only {len(args)} positional arguments")
    if jax.process_count() > 1:
      raise NotImplementedError("wus.pmap runs in one process; with several, use wus.shard_map "
                                "over a global mesh")
    dyn_pos = [i for i in range(len(args)) if i not in self._static]
    statics = tuple((i, args[i]) for i in self._static)
    # Keyword arguments go last, as one dict: mapped over their leading axis.
    dyn = (*[args[i] for i in dyn_pos], kwargs)
    paths, treedef = jax.tree_util.tree_flatten_with_path(dyn, is_leaf=is_sharded)
    for path, x in paths:
      check_alive(x, jax.tree_util.keystr(path))
    leaves = [x for _, x in paths]
    axes = self._leaf_axes(dyn_pos, args, kwargs, treedef)
    _check_mapped_ranks(paths, axes)
    mesh = self._mesh(leaves, axes)
    leaves = [self._place(x, ax, mesh) for x, ax in zip(leaves, axes, strict=True)]
    replicated = self._replicated(leaves, axes, treedef, dyn_pos)
    key = (treedef, axes, statics, mesh, tuple(sorted(kwargs)))
    if key not in self._steps:
      self._steps[key] = self._make_step(treedef, axes, statics, dyn_pos, len(args),
                                         tuple(sorted(kwargs)))
    step, donated = self._steps[key]
    return pipeline.Call(step, self._options, jax.tree.unflatten(treedef, leaves),
                         tuple(leaves), treedef, replicated, mesh, donated), key

  def _compiled(self, call: pipeline.Call, key: tuple) -> runtime.Compiled:
    """The step compiled for `call` (`_prepare`): once per input signature."""
    signature = (key, tuple(runtime.leaf_signature(x) for x in call.leaves), call.replicated)
    return runtime.compiled_once(self._cache, signature, lambda: pipeline.compile_step(call),
                                 self)

  def _leaf_axes(self, dyn_pos, args, kwargs, treedef) -> tuple:
    """The mapped axis of every flat leaf, as jax.pmap broadcasts `in_axes`."""
    in_axes = self._in_axes
    if isinstance(in_axes, list):
      in_axes = tuple(in_axes)
    if isinstance(in_axes, tuple):
      if len(in_axes) != len(args):
        raise ValueError(f"pmap in_axes has {len(in_axes)} entries but the function was called "
                         f"with {len(args)} positional arguments")
      in_axes = tuple(in_axes[i] for i in dyn_pos)
    else:
      in_axes = (in_axes,) * len(dyn_pos)
    try:
      return _broadcast_axes((*in_axes, {k: 0 for k in kwargs}),
                             jax.tree.unflatten(treedef, [0] * treedef.num_leaves))
    except ValueError as e:
      raise ValueError("pmap in_axes must be a tree prefix of the positional arguments: "
                       f"{e}") from None

  def _mesh(self, leaves: list, axes: tuple) -> Mesh:
    sizes = {(x.shape[ax] if not is_sharded(x) else x.shape[ax])
             for x, ax in zip(leaves, axes, strict=True) if ax is not None}
    if not sizes:
      raise ValueError("pmap requires at least one argument with a mapped axis")
    if len(sizes) > 1:
      raise ValueError(f"pmap got mapped axes of different sizes: {sorted(sizes)}")
    (size,) = sizes
    if self._axis_size is not None and self._axis_size != size:
      raise ValueError(f"Specified axis_size {self._axis_size} doesn't match received "
                       f"axis_size {size}.")
    devices = self._devices or jax.local_devices(backend=self._backend)[:size]
    if len(devices) != size:
      raise ValueError(f"pmap of a mapped axis of size {size} over {len(devices)} devices")
    return _mesh(tuple(devices), self._axis)

  def _place(self, x, axis: int | None, mesh: Mesh):
    """Puts a whole leaf on the mesh as jax.pmap would (sharded state is already)."""
    if is_sharded(x):
      return x
    return jax.device_put(x, NamedSharding(mesh, _spec(self._axis, axis)))

  def _replicated(self, leaves: list, axes: tuple, treedef, dyn_pos) -> frozenset:
    """Positions of mapped leaves whose per-device copies are identical.

    Sharded state and outputs of the last call the analysis proved identical
    are known; the other mapped leaves are compared, all in one program.

    Raises:
      ValueError: a leaf of `replicated_argnums` has differing copies.
    """
    known, unknown = set(), []
    for k, (x, ax) in enumerate(zip(leaves, axes, strict=True)):
      if ax is None:
        continue
      ref = self._known.get(id(x))
      if is_sharded(x) or (ref is not None and ref() is x):
        known.add(k)
      elif not jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key):
        unknown.append(k)
    if unknown:
      same = _copies_equal([leaves[k] for k in unknown], [axes[k] for k in unknown])
      known.update(k for k, s in zip(unknown, same, strict=True) if s)
    if self._replicated_argnums:
      first = _first_leaf_of_args(treedef, len(dyn_pos))
      for a in self._replicated_argnums:
        if a not in dyn_pos:
          continue
        j = dyn_pos.index(a)
        for k in range(first[j], first[j + 1]):
          if axes[k] is not None and k not in known:
            raise ValueError(
                f"argument {a} is in replicated_argnums but its per-device copies differ "
                f"(flat leaf {k - first[j]}); replicate it (e.g. flax.jax_utils.replicate) or "
                "leave it out of replicated_argnums")
    return frozenset(known)

  def _make_step(self, treedef, axes, statics, dyn_pos, num_args,
                 kwarg_names) -> tuple[pipeline.Step, frozenset]:
    """The pipeline's Step of `f` mapped as `axes` say, and the donated positions among
    its arguments."""
    f, axis_name, out_axes = self._f, self._axis, self._out_axes

    def body(*dyn):
      leaves = jax.tree.leaves(dyn)
      leaves = [x if ax is None else jnp.squeeze(x, ax) for x, ax in zip(leaves, axes, strict=True)]
      *positional, kw = jax.tree.unflatten(treedef, leaves)
      full = [None] * num_args
      for i, x in zip(dyn_pos, positional, strict=True):
        full[i] = x
      for i, x in statics:
        full[i] = x
      out = f(*full, **kw)
      out_leaves, out_tree = jax.tree.flatten(out)
      out_axes_flat = _broadcast_axes(out_axes, out)
      return jax.tree.unflatten(out_tree, [
          y if ax is None else jnp.expand_dims(y, ax)
          for y, ax in zip(out_leaves, out_axes_flat, strict=True)])

    body.__signature__ = _dynamic_signature(f, dyn_pos)  # The Plan names arguments by it.
    in_specs = jax.tree.unflatten(treedef, [_spec(axis_name, ax) for ax in axes])
    out_specs = jax.tree.map(lambda ax: _spec(axis_name, ax), out_axes, is_leaf=lambda x: x is None)
    # Positions among the dynamic arguments; keyword arguments by name.
    donated = {dyn_pos.index(i) for i in self._donated if i in dyn_pos}
    if set(kwarg_names) & set(self._donate_argnames):
      donated.add(len(dyn_pos))  # The keyword dict (jax.pmap never donates keywords).
    step = pipeline.Step(body, tuple(in_specs), out_specs, check_vma=False,
                         split_reason=MAPPED_COPIES_DIFFER,
                         signature=Signature.of(f, positions=tuple(dyn_pos), keywords=True))
    return step, frozenset(donated)


def _check_mapped_ranks(paths: list, axes: tuple) -> None:
  """Raises ValueError, as jax.pmap does, for a mapped leaf without the mapped axis (a
  Python number), or mapped axes of different sizes (state not replicated with
  `flax.jax_utils.replicate`), naming the arguments."""
  sizes: dict[int, str] = {}
  for (path, x), ax in zip(paths, axes, strict=True):
    if ax is None:
      continue
    name = jax.tree_util.keystr(path)
    if np.ndim(x) <= ax:
      kind = type(x).__name__ if not hasattr(x, "shape") else "value"
      raise ValueError(
          f"pmap was requested to map argument {name} (a {kind} of shape {np.shape(x)}) "
          f"along axis {ax}, which it does not have. Give every mapped argument a leading "
          "axis of one entry per device (flax.jax_utils.replicate(state) for weights and "
          "optimizer state), or pass in_axes=None for it (static configuration: "
          "static_broadcasted_argnums)")
    sizes.setdefault(np.shape(x)[ax], name)
  if len(sizes) > 1:
    raise ValueError(
        "pmap got mapped axes of different sizes: "
        + ", ".join(f"{size} (e.g. argument {name})" for size, name in sizes.items())
        + ". Every mapped argument needs one entry per device along its mapped axis: "
        "replicate weights and optimizer state (flax.jax_utils.replicate), split batches "
        "per device, or pass in_axes=None for what is the same on every device")


def _dynamic_signature(f: Callable, dyn_pos: list[int]) -> inspect.Signature:
  """The signature of the step's body: `f`'s parameters at `dyn_pos` (positional), then
  `kwargs`, the keyword arguments' dict, so that the Plan names them as `f` does."""
  try:
    params = [p for p in inspect.signature(f).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
  except (TypeError, ValueError):
    params = []
  names = [params[i].name if i < len(params) else f"arg{i}" for i in dyn_pos]
  kind = inspect.Parameter.POSITIONAL_ONLY
  last = "kwargs" if "kwargs" not in names else "keyword_arguments"
  return inspect.Signature([inspect.Parameter(n, kind) for n in (*names, last)])


_UNMAPPED = object()


def _broadcast_axes(prefix: Any, tree: Any) -> tuple:
  """The axis (int or None) of each leaf of `tree`, from a pytree prefix of axes.

  Raises:
    ValueError: `prefix` is not a tree prefix of `tree`.
  """
  marked = jax.tree.map(lambda a: _UNMAPPED if a is None else a, prefix,
                        is_leaf=lambda x: x is None)
  full = jax.tree.broadcast(marked, tree)
  return tuple(None if a is _UNMAPPED else a for a in jax.tree.leaves(full))


def _first_leaf_of_args(treedef, num_positional: int) -> list[int]:
  """Flat position of each top-level positional argument's first leaf, and the end."""
  children = treedef.children()
  starts = [0]
  for child in children[:num_positional]:
    starts.append(starts[-1] + child.num_leaves)
  return starts


@functools.lru_cache(maxsize=None)
def _mesh(devices: tuple, axis_name) -> Mesh:
  return Mesh(np.array(devices), (axis_name,), axis_types=(AxisType.Auto,))


@functools.partial(jax.jit, static_argnums=1)
def _all_equal(xs: list, axes: tuple) -> jax.Array:
  """Per leaf: whether every slice along its mapped axis equals the first (NaNs equal)."""
  def one(x, ax):
    first = jax.lax.index_in_dim(x, 0, ax, keepdims=True)
    return jnp.all((x == first) | ((x != x) & (first != first)))
  return jnp.stack([one(x, ax) for x, ax in zip(xs, axes, strict=True)])


def _copies_equal(xs: list, axes: list) -> list[bool]:
  return [bool(b) for b in np.asarray(_all_equal(xs, tuple(axes)))]
