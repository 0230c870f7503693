"""The Plan: every weight-update cluster, its tensors, format and decision (§3, §4).

The Plan is the boundary between the analysis and the rewrite: what the
rewrite follows and what a user reads to learn which tensors are sharded and
why the others are not. `wus.analysis.planner.make_plan` makes it.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

from wus.analysis import network, reasons, sizing
from wus.analysis.formats import Format
from wus.analysis.network import format_bytes as _bytes
from wus.analysis.owned import Ownership
# The Plan's parts, re-exported: `from wus.analysis.plan import ClusterPlan` as before.
from wus.analysis.plan_parts import ClusterPlan as ClusterPlan
from wus.analysis.plan_parts import Grouping as Grouping
from wus.analysis.plan_parts import InputPlan as InputPlan
from wus.analysis.plan_parts import JaxprPlan as JaxprPlan
from wus.analysis.plan_parts import TensorPlan as TensorPlan


@dataclasses.dataclass(frozen=True)
class Plan:
  """The weight-update sharding plan of one step function.

  Attributes:
    axes: the replica mesh axes the update is sharded over.
    num_shards: replicas along `axes` (N).
    inputs: one entry per flat argument leaf of the step.
    clusters: one entry per weight-update cluster.
    min_size: tensors with fewer elements (or fewer than N) stay whole.
    rewrite: the rewrite's instructions for the planned jaxpr (`transforms/rewrite.py`), in
      that jaxpr's index space: its equations, its inputs kept sharded between steps
      (`sharded_in`) and its outputs returned sharded (`sharded_out`) by position among
      its inputs and outputs. Under `wus.jit` these are the update region's operands and
      results, not the step's arguments; every other field speaks in the step's arguments.
    state_inputs: index in `inputs` -> format, for the arguments kept sharded between
      steps (optimizer state): `rewrite.sharded_in` in the step's arguments.
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
    buckets: that choice in words, with the cost model's arithmetic ("" when nothing is
      sharded; `details()` prints it).
    collectives: the batched collectives per step in brief, predicted (`str(plan)`
      prints it; "" when nothing is sharded).
    owned: the updates run on whole tensors by one replica each
      (`wus.analysis.owned.Ownership`), or None.
    resolution: seconds; the cost model's predictions of a cluster below this are
      not shown (`network.resolution`: one ring step's latency).
    unchanged: why the step runs as the front end's JAX function would, with
      nothing sharded (`wus.jit` of a step without data parallelism): a
      `reasons.Reason`, its verdict one of `refusals`'; None when it is planned.
    split_by: what splits inputs over model axes: "its spec" (shard_map) or "its placement".
    copy_axes, num_copies: the other manual mesh axes (size > 1, mesh order) over which an
      update identical on all their replicas is sharded too (a TP step's LayerNorms,
      embeddings), and how many replicas they have together (1: none): its tensors have
      `num_shards * num_copies` shards (`shard_axes`). (The copy axes' sizes are
      `planning.PlanRequest.copy_sizes`.)
    outside: why parts of the update run outside the sharded region, as the front
      end's JAX function runs them (`wus.jit`: an equation that needs a dim whole
      that a model axis splits, and what it reads), one `reasons.Reason` each (its
      verdict `refusals.NeedsWhole` or `refusals.Reshards`); () when none does.

  `str(plan)` (what `print` shows) is the totals, then one line per cluster: its
  verdict, its weight (or state) tensor, the other weights and state it updates named by
  their paths ("params['w'] float32[64] and its opt_state.mu, .nu": each path with the
  end it shares with the first one's left off), why, and where its gradient is summed.
  `plan.details()` is the full table: every tensor with its format, every input and why,
  the paper's sections (§) and figures behind each reason, and the cost model's
  arithmetic (buckets).
  """

  axes: tuple
  num_shards: int
  min_size: int
  inputs: tuple[InputPlan, ...]
  clusters: tuple[ClusterPlan, ...]
  rewrite: JaxprPlan
  formats: Mapping = dataclasses.field(default_factory=dict, repr=False)
  gather_dtypes: Mapping = dataclasses.field(default_factory=dict, repr=False)
  group_size: int | None = None
  groups: Grouping | None = None
  objective: str = "memory"
  bucket_bytes: int = sizing.DEFAULT_BUCKET_BYTES
  alone_bytes: int | None = None
  buckets: str = ""
  collectives: str = ""
  owned: Ownership | None = None
  resolution: float = 0.0
  unchanged: reasons.Reason | None = None
  split_by: str = "its spec"
  copy_axes: tuple = ()
  num_copies: int = 1
  outside: tuple[reasons.Reason, ...] = ()
  state_inputs: Mapping[int, Format] = dataclasses.field(default_factory=dict)

  def shard_axes(self, fmt: Format) -> tuple:
    """The mesh axes a tensor's shards in `fmt` lie over, major first (shard r * copies + c);
    the copy axes alone for a block of the plan's axes (`ShardFormat.blocks`: FSDP)."""
    if getattr(fmt, "copy_axes", ()):
      return (*(() if fmt.blocks else self.axes), *fmt.copy_axes)
    if self.num_copies > 1 and fmt.num_shards == self.num_shards * self.num_copies:
      return (*self.axes, *self.copy_axes)
    return tuple(self.axes)

  @property
  def across_groups(self) -> int:
    """With groups, the batched all-reduces of gradient shards across them per step
    (Fig. 10, right), predicted; else 0."""
    return self.groups.across if self.groups is not None else 0

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
    kept = self.state_inputs
    whole = sum(self.inputs[k].nbytes * self.inputs[k].blocks for k in kept)
    shard = sum(f.shard_size * self.inputs[k].itemsize for k, f in kept.items())
    return whole, shard

  def _split_state(self) -> str:
    """The sharded state per device as a fraction of the layout of the user's specs
    alone (state split over a model axis), or "" when no spec splits any."""
    whole, shard = self.state_bytes
    alone = sum(self.inputs[k].nbytes for k in self.state_inputs)
    if whole == alone or not shard:
      return ""
    return (f"; {shard / whole:.3g} of a whole copy, {shard / alone:.3g} of what the "
            "specs alone leave on a device")

  def _layout(self, k: int) -> str:
    """Where an input lies, for its line: the axes the user's spec splits it over, those
    wus shards it over and what each device holds of it ("" for a whole replicated one)."""
    i = self.inputs[k]
    split = f"split over {[a for a, _ in i.split]} by {self.split_by}" if i.split else ""
    fsdp = f"FSDP over {[a for a, _ in i.fsdp]}" if i.fsdp else ""
    fmt = self.state_inputs.get(k) if i.sharded else None
    if fmt is None and i.fsdp and i.state:
      return (f" [{', '.join(filter(None, [split, fsdp]))}: already "
              f"split by {self.split_by}, nothing repeated there: {_bytes(i.nbytes)} per device]")
    if fmt is None:
      return f" [{split}]" if split else ""
    wus = f"sharded over {list(self.shard_axes(fmt))} by wus"
    return (f" [{', '.join(filter(None, [split, fsdp, wus]))}: "
            f"{_bytes(fmt.shard_size * i.itemsize)} per device of {_bytes(i.nbytes * i.blocks)}]")

  @property
  def whole_state_bytes(self) -> int:
    """Bytes of the step's state (inputs with a next value) each replica keeps whole."""
    return sum(i.nbytes for i in self.inputs if i.state and not i.sharded)

  def _whole_state(self) -> str:
    """What the state kept whole is, for the totals: weights and tiny tensors, and the
    optimizer state of replicated clusters when there is some (Muon's momenta)."""
    replicated = {t.name for c in self.clusters if not c.sharded and c.owner is None
                  for t in c.tensors if t.role == "state"}
    kept = any(i.state and not i.sharded and i.name in replicated for i in self.inputs)
    return "weights, tiny tensors" + (", optimizer state of replicated clusters" if kept else "")

  def _wide(self) -> str:
    """How many sharded clusters lie over copy axes too (or, for blocks of the plan's
    axes, over copy axes alone), per set of axes, for the totals."""
    wide: dict = {}  # (axes, N, blocks) -> clusters.
    for c in self.clusters:
      fmt = next((t.format for t in c.tensors if t.format is not None
                  and self.shard_axes(t.format) != tuple(self.axes)), None)
      if c.sharded and fmt is not None:
        key = (self.shard_axes(fmt), fmt.num_shards, getattr(fmt, "blocks", False))
        wide[key] = wide.get(key, 0) + 1
    return "".join(
        f", {k} of them over {axes} within each block of {self.axes} (N={n} per block, "
        f"identical across {list(axes)})" if blocks else
        f", {k} of them over {axes} (N={n}, identical across {list(axes[len(self.axes):])})"
        for (axes, n, blocks), k in wide.items())

  def _totals(self, cite: bool) -> list[str]:
    """The totals lines; with `cite`, the bucket arithmetic, else the collectives in brief."""
    whole, shard = self.state_bytes
    sharded = sum(c.sharded for c in self.clusters)
    owned = sum(c.owner is not None for c in self.clusters)
    lines = [f"wus plan: {sharded} of {len(self.clusters)} weight-update clusters sharded"
             + (f", {owned} owned" if owned else "") + f" over "
             f"{self.axes} (N={self.num_shards})" + self._wide() + f", {self.objective} objective",
             *([f"  the step runs unchanged: {reasons.render(self.unchanged)}"]
               if self.unchanged is not None else []),
             *[f"  runs as jax.jit runs it, with what it reads: {reasons.render(why)}"
               for why in self.outside],
             f"  state kept sharded between steps: {_bytes(whole)} whole -> {_bytes(shard)} per "
             f"device (predicted{self._split_state()}); state kept whole: "
             f"{_bytes(self.whole_state_bytes)} ({self._whole_state()})",
             f"  weight update: {_bytes(self.sharded_bytes)} of tensors updated on shards, "
             + (f"{_bytes(self.owned_bytes)} owned, " if self.owned is not None else "")
             + f"{_bytes(self.replicated_bytes)} in replicated clusters"]
    batching = self.buckets if cite else self.collectives
    return lines + [f"  {x}" for x in (self.groups, batching, self.owned) if x]

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
    lines = self._totals(cite=False)
    labels = [_label(c) for c in self.clusters]
    width = min(max(map(len, labels), default=0), 72)
    for c, label in zip(self.clusters, labels, strict=True):
      verdict = "SHARDED   " if c.sharded else "OWNED     " if c.owner is not None else "replicated"
      where = next((t.name for t in c.tensors if t.role == "gradient"), "")
      parts = [reasons.render(c.why, cite=False), where, self._predicted(c)]
      lines.append(f"cluster {c.index:<3d} {verdict} {label:{width}s}  "
                   + "; ".join(p for p in parts if p))
    kept = sum(i.sharded for i in self.inputs)
    lines.append(f"inputs: {kept} kept sharded between steps, {len(self.inputs) - kept} whole. "
                 "plan.details() lists every tensor, its format, and every input with why.")
    return "\n".join(lines)

  def details(self) -> str:
    """The full table: every cluster's tensors and formats, every input and why, with the
    paper's sections behind each reason and the cost model's bucket arithmetic."""
    lines = self._totals(cite=True)
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
                 f"{self.whole_state_bytes} B ({self._whole_state()}: see inputs)")
    return "\n".join(lines)


def _label(c: ClusterPlan) -> str:
  """A cluster in a few words: its weight (or state) tensor, then the other weights and
  state it updates, at most three by name (each path without the end it shares with the
  first: "params['w'] float32[64] and its opt_state.mu, .nu"), then how many more."""
  order = {"weight": 0, "state": 1, "output": 2, "gradient": 3}
  # A value named by what produced it ("<scatter-add at ...>": under wus.jit, a region
  # operand computed before the region) names the cluster only when nothing else does.
  main = min(c.tensors, key=lambda t: (t.name.startswith("<"), order.get(t.role, 4)),
             default=None)
  if main is None:
    return "(no tensors)"
  name = main.name if main.role != "gradient" else "gradient"
  label = f"{name} {main.dtype}[{','.join(map(str, main.shape))}]"
  others = [t.name for t in c.tensors if t is not main and t.role in ("weight", "state", "root")]
  if not others:
    return label
  more = f" and {len(others) - 3} more" if len(others) > 3 else ""
  heads = [_without_end(n, name) for n in others[:3]]
  if any(h == n for h, n in zip(heads, others, strict=False)):
    return f"{label} with {', '.join(others[:3])}{more}"
  first = _segments(heads[0])
  shown = [heads[0]]
  for h in heads[1:]:  # After the first, only where they differ from it.
    seg = _segments(h)
    same = next((k for k, (a, b) in enumerate(zip(first, seg)) if a != b), min(len(first),
                                                                                len(seg)))
    shown.append("".join(seg[same:]) or h)
  return f"{label} and its {', '.join(shown)}{more}"


_SEGMENT = re.compile(r"\[[^\]]*\]|\.[^.\[]+|[^.\[]+")


def _segments(path: str) -> list[str]:
  """A pytree path's parts: `opt_state[0].mu['w']` -> ["opt_state", "[0]", ".mu", "['w']"]."""
  return _SEGMENT.findall(path)


def _without_end(path: str, main: str) -> str:
  """`path` without the parts it ends with that `main` ends with too (`path` itself when
  none, or when nothing would be left)."""
  seg, end = _segments(path), _segments(main)
  k = 0
  while k < min(len(seg) - 1, len(end)) and seg[-1 - k] == end[-1 - k]:
    k += 1
  return "".join(seg[:len(seg) - k]) if k else path
