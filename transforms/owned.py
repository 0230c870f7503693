"""The owned updates of a step, rewritten: rows in, a switch on the replica index, rows out.

The Plan's ownership part (`wus.analysis.owned.Ownership`) says which replica
runs which update on whole tensors. The rewrite (`transforms.rewrite`) hands
this module the local gradients of the owned all-reduces; they are laid out
in rows, one per owner, and reduce-scattered with the sharded tensors'
gradients in the same batched collectives (§5.2), so every replica receives
the summed gradients of the tensors it owns, whole. One `lax.switch` on the
replica index then runs, on replica r, the equations of the updates r owns,
exactly as the original step wrote them, on whole tensors; it returns the row
of r's new weights (all-gathered, batched, where they are read whole) and the
rows of r's optimizer state, which stay on r, cut into the columns of their
bank (`owned.Bank`).

Before/after for Muon on two matrices w0, w1 of one shape, N = 2:

  g0 = psum dw0                          rows = [dw0 | dw1]                  # row r: r's tensors
  g1 = psum dw1                          mine = psum_scatter(rows)          # my gradient, whole
  m0' = b*m0 + g0; u0 = NS(m0') ...      new, m' = switch(axis_index, [
  m1' = b*m1 + g1; u1 = NS(m1') ...        lambda: (w0 - lr*NS(b*m0 + mine), ...),   # replica 0
  return w0 - lr*u0, w1 - lr*u1, ...       lambda: (w1 - lr*NS(b*m1 + mine), ...)])  # replica 1
                                         w0', w1' = cut(all_gather(new)); return w0', w1', m'
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
from jax import lax

from wus import collectives
from wus.analysis import compat
from wus.analysis.formats import ShardFormat
from wus.analysis.owned import Ownership
from wus.analysis.plan import Plan
from wus.analysis.shardable import Kind
from wus.collectives import owned as rows_lib
from wus.transforms import interpret


class OwnedUpdates:
  """The owned updates of one step, as the rewrite meets them.

  Attributes:
    done: whether the switch has run.
    columns: this replica's column of each owned state output, after it.
    wholes: the whole value of each owned output read whole, once gathered.
  """

  def __init__(self, plan: Plan):
    self.own: Ownership = plan.owned
    self.axes = plan.axes
    self.num_shards = plan.num_shards
    self.summands: dict = {}   # Owned gradient (seed result) -> this replica's local gradient.
    self.received: dict = {}   # dtype -> this replica's row of summed gradients.
    self.out_rows: dict = {}   # dtype -> this replica's row of new values read whole.
    self.columns: dict = {}
    self.wholes: dict = {}
    self.done = False

  # --- Gradients in, as rows. -------------------------------------------------

  def to_scatter(self) -> tuple[list, list, list]:
    """The rows of the waiting owned gradients: (dtypes, flat rows, their formats)."""
    by_dtype: dict = {}
    for v, x in self.summands.items():
      by_dtype.setdefault(self.own.grads[v][0], []).append((v, x))
    self.summands = {}
    dtypes, values, fmts = [], [], []
    for dtype, items in by_dtype.items():
      length = self.own.grad_rows[dtype]
      values.append(rows_lib.rows([x for _, x in items], [self.own.grads[v][1] for v, _ in items],
                                  self.num_shards, length, dtype))
      fmts.append(ShardFormat.flat((self.num_shards * length,), self.num_shards))
      dtypes.append(dtype)
    return dtypes, values, fmts

  def scattered(self, dtypes: list, shards: list) -> None:
    self.received.update(zip(dtypes, shards, strict=True))

  # --- The switch. ------------------------------------------------------------

  def meet(self, eqn, kind: Kind, env) -> list:
    """The rewrite's rule for an owned equation (`Kind.OWNED`, `Kind.OWNED_SCATTER`).

    A gradient waits for the batched reduce-scatter of rows; the first other
    owned equation runs them all, each on its owner, in one switch (`run`).

    Args:
      eqn: the equation.
      kind: its Kind in the program.
      env: the rewrite's values (`whole`, `shard`, `scatter`, `jaxpr`).

    Returns:
      Per output, this replica's column of its bank (owned state), or None (a
      new weight, gathered as rows where read whole).
    """
    if kind is Kind.OWNED_SCATTER:
      self.summands[eqn.outvars[0]] = env.whole(eqn.invars[0])
    elif not self.done:
      if self.summands:
        env.scatter()
      self.run(env.jaxpr, env.whole, env.shard)
    return [self.columns.get(v) for v in eqn.outvars]

  def run(self, jaxpr, whole: Callable[[Any], Any], column: Callable[[Any], Any]) -> None:
    """Runs every owned equation of `jaxpr` (the step's), each on its owner.

    Args:
      jaxpr: the step's jaxpr (not closed).
      whole: the whole value of a variable the owned updates read.
      column: this replica's column of an owned state input.
    """
    own = self.own
    banks = {}  # bank -> {index: state input var}
    for x, fmt in own.state_vars_in.items():
      banks.setdefault(fmt.bank, {})[fmt.index] = x
    state_rows = [lax.concatenate([column(members[t]) for t in range(len(bank.shapes))], 0)
                  for bank, members in banks.items()]
    seeds = {i for u in own.units for i in u.seeds}
    made = {v for u in own.units for i in u.eqns for v in jaxpr.eqns[i].outvars}
    external = list(dict.fromkeys(
        v for u in own.units for i in u.eqns if i not in seeds for v in jaxpr.eqns[i].invars
        if not compat.is_literal(v) and v not in made and v not in own.state_vars_in))
    owners = _Owners(self, jaxpr, list(banks.items()), seeds, external, sorted(self.received))
    operands = compat.match_varying(
        [self.received[d] for d in owners.dtypes] + state_rows + [whole(v) for v in external])
    # Every branch's rows vary over the same axes: the sharding axes and whatever axis an
    # operand varies over (a weight placed over a mesh axis of size 1 is typed varying
    # over it, and only the branches of its owner read it).
    varying = tuple(dict.fromkeys([*self.axes, *sorted(
        frozenset().union(*(compat.varying_axes(jax.typeof(x)) for x in operands)))]))
    results = lax.switch(rows_lib.replica(self.axes),
                         [owners.branch(r, varying) for r in range(self.num_shards)], *operands)
    out_dtypes = owners.out_dtypes
    self.out_rows = dict(zip(out_dtypes, results[:len(out_dtypes)], strict=True))
    for (bank, _), new in zip(owners.banks, results[len(out_dtypes):], strict=True):
      for t, col in enumerate(rows_lib.columns(new, bank.widths)):
        self.columns[owners.outs_of[bank, t]] = col
    self.done = True

  def _eval(self, i: int, eqn, args: list) -> list:
    """`eqn` on the owner (an `interpret.Hook`): collectives of equal values locally (the
    planner owns no other, `ownership._runs_on_owner`), sub-jaxprs re-traced with the owner's
    types."""
    if eqn.primitive in (compat.pvary_p, compat.pmax_p, compat.pmin_p):
      return [compat.to_varying(x, self.axes) for x in args]
    if eqn.primitive in (compat.psum_p, compat.psum_invariant_p):
      copies = math.prod(lax.axis_size(a) for a in compat.collective_axes(eqn))
      return [collectives.sum_of_copies(x, copies) for x in args]
    if eqn.primitive is compat.cond_p:
      cond = compat.cond(eqn)
      return cond.bind(compat.match_varying(args),
                       [lambda a, b=b: self._eval_jaxpr(b, a) for b in cond.branches])
    if eqn.primitive in (compat.scan_p, compat.while_p):
      loop = compat.loop(eqn)
      return loop.bind(compat.match_varying(args), lambda a: self._eval_jaxpr(loop.body, a),
                       None if loop.cond is None else lambda a: self._eval_jaxpr(loop.cond, a))
    return compat.rebind(eqn, *compat.match_varying(args))

  def _eval_jaxpr(self, closed, args: list) -> list:
    outs = interpret.eval_jaxpr(closed.jaxpr, closed.consts, args, self._eval)
    return [compat.to_varying(x, self.axes) for x in outs]

  # --- New weights out, as rows. -------------------------------------------------

  def to_gather(self) -> tuple[list, list, list]:
    """This replica's rows of owned values read whole: (dtypes, rows, their formats)."""
    dtypes = [d for d in sorted(self.out_rows) if not any(
        v in self.wholes for v, (dd, _) in self.own.outputs.items() if dd == d)]
    fmts = [ShardFormat.flat((self.num_shards * self.own.out_rows[d],), self.num_shards)
            for d in dtypes]
    return dtypes, [self.out_rows[d] for d in dtypes], fmts

  def gathered(self, dtypes: list, wholes: list) -> dict:
    """The owned values read whole, from the gathered rows of `dtypes` (`to_gather`)."""
    for dtype, every in zip(dtypes, wholes, strict=True):
      items = [(v, s) for v, (d, s) in self.own.outputs.items() if d == dtype]
      for (v, _), x in zip(items, rows_lib.cut(every, [s for _, s in items],
                                               [tuple(v.aval.shape) for v, _ in items],
                                               self.own.out_rows[dtype]), strict=True):
        self.wholes[v] = x
    return self.wholes


class _Owners:
  """The branches of the owned updates' switch: replica r's runs the equations r owns on
  whole tensors cut from the rows it receives, and returns r's rows.

  Operands of every branch: the received gradient rows (one per dtype, `dtypes`), the
  rows of owned state (one per bank, `banks`), the `external` values read whole.
  """

  def __init__(self, region: OwnedUpdates, jaxpr, banks: list, seeds: set[int], external: list,
               dtypes: list):
    self.region, self.own, self.jaxpr = region, region.own, jaxpr
    self.banks, self.seeds, self.external, self.dtypes = banks, seeds, external, dtypes
    self.out_dtypes = sorted(self.own.out_rows)
    self.grads = [jaxpr.eqns[i].outvars[0] for i in sorted(seeds)]  # Traced in jaxpr order.
    self.outs_of = {(fmt.bank, fmt.index): y for y, fmt in self.own.state_vars_out.items()}

  def branch(self, r: int, varying: tuple) -> Callable:
    """Replica r's branch; its rows typed varying over `varying`."""
    eqns = sorted(i for u in self.own.units if u.owner == r for i in u.eqns
                  if i not in self.seeds)

    def fn(*operands):
      env = interpret.eval_eqns(self.jaxpr, self._wholes(r, list(operands)), self.region._eval,
                                eqns)
      return tuple(compat.to_varying(x, varying) for x in self._rows(r, env))
    return fn

  def _wholes(self, r: int, got: list) -> dict:
    """The values r's equations read: the whole tensors r owns, cut from the rows, and the
    external values."""
    own, dtypes, n_banks = self.own, self.dtypes, len(self.banks)
    received = dict(zip(dtypes, got[:len(dtypes)], strict=True))
    env = dict(zip(self.external, got[len(dtypes) + n_banks:], strict=True))
    # Whole tensors cut from rows and written into rows through an optimization
    # barrier: XLA would otherwise see through the reshape of a row's piece and
    # reduce a [16,16] tensor as a [256] one, in another order (its reduction
    # splitter) than the unmodified step reduces the same tensor.
    for v in self.grads:
      dtype, slot = own.grads[v]
      if slot.owner == r:
        env[v] = lax.optimization_barrier(
            rows_lib.piece(received[dtype], slot.offset, tuple(v.aval.shape)))
    srows = got[len(dtypes):len(dtypes) + n_banks]
    for (bank, members), srow in zip(self.banks, srows, strict=True):
      for t, x in members.items():
        if bank.slots[t].owner == r:
          env[x] = lax.optimization_barrier(
              rows_lib.piece(srow, bank.slots[t].offset, bank.shapes[t]))
    return env

  def _rows(self, r: int, env: dict) -> list:
    """r's rows: its new values read whole (one per dtype), its new state (one per bank)."""
    own, result = self.own, []
    for dtype in self.out_dtypes:
      mine = [(lax.optimization_barrier(env[v]), s.offset)
              for v, (d, s) in own.outputs.items() if d == dtype and s.owner == r]
      if dtype == own.pin_dtype:  # Used twice, as in the unmodified step (Ownership.pins).
        start = own.out_rows[dtype] - len(own.pins)
        mine += [(env[v].astype(dtype), start + k) for k, v in enumerate(own.pins)
                 if v not in own.unpinned.get(r, ())]
      result.append(rows_lib.row([x for x, _ in mine], [o for _, o in mine],
                                 own.out_rows[dtype], dtype))
    for bank, members in self.banks:
      mine = [t for t in members if bank.slots[t].owner == r]
      result.append(rows_lib.row([lax.optimization_barrier(env[self.outs_of[bank, t]])
                                  for t in mine],
                                 [bank.slots[t].offset for t in mine], bank.length, bank.dtype))
    return result
