"""What the planner is asked and what its stages share: `PlanRequest`, `PlanningContext`.

A front end's pipeline (`wus.pipeline.plan`) says everything the planner needs of one
step in a `PlanRequest`; `planner.make_plan(request)` derives from it the
`PlanningContext` that every stage of the planning reads (clusters, layouts, the
cost decisions, the state kept sharded, ownership), and returns the `plan.Plan`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from wus.analysis import causes, network, reasons
from wus.analysis.compat import Jaxpr, Var
from wus.analysis.plan_parts import Grouping
from wus.analysis.redundancy import Redundancy


@dataclasses.dataclass(frozen=True)
class Argument:
  """One argument leaf of a step whose planned jaxpr is a region of it (`wus.jit`): a
  planner input, so that the Plan lists the step's arguments rather than the region's
  operands.

  Attributes:
    name: the argument's pytree path.
    shape, dtype: its shape and dtype (a numpy dtype, or a typed PRNG key's). The Plan
      shows an argument the region reads as the region reads it (one replica's rows of a
      batch split over the batch axes, one block of a weight split over model axes), one
      it does not read whole.
    operand: the region's input it enters as (through sharding constraints too), or None:
      only the rest of the step (the forward and backward pass) reads it.
    matched: its next value among the step's outputs and the rule that found it, or ""
      when the step returns none (it is not state).
  """

  name: str
  shape: tuple[int, ...]
  dtype: Any
  operand: int | None
  matched: str = ""


@dataclasses.dataclass(frozen=True)
class PlanRequest:
  """One step to plan: the weight-update sharding of a flat shard_map body.

  Attributes:
    jaxpr: the per-replica jaxpr, calls inlined.
    facts: its redundancy analysis.
    axes: the replica mesh axes (a gradient all-reduce runs over exactly these).
    num_shards: N, the number of replicas along `axes`.
    in_names: a name (pytree path) per flat input.
    out_names: a name per flat output.
    state_pairs: output position -> input position for outputs that are the next value
      of an input (the step's state, matched by position, name or structure). Such a
      pair stays sharded between steps when only the update reads the input.
    min_size: tensors with fewer elements stay replicated (never below N).
    split_reason: what makes an input differ across replicas, as the front end says it
      (`causes.SplitBy`; shown in the Plan).
    objective: as for `cost.decide`.
    topology: as for `cost.decide` (N devices), or None for
      `network.default_topology(N)`.
    shard_weights: a weight whose next value the step returns, which the forward pass
      reads only converted to one narrower float, stays sharded between steps like
      optimizer state and is all-gathered in that float at its first read (Fig. 4
      right, Fig. 7, across calls instead of a loop).
    state_whole: input position -> why the caller keeps that state whole between steps
      (left out of `state_pairs`), for the Plan: a verdict (`causes.SplitDifferently`).
    matched: input position -> which output the state matching took for its next value
      and by which rule, or why it found none, for the Plan.
    roots: positions of inputs that are identical on every replica and that an update
      reads whole, to be sliced locally (`roots.find_roots`): a front end's gradients
      that arrive all-reduced. The planner finds the roots of the updates of state that
      no all-reduce reaches itself.
    split: input position -> the mesh axes of size > 1 the user's spec splits it over
      besides `axes`, with their sizes (tensor parallelism), for the Plan.
    fsdp: input position -> the axes of `axes` its spec splits it over (FSDP), for the
      Plan.
    copy_sizes: the copy axes (other manual mesh axes, size > 1, in mesh order) -> their
      sizes: a cluster that every replica of them repeats (`redundancy.differs_over`) is
      sharded over them too (`Plan.copy_axes`, `Plan.num_copies`). One name per concept:
      `copy_axes` are these axes' names (a tuple), `copy_sizes` the same axes with their
      sizes, `num_copies` the replicas they have together (the product).
    group_size: `shard_group_size`'s G, the update sharded within groups of G replicas
      of the one axis in `axes` (§5.2): N / G groups, whose gradient shards are
      all-reduced across them; 1: every update replicated (the reason is
      `grouping.layout`); None: one group of all N.
    grouping: the groups as the Plan says them (`Grouping`: for "auto", the choice and
      its predicted times; the groups in words; M = N / G for groups the programs run
      in), or None; the planner counts the all-reduces across the groups.
    split_by: what splits `split`'s inputs over their model axes, in the Plan's words:
      "its spec" (`wus.shard_map`) or "its placement" (`wus.jit`).
    outside: why parts of the update run outside this step, as the front end's JAX
      function runs them (`wus.jit`'s equations outside its region: `Plan.outside`), one
      `reasons.Reason` each.
    arguments: the step's argument leaves, when `jaxpr` is a region of the step
      (`wus.jit`): the Plan's inputs are then these, each with the plan of the input of
      `jaxpr` it enters as (`Plan.state_inputs`); None: the inputs of `jaxpr` are the
      arguments, named `in_names`.
    presliced: positions of inputs of `jaxpr` (a region) the front end may hand the
      program split, as the global arrays of their shards, if the update reads them only
      as shards (`presliced.stacked`: values a loop stacks, whose placement splits
      nothing, on a mesh of Auto axes); the planner decides (`JaxprPlan.presliced`).
  """

  jaxpr: Jaxpr
  facts: Redundancy
  axes: Sequence[str]
  num_shards: int
  in_names: Sequence[str]
  out_names: Sequence[str]
  state_pairs: Mapping[int, int]
  min_size: int = 0
  split_reason: causes.SplitBy = causes.SPEC_SPLITS
  objective: str = "memory"
  topology: network.Topology | None = None
  shard_weights: bool = False
  state_whole: Mapping[int, object] = dataclasses.field(default_factory=dict)
  matched: Mapping[int, str] = dataclasses.field(default_factory=dict)
  roots: Sequence[int] = ()
  split: Mapping[int, tuple] = dataclasses.field(default_factory=dict)
  fsdp: Mapping[int, tuple] = dataclasses.field(default_factory=dict)
  copy_sizes: Mapping[str, int] = dataclasses.field(default_factory=dict)
  group_size: int | None = None
  grouping: Grouping | None = None
  split_by: str = "its spec"
  outside: tuple[reasons.Reason, ...] = ()
  arguments: Sequence[Argument] | None = None
  presliced: frozenset[int] = frozenset()


@dataclasses.dataclass(frozen=True)
class PlanningContext:
  """What every stage of one planning reads, the same for the step and its loop bodies.

  Attributes:
    facts: the step's redundancy analysis (`PlanRequest.facts`).
    axes: the replica axes the plan shards over; in `fsdp_blocks`' pass, the copy axes
      the blocks are sharded over.
    num_shards: the number of replicas along `axes`.
    min_size: tensors with fewer elements stay replicated.
    big: whether a value is large enough to shard (`graph.Graph.big`).
    objective: as for `cost.decide`.
    topology: the network the cost model prices collectives on (`num_shards` devices).
    shard_weights: `PlanRequest.shard_weights`.
    roots: the declared roots (`PlanRequest.roots`), as variables of the step's jaxpr.
    copy_sizes: the copy axes -> their sizes (`PlanRequest.copy_sizes`); `copy_axes`,
      their names.
    block_axes: in `fsdp_blocks`' pass, the plan's axes, of which each replica updates
      its own block (`axes` and `num_shards` are then the copy axes); else ().
    memo: this planning's memo: a loop's `loops.Body` -> its plan (`planner`), a
      conditional's branch jaxpr -> its cluster (`clusters.find_clusters`).
  """

  facts: Redundancy
  axes: frozenset[str]
  num_shards: int
  min_size: int
  big: Callable[[Var], bool]
  objective: str
  topology: network.Topology
  shard_weights: bool = False
  roots: frozenset[Var] = frozenset()
  copy_sizes: Mapping[str, int] = dataclasses.field(default_factory=dict)
  block_axes: tuple[str, ...] = ()
  memo: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

  @classmethod
  def of(cls, request: PlanRequest, big: Callable[[Var], bool]) -> PlanningContext:
    """The context of planning `request`, whose step's graph says which values are `big`."""
    return cls(request.facts, frozenset(request.axes), request.num_shards, request.min_size,
               big, request.objective,
               request.topology or network.default_topology(request.num_shards),
               request.shard_weights, frozenset(request.jaxpr.invars[k] for k in request.roots),
               dict(request.copy_sizes))

  @property
  def copy_axes(self) -> tuple[str, ...]:
    """The copy axes' names, in mesh order (`copy_sizes`' keys)."""
    return tuple(self.copy_sizes)
