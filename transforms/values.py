"""The values of the rewritten step: each variable whole, as shards, or both (§4).

`Env` holds the values of one jaxpr while `wus.transforms.rewrite` evaluates it and
makes the other form on demand: a shard from a whole value identical on every replica
is a local slice, a whole value from shards an all-gather, a gradient waiting for its
reduce-scatter is scattered with every other waiting one (batched, §5.2), a partial
result of a sharded reduction all-reduced with the others of its phase (Fig. 6).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax

from wus import collectives
from wus.analysis import compat
from wus.analysis.formats import ShardFormat
from wus.analysis.plan import JaxprPlan, Plan
from wus.transforms import owned


class Held:
  """A variable's value in the rewritten program: whole, shard, or both.

  `partial` is this replica's part of a reduction still to be all-reduced,
  as (value, op, axes); the whole value appears when it is first read. `summand`
  is this replica's addend of a gradient all-reduce still to be
  reduce-scattered, and `across` the mesh axes beyond the sharding axes its
  all-reduce spans (partial sharding, §5.2); the shard appears when it is
  first read.
  """

  __slots__ = ("whole", "shard", "partial", "summand", "across")

  def __init__(self, whole=None, shard=None, partial=None, summand=None, across=()):
    self.whole, self.shard, self.partial, self.summand = whole, shard, partial, summand
    self.across = across


class Env:
  """Variable values of one jaxpr, converting between whole and shard on demand."""

  def __init__(self, plan: Plan, jaxpr_plan: JaxprPlan):
    self.plan, self.jaxpr_plan = plan, jaxpr_plan
    self.held: dict = {}
    self.pending: list = []  # Variables holding partial results.
    self.summands: list = []  # Variables waiting for their reduce-scatter.
    self.casts: dict = {}    # Whole values cast to varying (compat.match_varying).
    self.current = -1        # Index of the equation being rewritten.
    self.owned = (owned.OwnedUpdates(plan)
                  if plan.owned is not None and jaxpr_plan is plan.rewrite else None)

  def fmt(self, v) -> ShardFormat:
    return self.plan.formats[v]

  def axes(self, v) -> tuple:
    """The mesh axes `v`'s shards lie over (`Plan.shard_axes`)."""
    return self.plan.shard_axes(self.fmt(v))

  def big(self, v) -> bool:
    """Whether the Plan holds `v` as shards where the update reads or writes it."""
    return not compat.is_literal(v) and v in self.plan.formats

  def whole(self, v) -> Any:
    if compat.is_literal(v):
      return v.val
    h = self.held[v]
    if h.partial is not None:
      self.flush()
    if h.whole is None and h.shard is None:
      self.scatter()
    if h.whole is None and v in self.plan.gather_dtypes:
      # Weights kept sharded across a loop's iterations, read by the forward
      # pass in a narrower float: gathered in it (Fig. 4 right, Fig. 7), all
      # together at the first read (§5.2).
      self.gather([u for u, held in self.held.items() if u in self.plan.gather_dtypes
                   and held.whole is None and held.shard is not None])
    if h.whole is None:
      h.whole = collectives.all_gather(h.shard, self.fmt(v), self.axes(v))
    return h.whole

  def shard(self, v) -> Any:
    h = self.held[v]
    if h.summand is not None:
      self.scatter()
    if h.shard is None:
      h.shard = collectives.shard(self.whole(v), self.fmt(v), self.axes(v))
    return h.shard

  def flush(self) -> None:
    """All-reduces every pending partial result: one collective per op, dtype and the
    axes of the shards it was reduced from (§5.2)."""
    groups: dict = {}
    for v in self.pending:
      value, op, axes = self.held[v].partial
      groups.setdefault((op, value.dtype, axes), []).append(v)
    for (op, _, axes), vs in groups.items():
      outs = collectives.all_reduce([self.held[v].partial[0] for v in vs], op, axes)
      for v, x in zip(vs, outs, strict=True):
        self.held[v].whole, self.held[v].partial = x, None
    self.pending = []

  def scatter(self) -> None:
    """Reduce-scatters every waiting gradient, batched (§5.2); in partial
    sharding the shards are then all-reduced across the groups, batched too
    (Fig. 10). Gradients of updates sharded over `Plan.copy_axes` too are summed
    over the replica axes alone, in collectives of their own, or, all-reduced over
    the copy axes too (`redundancy.sums_over`), over both in one reduce-scatter."""
    vs, self.summands = self.summands, []
    dtypes, rows, row_fmts = self.owned.to_scatter() if self.owned is not None else ([], [], [])
    values = [self.held[v].summand for v in vs] + rows
    # (copy axes, whether the sum runs over them too: one reduce-scatter over all).
    keys = [(c := self.axes(v)[len(self.plan.axes):],
             bool(c) and set(self.held[v].across) >= set(c)) for v in vs]
    outs = collectives.batched.grouped(
        keys + [((), False)] * len(rows),
        lambda key, xs, fmts: collectives.batched.reduce_scatter(
            xs, fmts, (*self.plan.axes, *key[0]) if key[1] else self.plan.axes,
            self.plan.bucket_bytes, self.plan.alone_bytes, keys=vma(xs),
            copies=() if key[1] else key[0]),
        values, [self.fmt(v) for v in vs] + row_fmts)
    if dtypes:  # Rows of owned gradients, in the same batched reduce-scatters.
      self.owned.scattered(dtypes, outs[len(vs):])
    groups: dict = {}
    for v, x, (copies, over_copies) in zip(vs, outs[:len(vs)], keys, strict=True):
      self.held[v].shard, self.held[v].summand = x, None
      if (across := tuple(a for a in self.held[v].across
                          if not over_copies or a not in copies)):
        groups.setdefault(across, []).append(v)
    for across, us in groups.items():
      shards = [self.held[u].shard for u in us]
      summed = collectives.batched.all_reduce_bucketed(shards, across, self.plan.bucket_bytes,
                                                       keys=vma(shards))
      for u, x in zip(us, summed, strict=True):
        self.held[u].shard = x

  def gather(self, vs: list, after: Mapping | None = None) -> None:
    """Gives each of `vs` (held as shards) its whole value, batched (§5.2); in
    the narrower float of `plan.gather_dtypes` where it has one (Fig. 7). The
    all-gather of each follows its values in `after` (`JaxprPlan.gather_after`),
    those of owned rows all of them."""
    narrow = self.plan.gather_dtypes
    after = after or {}
    mine = [v for v in vs if self.owned is None or v not in self.owned.own.outputs]
    shards = [self.shard(v) if v not in narrow else self.shard(v).astype(narrow[v]) for v in mine]
    # Rows of owned new weights join the same batched all-gathers (§5.2).
    dtypes, rows, row_fmts = self.owned.to_gather() if len(mine) < len(vs) else ([], [], [])
    shards += rows
    every = tuple(dict.fromkeys(u for v in vs for u in after.get(v, ())))
    tokens = [self.tokens(after.get(v, ())) for v in mine] + [self.tokens(every)] * len(rows)
    outs = collectives.batched.grouped(  # Shards over `copy_axes` too: collectives of their own.
        [self.axes(v) for v in mine] + [tuple(self.plan.axes)] * len(rows),
        lambda over, xs, fmts, ts: collectives.batched.all_gather(
            xs, fmts, over, self.plan.bucket_bytes, self.plan.alone_bytes, keys=vma(xs),
            after=ts),
        shards, [self.fmt(v) for v in mine] + row_fmts, tokens)
    wholes = dict(zip(mine, outs, strict=False))
    if dtypes:
      wholes.update(self.owned.gathered(dtypes, outs[len(mine):]))
    for v in vs:
      self.held[v].whole = wholes[v]

  def tokens(self, vs) -> list:
    """The values of `vs` that vary over no mesh axis but the sharding axes (as
    shards or whole): what `collectives.after` may tie the values gathered over
    those axes to and leave them the same across the others (partial sharding). A
    gradient all-reduce that `_scatter_blocks` took whole has no value to tie to."""
    held = [u for u in vs if any(x is not None for x in (
        self.held[u].whole, self.held[u].shard, self.held[u].summand, self.held[u].partial))]
    values = [self.shard(u) if u in self.plan.formats else self.whole(u) for u in held]
    return [x for x in values if compat.varying_axes(jax.typeof(x)) <= set(self.plan.axes)]

  def shard_as(self, v, fmt: ShardFormat) -> Any:
    """The shard of `v` in `fmt`, which may differ from the plan's format for `v`."""
    if self.plan.formats.get(v) == fmt:
      return self.shard(v)
    return collectives.shard(self.whole(v), fmt, self.plan.shard_axes(fmt))


def vma(values) -> list[frozenset]:
  """The mesh axes each value varies over (JAX's types under check_vma): the batched
  collectives' bucket keys (a weight split over a model axis never shares a bucket
  with a replicated one)."""
  return [compat.varying_axes(jax.typeof(x)) for x in values]
