"""Whether to shard a weight-update cluster, with the reason (§3.2).

The model is deliberately conservative. Sharding replaces each gradient
all-reduce with a reduce-scatter (its first half) and adds an all-gather for
every sharded value someone needs whole (updated weights, outputs that are
not state). It is taken when

  * every reader of the cluster's shards can run on shards or is allowed to
    read a whole value (a program output, or computation that differs across
    replicas), i.e. no redundant operation without a shard rule reads them;
  * it saves something: it reads program inputs (weights, optimizer state) or
    writes program outputs on shards. Those are the non-fusible tensors whose
    memory traffic shrinks to 1/N (the gradient itself fuses with its
    collective); and
  * the all-gathers move no more bytes than the all-reduces' all-gather
    phase they replace, plus 1/N of it (room for gathering small statistics
    such as Adafactor's factored second moments), so communication barely
    grows; or, with more all-gather than that, it keeps optimizer state
    sharded between steps (the memory objective, the default). An update
    grown from roots (`roots.find_roots`: no all-reduce to make a
    reduce-scatter, its gradient a local slice) only adds all-gathers: it is
    taken only when it keeps optimizer state sharded.

Every decision also carries the alpha-beta cost model's prediction of the
cluster's collectives and update, sharded and replicated
(`costmodel.cluster_seconds` of the cluster's `costmodel.Workload`: its
gradients, the values it all-gathers, the inputs and outputs its update
reads and writes). With `objective="time"` a cluster shards only where that
prediction is no slower; with `objective="memory"` the prediction is only
reported. The step's batching (`bucket_bytes`) and `shard_group_size="auto"`
(`auto_group_size`) price the sharded clusters' workloads together
(`step_workload`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import numpy as np

from wus.analysis import compat
from wus.analysis import causes, costmodel, network, reasons, sizing, verdicts
from wus.analysis.clusters import Cluster
from wus.analysis.compat import Jaxpr, Var
from wus.analysis.layouts import Layout
from wus.analysis.redundancy import Redundancy, why_differs
from wus.analysis.shardable import REDUCING
from wus.collectives import batched


def nbytes(v: Var) -> int:
  """Bytes of a whole value of `v` (shape × itemsize)."""
  return int(v.aval.size) * v.aval.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class Decision:
  """The cost model's verdict on one cluster.

  Attributes:
    shard: whether the cluster runs on shards.
    why: why, as a value (`reasons.Reason`: one of the cost model's verdicts,
      `verdicts.OnShards`...; or what stopped the layout); `reason` is its text.
    all_reduce_bytes: whole bytes of the gradient all-reduces it replaces.
    all_gather_bytes: whole bytes it must all-gather per step if sharded.
    saved_bytes: predicted bytes of program inputs and outputs each replica
      no longer reads or writes: (1 - 1/N) of their whole size.
    replicated_seconds: predicted seconds of the cluster's all-reduces and
      update, replicated (`costmodel.cluster_seconds`); 0 when not predicted.
    sharded_seconds: the same sharded: reduce-scatters, all-gathers and the
      update on 1/N.
    workload: what the prediction prices (None when not predicted).
  """

  shard: bool
  why: reasons.Reason
  all_reduce_bytes: int
  all_gather_bytes: int
  saved_bytes: int
  replicated_seconds: float = dataclasses.field(default=0.0, compare=False)
  sharded_seconds: float = dataclasses.field(default=0.0, compare=False)
  workload: costmodel.Workload | None = dataclasses.field(default=None, compare=False,
                                                          repr=False)

  @property
  def reason(self) -> str:
    """Why, in the Plan's words (`reasons.render`)."""
    return reasons.render(self.why)


OBJECTIVES = ("memory", "time")


def tensor(v: Var) -> costmodel.Tensor:
  """`v` as the cost model sees it: (elements, bytes per element)."""
  return int(v.aval.size), v.aval.dtype.itemsize


def _branch_gathers(cluster: Cluster, rare: set[int]) -> list[Var]:
  """The values conditionals' branches all-gather (read whole inside).

  A conditional in `rare` runs every k steps (§3.2): what it gathers is
  amortized and not counted.
  """
  out = []
  for i, subs in cluster.nested.items():
    if i in rare:
      continue
    for sub in subs:
      out += [*sub.outside_readers, *_branch_gathers(sub, set())]
  return out


def _first_whole_reader(cluster: Cluster, jaxpr: Jaxpr, facts: Redundancy, axes,
                        names: Sequence[str]) -> causes.ReadWhole | None:
  """The first outside reader of the cluster's values, and why its result differs across
  replicas (if it does); None without one."""
  for v, readers in cluster.outside_readers.items():
    eqn = jaxpr.eqns[readers[0]]
    varying = [o for o in eqn.outvars if not facts.is_redundant(o, axes)]
    return causes.ReadWhole(v.aval.str_short(), causes.Eqn.of(eqn, compat.source_line(eqn)),
                            why_differs(jaxpr, facts, varying[0], axes, names) if varying
                            else None)
  return None


def decide(cluster: Cluster, layout: Layout, jaxpr: Jaxpr, facts: Redundancy,
           axes: frozenset, state_outputs: set[int], num_shards: int,
           rare: set[int] = frozenset(), *, objective: str = "memory",
           topology: network.Topology | None = None,
           extra_gather: tuple[costmodel.Tensor, ...] = (),
           sliced: list[str] | tuple = (), names: Sequence[str] = ()) -> Decision:
  """Decides one cluster.

  Args:
    cluster: the cluster.
    layout: its formats.
    jaxpr: the jaxpr it belongs to.
    facts: the jaxpr's redundancy analysis.
    axes: the replica axes.
    state_outputs: output positions that stay sharded between steps.
    num_shards: N.
    rare: conditionals of `jaxpr` whose predicate follows the loop counter
      (taken every k steps, §3.2 frequency analysis).
    objective: "memory" (shard whenever the update can run on shards and
      saves memory traffic or keeps optimizer state sharded) or "time" (as
      "memory", and only where `costmodel.cluster_seconds` says sharded is no
      slower).
    topology: the N devices, for the prediction; None:
      `network.default_topology(num_shards)`.
    extra_gather: (elements, bytes per element) of inputs it keeps sharded
      that are gathered where read (weights with `shard_weights`, in their
      narrow dtype).
    sliced: for a cluster grown from roots (`Cluster.roots`), the names of
      the values identical on every replica it reads by a local slice.
    names: a name per input of `jaxpr` (its pytree path), for the reasons.

  Returns:
    The decision, with byte counts (whole-tensor bytes, before sharding) and
    the predicted seconds.

  Raises:
    ValueError: an unknown objective, or a topology of other than N devices.
  """
  topology = _topology(objective, topology, num_shards)
  eqns = jaxpr.eqns
  gathered, workload = _workload(cluster, layout, jaxpr, state_outputs, rare, extra_gather)
  all_reduce, all_gather, io = (sum(n * b for n, b in ts) for ts in (
      workload.gradients, workload.gathered, workload.updated))
  saved = io - io // num_shards
  replicated_s, sharded_s = costmodel.cluster_seconds(workload, topology)

  def verdict(shard: bool, why) -> Decision:
    return Decision(shard, reasons.Reason(why), all_reduce, all_gather, saved, replicated_s,
                    sharded_s, workload)

  def slower() -> Decision | None:
    """The time objective's veto, if the prediction says sharding is slower."""
    if objective == "time" and sharded_s > replicated_s:
      return verdict(False, verdicts.SlowerSharded(sharded_s, replicated_s))
    return None

  for v, readers in cluster.outside_readers.items():
    for r in readers:
      eqn = eqns[r]
      if facts.repeats(eqn, axes):
        return verdict(False, verdicts.WholeReader(causes.Eqn.of(eqn,
                                                                 compat.source_line(eqn))))
  if not saved:
    return verdict(False, verdicts.SavesNothing())
  if cluster.roots and not cluster.seeds:
    # No all-reduce to replace: the update reads values identical on every
    # replica (its roots) by a local slice, and sharding it only adds the
    # all-gathers. Taken for the optimizer state it keeps sharded, or not at all.
    what = f"{', '.join(sliced) or 'its roots'}, identical on every replica"
    if not state_outputs:
      return verdict(False, verdicts.OnlyAddsGathers(what, all_gather))
    return slower() or verdict(True, verdicts.RootsSliced(what, all_gather))
  extra = all_gather - (all_reduce + all_reduce // num_shards)
  if extra > 0 and state_outputs and not cluster.seeds:
    # Its gradient arrives as shards (a loop accumulated it on shards, §4.2):
    # the all-reduce is gone already; the weights are gathered once here.
    return slower() or verdict(True, verdicts.ArrivesAsShards(all_gather))
  if extra > 0 and state_outputs:
    # More all-gather than the all-reduce it replaces (its all-reduce runs
    # whole): taken for the optimizer state it keeps sharded between steps.
    return slower() or verdict(True, verdicts.KeepsStateSharded(extra))
  if extra > 0:
    return verdict(False, verdicts.MoreAllGather(
        all_gather, all_reduce, _first_whole_reader(cluster, jaxpr, facts, axes, names)))
  reductions = sum(k in REDUCING for k in cluster.kinds.values())
  return slower() or verdict(True, verdicts.OnShards(reductions, len(gathered)))


def _topology(objective: str, topology: network.Topology | None,
              num_shards: int) -> network.Topology:
  """`decide`'s topology (the default one of N devices for None), its arguments checked."""
  if objective not in OBJECTIVES:
    raise ValueError(f"objective={objective!r}: use one of {OBJECTIVES}")
  topology = topology or network.default_topology(num_shards)
  if topology.num_devices != num_shards:
    raise ValueError(f"the topology has {topology.num_devices} devices; the update is sharded "
                     f"over {num_shards}")
  return topology


def _workload(cluster: Cluster, layout: Layout, jaxpr: Jaxpr, state_outputs: set[int],
              rare, extra_gather) -> tuple[list[Var], costmodel.Workload]:
  """(the sharded values it all-gathers, the cluster as the cost model sees it): its
  gradients, what it gathers, and the inputs it reads and outputs it writes (non-fusible)."""
  gathered = [v for v in cluster.sharded if v not in layout.partial and (
      v in cluster.outside_readers or v in layout.whole_reads
      or any(p not in state_outputs for p in cluster.returned.get(v, ())))]
  inputs = set(jaxpr.invars)
  return gathered, costmodel.Workload(
      gradients=tuple(tensor(jaxpr.eqns[i].outvars[0]) for i in cluster.seeds),
      gathered=(*map(tensor, gathered), *map(tensor, _branch_gathers(cluster, rare)),
                *extra_gather),
      updated=(*(tensor(v) for v in cluster.reads if v in inputs),
               *(tensor(v) for v, p in cluster.returned.items() for _ in p)))


def auto_group_size(plan, topology: network.Topology) -> tuple[int | None, object]:
  """`shard_group_size="auto"`: the G the cost model predicts fastest (§5.2), and why.

  The workload is what the Plan of full sharding shards (`step_workload`):
  its sharded gradients and what their updates read and write. G is chosen among the
  divisors of N whose groups follow the topology's axes
  (`sizing.choose_group_size`); None means N, one group.

  Args:
    plan: the `plan.Plan` of the step sharded in one group of all N.
    topology: the N devices.

  Returns:
    (G, or None for N; the choice and its predicted times: `causes.AutoGroupSize`, or
    `causes.AutoOneGroup` when there is nothing to group).
  """
  n = plan.num_shards
  workload = step_workload(plan.clusters)
  if len(plan.axes) != 1 or workload is None:
    return None, causes.AutoOneGroup(n, several=bool(workload))
  best = sizing.best_sharded(workload, topology)
  full = costmodel.predict_sharded(workload, topology, n, bucket_bytes=best.bucket_bytes)
  why = causes.AutoGroupSize(best.group_size, n, best.total, full.total,
                             tuple((a.name, a.size) for a in topology.axes))
  return (None if best.group_size == n else best.group_size), why


def step_workload(clusters, gathered: Sequence[costmodel.Tensor] | None = None
                  ) -> costmodel.Workload | None:
  """The cost model's `Workload` of the sharded clusters together (None if none has a gradient).

  Their gradients, in the Plan's order; what each cluster's update reads and
  writes (`Decision.workload`); the all-gathers `gathered`, or, where the
  step's are not known (a group size priced from the Plan alone), the
  gradients' tensors in their dtype: the all-gathers of the new weights
  mirror the reduce-scatters.

  Args:
    clusters: the `plan.ClusterPlan`s of one step.
    gathered: the tensors the rewrite all-gathers, in its order
      (`gathered_tensors`), or None.
  """
  sharded = [c for c in clusters if c.sharded]
  grads = tuple((math.prod(t.shape), t.itemsize) for c in sharded for t in c.tensors
                if t.role == "gradient")
  if not grads:
    return None
  return costmodel.Workload(
      gradients=grads, gathered=grads if gathered is None else tuple(gathered),
      updated=tuple(t for c in sharded if c.workload is not None for t in c.workload.updated))


def gathered_tensors(jaxpr: Jaxpr, sharded_out: Mapping, formats: Mapping,
                     gather_dtypes: Mapping) -> tuple[costmodel.Tensor, ...]:
  """The tensors the rewrite all-gathers in batches (§5.2), in its order: (elements, itemsize).

  First the values kept sharded and read whole in a narrower float
  (`Plan.gather_dtypes`, Fig. 7: gathered together at the first read, in the
  order the step defines them), then
  each output returned whole that the step holds as shards, once, in the
  outputs' order (`transforms.rewrite`). The buckets fill in this order
  (`batched.buckets`), which is not the gradients' (the backward pass's), and
  a narrower float moves fewer bytes, so neither mirrors the reduce-scatters.

  Args:
    jaxpr: the step.
    sharded_out: output position -> format, of the outputs returned as shards.
    formats: the values held as shards -> their format.
    gather_dtypes: value -> the narrower dtype it is gathered in.
  """
  held = [*jaxpr.invars, *(v for e in jaxpr.eqns for v in e.outvars)]  # The rewrite's order.
  narrow = [v for v in held if v in gather_dtypes and v in formats]
  outputs = [v for k, v in enumerate(jaxpr.outvars) if k not in sharded_out
             and not compat.is_literal(v) and v in formats]
  return tuple((math.prod(v.aval.shape), np.dtype(gather_dtypes.get(v, v.aval.dtype)).itemsize)
               for v in dict.fromkeys([*narrow, *outputs]))


def bucket_bytes(clusters, num_shards: int, topology: network.Topology,
                 objective: str = "memory", gathered: Sequence[costmodel.Tensor] | None = None
                 ) -> tuple[int, int | None, str, str]:
  """How the batched collectives group tensors (§5.2), chosen by the cost model, and why.

  `sizing.choose_batching` on the sharded clusters' workload: tensors of
  `alone_bytes` or more (unpadded) keep a collective of their own, where the
  predicted copy into and out of a bucket costs more than a collective's
  latency; the rest share buckets, the smallest limit whose predicted
  collectives and copies are within 1% of one bucket's. A bucket's
  concatenated buffers are temporary memory the model does not price, so
  with `objective="memory"` the limit is at most
  `sizing.DEFAULT_BUCKET_BYTES` (4 MiB; measured on the main job: one
  32 MiB bucket raised the compiled step's memory from 0.38 to 0.65 of the
  replicated step's); with "time", any of `sizing.BUCKET_CANDIDATES`.

  Args:
    clusters: the `plan.ClusterPlan`s of the step.
    num_shards: N, the replicas sharing the update.
    topology: the N devices.
    objective: "memory" or "time" (`decide`).
    gathered: the tensors the step all-gathers, in its order (`gathered_tensors`);
      None: the gradients'.

  Returns:
    (bucket limit in bytes, alone_bytes or None, the choice in words with its arithmetic
    for `Plan.buckets`, the collectives it makes in brief for `Plan.collectives`).
  """
  workload = step_workload(clusters, gathered)
  if workload is None:
    return sizing.DEFAULT_BUCKET_BYTES, None, "", ""
  candidates = [c for c in sizing.BUCKET_CANDIDATES
                if objective == "time" or c <= sizing.DEFAULT_BUCKET_BYTES]
  limit, alone = sizing.choose_batching(workload, topology, num_shards, candidates=candidates)
  one = costmodel.predict_sharded(workload, topology, num_shards)
  chosen = costmodel.predict_sharded(workload, topology, num_shards, bucket_bytes=limit,
                                     alone_bytes=alone)
  counts = chosen.collectives
  sizes = [n * b for n, b in workload.gradients]
  padded = [num_shards * costmodel.shard_elements(n, num_shards, topology.tile_elements) != n
            for n, _ in workload.gradients]
  apart = sum(len(b) == 1 for b in batched.buckets(sizes, limit, alone, padded))
  copied = network.copied(sizes, limit, alone, padded)
  by_size = ("every tensor under the limit shares one" if alone is None else
             f"tensors of {_mib(alone)} or more keep their own unless padded")
  brief = (f"collectives per step: {counts['reduce-scatter']} reduce-scatter(s) of the "
           f"gradients, {counts['all-gather']} all-gather(s) of the new weights, batched "
           "(predicted)")
  return limit, alone, (
      f"collectives batched in buckets of at most {_mib(limit)} ({by_size}: "
      f"{apart} of {len(sizes)} tensors alone; {copied / 2 ** 20:.3g} MiB of gradients copied "
      f"into buckets, the weights out of them, predicted "
      f"{network.format_seconds(chosen.copies)}): "
      f"{counts['reduce-scatter']} reduce-scatter(s), {counts['all-gather']} all-gather(s), "
      f"predicted {network.format_seconds(chosen.communication + chosen.copies)} with the "
      f"copies (one bucket: {network.format_seconds(one.communication + one.copies)}; cost "
      f"model, {objective} objective)"), brief


def _mib(nbytes: int) -> str:
  return f"{nbytes / 2 ** 20:g} MiB" if nbytes >= 2 ** 20 else f"{nbytes // 1024} KiB"
