"""Data dependencies XLA keeps: `after(values, tokens)` orders a computation without changing it,
and `opaque(ints, like)` hides constants from it.

XLA's copy insertion orders instructions by data dependence alone, and the
CPU backend removes `lax.optimization_barrier` before it runs, so a barrier
orders nothing there. A donated input's buffer can hold an output only if
every reader of the input runs before the output is written; where nothing
orders them, XLA copies the input first. `after` makes `values` depend on
one element of each token, through an OR with a zero XLA cannot fold
(the population count of 32 bits shifted right by 6), so that whatever
consumes the returned values runs after every token's producer. The values
themselves are returned bit for bit.

The tokens' bits are ORed in one fusion; with more than a few, the result
goes through a sort of two elements, which XLA neither fuses into consumers
nor folds, so that the fusion reading every token runs once, not once per
consumer of the zero.

The same sort hides integers: XLA:CPU compiles one kernel per distinct
fused computation, and a slice at a constant offset fused into its consumer
makes each consumer distinct. With the offset read from a sort's result (a
buffer, a parameter of the fusion), the consumers of equal shapes are one
computation and share a kernel.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
from jax import lax

# More tokens than this are combined once, behind a sort (which XLA does not
# fuse into its consumers), instead of in every consumer's fusion.
_FUSED_TOKENS = 4


def after(values: Sequence[jnp.ndarray], tokens: Sequence[jnp.ndarray]) -> list[jnp.ndarray]:
  """`values`, unchanged, as results of a computation that reads every one of `tokens`.

  Args:
    values: arrays of any shape; booleans, integers and real floats are
      tied, other dtypes (complex, PRNG keys) pass through untied.
    tokens: arrays of any shape and dtype; one element of each is read
      (empty ones and those of other dtypes are left out).

  Returns:
    Arrays equal to `values` bit for bit, shapes and dtypes as given.
  """
  zero = zero_after(tokens) if values else None
  return [tied(x, zero) for x in values]


def zero_after(tokens: Sequence[jnp.ndarray]) -> jnp.ndarray | None:
  """A uint32 [] zero computed from one element of each of `tokens` (`after`), which
  `tied` ORs into values; None if no token has bits to read."""
  bits = [b for t in tokens if (b := _bits(t)) is not None]
  if not bits:
    return None
  acc = bits[0]
  for b in bits[1:]:
    acc = lax.bitwise_or(acc, b)
  if len(bits) > _FUSED_TOKENS:
    acc = lax.sort(jnp.concatenate([acc, acc]))[-1:]
  # A population count of 32 bits is at most 32, so shifting it right by 6 is 0.
  return lax.shift_right_logical(lax.population_count(acc), jnp.uint32(6))[0]


def opaque(ints: Sequence[int], like: jnp.ndarray) -> list[jnp.ndarray] | None:
  """int32 scalars equal to `ints`, which XLA can neither fold into constants nor fuse.

  They come out of one sort keyed on an element of `like`: each is a buffer
  of its own, computed after `like`'s producer.

  Args:
    ints: values that fit int32.
    like: any array whose `_bits` exist (non-empty, boolean, integer or float).

  Returns:
    int32 [] scalars equal to `ints`, or None if `like` has no bits to key on.
  """
  key = _bits(like)
  if key is None or not ints:
    return None
  carried = [jnp.full((2,), i, jnp.int32) for i in ints]
  # Two elements: XLA removes a sort of one, and folds a sort of constants.
  return [x[0] for x in lax.sort((jnp.concatenate([key, key]), *carried), num_keys=1)[1:]]


def _bits(t: jnp.ndarray) -> jnp.ndarray | None:
  """The bits of one element of `t` as uint32 [1], or None for an empty or untyped array."""
  # lax, not jnp: each jnp function is a jit of its own to trace, and this runs per tensor.
  if not t.size:
    return None
  x = lax.slice(lax.reshape(t, (t.size,)), (0,), (1,))
  if jnp.issubdtype(x.dtype, jnp.complexfloating):
    x = lax.real(x)
  if x.dtype == jnp.bool_:
    return lax.convert_element_type(x, jnp.uint32)
  if not (jnp.issubdtype(x.dtype, jnp.floating) or jnp.issubdtype(x.dtype, jnp.integer)):
    return None
  return lax.convert_element_type(lax.bitcast_convert_type(x, _uint(x.dtype)), jnp.uint32)


def tied(x: jnp.ndarray, zero: jnp.ndarray | None) -> jnp.ndarray:
  """`x` bit for bit, as `x | zero` on its bits (`zero` from `zero_after`; None: `x`)."""
  if zero is None:
    return x

  def with_zero(bits):
    return lax.bitwise_or(bits, lax.broadcast_in_dim(
        lax.convert_element_type(zero, bits.dtype), bits.shape, ()))
  if x.dtype == jnp.bool_:
    return with_zero(x)
  if not (jnp.issubdtype(x.dtype, jnp.floating) or jnp.issubdtype(x.dtype, jnp.integer)):
    return x
  return lax.bitcast_convert_type(with_zero(lax.bitcast_convert_type(x, _uint(x.dtype))),
                                  x.dtype)


def _uint(dtype) -> jnp.dtype:
  return jnp.dtype(f"uint{8 * jnp.dtype(dtype).itemsize}")
