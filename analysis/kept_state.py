"""The state a cluster keeps sharded between steps (§4.2): its state pairs.

A weight or optimizer-state input keeps its shards from one step to the next
when the cluster that updates it is its only reader (`pairs`), possibly
through the layout-only equations `wus.pmap` adds (`through_copies`,
`passed_through`), or when every other read converts it to a narrower float
first (mixed precision, Fig. 4 right, Fig. 7). `continued` finds the rest of
a replicated update that no cluster holds, so the Plan lists its state.

`ctx` throughout is the planning's `planning.PlanningContext`, of which this
module reads `facts` (the step's `Redundancy`), `axes` (the replica axes),
`num_shards`, and `big` (whether a value is large enough to shard).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from wus.analysis import clusters as clusters_lib
from wus.analysis import causes, compat, layouts, precision, shardable
from wus.analysis.compat import Jaxpr, source_line
from wus.analysis.graph import Graph
from wus.analysis.planning import PlanningContext
from wus.analysis.shardable import Kind


def passed_through(graph: Graph, in_pos: int, out_pos: int,
                   ctx: PlanningContext) -> list[int] | None:
  """The layout-only equations (`wus.pmap`'s squeeze and expand_dims) by which
  output `out_pos` returns input `in_pos` unchanged, if nothing else reads it
  and it is identical on every replica and worth sharding; else None.

  Such state (a GAN's discriminator state passed through the generator's
  step) stays sharded between steps instead of being gathered and re-sharded
  by each step that does not update it.
  """
  jaxpr = graph.jaxpr
  v, y = jaxpr.invars[in_pos], jaxpr.outvars[out_pos]
  if (compat.is_literal(y) or not ctx.big(v) or not ctx.facts.is_redundant(v, ctx.axes)
      or graph.readers(y) or jaxpr.outvars.count(y) != 1):
    return None
  return precision.copy_chain(graph, v, y)


def pairs(c: clusters_lib.Cluster, layout: layouts.Layout, graph: Graph,
          members: set[int], candidates: Mapping[int, int],
          narrow: dict | None = None, gathers: dict | None = None,
          why_whole: dict | None = None, through: frozenset = frozenset()) -> dict[int, int]:
  """The (output, input) state pairs this cluster can keep sharded between steps.

  A pair qualifies when only the cluster reads the input. With `narrow` (a
  loop body, or `shard_weights`), an input that is also read whole, but only
  ever converted to a narrower float first (the forward pass of
  mixed-precision training), qualifies too: it is all-gathered in that dtype
  where read (Fig. 4 right, Fig. 7); `narrow` records input -> dtype, and
  `gathers` the values gathered narrow (the input, or a layout-only copy the
  cluster holds as shards, `precision.Narrowed.gathered`) -> dtype. With
  `why_whole`, an input that does not qualify for its whole reads records
  input position -> why. `through` are inputs the cluster reads through
  layout-only equations that others read too (`through_copies`): only the
  cluster reads them, but whole through those copies. `graph` is the
  jaxpr's (`graph.Graph`).
  """
  jaxpr, outvars = graph.jaxpr, graph.outputs
  pairs = {}
  for out_pos, in_pos in candidates.items():
    x, y = jaxpr.invars[in_pos], jaxpr.outvars[out_pos]
    if compat.is_literal(y) or not (y in c.returned and x in c.reads and x not in outvars
            and y not in layout.partial and x not in layout.whole_reads
            and x.aval.dtype == y.aval.dtype
            and layout.formats.get(x) == layout.formats.get(y) is not None):
      continue
    if graph.only_read_by(x, members) and x not in through:
      pairs[out_pos] = in_pos
    elif narrow is not None:
      read = precision.narrowed(graph, x, members)
      if not isinstance(read, precision.Narrowed) or read.copies:
        # Copies outside the cluster would read the narrow whole value and
        # hand it to the update: the cluster must hold them (through_copies).
        if why_whole is not None:
          why_whole[in_pos] = (read if not isinstance(read, precision.Narrowed)
                               else causes.ThroughLayoutChange())
        continue
      pairs[out_pos] = in_pos
      narrow[x] = read.dtype
      gathers.update(dict.fromkeys(read.gathered, read.dtype))
  return pairs


def through_copies(c: clusters_lib.Cluster, layout: layouts.Layout, graph: Graph,
                   candidates: Mapping[int, int], ctx: PlanningContext, why_whole: dict
                   ) -> tuple[clusters_lib.Cluster, layouts.Layout, frozenset]:
  """`c` reading the weights it updates through layout-only equations (shard_weights).

  `wus.pmap` squeezes the mapped axis off every argument: the update reads
  the squeezed weight, which the forward pass reads too, so the squeeze is
  no cluster equation (clusters grow backward only through values that only
  they read) and the weight is no state pair. When the forward pass reads
  the weight only narrow (`precision.narrowed`), the squeeze joins the
  cluster and runs on the shard: the update reads the float32 shard, and the
  forward pass the squeezed weight, all-gathered narrow.

  Returns:
    The cluster, its layout, and the weights it now reads through copies;
    `c`, `layout` and none when nothing qualifies or the formats do not fit.
    `why_whole` records weights kept whole: input position -> why.
  """
  members, copies, weights = set(c.eqns), set(), []
  kind_ctx = shardable.Context(ctx.facts, ctx.axes)
  jaxpr, outvars = graph.jaxpr, graph.outputs
  for out_pos, in_pos in candidates.items():
    x, y = jaxpr.invars[in_pos], jaxpr.outvars[out_pos]
    if (compat.is_literal(y) or y not in c.returned or x in c.reads or x in outvars
        or not ctx.big(x) or x.aval.dtype != y.aval.dtype
        or not ctx.facts.is_redundant(x, ctx.axes)):
      continue
    read = precision.narrowed(graph, x, members)
    if not isinstance(read, precision.Narrowed):
      why_whole[in_pos] = read
    elif read.copies and all(shardable.shard_kind(jaxpr.eqns[i], kind_ctx) is Kind.LAYOUT
                             and all(map(ctx.big, jaxpr.eqns[i].outvars)) for i in read.copies):
      copies |= set(read.copies)
      weights.append(in_pos)
  if not copies:
    return c, layout, frozenset()
  wider = _with_copies(c, jaxpr, sorted(copies), ctx.big)
  wider_layout = layouts.assign(jaxpr, wider, ctx.num_shards, ctx.big)
  if not isinstance(wider_layout, layouts.Layout):
    why_whole.update(dict.fromkeys(weights, causes.NoShardsRead(wider_layout)))
    return c, layout, frozenset()
  return wider, wider_layout, frozenset(jaxpr.invars[k] for k in weights)


def _with_copies(c: clusters_lib.Cluster, jaxpr: Jaxpr, copies: list[int],
                 big) -> clusters_lib.Cluster:
  """`c` with the layout-only equations `copies` run on shards too.

  Their results are read whole elsewhere only narrow: those reads are the
  narrow all-gathers `cost.decide` counts as `extra_gather`, so they are
  not `outside_readers` (whose whole reads would need a shard rule).
  """
  eqns = tuple(sorted({*c.eqns, *copies}))
  made = {*c.sharded, *(v for i in copies for v in jaxpr.eqns[i].outvars)}
  reads = tuple(dict.fromkeys(v for i in eqns for v in jaxpr.eqns[i].invars
                              if big(v) and v not in made))
  return dataclasses.replace(
      c, eqns=eqns, kinds={**c.kinds, **dict.fromkeys(copies, Kind.LAYOUT)},
      sharded=(*c.sharded, *(v for i in copies for v in jaxpr.eqns[i].outvars)), reads=reads)


def continued(graph: Graph, c: clusters_lib.Cluster, clustered: set[int],
              state_pairs: Mapping[int, int], ctx: PlanningContext,
              taken: set[int]) -> tuple[clusters_lib.Cluster, dict]:
  """The rest of a replicated cluster's weight update, which no cluster holds.

  Growth stops at an equation with no shard rule (a matmul with the weight, a
  product); the equations after it that every replica still repeats (all
  outputs identical across `ctx.axes`, no side effects), with the ones of that
  kind that feed them (the momentum of the same tensor), continue the same
  update. Returned as a cluster with no seeds or equations, only the big
  inputs they read (`reads`) and the outputs they return (`returned`),
  so that the Plan lists them with the cluster that keeps them whole; and the
  pairs of `state_pairs` whose input only this update reads (state, not weight).
  Equations in `taken` continue an earlier cluster's update, which lists them: they are
  not followed; the ones found are added to `taken`.
  """
  jaxpr, producer = graph.jaxpr, graph.producer
  seen: set[int] = set()
  todo = [r for v in c.sharded for r in graph.readers(v)] + list(c.kept_whole)
  while todo:
    i = todo.pop()
    if (i in seen or i in clustered or i in taken
        or not ctx.facts.repeats(jaxpr.eqns[i], ctx.axes)):
      continue
    seen.add(i)
    eqn = jaxpr.eqns[i]
    todo += [r for v in eqn.outvars for r in graph.readers(v)]
    todo += [producer[v] for v in eqn.invars if not compat.is_literal(v) and v in producer]
  inputs = set(jaxpr.invars) - set(c.reads)
  reads = {v: None for r in sorted(seen) for v in jaxpr.eqns[r].invars
           if not compat.is_literal(v) and v in inputs and ctx.big(v)}
  made = {v for r in seen for v in jaxpr.eqns[r].outvars}
  outputs = {v: p for v, p in graph.outputs.items()
             if v in made and ctx.big(v) and v not in c.returned}
  taken |= seen
  update = seen | set(c.eqns)
  pairs = {o: k for o, k in state_pairs.items()
           if jaxpr.invars[k] in reads and graph.only_read_by(jaxpr.invars[k], update)}
  return clusters_lib.Cluster((), {}, (), (), tuple(reads), {}, outputs), pairs


def whole_reader(graph: Graph, x, clustered: set[int], ctx: PlanningContext) -> str | None:
  """A reader of `x` outside the clusters (`clustered`) that every replica repeats and
  that has no shard rule (a `sort` of the momentum), in words ("sort at f.py:5"), or
  None: what keeps state whole whose next value an update computes."""
  kind_ctx = shardable.Context(ctx.facts, ctx.axes)
  for r in graph.readers(x):
    eqn = graph.jaxpr.eqns[r]
    if (r not in clustered and ctx.facts.repeats(eqn, ctx.axes)
        and shardable.shard_kind(eqn, kind_ctx) is None):
      return causes.Eqn.of(eqn, source_line(eqn))
  return None
