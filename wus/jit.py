"""`wus.jit`: a global-view `jax.jit` step with its weight update sharded (DESIGN.md §1).

The step is traced as `jax.jit` traces it. `analysis.global_view` finds where
the batch ends in its global jaxpr: the gradient sums and the update that
reads only whole values. The rest (the forward and backward pass) runs as
GSPMD partitions it; the sums and the update run as a shard_map region over
the batch axes through the pipeline of `wus.shard_map`, so the gradients are
reduce-scattered, the update runs on 1/N of every tensor and optimizer state
stays sharded between calls.

On a mesh with model axes besides the batch axes (tensor parallelism: the
state placed over "model"), the region runs manual over every axis, each
model rank's blocks as `analysis.model_splits` says; each block's update is
sharded over the batch axes, and the state is split over data x model (one
`ShardedLayout`: the placement's split, then wus's; DESIGN.md §1). State placed
over a batch axis itself (FSDP) is a block the same way: its gradient sum is
reduce-scattered to it (`transforms.global_view.summed`), and with a replica
axis beside (HSDP) the update is sharded over the axes no weight is placed
over (`mesh_axes.Roles`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
import types
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding

from wus import (errors, jit_arguments, jit_operands, jit_placement, jit_region, mesh_axes,
                 pipeline, runtime)
from wus.analysis import compat, global_view, planner, presliced, propagation, refusals
from wus.analysis.causes import BATCH_SPLITS
from wus.analysis.model_splits import ModelSplits
from wus.analysis.plan import Plan
from wus.analysis.reasons import Reason
from wus.matching import Signature, StateMatch, argument_paths, match_state
from wus.options import Options
from wus.sharded import is_sharded
from wus.transforms import cond_parts
from wus.transforms import global_view as global_view_program


def jit(fun: Callable | None = None, /, *, in_shardings: Any = None, out_shardings: Any = None,
        static_argnums: int | Sequence[int] | None = None,
        static_argnames: str | Sequence[str] | None = None,
        donate_argnums: int | Sequence[int] | None = None,
        donate_argnames: str | Sequence[str] | None = None, keep_unused: bool = False,
        device: Any = None, backend: str | None = None, inline: bool = False,
        compiler_options: dict[str, Any] | None = None,
        min_shard_size: int = 0, objective: str = "memory",
        topology: Any = None) -> JitStep | Callable[[Callable], JitStep]:
  """Like `jax.jit`, with the weight update of a data-parallel step sharded across replicas.

  Swap `jax.jit` for `wus.jit`; nothing else changes. For a step written on
  global arrays, with the batch split over one or more mesh axes (placed with
  `NamedSharding(mesh, P("data"))`, or by `in_shardings`) and the weights and
  optimizer state whole (`P()` or unplaced), the gradient sums over the batch
  become reduce-scatters, the update runs on 1/N of every tensor and the new
  weights are all-gathered (§3, §4). Weights placed over other mesh axes
  (tensor parallelism: `NamedSharding(mesh, P(None, "model"))`, `in_shardings`,
  `nnx.with_partitioning`, linen logical axis rules) have each model rank's
  block sharded over the batch axes: their state is split over data x model.
  Weights placed over a batch axis itself (FSDP) have their gradients
  reduce-scattered to their blocks and their state kept as placed; beside a
  replica axis (HSDP: the batch over `("replica", "fsdp")`, the weights over
  "fsdp"), each block's update is sharded over "replica" too.
  Optimizer state comes back as
  `wus.ShardedArray` leaves, to pass straight to the next call;
  `wus.unshard` gives whole arrays. A step with no batch split, or whose
  update wus cannot find, runs as `jax.jit` runs it, with the reason in
  `.plan(...)`.

  Args:
    fun: the step, as for `jax.jit`.
    in_shardings: as for `jax.jit`.
    out_shardings: as for `jax.jit`.
    static_argnums: as for `jax.jit`.
    static_argnames: as for `jax.jit`.
    donate_argnums: as for `jax.jit`; a donated argument (sharded state
      included) must not be used after the call (passing it again raises
      ValueError).
    donate_argnames: as for `jax.jit`.
    keep_unused: as for `jax.jit`.
    device: as for `jax.jit`. A step pinned to one device has no data
      parallelism: it runs as `jax.jit` runs it, with the reason in the Plan.
    backend: as for `jax.jit`, the same.
    inline: as for `jax.jit`.
    compiler_options: as for `jax.jit`: XLA options for the step's program
      (wus's included).
    min_shard_size: as for `wus.shard_map`: tensors with fewer elements stay
      replicated.
    objective: as for `wus.shard_map` ("memory" or "time", §3.2).
    topology: as for `wus.shard_map`: the devices, for the cost model.

  Returns:
    A `JitStep`, called like the `jax.jit` of `fun`, with `.plan(*args,
    **kwargs)` and `.lower(*args, **kwargs)`. Used as a decorator without
    `fun`, a function that makes one.

  Example:
    >>> step = wus.jit(train_step, donate_argnums=(0, 1))  # doctest: +SKIP
    >>> params, opt_state, metrics = step(params, opt_state, batch)  # doctest: +SKIP
  """
  jit_kwargs = dict(in_shardings=in_shardings, out_shardings=out_shardings,
                    static_argnums=static_argnums, static_argnames=static_argnames,
                    donate_argnums=donate_argnums, donate_argnames=donate_argnames,
                    keep_unused=keep_unused or None, device=device, backend=backend,
                    inline=inline or None, compiler_options=compiler_options)
  jit_kwargs = {k: v for k, v in jit_kwargs.items() if v is not None}
  # Validated once, here: a bad objective= raises before any call.
  options = Options(min_shard_size=min_shard_size, objective=objective, topology=topology)

  def make(f: Callable) -> JitStep:
    return JitStep(f, jit_kwargs, options)
  return make if fun is None else make(fun)


class JitStep:
  """A global-view step whose weight update runs on shards (from `wus.jit`).

  Called like the `jax.jit` of the step it replaces. The gradient sums over the
  batch axes and the update after them run as a `shard_map` over those axes,
  each sum reduce-scattered and the update run on 1/N of every tensor (§4);
  the rest of the step runs as traced, partitioned by GSPMD. The state it keeps
  sharded comes back as `wus.ShardedArray`s, to pass to the next call as they
  are. A call raises `ValueError` for an argument donated to an earlier call.
  """

  def __init__(self, fun: Callable, jit_kwargs: dict, options: Options):
    self._fun = fun
    self._jit = jit_arguments.Jitted(fun, jit_kwargs)  # PartitionSpecs resolved per call.
    self._options = options
    # Static argument positions and names, each inferred from the other as jax.jit does.
    self._static, self._static_names = jit_arguments.static_args(fun, jit_kwargs)
    self._cache: dict = {}
    # (args, paths) -> the paths named as the user's function names its parameters, for
    # the adapters whose `fun` wraps the user's (`filter_jit`, `nnx_jit`); None: as they are.
    self.rename_paths: Callable[[tuple, list[str]], list[str]] | None = None
    functools.update_wrapper(self, fun)

  _jitted = property(lambda self: self._jit.jitted())
  _jit_kwargs = property(lambda self: self._jit.kwargs())

  def __call__(self, *args, **kwargs):
    leaves, compiled = self._compiled(args, kwargs)
    if compiled.mesh is None:  # The step runs unchanged.
      return self._jitted(*args, **kwargs)
    return runtime.call(leaves, compiled)

  def plan(self, *args, **kwargs) -> Plan:
    """The Plan for these arguments (whole or sharded state alike).

    Args:
      *args: the step's arguments, concrete or abstract, whole or sharded.
      **kwargs: its keyword arguments, the same.

    Returns:
      The `wus.Plan`: each weight-update cluster, sharded, owned or replicated
      and why (§3.2), with the cost model's prediction; `Plan.unchanged` says
      why a step runs as `jax.jit` runs it (no batch split, an update that
      cannot run on the model blocks).
    """
    return self._compiled(args, kwargs)[1].plan

  def lower(self, *args, **kwargs) -> jax.stages.Lowered:
    """Lowers the steady-state step program (optimizer state already sharded).

    Args:
      *args: the step's arguments, concrete or abstract, whole or sharded.
      **kwargs: its keyword arguments, the same.

    Returns:
      A `jax.stages.Lowered`, as `jax.jit(...).lower` returns:
      `.compile().memory_analysis()` gives per-device bytes,
      `.compile().as_text()` the optimized HLO.
    """
    leaves, compiled = self._compiled(args, kwargs)
    if compiled.mesh is None:
      return self._jitted.lower(*args, **kwargs)
    return runtime.lower(leaves, compiled)

  def timings(self, *args, **kwargs) -> dict[str, float]:
    """Seconds wus spends on these arguments' program, beside XLA's compile time.

    Args:
      *args: the step's arguments, concrete or abstract, whole or sharded.
      **kwargs: its keyword arguments, the same.

    Returns:
      {"trace": tracing the step once, as `jax.jit` does too; "analysis": propagating
      the placements, finding the update region and planning it; "rewrite": the
      rewrite interpreter emitting the region's sharded program, present once the step
      has been called or lowered, or whenever wus traced it to check it}.
    """
    return dict(self._compiled(args, kwargs)[1].timings)

  def state_target(self, *args, **kwargs) -> tuple:
    """The arguments as this step reads them, abstract: the target to restore a checkpoint into.

    As `ShardedStep.state_target`: pass the parts you saved to Orbax's restore;
    state this step keeps sharded comes back as `wus.ShardedArray`s in its
    format, at this mesh's replica count.

    Args:
      *args: the step's arguments, concrete or abstract, whole or sharded.
      **kwargs: its keyword arguments, the same.

    Returns:
      A tuple like `args` (static arguments as given): `jax.ShapeDtypeStruct`s
      with the step's shardings for what it reads whole,
      `wus.checkpoint.LogicalView`s for what it keeps sharded; with keyword
      arguments, `(that tuple, a dict like kwargs)`.
    """
    leaves, compiled = self._compiled(args, kwargs)
    shardings = compiled.in_shardings or [getattr(x, "sharding", None) for x in leaves]
    full, full_kwargs = self._with_dynamic(args, kwargs,
                                           runtime.state_target(leaves, compiled, shardings))
    return tuple(full) if not kwargs else (tuple(full), full_kwargs)

  # --- Tracing and planning. ----------------------------------------------------

  def _compiled(self, args: tuple, kwargs: dict) -> tuple[list, runtime.Compiled]:
    dyn = (tuple(x for i, x in enumerate(args) if i not in self._static),
           {k: v for k, v in kwargs.items() if k not in self._static_names})
    leaves, treedef = jax.tree.flatten(dyn, is_leaf=is_sharded)
    statics = (tuple((i, args[i]) for i in sorted(self._static) if i < len(args)),
               tuple(sorted((k, kwargs[k]) for k in self._static_names if k in kwargs)))
    key = (treedef, tuple(jit_arguments.leaf_key(x) for x in leaves), statics, self._jit.mesh())
    return leaves, runtime.compiled_once(self._cache, key,
                                         lambda: self._build(args, kwargs, dyn, leaves), self)

  def _build(self, args: tuple, kwargs: dict, dyn: tuple, leaves: list) -> runtime.Compiled:
    """The step for these arguments: the user's function traced once, as `jax.jit` traces
    it (its errors are the user's), then analysed and rewritten; an error of wus's own
    there makes the step run as `jax.jit` runs it, with the error in the Plan."""
    paths = argument_paths(self._fun, (*dyn[0], dyn[1]), keywords=True,
                           positions=self._dynamic_positions(args))
    if self.rename_paths is not None:
      paths = self.rename_paths(args, paths)
    declared = jit_arguments.declared(self._jit_kwargs.get("in_shardings"), dyn[0], leaves)
    mesh = jit_placement.mesh_of(leaves, declared)
    declared = [jit_arguments.named(s, mesh) for s in declared]
    start = time.perf_counter()
    traced = self._trace(args, kwargs, [jit_arguments.abstract(x, mesh) for x in leaves])
    traced_at = time.perf_counter()

    def unchanged(reason: Reason, axes: tuple = ()) -> runtime.Compiled:
      plan = _unchanged_plan(traced.jaxpr.jaxpr, paths, axes, mesh, reason)
      return _compiled(plan, self._jitted, {}, {}, paths, traced.out_tree, None)

    try:
      compiled = self._analyse(args, dyn, leaves, paths, declared, mesh, traced, unchanged)
    except Exception as e:  # noqa: BLE001 -- wus's own error never reaches the user's program.
      compiled = unchanged(errors.own_error(e))
    # The user's function traced once; the rest is wus's own (the rewrite's seconds are
    # recorded when the region's program is traced).
    spent = time.perf_counter() - traced_at - compiled.lowering.get("rewrite", 0.0)
    return dataclasses.replace(compiled, seconds=types.MappingProxyType(
        {"trace": traced_at - start, "analysis": spent}))

  def _analyse(self, args: tuple, dyn: tuple, leaves: list, paths: list[str], declared: list,
               mesh: Mesh | None, traced, unchanged: Callable) -> runtime.Compiled:
    """The batch's splits propagated from the placements, the update region, and the
    region's sharded program (`_compile`); or the step unchanged, and why."""
    if (pinned := jit_arguments.pinned(self._jit_kwargs)) is not None:
      return unchanged(pinned)
    if mesh is None:
      return unchanged(Reason(refusals.NoMesh()))
    refs = jit_arguments.refs(traced.jaxpr, paths)
    if refs:
      return unchanged(Reason(refusals.ReadsRefs(refs[0])))
    match = self._state(args, dyn, traced.out_info)
    pairs = match.pairs  # Output -> the input it follows.
    state = frozenset(pairs.values())
    flat = jit_region.flat_jaxpr(traced.jaxpr, mesh)
    splits = jit_placement.batch_splits(flat.jaxpr, leaves, declared, mesh, state)
    placed = jit_placement.batch_axes([leaves[k] for k in state], [declared[k] for k in state],
                                      mesh)
    roles = mesh_axes.Roles.of(mesh, propagation.batch_axes(splits, dict(mesh.shape)), placed)
    if not roles.batch:
      return unchanged(Reason(refusals.NoBatchSplit()))
    if roles.fsdp and (parted := cond_parts.split(
        flat, global_view.reads_sum(flat.jaxpr, splits))) is not flat:
      # A conditional around every update (MultiSteps, apply_if_finite) would join the
      # FSDP blocks, computed apart on each replica, and the rest: one per part instead.
      flat = parted
      splits = jit_placement.batch_splits(flat.jaxpr, leaves, declared, mesh, state)
    found = jit_region.update_region(flat, splits, mesh, roles.model, roles.fsdp, leaves,
                                     declared, state, frozenset(pairs))
    if isinstance(found, Reason):
      return unchanged(found.noted(*_split_ends(propagation.where_lost(flat.jaxpr, splits))),
                       roles.batch)
    blocks = found[2]
    roles = mesh_axes.Roles.of(mesh, roles.batch, placed, jit_region.blocked(blocks))
    compiled = self._compile(*found, match, dyn, traced, mesh, roles, paths, declared)
    if isinstance(compiled, Reason):
      return unchanged(compiled.noted(*_split_ends(propagation.where_lost(flat.jaxpr, splits))),
                       roles.batch)
    runtime.trace(leaves, compiled)  # Raises here, not at the user's call.
    return compiled

  def _dynamic_positions(self, args: tuple) -> tuple[int, ...]:
    return tuple(i for i in range(len(args)) if i not in self._static)

  def _with_dynamic(self, args: tuple, kwargs: dict, leaves: list) -> tuple[list, dict]:
    """The arguments with `leaves` as their dynamic leaves."""
    dyn_args, dyn_kwargs = jax.tree.unflatten(jit_arguments.dyn_structure(
        args, kwargs, self._static, self._static_names), leaves)
    full = list(args)
    for i, x in zip(self._dynamic_positions(args), dyn_args, strict=True):
      full[i] = x
    return full, {**kwargs, **dyn_kwargs}

  def _trace(self, args: tuple, kwargs: dict, leaves: list):
    """`jax.jit(fun).trace` on the arguments with `leaves` as their dynamic leaves."""
    full, full_kwargs = self._with_dynamic(args, kwargs, leaves)
    return self._jitted.trace(*full, **full_kwargs)

  def _state(self, args: tuple, dyn: tuple, out: Any) -> StateMatch:
    """Which outputs are the next values of which dynamic leaves (`match_state`)."""
    signature = Signature.of(self._fun, positions=self._dynamic_positions(args), keywords=True)
    return match_state((*dyn[0], dyn[1]), out, signature)

  def _compile(self, flat, region: global_view.Region, blocks: ModelSplits | None,
               specs: tuple, outside: tuple[Reason, ...], match: StateMatch, dyn: tuple,
               traced, mesh: Mesh, roles: mesh_axes.Roles, paths: list[str],
               declared: list) -> runtime.Compiled | Reason:
    """The compiled step; or, where parts of the update run outside the region and the
    region shards nothing, why the whole step runs as jax.jit runs it (the region would
    only change how GSPMD partitions the rest)."""
    jaxpr = flat.jaxpr
    in_pos = {v: k for k, v in enumerate(jaxpr.invars)}
    out_shape = traced.out_info
    region_out = {v: k for k, v in enumerate(region.outvars)}
    pairs, how = jit_operands.region_state(jaxpr, region, match)
    in_names = [jit_operands.name_of(jaxpr, v, in_pos, paths) for v in region.invars]
    out_paths = ["output" + jax.tree_util.keystr(p)
                 for p, _ in jax.tree_util.tree_flatten_with_path(out_shape)[0]]
    out_names = [next(out_paths[k] for k, w in enumerate(jaxpr.outvars) if w is v)
                 for v in region.outvars]
    in_specs, out_specs = specs
    step = pipeline.Step(
        global_view_program.region_fn(jaxpr, region, roles.batch, blocks, dict(mesh.shape)),
        in_specs, out_specs, check_vma=False, split_reason=BATCH_SPLITS,
        match_state=lambda a, o: StateMatch(dict(pairs), dict(how)),
        names=(in_names, out_names), split_by="its placement", outside=outside,
        arguments=jit_operands.arguments(jaxpr, region, paths, match, out_paths),
        presliced=presliced.stacked(jaxpr, region.invars))
    region_args = tuple(jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype,
                                             sharding=NamedSharding(mesh, s))
                        for v, s in zip(region.invars, in_specs, strict=True))
    sub = pipeline.compile_step(pipeline.Call(
        step, self._options, region_args, region_args, jax.tree.structure(region_args),
        frozenset(), mesh, frozenset(), roles))
    if not any(c.sharded or c.owner is not None for c in sub.plan.clusters):
      return _shards_nothing(sub.plan, blocks, outside)
    # Region input / output positions -> the step's flat leaves.
    sharded_leaves = {in_pos[region.invars[k]]: dataclasses.replace(layout, spec=in_specs[k])
                      for k, layout in sub.sharded_leaves.items()}
    sharded_outputs = {o: sub.sharded_outputs[region_out[v]] for o, v in enumerate(jaxpr.outvars)
                       if not compat.is_literal(v) and v in region_out
                       and region_out[v] in sub.sharded_outputs}
    donated = tuple(k for k, info in enumerate(jax.tree.leaves(traced.args_info))
                    if getattr(info, "donated", False))
    in_shardings = tuple(
        sharded_leaves[k].data_sharding if k in sharded_leaves
        else d or jit_placement.placement(x, mesh)
        for k, (x, d) in enumerate(zip(jax.tree.leaves(dyn, is_leaf=is_sharded), declared,
                                       strict=True)))
    wanted = jit_arguments.declared(self._jit_kwargs.get("out_shardings"), out_shape,
                                    jax.tree.leaves(out_shape))
    out_shardings = tuple(sharded_outputs[k].data_sharding if k in sharded_outputs
                          else jit_arguments.named(s, mesh)
                          for k, s in enumerate(wanted))
    run = jax.jit(functools.partial(global_view_program.run, flat, region, sub, in_specs),
                  donate_argnums=donated, in_shardings=in_shardings, out_shardings=out_shardings,
                  **jit_arguments.program_options(self._jit_kwargs))
    return _compiled(sub.plan, run, sharded_leaves, sharded_outputs, paths, traced.out_tree,
                     sub.mesh, in_shardings, sub)


def _compiled(plan: Plan, run: Callable, sharded_leaves: dict, sharded_outputs: dict,
              paths: list[str], out_tree, mesh: Mesh | None, in_shardings: tuple = (),
              region: runtime.Compiled | None = None) -> runtime.Compiled:
  """The pipeline's `Compiled` of a global-view step: `run` (the jitted program of the flat
  dynamic leaves, or the user's `jax.jit` with `mesh` None: the step runs unchanged) takes
  every leaf as an operand, on the user's mesh; its timings are its `region`'s."""
  return runtime.Compiled(plan, run, tuple(("arg", k) for k in range(len(paths))),
                           sharded_leaves, sharded_outputs, tuple(paths), (), (), out_tree,
                           mesh, mesh, region.seconds if region else {},
                           region.lowering if region else {}, in_shardings)


def _shards_nothing(plan: Plan, blocks: ModelSplits | None,
                    outside: tuple[Reason, ...]) -> Reason:
  """Why a step whose region would shard nothing runs as jax.jit runs it: the region would
  only change how GSPMD partitions the rest (the order of a sum, an ulp), for no saving."""
  return Reason(refusals.ShardsNothing(
      plan.clusters[0].why if plan.clusters else None, plan.num_shards, plan.min_size,
      outside[0] if outside else None, tuple(sorted(set(blocks.axes()))) if outside else ()))


def _split_ends(eqn) -> tuple[refusals.SplitEnds, ...]:
  """Where the batch's split ends, a note for a Plan's reason (none if nowhere)."""
  if eqn is None:
    return ()
  return (refusals.SplitEnds(str(eqn.primitive), compat.source_line(eqn)),)


def _unchanged_plan(jaxpr, paths: list[str], axes: tuple, mesh, reason: Reason) -> Plan:
  """The Plan of a step wus runs unchanged, every input whole for `reason` (the planner's)."""
  n = math.prod(mesh.shape[a] for a in axes) if mesh is not None and axes else 1
  return planner.unchanged_plan(jaxpr, paths, axes, n, reason)
