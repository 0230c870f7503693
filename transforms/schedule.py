"""The order in which the rewrite runs a jaxpr's equations (§5.2).

Any order that respects data dependence computes the same values; this one
lets the rewrite batch its collectives: every gradient all-reduce before the
update reads any (one batched reduce-scatter), every reduction of one phase
before anything reads a result of that phase (one batched all-reduce per
phase), and the owned updates (`transforms.owned`) together in one switch.
"""

from __future__ import annotations

from wus.analysis import compat
from wus.analysis.plan import JaxprPlan
from wus.analysis.shardable import Kind


def schedule(jaxpr, jaxpr_plan: JaxprPlan) -> list[int]:
  """An order of the equations that batches the collectives of the update (§5.2).

  An equation's level counts, on its longest input path, the all-reduces of
  partial results (two levels each) and whether the weight update has begun
  (one level): level 2p is phase p before the update, 2p + 1 its update.
  Running equations by (level, position) is a valid order (a reader's level
  is at least its producer's) in which every gradient all-reduce runs before
  the update reads any (one batched reduce-scatter) and every reduction of
  one phase before anything reads a result of that phase (one batched
  all-reduce per phase). Effectful equations keep their order. Owned updates
  run together (`transforms.owned`), last of the highest level any reaches.
  """
  owned_eqns = {i for i, k in jaxpr_plan.shard_eqns.items() if k is Kind.OWNED}
  keys = _levels(jaxpr, jaxpr_plan)
  if owned_eqns:
    keys = _levels(jaxpr, jaxpr_plan, owned_eqns, max(keys[i][0] for i in owned_eqns))
  return [i for *_, i in sorted(keys)]


def _levels(jaxpr, jaxpr_plan: JaxprPlan, owned_eqns=frozenset(), top: int = 0) -> list[tuple]:
  """(level, owned, position) per equation (`schedule`); `owned_eqns` forced to `top`."""
  level: dict = {}
  keys, last_effect = [], 0
  for i, eqn in enumerate(jaxpr.eqns):
    p = max((level.get(v, 0) for v in eqn.invars if not compat.is_literal(v)), default=0)
    kind = jaxpr_plan.shard_eqns.get(i)
    if kind is not None and kind.update:
      p |= 1
    if compat.side_effects(eqn):
      p = last_effect = max(p, last_effect)
    if i in owned_eqns:
      p = top
    done = p + (kind is not None and kind.partial) + (i in owned_eqns)
    for v in eqn.outvars:
      level[v] = done
    keys.append((p, i in owned_eqns, i))
  return keys
