"""What the all-gathers of a step's whole outputs follow, so that donation copies nothing.

With `donate_argnums`, XLA writes an output into the buffer of a donated
input of the same shape and dtype (JAX pairs them in order). The weights the
sharded step returns whole are all-gathered into such buffers. XLA's copy
insertion orders instructions by data dependence alone (the CPU backend
drops optimization barriers before it runs), so unless a data path orders
every read of the old weight before the all-gather that overwrites it, XLA
copies the whole weight first, every step. (The replicated step has no such
copy only because XLA combines its gradient all-reduces into one
instruction, which follows every read of the weights.)

`gather_after` names values whose producers follow every read: the
gradient all-reduces (their reduce-scatter results; all of them, so that
every all-gather runs after the last reduce-scatter, as the update does),
and the results of reads no gradient follows. Which HLO instruction reads the
weight depends on XLA's fusion: elementwise, layout and reduction ops
(`_DUPLICABLE`) may be duplicated into every consumer's fusion, even into a
layout copy XLA inserts before a matmul's operand (it recomputes a ReLU
there), or into the slice that takes a token. So the reads are the
equations XLA keeps as one instruction reached from the weight through such
ops: a matmul, a collective, a loop (or the equation computing an output).
A read precedes the gradient all-reduces its result flows into, and its
own result, which no fusion recomputes, is a token that follows it.
The rewrite makes the final all-gathers read one element of each value
(`wus.collectives.after`): an ordering, no value changes.

A weight that nothing but the update reads here is read before this
program: `wus.jit` runs only a global step's gradient sums and update as
the sharded program, the forward and backward pass before it, so every
read of a weight there precedes one of the gradient sums, and the
all-gathers follow all of them.
"""

from __future__ import annotations

from collections.abc import Mapping

from jax import lax

from wus.analysis import compat
from wus.analysis.graph import Graph
from wus.analysis.primitives import ELEMENTWISE
from wus.analysis.shardable import Kind

# Primitives XLA may fuse into a consumer, duplicating them where they have
# several: an instruction that reads a weight through them may be any of
# their consumers' fusions.
_DUPLICABLE: frozenset = ELEMENTWISE | frozenset({
    lax.broadcast_in_dim_p, lax.reshape_p, lax.squeeze_p, lax.transpose_p,
    lax.bitcast_convert_type_p, lax.stop_gradient_p, lax.optimization_barrier_p,
    lax.sharding_constraint_p, compat.pvary_p, lax.slice_p, lax.pad_p, lax.concatenate_p,
    lax.rev_p, lax.gather_p, lax.dynamic_slice_p, lax.iota_p,
    lax.reduce_sum_p, lax.reduce_max_p, lax.reduce_min_p, lax.reduce_prod_p, lax.reduce_and_p,
    lax.reduce_or_p, lax.reduce_xor_p, lax.reduce_p, lax.argmax_p, lax.argmin_p,
})


def gather_after(graph: Graph, shard_eqns: Mapping[int, Kind], formats: Mapping,
                 sharded_out: Mapping, *, read_tokens: bool = True) -> tuple[tuple, frozenset]:
  """Values the outputs written into donated buffers must follow (module docstring).

  Those outputs are the ones all-gathered, and the ones computed whole by an
  elementwise equation (an update kept replicated, a metric), whose buffer
  a donated input of the same shape and dtype may be.

  Args:
    graph: the graph of the step's flat jaxpr.
    shard_eqns: its equations run on shards (`JaxprPlan.shard_eqns`).
    formats: the values held as shards (`Plan.formats`).
    sharded_out: outputs returned as shards (`JaxprPlan.sharded_out`).
    read_tokens: whether the results of reads may be tokens; if not, only
      the gradient all-reduces order the all-gathers (a read no gradient sum
      follows then leaves its weight copied).

  Returns:
    (values, tied): variables of `jaxpr`, outputs of gradient all-reduces
    (the rewrite reads their reduce-scatter results) and of reading
    instructions, both empty when nothing needs ordering; and the positions
    of the outputs computed whole that the rewrite ties to them too (the
    all-gathered ones are tied before their all-gathers).
  """
  jaxpr, producer = graph.jaxpr, graph.producer
  eqns = jaxpr.eqns
  given = set(jaxpr.invars)
  outs = [(k, v) for k, v in enumerate(jaxpr.outvars) if k not in sharded_out
          and not compat.is_literal(v) and (v in formats or (
              v not in given and v in producer and eqns[producer[v]].primitive in ELEMENTWISE))]
  inputs = [v for v in jaxpr.invars if any(_aval(v) == _aval(u) for _, u in outs)]
  outs = [(k, v) for k, v in outs if any(_aval(v) == _aval(u) for u in inputs)]
  if not inputs:
    return (), frozenset()
  seeds = [i for i in sorted(shard_eqns) if shard_eqns[i] is Kind.REDUCE_SCATTER]
  summed = _reach(graph, dict.fromkeys(seeds, 1))  # 1: a gradient sum follows the equation.
  # Per equation, the outputs (bit k: outs[k]) it precedes.
  before = _reach(graph, {producer[v]: 1 << k for k, (_, v) in enumerate(outs)
                          if v in producer})
  written = {}  # aval -> the outputs an input of that aval may give its buffer to
  for k, (_, v) in enumerate(outs):
    written[_aval(v)] = written.get(_aval(v), 0) | 1 << k
  need = []
  for v in inputs:
    reads = _reads(graph, v, shard_eqns, set(seeds))
    need += [(summed[i], i) for i in reads if before[i] & written[_aval(v)] != written[_aval(v)]]
    if not reads and seeds:  # Read before the step (module docstring): after every gradient sum.
      need.append((1, None))
  # Every reduce-scatter, as the update itself follows them all (`transforms.schedule`),
  # not a few that cover the reads: one order for every step, owned updates included.
  chosen = [eqns[i].outvars[0] for i in seeds] if any(m for m, _ in need) else []
  rest = dict.fromkeys(next(iter(eqns[i].outvars), None) for m, i in need
                       if not m and read_tokens)
  values = tuple(chosen) + tuple(v for v in rest if v is not None)
  return values, frozenset(k for k, v in outs if v not in formats) if values else frozenset()


def _aval(v) -> tuple:
  return tuple(v.aval.shape), v.aval.dtype


def _reads(graph: Graph, x, shard_eqns: Mapping, seeds: set) -> set[int]:
  """The equations whose instructions may read input `x`, outside the update (module docstring).

  The update's own equations (`shard_eqns`, but for gradient all-reduces)
  read shards, before the all-gathers they feed.
  """
  def skip(i: int) -> bool:
    return i in shard_eqns and i not in seeds

  def fused_away(i: int) -> bool:
    """Whether XLA may fuse equation i into each of its consumers (no output is the step's)."""
    return (jaxpr.eqns[i].primitive in _DUPLICABLE and i not in seeds
            and not any(v in outputs for v in jaxpr.eqns[i].outvars))

  jaxpr, outputs = graph.jaxpr, graph.outputs
  reads, seen, todo = set(), set(), [x]
  while todo:
    for i in graph.readers(todo.pop()):
      if i in seen or skip(i):
        continue
      seen.add(i)
      if fused_away(i):
        todo += jaxpr.eqns[i].outvars
      else:
        reads.add(i)
  return reads


def _reach(graph: Graph, bit: Mapping[int, int]) -> list[int]:
  """Per equation, the OR of `bit` over the equations its results flow into, itself included."""
  eqns = graph.jaxpr.eqns
  reach = [0] * len(eqns)
  for i in reversed(range(len(eqns))):
    r = bit.get(i, 0)
    for v in eqns[i].outvars:
      for j in graph.readers(v):
        r |= reach[j]
    reach[i] = r
  return reach
