"""The Plan's parts: a tensor, a cluster, an input, a jaxpr's instructions, the groups.

`wus.analysis.plan.Plan` holds them (and re-exports them); the planner's passes make them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

from wus.analysis import costmodel, reasons
from wus.analysis.formats import Format
from wus.analysis.reasons import Reason
from wus.analysis.shardable import Kind


@dataclasses.dataclass(frozen=True)
class TensorPlan:
  """One tensor a cluster reads or writes.

  Attributes:
    name: the pytree path of the input or output (`params['w']`), or what
      produced it.
    shape: logical shape.
    dtype: numpy dtype name.
    role: "gradient" (an all-reduce it replaces), "root" (a value identical
      on every replica that an update no all-reduce reaches grows from, read
      by a local slice: `roots.find_roots`), "state" (an input kept
      sharded between steps), "weight" (an input the step also reads whole,
      sliced locally), or "output" (a result returned whole).
    format: its sharding format (None when the cluster stays replicated).
    itemsize: bytes per element (typed PRNG keys have no numpy dtype).
  """

  name: str
  shape: tuple[int, ...]
  dtype: str
  role: str
  format: Format | None
  itemsize: int = 4

  @property
  def nbytes(self) -> int:
    return int(np.prod(self.shape)) * self.itemsize


@dataclasses.dataclass(frozen=True)
class ClusterPlan:
  """The decision for one weight-update cluster (§3.2).

  Attributes:
    index: position in `Plan.clusters`.
    tensors: the tensors it reads and writes.
    sharded: whether it runs on shards.
    why: why, as a value (`reasons.Reason`); `reason` is its text.
    all_reduce_bytes: whole bytes of its gradient all-reduces.
    all_gather_bytes: whole bytes it all-gathers per step when sharded.
    saved_bytes: predicted bytes of weights, state and outputs each replica no
      longer reads or writes per step when sharded.
    replicated_seconds, sharded_seconds: the cost model's prediction of the
      cluster's collectives and update, replicated and sharded (seconds;
      `costmodel.cluster_seconds`), 0 where not predicted; for an owned
      cluster, owned.
    owner: the replica that runs the cluster's update on whole tensors
      (ownership, `Plan.owned`), or None; an owned cluster is not `sharded`.
    workload: what the cost model priced (`cost.Decision.workload`): the
      step's batching and group size price the sharded clusters' together.
  """

  index: int
  tensors: tuple[TensorPlan, ...]
  sharded: bool
  why: Reason
  all_reduce_bytes: int
  all_gather_bytes: int
  saved_bytes: int
  replicated_seconds: float = 0.0
  sharded_seconds: float = 0.0
  owner: int | None = None
  workload: costmodel.Workload | None = dataclasses.field(default=None, compare=False,
                                                          repr=False)

  @property
  def reason(self) -> str:
    """Why, in the Plan's words (`reasons.render`)."""
    return reasons.render(self.why)


@dataclasses.dataclass(frozen=True)
class InputPlan:
  """How one flat input of the step is passed.

  Attributes:
    name: pytree path of the argument leaf.
    shape, dtype: logical shape and numpy dtype name.
    sharded: whether it is kept sharded between steps (optimizer state).
    why: why it is, or why it stays whole, as a value (`reasons.Reason`); `reason`
      is its text.
    state: whether an output is its next value (the step's state: weights,
      optimizer state), whether or not it is sharded.
    itemsize: bytes per element (typed PRNG keys have no numpy dtype).
    matched: the output the step's state matching took for its next value and
      the rule that found it (position, name, structure), or why it found
      none although outputs share its tree structure; "" otherwise.
    split: the mesh axes of size > 1 the user's spec splits it over besides
      the replica axes, with their sizes (tensor parallelism's model axis:
      `shape` is one rank's block, and there are `blocks` of them); () on a
      1-D mesh.
    fsdp: the replica axes of size > 1 the user's spec splits it over itself, with
      their sizes (FSDP: each replica updates its own block, nothing is repeated
      there; `shape` is one block).
  """

  name: str
  shape: tuple[int, ...]
  dtype: str
  sharded: bool
  why: Reason
  state: bool = False
  itemsize: int = 4
  matched: str = ""
  split: tuple[tuple[str, int], ...] = ()
  fsdp: tuple[tuple[str, int], ...] = ()

  @property
  def blocks(self) -> int:
    """Blocks the user's spec splits the whole tensor into (1: none)."""
    return int(np.prod([n for _, n in (*self.split, *self.fsdp)]))

  @property
  def reason(self) -> str:
    """Why, in the Plan's words (`reasons.render`)."""
    return reasons.render(self.why)

  @property
  def nbytes(self) -> int:
    return int(np.prod(self.shape)) * self.itemsize


@dataclasses.dataclass(frozen=True)
class JaxprPlan:
  """The plan of one jaxpr (the step, a conditional's branch, a loop body): how the rewrite
  runs it. (Programs are what `transforms/programs.py` compiles from the step's.)

  Attributes:
    shard_eqns: equation index -> shard kind, for every equation that runs on
      shards (valid for the jaxpr the plan was made from).
    sharded_in: input position -> format, for inputs that arrive as shards.
    sharded_out: output position -> format, for outputs returned as shards.
    bodies: for each conditional in `shard_eqns`, one JaxprPlan per branch; for
      each loop, its body's JaxprPlan.
    gather_after: values the all-gathers of the outputs returned whole must
      follow, so that donated inputs' buffers hold them with no copy
      (`wus.analysis.ordering`; the step's JaxprPlan only).
    tied_outputs: positions of outputs computed whole that follow
      `gather_after` too.
    presliced: positions in `sharded_in` of inputs that are no state: values computed
      before the program (a `wus.jit` region's stacked gradients) that it takes as the
      global arrays of their shards (`wus.analysis.presliced`; the step's JaxprPlan
      only).
  """

  shard_eqns: Mapping[int, Kind]
  sharded_in: Mapping[int, Format]
  sharded_out: Mapping[int, Format]
  bodies: Mapping[int, tuple[JaxprPlan, ...]] = dataclasses.field(default_factory=dict)
  gather_after: tuple = ()
  tied_outputs: frozenset = frozenset()
  presliced: frozenset = frozenset()


@dataclasses.dataclass(frozen=True)
class Grouping:
  """The sharding groups of `shard_group_size` (§5.2, Fig. 10), as the Plan says them.

  Attributes:
    chosen: with `shard_group_size="auto"`, how the cost model chose G
      (`causes.AutoGroupSize`, `causes.AutoOneGroup`); None otherwise.
    layout: the groups in words (`transforms.groups.Groups.describe`), or why
      there are none to speak of (G = 1, G = N); "" when "auto" kept G = N.
    num_groups: M = N / G.
    across: the batched all-reduces of the gradient shards across the groups
      per step, predicted (0: none, or one group).
  """

  chosen: object | None = None
  layout: str = ""
  num_groups: int = 0
  across: int = 0

  def __str__(self) -> str:
    across = (f"the gradient shards are all-reduced across the {self.num_groups} groups in "
              f"{self.across} batched all-reduce(s)") if self.across else ""
    chosen = reasons.render(reasons.Reason(self.chosen)) if self.chosen is not None else ""
    return "; ".join(filter(None, [chosen, self.layout, across]))

  def __bool__(self) -> bool:
    return bool(str(self))
