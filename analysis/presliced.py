"""Inputs of `wus.jit`'s update region that it reads only as shards: handed to it split.

The region runs as a shard_map inside the `jax.jit` program GSPMD partitions. A region
input a loop stacks (the gradients of scanned layers, all-reduced layer by layer inside
the backward loop, transposed to their weights' layout) that the rewritten update reads
only as this replica's shard would enter the shard_map whole, its shard a local slice
inside: GSPMD cannot see that each device reads a slice, so it builds the whole value on
every device, in the loop. Handed to the region as the global array of its shards
(`ShardedLayout.data_sharding`), the value is split where the loop writes it: the loop
keeps each device's slice only, as for a sharded optimizer update written by hand
(MaxText's `shard_optimizer_over_data`). The values are the same: the shard is the slice.
"""

from __future__ import annotations

from collections.abc import Mapping

from wus.analysis import compat, global_view
from wus.analysis.formats import Format, ShardFormat
from wus.analysis.graph import Graph
from wus.analysis.shardable import Kind

# Rules that read their big operand as its shard in the value's own format (`rewrite`).
_READ_AS_SHARD = frozenset({Kind.ELEMENTWISE, Kind.LAYOUT, Kind.IDENTITY, Kind.REDUCE,
                            Kind.REDUCE_ALL, Kind.DOT_ALL})


def stacked(jaxpr, invars) -> frozenset[int]:
  """The positions among `invars` (a region's inputs in the step's flat jaxpr) of the
  values a loop stacks, one row per iteration (a scan's outputs that are no carry: the
  gradients of scanned layers), or such a value with its elements moved (transposed to
  the weight's layout). GSPMD splits those rows where the loop writes them. A carry (a
  gradient accumulated over micro-batches) is left whole: split, it has GSPMD partition
  the loop's own computation anew, which changes its rounding."""
  graph = Graph(jaxpr)
  out = set()
  for k, v in enumerate(invars):
    eqn = graph.producing(v)
    while eqn is not None and global_view.moves_elements(eqn):
      v, eqn = eqn.invars[0], graph.producing(eqn.invars[0])
    if (eqn is not None and eqn.primitive is compat.scan_p
        and eqn.outvars.index(v) >= compat.loop(eqn).num_carry):
      out.add(k)
  return frozenset(out)


def taken_as_shards(graph: Graph, jaxpr_plan, formats: Mapping,
                    candidates: frozenset[int]) -> dict[int, Format]:
  """The inputs of `jaxpr` (a `wus.jit` region) that the program takes as the global
  arrays of their shards, with their formats (`JaxprPlan.presliced`).

  Args:
    graph: the graph of the region's flat jaxpr (the planner's).
    jaxpr_plan: its plan, before this choice (`JaxprPlan`).
    formats: the values held as shards (`Plan.formats`).
    candidates: the positions the front end may hand split (`PlanRequest.presliced`:
      values a loop stacks, `stacked`, whose placement splits nothing, on a mesh of Auto
      axes: with Explicit ones each value's type fixes its layout, and GSPMD would not
      split it where it is computed).

  Returns:
    Among `candidates`, the inputs held as shards (a cluster's roots) that are no state,
    not returned, in a format of the Plan's own axes alone whose shards are the blocks of
    the leading dim, and read only by equations that read them as shards in that format.
  """
  jaxpr, out = graph.jaxpr, {}
  for k in sorted(candidates):
    v = jaxpr.invars[k]
    fmt = formats.get(v)
    if (k in jaxpr_plan.sharded_in or not isinstance(fmt, ShardFormat) or fmt.copy_axes
        or fmt.blocks or v in graph.outputs or not graph.readers(v)
        or not _splits_leading_dim(fmt)):
      continue
    if all(_reads_shard(jaxpr_plan.shard_eqns.get(i), jaxpr.eqns[i], v)
           for i in graph.readers(v)):
      out[k] = fmt
  return out


def _splits_leading_dim(fmt: ShardFormat) -> bool:
  """Whether `fmt`'s shards are the blocks of the value's leading dim cut evenly: a split
  GSPMD lays out as such (P(axes) on dim 0), where it computes the value. Another (rows
  of merged dims, padding) would have GSPMD repartition the loop computing it."""
  return bool(fmt.shape) and fmt.shape[0] % fmt.num_shards == 0


def _reads_shard(kind: Kind | None, eqn, v) -> bool:
  """Whether equation `eqn`, run by `kind`, reads `v` as its shard (not whole)."""
  if kind not in _READ_AS_SHARD:
    return False
  if kind is Kind.ELEMENTWISE:
    return all(tuple(o.aval.shape) == tuple(v.aval.shape) for o in eqn.outvars)
  if kind in (Kind.REDUCE, Kind.REDUCE_ALL, Kind.LAYOUT, Kind.IDENTITY):
    return eqn.invars[0] is v and len(eqn.invars) == 1
  return True  # DOT_ALL: both operands as shards.
