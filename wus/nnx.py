"""`wus.nnx_jit`: `flax.nnx.jit` for steps that update NNX objects in place.

A Flax NNX step (`model`, `optimizer` and `metrics` updated in place, as the
NNX MNIST tutorial writes it) is a function of graph objects, not of pytrees.
`nnx_jit` splits them into their graph definitions and states
(`nnx.split`), runs the state step under `wus.jit`, and writes the new states
back into the objects (`nnx.update`), as `nnx.jit` does. Optimizer state the
step keeps sharded lives in the `nnx.Optimizer` as `wus.ShardedArray`s between
calls; `wus.unshard(nnx.state(optimizer))` gives whole arrays.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from flax import nnx

from wus.jit import jit
from wus.matching import parameter_names, renamed_paths


def nnx_jit(fun: Callable | None = None, /, **jit_kwargs) -> Callable:
  """Like `flax.nnx.jit`, with the weight update sharded (`wus.jit`).

  The one-line change for an NNX step: `@nnx.jit` becomes `@wus.nnx_jit`.

  Args:
    fun: the step; its arguments may be NNX graph objects (modules,
      `nnx.Optimizer`, metrics), updated in place, and pytrees of arrays.
    **jit_kwargs: as for `wus.jit` (`donate_argnums` counts the step's
      positional arguments).

  Returns:
    The step, called like `fun`: its graph-object arguments hold their new
    state afterwards; it returns what `fun` returns (arrays only). The
    optimizer state it keeps sharded (1/N of each tensor per device, §4.2)
    stays in the `nnx.Optimizer` as `wus.ShardedArray`s.

  Raises:
    ValueError: at call time, as for `wus.jit` (an argument donated to an
      earlier call).

  `wus.nnx_jit` is imported when first used (`import wus` does not import
  Flax); where Flax is missing, `wus.nnx_jit` raises an ImportError saying to
  install it.
  """
  def make(f: Callable) -> Callable:
    def pure(static, states, rest, kwargs):
      graphdefs, positions = static
      args = list(rest)
      for k, g, s in zip(positions, graphdefs, states, strict=True):
        args.insert(k, nnx.merge(g, s))
      out = f(*args, **kwargs)
      return [nnx.state(args[k]) for k in positions], out

    step = jit(pure, static_argnums=0, **_shifted(jit_kwargs))
    step.rename_paths = functools.partial(_user_paths, parameter_names(f))
    step.front_end = f"wus.nnx_jit({getattr(f, '__name__', 'step')})"  # For its warnings.

    def split(args: tuple) -> tuple:
      """(static, states, the other arguments, the graph objects)."""
      positions = tuple(k for k, a in enumerate(args) if _is_graph(a))
      objects = [args[k] for k in positions]
      parts = [nnx.split(o) for o in objects]
      static = (tuple(g for g, _ in parts), positions)
      return static, [s for _, s in parts], [a for a in args if not _is_graph(a)], objects

    @functools.wraps(f)
    def wrapped(*args, **kwargs):
      static, states, rest, objects = split(args)
      new_states, out = step(static, states, rest, kwargs)
      for o, s in zip(objects, new_states, strict=True):
        nnx.update(o, s)
      return out

    def plan(*args, **kwargs):
      static, states, rest, _ = split(args)
      return step.plan(static, states, rest, kwargs)
    wrapped.plan = plan
    return wrapped
  return make if fun is None else make(fun)


def _user_paths(names: list[str], args: tuple, paths: list[str]) -> list[str]:
  """`pure`'s paths (`states[0]['l1']['kernel'].value`, `rest[0]['x']`,
  `kwargs['batch']`) under the user's parameter names (`model['l1']['kernel'].value`)."""
  (_, positions), states, rest, _ = args
  others = [k for k in range(len(states) + len(rest)) if k not in positions]

  def name(k: int) -> str:
    return names[k] if k < len(names) else f"[{k}]"
  paths = renamed_paths(paths, "states", {j: name(k) for j, k in enumerate(positions)})
  paths = renamed_paths(paths, "rest", {j: name(k) for j, k in enumerate(others)})
  return [p[len("kwargs['"):].replace("']", "", 1) if p.startswith("kwargs['") else p
          for p in paths]


def _is_graph(x) -> bool:
  return nnx.graph.is_graph_node(x)


def _shifted(jit_kwargs: dict) -> dict:
  """`jit_kwargs` for `pure`, whose states come as one argument: donating any graph
  object's state donates them all."""
  out = dict(jit_kwargs)
  if out.get("donate_argnums") is not None:
    out["donate_argnums"] = (1,)
  return out
