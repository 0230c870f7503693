"""Why the Plan decides as it does, as values: the passes build them, `render` words them.

A cluster's `Reason` is the verdict of the pass that decided it (the cost
model's words, `cost.decide`; what stops its layout; a format clash; an
owner) and the notes later passes add: where a loop gathers its weights
(Fig. 4), the conditionals that gather inside their branch (§3.2), partial
sharding (§5.2), the equations of the update that run whole, why ownership
does not take it. `render` turns one into the Plan's text, in this one
place, by a table keyed by the note's type.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class FormatClash:
  """A value an earlier cluster reads as shards of another format (one value, one format)."""

  name: str


@dataclasses.dataclass(frozen=True)
class RunsWhole:
  """Equations of the update that run whole because a repeated reader has no shard rule.

  Attributes:
    what: the first of them in words ("the all-reduce at f.py:3", "mul at f.py:4").
    more: how many more run whole with it.
    reader: the reader's primitive name and source line ("sort at f.py:5").
  """

  what: str
  more: int
  reader: str


@dataclasses.dataclass(frozen=True)
class KeptWhole:
  """The parts of an update that run whole, one per reader that makes them."""

  parts: tuple[RunsWhole, ...]


@dataclasses.dataclass(frozen=True)
class RareConditionals:
  """Conditionals on the loop counter, at these source lines: each gathers what it reads
  whole inside its branch, off the frequent path (§3.2)."""

  lines: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Gather:
  """A weight all-gathered where read whole: `nbytes` moved instead of `whole_bytes`
  (its own dtype), in `dtype`; `narrow` when that is a narrower float (Fig. 7)."""

  name: str
  dtype: str
  nbytes: int
  whole_bytes: int
  narrow: bool


@dataclasses.dataclass(frozen=True)
class LoopGathers:
  """Where a loop body's cluster gathers each carried weight it reads (Fig. 4): right
  before the forward pass when narrow (right), at the end of each iteration (left)."""

  gathers: tuple[Gather, ...]


@dataclasses.dataclass(frozen=True)
class KeptShardedWeights:
  """Weights kept sharded between steps (`shard_weights=True`), gathered narrow at
  their first read (Fig. 4 right, Fig. 7)."""

  gathers: tuple[Gather, ...]


@dataclasses.dataclass(frozen=True)
class PartialSharding:
  """Reduce-scatter over `axes`, the shards all-reduced across `across` (§5.2)."""

  axes: tuple[str, ...]
  across: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class NotOwned:
  """Why ownership does not run the replicated cluster on whole tensors."""

  why: str


@dataclasses.dataclass(frozen=True)
class Owned:
  """The update runs on whole tensors on one replica (ownership).

  Attributes:
    owner: the replica.
    where: its slot in its stack, in words.
    eqns: the update's equations.
    seconds: its predicted time on the owner.
    with_clusters: the other clusters that share its equations.
  """

  owner: int
  where: str
  eqns: int
  seconds: float
  with_clusters: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class OwnedWith:
  """A cluster owned with another one, whose equations it shares."""

  index: int


@dataclasses.dataclass(frozen=True)
class Reason:
  """Why a cluster is sharded, replicated or owned.

  Attributes:
    verdict: the deciding pass's words, or one of this module's verdicts
      (`FormatClash`, `KeptWhole`, `Owned`, `OwnedWith`).
    notes: what later passes add, in order.
    where: the loop the cluster sits in ("loop at f.py:12: "), "" at the step's level.
  """

  verdict: object
  notes: tuple = ()
  where: str = ""

  def noted(self, *notes) -> Reason:
    return dataclasses.replace(self, notes=self.notes + notes)

  def __str__(self) -> str:
    return render(self)


def render(reason: Reason) -> str:
  """The Plan's words for `reason`: its place, its verdict and its notes, "; "-separated."""
  return reason.where + "; ".join(_words(x) for x in (reason.verdict, *reason.notes))


def _words(x) -> str:
  return x if isinstance(x, str) else _RENDER[type(x)](x)


def _gather(g: Gather, loop: bool) -> str:
  if loop and not g.narrow:
    return (f"{g.name} all-gathered at the end of each iteration ({g.whole_bytes} B, {g.dtype}): "
            "the forward pass reads it whole in that dtype, so gathering before it would move "
            "as many bytes (Fig. 4 left)")
  if loop:
    return (f"{g.name} kept sharded across iterations and all-gathered in {g.dtype} right "
            f"before the forward pass reads it: {g.nbytes} B per iteration instead of "
            f"{g.whole_bytes} B (Fig. 4 right, Fig. 7)")
  return (f"{g.name} kept sharded between steps (shard_weights=True) and all-gathered in "
          f"{g.dtype} at its first read: {g.nbytes} B per step instead of {g.whole_bytes} B "
          "(Fig. 4 right, Fig. 7)")


def _owned(x: Owned) -> str:
  out = (f"OWNED by replica {x.owner}, {x.where}: the owner runs the update on whole tensors "
         f"({x.eqns} equations, predicted {x.seconds * 1e6:.3g} us); gradient "
         "reduce-scattered in rows, new weights all-gathered, state only on its owner")
  if x.with_clusters:
    out += f"; with cluster(s) {list(x.with_clusters)}, which share its equations"
  return out


_RENDER: dict[type, Callable] = {
    FormatClash: lambda x: (f"{x.name} is read as shards of another format by an earlier "
                            "cluster (one value, one format)"),
    RunsWhole: lambda x: (f"{x.what} and {x.more} more equation(s) run whole: {x.reader} reads "
                          "the result whole and has no shard rule"),
    KeptWhole: lambda x: "; ".join(map(_words, x.parts)),
    RareConditionals: lambda x: ", ".join(
        f"the conditional at {line} follows the loop counter: it gathers what it reads whole "
        "inside its branch, off the frequent path (§3.2)" for line in x.lines),
    LoopGathers: lambda x: ", ".join(_gather(g, loop=True) for g in x.gathers) or (
        "no carried weight is read whole: nothing gathered in the loop"),
    KeptShardedWeights: lambda x: ", ".join(_gather(g, loop=False) for g in x.gathers),
    PartialSharding: lambda x: (f"partial sharding (§5.2): reduce-scatter over {list(x.axes)}, "
                                f"the shards all-reduced across {list(x.across)}"),
    NotOwned: lambda x: f"not owned: {x.why}",
    Owned: _owned,
    OwnedWith: lambda x: f"owned with cluster {x.index} (shares equations)",
}
