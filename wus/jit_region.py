"""How `wus.jit` finds the update region of a global-view step on a mesh: which equations
run as a shard_map, on which model blocks, and what runs outside it as `jax.jit` runs it.

The region is found in the step's flat global jaxpr (`flat_jaxpr`: calls inlined, refs
discharged, input placements dropped). `analysis.global_view` finds the region where the
batch ends; `analysis.model_splits` solves which dims of its values the model axes
split, and those the state is placed over among the batch axes (FSDP). An equation that
needs a split dim whole (a `scan` over Muon's matrices, the `cond` of apply_if_finite)
runs outside the region with what it reads, and so does an FSDP gradient summed by
another primitive than a `dot_general` (summed as GSPMD sums it); the rest of the step
is served. How the region's operands are the step's arguments is `wus.jit_operands`.
"""

from __future__ import annotations

import jax
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from wus.analysis import compat, global_view, refusals
from wus.analysis import model_splits as splits_lib
from wus.analysis.reasons import Reason
from wus.sharded import is_sharded
from wus.transforms import global_view as global_view_program
from wus.transforms import inline


def flat_jaxpr(closed, mesh: Mesh):
  """The traced jaxpr with its calls inlined (spliced in where `inline.spliced` applies,
  else traced), the refs it creates discharged into values (`compat.without_refs`), the
  placements of its inputs dropped (`global_view.without_input_placements`) and dead code
  dropped."""
  flat = inline.spliced(closed)
  if flat is None:
    # The types `jax.jit` traced the step with (on the mesh's abstract mesh): each equation
    # is then replayed with its own types (`compat.bind`'s fast path), not bound anew.
    flat = jax.make_jaxpr(inline.inlined(closed))(*closed.in_avals)
  flat = compat.without_refs(flat)
  sizes = dict(mesh.shape)
  if any(global_view.is_placement(e, sizes) for e in flat.jaxpr.eqns):
    flat = global_view_program.without_input_placements(flat, sizes)
  return compat.ClosedJaxpr(compat.dce(flat.jaxpr), flat.consts)


def update_region(flat, splits, mesh: Mesh, model: tuple, fsdp: tuple, leaves: list,
                  declared: list, state: frozenset,
                  state_out: frozenset = frozenset()) -> tuple | Reason:
  """(the flat jaxpr, its update region, the region's model splits, its (in_specs,
  out_specs), why parts run outside it (`Reason`s)), or why the step has no region wus
  can run (a `Reason`, its verdict one of `refusals`').

  Args:
    flat: the step's flat global jaxpr (`flat_jaxpr`), closed.
    splits: its values' splits over the batch axes (`jit_placement.batch_splits`).
    mesh: the step's mesh.
    model: the model axes (the state is placed over them besides the batch axes).
    fsdp: the batch axes some state leaf is placed over itself.
    leaves, declared: the step's flat dynamic leaves and their declared shardings.
    state: the flat positions of the leaves with a next value.
    state_out: the flat output positions that are such next values.
  """
  # Equations run outside the region -> why (None: no limit). First, those reading a value
  # typed on other axis types than the mesh's: `auto_axes` computes them in Auto axes
  # inside an Explicit mesh (the gather of `x.at[i].get(out_sharding=...)` and its
  # gradient's scatter-add), where GSPMD orders their sums; the update reads the results.
  types = tuple(zip(mesh.axis_names, mesh.axis_types, strict=True))
  outside: dict[int, Reason | None] = {
      i: None for i, e in enumerate(flat.jaxpr.eqns)
      if any(_typed_otherwise(v.aval, types) for v in e.invars)}

  def cannot(why: Reason) -> Reason:
    return Reason(refusals.OnBlocks((*model, *fsdp), why))
  while True:
    region = global_view.find_region(flat.jaxpr, splits, dict(mesh.shape),
                                     frozenset(model) | frozenset(fsdp), frozenset(outside),
                                     state_out)
    if isinstance(region, Reason):
      why = next(filter(None, outside.values()), None)
      return cannot(why) if why else region
    blocks = model_splits(flat.jaxpr, region, leaves, declared, mesh, model, fsdp, state,
                          splits)
    position = getattr(blocks.verdict, "position", None) if isinstance(blocks, Reason) else None
    if isinstance(blocks, splits_lib.ModelSplits) and (gspmd := {
        i for i in blocks.scattered if i not in outside
        and global_view.summing_primitive(flat.jaxpr, i) is not lax.dot_general_p}):
      # An FSDP gradient summed by another primitive (an embedding's scatter-add) is
      # summed as GSPMD sums it, outside: its block enters the region.
      outside.update(dict.fromkeys(gspmd))
      continue
    if position is None or position in outside:
      break
    outside[position] = blocks
  if isinstance(blocks, Reason):
    return cannot(blocks)
  specs = region_specs(region, blocks)
  return specs if isinstance(specs, Reason) else (flat, region, blocks, specs,
                                                  tuple(filter(None, outside.values())))


def _typed_otherwise(aval, types: tuple) -> bool:
  """Whether a value is typed on other axis types than the mesh's (`types`: its (name,
  type) pairs), as `auto_axes` retypes one inside an Explicit mesh. A type on another
  mesh whose axes are Auto, as the mesh's are, lays nothing out: Keras's guide to data
  parallelism replicates the variables on a mesh of their own over the same devices."""
  have = compat.type_axes(aval)
  return have not in ((), types) and not all(t == AxisType.Auto for _, t in (*have, *types))


def model_splits(jaxpr, region, leaves: list, declared: list, mesh: Mesh, model: tuple,
                 fsdp: tuple = (), state: frozenset = frozenset(),
                 batch_splits=None) -> splits_lib.ModelSplits | None | Reason:
  """The model splits of the region's values (`analysis.model_splits`); None on a mesh
  without model axes and no state split over the batch axes, or why the region cannot
  run on blocks.

  Over the model axes: seeded by the placements of the step's arguments, the region's
  constraints and, on a mesh with Explicit axes, the types. Over `fsdp` (the batch axes
  some state leaf, at a flat position in `state`, is placed over itself: FSDP): seeded
  by the state's placements, constraints and types after the gradient sums alone, and
  solved over the equations after them (`global_view.partial_eqns`, whose values carry
  the batch, `batch_splits`): each sum is computed whole on this replica's rows and
  reduce-scattered to the block its result is split into (`ModelSplits.scattered`).
  """
  if not model and not fsdp:
    return None
  eqns = [(i, jaxpr.eqns[i]) for i in region.eqns]
  values = [*region.invars, *(v for _, e in eqns for v in e.outvars)]
  parts = []
  if model:
    parts.append(_solve(jaxpr, eqns, values, region, leaves, declared, mesh,
                        frozenset(model), range(len(leaves))))
  scattered = {}
  if fsdp:
    batch_splits = batch_splits or {}
    partial = global_view.partial_eqns(jaxpr, region, batch_splits)
    carried = {v for i in partial if i not in region.sums for v in jaxpr.eqns[i].outvars}
    parts.append(part := _solve(
        jaxpr, [(i, e) for i, e in eqns if i not in partial],
        [v for v in values if v not in carried and v not in batch_splits],
        region, leaves, declared, mesh, frozenset(fsdp), state))
    if not isinstance(part, Reason):
      scattered = {i: s for i in region.sums if (s := part.split(jaxpr.eqns[i].outvars[0]))}
  why = next((p for p in parts if isinstance(p, Reason)), None)
  return why if why is not None else splits_lib.merged(parts, scattered)


def _solve(jaxpr, eqns: list, values: list, region, leaves: list, declared: list, mesh: Mesh,
           axes: frozenset, seeded) -> splits_lib.ModelSplits | Reason:
  """`model_splits.solve` of `values` over `axes`, seeded by the placements of the step's
  arguments at the flat positions in `seeded`, the constraints among `eqns` and, on a
  mesh with Explicit axes, the types of `values`."""
  in_pos = {v: k for k, v in enumerate(jaxpr.invars)}
  seeds = {}
  for v in region.invars:
    if v in in_pos and in_pos[v] in seeded:
      k = in_pos[v]
      sharding = declared[k] or getattr(leaves[k], "sharding", None)
      if is_sharded(leaves[k]):
        sharding = NamedSharding(leaves[k].mesh, leaves[k].spec)
      if isinstance(sharding, NamedSharding) and sharding.mesh == mesh:
        if (split := splits_lib.restricted(sharding.spec, v.aval.ndim, axes)):
          seeds[v] = split
  seeds.update(splits_lib.seeds_of_constraints(eqns, axes))
  typed = compat.explicit_axes(mesh) & axes
  if typed:
    seeds.update(splits_lib.seeds_of_types(values, axes))
  return splits_lib.solve(eqns, values, seeds, dict(mesh.shape), typed)


def region_specs(region, blocks) -> tuple[tuple, tuple] | Reason:
  """(in_specs, out_specs) of the region's shard_map: each value's batch split, then its
  model split (`blocks`); or why they cannot be merged (a dim split both ways)."""
  if blocks is None:
    return region.in_specs, (P(),) * len(region.outvars)
  ins = []
  for v, spec in zip(region.invars, region.in_specs, strict=True):
    batch = tuple(None if e is None else e if isinstance(e, tuple) else (e,) for e in spec)
    merged = splits_lib.spec_with(batch + (None,) * (v.aval.ndim - len(batch)), blocks.split(v))
    if merged is None:
      return Reason(refusals.SplitBothWays(v.aval.str_short(), blocks.split(v), spec,
                                           read=True))
    ins.append(global_view.spec_of(merged))
  return tuple(ins), tuple(global_view.spec_of(blocks.split(v)) for v in region.outvars)


def blocked(blocks: splits_lib.ModelSplits | None) -> frozenset:
  """The axes some value of the update is split over into blocks: a batch axis among them
  (FSDP) splits a weight's update, whether its gradient is reduce-scattered to its block
  in the region or arrives as one (summed inside a loop, or as GSPMD sums it), so nothing
  is repeated over it in that update (`mesh_axes.Roles.update`)."""
  return frozenset(blocks.axes()) if blocks else frozenset()
