"""Loops and conditionals in the planner (§3.2, §4.2, Fig. 4).

A while or scan body whose update runs on shards gets its own plan: carried
optimizer state stays sharded across iterations; a weight the forward pass
reads whole is all-gathered where it moves the fewest bytes (Fig. 4 left or
right); a conditional whose predicate follows an iteration counter runs every
k steps (the frequency analysis of §3.2).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from jax import lax

from wus.analysis import compat
from wus.analysis.compat import Jaxpr, source_line
from wus.analysis.plan import Program


@dataclasses.dataclass
class Loop:
  """A loop whose body runs the weight update on shards (§4.2)."""

  program: Program
  carries: dict           # Carry position -> format, for carries held as shards.
  read_whole: set         # Carries also read whole in the body (weights, Fig. 4 right).
  first_carry: int        # Operand position of carry 0 in the loop equation.
  clusters: list
  formats: dict
  gather_dtypes: dict


def plan_loops(jaxpr: Jaxpr, ctx, in_names, label: str,
               plan_body: Callable) -> dict[int, Loop]:
  """Plans the body of every while / scan of `jaxpr` whose body shards something.

  Carried state (optimizer state) stays sharded across iterations: it is
  sharded before the loop and gathered after it only where read whole (Fig. 4
  left). Carries the loop condition reads stay whole. `plan_body(body, ctx,
  state_pairs, in_names, out_names, label, in_loop=True, counters=...)` plans a
  body (the planner's own `_plan`, passed in: loops nest).
  """
  invar_pos = {v: k for k, v in enumerate(jaxpr.invars)}
  loops = {}
  for i, eqn in enumerate(jaxpr.eqns):
    if eqn.primitive is compat.scan_p:
      body, num_consts, num_carry = compat.scan_parts(eqn)
      first, cond_reads = num_consts, set()
    elif eqn.primitive is compat.while_p:
      cond, cond_nconsts, body, num_consts = compat.while_parts(eqn)
      num_carry = len(body.jaxpr.outvars)
      first = cond_nconsts + num_consts
      read = {v for e in cond.jaxpr.eqns for v in e.invars if not compat.is_literal(v)}
      cond_reads = {k for k, v in enumerate(cond.jaxpr.invars[cond_nconsts:]) if v in read}
    else:
      continue
    inner = body.jaxpr
    names = [outer_name(op, invar_pos, in_names, f"loop input {k}")
             for k, op in enumerate(eqn.invars[first - num_consts:])]
    pairs = {k: num_consts + k for k in range(num_carry) if k not in cond_reads}
    where = f"loop at {source_line(eqn)}: "
    counters = frozenset(inner.invars[num_consts + k] for k in range(num_carry)
                         if counts(inner, num_consts + k, k))
    planned = plan_body(inner, ctx, pairs, names, names[num_consts:num_consts + num_carry]
                    + [f"loop output {k}" for k in range(len(inner.outvars) - num_carry)],
                    label + where, in_loop=True, counters=counters)
    if planned.program.shard_eqns:
      carries = {k - num_consts: f for k, f in planned.program.sharded_in.items()}
      read_whole = {k for k in carries if inner.invars[num_consts + k] in planned.gather_dtypes}
      loops[i] = Loop(planned.program, carries, read_whole, first, planned.clusters,
                       planned.formats, planned.gather_dtypes)
  return loops


def counts(body: Jaxpr, in_pos: int, out_pos: int) -> bool:
  """Whether carry `in_pos` -> `out_pos` of a loop body is `i + 1` (an iteration counter)."""
  x, y = body.invars[in_pos], body.outvars[out_pos]
  for eqn in body.eqns:
    if y in eqn.outvars and eqn.primitive is lax.add_p:
      a, b = eqn.invars
      return ((a is x and compat.is_literal(b) and b.val == 1)
              or (b is x and compat.is_literal(a) and a.val == 1))
  return False


def rare_conds(jaxpr: Jaxpr, counters: frozenset) -> set[int]:
  """Conditionals whose predicate depends on an iteration counter (§3.2)."""
  if not counters:
    return set()
  depends = set(counters)
  rare = set()
  for i, eqn in enumerate(jaxpr.eqns):
    if any(v in depends for v in eqn.invars if not compat.is_literal(v)):
      depends.update(eqn.outvars)
      if eqn.primitive is compat.cond_p and eqn.invars[0] in depends:
        rare.add(i)
  return rare


def outer_name(v, invar_pos, in_names, default: str) -> str:
  return in_names[invar_pos[v]] if not compat.is_literal(v) and v in invar_pos else default


def loop_state(jaxpr: Jaxpr, i: int, loop: Loop, y, x):
  """The format of (x in, y out) if they are a loop carry kept sharded between steps.

  Weights the body reads whole (Fig. 4 right) leave the step whole: the user
  reads them too.
  """
  eqn = jaxpr.eqns[i]
  for k, fmt in loop.carries.items():
    if (k not in loop.read_whole and eqn.outvars[k] is y and eqn.invars[loop.first_carry + k] is x
        and all(x not in e.invars for j, e in enumerate(jaxpr.eqns) if j != i)
        and x not in jaxpr.outvars):
      return fmt
  return None


def placements(c, jaxpr: Jaxpr, members: set[int], carries: Mapping[int, int],
                pairs: Mapping[int, int], narrow: dict, invar_pos, in_names,
                readers: dict) -> str:
  """Where each carried weight of a loop body's cluster is all-gathered, and why (Fig. 4).

  The choice is by bytes per iteration: gathering right before the forward
  pass (Fig. 4 right) moves the dtype the forward pass reads, gathering at the
  end of the iteration (Fig. 4 left) moves the weight's own dtype. Right wins
  only when the forward pass reads a narrower float (Fig. 7); at equal bytes,
  left keeps the carried weight whole, as the user's loop has it.
  """
  out = []
  for in_pos in sorted(set(carries.values())):
    x = jaxpr.invars[in_pos]
    if x not in c.reads or readers.get(x, set()) <= members:
      continue  # Not this cluster's, or optimizer state only the update reads.
    whole = x.aval.size * x.aval.dtype.itemsize
    if x in narrow:
      out.append(f"{in_names[in_pos]} kept sharded across iterations and all-gathered in "
                 f"{narrow[x].name} right before the forward pass reads it: "
                 f"{x.aval.size * narrow[x].itemsize} B per iteration instead of {whole} B "
                 "(Fig. 4 right, Fig. 7)")
    elif in_pos not in pairs.values():
      out.append(f"{in_names[in_pos]} all-gathered at the end of each iteration ({whole} B, "
                 f"{x.aval.dtype.name}): the forward pass reads it whole in that dtype, so "
                 "gathering before it would move as many bytes (Fig. 4 left)")
  return ", ".join(out) or "no carried weight is read whole: nothing gathered in the loop"
