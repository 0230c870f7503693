"""The values the pipeline's stages hand each other (§3, §4): each carries what the stages
after it read, and no stage holds the chain before it.

`Traced` (stage 1, `pipeline.trace`) -> `Matched` -> `Grouped` -> `Flat` -> `Analysed` ->
`Planned`, then `pipeline.build`'s `Compiled`. What no later stage changes travels as two
small values: `Origin`, the call and its trace (made by `trace`), and `Placement`, the mesh
the programs run on and the step's specs on it (made by `group`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

from jax.sharding import Mesh

from wus.analysis import compat, network, redundancy
from wus.analysis.plan import Grouping, Plan
from wus.transforms import groups


@dataclasses.dataclass(frozen=True)
class Origin:
  """The call and what its trace fixed, read by every stage after `trace`.

  Attributes:
    call: the front end's translation of the call (`pipeline.Call`, which imports this
      module).
    body: the shard_map's per-replica jaxpr (calls not inlined).
    check_vma: the shard_map's.
    sources: per body input, ("arg", flat leaf) or ("const", value).
    out_shape: the step's outputs, abstract, as the user's pytree.
  """

  call: Any
  body: compat.Jaxpr
  check_vma: bool
  sources: tuple
  out_shape: Any

  @functools.cached_property
  def body_pos(self) -> dict:
    """Flat leaf -> its body input position."""
    return {s[1]: k for k, s in enumerate(self.sources) if s[0] == "arg"}


@dataclasses.dataclass(frozen=True)
class Traced:
  """Stage 1, `trace`: the user's step traced as `jax.shard_map` traces it.

  Attributes:
    origin: the call and what its trace fixed.
    avals: per flat leaf, what was traced (sharded state as its whole value).
    in_specs, out_specs, manual: the shard_map's, on the user's mesh.
  """

  origin: Origin
  avals: tuple
  in_specs: tuple
  out_specs: tuple
  manual: frozenset

  @property
  def operand_avals(self) -> list:  # Per body input.
    return [self.avals[s[1]] if s[0] == "arg" else s[1] for s in self.origin.sources]


@dataclasses.dataclass(frozen=True)
class GroupRequest:
  """The sharding groups asked for: G (None: one group of all N) and, for "auto", why."""

  size: int | None = None
  chosen: object | None = None


@dataclasses.dataclass(frozen=True)
class Matched:
  """Stage 2, `match`: the step's state (which outputs are the next values of which inputs).

  Attributes:
    traced: stage 1, all of which `group` reads (its specs, operands and origin).
    pairs: output position -> body input position of its state.
    matched: body input position -> which output the matching took for its next value
      and by which rule, or why it found none, for the Plan.
    out_names: a name per flat output.
    request: the groups `options.shard_group_size` asks for (G = None for "auto",
      until the cost model chooses).
  """

  traced: Traced
  pairs: dict
  matched: dict
  out_names: tuple
  request: GroupRequest


@dataclasses.dataclass(frozen=True)
class Placement:
  """Where the programs run, read by every stage after `group` (§5.2).

  Attributes:
    mesh: the mesh the programs run on (derived for sharding groups, else the user's).
    home: the sharding groups the programs run in, or None (G = N, G = 1, no G).
    grouping: the groups as the Plan says them, or None.
    group_size: the G asked (`GroupRequest.size`).
    in_specs, out_specs, manual: the step's, on `mesh`.
  """

  mesh: Mesh
  home: groups.Groups | None
  grouping: Grouping | None
  group_size: int | None
  in_specs: tuple
  out_specs: tuple
  manual: frozenset


@dataclasses.dataclass(frozen=True)
class Grouped:
  """Stage 3, `group`: the mesh the programs run on, derived for sharding groups (§5.2).

  Attributes:
    origin: the call and what its trace fixed.
    placement: the mesh, the groups and the step's specs on them.
    axes: the replica axes, when the groups fix them; None: found on the flat jaxpr.
    operand_avals: the step's operands, on `placement.mesh`.
    pairs, matched, out_names: stage 2's.
  """

  origin: Origin
  placement: Placement
  axes: tuple | None
  operand_avals: list
  pairs: dict
  matched: dict
  out_names: tuple


@dataclasses.dataclass(frozen=True)
class Flat:
  """Stage 4, `flatten`: one flat jaxpr, calls inlined, dead code dropped.

  Attributes:
    origin, placement: stage 3's.
    jaxpr: the flat per-replica jaxpr.
    axes: the replica (data-parallel) axes, in mesh order.
    pairs: `Matched.pairs` less `split_state`.
    split_state: body input position -> why that state is kept whole between steps.
    matched, out_names: stage 2's.
  """

  origin: Origin
  placement: Placement
  jaxpr: compat.Jaxpr
  axes: tuple
  pairs: dict
  split_state: dict
  matched: dict
  out_names: tuple


@dataclasses.dataclass(frozen=True)
class Analysed:
  """Stage 5, `analyse`: the redundancy facts (§3.1) and what the planner is told.

  Attributes:
    flat: stage 4, all of which `pipeline.plan_request` reads.
    facts: the redundancy analysis of `flat.jaxpr`.
    names: a name per flat leaf of the arguments.
    topology: the cost model's devices.
  """

  flat: Flat
  facts: redundancy.Redundancy
  names: tuple
  topology: network.Topology

  @property
  def in_names(self) -> list[str]:
    return [self.names[s[1]] if s[0] == "arg" else "<constant>"
            for s in self.flat.origin.sources]

  @property
  def num_shards(self) -> int:
    return math.prod(self.flat.placement.mesh.shape[a] for a in self.flat.axes)


@dataclasses.dataclass(frozen=True)
class Planned:
  """Stage 6, `plan`: the complete Plan, with what `pipeline.build` reads of the stages before.

  Attributes:
    plan: the Plan.
    origin, placement: stage 3's.
    jaxpr, axes: stage 4's.
    facts, names: stage 5's.
  """

  plan: Plan
  origin: Origin
  placement: Placement
  jaxpr: compat.Jaxpr
  axes: tuple
  facts: redundancy.Redundancy
  names: tuple
