"""The pipeline every front end shares: seven stages, each one value to the next (§3, §4).

A front end (`wus.shard_map`, `wus.pmap`, `wus.jit`'s update region)
translates each call into one `Call` (its `Step`, the user's `Options`, the
arguments, the mesh); `compile_step` runs `trace` -> `match` -> `group` ->
`flatten` -> `analyse` -> `plan` -> `build` on it (the values of `wus.stages`: `Traced`,
`Matched`, `Grouped`, `Flat`, `Analysed`, `Planned`, then the `Compiled` step that
`wus.runtime` runs).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from wus import mesh_axes, runtime, spec_splits
from wus.analysis import causes, compat, cost, reasons, redundancy
from wus.analysis.compat import ClosedJaxpr
from wus.analysis.plan import Grouping
from wus.analysis.planner import make_plan
from wus.analysis.planning import Argument, PlanRequest
from wus.matching import Signature, StateMatch, argument_paths, aval, match_state
from wus.options import Options
from wus.sharded import is_sharded
from wus.stages import (Analysed, Flat, Grouped, GroupRequest, Matched, Origin, Placement,
                        Planned, Traced)
from wus.transforms import gc_pause, groups, inline, programs
from wus.transforms.layout import ShardedLayout, spec_axes


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
    presliced: the positions of the operand leaves the front end can hand the step as
      shards where the step reads them only as shards (`analysis.presliced`: `wus.jit`'s
      region, whose GSPMD program splits a loop's stacked gradients where it writes them).
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
  presliced: frozenset = frozenset()


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
      whole = analyse(flatten(group(matched)))
      g, why = cost.auto_group_size(plan(whole).plan, whole.topology)
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
  return Traced(Origin(call, body, check_vma, sources, out_shape), avals, tuple(in_specs),
                tuple(out_specs), frozenset(manual))


def match(traced: Traced) -> Matched:
  """Stage 2: which outputs are the next values of which inputs (`matching`), with
  what the Plan says of each input's next value."""
  o = traced.origin
  call, step = o.call, o.call.step
  found = (step.match_state(call.args, o.out_shape) if step.match_state is not None
           else match_state(call.args, o.out_shape, step.signature))
  body_pos = o.body_pos
  pairs = {k: body_pos[i] for k, i in found.pairs.items() if i in body_pos}
  out_names = (tuple(step.names[1]) if step.names is not None else tuple(
      jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(
          o.out_shape)[0]))
  matched = {body_pos[i]: why for i, why in found.how.items() if i in body_pos}
  matched.update({body_pos[i]: f"next value {out_names[k]} (by {found.how[i]})"
                  for k, i in found.pairs.items() if i in body_pos})
  size = call.options.shard_group_size
  return Matched(traced, pairs, matched, out_names,
                 GroupRequest(None if size == "auto" else size))


def group(matched: Matched) -> Grouped:
  """Stage 3: the sharding groups `matched.request` asks for (§5.2); with groups the
  programs run on a mesh derived for them (`transforms.groups`), the step's specs and
  operands moved onto it.

  Raises:
    ValueError: as `mesh_axes.sharding_groups` (several sharding axes, a G that does not divide N).
  """
  t, request = matched.traced, matched.request
  o = t.origin
  mesh, size = o.call.mesh, request.size

  def grouped(placement: Placement, axes: tuple | None, operand_avals: list) -> Grouped:
    return Grouped(o, placement, axes, operand_avals, matched.pairs, matched.matched,
                   matched.out_names)

  chosen = Grouping(request.chosen) if request.chosen is not None else None
  if size is None:
    return grouped(Placement(mesh, None, chosen, size, t.in_specs, t.out_specs, t.manual),
                   None, t.operand_avals)
  axes = o.call.roles.update if o.call.roles else mesh_axes.replica_axes(
      o.call.options.axis_name, mesh, t.manual, o.body,
      [o.body.invars[i] for i in matched.pairs.values()])
  home, words = mesh_axes.sharding_groups(mesh, axes, size)
  if home is None:
    return grouped(Placement(mesh, None, Grouping(request.chosen, words), size, t.in_specs,
                             t.out_specs, t.manual), axes, t.operand_avals)
  derived = home.derived
  in_specs = tuple(home.derived_spec(p) for p in t.in_specs)
  operand_avals = [jax.ShapeDtypeStruct(np.shape(x), aval(x)[1],
                                        sharding=NamedSharding(derived, p),
                                        weak_type=bool(getattr(x, "weak_type", False)))
                   for x, p in zip(t.operand_avals, in_specs, strict=True)]
  return grouped(Placement(derived, home, Grouping(request.chosen, words, home.num_groups),
                           size, in_specs, tuple(home.derived_spec(p) for p in t.out_specs),
                           (t.manual - {home.axis}) | {home.outer, home.inner}),
                 (home.inner,), operand_avals)


def flatten(grouped: Grouped) -> Flat:
  """Stage 4: inlines calls (spliced in where `inline.spliced` applies, else retraced),
  then drops dead code (as jax.jit does before lowering): the analysis works on one flat
  jaxpr, and an unused read of optimizer state does not keep it whole. With groups, the
  step is renamed onto the derived mesh while it is inlined. State its in_spec and
  out_spec split differently (tensor parallelism) is kept whole between steps."""
  o, p = grouped.origin, grouped.placement
  spliced = inline.spliced(ClosedJaxpr(o.body, ())) if p.home is None else None
  if spliced is not None and not spliced.consts:
    flat = compat.without_dead_code(spliced.jaxpr, p.mesh, p.manual, o.check_vma)
  else:
    rename = p.home.rename if p.home is not None else None
    with groups.on(p.mesh) if p.home is not None else contextlib.nullcontext():
      flat_outer = jax.make_jaxpr(jax.shard_map(
          lambda *a: tuple(inline.inlined(ClosedJaxpr(o.body, ()), rename)(*a)), mesh=p.mesh,
          in_specs=p.in_specs, out_specs=p.out_specs, check_vma=o.check_vma,
          axis_names=p.manual))(*grouped.operand_avals)
    flat = compat.body_without_dead_code(compat.shard_map_eqn(flat_outer))
  pairs = dict(grouped.pairs)
  axes = (grouped.axes if grouped.axes is not None else o.call.roles.update if o.call.roles
          else mesh_axes.replica_axes(o.call.options.axis_name, p.mesh, p.manual, flat,
                                      [flat.invars[i] for i in pairs.values()]))
  # State split over other mesh axes too (tensor parallelism): each block is sharded
  # over the replica axes (ShardedLayout.split_axes), if it comes back as it came in.
  split_state = spec_splits.split_differently(pairs, p.in_specs, p.out_specs, grouped.out_names)
  for i in split_state:
    del pairs[next(k for k, j in pairs.items() if j == i)]
  return Flat(o, p, flat, axes, pairs, split_state, grouped.matched, grouped.out_names)


def analyse(flat: Flat) -> Analysed:
  """Stage 5: the redundancy analysis (§3.1), the inputs' names, the cost model's devices."""
  o, p = flat.origin, flat.placement
  call, mesh = o.call, p.mesh
  # An axis of size 1 splits nothing: a value its spec splits over one is the same on
  # its one replica (a (8, 1) mesh plans as the 1-D mesh).
  single = frozenset(a for a in p.manual if mesh.shape[a] == 1)
  in_rep = [frozenset(p.manual) if s[0] == "arg" and s[1] in call.replicated
            else p.manual - (spec_axes(spec) - single)
            for spec, s in zip(p.in_specs, o.sources, strict=True)]
  facts = redundancy.analyze(flat.jaxpr, in_rep, p.manual)
  step = call.step
  names = (tuple(step.names[0]) if step.names is not None
           else tuple(argument_paths(step.f, call.args, step.signature.keywords)))
  num_shards = math.prod(mesh.shape[a] for a in flat.axes)
  return Analysed(flat, facts, names,
                  mesh_axes.topology_for(call.options.topology, mesh, flat.axes, num_shards))


def plan(analysed: Analysed) -> Planned:
  """Stage 6: the complete Plan (`planner.make_plan`), groups and all."""
  f = analysed.flat
  return Planned(make_plan(plan_request(analysed)), f.origin, f.placement, f.jaxpr, f.axes,
                 analysed.facts, analysed.names)


def plan_request(analysed: Analysed) -> PlanRequest:
  """What the planner is asked of the analysed step (`planning.PlanRequest`): its flat
  jaxpr and facts, the mesh axes' roles, the state, the user's options and the front
  end's words."""
  f = analysed.flat
  o, g = f.origin, f.placement
  call, options, step = o.call, o.call.options, o.call.step
  roles = call.roles
  copy_sizes = ({a: g.mesh.shape[a] for a in roles.copy_axes} if roles and g.home is None else
                mesh_axes.copy_sizes(roles is None and options.axis_name is None, g.mesh,
                                     g.manual, f.axes, g.home))
  return PlanRequest(
      f.jaxpr, analysed.facts, axes=f.axes, num_shards=analysed.num_shards,
      in_names=analysed.in_names, out_names=list(f.out_names), state_pairs=f.pairs,
      state_whole=f.split_state, matched=f.matched,
      split=spec_splits.split_over(g.in_specs, f.axes, g.mesh, g.home),
      fsdp=spec_splits.fsdp_axes(g.in_specs, o.sources, call.replicated, f.axes, g.mesh),
      min_size=options.min_shard_size, split_reason=step.split_reason,
      objective=options.objective, shard_weights=options.shard_weights,
      topology=analysed.topology, copy_sizes=copy_sizes,
      group_size=g.group_size, grouping=g.grouping, split_by=step.split_by,
      outside=step.outside, arguments=None if step.arguments is None else tuple(
          # Each argument's operand of the region, as an operand of the traced step.
          dataclasses.replace(a, operand=o.body_pos.get(a.operand))
          for a in step.arguments),
      presliced=_presliced(step.presliced, o.sources, g))


def _presliced(allowed: frozenset, sources: Sequence, g: Placement) -> frozenset[int]:
  """The operands the front end may hand the region split (`PlanRequest.presliced`): those
  of the leaves in `allowed` (`Step.presliced`) that their spec splits over nothing, on
  the user's mesh of Auto axes (with Explicit ones each value's type fixes its layout:
  GSPMD would not split it where it is computed)."""
  if not allowed or g.home is not None or compat.explicit_axes(g.mesh):
    return frozenset()
  return frozenset(k for k, s in enumerate(sources)
                   if s[1] in allowed and all(e is None for e in g.in_specs[k]))


def build(planned: Planned, seconds: Mapping[str, float]) -> runtime.Compiled:
  """Stage 7: the rewritten step, jit-compiled (lowered at its first call), and how its
  operands and outputs map to the user's leaves; `seconds` the earlier stages' times."""
  p, o, g = planned.plan, planned.origin, planned.placement
  call, mesh, home = o.call, g.mesh, g.home
  arg_of_leaf = [k for k, arg in enumerate(call.args)
                 for _ in jax.tree.leaves(arg, is_leaf=is_sharded)]
  donated = [k for k, s in enumerate(o.sources)
             if s[0] == "arg" and arg_of_leaf[s[1]] in call.donate_argnums]
  lowering: dict = {}  # The program records its rewrite's seconds here when lowered.
  program = programs.step_program(ClosedJaxpr(planned.jaxpr, ()), p, mesh=mesh,
                                  in_specs=g.in_specs, out_specs=g.out_specs,
                                  axis_names=g.manual, check_vma=o.check_vma,
                                  donate_argnums=donated, timings=lowering, home=home)
  # The rewrite's sharded inputs are positions among the step's operands; the runtime's
  # are positions among the user's flat argument leaves: state, and values computed
  # before the region that it takes split (`JaxprPlan.presliced`).
  layouts = {k: ShardedLayout(fmt, p.shard_axes(fmt), g.in_specs[k], mesh, home)
             for k, fmt in p.rewrite.sharded_in.items()}
  sharded_leaves = {o.sources[k][1]: layout for k, layout in layouts.items()
                    if k not in p.rewrite.presliced}
  sharded_outputs = {k: ShardedLayout(fmt, p.shard_axes(fmt), g.out_specs[k], mesh, home)
                     for k, fmt in p.rewrite.sharded_out.items()}
  # Identical on every replica: of all the data-parallel axes, also across groups.
  same = frozenset(planned.axes) | (frozenset((home.outer, home.inner)) if home is not None
                                    else set())
  out_replicated = tuple(planned.facts.is_redundant(v, same) for v in planned.jaxpr.outvars)
  return runtime.Compiled(p, program, o.sources, sharded_leaves, sharded_outputs,
                          planned.names, g.out_specs, out_replicated,
                          jax.tree.structure(o.out_shape), mesh, call.mesh,
                          types.MappingProxyType(dict(seconds)), lowering,
                          presliced={o.sources[k][1]: layouts[k] for k in p.rewrite.presliced})
