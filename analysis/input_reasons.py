"""Why each input of a planned jaxpr is kept sharded or whole (§3.2, §4.2).

The planner's passes propose reasons for an input as they run (a loop, each
cluster, ownership, the state kept after them); `InputReasons.pick` is the one
place that chooses among them, by a stated precedence, so the order the passes
run in does not decide the Plan.
"""

from __future__ import annotations

import dataclasses

from wus.analysis import reasons

# The precedence, highest first (`InputReasons.pick`).
KEPT = 0      # Kept sharded between steps after the clusters (read only as shards, passed
              # through); proposed only for state no cluster or owner keeps sharded.
OWNED = 1     # Ownership's: it re-plans replicated clusters on whole tensors.
SHARDED = 2   # A cluster or a loop keeps it sharded; the last one proposed wins.
NOTED = 3     # shard_weights: a weight an update writes, kept whole, and why; noted on
              # the fallback (or "the cluster that updates it").
FALLBACK = 4  # Why it stays whole: the first one proposed wins (a loop's whole input, the
              # replicated cluster, the cluster that slices it locally, the reader with no
              # shard rule); `make_plan` says why for an input with none.


@dataclasses.dataclass
class InputReasons:
  """The candidate reasons of the inputs of one jaxpr, by input position.

  A reason is (kept sharded, why: a `reasons` verdict or a `reasons.Reason`).
  """

  kept: dict = dataclasses.field(default_factory=dict)
  owned: dict = dataclasses.field(default_factory=dict)
  sharded: dict = dataclasses.field(default_factory=dict)
  noted: dict = dataclasses.field(default_factory=dict)  # k -> (the cluster, [notes]).
  fallback: dict = dataclasses.field(default_factory=dict)
  order: dict = dataclasses.field(default_factory=dict)  # Inputs, by their first proposal.

  def keep(self, k: int, why) -> None:
    self.order.setdefault(k)
    self.kept[k] = (True, why)

  def own(self, input_reason: dict) -> None:
    self.order.update(dict.fromkeys(k for k in input_reason if k not in self.order))
    self.owned.update(input_reason)

  def shard(self, k: int, why) -> None:
    self.order.setdefault(k)
    self.sharded[k] = (True, why)

  def note(self, k: int, cluster: int, note) -> None:
    self.order.setdefault(k)
    self.noted.setdefault(k, (cluster, []))[1].append(note)

  def whole(self, k: int, why) -> None:
    self.order.setdefault(k)
    self.fallback.setdefault(k, (False, why))

  def pick(self, k: int) -> tuple[bool, object] | None:
    """Input `k`'s reason: the candidate of highest precedence (`KEPT` to `FALLBACK`),
    or None if no pass proposed one."""
    for tier in (self.kept, self.owned, self.sharded):
      if k in tier:
        return tier[k]
    if k in self.noted:
      cluster, notes = self.noted[k]
      why = self.fallback.get(k, (False, reasons.ClusterUpdates(cluster)))[1]
      why = why if isinstance(why, reasons.Reason) else reasons.Reason(why)
      return False, why.noted(*notes)
    return self.fallback.get(k)

  def picked(self) -> dict[int, tuple[bool, object]]:
    """Input position -> its reason, for every input some pass proposed one for (in the
    order of their first proposals)."""
    return {k: self.pick(k) for k in self.order}
