"""Which replica owns which update, and where its tensors lie in the rows (DESIGN.md, Ownership).

`wus.analysis.ownership` finds the updates that can run on whole tensors;
this module assigns them to replicas and lays their tensors out
(`wus.analysis.owned`): units of one (shapes, dtypes, update) form a stack,
each replica owns k = m // N contiguous members of a stack of m, and the
remainders and singletons go, largest predicted cost first, to the replica
with the least predicted work (ties: the lower replica, the earlier unit).
Rows place each replica's tensors in that order.

It also models one decision XLA:CPU makes differently for an owner than
for the unmodified step (`rewritten_divides`), which the rewrite undoes so
that the owner computes bit for bit what every replica computed before.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from jax import lax

from wus.analysis import compat, costmodel, primitives
from wus.analysis.compat import Jaxpr
from wus.analysis.cost import nbytes
from wus.analysis.owned import Ownership, OwnedFormat, OwnedUnit, Slot, build_bank


def rewritten_divides(jaxpr: Jaxpr) -> frozenset[int]:
  """The divisions by a scalar that XLA:CPU rewrites as multiplications by its reciprocal.

  XLA's algebraic simplifier rewrites `A / broadcast(B)` as `A * broadcast(1 / B)` on
  the CPU when B has one use (openxla `AlgebraicSimplifierVisitor::HandleDivide`,
  "A / broadcast(B) => A * broadcast(1 / B)"; the two round differently). It visits
  instructions in post order from the root. When every reader of a scalar B
  broadcasts it to one shape (one broadcast after CSE: B has one use), the
  first division visited is rewritten and no other, since B's reciprocal is
  then a second use. An owner that runs such a division alone would see B
  with one use and rewrite it too: the rewrite (`transforms.owned`) keeps B
  used twice on every owner and writes the reciprocal itself where this
  predicts XLA does in the unmodified step.

  Args:
    jaxpr: the step's flat jaxpr (the unmodified step, as XLA compiles it).

  Returns:
    Indices of the `div` equations rewritten, by this model of XLA's rule.
  """
  order: dict[int, int] = {}
  producer = {v: i for i, eqn in enumerate(jaxpr.eqns) for v in eqn.outvars}
  for root in jaxpr.outvars:  # Post order from the root tuple, operands in order.
    stack = [] if compat.is_literal(root) or root not in producer else [(producer[root], 0)]
    while stack:
      i, k = stack.pop()
      if i in order:
        continue
      atoms = jaxpr.eqns[i].invars
      while k < len(atoms) and (compat.is_literal(atoms[k]) or atoms[k] not in producer
                                or producer[atoms[k]] in order):
        k += 1
      if k == len(atoms):
        order[i] = len(order)
      else:
        stack += [(i, k + 1), (producer[atoms[k]], 0)]
  readers: dict = {}
  for i, eqn in enumerate(jaxpr.eqns):
    for v in eqn.invars:
      if not compat.is_literal(v) and not v.aval.shape:
        readers.setdefault(v, []).append(i)
  out = set()
  outputs = {v for v in jaxpr.outvars if not compat.is_literal(v)}
  for b, rs in readers.items():
    shapes = {tuple(jaxpr.eqns[r].outvars[0].aval.shape) for r in rs}
    divides = [r for r in rs if jaxpr.eqns[r].primitive is lax.div_p
               and jaxpr.eqns[r].invars[1] is b and r in order]
    if (divides and b not in outputs and len(shapes) == 1 and () not in shapes
        and all(jaxpr.eqns[r].primitive in primitives.ELEMENTWISE for r in rs)
        and np.issubdtype(b.aval.dtype, np.floating)):
      out.add(min(divides, key=order.__getitem__))
  return frozenset(out)


def signature(jaxpr: Jaxpr, u) -> tuple:
  """What units of one stack share: tensor shapes and dtypes, and the update's primitives."""
  def sig(vs):
    return tuple((tuple(v.aval.shape), v.aval.dtype.name) for v in vs)
  return (sig(jaxpr.eqns[i].outvars[0] for i in u.seeds),
          sig(jaxpr.invars[k] for k in u.pairs.values()), sig(u.exits),
          tuple(jaxpr.eqns[i].primitive for i in sorted(u.eqns)))


def assign(jaxpr: Jaxpr, units: list, num_shards: int) -> list[list]:
  """Owners for `units` (module docstring, 3); returns the stacks, in order."""
  by_key: dict = {}
  for u in sorted(units, key=lambda u: min(u.eqns)):
    by_key.setdefault(signature(jaxpr, u), []).append(u)
  stacks = list(by_key.values())
  loads = [0.0] * num_shards
  rest = []
  for s, members in enumerate(stacks):
    k = len(members) // num_shards
    for j, u in enumerate(members):
      u.stack = s
      if j < k * num_shards:
        u.owner = j // k
        loads[u.owner] += u.cost
      else:
        rest.append(u)
  for u in sorted(rest, key=lambda u: (-u.cost, min(u.eqns))):
    u.owner = min(range(num_shards), key=lambda r: (loads[r], r))
    loads[u.owner] += u.cost
  return stacks


def rows(jaxpr: Jaxpr, units: list, stacks, num_shards: int, rewritten: frozenset
          ) -> tuple[Ownership, dict]:
  """The row layouts of owned gradients, outputs and state; (Ownership, state var -> format).

  Each replica's rows hold its units in stack order, those with a division
  XLA:CPU rewrites (`rewritten`, `Ownership.unpinned`) first."""
  grads: dict = {}
  outputs: dict = {}
  state_slots: dict = {}  # state input var -> (dtype, Slot)
  lengths: dict = {"grad": {}, "out": {}, "state": {}}
  loads = [0.0] * num_shards
  for r in range(num_shards):
    used: dict = {"grad": {}, "out": {}, "state": {}}

    def place(kind: str, v, into: dict, used=used):
      dtype = v.aval.dtype.name
      offset = used[kind].get(dtype, 0)
      size = math.prod(v.aval.shape)
      into[v] = (dtype, Slot(r, offset, size))
      used[kind][dtype] = offset + size

    mine = [u for members in stacks for u in members if u.owner == r]
    for u in sorted(mine, key=lambda u: not u.eqns & rewritten):
      loads[r] += u.cost
      for i in u.seeds:
        place("grad", jaxpr.eqns[i].outvars[0], grads)
      for v in u.exits:
        place("out", v, outputs)
      for in_pos in sorted(u.pairs.values()):
        place("state", jaxpr.invars[in_pos], state_slots)
    for kind in used:
      for dtype, n in used[kind].items():
        lengths[kind][dtype] = max(lengths[kind].get(dtype, 0), n)
  state: dict = {}
  for dtype, length in lengths["state"].items():
    members = [v for v in jaxpr.invars if v in state_slots and state_slots[v][0] == dtype]
    bank = build_bank(dtype, num_shards, [tuple(v.aval.shape) for v in members],
                      [state_slots[v][1] for v in members], length)
    state.update({v: OwnedFormat(bank, t) for t, v in enumerate(members)})
  pairs = {jaxpr.outvars[o]: jaxpr.invars[i] for u in units for o, i in u.pairs.items()}
  described = []
  for members in stacks:
    shapes = ", ".join(jaxpr.eqns[i].outvars[0].aval.str_short() for i in members[0].seeds)
    k = len(members) // num_shards
    described.append(f"{len(members)} x {shapes}: {k} per replica"
                     + (f" + {len(members) - k * num_shards} balanced" if len(members) % num_shards
                        else ""))
  ownership = Ownership(
      num_shards,
      tuple(OwnedUnit(u.index, tuple(sorted(u.eqns)), u.seeds, u.owner, u.stack, u.cost)
            for u in sorted(units, key=lambda u: u.index)),
      grads, outputs, dict(lengths["grad"]), dict(lengths["out"]),
      dict(state), {y: state[x] for y, x in pairs.items()},
      tuple(described), tuple(loads))
  return ownership, state


def pinned(jaxpr: Jaxpr, ownership: Ownership, rewritten: frozenset) -> Ownership:
  """`ownership` with the scalars owned divisions divide by pinned (`Ownership.pins`)."""
  eqns = {i for u in ownership.units for i in u.eqns}
  made = {v for i in eqns for v in jaxpr.eqns[i].outvars}
  divides = [i for i in sorted(eqns) if jaxpr.eqns[i].primitive is lax.div_p]
  pins = tuple(dict.fromkeys(
      b for i in divides for b in jaxpr.eqns[i].invars[1:] if not compat.is_literal(b)
      and not b.aval.shape and b not in made and np.issubdtype(b.aval.dtype, np.floating)))
  floats = [d for d in sorted(ownership.out_rows) if np.issubdtype(np.dtype(d), np.floating)]
  if not pins or not floats:
    return ownership
  rows = dict(ownership.out_rows)
  rows[floats[0]] += len(pins)
  unpinned: dict = {}
  for u in ownership.units:
    for i in rewritten.intersection(u.eqns):
      if jaxpr.eqns[i].invars[1] in pins:
        unpinned.setdefault(u.owner, set()).add(jaxpr.eqns[i].invars[1])
  return dataclasses.replace(ownership, out_rows=rows, pins=pins, pin_dtype=floats[0],
                             unpinned={r: frozenset(b) for r, b in unpinned.items()})


def whole_prediction(jaxpr: Jaxpr, units: list, ownership: Ownership,
                      ctx) -> tuple[float, float]:
  """(replicated, owned) predicted seconds of all owned units' collectives and updates."""
  topo = ctx.topology
  axes = tuple(dataclasses.replace(a, alpha=0.0) for a in topo.axes)
  n = ctx.num_shards
  grads = sum(nbytes(jaxpr.eqns[i].outvars[0]) for u in units for i in u.seeds)
  itemsize = {d: np.dtype(d).itemsize for d in {*ownership.grad_rows, *ownership.out_rows}}
  grad_rows = sum(n * length * itemsize[d] for d, length in ownership.grad_rows.items())
  out_rows = sum(n * length * itemsize[d] for d, length in ownership.out_rows.items())
  rep = costmodel.all_reduce(grads, axes) + sum(u.cost for u in units)
  own = (costmodel.reduce_scatter(grad_rows, axes) + costmodel.all_gather(out_rows, axes)
         + max(ownership.loads) + 2 * (grad_rows + out_rows) / topo.memory_bandwidth)
  return rep, own
