"""The graph of one jaxpr: who computes, reads and returns each value, and which are big.

Built once per jaxpr the planner plans (the step, each loop body) and handed
to every pass that walks it: clusters (§3.2), the state kept sharded, loops,
ownership, precision and the order of the all-gathers.
"""

from __future__ import annotations

from collections.abc import Collection

from wus.analysis import compat, formats
from wus.analysis.compat import Jaxpr, Var


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

  def __init__(self, jaxpr: Jaxpr, num_shards: int, min_size: int = 0):
    self.jaxpr, self.num_shards, self.min_size = jaxpr, num_shards, min_size
    self.producer: dict[Var, int] = {}
    readers: dict[Var, dict[int, None]] = {}
    for i, eqn in enumerate(jaxpr.eqns):
      for v in eqn.outvars:
        self.producer[v] = i
      for v in eqn.invars:
        if not compat.is_literal(v):
          readers.setdefault(v, {})[i] = None
    self._readers = {v: tuple(rs) for v, rs in readers.items()}
    outputs: dict[Var, list[int]] = {}
    for pos, v in enumerate(jaxpr.outvars):
      if not compat.is_literal(v):
        outputs.setdefault(v, []).append(pos)
    self.outputs: dict[Var, tuple[int, ...]] = {v: tuple(p) for v, p in outputs.items()}

  def readers(self, v) -> tuple[int, ...]:
    """The indices of the equations that read `v`, ascending, each once (none for a literal)."""
    return () if compat.is_literal(v) else self._readers.get(v, ())

  def only_read_by(self, v, eqns: Collection[int]) -> bool:
    """Whether every equation that reads `v` is one of `eqns` (true if none reads it)."""
    return all(r in eqns for r in self.readers(v))

  def big(self, v) -> bool:
    """Whether `v` is worth sharding: no literal, and a shape `formats.is_shardable_shape`
    takes for N = `num_shards` and `min_size`."""
    return (not compat.is_literal(v)
            and formats.is_shardable_shape(tuple(v.aval.shape), self.num_shards, self.min_size))
