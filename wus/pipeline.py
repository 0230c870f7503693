"""The pipeline every front end shares: seven stages, each one value to the next (§3, §4).

A front end (`wus.shard_map`, `wus.pmap`, `wus.jit`'s update region)
translates each call into one `Call` (its `Step`, the user's `Options`, the
arguments, the mesh); `compile_step` runs `trace` -> `match` -> `group` ->
`flatten` -> `analyse` -> `plan` -> `build` on it (`Traced`, `Matched`, `Grouped`,
`Flat`, `Analysed`, `Planned`, then the `Compiled` step that `wus.runtime` runs).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import time
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from wus import mesh_axes, runtime, spec_splits
from wus.analysis import causes, compat, cost, network, reasons, redundancy
from wus.analysis.compat import ClosedJaxpr
from wus.analysis.plan import Grouping, Plan
from wus.analysis.planner import make_plan
from wus.analysis.planning import Argument, PlanRequest
from wus.matching import Signature, StateMatch, argument_paths, aval, match_state
from wus.options import Options
from wus.sharded import is_sharded
from wus.transforms import gc_pause, groups, inline, programs
from wus.transforms.layout import ShardedLayout


@dataclasses.dataclass(frozen=True)
class Step:
  """A per-replica step as the pipeline reads it: what a front end knows.

  Attributes:
    f: the per-replica step.
    in_specs, out_specs, check_vma, axis_names: as for `jax.shard_map`.
    split_reason: why an input its in_spec splits differs across replicas, for the Plan
      (`causes.SplitBy`; `wus.pmap` names its per-device copies).
    split_by: what splits inputs over model axes, in the Plan's words
      (`planning.PlanRequest`).
    outside: why parts of the front end's update run outside it (`Plan.outside`'s Reasons).
    signature: how the positional arguments map to the user's parameters.
    match_state: the front end's own state pairs (`wus.jit`'s region), or None
      for `matching.match_state`.
    names: the front end's names of the flat inputs and outputs, or None for
      the argument paths.
    arguments: the step's argument leaves when `f` is a region of it (`wus.jit`):
      the Plan lists these (`planning.Argument`); None: `f`'s own.
  """

  f: Callable
  in_specs: Any
  out_specs: Any
  check_vma: bool = True
  axis_names: frozenset = frozenset()
  split_reason: causes.SplitBy = causes.SPEC_SPLITS
  signature: Signature = Signature()
  match_state: Callable[[tuple, Any], StateMatch] | None = None
  names: tuple[Sequence[str], Sequence[str]] | None = None
  split_by: str = "its spec"
  outside: tuple[reasons.Reason, ...] = ()
  arguments: tuple[Argument, ...] | None = None


def compile_step(call: Call) -> runtime.Compiled:
  """The pipeline: trace, match state, group, flatten, analyse, plan, build (§3, §4).

  Every front end calls this once per input signature, with the one value it
  translates a call into; everything the Plan says is decided here,
  `shard_group_size="auto"` included (§5.2): the Plan of one group of all N
  (`cost.auto_group_size`) chooses G, then the step is grouped, analysed and
  planned again for it, the choice an input of the planner.
  """
  with gc_pause.paused():
    start = time.perf_counter()
    matched = match(trace(call))
    if call.options.shard_group_size == "auto":
      whole = plan(analyse(flatten(group(matched))))
      g, why = cost.auto_group_size(whole.plan, whole.analysed.topology)
      matched = dataclasses.replace(matched, request=GroupRequest(g, why))
    grouped = group(matched)
    traced_at = time.perf_counter()
    planned = plan(analyse(flatten(grouped)))
    return build(planned, {"trace": traced_at - start,
                           "analysis": time.perf_counter() - traced_at})


@dataclasses.dataclass(frozen=True)
class Call:
  """One call's inputs to the pipeline, as a front end translates its calling convention.

  Attributes:
    step: the per-replica step and the facts its front end knows.
    options: the user's options.
    args: the positional arguments; `leaves`, `treedef`: their flat leaves (sharded
      state as `ShardedArray` leaves).
    replicated: flat leaf positions identical on every replica although their in_spec
      splits them (`wus.pmap`'s equal per-device copies, §3.1).
    mesh: the user's mesh.
    donate_argnums: positional arguments whose buffers the step may reuse.
    roles: the mesh axes' roles, where the front end derives them (`wus.jit`, from
      the step's placements); None: the pipeline reads them off the step (the
      gradients' all-reduces, the user's `axis_name=`), and an update identical
      across the other manual axes is sharded over them too unless `axis_name=`
      names the sharding axes.
  """

  step: Step
  options: Options
  args: tuple
  leaves: tuple
  treedef: Any
  replicated: frozenset
  mesh: Mesh
  donate_argnums: frozenset
  roles: mesh_axes.Roles | None = None


@dataclasses.dataclass(frozen=True)
class Traced:
  """Stage 1, `trace`: the user's step traced as `jax.shard_map` traces it.

  Attributes:
    avals: per flat leaf, what was traced (sharded state as its whole value).
    body: the shard_map's per-replica jaxpr (calls not inlined).
    in_specs, out_specs, manual, check_vma: the shard_map's.
    sources: per body input, ("arg", flat leaf) or ("const", value).
    out_shape: the step's outputs, abstract, as the user's pytree.
  """

  call: Call
  avals: tuple
  body: Any
  in_specs: tuple
  out_specs: tuple
  manual: frozenset
  check_vma: bool
  sources: tuple
  out_shape: Any

  @property
  def operand_avals(self) -> list:  # Per body input.
    return [self.avals[s[1]] if s[0] == "arg" else s[1] for s in self.sources]

  @functools.cached_property
  def body_pos(self) -> dict:
    """Flat leaf -> its body input position."""
    return {s[1]: k for k, s in enumerate(self.sources) if s[0] == "arg"}


@dataclasses.dataclass(frozen=True)
class GroupRequest:
  """The sharding groups asked for: G (None: one group of all N) and, for "auto", why."""

  size: int | None = None
  chosen: object | None = None


@dataclasses.dataclass(frozen=True)
class Matched:
  """Stage 2, `match`: the step's state (which outputs are the next values of which inputs).

  Attributes:
    traced: stage 1.
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
class Grouped:
  """Stage 3, `group`: the mesh the programs run on, derived for sharding groups (§5.2).

  Attributes:
    matched: stage 2.
    home: the sharding groups the programs run in, or None (G = N, G = 1, no G).
    axes: the replica axes, when the groups fix them; None: found on the flat jaxpr.
    grouping: the groups as the Plan says them, or None.
    mesh, in_specs, out_specs, manual, operand_avals: the step's, on the derived mesh.
  """

  matched: Matched
  home: groups.Groups | None
  axes: tuple | None
  grouping: Grouping | None
  mesh: Mesh
  in_specs: tuple
  out_specs: tuple
  manual: frozenset
  operand_avals: list


@dataclasses.dataclass(frozen=True)
class Flat:
  """Stage 4, `flatten`: one flat jaxpr, calls inlined, dead code dropped.

  Attributes:
    grouped: stage 3.
    jaxpr: the flat per-replica jaxpr.
    axes: the replica (data-parallel) axes, in mesh order.
    pairs: `Matched.pairs` less `split_state`.
    split_state: body input position -> why that state is kept whole between steps.
  """

  grouped: Grouped
  jaxpr: Any
  axes: tuple
  pairs: dict
  split_state: dict


@dataclasses.dataclass(frozen=True)
class Analysed:
  """Stage 5, `analyse`: the redundancy facts (§3.1) and what the planner is told.

  Attributes:
    flat: stage 4.
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
    sources = self.flat.grouped.matched.traced.sources
    return [self.names[s[1]] if s[0] == "arg" else "<constant>" for s in sources]

  @property
  def num_shards(self) -> int:
    return math.prod(self.flat.grouped.mesh.shape[a] for a in self.flat.axes)


@dataclasses.dataclass(frozen=True)
class Planned:
  """Stage 6, `plan`: the complete Plan."""

  analysed: Analysed
  plan: Plan


def trace(call: Call) -> Traced:
  """Stage 1: traces the user's step exactly as `jax.shard_map` would.

  Raises:
    NotImplementedError: the traced function's outputs do not come from the shard_map.
  """
  step, mesh = call.step, call.mesh
  avals = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype,
                                     sharding=NamedSharding(mesh, x.layout.user_spec))
                if is_sharded(x) else x for x in call.leaves)
  smap = jax.shard_map(step.f, mesh=mesh, in_specs=step.in_specs,
                       out_specs=step.out_specs, check_vma=step.check_vma,
                       axis_names=step.axis_names)
  outer, out_shape = jax.make_jaxpr(smap, return_shape=True)(
      *jax.tree.unflatten(call.treedef, avals))
  eqn = compat.shard_map_eqn(outer)
  body, _, in_specs, out_specs, manual, check_vma = compat.shard_map_params(eqn)
  if list(outer.jaxpr.outvars) != list(eqn.outvars):
    raise NotImplementedError("wus.shard_map expects f's outputs to come from shard_map")
  arg_pos = {v: k for k, v in enumerate(outer.jaxpr.invars)}
  const_val = dict(zip(outer.jaxpr.constvars, outer.consts, strict=True))
  sources = tuple(("arg", arg_pos[v]) if v in arg_pos else ("const", const_val[v])
                  for v in eqn.invars)
  return Traced(call, avals, body, tuple(in_specs), tuple(out_specs), frozenset(manual),
                check_vma, sources, out_shape)


def match(traced: Traced) -> Matched:
  """Stage 2: which outputs are the next values of which inputs (`matching`), with
  what the Plan says of each input's next value."""
  call, step = traced.call, traced.call.step
  found = (step.match_state(call.args, traced.out_shape) if step.match_state is not None
           else match_state(call.args, traced.out_shape, step.signature))
  body_pos = traced.body_pos
  pairs = {o: body_pos[i] for o, i in found.pairs.items() if i in body_pos}
  out_names = (tuple(step.names[1]) if step.names is not None else tuple(
      jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(
          traced.out_shape)[0]))
  matched = {body_pos[i]: why for i, why in found.how.items() if i in body_pos}
  matched.update({body_pos[i]: f"next value {out_names[o]} (by {found.how[i]})"
                  for o, i in found.pairs.items() if i in body_pos})
  size = call.options.shard_group_size
  return Matched(traced, pairs, matched, out_names,
                 GroupRequest(None if size == "auto" else size))


def group(matched: Matched) -> Grouped:
  """Stage 3: the sharding groups `matched.request` asks for (§5.2); with groups the
  programs run on a mesh derived for them (`transforms.groups`), the step's specs and
  operands moved onto it.

  Raises:
    ValueError: as `_groups` (several sharding axes, a G that does not divide N).
  """
  t, request = matched.traced, matched.request
  mesh, options = t.call.mesh, t.call.options
  chosen = Grouping(request.chosen) if request.chosen is not None else None
  if request.size is None:
    return Grouped(matched, None, None, chosen, mesh, t.in_specs, t.out_specs, t.manual,
                   t.operand_avals)
  axes = t.call.roles.update if t.call.roles else mesh_axes.replica_axes(
      options.axis_name, mesh, t.manual, t.body, [t.body.invars[i] for i in matched.pairs.values()])
  home, words = mesh_axes.sharding_groups(mesh, axes, request.size)
  if home is None:
    return Grouped(matched, None, axes, Grouping(request.chosen, words), mesh, t.in_specs,
                   t.out_specs, t.manual, t.operand_avals)
  derived = home.derived
  in_specs = tuple(home.derived_spec(p) for p in t.in_specs)
  operand_avals = [jax.ShapeDtypeStruct(np.shape(x), aval(x)[1],
                                        sharding=NamedSharding(derived, p),
                                        weak_type=bool(getattr(x, "weak_type", False)))
                   for x, p in zip(t.operand_avals, in_specs, strict=True)]
  return Grouped(matched, home, (home.inner,),
                 Grouping(request.chosen, words, home.num_groups), derived, in_specs,
                 tuple(home.derived_spec(p) for p in t.out_specs),
                 (t.manual - {home.axis}) | {home.outer, home.inner}, operand_avals)


def flatten(grouped: Grouped) -> Flat:
  """Stage 4: inlines calls (spliced in where `inline.spliced` applies, else retraced),
  then drops dead code (as jax.jit does before lowering): the analysis works on one flat
  jaxpr, and an unused read of optimizer state does not keep it whole. With groups, the
  step is renamed onto the derived mesh while it is inlined. State its in_spec and
  out_spec split differently (tensor parallelism) is kept whole between steps."""
  g, t = grouped, grouped.matched.traced
  spliced = inline.spliced(ClosedJaxpr(t.body, ())) if g.home is None else None
  if spliced is not None and not spliced.consts:
    flat = compat.without_dead_code(spliced.jaxpr, g.mesh, g.manual, t.check_vma)
  else:
    rename = g.home.rename if g.home is not None else None
    with groups.on(g.mesh) if g.home is not None else contextlib.nullcontext():
      flat_outer = jax.make_jaxpr(jax.shard_map(
          lambda *a: tuple(inline.inlined(ClosedJaxpr(t.body, ()), rename)(*a)), mesh=g.mesh,
          in_specs=g.in_specs, out_specs=g.out_specs, check_vma=t.check_vma,
          axis_names=g.manual))(*g.operand_avals)
    flat = compat.body_without_dead_code(compat.shard_map_eqn(flat_outer))
  pairs = dict(g.matched.pairs)
  axes = (g.axes if g.axes is not None else t.call.roles.update if t.call.roles
          else mesh_axes.replica_axes(t.call.options.axis_name, g.mesh, g.manual, flat,
                                      [flat.invars[i] for i in pairs.values()]))
  # State split over other mesh axes too (tensor parallelism): each block is sharded
  # over the replica axes (ShardedLayout.split_axes), if it comes back as it came in.
  split_state = spec_splits.split_differently(pairs, g.in_specs, g.out_specs, g.matched.out_names)
  for i in split_state:
    del pairs[next(o for o, k in pairs.items() if k == i)]
  return Flat(grouped, flat, axes, pairs, split_state)


def analyse(flat: Flat) -> Analysed:
  """Stage 5: the redundancy analysis (§3.1), the inputs' names, the cost model's devices."""
  g, t = flat.grouped, flat.grouped.matched.traced
  call, mesh = t.call, g.mesh
  # An axis of size 1 splits nothing: a value its spec splits over one is the same on
  # its one replica (a (8, 1) mesh plans as the 1-D mesh).
  single = frozenset(a for a in g.manual if mesh.shape[a] == 1)
  in_rep = [frozenset(g.manual) if s[0] == "arg" and s[1] in call.replicated
            else g.manual - (runtime.spec_axes(spec) - single)
            for spec, s in zip(g.in_specs, t.sources, strict=True)]
  facts = redundancy.analyze(flat.jaxpr, in_rep, g.manual)
  step = call.step
  names = (tuple(step.names[0]) if step.names is not None
           else tuple(argument_paths(step.f, call.args, step.signature.keywords)))
  num_shards = math.prod(mesh.shape[a] for a in flat.axes)
  return Analysed(flat, facts, names,
                  mesh_axes.topology_for(call.options.topology, mesh, flat.axes, num_shards))


def plan(analysed: Analysed) -> Planned:
  """Stage 6: the complete Plan (`planner.make_plan`), groups and all."""
  return Planned(analysed, make_plan(plan_request(analysed)))


def plan_request(analysed: Analysed) -> PlanRequest:
  """What the planner is asked of the analysed step (`planning.PlanRequest`): its flat
  jaxpr and facts, the mesh axes' roles, the state, the user's options and the front
  end's words."""
  f, g, m = analysed.flat, analysed.flat.grouped, analysed.flat.grouped.matched
  call, options, step = m.traced.call, m.traced.call.options, m.traced.call.step
  roles = call.roles
  copy_sizes = ({a: g.mesh.shape[a] for a in roles.copies} if roles and g.home is None else
                mesh_axes.copy_axes(roles is None and options.axis_name is None, g.mesh, g.manual,
                                    f.axes, g.home))
  return PlanRequest(
      f.jaxpr, analysed.facts, axes=f.axes, num_shards=analysed.num_shards,
      in_names=analysed.in_names, out_names=list(m.out_names), state_pairs=f.pairs,
      state_whole=f.split_state, matched=m.matched,
      split=spec_splits.split_over(g.in_specs, f.axes, g.mesh, g.home),
      fsdp=spec_splits.fsdp_axes(g.in_specs, m.traced.sources, call.replicated, f.axes, g.mesh),
      min_size=options.min_shard_size, split_reason=step.split_reason,
      objective=options.objective, shard_weights=options.shard_weights,
      topology=analysed.topology, copy_sizes=copy_sizes,
      group_size=m.request.size, grouping=g.grouping, split_by=step.split_by,
      outside=step.outside, arguments=None if step.arguments is None else tuple(
          # Each argument's operand of the region, as an operand of the traced step.
          dataclasses.replace(a, operand=m.traced.body_pos.get(a.operand))
          for a in step.arguments))


def build(planned: Planned, seconds: Mapping[str, float]) -> runtime.Compiled:
  """Stage 7: the rewritten step, jit-compiled (lowered at its first call), and how its
  operands and outputs map to the user's leaves; `seconds` the earlier stages' times."""
  a, p, f = planned.analysed, planned.plan, planned.analysed.flat
  g, t = f.grouped, f.grouped.matched.traced
  call, mesh, home = t.call, g.mesh, g.home
  arg_of_leaf = [k for k, arg in enumerate(call.args)
                 for _ in jax.tree.leaves(arg, is_leaf=is_sharded)]
  donated = [k for k, s in enumerate(t.sources)
             if s[0] == "arg" and arg_of_leaf[s[1]] in call.donate_argnums]
  lowering: dict = {}  # The program records its rewrite's seconds here when lowered.
  program = programs.step_program(ClosedJaxpr(f.jaxpr, ()), p, mesh=mesh, in_specs=g.in_specs,
                                  out_specs=g.out_specs, axis_names=g.manual,
                                  check_vma=t.check_vma, donate_argnums=donated,
                                  timings=lowering, home=home)
  # The rewrite's sharded inputs are positions among the step's operands; the runtime's
  # are positions among the user's flat argument leaves.
  sharded_leaves = {t.sources[k][1]: ShardedLayout(fmt, p.shard_axes(fmt), g.in_specs[k], mesh,
                                                   home) for k, fmt in p.rewrite.sharded_in.items()}
  sharded_outputs = {k: ShardedLayout(fmt, p.shard_axes(fmt), g.out_specs[k], mesh, home)
                     for k, fmt in p.rewrite.sharded_out.items()}
  # Identical on every replica: of all the data-parallel axes, also across groups.
  same = frozenset(f.axes) | (frozenset((home.outer, home.inner)) if home is not None
                              else set())
  out_replicated = tuple(a.facts.is_redundant(v, same) for v in f.jaxpr.outvars)
  return runtime.Compiled(p, program, t.sources, sharded_leaves, sharded_outputs, a.names,
                  g.out_specs, out_replicated, jax.tree.structure(t.out_shape), mesh,
                  call.mesh, types.MappingProxyType(dict(seconds)), lowering)
