"""`wus.pmap`: a drop-in for `jax.pmap` with the weight update sharded.

As in JAX itself (DESIGN.md §5), pmap is `jit(shard_map(...))` over a 1-D mesh
of the devices: mapped arguments arrive as each device's slice, outputs leave
stacked along a new leading axis.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from wus.api import ShardedStep
from wus.sharded import is_sharded


def pmap(f: Callable, axis_name: str, *, in_axes: int | None | Sequence[int | None] = 0,
         out_axes: int = 0, devices: Sequence[jax.Device] | None = None,
         replicated_argnums: Sequence[int] = (), min_shard_size: int = 0,
         donate_argnums: int | Sequence[int] = ()) -> Callable:
  """Like `jax.pmap`, with the weight update sharded across devices.

  Data-parallel pmap code keeps one copy of the weights and optimizer state
  per device (for example from `flax.jax_utils.replicate`). Nothing in the
  program says those copies are equal, so declare them with
  `replicated_argnums` (the paper's annotated parameters, §3.1); arguments
  with `in_axes=None` are replicated by construction. Optimizer state then
  comes back as `wus.ShardedArray` leaves; `wus.unshard` returns the stacked
  copies jax.pmap would have returned.

  Args:
    f: the per-device step.
    axis_name: the name of the mapped axis, used by the collectives in `f`.
    in_axes: 0 (mapped over the leading axis) or None (broadcast), for all
      positional arguments or one entry per argument.
    out_axes: must be 0.
    devices: the devices to map over; default `jax.local_devices()`.
    replicated_argnums: positional arguments whose per-device copies are
      identical (weights, optimizer state). The first call checks it and
      raises ValueError if they differ.
    min_shard_size: tensors with fewer elements stay replicated.
    donate_argnums: positional arguments whose buffers the step may reuse for
      its outputs, as for `jax.pmap`.

  Returns:
    A function called like the `jax.pmap` of `f`.

  Raises:
    NotImplementedError: for in_axes other than 0 / None, or out_axes != 0.
  """
  if out_axes != 0:
    raise NotImplementedError("wus.pmap supports out_axes=0 only; use jax.pmap otherwise")
  devices = list(devices if devices is not None else jax.local_devices())
  mesh = Mesh(np.array(devices), (axis_name,), axis_types=(AxisType.Auto,))
  donate = frozenset([donate_argnums] if isinstance(donate_argnums, int) else donate_argnums)
  return _Pmapped(f, axis_name, in_axes, mesh, frozenset(replicated_argnums), min_shard_size,
                  donate)


class _Pmapped:
  """The callable `wus.pmap` returns."""

  def __init__(self, f, axis_name, in_axes, mesh, replicated_argnums, min_shard_size,
               donate_argnums):
    self._f, self._axis, self._in_axes, self._mesh = f, axis_name, in_axes, mesh
    self._replicated_argnums = replicated_argnums
    self._donate_argnums = donate_argnums
    self._min_size = min_shard_size
    self._steps: dict[tuple, ShardedStep] = {}
    self._checked: set = set()
    functools.update_wrapper(self, f)

  def _axes_of(self, num_args: int) -> tuple:
    axes = self._in_axes
    axes = tuple(axes) if isinstance(axes, (tuple, list)) else (axes,) * num_args
    if len(axes) != num_args or any(a not in (0, None) for a in axes):
      raise NotImplementedError(f"wus.pmap supports in_axes of 0 or None per argument; got {self._in_axes}")
    return axes

  def _step(self, in_axes: tuple) -> ShardedStep:
    if in_axes not in self._steps:
      def body(*args):
        args = [jax.tree.map(lambda x: jnp.squeeze(x, 0), a) if ax == 0 else a
                for a, ax in zip(args, in_axes, strict=True)]
        return jax.tree.map(lambda y: jnp.expand_dims(y, 0), self._f(*args))

      spec = P(self._axis)
      self._steps[in_axes] = ShardedStep(
          body, mesh=self._mesh, in_specs=tuple(spec if ax == 0 else P() for ax in in_axes),
          out_specs=spec, check_vma=False, axis_names=frozenset(), axis_name=self._axis,
          min_shard_size=self._min_size,
          replicated_argnums=frozenset(a for a in self._replicated_argnums if in_axes[a] == 0),
          donate_argnums=self._donate_argnums,
          split_reason="mapped, and its copies are not declared equal: add it to "
                       "replicated_argnums if they are")
    return self._steps[in_axes]

  def _place(self, args: tuple, in_axes: tuple) -> tuple:
    """Puts whole leaves on the mesh as jax.pmap would (sharded state is already)."""
    def put(x, ax):
      if is_sharded(x):
        return x
      return jax.device_put(x, NamedSharding(self._mesh, P(self._axis) if ax == 0 else P()))
    return tuple(jax.tree.map(lambda x: put(x, ax), a, is_leaf=is_sharded)
                 for a, ax in zip(args, in_axes, strict=True))

  def _check_replicated(self, args: tuple, in_axes: tuple) -> None:
    """Raises ValueError if an argument declared replicated has differing copies."""
    for a in sorted(self._replicated_argnums):
      if in_axes[a] != 0:
        continue
      for path, x in jax.tree_util.tree_flatten_with_path(args[a], is_leaf=is_sharded)[0]:
        if not is_sharded(x) and not bool(_all_copies_equal(x)):
          raise ValueError(
              f"argument {a}{jax.tree_util.keystr(path)} is in replicated_argnums but its "
              "per-device copies differ; replicate it (e.g. flax.jax_utils.replicate) or "
              "leave it out of replicated_argnums")

  def __call__(self, *args):
    in_axes = self._axes_of(len(args))
    args = self._place(args, in_axes)
    key = (in_axes, jax.tree.structure(args, is_leaf=is_sharded))
    if key not in self._checked:
      self._check_replicated(args, in_axes)
      self._checked.add(key)
    return self._step(in_axes)(*args)

  def plan(self, *args):
    """The wus Plan for these arguments."""
    in_axes = self._axes_of(len(args))
    return self._step(in_axes).plan(*self._place(args, in_axes))

  def lower(self, *args) -> jax.stages.Lowered:
    """Lowers the steady-state step program, as `ShardedStep.lower`."""
    in_axes = self._axes_of(len(args))
    return self._step(in_axes).lower(*self._place(args, in_axes))


@jax.jit
def _all_copies_equal(x: Any) -> jax.Array:
  x = jnp.asarray(x)
  return jnp.all((x == x[:1]) | (x != x))  # NaN copies count as equal.
