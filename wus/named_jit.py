"""`wus.named_jit`: `wus.jit` for haliax's `named_jit` (Levanter's train step)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import jax

from wus.analysis.plan import Plan
from wus.filter_jit import arrays_only, filtered, recombined
from wus.jit import JitStep, jit
from wus.jit_arguments import abstract, leaf_key
from wus.matching import parameter_names, renamed_paths
from wus.sharded import is_sharded


def named_jit(fn: Callable | None = None, axis_resources=None, *, in_axis_resources=None,
              out_axis_resources=None, donate_args=None, donate_kwargs=None,
              **jitkwargs) -> Callable:
  """`wus.jit` for steps written with haliax's `named_jit` (Levanter), as `named_jit` is.

  The one-line change for Levanter: in levanter/trainer.py, `named_jit` imported from
  wus instead of haliax (`from wus import named_jit`); `Trainer._train_step` then runs
  under `wus.jit`, its optimizer state kept sharded between steps (§4.2). As haliax's
  `named_jit`, it traces the step under the `axis_resources` mapping (the context's, if
  None), lays the arguments out by `in_axis_resources` (their own placements, if None)
  and the outputs by `out_axis_resources` (`axis_resources`, if None), and takes every
  array leaf as an argument, every other leaf as static. Unlike it, sharded state passes
  through whole (`wus.ShardedArray` leaves in the outputs, which haliax's own wrapper
  cannot put back together with the outputs' static leaves). Haliax is imported at the
  first call.

  Args:
    fn: the step.
    axis_resources: haliax's mapping from named axes to mesh axes, for tracing.
    in_axis_resources: the mapping the arguments are laid out by.
    out_axis_resources: the mapping the outputs are laid out by.
    donate_args: per positional argument (a prefix tuple), whether its buffers are
      donated: True donates every array of that argument; any other value (False, a
      per-leaf tree or function, which haliax also takes) donates none of it.
    donate_kwargs: the same per keyword argument.
    **jitkwargs: `jax.jit`'s other keywords (`keep_unused`, `backend`, `inline`) and
      wus's options, as for `wus.jit`.

  Returns:
    The step, called like `fn`, with `.plan(*args, **kwargs)` and `.lower(*args,
    **kwargs)`.

  Examples:
    >>> train_step = wus.named_jit(trainer._train_step,  # was: haliax.named_jit
    ...                            axis_resources=parameter_mapping,
    ...                            out_axis_resources=parameter_mapping,
    ...                            donate_args=(True,))  # doctest: +SKIP
  """
  if fn is None:
    return functools.partial(named_jit, axis_resources=axis_resources,
                             in_axis_resources=in_axis_resources,
                             out_axis_resources=out_axis_resources, donate_args=donate_args,
                             donate_kwargs=donate_kwargs, **jitkwargs)
  step = _NamedJit(fn, axis_resources, in_axis_resources, out_axis_resources,
                   donate_args, donate_kwargs, jitkwargs)
  return functools.update_wrapper(step, fn)


class _NamedJit:
  """The step `named_jit` returns: one `wus.jit` step per layout of the arguments."""

  def __init__(self, fn, axis_resources, in_axis_resources, out_axis_resources,
               donate_args, donate_kwargs, jitkwargs: dict):
    self._fn, self._jitkwargs = fn, jitkwargs
    self._resources = (axis_resources, in_axis_resources, out_axis_resources)
    self._donate = (tuple(donate_args) if isinstance(donate_args, (tuple, list))
                    else donate_args, dict(donate_kwargs or {}))
    self._outs: dict = {}  # Static key -> the outputs' structure and static leaves.
    self._inner = arrays_only(fn, self._outs)
    self._steps: dict = {}  # By the arguments' count, keywords and layouts.

  def __call__(self, *args, **kwargs):
    (args, kwargs), static = filtered(args, kwargs)
    with self._mapping():
      result = self._step(args, kwargs, static)(static, *args, **kwargs)
    return recombined(self._outs[static], result)

  def plan(self, *args, **kwargs) -> Plan:
    (args, kwargs), static = filtered(args, kwargs)
    with self._mapping():
      return self._step(args, kwargs, static).plan(static, *args, **kwargs)

  def lower(self, *args, **kwargs) -> jax.stages.Lowered:
    (args, kwargs), static = filtered(args, kwargs)
    with self._mapping():
      return self._step(args, kwargs, static).lower(static, *args, **kwargs)

  def _mapping(self):
    from haliax import partitioning  # noqa: PLC0415 -- haliax only where it is used
    mapping = self._resources[0] or partitioning.current_thread_local_mapping()
    return partitioning.axis_mapping(mapping) if mapping else contextlib.nullcontext()

  def _step(self, args: tuple, kwargs: dict, static) -> JitStep:
    """The `wus.jit` step for these arguments (arrays, None elsewhere), its shardings by
    haliax's mappings as `named_jit` infers them (once per mapping and arguments' layout:
    the outputs' from the step's shapes, as haliax's cached `eval_shape` does)."""
    from haliax import partitioning  # noqa: PLC0415
    axis, given_in, given_out = self._resources
    mapping = axis or partitioning.current_thread_local_mapping()
    out_mapping = given_out if given_out is not None else mapping
    leaves, treedef = jax.tree.flatten((args, kwargs), is_leaf=is_sharded)
    key = (static, treedef, tuple(map(leaf_key, leaves)), _items(mapping), _items(given_in),
           _items(out_mapping))
    if key not in self._steps:
      ins = outs = None
      if given_in is not None:
        ins = partitioning.infer_resource_partitions(args, given_in)
      if out_mapping is not None:
        shapes = jax.eval_shape(functools.partial(self._inner, static),
                                *_abstract(args), **_abstract(kwargs))
        outs = partitioning.infer_resource_partitions(shapes, out_mapping)
      self._steps[key] = self._jit(len(args), tuple(sorted(kwargs)), ins, outs)
    return self._steps[key]

  def _jit(self, num_args: int, keywords: tuple, ins, outs) -> JitStep:
    """`wus.jit` of the step, taking the static leaves first, donating as asked."""
    donate_args, donate_kwargs = self._donate
    donated = tuple(i + 1 for i in range(num_args) if isinstance(donate_args, tuple)
                    and i < len(donate_args) and donate_args[i] is True)
    names = tuple(k for k in keywords if donate_kwargs.get(k) is True)
    kw = dict(self._jitkwargs, static_argnums=0, donate_argnums=donated or None,
              donate_argnames=names or None)
    if ins is not None:
      kw["in_shardings"] = tuple(ins)
    if outs is not None:
      kw["out_shardings"] = outs
    step = jit(self._inner, **kw)
    params = dict(enumerate(parameter_names(self._fn)))
    step.rename_paths = lambda a, paths: renamed_paths(paths, "args", params)
    step.front_end = f"wus.named_jit({getattr(self._fn, '__name__', 'step')})"
    return step


def _items(mapping) -> tuple | None:
  """A hashable form of a haliax resource mapping (a dict of axis names)."""
  return None if mapping is None else tuple(sorted(mapping.items(), key=str))


def _abstract(tree):
  """Arrays as their shapes, sharded state as the whole value it stands for."""
  return jax.tree.map(lambda x: None if x is None else abstract(x, None), tree,
                      is_leaf=lambda x: x is None or is_sharded(x))
