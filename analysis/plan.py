"""The Plan: every weight-update cluster, its tensors, format and decision (§3, §4).

The Plan is the boundary between the analysis and the rewrite: what the
rewrite follows and what a user reads to learn which tensors are sharded and
why the others are not. `wus.analysis.planner.make_plan` makes it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

from wus.analysis import costmodel
from wus.analysis.formats import ShardFormat
from wus.analysis.owned import Ownership
from wus.analysis.shardable import Kind


@dataclasses.dataclass(frozen=True)
class TensorPlan:
  """One tensor a cluster reads or writes.

  Attributes:
    name: the pytree path of the input or output (`params['w']`), or what
      produced it.
    shape: logical shape.
    dtype: numpy dtype name.
    role: "gradient" (an all-reduce it replaces), "state" (an input kept
      sharded between steps), "weight" (an input the step also reads whole,
      sliced locally), or "output" (a result returned whole).
    format: its sharding format (None when the cluster stays replicated).
    itemsize: bytes per element (typed PRNG keys have no numpy dtype).
  """

  name: str
  shape: tuple[int, ...]
  dtype: str
  role: str
  format: ShardFormat | None
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
    reason: why.
    all_reduce_bytes: whole bytes of its gradient all-reduces.
    all_gather_bytes: whole bytes it all-gathers per step when sharded.
    saved_bytes: predicted bytes of weights, state and outputs each replica no
      longer reads or writes per step when sharded.
    replicated_seconds, sharded_seconds: the cost model's prediction of the
      cluster's collectives and update, replicated and sharded (seconds;
      `cost.predict`), 0 where not predicted; for an owned cluster, owned.
    owner: the replica that runs the cluster's update on whole tensors
      (ownership, `Plan.owned`), or None; an owned cluster is not `sharded`.
  """

  index: int
  tensors: tuple[TensorPlan, ...]
  sharded: bool
  reason: str
  all_reduce_bytes: int
  all_gather_bytes: int
  saved_bytes: int
  replicated_seconds: float = 0.0
  sharded_seconds: float = 0.0
  owner: int | None = None


@dataclasses.dataclass(frozen=True)
class InputPlan:
  """How one flat input of the step is passed.

  Attributes:
    name: pytree path of the argument leaf.
    shape, dtype: logical shape and numpy dtype name.
    sharded: whether it is kept sharded between steps (optimizer state).
    reason: why it is, or why it stays whole.
    state: whether an output is its next value (the step's state: weights,
      optimizer state), whether or not it is sharded.
    itemsize: bytes per element (typed PRNG keys have no numpy dtype).
  """

  name: str
  shape: tuple[int, ...]
  dtype: str
  sharded: bool
  reason: str
  state: bool = False
  itemsize: int = 4

  @property
  def nbytes(self) -> int:
    return int(np.prod(self.shape)) * self.itemsize


@dataclasses.dataclass(frozen=True)
class Program:
  """How the rewrite runs one jaxpr: the step, a conditional's branch, a loop body.

  Attributes:
    shard_eqns: equation index -> shard kind, for every equation that runs on
      shards (valid for the jaxpr the plan was made from).
    sharded_in: input position -> format, for inputs that arrive as shards.
    sharded_out: output position -> format, for outputs returned as shards.
    bodies: for each conditional in `shard_eqns`, one Program per branch; for
      each loop, its body's Program.
  """

  shard_eqns: Mapping[int, Kind]
  sharded_in: Mapping[int, ShardFormat]
  sharded_out: Mapping[int, ShardFormat]
  bodies: Mapping[int, tuple[Program, ...]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Plan:
  """The weight-update sharding plan of one step function.

  Attributes:
    axes: the replica mesh axes the update is sharded over.
    num_shards: replicas along `axes` (N).
    inputs: one entry per flat input.
    clusters: one entry per weight-update cluster.
    min_size: tensors with fewer elements (or fewer than N) stay whole.
    program: the rewrite's instructions for the step; its `sharded_in` are
      the inputs kept sharded between steps (optimizer state), its
      `sharded_out` the outputs returned sharded.
    formats: the format of every tensor a sharded cluster holds or reads as
      shards (keyed by the jaxpr's variables, nested jaxprs included).
    gather_dtypes: sharded tensors whose whole value is only ever read in a
      narrower float: their all-gather moves that dtype (Fig. 7).
    group_size: with `shard_group_size=G`, G (the update is sharded within
      groups of G replicas of one axis, §5.2); None otherwise.
    groups: how the replicas are grouped, in words ("" without groups).
    objective: "memory" or "time", what the cluster decisions favour (`cost.decide`).
    across_groups: with groups, the batched all-reduces of gradient shards
      across them per step (Fig. 10, right), predicted.
    bucket_bytes: the most bytes of tensors one batched collective moves
      (§5.2), chosen by the cost model (`cost.bucket_bytes`).
    buckets: that choice in words ("" when nothing is sharded).
    owned: the updates run on whole tensors by one replica each
      (`wus.analysis.owned.Ownership`), or None.
  """

  axes: tuple
  num_shards: int
  min_size: int
  inputs: tuple[InputPlan, ...]
  clusters: tuple[ClusterPlan, ...]
  program: Program
  formats: Mapping = dataclasses.field(default_factory=dict, repr=False)
  gather_dtypes: Mapping = dataclasses.field(default_factory=dict, repr=False)
  group_size: int | None = None
  groups: str = ""
  across_groups: int = 0
  objective: str = "memory"
  bucket_bytes: int = costmodel.DEFAULT_BUCKET_BYTES
  buckets: str = ""
  owned: Ownership | None = None

  @property
  def shard_eqns(self) -> Mapping[int, Kind]:
    return self.program.shard_eqns

  @property
  def state_inputs(self) -> Mapping[int, ShardFormat]:
    """Flat input position -> format, for inputs passed sharded."""
    return self.program.sharded_in

  @property
  def state_outputs(self) -> Mapping[int, ShardFormat]:
    """Flat output position -> format, for outputs returned sharded."""
    return self.program.sharded_out

  @property
  def sharded_bytes(self) -> int:
    """Whole bytes of the tensors updated on shards."""
    return sum(t.nbytes for c in self.clusters if c.sharded for t in c.tensors
               if t.role in ("state", "weight"))

  @property
  def replicated_bytes(self) -> int:
    """Whole bytes of the weight-update tensors kept replicated (neither sharded nor owned)."""
    return sum(t.nbytes for c in self.clusters if not c.sharded and c.owner is None
               for t in c.tensors if t.role in ("state", "weight"))

  @property
  def owned_bytes(self) -> int:
    """Whole bytes of the tensors updated whole by one replica each (ownership)."""
    return sum(t.nbytes for c in self.clusters if c.owner is not None for t in c.tensors
               if t.role in ("state", "weight"))

  @property
  def state_bytes(self) -> tuple[int, int]:
    """(whole bytes, per-replica bytes) of the inputs kept sharded between steps."""
    whole = sum(self.inputs[k].nbytes for k in self.state_inputs)
    shard = sum(f.shard_size * self.inputs[k].itemsize for k, f in self.state_inputs.items())
    return whole, shard

  @property
  def whole_state_bytes(self) -> int:
    """Bytes of the step's state (inputs with a next value) each replica keeps whole."""
    return sum(i.nbytes for i in self.inputs if i.state and not i.sharded)

  def __str__(self) -> str:
    lines = [f"wus plan: weight update sharded over {self.axes} (N={self.num_shards})"]
    if self.groups:
      lines.append(self.groups)
    for c in self.clusters:
      verdict = "SHARDED: " if c.sharded else "" if c.owner is not None else "replicated: "
      lines.append(f"cluster {c.index}: {verdict}{c.reason}")
      if c.replicated_seconds:
        lines.append(f"    predicted: {c.sharded_seconds * 1e6:.3g} us "
                     f"{'owned' if c.owner is not None else 'sharded'}, "
                     f"{c.replicated_seconds * 1e6:.3g} us replicated (collectives and update, "
                     f"{self.objective} objective)")
      for t in c.tensors:
        fmt = str(t.format) if t.format is not None else "whole"
        lines.append(f"    {t.role:9s} {t.name:40s} {t.dtype:9s} {fmt}")
    if self.buckets:
      lines.append(self.buckets)
    if self.owned is not None:
      lines.append(str(self.owned))
    lines.append("inputs:")
    for i in self.inputs:
      layout = "sharded" if i.sharded else "whole"
      lines.append(f"    {i.name:40s} {str(list(i.shape)):16s} {i.dtype:9s} {layout}: {i.reason}")
    whole, shard = self.state_bytes
    lines.append(f"totals: weight update {self.sharded_bytes} B on shards, "
                 + (f"{self.owned_bytes} B owned, " if self.owned is not None else "")
                 + f"{self.replicated_bytes} B in replicated clusters; state sharded "
                 f"{whole} B -> {shard} B per replica (predicted), state kept whole "
                 f"{self.whole_state_bytes} B (weights, tiny tensors: see inputs)")
    return "\n".join(lines)


def replicated(plan: Plan, reason: str) -> Plan:
  """`plan` with every cluster kept replicated and every input whole, for `reason`.

  The rewrite then replays the step unchanged.
  """
  clusters = tuple(dataclasses.replace(
      c, sharded=False, reason=reason, owner=None,
      tensors=tuple(dataclasses.replace(t, format=None) for t in c.tensors)) for c in plan.clusters)
  inputs = tuple(dataclasses.replace(i, sharded=False, reason=reason) if i.sharded else i
                 for i in plan.inputs)
  return dataclasses.replace(plan, inputs=inputs, clusters=clusters, program=Program({}, {}, {}),
                             formats={}, gather_dtypes={}, owned=None)
