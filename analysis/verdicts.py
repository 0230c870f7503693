"""The cost model's verdicts on a cluster (`cost.decide`, §3.2), as values.

Each is the verdict of a `reasons.Reason`; `RENDER` words them for `reasons.render`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from wus.analysis import causes
from wus.analysis.network import format_seconds


@dataclasses.dataclass(frozen=True)
class OnShards:
  """Sharded: the update runs on 1/N shards, with `reductions` partial reductions (all-reduced)
  and `gathers` all-gathers."""

  reductions: int
  gathers: int


@dataclasses.dataclass(frozen=True)
class KeepsStateSharded:
  """Sharded for the optimizer state it keeps sharded, at `extra` bytes more all-gather than
  the reduce-scatter saves."""

  extra: int


@dataclasses.dataclass(frozen=True)
class ArrivesAsShards:
  """Sharded: its gradient arrives as shards (a loop accumulated it, §4.2); `all_gather`
  bytes all-gathered, optimizer state kept sharded."""

  all_gather: int


@dataclasses.dataclass(frozen=True)
class RootsSliced:
  """Sharded with no all-reduce to replace: its roots (`what`) are local slices; optimizer
  state kept sharded at `all_gather` bytes of all-gather."""

  what: str
  all_gather: int


@dataclasses.dataclass(frozen=True)
class OnlyAddsGathers:
  """Replicated: no all-reduce to replace (its roots, `what`, are sliced locally) and no
  optimizer state to keep sharded, so sharding would only add `all_gather` bytes."""

  what: str
  all_gather: int


@dataclasses.dataclass(frozen=True)
class MoreAllGather:
  """Replicated: `all_gather` bytes of all-gather, more than the `all_reduce` bytes it
  replaces; `reader` says who reads a value of it whole, and why that differs
  (`causes.ReadWhole`; None if nothing outside reads one)."""

  all_gather: int
  all_reduce: int
  reader: causes.ReadWhole | None = None


@dataclasses.dataclass(frozen=True)
class SavesNothing:
  """Replicated: reads no weights or state and returns nothing."""


@dataclasses.dataclass(frozen=True)
class WholeReader:
  """Replicated: `reader` (a `causes.Eqn`), repeated on every replica and with no shard
  rule, reads a sharded value whole."""

  reader: causes.Eqn


@dataclasses.dataclass(frozen=True)
class SlowerSharded:
  """Replicated under objective='time': predicted `sharded` seconds of collectives and
  update against `replicated`."""

  sharded: float
  replicated: float


RENDER: dict[type, Callable] = {
    OnShards: lambda x: ("update on 1/N shards"
                         + (f", {x.reductions} reduction(s)" if x.reductions else "")
                         + f"; {x.gathers} all-gather(s)"),
    KeepsStateSharded: lambda x: (f"update on 1/N shards; optimizer state kept sharded at the "
                                  f"cost of {x.extra} B more all-gather than the reduce-scatter "
                                  "saves"),
    ArrivesAsShards: lambda x: ("update on 1/N shards of a gradient that arrives as shards; "
                                f"optimizer state kept sharded, {x.all_gather} B all-gathered"),
    RootsSliced: lambda x: ("update on 1/N shards with no all-reduce to make a reduce-scatter: "
                            f"its roots are local slices (no communication) of {x.what}; "
                            f"optimizer state kept sharded at the cost of {x.all_gather} B of "
                            "all-gather"),
    OnlyAddsGathers: lambda x: (f"no all-reduce to make a reduce-scatter: the update reads "
                                f"{x.what}, and would keep no optimizer state sharded between "
                                f"steps, so sharding it would only add {x.all_gather} B of "
                                "all-gather"),
    MoreAllGather: lambda x: (f"needs {x.all_gather} B of all-gather, more than the "
                              f"{x.all_reduce} B all-reduce it replaces"
                              + (causes.words(x.reader) if x.reader is not None else "")),
    SavesNothing: lambda x: ("reads no weights or optimizer state and returns nothing: only "
                             "computation that differs across replicas reads its result"),
    WholeReader: lambda x: (f"{causes.words(x.reader)} reads a sharded value whole and has no "
                            "shard rule"),
    SlowerSharded: lambda x: (f"predicted slower sharded ({format_seconds(x.sharded)} of "
                              f"collectives and update against {format_seconds(x.replicated)} "
                              "replicated; objective='time'; objective='memory' shards it)"),
}
