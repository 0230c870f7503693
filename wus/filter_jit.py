"""`wus.filter_jit`: `wus.jit` for steps taking and returning non-array leaves (Equinox)."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import jax
import numpy as np

from wus.analysis.plan import Plan
from wus.jit import JitStep, jit
from wus.matching import parameter_names, renamed_paths
from wus.options import OPTION_NAMES, Options
from wus.sharded import is_sharded


# `donate=` -> (donate the first argument's arrays, the other arguments', silence JAX's
# "Some donated buffers were not usable" warnings), as `equinox.filter_jit` reads it.
_DONATE = {"none": (False, False, False), "all": (True, True, True),
           "all-except-first": (False, True, True), "warn": (True, True, False),
           "warn-except-first": (False, True, False)}
# What `equinox.filter_jit` refuses among `jax.jit`'s keywords (it sets them itself).
_REFUSED = ("static_argnums", "static_argnames", "donate_argnums", "in_shardings",
            "out_shardings")


def filter_jit(fun: Callable | None = None, /, *, donate: str = "none", **jitkwargs
               ) -> Callable:
  """`wus.jit` for steps that take and return non-array leaves, as `equinox.filter_jit`.

  Every JAX or NumPy array (and sharded state) among the arguments is traced;
  every other leaf (an Equinox module's activation function, a Python float)
  is static, part of the cache key. Outputs may hold non-array leaves too.
  The one-line change for an Equinox step: `@eqx.filter_jit` becomes
  `@wus.filter_jit`, with the same keywords. The traced step runs under
  `wus.jit`: its gradient sums are reduce-scattered and the update runs on 1/N
  of every tensor (§4), the optimizer state kept sharded between calls (§4.2).
  wus does not import Equinox.

  Args:
    fun: the step.
    donate: as for `equinox.filter_jit`: "none"; "all" (every array argument
      donated), "all-except-first" (but those of the first argument), and
      "warn" and "warn-except-first", the same without silencing JAX's
      warning about donated buffers it could not reuse.
    **jitkwargs: as `equinox.filter_jit` takes them: `jax.jit`'s other
      keywords (`keep_unused`, `device`, `backend`, `inline`,
      `compiler_options`; `donate_argnames` donates the keyword arguments it
      names), and wus's options, as for `wus.jit` (`min_shard_size`,
      `objective`, `topology`).

  Returns:
    The step, called like `fun`, with `.plan(*args, **kwargs)`.

  Raises:
    ValueError: another `donate`; `static_argnums`, `static_argnames`,
      `donate_argnums`, `in_shardings` or `out_shardings` among `jitkwargs`
      (as Equinox raises: it decides them); an option `Options` rejects (an
      unknown `objective`).
    TypeError: a keyword neither `jax.jit` nor wus takes; at call time, a
      static leaf that is not hashable.
  """
  if donate not in _DONATE:
    raise ValueError(f"filter_jit(donate={donate!r}) must be one of {list(_DONATE)}")
  if any(k in jitkwargs for k in _REFUSED):
    raise ValueError(f"filter_jit's jitkwargs cannot contain {', '.join(map(repr, _REFUSED))}: "
                     "it decides them from the arguments (arrays traced, the rest static; "
                     "`donate=` for donation)")
  # Validated here, once: the steps `wus.jit` makes are made at the first call.
  Options(**{k: v for k, v in jitkwargs.items() if k in OPTION_NAMES})
  donate_first, donate_rest, quiet = _DONATE[donate]

  def make(f: Callable) -> Callable:
    outs: dict = {}  # Static key -> the outputs' structure and static leaves, from tracing.

    inner = arrays_only(f, outs)

    steps: dict[tuple, JitStep] = {}  # By the arguments' count and keywords (donation).

    def step_for(num_args: int, keywords: tuple[str, ...]) -> JitStep:
      if (num_args, keywords) not in steps:
        donated = tuple(range(1 if donate_first else 2, num_args + 1)) if donate_rest else ()
        given = jitkwargs.get("donate_argnames") or ()
        names = {given} if isinstance(given, str) else set(given)
        names |= set(keywords) if donate_rest else set()
        kw = {**jitkwargs, "donate_argnames": tuple(sorted(names)) or None}
        step = steps[num_args, keywords] = jit(inner, static_argnums=0,
                                               donate_argnums=donated or None, **kw)
        names = dict(enumerate(parameter_names(f)))
        step.rename_paths = lambda args, paths: renamed_paths(paths, "args", names)
        step.front_end = f"wus.filter_jit({getattr(f, '__name__', 'step')})"
      return steps[num_args, keywords]
    step_for(0, ())  # `jax.jit`'s own check of its keywords, now.

    @functools.wraps(f)
    def wrapped(*args, **kwargs):
      (args, kwargs), static = filtered(args, kwargs)
      with warnings.catch_warnings():
        if quiet:
          warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        result = step_for(len(args), tuple(sorted(kwargs)))(static, *args, **kwargs)
      return recombined(outs[static], result)

    def plan(*args, **kwargs) -> Plan:
      (args, kwargs), static = filtered(args, kwargs)
      return step_for(len(args), tuple(sorted(kwargs))).plan(static, *args, **kwargs)
    wrapped.plan = plan
    return wrapped
  return make if fun is None else make(fun)


def arrays_only(f: Callable, outs: dict) -> Callable:
  """`f` called as `inner(static, *arrays, **arrays)` (`filtered`'s halves, put back
  together), returning its output's arrays with None for every other leaf, which it
  records in `outs[static]` (with the output's structure) for `recombined`."""
  def inner(static, *args, **kwargs):
    treedef, static_leaves = static.value
    leaves = [s if a is None else a for a, s in
              zip(treedef.flatten_up_to((args, kwargs)), static_leaves, strict=True)]
    call_args, call_kwargs = jax.tree.unflatten(treedef, leaves)
    out = f(*call_args, **call_kwargs)
    out_leaves, out_def = jax.tree.flatten(out, is_leaf=is_sharded)
    keep = [_is_array(x) for x in out_leaves]
    outs[static] = (out_def, [None if k else x for x, k in zip(out_leaves, keep, strict=True)])
    return jax.tree.unflatten(out_def, [x if k else None for x, k in
                                        zip(out_leaves, keep, strict=True)])
  return inner


def recombined(recorded: tuple, result):
  """The step's output: its arrays (`result`, sharded state as `wus.ShardedArray`) with the
  other leaves `arrays_only` recorded put back."""
  out_def, static_out = recorded
  return jax.tree.unflatten(out_def, [s if x is None else x for x, s in
                                      zip(out_def.flatten_up_to(result), static_out,
                                          strict=True)])


def _is_array(x) -> bool:
  return is_sharded(x) or isinstance(x, (jax.Array, np.ndarray, np.generic))


def filtered(args, kwargs) -> tuple:
  """((args, kwargs) with None for every leaf but arrays and sharded state, the other
  leaves as one hashable static value)."""
  leaves, treedef = jax.tree.flatten((args, kwargs), is_leaf=is_sharded)
  keep = [_is_array(x) for x in leaves]
  arrays = [x if k else None for x, k in zip(leaves, keep, strict=True)]
  static = tuple(None if k else x for x, k in zip(leaves, keep, strict=True))
  return jax.tree.unflatten(treedef, arrays), _Static((treedef, static))


class _Static:
  """Static leaves, hashed by value (by identity where they are not hashable)."""

  def __init__(self, value):
    self.value = value
    try:
      self._key = hash(value)
    except TypeError:
      self._key = None

  def __hash__(self):
    return self._key if self._key is not None else id(self.value)

  def __eq__(self, other):
    if not isinstance(other, _Static):
      return False
    if self._key is None or other._key is None:
      return self.value is other.value
    return self._key == other._key and self.value == other.value
