"""What the Plan's reasons are built from, as values: equations, splits, failed layouts.

A `reasons.Reason`'s verdict and notes hold these where their words name an equation
(`Eqn`: its primitive and source line), why an input differs across replicas (a front
end's `SplitBy`), why no format fits a cluster (`SmallReduction`, `Regroups`,
`LoopFormat`), why ownership does not take a cluster (`NotOwned`'s causes), how
`shard_group_size` chose G (`GroupsOfOne`, `AutoGroupSize`, `AutoOneGroup`) or why state is
kept whole between steps (`SplitDifferently`). `RENDER` words them for `reasons.render`,
the one place a Reason becomes text.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class Eqn:
  """An equation, by its primitive's name and its source line ("sort at f.py:5")."""

  primitive: str
  line: str

  @classmethod
  def of(cls, eqn, line: str) -> Eqn:
    """`eqn` (a JaxprEqn) at `line` (`compat.source_line(eqn)`)."""
    return cls(str(eqn.primitive), line)


@dataclasses.dataclass(frozen=True)
class SplitBy:
  """What makes an input differ across the replicas, as its front end says it:
  "spec" (`wus.shard_map`: its in_spec splits it), "batch" (`wus.jit`: split over the
  batch axes) or "mapped" (`wus.pmap`: its per-device copies differ)."""

  how: str = "spec"


# Each front end's `pipeline.Step.split_reason`.
SPEC_SPLITS = SplitBy("spec")
BATCH_SPLITS = SplitBy("batch")
MAPPED_COPIES_DIFFER = SplitBy("mapped")


@dataclasses.dataclass(frozen=True)
class SplitDifferently:
  """State whose in_spec and out_spec (of its next value, `name`) split it differently:
  kept whole between steps."""

  in_spec: str
  out_spec: str
  name: str


@dataclasses.dataclass(frozen=True)
class SmallReduction:
  """A reduction of `aval` keeps the shard dim, but its `result` is too small to shard."""

  aval: str
  result: str


@dataclasses.dataclass(frozen=True)
class Regroups:
  """A reshape of `aval` regroups dims that a reduction or broadcast must keep apart."""

  aval: str


@dataclasses.dataclass(frozen=True)
class LoopFormat:
  """`aval` leaves a loop as shards of another format than the update needs."""

  aval: str


# Why a value differs across replicas (`redundancy.why_differs`), or why an update may
# differ across other mesh axes (`redundancy.differs_over`, `reasons.OverCopies.why`).

@dataclasses.dataclass(frozen=True)
class DependsOnInput:
  """It depends on the input `name`, which differs across replicas."""

  name: str


@dataclasses.dataclass(frozen=True)
class NoRedundancyRule:
  """`eqn` has no redundancy rule: wus treats its result as differing."""

  eqn: Eqn


@dataclasses.dataclass(frozen=True)
class DependsOn:
  """It depends on `eqn` (which has side effects, with `effects`)."""

  eqn: Eqn
  effects: bool = False


@dataclasses.dataclass(frozen=True)
class VariesAcross:
  """It differs across replicas (no equation found to blame)."""


@dataclasses.dataclass(frozen=True)
class AllReduceOverSome:
  """Its gradient all-reduce at `line` runs over some of the axes."""

  line: str


@dataclasses.dataclass(frozen=True)
class HasEffects:
  """`eqn` has side effects."""

  eqn: Eqn


@dataclasses.dataclass(frozen=True)
class AtMost:
  """A tensor has at most `elements` elements (too few to shard over the copy axes too)."""

  elements: int


@dataclasses.dataclass(frozen=True)
class ReadWhole:
  """A value (`aval`) of a cluster read whole by `reader` outside it; `differs`: why the
  reader's result differs across replicas (`DependsOnInput`...), or None when it does not."""

  aval: str
  reader: Eqn
  differs: object | None = None


# Why ownership does not run a replicated cluster on whole tensors (`reasons.NotOwned`).

@dataclasses.dataclass(frozen=True)
class TooLargeToBalance:
  """Owning it with the rest predicts `owned` seconds against `replicated`."""

  owned: float
  replicated: float
  imbalance: float


@dataclasses.dataclass(frozen=True)
class TooCheap:
  """Its update predicts `owned` seconds owned (with the row copies), against `replicated`."""

  owned: float
  replicated: float


@dataclasses.dataclass(frozen=True)
class SpansMoreAxes:
  """Its all-reduce at `line` spans more axes than the sharding `axes`."""

  line: str
  axes: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class BlockOfSplit:
  """Its gradient at `line` is one block of a tensor split over `split` (tensor
  parallelism)."""

  line: str
  split: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class NotOnOneReplica:
  """`eqn` cannot run on one replica alone."""

  eqn: Eqn


@dataclasses.dataclass(frozen=True)
class ReadOutside:
  """`reader` reads `aval`, a value of the update, whole."""

  reader: Eqn
  aval: str


@dataclasses.dataclass(frozen=True)
class ReadsVarying:
  """It reads `aval`, which differs across replicas."""

  aval: str


@dataclasses.dataclass(frozen=True)
class NoOwnAllReduce:
  """It has no gradient all-reduce of its own."""


@dataclasses.dataclass(frozen=True)
class TinyTensors:
  """Its tensors are scalar or tiny."""


# Why `shard_weights=True` keeps a weight whole (`reasons.NotKeptByShardWeights.why`).

@dataclasses.dataclass(frozen=True)
class ReadInFloats:
  """The weight is read whole in `dtypes` (several floats, or none: not read whole)."""

  dtypes: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Returned:
  """`aval`, the weight or a layout copy of it, is returned."""

  aval: str


@dataclasses.dataclass(frozen=True)
class ReadsIn:
  """`eqn` reads the weight in `dtype`: converted to it (`converted`: not a narrower
  float), or as it is."""

  eqn: Eqn
  dtype: str
  converted: bool = False


@dataclasses.dataclass(frozen=True)
class ThroughLayoutChange:
  """The update also reads the weight through a layout change it does not hold."""


@dataclasses.dataclass(frozen=True)
class NoShardsRead:
  """The update cannot read the weight as shards, for `why` (a failed layout)."""

  why: object


# How `shard_group_size="auto"` chose G (`plan.Grouping.chosen`).

@dataclasses.dataclass(frozen=True)
class AutoGroupSize:
  """The cost model chose G = `group_size` of `num_shards`: `seconds` predicted for the
  collectives and update per step, `one_group` with one group of all; on `topology`
  ((axis name, size) per axis)."""

  group_size: int
  num_shards: int
  seconds: float
  one_group: float
  topology: tuple[tuple[str, int], ...]


@dataclasses.dataclass(frozen=True)
class GroupsOfOne:
  """`shard_group_size=1`: groups of one replica of `axis`, so nothing is sharded."""

  axis: str


@dataclasses.dataclass(frozen=True)
class AutoOneGroup:
  """One group of all `num_shards` replicas: nothing to group (`several` sharding axes,
  or no sharded update)."""

  num_shards: int
  several: bool


_SPLIT_BY = {"spec": "its in_spec splits it", "batch": "split over the batch axes",
             "mapped": "mapped, and its per-device copies differ"}


def _read_whole(x: ReadWhole) -> str:
  out = f" ({x.aval} is read whole by {_eqn(x.reader)}"
  if x.differs is not None:
    out += ", which differs across replicas: " + words(x.differs)
  return out + ")"


def _eqn(x: Eqn) -> str:
  return f"{x.primitive} at {x.line}"


def words(x) -> str:
  """The Plan's words for one of this module's values."""
  return RENDER[type(x)](x)


RENDER: dict[type, Callable] = {
    Eqn: _eqn,
    SplitBy: lambda x: _SPLIT_BY[x.how],
    SplitDifferently: lambda x: (f"its in_spec {x.in_spec} and the out_spec {x.out_spec} of its "
                                 f"next value {x.name} split it differently: kept whole between "
                                 "steps"),
    SmallReduction: lambda x: (f"a reduction of {x.aval} keeps the shard dim but its result "
                               f"{x.result} is too small to shard"),
    Regroups: lambda x: (f"a reshape of {x.aval} regroups dims that a reduction or broadcast "
                         "must keep apart"),
    LoopFormat: lambda x: (f"{x.aval} leaves a loop as shards of another format than this "
                           "update needs"),
    ReadWhole: _read_whole,
    DependsOnInput: lambda x: f"it depends on {x.name}, which differs across replicas",
    NoRedundancyRule: lambda x: (f"{_eqn(x.eqn)} has no redundancy rule, so wus treats its "
                                 "result as differing across replicas"),
    DependsOn: lambda x: (f"it depends on {_eqn(x.eqn)}"
                          + (", which has side effects" if x.effects else "")),
    VariesAcross: lambda x: "it differs across replicas",
    AllReduceOverSome: lambda x: f"its gradient all-reduce at {x.line} runs over some of them",
    HasEffects: lambda x: f"{_eqn(x.eqn)} has side effects",
    AtMost: lambda x: f"a tensor has at most {x.elements} elements",
    TooLargeToBalance: lambda x: (
        f"too large to balance: owning it with the rest predicts {x.owned * 1e6:.3g} us "
        f"against {x.replicated * 1e6:.3g} us replicated (imbalance {x.imbalance:.3f})"),
    TooCheap: lambda x: (f"its update is too cheap to own (predicted {x.owned * 1e6:.3g} us "
                         "owned, with the copies into and out of rows, against "
                         f"{x.replicated * 1e6:.3g} us replicated)"),
    SpansMoreAxes: lambda x: (f"its all-reduce at {x.line} spans more axes than the sharding "
                              f"axes {list(x.axes)}"),
    BlockOfSplit: lambda x: (f"its gradient at {x.line} is one block of a tensor split over "
                             f"{list(x.split)} (tensor parallelism): the update of the block "
                             "stays as the step wrote it, on every replica (owning blocks that "
                             "differ across those axes is not implemented)"),
    NotOnOneReplica: lambda x: f"{_eqn(x.eqn)} cannot run on one replica alone",
    ReadOutside: lambda x: f"{_eqn(x.reader)} reads {x.aval} of the update whole",
    ReadsVarying: lambda x: f"it reads {x.aval}, which differs across replicas",
    NoOwnAllReduce: lambda x: "it has no gradient all-reduce of its own",
    TinyTensors: lambda x: "its tensors are scalar or tiny",
    AutoGroupSize: lambda x: (
        f"shard_group_size='auto': the cost model chose G={x.group_size} of {x.num_shards} "
        f"(predicted collectives and update {x.seconds * 1e6:.3g} us per step, "
        f"{x.one_group * 1e6:.3g} us with one group of {x.num_shards}; topology "
        f"{' x '.join(f'{a}={n}' for a, n in x.topology)})"),
    ReadInFloats: lambda x: (f"read whole in {' and '.join(x.dtypes)}" if x.dtypes
                             else "not read whole"),
    Returned: lambda x: f"{x.aval} is returned",
    ReadsIn: lambda x: f"{_eqn(x.eqn)} reads it {'as' if x.converted else 'in'} {x.dtype}",
    ThroughLayoutChange: lambda x: ("the update also reads it through a layout change it does "
                                    "not hold"),
    NoShardsRead: lambda x: f"the update cannot read it as shards: {words(x.why)}",
    GroupsOfOne: lambda x: (f"shard_group_size=1: groups of one replica of {x.axis!r}, so "
                            "nothing is sharded; the update runs replicated as in the original "
                            "step"),
    AutoOneGroup: lambda x: (f"shard_group_size='auto': one group of all {x.num_shards} "
                             "replicas (nothing to group: "
                             f"{'several sharding axes' if x.several else 'no sharded update'})"),
}
