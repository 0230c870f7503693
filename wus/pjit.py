"""`wus.pjit`: `jax.experimental.pjit.pjit`'s signature and rules, on `wus.jit`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax

from wus.jit import JitStep, jit
from wus.jit_arguments import REPLICATED

_UNSPECIFIED = object()  # pjit's default: no sharding given (None means replicated).


def pjit(fun: Callable, in_shardings: Any = _UNSPECIFIED, out_shardings: Any = _UNSPECIFIED,
         static_argnums: int | Sequence[int] | None = None,
         static_argnames: str | Sequence[str] | None = None,
         donate_argnums: int | Sequence[int] | None = None,
         donate_argnames: str | Sequence[str] | None = None, keep_unused: bool = False,
         device: Any = None, backend: str | None = None, inline: bool = False,
         compiler_options: dict[str, Any] | None = None, **options) -> JitStep:
  """Like `jax.experimental.pjit.pjit`, with the weight update sharded (`wus.jit`).

  The one-line change for pjit-era code: `from jax.experimental.pjit import pjit`
  becomes `from wus import pjit`. As with pjit, `in_shardings` and `out_shardings`
  may be given by position; their PartitionSpecs name axes of the mesh of the
  legacy `with mesh:` context at call time (or of `jax.set_mesh`'s), and None
  there means replicated on that mesh. The step then runs as `wus.jit` runs it:
  the gradient sums over the batch axes reduce-scattered, the update on 1/N of
  every tensor, the optimizer state kept sharded between calls (§4).

  Args:
    fun: the step, as for pjit.
    in_shardings: as for pjit: a pytree prefix of the dynamic positional
      arguments of Shardings, PartitionSpecs or None (replicated).
    out_shardings: as for pjit, for the outputs.
    static_argnums: as for pjit.
    static_argnames: as for pjit.
    donate_argnums: as for pjit.
    donate_argnames: as for pjit.
    keep_unused: as for pjit.
    device: as for pjit (the step then runs as pjit runs it: one device).
    backend: as for pjit, the same.
    inline: as for pjit.
    compiler_options: as for pjit.
    **options: wus's options, as for `wus.jit` (`min_shard_size`, `objective`,
      `topology`).

  Returns:
    A `wus.JitStep`, called like the pjit of `fun`.

  Example:
    >>> step = pjit(train_step, in_shardings=(P(), P(), P("data")),
    ...             out_shardings=(P(), P(), None))  # doctest: +SKIP
    >>> with mesh:  # doctest: +SKIP
    ...   params, opt_state, loss = step(params, opt_state, batch)
  """
  def pjit_rule(shardings):
    if shardings is _UNSPECIFIED:
      return None
    return jax.tree.map(lambda s: REPLICATED if s is None else s, shardings,
                        is_leaf=lambda s: s is None or isinstance(s, (jax.sharding.Sharding,
                                                                     jax.sharding.PartitionSpec)))
  return jit(fun, in_shardings=pjit_rule(in_shardings), out_shardings=pjit_rule(out_shardings),
             static_argnums=static_argnums, static_argnames=static_argnames,
             donate_argnums=donate_argnums, donate_argnames=donate_argnames,
             keep_unused=keep_unused, device=device, backend=backend, inline=inline,
             compiler_options=compiler_options, **options)
