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

`gather_after` names, per output, values whose producers follow every read
of the inputs whose buffer that output may take (JAX pairs them in order:
`_may_take`) that does not already precede the output: per read, the first
gradient all-reduce its result flows into (its reduce-scatter result; in a
backward pass the earliest, so that each layer's all-gather may run beside
the backward pass of the layers below, as a hand-written per-tensor ZeRO
runs it, issue 42), and the results of reads no gradient follows. Which HLO
instruction reads the weight depends on XLA's fusion: elementwise, layout and reduction ops
(`_DUPLICABLE`) may be duplicated into every consumer's fusion, even into a
layout copy XLA inserts before a matmul's operand (it recomputes a ReLU
there), or into the slice that takes a token. So the reads are the
equations XLA keeps as one instruction reached from the weight through such
ops: a matmul, a collective, a loop, or the equation computing an output
(which XLA may also recompute in its consumers' fusions: an Adam moment kept
whole, recomputed in the fusion of the new bias, reads the old moment there).
A read precedes the gradient all-reduces its result flows into, and its
own result, which no fusion recomputes, is a token that follows it.
The rewrite makes each all-gather read one element of its outputs' values
(`wus.collectives.after`): an ordering, no value changes. An output computed
whole follows one all-gathered output, whose values include its own.

A weight that nothing but the update reads here is read before this
program: `wus.jit` runs only a global step's gradient sums and update as
the sharded program (a region whose inputs and outputs are not the
step's, so the pairing is unknown), the forward and backward pass before
it, so every read of a weight there precedes one of the gradient sums,
and the all-gathers follow all of them.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

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
                 sharded_out: Mapping, *, read_tokens: bool = True,
                 sharded_in: Collection[int] = (), in_order: bool = True,
                 alone: Callable[[Any], bool] = lambda v: False) -> tuple[tuple, frozenset]:
  """Values each output written into a donated buffer must follow (module docstring).

  Those outputs are the ones all-gathered, and the ones computed whole by an
  elementwise equation (an update kept replicated, a metric), whose buffer
  a donated input of the same shape and dtype may be (`_may_take`).

  Args:
    graph: the graph of the step's flat jaxpr.
    shard_eqns: its equations run on shards (`JaxprPlan.shard_eqns`).
    formats: the values held as shards (`Plan.formats`).
    sharded_out: outputs returned as shards (`JaxprPlan.sharded_out`).
    read_tokens: whether the results of reads may be tokens; if not, only
      the gradient all-reduces order the all-gathers (a read no gradient sum
      follows then leaves its weight copied).
    sharded_in: inputs (positions) that arrive as shards (`JaxprPlan.sharded_in`):
      their buffers hold shards, never a whole output.
    in_order: whether the jaxpr's inputs and outputs are the compiled step's, so that
      JAX's pairing of donated inputs with outputs is known (`_may_take`); if not (a
      region of the step, `wus.jit`), any output may take any input's buffer of its
      shape and dtype.
    alone: whether the reduce-scatter of a gradient all-reduce's result has a
      collective of its own (`collectives.batched.buckets`): a read is tied to the
      first such sum it flows into, if any, rather than to a bucket that may wait
      for the last gradient of the backward pass.

  Returns:
    (after, tied): per output of `jaxpr`, the variables its write must follow,
    outputs of gradient all-reduces (the rewrite reads their reduce-scatter
    results) and of reading instructions (empty when nothing needs ordering,
    `()` for all); and the positions of the outputs computed whole that the
    rewrite ties to one all-gathered output, whose values include theirs.
  """
  jaxpr, producer = graph.jaxpr, graph.producer
  eqns = jaxpr.eqns
  given = set(jaxpr.invars)
  outs = [(k, v) for k, v in enumerate(jaxpr.outvars) if k not in sharded_out
          and not compat.is_literal(v) and (v in formats or (
              v not in given and v in producer and eqns[producer[v]].primitive in ELEMENTWISE))]
  inputs = [v for p, v in enumerate(jaxpr.invars) if p not in sharded_in
            and any(_aval(v) == _aval(u) for _, u in outs)]
  outs = [(k, v) for k, v in outs if any(_aval(v) == _aval(u) for u in inputs)]
  if not inputs:
    return (), frozenset()
  seeds = [i for i in sorted(shard_eqns) if shard_eqns[i] is Kind.REDUCE_SCATTER]
  prefer = sum(1 << s for s, i in enumerate(seeds) if alone(eqns[i].outvars[0]))
  sums, tokens = _needs(graph, shard_eqns, seeds, inputs, outs, in_order, read_tokens, prefer)
  gathered = [k for k, (_, v) in enumerate(outs) if v in formats]
  tied = [k for k, (_, v) in enumerate(outs) if v not in formats and (sums[k] or tokens[k])]
  if gathered:  # A tied output follows one all-gathered output: the one already after most.
    carrier = max(gathered, key=lambda k: (sums[k].bit_count() + len(tokens[k]), -k))
    for k in tied:
      sums[carrier] |= sums[k]
      tokens[carrier].update(tokens[k])
  if not any(sums) and not any(tokens):
    return (), frozenset()
  per_output = [()] * len(jaxpr.outvars)
  for k, (p, _) in enumerate(outs):
    per_output[p] = tuple(eqns[seeds[s]].outvars[0] for s in _bits(sums[k])) + tuple(tokens[k])
  return tuple(per_output), frozenset(outs[k][0] for k in tied)


def _needs(graph: Graph, shard_eqns: Mapping, seeds: list[int], inputs: list, outs: list,
           in_order: bool, read_tokens: bool, prefer: int) -> tuple[list[int], list[dict]]:
  """Per output in `outs`, the gradient sums (bit s: `seeds[s]`) and the results of reads
  (keys) its write must follow: per read of an input whose buffer it may take that does
  not precede it, the first gradient sum the read flows into (in a backward pass the
  earliest; of those in `prefer`, if any), or its own result; every sum after an input
  read before the program."""
  eqns, producer = graph.jaxpr.eqns, graph.producer
  # Per equation, the gradient sums (bit s) and the outputs (bit k: outs[k]) it precedes.
  summed = _reach(graph, {i: 1 << s for s, i in enumerate(seeds)})
  before = _reach(graph, {producer[v]: 1 << k for k, (_, v) in enumerate(outs)
                          if v in producer})
  every = (1 << len(seeds)) - 1
  sums, tokens = [0] * len(outs), [{} for _ in outs]
  for v, mine in _may_take(graph.jaxpr.invars, inputs, outs, in_order):
    reads = _reads(graph, v, shard_eqns, set(seeds))
    for i in reads:
      first = summed[i] & prefer or summed[i]
      first &= -first
      token = None if first or not read_tokens else next(iter(eqns[i].outvars), None)
      for k in _bits(mine & ~before[i]):
        sums[k] |= first
        if token is not None:
          tokens[k][token] = None
    if not reads or not in_order:  # Read before (module docstring): after every sum.
      for k in _bits(mine):
        sums[k] = every
  return sums, tokens


def _may_take(invars, inputs: list, outs: list, in_order: bool) -> list[tuple]:
  """(input, bits of `outs` that may take its buffer) per input in `inputs`.

  JAX pairs donated inputs with outputs of the same shape and dtype in order
  (`jax._src.interpreters.mlir._set_up_aliases`, JAX 0.10.2 to 0.12, where the outputs'
  shardings are given, as every program of the rewrite gives them): the j-th such output
  takes the j-th donated input, which is at least the j-th input of its shape and dtype,
  whichever are donated. So output j may take input i only if i >= j (with `in_order`;
  otherwise any output of its shape and dtype). Outputs and inputs this does not count
  (shards, outputs computed otherwise) only move the pairs later, which the rule allows.
  A pairing it did not allow would cost a copy of the buffer, not a value: XLA's copy
  insertion copies a donated buffer still to be read before an output overwrites it.
  """
  of_aval: dict = {}  # aval -> bits of outs of it, in order
  for k, (_, u) in enumerate(outs):
    of_aval.setdefault(_aval(u), []).append(1 << k)
  wanted, rank, pairs = set(inputs), {}, []
  for v in invars:
    a = _aval(v)
    rank[a] = rank.get(a, 0) + 1
    if v in wanted:
      pairs.append((v, sum(of_aval[a][:rank[a]] if in_order else of_aval[a])))
  return pairs


def _bits(mask: int) -> list[int]:
  """The positions of the set bits of `mask`, lowest first."""
  out = []
  while mask:
    low = mask & -mask
    out.append(low.bit_length() - 1)
    mask ^= low
  return out


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
    """Whether XLA may fuse equation i into each of its consumers."""
    return jaxpr.eqns[i].primitive in _DUPLICABLE and i not in seeds

  jaxpr, outputs = graph.jaxpr, graph.outputs
  reads, seen, todo = set(), set(), [x]
  while todo:
    for i in graph.readers(todo.pop()):
      if i in seen or skip(i):
        continue
      seen.add(i)
      if fused_away(i):
        todo += jaxpr.eqns[i].outvars
      # An output is one instruction, and may be recomputed in its consumers' fusions too.
      if not fused_away(i) or any(v in outputs for v in jaxpr.eqns[i].outvars):
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
