"""The step's arguments as the operands of its update region (`wus.jit`): which state
pairs are the region's, the planner's view of each argument (`planning.Argument`: the
region operand it enters as, its next value) and the name of each value the region
reads, as the Plan prints it.

The region (`wus.jit_region`) reads some of the step's arguments directly, some through a
sharding constraint (`eqx.filter_shard`), and values the rest of the step computes; the
Plan names its operands by the arguments' paths where it can.
"""

from __future__ import annotations

from wus.analysis import compat, global_view
from wus.analysis.graph import Graph
from wus.analysis.planning import Argument
from wus.matching import StateMatch


def region_state(jaxpr, region: global_view.Region, match: StateMatch) -> tuple[dict, dict]:
  """The step's state pairs (`match`) as the region's: (region output -> region input,
  region input -> how it was matched), for state only the region reads and writes (or
  reads and passes on unchanged)."""
  inside = set(region.eqns)
  outside_reads = {v for i, e in enumerate(jaxpr.eqns) if i not in inside for v in e.invars
                   if not compat.is_literal(v)}
  region_in = {v: k for k, v in enumerate(region.invars)}
  region_out = {v: k for k, v in enumerate(region.outvars)}
  returned = {w for w in jaxpr.outvars if not compat.is_literal(w)}
  pairs, how = {}, {}
  for o, i in match.pairs.items():
    ov, iv = jaxpr.outvars[o], jaxpr.invars[i]
    unchanged = ov is iv and jaxpr.outvars.count(iv) == 1
    if (not compat.is_literal(ov) and ov in region_out and iv in region_in
        and iv not in outside_reads and (iv not in returned or unchanged)):
      pairs[region_out[ov]] = region_in[iv]
      how[region_in[iv]] = match.how[i]
  return pairs, how


def arguments(jaxpr, region: global_view.Region, paths: list[str], match: StateMatch,
               out_paths: list[str]) -> tuple[Argument, ...]:
  """The step's argument leaves for the planner (`planner.Argument`): each with the region
  input it enters as (itself, or a sharding constraint of it) and its next value."""
  operand = {v: k for k, v in enumerate(region.invars)}
  for e in jaxpr.eqns:  # `x` of `eqx.filter_shard((x, y), sharding)` enters as its result.
    if (compat.is_sharding_constraint(e) and not compat.is_literal(e.invars[0])
        and e.outvars[0] in operand):
      operand.setdefault(e.invars[0], operand[e.outvars[0]])
  nexts = {i: o for o, i in match.pairs.items()}
  return tuple(Argument(path, tuple(v.aval.shape), v.aval.dtype, operand.get(v),
                        f"next value {out_paths[nexts[k]]} (by {match.how[k]})"
                        if k in nexts else "")
               for k, (path, v) in enumerate(zip(paths, jaxpr.invars, strict=True)))


def name_of(jaxpr, v, in_pos: dict, paths: list[str]) -> str:
  """A name for a value the region reads: the step's argument path for an argument, also
  through sharding constraints (`x` of `eqx.filter_shard((x, y), sharding)`); else where
  the forward or backward pass computes it, or a constant the step closes over
  (optax.contrib.mechanize's, say)."""
  eqn, producing = None, Graph(jaxpr).producing
  while v not in in_pos:
    eqn = producing(v)
    if eqn is None or not compat.is_sharding_constraint(eqn) or compat.is_literal(eqn.invars[0]):
      break
    v = eqn.invars[0]
  if v in in_pos:
    return paths[in_pos[v]]
  if eqn is None:
    return f"<constant {v.aval.str_short()}>"
  return f"<{eqn.primitive} at {compat.source_line(eqn)}>"
