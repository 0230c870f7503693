"""The Plan: every weight-update cluster, its tensors, format and decision (§3, §4).

The Plan is the boundary between the analysis and the rewrite: what the
rewrite follows and what a user reads to learn which tensors are sharded and
why the others are not. `wus.analysis.planner.make_plan` makes it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

from wus.analysis import costmodel, network, reasons
from wus.analysis.formats import Format
from wus.analysis.network import format_bytes as _bytes
from wus.analysis.owned import Ownership
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
      by a local slice: `clusters.find_roots`), "state" (an input kept
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
    fsdp: the replica axes of size > 1 the user's spec splits it over itself
      (FSDP: each replica updates its own part, nothing is repeated there).
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
  fsdp: tuple[str, ...] = ()

  @property
  def blocks(self) -> int:
    """Blocks the user's spec splits the whole tensor into (1: none)."""
    return int(np.prod([n for _, n in self.split]))

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
  """

  shard_eqns: Mapping[int, Kind]
  sharded_in: Mapping[int, Format]
  sharded_out: Mapping[int, Format]
  bodies: Mapping[int, tuple[JaxprPlan, ...]] = dataclasses.field(default_factory=dict)
  gather_after: tuple = ()
  tied_outputs: frozenset = frozenset()


@dataclasses.dataclass(frozen=True)
class Grouping:
  """The sharding groups of `shard_group_size` (§5.2, Fig. 10), as the Plan says them.

  Attributes:
    chosen: with `shard_group_size="auto"`, how the cost model chose G; "" otherwise.
    layout: the groups in words (`transforms.groups.Groups.describe`), or why
      there are none to speak of (G = 1, G = N); "" when "auto" kept G = N.
    num_groups: M = N / G.
    across: the batched all-reduces of the gradient shards across the groups
      per step, predicted (0: none, or one group).
  """

  chosen: str = ""
  layout: str = ""
  num_groups: int = 0
  across: int = 0

  def __str__(self) -> str:
    across = (f"the gradient shards are all-reduced across the {self.num_groups} groups in "
              f"{self.across} batched all-reduce(s)") if self.across else ""
    return "; ".join(filter(None, [self.chosen, self.layout, across]))

  def __bool__(self) -> bool:
    return bool(str(self))


@dataclasses.dataclass(frozen=True)
class Plan:
  """The weight-update sharding plan of one step function.

  Attributes:
    axes: the replica mesh axes the update is sharded over.
    num_shards: replicas along `axes` (N).
    inputs: one entry per flat argument leaf of the step.
    clusters: one entry per weight-update cluster.
    min_size: tensors with fewer elements (or fewer than N) stay whole.
    jaxpr_plan: the rewrite's instructions for the step; its `sharded_in` are
      the inputs kept sharded between steps (optimizer state), its
      `sharded_out` the outputs returned sharded.
    formats: the format of every tensor a sharded cluster holds or reads as
      shards (keyed by the jaxpr's variables, nested jaxprs included).
    gather_dtypes: sharded tensors whose whole value is only ever read in a
      narrower float: their all-gather moves that dtype (Fig. 7).
    group_size: with `shard_group_size=G`, G (the update is sharded within
      groups of G replicas of one axis, §5.2); None otherwise.
    groups: the sharding groups of `shard_group_size` (a `Grouping`; None
      without that option). "Groups" means these alone: G replicas of one
      axis that share one update (§5.2).
    objective: "memory" or "time", what the cluster decisions favour (`cost.decide`).
    bucket_bytes: the most bytes of tensors one batched collective moves
      (§5.2), chosen by the cost model (`cost.bucket_bytes`).
    alone_bytes: tensors of this many bytes or more that need no padding
      have a reduce-scatter and an all-gather of their own, with no copy
      into or out of a bucket (`wus.collectives.batched.buckets`); None:
      every tensor under `bucket_bytes` is batched.
    buckets: that choice in words ("" when nothing is sharded).
    owned: the updates run on whole tensors by one replica each
      (`wus.analysis.owned.Ownership`), or None.
    resolution: seconds; the cost model's predictions of a cluster below this are
      not shown (`network.resolution`: one ring step's latency).
    unchanged: why the step runs as the front end's JAX function would, with
      nothing sharded (`wus.jit` of a step without data parallelism); "" when
      it is planned.
    split_by: what splits inputs over model axes: "its spec" (shard_map) or "its placement".
    copy_axes, copies: the other manual mesh axes (size > 1) over which an update identical
      on all their replicas is sharded too (a TP step's LayerNorms, embeddings), and their
      replicas: its tensors have `num_shards * copies` shards (`shard_axes`).
    outside: why parts of the update run outside the sharded region, as the front
      end's JAX function runs them (`wus.jit`: an equation that needs a dim whole
      that a model axis splits, and what it reads); () when none does.
    input_of: per input of the planned jaxpr, the index in `inputs` of the argument it
      is, or None for a value the rest of the step computes (`wus.jit`'s region reads
      gradients and activations); () when the planned jaxpr's inputs are the
      arguments themselves. `jaxpr_plan` and `state_inputs` are keyed by the former.

  `str(plan)` (what `print` shows) is one line per cluster, the totals first;
  `plan.details()` the full table: every tensor with its format, every input.
  """

  axes: tuple
  num_shards: int
  min_size: int
  inputs: tuple[InputPlan, ...]
  clusters: tuple[ClusterPlan, ...]
  jaxpr_plan: JaxprPlan
  formats: Mapping = dataclasses.field(default_factory=dict, repr=False)
  gather_dtypes: Mapping = dataclasses.field(default_factory=dict, repr=False)
  group_size: int | None = None
  groups: Grouping | None = None
  objective: str = "memory"
  bucket_bytes: int = costmodel.DEFAULT_BUCKET_BYTES
  alone_bytes: int | None = None
  buckets: str = ""
  owned: Ownership | None = None
  resolution: float = 0.0
  unchanged: str = ""
  split_by: str = "its spec"
  copy_axes: tuple = ()
  copies: int = 1
  outside: tuple[str, ...] = ()
  input_of: tuple[int | None, ...] = ()

  def shard_axes(self, fmt: Format) -> tuple:
    """The mesh axes a tensor's shards in `fmt` lie over, major first (shard r * copies + c)."""
    if self.copies > 1 and fmt.num_shards == self.num_shards * self.copies:
      return (*self.axes, *self.copy_axes)
    return tuple(self.axes)

  @property
  def across_groups(self) -> int:
    """With groups, the batched all-reduces of gradient shards across them per step
    (Fig. 10, right), predicted; else 0."""
    return self.groups.across if self.groups is not None else 0

  @property
  def shard_eqns(self) -> Mapping[int, Kind]:
    return self.jaxpr_plan.shard_eqns

  @property
  def state_inputs(self) -> Mapping[int, Format]:
    """Flat input position -> format, for inputs passed sharded."""
    return self.jaxpr_plan.sharded_in

  @property
  def state_outputs(self) -> Mapping[int, Format]:
    """Flat output position -> format, for outputs returned sharded."""
    return self.jaxpr_plan.sharded_out

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
    """(whole bytes, per-device bytes) of the inputs kept sharded between steps; whole
    over every block of a tensor the user's spec splits over other axes too."""
    kept = self.kept_sharded
    whole = sum(self.inputs[k].nbytes * self.inputs[k].blocks for k in kept)
    shard = sum(f.shard_size * self.inputs[k].itemsize for k, f in kept.items())
    return whole, shard

  @property
  def kept_sharded(self) -> Mapping[int, Format]:
    """Index in `inputs` -> format, for the arguments kept sharded between steps."""
    if not self.input_of:
      return self.state_inputs
    return {self.input_of[k]: f for k, f in self.state_inputs.items()}

  def _split_state(self) -> str:
    """The sharded state per device as a fraction of the layout of the user's specs
    alone (state split over a model axis), or "" when no spec splits any."""
    whole, shard = self.state_bytes
    alone = sum(self.inputs[k].nbytes for k in self.kept_sharded)
    if whole == alone or not shard:
      return ""
    return (f"; {shard / whole:.3g} of a whole copy, {shard / alone:.3g} of what the "
            "specs alone leave on a device")

  def _layout(self, k: int) -> str:
    """Where an input lies, for its line: the axes the user's spec splits it over, those
    wus shards it over and what each device holds of it ("" for a whole replicated one)."""
    i = self.inputs[k]
    split = f"split over {[a for a, _ in i.split]} by {self.split_by}" if i.split else ""
    fmt = self.kept_sharded.get(k) if i.sharded else None
    if fmt is None and i.fsdp and i.state:
      return (f" [{', '.join(filter(None, [split, f'FSDP over {list(i.fsdp)}']))}: already "
              f"split by {self.split_by}, nothing repeated there: {_bytes(i.nbytes)} per device]")
    if fmt is None:
      return f" [{split}]" if split else ""
    wus = f"sharded over {list(self.shard_axes(fmt))} by wus"
    return (f" [{', '.join(filter(None, [split, wus]))}: "
            f"{_bytes(fmt.shard_size * i.itemsize)} per device of {_bytes(i.nbytes * i.blocks)}]")

  @property
  def whole_state_bytes(self) -> int:
    """Bytes of the step's state (inputs with a next value) each replica keeps whole."""
    return sum(i.nbytes for i in self.inputs if i.state and not i.sharded)

  def _totals(self) -> list[str]:
    whole, shard = self.state_bytes
    sharded = sum(c.sharded for c in self.clusters)
    owned = sum(c.owner is not None for c in self.clusters)
    wide = sum(c.sharded and any(t.format is not None and len(self.shard_axes(t.format)) > len(
        self.axes) for t in c.tensors) for c in self.clusters)
    lines = [f"wus plan: {sharded} of {len(self.clusters)} weight-update clusters sharded"
             + (f", {owned} owned" if owned else "") + f" over "
             f"{self.axes} (N={self.num_shards})" + (
                 f", {wide} of them over {(*self.axes, *self.copy_axes)} "
                 f"(N={self.num_shards * self.copies}, identical across {list(self.copy_axes)})"
                 if wide else "") + f", {self.objective} objective",
             *([f"  the step runs unchanged: {self.unchanged}"] if self.unchanged else []),
             *[f"  runs as jax.jit runs it, with what it reads: {why}" for why in self.outside],
             f"  state kept sharded between steps: {_bytes(whole)} whole -> {_bytes(shard)} per "
             f"device (predicted{self._split_state()}); state kept whole: "
             f"{_bytes(self.whole_state_bytes)} (weights, tiny tensors)",
             f"  weight update: {_bytes(self.sharded_bytes)} of tensors updated on shards, "
             + (f"{_bytes(self.owned_bytes)} owned, " if self.owned is not None else "")
             + f"{_bytes(self.replicated_bytes)} in replicated clusters"]
    return lines + [f"  {x}" for x in (self.groups, self.buckets, self.owned) if x]

  def _predicted(self, c: ClusterPlan) -> str:
    """The cluster's predicted times, or "" where the model resolves neither; one below
    the resolution is said as "< resolution"."""
    if not c.replicated_seconds or max(c.sharded_seconds, c.replicated_seconds) < self.resolution:
      return ""
    seconds = lambda t: (network.format_seconds(t) if t >= self.resolution  # noqa: E731
                         else f"< {network.format_seconds(self.resolution)}")
    return (f"predicted {seconds(c.sharded_seconds)} "
            f"{'owned' if c.owner is not None else 'sharded'}, "
            f"{seconds(c.replicated_seconds)} replicated")

  def __str__(self) -> str:
    lines = self._totals()
    width = max([len(_label(c)) for c in self.clusters], default=0)
    for c in self.clusters:
      verdict = "SHARDED   " if c.sharded else "OWNED     " if c.owner is not None else "replicated"
      where = next((t.name for t in c.tensors if t.role == "gradient"), "")
      parts = [c.reason, where, self._predicted(c)]
      lines.append(f"cluster {c.index:<3d} {verdict} {_label(c):{width}s}  "
                   + "; ".join(p for p in parts if p))
    kept = sum(i.sharded for i in self.inputs)
    lines.append(f"inputs: {kept} kept sharded between steps, {len(self.inputs) - kept} whole. "
                 "plan.details() lists every tensor, its format, and every input with why.")
    return "\n".join(lines)

  def details(self) -> str:
    """The full table: every cluster's tensors and formats, every input and why."""
    lines = self._totals()
    for c in self.clusters:
      verdict = "SHARDED: " if c.sharded else "" if c.owner is not None else "replicated: "
      lines.append(f"cluster {c.index}: {verdict}{c.reason}")
      if predicted := self._predicted(c):
        lines.append(f"    {predicted} (collectives and update, {self.objective} objective)")
      for t in c.tensors:
        fmt = str(t.format) if t.format is not None else "whole"
        lines.append(f"    {t.role:9s} {t.name:40s} {t.dtype:9s} {fmt}")
    lines.append("inputs:")
    for k, i in enumerate(self.inputs):
      layout = "sharded" if i.sharded else "whole"
      lines.append(f"    {i.name:40s} {str(list(i.shape)):16s} {i.dtype:9s} {layout}: {i.reason}"
                   + (f"; {i.matched}" if i.matched else "") + self._layout(k))
    whole, shard = self.state_bytes
    lines.append(f"totals: weight update {self.sharded_bytes} B on shards, "
                 + (f"{self.owned_bytes} B owned, " if self.owned is not None else "")
                 + f"{self.replicated_bytes} B in replicated clusters; state sharded "
                 f"{whole} B -> {shard} B per replica (predicted), state kept whole "
                 f"{self.whole_state_bytes} B (weights, tiny tensors: see inputs)")
    return "\n".join(lines)


def _label(c: ClusterPlan) -> str:
  """A cluster in a few words: its weight (or state) tensor, and how many it holds."""
  order = {"weight": 0, "state": 1, "output": 2, "gradient": 3}
  main = min(c.tensors, key=lambda t: order.get(t.role, 4), default=None)
  if main is None:
    return "(no tensors)"
  shape = ",".join(map(str, main.shape))
  name = main.name if main.role != "gradient" else "gradient"
  more = f" +{len(c.tensors) - 1}" if len(c.tensors) > 1 else ""
  return f"{name} {main.dtype}[{shape}]{more}"
