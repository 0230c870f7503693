"""Why a front end runs a step, or part of its update, as its JAX function runs it, as values.

`wus.jit` refuses a step (`Plan.unchanged`, a `reasons.Reason` with one of these as its
verdict) when nothing splits the batch (`Pinned`, `NoMesh`, `NoBatchSplit`), when the
step reads refs (`ReadsRefs`), when it finds no update (`NoUpdate`, with `SplitEnds`,
where the batch's split was lost, as a note), when the update cannot run on the model
blocks (`OnBlocks`, for one of the block refusals below), when the region would shard
nothing (`ShardsNothing`), or on an error of its own (`OwnError`). The block refusals
(`analysis.model_splits`, `wus.jit_region`) name the equation, its source line and the
value (its aval, as `str_short` writes it); one that needs a dim whole (`NeedsWhole`,
`Reshards`) runs outside the region instead, with what it reads (`Plan.outside`).
`RENDER` words them for `reasons.render`, the one place a Reason becomes text.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

# The words that open an own error's reason (`wus.saving` tells it from the user's).
OWN_ERROR = "wus could not shard this step (an error of its own"
_NO_PARALLELISM = "so there is no data parallelism to shard the update over"


@dataclasses.dataclass(frozen=True)
class Pinned:
  """`jax.jit`'s `device=` or `backend=` pins the step to one device.

  Attributes:
    given: (keyword, the repr of its value) for each of them passed.
  """

  given: tuple[tuple[str, str], ...]


@dataclasses.dataclass(frozen=True)
class NoMesh:
  """No argument is placed on a mesh of more than one device."""


@dataclasses.dataclass(frozen=True)
class ReadsRefs:
  """The step reads or writes JAX refs it does not create: `name`, the first (an
  argument's path, or a ref it closes over)."""

  name: str


@dataclasses.dataclass(frozen=True)
class NoBatchSplit:
  """No argument (the state aside) is split over a mesh axis as the batch, nor laid out
  so by a sharding constraint in the step."""


@dataclasses.dataclass(frozen=True)
class OwnError:
  """An error of wus's own while analysing the step.

  Attributes:
    where: "folder/file.py:line" where it was raised (`errors.where`).
    kind: its type's name.
    message: what it says.
  """

  where: str
  kind: str
  message: str


@dataclasses.dataclass(frozen=True)
class NoUpdate:
  """No update reads only whole values: the forward and backward pass read every result
  (`global_view.find_region`)."""


@dataclasses.dataclass(frozen=True)
class SplitEnds:
  """A note: the batch's split ends at `primitive` (at `line`), which has no rule carrying
  it through, so no gradient after it is seen as a sum over the batch."""

  primitive: str
  line: str


@dataclasses.dataclass(frozen=True)
class NeedsWhole:
  """An equation needs dim `dim` of a value (`aval`) whole, which is split over `axes`;
  at `position` among the region's top equations, which may run outside it."""

  primitive: str
  line: str
  dim: int
  aval: str
  axes: tuple[str, ...]
  position: int | None = None


@dataclasses.dataclass(frozen=True)
class Reshards:
  """An equation lays dim `dim` of `aval` out as dim `dim_to` of `aval_to`, over `before`
  then `after` (a reshard of JAX's Explicit axes); at `position`, as for `NeedsWhole`."""

  primitive: str
  line: str
  dim: int
  aval: str
  dim_to: int
  aval_to: str
  before: tuple[str, ...]
  after: tuple[str, ...]
  position: int | None = None


@dataclasses.dataclass(frozen=True)
class PlacedApart:
  """A tensor (`aval`) placed over `axes` meets a dim placed over `met`."""

  aval: str
  axes: tuple[str, ...]
  met: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class SplitTwice:
  """A value (`aval`) would be split twice over one axis (`split`, per dim)."""

  aval: str
  split: tuple


@dataclasses.dataclass(frozen=True)
class Indivisible:
  """A dim of `size` of `aval` does not divide over `axes`, which its placement splits it over."""

  size: int
  aval: str
  axes: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class SplitBothWays:
  """A dim of `aval` split over the model axes (`model`, per dim) and the batch axes
  (`batch`) at once; `read` when the update reads it (the region's in_specs)."""

  aval: str
  model: tuple
  batch: tuple
  read: bool = False


@dataclasses.dataclass(frozen=True)
class OnBlocks:
  """The update cannot run on the blocks of the tensors split over `axes`, for `why`."""

  axes: tuple[str, ...]
  why: object  # A `reasons.Reason` (this module is imported by `reasons`).


@dataclasses.dataclass(frozen=True)
class ShardsNothing:
  """The update region would shard nothing, only change how GSPMD partitions the rest.

  Attributes:
    cluster: cluster 0's reason when every cluster stays replicated; None when there is
      no cluster with a tensor to shard (each is split by its placement already, or has
      at most `num_shards` elements or fewer than `min_size`).
    num_shards, min_size: the Plan's N and min_shard_size.
    outside: why the first part of the update runs outside the region, on the blocks of
      the tensors split over `axes`; None when none does.
  """

  cluster: object | None  # A `reasons.Reason`, as `outside` (see `OnBlocks.why`).
  num_shards: int
  min_size: int
  outside: object | None = None
  axes: tuple[str, ...] = ()


def _shards_nothing(x: ShardsNothing) -> str:
  why = (f"every weight-update cluster stays replicated, cluster 0: {x.cluster}"
         if x.cluster is not None else "no weight-update cluster with a tensor to shard: each "
         "is split by its placement already (FSDP), or has at most "
         f"N={x.num_shards} elements or fewer than min_shard_size={x.min_size}")
  if x.outside is not None:
    why += (f"; parts of the update run outside it, on the blocks of the tensors split over "
            f"{list(x.axes)}: {x.outside}")
  return f"the update region shards nothing ({why}); the step runs as jax.jit runs it"


RENDER: dict[type, Callable] = {
    Pinned: lambda x: (f"{' and '.join(f'{k}={v}' for k, v in x.given)} pins the step to one "
                       f"device, {_NO_PARALLELISM}"),
    NoMesh: lambda x: ("no argument is placed on a mesh of more than one device, "
                       + _NO_PARALLELISM),
    ReadsRefs: lambda x: (f"the step reads or writes JAX refs it does not create ({x.name}): "
                          "wus.jit shards updates of values the step takes and returns, so "
                          "the step runs as jax.jit runs it; pass the values (ref[...]) and "
                          "return the new ones to shard the update"),
    NoBatchSplit: lambda x: ("no argument is split over a mesh axis as the batch (the state "
                             "aside), nor laid out so by a sharding constraint in the step, "
                             + _NO_PARALLELISM),
    OwnError: lambda x: (f"{OWN_ERROR}, at {x.where}: {x.kind}: {x.message}); it runs as "
                         "jax.jit runs it"),
    NoUpdate: lambda x: ("no update reads only whole values (the step's forward and backward "
                         "pass read every result)"),
    SplitEnds: lambda x: (f"the batch's split ends at {x.primitive} ({x.line}): wus has no rule "
                          "carrying it through there, so no gradient after it is seen as a "
                          "sum over the batch"),
    NeedsWhole: lambda x: (f"{x.primitive} at {x.line} needs dim {x.dim} of {x.aval} whole, "
                           f"which is split over {list(x.axes)}"),
    Reshards: lambda x: (f"{x.primitive} at {x.line} lays dim {x.dim} of {x.aval} out as dim "
                         f"{x.dim_to} of {x.aval_to} (over {list(x.before)}, then "
                         f"{list(x.after)}): a reshard, which runs as jax.jit runs it"),
    PlacedApart: lambda x: (f"a tensor {x.aval} is placed over {x.axes} where what it meets "
                            f"is placed over {x.met}"),
    SplitTwice: lambda x: f"a value {x.aval} would be split twice over one axis ({x.split})",
    Indivisible: lambda x: (f"a dim of {x.size} of {x.aval} does not divide over "
                            f"{list(x.axes)}, which its placement splits it over"),
    SplitBothWays: lambda x: (
        f"a value {x.aval} the update reads is split over the batch and the model axes on "
        f"one dim ({x.batch}, {x.model})" if x.read else
        f"a dim of {x.aval} is split over the model axes and over the batch axes at once "
        f"({x.model}, {x.batch})"),
    OnBlocks: lambda x: (f"the update cannot run on the blocks of the tensors split over "
                         f"{list(x.axes)}: {x.why}; the step runs as jax.jit runs it"),
    ShardsNothing: _shards_nothing,
}
