"""The precision pass (Fig. 7): in which dtype a sharded weight is read whole.

A weight the forward pass only ever reads converted to a narrower float
(mixed precision) can be all-gathered in that dtype.

Layout-only equations (`squeeze`, a `reshape` that keeps the row-major
order, `expand_dims`, `pvary`) move no element and change none, so they
commute with a conversion: the pass follows the weight through them. Those
between the weight and the update (`wus.pmap`'s squeeze of the mapped axis,
which both the update and the forward pass read) run on the shard, as the
update does, so the update still reads the weight's own float32 shard; what
they produce is then gathered instead of the weight itself, in its own shape.
Those that only the forward pass reads run on the narrow whole value.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
from jax import lax

from wus.analysis import causes, compat
from wus.analysis.compat import JaxprEqn
from wus.analysis.graph import Graph


@dataclasses.dataclass(frozen=True)
class Narrowed:
  """How the forward pass reads a weight the update keeps sharded: only narrow.

  Attributes:
    dtype: the one narrower float every whole read converts the weight to.
    copies: layout-only equations outside the update between the weight and
      what the update reads (pmap's squeeze): they join the update and run on
      the shard.
    gathered: the values read whole (the weight, or a copy the update holds
      as shards), each all-gathered in `dtype` at its first read.
  """

  dtype: np.dtype
  copies: tuple[int, ...]
  gathered: tuple


def is_copy(eqn: JaxprEqn) -> bool:
  """Whether `eqn` only changes the layout of one operand: same elements, same
  row-major order (squeeze, expand_dims, a reshape without `dimensions`, pvary)."""
  if len(eqn.invars) != 1 or len(eqn.outvars) != 1 or compat.is_literal(eqn.invars[0]):
    return False
  if eqn.primitive in (lax.squeeze_p, compat.pvary_p):
    return True
  if eqn.primitive is lax.reshape_p:
    return eqn.params.get("dimensions") is None
  if eqn.primitive is lax.broadcast_in_dim_p:  # Only size-1 dims added.
    return math.prod(eqn.invars[0].aval.shape) == math.prod(eqn.outvars[0].aval.shape)
  return False


def copy_chain(graph: Graph, start, end) -> list[int] | None:
  """The layout-only equations (`is_copy`, no pvary) leading from `start` to `end`.

  Each value on the way before `end` has exactly one reader and is no output
  of `jaxpr`, so the chain can run on shards with nothing else noticing.

  Args:
    graph: the jaxpr's graph.
    start, end: variables of the jaxpr (the same one: an empty chain).

  Returns:
    The equations' indices in order, or None if there is no such chain.
  """
  chain, v, jaxpr = [], start, graph.jaxpr
  while v is not end:
    rs = graph.readers(v)
    if len(rs) != 1 or v in graph.outputs:
      return None
    eqn = jaxpr.eqns[rs[0]]
    if eqn.primitive is compat.pvary_p or not is_copy(eqn):
      return None
    chain.append(rs[0])
    v = eqn.outvars[0]
  return chain


def narrowed(graph: Graph, x, members: set[int]) -> Narrowed | str:
  """How the equations outside the update `members` read `x`: only narrow, or why not.

  Args:
    graph: the jaxpr's graph.
    x: a weight the update reads as shards (or reads through layout-only
      equations, `is_copy`).
    members: indices of the update's equations.

  Returns:
    The `Narrowed` read, or a reason (a `causes` value: the first equation that reads
    `x` otherwise than converted to one narrower float).
  """
  jaxpr = graph.jaxpr
  reads = {v for i in members for v in jaxpr.eqns[i].invars if not compat.is_literal(v)}

  def to_update(v) -> bool:
    """Whether the update reads `v` or a layout-only copy of it."""
    return v in reads or any(is_copy(jaxpr.eqns[i]) and to_update(jaxpr.eqns[i].outvars[0])
                             for i in graph.readers(v))

  # The values holding x's elements as shards: x, and the copies on its way to the update.
  held, copies, todo = [x], [], [x]
  while todo:
    for i in graph.readers(todo.pop()):
      eqn = jaxpr.eqns[i]
      if is_copy(eqn) and (i in members or to_update(eqn.outvars[0])):
        copies += [] if i in members else [i]
        held.append(eqn.outvars[0])
        todo.append(eqn.outvars[0])
  found, gathered, skip = set(), [], members | set(copies)
  for v in held:
    if graph.only_read_by(v, skip):
      continue
    dtypes = _whole_reads(graph, v, skip)
    if not isinstance(dtypes, set):
      return dtypes
    found |= dtypes
    gathered.append(v)
  if len(found) != 1:
    return causes.ReadInFloats(tuple(sorted(d.name for d in found)))
  return Narrowed(found.pop(), tuple(copies), tuple(gathered))


def _whole_reads(graph: Graph, v, skip: set[int]) -> set[np.dtype] | object:
  """The narrower floats the readers of `v` outside `skip` convert it to.

  The value is all-gathered narrow: it may only flow, through layout-only
  equations, into conversions to a narrower float, and may not be returned.
  A reason instead (a `causes` value), if something reads it otherwise.
  """
  found, todo = set(), [v]
  while todo:
    u = todo.pop()
    if u in graph.outputs:
      return causes.Returned(u.aval.str_short())
    for i in graph.readers(u):
      eqn = graph.jaxpr.eqns[i]
      if u is v and i in skip:
        continue  # The update reads the shard.
      if eqn.primitive is lax.convert_element_type_p:
        new = np.dtype(eqn.params["new_dtype"])
        if not (jnp.issubdtype(new, jnp.floating) and new.itemsize < v.aval.dtype.itemsize):
          return causes.ReadsIn(causes.Eqn.of(eqn, compat.source_line(eqn)), new.name, True)
        found.add(new)
      elif is_copy(eqn):
        todo.extend(eqn.outvars)
      else:
        return causes.ReadsIn(causes.Eqn.of(eqn, compat.source_line(eqn)), u.aval.dtype.name)
  return found
