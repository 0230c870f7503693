"""Loops and conditionals in the planner (§3.2, §4.2, Fig. 4).

A while or scan body whose update runs on shards gets its own plan: carried
optimizer state stays sharded across iterations; a weight the forward pass
reads whole is all-gathered where it moves the fewest bytes (Fig. 4 left or
right); a conditional whose predicate follows an iteration counter runs every
k steps (the frequency analysis of §3.2).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from jax import lax

from wus.analysis import compat, precision, reasons
from wus.analysis import formats as formats_lib
from wus.analysis.compat import Jaxpr, source_line
from wus.analysis.graph import Graph
from wus.analysis.plan import JaxprPlan


@dataclasses.dataclass
class PlannedLoop:
  """A loop whose body runs the weight update on shards (§4.2)."""

  jaxpr_plan: JaxprPlan
  carries: dict           # Carry position -> format, for carries held as shards.
  read_whole: set         # Carries also read whole in the body (weights, Fig. 4 right).
  formats: dict
  gather_dtypes: dict


@dataclasses.dataclass(frozen=True)
class Body:
  """A while / scan body and what planning it takes: the key of the planner's memo.

  Attributes:
    jaxpr: the body (not closed); the same object for every loop that runs it.
    state_pairs: (carry output position, body input position) pairs: the
      carries, but those the loop condition reads (they stay whole).
    in_names, out_names: names of the body's inputs and outputs, for the Plan.
    label: the loop's place ("loop at f.py:12: "), prefixed to its clusters' reasons.
    counters: the body inputs that count iterations (`counts`).
  """

  jaxpr: Jaxpr
  state_pairs: tuple[tuple[int, int], ...]
  in_names: tuple[str, ...]
  out_names: tuple[str, ...]
  label: str
  counters: frozenset


def bodies(jaxpr: Jaxpr, in_names, label: str) -> dict[int, Body]:
  """The body of every while / scan of `jaxpr`: equation index -> `Body`.

  Carried state (optimizer state) may stay sharded across iterations: it is
  sharded before the loop and gathered after it only where read whole (Fig. 4
  left). Carries the loop condition reads stay whole. The planner plans each
  body through its memoized entry point (loops nest), lists every body's
  clusters in the Plan, sharded or not (a replicated one says why), and runs
  on shards the loops whose body shards something (`planned_loop`).
  """
  invar_pos = {v: k for k, v in enumerate(jaxpr.invars)}
  out = {}
  for i, eqn in enumerate(jaxpr.eqns):
    if eqn.primitive not in (compat.scan_p, compat.while_p):
      continue
    loop = compat.loop(eqn)
    inner, carry_in = loop.body.jaxpr, loop.body_carry
    names = [outer_name(op, invar_pos, in_names, f"loop input {k}")
             for k, op in enumerate(loop.body_operands)]
    cond_reads = loop.cond_reads()
    out_names = [names[j] for j in carry_in] + [
        f"loop output {k}" for k in range(len(inner.outvars) - loop.num_carry)]
    out[i] = Body(inner, tuple((k, j) for k, j in enumerate(carry_in) if k not in cond_reads),
                  tuple(names), tuple(out_names), f"{label}loop at {source_line(eqn)}: ",
                  frozenset(inner.invars[j] for k, j in enumerate(carry_in)
                            if counts(inner, j, k)))
  return out


def planned_loop(eqn, planned) -> PlannedLoop | None:
  """The loop `eqn` with its body planned (`planned`, the planner's plan of its `Body`),
  or None if the body shards nothing."""
  if not planned.jaxpr_plan.shard_eqns:
    return None
  loop = compat.loop(eqn)
  inner, carry_in = loop.body.jaxpr, loop.body_carry
  carries = {j - loop.num_consts: f for j, f in planned.jaxpr_plan.sharded_in.items()}
  read_whole = {k for k in carries if inner.invars[carry_in[k]] in planned.gather_dtypes}
  return PlannedLoop(planned.jaxpr_plan, carries, read_whole, planned.formats,
                     planned.gather_dtypes)


def counts(body: Jaxpr, in_pos: int, out_pos: int) -> bool:
  """Whether carry `in_pos` -> `out_pos` of a loop body is `i + 1` (an iteration counter)."""
  x, eqn = body.invars[in_pos], Graph(body).producing(body.outvars[out_pos])
  if eqn is None or eqn.primitive is not lax.add_p:
    return False
  a, b = eqn.invars
  return ((a is x and compat.is_literal(b) and b.val == 1)
          or (b is x and compat.is_literal(a) and a.val == 1))


def rare_conds(jaxpr: Jaxpr, counters: frozenset) -> set[int]:
  """Conditionals whose predicate depends on an iteration counter (§3.2)."""
  if not counters:
    return set()
  depends = set(counters)
  rare = set()
  for i, eqn in enumerate(jaxpr.eqns):
    if any(v in depends for v in eqn.invars if not compat.is_literal(v)):
      depends.update(eqn.outvars)
      if eqn.primitive is compat.cond_p and compat.cond(eqn).index in depends:
        rare.add(i)
  return rare


def outer_name(v, invar_pos, in_names, default: str) -> str:
  return in_names[invar_pos[v]] if not compat.is_literal(v) and v in invar_pos else default


@dataclasses.dataclass(frozen=True)
class LoopState:
  """A step input carried by a loop and returned after it, kept sharded between steps.

  Attributes:
    formats: the format of every value on the way: the input, the layout-only
      copies between it and the loop (`wus.pmap`'s squeeze of the mapped
      axis) and between the loop and the output (its expand_dims), the output.
    copies: those copies' equation indices; they run on shards (Kind.LAYOUT).
  """

  formats: Mapping
  copies: tuple[int, ...]


def loop_state(graph: Graph, i: int, loop: PlannedLoop, y, x) -> LoopState | None:
  """How (x in, y out) are a loop carry kept sharded between steps, if they are.

  x reaches the carry's initial value, and the carry's result reaches y,
  directly or through layout-only copies that nothing else reads
  (`precision.copy_chain`). Weights the body reads whole (Fig. 4 right) leave
  the step whole: the user reads them too. `graph` is the jaxpr's.
  """
  jaxpr = graph.jaxpr
  eqn = jaxpr.eqns[i]
  init = compat.loop(eqn).carry
  if y not in jaxpr.outvars or x in jaxpr.outvars:
    return None
  for k, fmt in loop.carries.items():
    if k in loop.read_whole or set(graph.readers(init[k])) != {i} or graph.readers(y):
      continue
    into = precision.copy_chain(graph, x, init[k])
    out_of = precision.copy_chain(graph, eqn.outvars[k], y)
    if into is None or out_of is None:
      continue
    values = [x, *(jaxpr.eqns[j].outvars[0] for j in into + out_of)]
    try:
      formats = {v: formats_lib.ShardFormat(tuple(v.aval.shape), fmt.merged_shape,
                                            fmt.num_shards) for v in values}
    except ValueError:
      continue  # Not a layout of the carry's format.
    formats[eqn.outvars[k]] = fmt
    return LoopState(formats, tuple(into + out_of))
  return None


def placements(c, graph: Graph, members: set[int], carries: Mapping[int, int],
               pairs: Mapping[int, int], narrow: dict, in_names) -> reasons.LoopGathers:
  """Where each carried weight of a loop body's cluster is all-gathered, and why (Fig. 4).

  The choice is by bytes per iteration: gathering right before the forward
  pass (Fig. 4 right) moves the dtype the forward pass reads, gathering at the
  end of the iteration (Fig. 4 left) moves the weight's own dtype. Right wins
  only when the forward pass reads a narrower float (Fig. 7); at equal bytes,
  left keeps the carried weight whole, as the user's loop has it.
  """
  out = []
  for in_pos in sorted(set(carries.values())):
    x = graph.jaxpr.invars[in_pos]
    if x not in c.reads or graph.only_read_by(x, members):
      continue  # Not this cluster's, or optimizer state only the update reads.
    whole = x.aval.size * x.aval.dtype.itemsize
    if x in narrow:
      out.append(reasons.Gather(in_names[in_pos], narrow[x].name, x.aval.size * narrow[x].itemsize,
                                whole, True))
    elif in_pos not in pairs.values():
      out.append(reasons.Gather(in_names[in_pos], x.aval.dtype.name, whole, whole, False))
  return reasons.LoopGathers(tuple(out))
