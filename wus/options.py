"""`Options`: what a user tells wus besides the step, validated once for every front end."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from wus.analysis import cost, network
from wus.transforms import groups


@dataclasses.dataclass(frozen=True)
class Options:
  """The options `wus.shard_map`, `wus.pmap` and `wus.jit` take, as the pipeline reads them.

  Attributes:
    min_shard_size: tensors with fewer elements stay replicated (tensors of at
      most N elements always do).
    shard_group_size: None (one group of all replicas), a positive int G
      (partial sharding within groups of G consecutive replicas, §5.2) or
      "auto" (the G the cost model predicts fastest).
    objective: "memory" or "time", what a cluster's decision favours (§3.2).
    topology: the devices the update is sharded over, for the cost model;
      None: `network.default_topology` from the mesh's processes.
    shard_weights: keep weights the forward pass reads only in a narrower float
      sharded between calls too (Fig. 4 right, Fig. 7).
    axis_name: the data-parallel mesh axis (or axes) to shard over; None: the
      axes of the gradient all-reduces.

  Raises:
    ValueError: a `shard_group_size` that is not a positive int, None or
      "auto"; an unknown `objective`; a negative `min_shard_size`.
  """

  min_shard_size: int = 0
  shard_group_size: int | str | None = None
  objective: str = "memory"
  topology: network.Topology | None = None
  shard_weights: bool = False
  axis_name: str | Sequence[str] | None = None

  def __post_init__(self):
    groups.check_group_size(self.shard_group_size)
    if self.shard_group_size not in (None, "auto"):
      object.__setattr__(self, "shard_group_size", int(self.shard_group_size))
    if self.objective not in cost.OBJECTIVES:
      raise ValueError(f"objective={self.objective!r}: pass one of {list(cost.OBJECTIVES)} "
                       "(\"memory\" shards for the optimizer state it keeps sharded, \"time\" "
                       "only where the cost model predicts no slower steps)")
    if self.min_shard_size < 0:
      raise ValueError(f"min_shard_size={self.min_shard_size} must be at least 0")
    object.__setattr__(self, "shard_weights", bool(self.shard_weights))


OPTION_NAMES = frozenset(f.name for f in dataclasses.fields(Options))  # Its keyword arguments.
