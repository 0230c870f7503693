"""Which cluster a reduction of big tensors to small values joins, to run on shards.

A reduction of a big tensor to a small value (a norm's sum of squares) that
runs whole reads that tensor whole on every replica. Run on shards, each
replica reduces its shard and an all-reduce of the small partial results
combines them (`Kind.REDUCE_ALL`, Fig. 6). Two kinds join a cluster:

* those the update reads through small values (LARS and LAMB's ‖w‖, a global
  norm's clip, §4.1): they join the first cluster equation their result
  reaches (`reached_member`);
* those that read what a cluster computes or reads on shards and whose results
  only equations outside every cluster read (a gradient norm a step returns
  as a metric, `optax.global_norm(grads)`): run whole, they keep the
  cluster's tensors whole on every replica (`clusters._kept_whole`), a
  gradient all-reduced whole or its transpose copied whole. They join the
  cluster they read from (`read_member`), unless what they read is the step's
  state itself (a weight's norm, which the forward pass may read too).
"""

from __future__ import annotations

from wus.analysis.graph import Graph
from wus.analysis.redundancy import Redundancy


def reached_member(start: int, graph: Graph, members, facts: Redundancy, axes: frozenset,
                   limit: int = 64) -> int | None:
  """The first cluster equation that `start`'s outputs reach through equations
  every replica repeats (a norm's sqrt, a trust ratio), or None; looks at
  `limit` equations at most."""
  seen, todo = {start}, [start]
  while todo and len(seen) <= limit:
    for v in graph.jaxpr.eqns[todo.pop(0)].outvars:
      for r in graph.readers(v):
        if r in members:
          return r
        if r not in seen and facts.repeats(graph.jaxpr.eqns[r], axes):
          seen.add(r)
          todo.append(r)
  return None


def read_member(start: int, graph: Graph, members, kind, state=frozenset(),
                limit: int = 64) -> int | None:
  """A cluster equation that computes, or reads (but for `state`: a weight's norm in the
  loss stays as the forward pass computes it), a big value that `start` is computed from
  through equations that can run on shards (`kind` not None, outside every cluster: the
  `x * x` of `sum(x * x)`), or None; looks at `limit` equations at most."""
  eqns = graph.jaxpr.eqns
  seen, todo = {start}, [start]
  while todo and len(seen) <= limit:
    for v in filter(graph.big, eqns[todo.pop(0)].invars):
      p = graph.producer.get(v)
      if p in members:
        return p
      r = next((r for r in graph.readers(v) if r in members), None)
      if r is not None and v not in state:
        return r
      if p is not None and p not in seen and kind(p) is not None:
        seen.add(p)
        todo.append(p)
  return None
