"""The updates no all-reduce reaches, and the updates of state beside a cluster.

An update that no all-reduce reaches grows from its roots (`find_roots`): values identical
on every replica that it reads together with state of their shape (a gradient AD formed
from invariant values, or that the caller all-reduced before the region). A cluster reads
its shard of a root by a local slice, no communication.

State a cluster reads may also be updated by equations the cluster does not reach (SAM's
`cache`, the old weights kept for the next outer step; an average of the weights before
the step): run whole, they would keep that state whole on every replica. Those that only
outputs and each other read join the cluster (`beside`), so the state stays sharded,
where nothing else reads the state whole (a weight the forward pass reads stays whole,
and so do the equations beside its update).
"""

from __future__ import annotations

import jax.numpy as jnp

from wus.analysis.compat import Var
from wus.analysis.graph import Graph
from wus.analysis.redundancy import Redundancy
from wus.analysis.shardable import REDUCING, Context, Kind, shard_kind


def find_roots(graph: Graph, facts: Redundancy, axes: frozenset, state, taken: set[int],
               kind=None) -> frozenset:
  """The roots of the updates of `state` that no cluster reaches.

  The update of a state input s is what every replica repeats on its way from
  s to the outputs: the equations with a shard kind reachable from s's readers
  through such equations, that reach an output. No all-reduce need feed it
  (a weight decay AD forms from invariant values after a scalar psum; a
  gradient already all-reduced outside the region). Its roots are the values
  it reads but does not compute that have s's elements (non-unit dims), are
  floats, are identical on every replica and are not state themselves: the
  gradient entering the momentum. A cluster grown from a root reads it by a
  local slice (`collectives.shard`, no communication).

  Args:
    graph: the flat jaxpr's graph (its `big` values are the tensors worth sharding).
    facts: its redundancy analysis.
    axes: the replica axes.
    state: the jaxpr's state inputs.
    taken: equations already in clusters: state one of them reads is skipped.
    kind: `find_clusters`' shard kind of an equation index (None: computed).

  Returns:
    The roots (variables of `jaxpr`).
  """
  jaxpr, big = graph.jaxpr, graph.big
  if kind is None:
    ctx = Context(facts, frozenset(axes))

    def kind(i: int) -> Kind | None:
      eqn = jaxpr.eqns[i]
      if not facts.repeats(eqn, frozenset(axes)):
        return None
      k = shard_kind(eqn, ctx)
      return k if k is not None and any(map(big, k.big_values(eqn))) else None

  state = frozenset(state)
  found: set = set()
  for s in state:
    if (not big(s) or not facts.is_redundant(s, frozenset(axes))
        or any(r in taken for r in graph.readers(s))):
      continue
    update = update_of(s, graph, kind)
    made = {v for i in update for v in jaxpr.eqns[i].outvars}
    shape = _nonunit(s)
    found.update(v for i in update for v in jaxpr.eqns[i].invars
                 if big(v) and v not in made and v not in state and _nonunit(v) == shape
                 and jnp.issubdtype(v.aval.dtype, jnp.floating)
                 and facts.is_redundant(v, frozenset(axes)))
  return frozenset(found)


def update_of(s: Var, graph: Graph, kind) -> set[int]:
  """What every replica repeats on its way from `s` to the outputs: the equations with a
  shard kind reachable from `s`'s readers through such equations, that reach an output."""
  reached, todo = set(), [r for r in graph.readers(s) if kind(r) is not None]
  while todo:  # Forward from s through equations with a shard kind.
    i = todo.pop()
    if i not in reached:
      reached.add(i)
      todo += [r for v in graph.jaxpr.eqns[i].outvars for r in graph.readers(v)
               if kind(r) is not None]
  update: set[int] = set()
  for i in sorted(reached, reverse=True):  # Those that reach an output (readers come later).
    if any(v in graph.outputs or any(r in update for r in graph.readers(v))
           for v in graph.jaxpr.eqns[i].outvars):
      update.add(i)
  return update


def beside(s: Var, graph: Graph, kind, members) -> set[int]:
  """The equations of state `s`'s update (`update_of`) outside `members` (the clusters'
  equations) whose results only outputs and each other read, reductions excepted (a
  weight's norm stays as the step computes it): SAM's `cache * (1 - first) + params *
  first`, beside the cluster that reads `cache`. Empty if anything else reads `s` (a
  weight the forward pass reads is whole anyway: run on shards, they would only add an
  all-gather)."""
  eqns, new = graph.jaxpr.eqns, set()
  for i in sorted(update_of(s, graph, kind) - set(members), reverse=True):
    if kind(i) not in REDUCING and all(
        r in new for v in eqns[i].outvars for r in graph.readers(v)):
      new.add(i)
  return new if all(r in members or r in new for r in graph.readers(s)) else set()


def _nonunit(v) -> tuple[int, ...]:
  return tuple(d for d in v.aval.shape if d != 1)
