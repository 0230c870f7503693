"""`wus.nnx_jit`: `flax.nnx.jit` for steps that update NNX objects in place.

A Flax NNX step (`model`, `optimizer` and `metrics` updated in place, as the
NNX MNIST tutorial writes it) is a function of graph objects, not of pytrees.
`nnx_jit` splits them into their graph definitions and states
(`nnx.split`), runs the state step under `wus.jit`, and writes the new states
back into the objects (`nnx.update`), as `nnx.jit` does. Optimizer state the
step keeps sharded lives in the `nnx.Optimizer` as `wus.ShardedArray`s between
calls; `wus.unshard(nnx.state(optimizer))` gives whole arrays.

The state step takes the user's arguments where the user passes them (a graph
object's state in its place) behind one static argument, the graph definitions,
and carries the user's signature behind that one: `static_argnames`,
`donate_argnames` and the Plan's names read the user's parameter names, and
each object's new state comes back at its argument's position (`match_state`'s
first rule).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

from flax import nnx

from wus.analysis import compat
from wus.jit import jit


def nnx_jit(fun: Callable | None = None, /, *, in_shardings: Any = None,
            out_shardings: Any = None, static_argnums: int | Sequence[int] | None = None,
            static_argnames: str | Sequence[str] | None = None,
            donate_argnums: int | Sequence[int] | None = None,
            donate_argnames: str | Sequence[str] | None = None, keep_unused: bool = False,
            device: Any = None, backend: str | None = None, inline: bool = False,
            graph: bool | None = None, graph_updates: bool | None = None,
            **options) -> Callable:
  """Like `flax.nnx.jit`, with the weight update sharded (`wus.jit`).

  The one-line change for an NNX step: `@nnx.jit` becomes `@wus.nnx_jit`,
  with the same keywords.

  Args:
    fun: the step; its arguments may be NNX graph objects (modules,
      `nnx.Optimizer`, metrics), updated in place, and pytrees of arrays.
    in_shardings: as for `nnx.jit`: per dynamic positional argument (static
      ones left out), a sharding or a prefix of the argument's state; a graph
      object's new state comes back with the same sharding.
    out_shardings: as for `nnx.jit`, for what `fun` returns.
    static_argnums: as for `nnx.jit`, positions of `fun`'s parameters.
    static_argnames: as for `nnx.jit`, names of `fun`'s parameters.
    donate_argnums: as for `nnx.jit`: the state of a donated graph object
      (sharded optimizer state included) is consumed by the call and replaced
      by its new state.
    donate_argnames: as for `nnx.jit`.
    keep_unused: as for `nnx.jit`.
    device: as for `nnx.jit`; a step pinned to one device has no data
      parallelism and runs as `nnx.jit` runs it.
    backend: as for `nnx.jit`, the same.
    inline: as for `nnx.jit`.
    graph: accepted as `nnx.jit` accepts it. wus always runs graph mode with
      graph updates (`nnx.split` / `nnx.merge` / `nnx.update`), which runs
      every tree-mode program the same and also shared references.
    graph_updates: accepted, the same.
    **options: wus's options, as for `wus.jit` (`min_shard_size`,
      `objective`, `topology`).

  Returns:
    The step, called like `fun`: its graph-object arguments hold their new
    state afterwards; it returns what `fun` returns (arrays only). The
    optimizer state it keeps sharded (1/N of each tensor per device, §4.2)
    stays in the `nnx.Optimizer` as `wus.ShardedArray`s. `.plan(*args,
    **kwargs)` gives the `wus.Plan`.

  Raises:
    ValueError: a static or donated position or name that `fun`'s signature
      contradicts (as `jax.jit` raises); at call time, as for `wus.jit` (an
      argument donated to an earlier call).
    TypeError: an option `wus.jit` does not take.

  Example:
    >>> @wus.nnx_jit(static_argnames="train", donate_argnames=("model", "optimizer"))
    ... def train_step(model, optimizer, batch, train=True):  # doctest: +SKIP
    ...   ...

  `wus.nnx_jit` is imported when first used (`import wus` does not import
  Flax); where Flax is missing, `wus.nnx_jit` raises an ImportError saying to
  install it.
  """
  del graph, graph_updates  # Graph mode with updates always (see Args).
  jax_kwargs = dict(keep_unused=keep_unused, device=device, backend=backend, inline=inline)

  def make(f: Callable) -> Callable:
    static = compat.static_args(f, static_argnums, static_argnames)
    donated = compat.static_args(f, donate_argnums, donate_argnames)  # The same inference.

    def pure(graphdefs: tuple, /, *args, **kwargs):
      """`f` on states: each graph object's state at its place; the new states back at
      their parameter's position (element 0: what `f` returns)."""
      args, kwargs = list(args), dict(kwargs)
      for key, g in graphdefs:
        if isinstance(key, int):
          args[key] = nnx.merge(g, args[key])
        else:
          kwargs[key] = nnx.merge(g, kwargs[key])
      out = f(*args, **kwargs)
      return out, *_new_states(graphdefs, args, kwargs, names)

    names = _with_leading(pure, f)
    step = jit(pure, in_shardings=in_shardings,
               out_shardings=_out_shardings(out_shardings, in_shardings, static[0], names),
               static_argnums=(0, *(i + 1 for i in static[0])), static_argnames=static[1],
               donate_argnums=tuple(i + 1 for i in donated[0]), donate_argnames=donated[1],
               **jax_kwargs, **options)
    step.front_end = f"wus.nnx_jit({getattr(f, '__name__', 'step')})"  # For its warnings.

    def split(args: tuple, kwargs: dict) -> tuple:
      """(graph definitions, the arguments with states for graph objects, the objects)."""
      args, kwargs = list(args), dict(kwargs)
      graphdefs, objects = [], []
      for key, x in [*enumerate(args), *kwargs.items()]:
        if nnx.graph.is_graph_node(x) and key not in static[0] and key not in static[1]:
          g, state = nnx.split(x)
          graphdefs.append((key, g))
          objects.append(x)
          if isinstance(key, int):
            args[key] = state
          else:
            kwargs[key] = state
      return (tuple(graphdefs), *args), kwargs, objects

    @functools.wraps(f)
    def wrapped(*args, **kwargs):
      args, kwargs, objects = split(args, kwargs)
      out, *states = step(*args, **kwargs)
      for o, s in zip(objects, _in_order(states, args[0], names), strict=True):
        nnx.update(o, s)
      return out

    def plan(*args, **kwargs):
      args, kwargs, _ = split(args, kwargs)
      return step.plan(*args, **kwargs)
    wrapped.plan = plan
    return wrapped
  return make if fun is None else make(fun)


def _with_leading(pure: Callable, f: Callable) -> tuple[str, ...]:
  """Gives `pure` the signature of `f` behind its graph definitions (so `jax.jit` and
  `wus.jit` read `f`'s parameter names); `pure`'s positional parameter names."""
  pure.__name__ = pure.__qualname__ = getattr(f, "__name__", "nnx_step")
  try:
    sig = inspect.signature(f)
  except (TypeError, ValueError):  # No signature (a builtin): positions only.
    return ()
  lead = inspect.Parameter("graphdefs", inspect.Parameter.POSITIONAL_ONLY)
  pure.__signature__ = sig.replace(parameters=[lead, *sig.parameters.values()])
  return tuple(p.name for p in pure.__signature__.parameters.values()
               if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


def _new_states(graphdefs: tuple, args: list, kwargs: dict, names: tuple) -> list:
  """`pure`'s outputs after `f`'s: per positional parameter of `f`, the new state of the graph
  object passed there (None where none is); then, as one dict, the new states of objects
  passed where `f`'s signature names no parameter (paired by name or structure)."""
  out, extra = [None] * max(len(names) - 1, 0), {}
  for key, _ in graphdefs:
    state = nnx.state(args[key] if isinstance(key, int) else kwargs[key])
    p = _position(key, names)
    if p is None:
      extra[str(key)] = state
    else:
      out[p] = state
  return [*out, extra]


def _in_order(states: list, graphdefs: tuple, names: tuple) -> list:
  """The new states `_new_states` laid out, in the order of `graphdefs`."""
  return [states[-1][str(key)] if _position(key, names) is None else states[_position(key, names)]
          for key, _ in graphdefs]


def _position(key: int | str, names: tuple[str, ...]) -> int | None:
  """Where `_new_states` puts the new state of the graph object at `key` (a positional
  index of `f` or a keyword): its parameter's position in `f`; None where `f`'s signature
  names no such positional parameter."""
  if isinstance(key, str):
    key = names.index(key) - 1 if key in names else -1
  return key if 0 <= key < len(names) - 1 else None


def _out_shardings(out_shardings: Any, in_shardings: Any, static: frozenset,
                   names: tuple) -> Any:
  """`pure`'s out_shardings: `out_shardings` for what `f` returns, and for each graph
  object's new state its argument's `in_shardings` entry (as `nnx.jit` gives them; with
  in_shardings, arguments are positional, as for `jax.jit`); None (unspecified) where the
  user gives neither."""
  if out_shardings is None and in_shardings is None:
    return None
  n = max(len(names) - 1, 0)
  if isinstance(in_shardings, (tuple, list)):
    dynamic = [i for i in range(n) if i not in static]
    per_position = dict(zip(dynamic, in_shardings, strict=False))
    return (out_shardings, *(per_position.get(i) for i in range(n)), None)
  return (out_shardings, *[in_shardings] * n, None)  # One sharding or prefix for all.
