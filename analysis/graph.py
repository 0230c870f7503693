"""The graph of one jaxpr: who computes, reads and returns each value, and which are big.

Built once per jaxpr the planner plans (the step, each loop body) and handed
to every pass that walks it: clusters (§3.2), the state kept sharded, loops,
ownership, precision and the order of the all-gathers. Its maps (who computes,
reads and returns each value) are built once per jaxpr however many Graphs of
it are made (memoized while the jaxpr lives, as JAX memoizes per jaxpr), so a
pass that needs them makes a `Graph` rather than its own maps.
"""

from __future__ import annotations

import collections
import dataclasses
import weakref
from collections.abc import Collection

from jax import lax

from wus.analysis import compat, formats
from wus.analysis.compat import Jaxpr, JaxprEqn, Var


class Graph:
  """Producers, readers and outputs of the variables of a jaxpr, and its big values.

  Attributes:
    jaxpr: the jaxpr (not closed).
    num_shards: N, the replicas a big value is sharded over.
    min_size: values with fewer elements are not big (`big`).
    producer: variable -> index of the equation that computes it (not for
      inputs, constants or literals).
    outputs: variable -> its positions among `jaxpr.outvars`.
  """

  def __init__(self, jaxpr: Jaxpr, num_shards: int = 1, min_size: int = 0):
    self.jaxpr, self.num_shards, self.min_size = jaxpr, num_shards, min_size
    maps = _maps(jaxpr)
    self.producer: dict[Var, int] = maps.producer
    self._readers, self._uses = maps.readers, maps.uses
    self.outputs: dict[Var, tuple[int, ...]] = maps.outputs

  def producing(self, v) -> JaxprEqn | None:
    """The equation that computes `v`, or None (an input, a constant or a literal)."""
    i = None if compat.is_literal(v) else self.producer.get(v)
    return None if i is None else self.jaxpr.eqns[i]

  def is_zero(self, v) -> bool:
    """Whether `v` is a literal zero or a broadcast of one (every element zero)."""
    eqn = self.producing(v)
    if eqn is not None and eqn.primitive is lax.broadcast_in_dim_p:
      v = eqn.invars[0]
    return compat.is_zero_literal(v)

  def readers(self, v) -> tuple[int, ...]:
    """The indices of the equations that read `v`, ascending, each once (none for a literal)."""
    return () if compat.is_literal(v) else self._readers.get(v, ())

  def uses(self, v) -> int:
    """How many times `v` is used: as an operand (each time an equation reads it) and as
    an output (each position); 0 for a literal."""
    return 0 if compat.is_literal(v) else self._uses.get(v, 0)

  def only_read_by(self, v, eqns: Collection[int]) -> bool:
    """Whether every equation that reads `v` is one of `eqns` (true if none reads it)."""
    return all(r in eqns for r in self.readers(v))

  def big(self, v) -> bool:
    """Whether `v` is worth sharding: no literal, and a shape `formats.is_shardable_shape`
    takes for N = `num_shards` and `min_size`."""
    return (not compat.is_literal(v)
            and formats.is_shardable_shape(tuple(v.aval.shape), self.num_shards, self.min_size))


@dataclasses.dataclass(frozen=True)
class _Maps:
  """Who computes, reads and returns each variable of one jaxpr (`Graph`'s attributes)."""

  producer: dict
  readers: dict
  outputs: dict
  uses: dict


# jaxpr -> its maps, while the jaxpr lives (the maps hold its variables, not the jaxpr).
_MAPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _maps(jaxpr: Jaxpr) -> _Maps:
  if (maps := _MAPS.get(jaxpr)) is not None:
    return maps
  producer: dict[Var, int] = {}
  readers: dict[Var, dict[int, None]] = {}
  uses: collections.Counter = collections.Counter()
  for i, eqn in enumerate(jaxpr.eqns):
    for v in eqn.outvars:
      producer[v] = i
    for v in eqn.invars:
      if not compat.is_literal(v):
        readers.setdefault(v, {})[i] = None
        uses[v] += 1
  outputs: dict[Var, list[int]] = {}
  for pos, v in enumerate(jaxpr.outvars):
    if not compat.is_literal(v):
      outputs.setdefault(v, []).append(pos)
      uses[v] += 1
  maps = _Maps(producer, {v: tuple(rs) for v, rs in readers.items()},
               {v: tuple(p) for v, p in outputs.items()}, dict(uses))
  _MAPS[jaxpr] = maps
  return maps
