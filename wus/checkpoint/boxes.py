"""Ranges of a row-major tensor as boxes, and the chunk shapes that keep processes apart.

Pure Python: the geometry `handler` writes and reads shards by.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def boxes(shape: Sequence[int], start: int, stop: int) -> list[tuple[slice, ...]]:
  """Boxes of `shape` covering its row-major elements [start, stop), in order.

  At most 2 * len(shape) - 1 boxes: the rest of a partial first row, the whole
  rows, and the start of a last row, each partial row split the same way one
  dimension down.

  Example:
    >>> boxes((3, 4), 2, 9)   # elements 2..8 of a 3 x 4 tensor
    [(slice(0, 1), slice(2, 4)), (slice(1, 2), slice(0, 4)), (slice(2, 3), slice(0, 1))]
  """
  if start >= stop:
    return []
  if not shape:
    return [()]
  row = math.prod(shape[1:])
  first, start_in = divmod(start, row)
  last, stop_in = divmod(stop, row)
  if first == last:
    return [(slice(first, first + 1), *b) for b in boxes(shape[1:], start_in, stop_in)]
  out = []
  if start_in:
    out += [(slice(first, first + 1), *b) for b in boxes(shape[1:], start_in, row)]
    first += 1
  if last > first:
    out.append((slice(first, last), *(slice(0, d) for d in shape[1:])))
  if stop_in:
    out += [(slice(last, last + 1), *b) for b in boxes(shape[1:], 0, stop_in)]
  return out


def box_shape(box: tuple[slice, ...]) -> tuple[int, ...]:
  return tuple(s.stop - s.start for s in box)


def _divisors(n: int) -> list[int]:
  small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
  return sorted({*small, *(n // d for d in small)})


def chunk_shape(shape: Sequence[int], max_size: int, boundaries: Sequence[int] = ()) -> tuple:
  """The largest chunk (1, ..., 1, c, d_{j+1}, ..., d_{n-1}) with c | d_j, at most
  `max_size` elements, whose row-major length divides every offset in `boundaries`.

  The chunks of such a shape are the consecutive runs of that length in
  row-major order, so no chunk spans a boundary: the ranges between boundaries
  are whole chunks.
  """
  step = math.gcd(*boundaries) if boundaries else 0
  best, best_size = tuple(1 for _ in shape), 1
  for j, d in enumerate(shape):
    rest = math.prod(shape[j + 1:])
    for c in _divisors(d):
      size = c * rest
      if best_size < size <= max(max_size, 1) and (not step or step % size == 0):
        best, best_size = (*(1,) * j, c, *shape[j + 1:]), size
  return best
