"""Who owns which update: its predicted cost, its replica, its rows (DESIGN.md, Ownership).

`wus.analysis.ownership` finds the updates that can run on whole tensors;
this module predicts what each costs and assigns them to replicas, and lays
their tensors out (`wus.analysis.owned`): units of one (shapes, dtypes,
update) form a stack, each replica owns k = m // N contiguous members of a
stack of m, and the remainders and singletons go, largest predicted cost
first, to the replica with the least predicted work (ties: the lower
replica, the earlier unit). Rows place each replica's tensors in that order.

Costs: collectives by `network`'s ring model over the topology, and an
update's flops at `network.FLOPS_PER_SECOND` plus its memory traffic (operands and
results of every equation, unfused) at the topology's memory bandwidth.
"""

from __future__ import annotations

import math

import numpy as np
from jax import lax

from wus.analysis import causes, compat, costmodel, network
from wus.analysis.compat import Jaxpr
from wus.analysis.cost import nbytes, tensor
from wus.analysis.owned import Ownership, OwnedFormat, OwnedUnit, Slot, build_bank


def work(eqns) -> tuple[float, float]:
  """(flops, bytes read and written) of equations, unfused; loops times their trip count."""
  flops = traffic = 0.0
  for eqn in eqns:
    subs = list(compat.sub_jaxprs(eqn))
    if eqn.primitive is compat.cond_p:
      f, t = max((work(s.eqns) for s in subs), default=(0.0, 0.0))
    elif subs:
      trips = eqn.params.get("length", 1) if eqn.primitive is compat.scan_p else 1
      f, t = (trips * x for x in work([e for s in subs for e in s.eqns]))
    elif eqn.primitive is lax.dot_general_p:
      (contract, _), _ = eqn.params["dimension_numbers"]
      k = math.prod(eqn.invars[0].aval.shape[d] for d in contract)
      f = 2.0 * k * math.prod(eqn.outvars[0].aval.shape)
      t = sum(_bytes(v) for v in [*eqn.invars, *eqn.outvars])
    else:
      f = float(sum(math.prod(v.aval.shape) for v in eqn.outvars if hasattr(v.aval, "shape")))
      t = sum(_bytes(v) for v in [*eqn.invars, *eqn.outvars])
    flops, traffic = flops + f, traffic + t
  return flops, traffic


def _bytes(v) -> int:
  aval = v.aval
  if compat.is_literal(v) or not hasattr(aval, "shape") or not hasattr(aval.dtype, "itemsize"):
    return 0
  return math.prod(aval.shape) * aval.dtype.itemsize


def update_seconds(jaxpr: Jaxpr, eqns, topology: network.Topology) -> float:
  """Predicted seconds of equations `eqns` of `jaxpr`: flops plus memory traffic."""
  flops, traffic = work([jaxpr.eqns[i] for i in sorted(eqns)])
  return network.compute_seconds(traffic, topology, flops)


def worth(jaxpr: Jaxpr, u, topology: network.Topology, num_shards: int) -> str | None:
  """Why owning unit `u` would not pay (`ownership` docstring, 2) on `num_shards` replicas
  of `topology`, or None; fills its cost."""
  u.cost = update_seconds(jaxpr, u.eqns, topology)
  # Its collectives as the cost model prices a cluster's; its update is this
  # module's (flops and traffic), shared by N replicas when owned.
  w = costmodel.Workload(tuple(tensor(jaxpr.eqns[i].outvars[0]) for i in u.seeds),
                         tuple(map(tensor, u.exits)))
  rep, own = costmodel.cluster_seconds(w, topology)
  rep, own = rep + u.cost, own + u.cost / num_shards
  moved = sum(n * b for n, b in (*w.gradients, *w.gathered))
  own += network.copy_seconds(moved, topology)  # Into and out of the rows.
  u.predicted = (rep, own)
  if own > rep:
    return causes.TooCheap(own, rep)
  return None


def unit_bytes(jaxpr: Jaxpr, u) -> int:
  """Bytes of a unit's gradients: what it adds to the rows of its owner."""
  return sum(nbytes(jaxpr.eqns[i].outvars[0]) for i in u.seeds)


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
    # dtype[shape] without JAX's varying-axes type (a size-1 mesh axis splits nothing).
    shapes = ", ".join(f"{a.dtype.name}[{','.join(map(str, a.shape))}]" for a in
                       (jaxpr.eqns[i].outvars[0].aval for i in members[0].seeds))
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


def whole_prediction(jaxpr: Jaxpr, units: list, ownership: Ownership,
                     topo: network.Topology, n: int) -> tuple[float, float]:
  """(replicated, owned) predicted seconds of all owned units' collectives and updates, on
  `n` replicas of `topo`."""
  grads = tuple(tensor(jaxpr.eqns[i].outvars[0]) for u in units for i in u.seeds)
  # The rows of each dtype, as tensors of N rows (`costmodel.cluster_seconds`).
  rows = [tuple((n * length, np.dtype(d).itemsize) for d, length in lengths.items())
          for lengths in (ownership.grad_rows, ownership.out_rows)]
  rep = costmodel.cluster_seconds(costmodel.Workload(grads), topo)[0] + sum(
      u.cost for u in units)
  own = (costmodel.cluster_seconds(costmodel.Workload(*rows), topo)[1] + max(ownership.loads)
         + network.copy_seconds(sum(k * b for k, b in (*rows[0], *rows[1])), topo))
  return rep, own
