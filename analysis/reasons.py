"""Why the Plan decides as it does, as values: the passes build them, `render` words them.

A cluster's `Reason` (`plan.ClusterPlan.why`) is the verdict of the pass
that decided it (the cost model's verdict, `cost.decide`, from `verdicts`; what stops its
layout; a format clash; an owner) and the notes later passes add: where a
loop gathers its weights (Fig. 4), the conditionals that gather inside their
branch (§3.2), partial sharding (§5.2), the equations of the update that run
whole, why ownership does not take it. An input's (`plan.InputPlan.why`) is
why it is kept sharded between steps (the cluster that alone reads it, a
loop's carry, its owner) or whole (the replicated cluster that reads it, a
reader with no shard rule, its in_spec, its size), and what
`shard_weights=True` adds. A front end's refusal (`Plan.unchanged`, `Plan.outside`) is
a Reason too, its verdict one of `refusals`'. `render` turns one into the Plan's text, in
this one place, by a table keyed by the verdict's or note's type.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

from wus.analysis import causes, refusals, verdicts


@dataclasses.dataclass(frozen=True)
class FormatClash:
  """A value an earlier cluster reads as shards of another format (one value, one format)."""

  name: str


@dataclasses.dataclass(frozen=True)
class RunsWhole:
  """Equations of the update that run whole because a repeated reader has no shard rule.

  Attributes:
    what: the first of them (`causes.Eqn`): its gradient all-reduce when `all_reduce`
      ("the all-reduce at f.py:3"), else the last ("mul at f.py:4").
    more: how many more run whole with it.
    reader: the reader (`causes.Eqn`: "sort at f.py:5").
    all_reduce: whether `what` is a gradient all-reduce.
  """

  what: causes.Eqn
  more: int
  reader: causes.Eqn
  all_reduce: bool = False


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
class OverCopies:
  """The update of values identical across the other mesh axes `copy_axes` (a
  tensor-parallel step's "model") is sharded over them too, or `why` it is not; with
  `blocks`, over them alone, within each block of the replica `axes` (FSDP)."""

  axes: tuple[str, ...]
  copy_axes: tuple[str, ...]
  why: object | None = None  # A `causes` value: `DependsOnInput`, `AtMost`, `Regroups`...
  summed: bool = False  # Its gradient all-reduces run over `copy_axes` too.
  blocks: bool = False  # Each replica of `axes` updates its own block (FSDP).


@dataclasses.dataclass(frozen=True)
class NotOwned:
  """Why ownership does not run the replicated cluster on whole tensors: `why`, one of
  `causes`' (`TooLargeToBalance`, `TooCheap`, `BlockOfSplit`...)."""

  why: object


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


# Inputs: why each is kept sharded between steps or whole (`plan.InputPlan.why`, a
# `Reason` with one of these as its verdict; a front end's reason, that the caller
# keeps the state whole, is the verdict (`causes.SplitDifferently`) with the planner's
# as a note).

@dataclasses.dataclass(frozen=True)
class LoopCarried:
  """Kept sharded: a loop carries it, sharded across iterations and between steps."""

  line: str  # The loop's source line.


@dataclasses.dataclass(frozen=True)
class OnlyCluster:
  """Kept sharded: optimizer state only cluster `index` reads."""

  index: int


@dataclasses.dataclass(frozen=True)
class OnlySharded:
  """Kept sharded: optimizer state read only as shards by sharded updates
  (several clusters); `unchanged` when the step returns it as it came."""

  unchanged: bool


@dataclasses.dataclass(frozen=True)
class PassedThrough:
  """Kept sharded: returned unchanged and read by nothing else (state another step updates)."""


@dataclasses.dataclass(frozen=True)
class NarrowWeight:
  """Kept sharded (`shard_weights=True`): a weight cluster `index` updates, which the
  forward pass reads only in `dtype`."""

  index: int
  dtype: str


@dataclasses.dataclass(frozen=True)
class OnOwner:
  """The owned cluster `index` reads it on its owner: optimizer state only it reads
  (`state`, kept on the owner), or a weight it reads whole."""

  owner: int
  index: int
  state: bool


@dataclasses.dataclass(frozen=True)
class ClusterReplicated:
  """Whole: the cluster `index` that reads it stays replicated."""

  index: int


@dataclasses.dataclass(frozen=True)
class SlicedLocally:
  """Whole: read whole elsewhere; the sharded cluster `index` slices it locally."""

  index: int


@dataclasses.dataclass(frozen=True)
class ClusterUpdates:
  """Whole: a weight cluster `index` updates (`NotKeptByShardWeights` says why whole)."""

  index: int


@dataclasses.dataclass(frozen=True)
class NoShardRule:
  """Whole: state whose next value an update computes, read whole by `reader` (a
  `causes.Eqn`), which every replica repeats and which has no shard rule."""

  reader: causes.Eqn


@dataclasses.dataclass(frozen=True)
class NotKeptByShardWeights:
  """A note: `shard_weights=True` does not keep this weight sharded, for `why` (a `causes`
  value: `ReadsIn`, `Returned`, `ReadInFloats`...)."""

  why: object


@dataclasses.dataclass(frozen=True)
class Differs:
  """Whole: not identical across the replica `axes`, for `why`: what splits it, as its
  front end says (`causes.SplitBy`, `pipeline.Step.split_reason`)."""

  axes: tuple[str, ...]
  why: causes.SplitBy


@dataclasses.dataclass(frozen=True)
class Tiny:
  """Whole: a scalar or tiny tensor (at most `num_shards` elements, or fewer than `min_size`)."""

  num_shards: int
  min_size: int


@dataclasses.dataclass(frozen=True)
class NoGradientAllReduce:
  """Whole: the step has no gradient all-reduce over exactly the replica `axes`."""

  axes: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class NotRead:
  """Whole: no weight-update cluster reads it (the forward pass only)."""


@dataclasses.dataclass(frozen=True)
class OutsideRegion:
  """Whole: an argument only the rest of a `wus.jit` step reads (the forward and backward
  pass), which runs as `jax.jit` runs it. With `state`, the step returns its next value,
  which that rest computes too: no gradient of it reached the update region as a sum over
  the batch."""

  state: bool = False


def shifted(x, offset: int):
  """`x` with the cluster it names numbered `offset` later (a loop body's clusters
  listed in the step's Plan after others)."""
  return dataclasses.replace(x, index=x.index + offset) if hasattr(x, "index") else x


@dataclasses.dataclass(frozen=True)
class Reason:
  """Why a cluster is sharded, replicated or owned, or an input kept sharded or whole.

  Attributes:
    verdict: a value, never words: one of this module's verdicts (`FormatClash`,
      `KeptWhole`, `Owned`, `OwnedWith`; an input's `OnlyCluster`...), the cost model's
      (`verdicts`), what stops a layout or keeps state whole (`causes`) or a front end's
      refusal (`refusals`).
    notes: what later passes add, in order.
    where: the loop the cluster sits in ("loop at f.py:12: "), "" at the step's level.
  """

  verdict: object
  notes: tuple = ()
  where: str = ""

  def __post_init__(self):
    if any(isinstance(x, str) for x in (self.verdict, *self.notes)):
      raise TypeError(f"a Reason holds values, not words: {self.verdict!r}, {self.notes!r}")

  def noted(self, *notes) -> Reason:
    return dataclasses.replace(self, notes=self.notes + notes)

  def __str__(self) -> str:
    return render(self)


def render(reason: Reason, cite: bool = True) -> str:
  """The Plan's words for `reason`: its place, its verdict and its notes, "; "-separated;
  without `cite`, without the paper's sections and figures ("(§3.1)", "(Fig. 4 left)"):
  `str(plan)` leaves them to `plan.details()`."""
  text = reason.where + "; ".join(_words(x) for x in (reason.verdict, *reason.notes))
  return text if cite else _CITATION.sub("", text)


# A citation of the paper in the words: " (§3.1)", " (Fig. 4 right, Fig. 7)".
_CITATION = re.compile(r" \((?:§|Fig\. )[^()]*\)")


def _words(x) -> str:
  return _RENDER[type(x)](x)


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
    **verdicts.RENDER,
    **refusals.RENDER,
    **causes.RENDER,
    FormatClash: lambda x: (f"{x.name} is read as shards of another format by an earlier "
                            "cluster (one value, one format)"),
    RunsWhole: lambda x: (("the all-reduce at " + x.what.line if x.all_reduce else _words(x.what))
                          + f" and {x.more} more equation(s) run whole: {_words(x.reader)} reads "
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
    OverCopies: lambda x: (
        f"sharded over {list(x.copy_axes)} within each block: not identical across "
        f"{list(x.axes)} (each replica of them updates its own block, FSDP), identical on "
        f"every replica of {list(x.copy_axes)} (§3.1), each keeps its part of the block"
        if x.why is None and x.blocks else
        f"sharded over {list(x.axes + x.copy_axes)}: its gradient all-reduce runs over "
        f"{list(x.copy_axes)} too, one reduce-scatter over all of them (§3.1)"
        if x.why is None and x.summed else
        f"sharded over {list(x.axes + x.copy_axes)}: identical on every replica of "
        f"{list(x.copy_axes)} too (§3.1), each keeps its part of the shard" if x.why is None else
        f"sharded over {list(x.axes)} only, not {list(x.copy_axes)}: its update may differ "
        f"across them ({_words(x.why)})"),
    NotOwned: lambda x: f"not owned: {_words(x.why)}",
    Owned: _owned,
    OwnedWith: lambda x: f"owned with cluster {x.index} (shares equations)",
    LoopCarried: lambda x: f"state of the loop at {x.line}, sharded between steps",
    OnlyCluster: lambda x: f"optimizer state: only cluster {x.index} reads it",
    OnlySharded: lambda x: ("optimizer state: only sharded updates read it"
                            + (", and it is returned unchanged" if x.unchanged else "")),
    PassedThrough: lambda x: ("returned unchanged, read by nothing else (state another step "
                              "updates): kept sharded between steps as it came"),
    NarrowWeight: lambda x: (f"weight kept sharded (shard_weights=True): cluster {x.index} "
                             f"updates it, the forward pass reads it in {x.dtype}"),
    OnOwner: lambda x: (f"optimizer state owned by replica {x.owner}: only cluster {x.index} "
                        "reads it, on its owner" if x.state
                        else f"read whole by its owner, replica {x.owner} (cluster {x.index})"),
    ClusterReplicated: lambda x: f"cluster {x.index} stays replicated",
    SlicedLocally: lambda x: f"read whole elsewhere; cluster {x.index} slices it locally",
    ClusterUpdates: lambda x: f"cluster {x.index} updates it",
    NoShardRule: lambda x: (f"{_words(x.reader)} reads it whole and has no shard rule (an update "
                            "computes its next value)"),
    NotKeptByShardWeights: lambda x: ("not kept sharded by shard_weights=True, which keeps "
                                      "weights read whole only in a narrower float: "
                                      + _words(x.why)),
    Differs: lambda x: f"not identical across {list(x.axes)} ({_words(x.why)})",
    Tiny: lambda x: (f"scalar or tiny (at most {x.num_shards} elements, or fewer than "
                     f"min_shard_size={x.min_size}): kept replicated"),
    NoGradientAllReduce: lambda x: (f"the step has no gradient all-reduce over exactly "
                                    f"{list(x.axes)}, so no weight update to shard (pass "
                                    "axis_name= the data-parallel axes)"),
    NotRead: lambda x: ("no weight-update cluster reads it (read whole only, e.g. by the "
                        "forward pass)"),
    OutsideRegion: lambda x: (
        "state the rest of the step updates, as jax.jit runs it (its next value is computed "
        "outside the update region: an RNG key, a counter, batch statistics, or a weight "
        "whose gradient is not seen as a sum over the batch)" if x.state else
        "read only by the rest of the step (the forward and backward pass), which runs as "
        "jax.jit runs it"),
}
