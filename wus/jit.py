"""`wus.jit`: a global-view `jax.jit` step with its weight update sharded (DESIGN.md §1).

The step is traced as `jax.jit` traces it. `analysis.global_view` finds where
the batch ends in its global jaxpr: the gradient sums and the update that
reads only whole values. The rest (the forward and backward pass) runs as
GSPMD partitions it; the sums and the update run as a shard_map region over
the batch axes through the pipeline of `wus.shard_map`, so the gradients are
reduce-scattered, the update runs on 1/N of every tensor and optimizer state
stays sharded between calls.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from wus.analysis import compat, global_view
from wus.analysis.plan import InputPlan, Plan, Program
from wus import runtime
from wus.api import ShardedStep
from wus.matching import Signature, StateMatch, match_state
from wus.sharded import ShardedArray, check_alive, is_sharded
from wus.transforms import inline, programs


def jit(fun: Callable | None = None, /, *, in_shardings: Any = None, out_shardings: Any = None,
        static_argnums: int | Sequence[int] | None = None,
        static_argnames: str | Sequence[str] | None = None,
        donate_argnums: int | Sequence[int] | None = None,
        donate_argnames: str | Sequence[str] | None = None,
        min_shard_size: int = 0, objective: str = "memory",
        topology: Any = None) -> JitStep | Callable[[Callable], JitStep]:
  """Like `jax.jit`, with the weight update of a data-parallel step sharded across replicas.

  Swap `jax.jit` for `wus.jit`; nothing else changes. For a step written on
  global arrays, with the batch split over one or more mesh axes (placed with
  `NamedSharding(mesh, P("data"))`, or by `in_shardings`) and the weights and
  optimizer state whole (`P()` or unplaced), the gradient sums over the batch
  become reduce-scatters, the update runs on 1/N of every tensor and the new
  weights are all-gathered (§3, §4). Optimizer state comes back as
  `wus.ShardedArray` leaves, to pass straight to the next call;
  `wus.unshard` gives whole arrays. A step with no batch split, or whose
  update wus cannot find, runs as `jax.jit` runs it, with the reason in
  `.plan(...)`.

  Args:
    fun: the step, as for `jax.jit`.
    in_shardings, out_shardings, static_argnums, static_argnames,
      donate_argnums, donate_argnames: as for `jax.jit`.
    min_shard_size, objective, topology: as for `wus.shard_map`.

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
                    donate_argnums=donate_argnums, donate_argnames=donate_argnames)
  jit_kwargs = {k: v for k, v in jit_kwargs.items() if v is not None}
  options = dict(min_shard_size=min_shard_size, objective=objective, topology=topology)

  def make(f: Callable) -> JitStep:
    return JitStep(f, jit_kwargs, options)
  return make if fun is None else make(fun)


@dataclasses.dataclass(frozen=True)
class _Compiled:
  """Everything compiled for one input signature."""

  plan: Plan
  run: Callable[..., Any]       # The jitted program of the flat dynamic leaves.
  state_in: dict                # Flat leaf -> (ShardFormat, whole spec): passed sharded.
  state_out: dict               # Flat output -> ShardFormat: returned sharded.
  in_names: tuple[str, ...]
  out_tree: Any
  mesh: Mesh | None
  axes: tuple
  in_shardings: tuple = ()      # Per flat leaf: where the program takes it.

  # What `ShardedStep._operands` reads of a program.
  @property
  def sources(self) -> tuple:
    return tuple(("arg", k) for k in range(len(self.in_names)))


class JitStep:
  """A global-view step whose weight update runs on shards (from `wus.jit`)."""

  def __init__(self, fun: Callable, jit_kwargs: dict, options: dict):
    self._fun = fun
    self._jit_kwargs = jit_kwargs
    self._options = options
    self._jitted = jax.jit(fun, **jit_kwargs)
    self._cache: dict = {}
    functools.update_wrapper(self, fun)

  def __call__(self, *args, **kwargs):
    leaves, prog = self._program(args, kwargs)
    if prog.mesh is None:
      return self._jitted(*args, **kwargs)
    for k, x in enumerate(leaves):
      check_alive(x, prog.in_names[k])
    ops = runtime.operands(leaves, prog) if prog.state_in else leaves
    # Placed where the program takes them, so the next call compiles nothing new.
    ops = [x if getattr(x, "sharding", None) == s else jax.device_put(x, s)
           for x, s in zip(ops, prog.in_shardings, strict=True)]
    outs = prog.run(*ops)
    wrapped = [ShardedArray(x, prog.state_out[k], prog.axes, P(), prog.mesh)
               if k in prog.state_out else x for k, x in enumerate(outs)]
    return jax.tree.unflatten(prog.out_tree, wrapped)

  def plan(self, *args, **kwargs) -> Plan:
    """The Plan for these arguments (whole or sharded state alike)."""
    return self._program(args, kwargs)[1].plan

  def lower(self, *args, **kwargs) -> jax.stages.Lowered:
    """Lowers the steady-state step program (optimizer state already sharded)."""
    leaves, prog = self._program(args, kwargs)
    if prog.mesh is None:
      return self._jitted.lower(*args, **kwargs)
    spec = NamedSharding(prog.mesh, programs.shard_spec(prog.axes))
    ops = [jax.ShapeDtypeStruct(prog.state_in[k][0].padded_shape, x.dtype, sharding=spec)
           if k in prog.state_in else x for k, x in enumerate(leaves)]
    return prog.run.lower(*ops)

  def state_target(self, *args, **kwargs) -> tuple:
    """The arguments as this step reads them, abstract: the target to restore a checkpoint into.

    As `ShardedStep.state_target`: pass the parts you saved to Orbax's restore;
    state this step keeps sharded comes back as `wus.ShardedArray`s in its
    format, at this mesh's replica count.

    Args:
      args, kwargs: the step's arguments, concrete or abstract, whole or sharded.

    Returns:
      A tuple like `args` (static arguments as given): `jax.ShapeDtypeStruct`s
      with the step's shardings for what it reads whole,
      `wus.checkpoint.LogicalView`s for what it keeps sharded; with keyword
      arguments, `(that tuple, a dict like kwargs)`.
    """
    from wus import checkpoint  # noqa: PLC0415 -- imports Orbax only when checkpoints are used
    leaves, prog = self._program(args, kwargs)
    out = []
    for k, x in enumerate(leaves):
      if k in prog.state_in:
        out.append(checkpoint.restore_target(prog.state_in[k][0], prog.axes, P(), prog.mesh,
                                             x.dtype))
      else:
        sharding = prog.in_shardings[k] if prog.in_shardings else getattr(x, "sharding", None)
        out.append(jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding,
                                        weak_type=bool(getattr(x, "weak_type", False))))
    static = _static(self._fun, self._jit_kwargs)[0]
    dyn_args, dyn_kwargs = jax.tree.unflatten(_dyn_structure(args, kwargs, static,
                                                             _static(self._fun,
                                                                     self._jit_kwargs)[1]), out)
    full = list(args)
    for i, x in zip([i for i in range(len(args)) if i not in static], dyn_args, strict=True):
      full[i] = x
    return tuple(full) if not kwargs else (tuple(full), {**kwargs, **dyn_kwargs})

  # --- Tracing and planning. ----------------------------------------------------

  def _program(self, args: tuple, kwargs: dict) -> tuple[list, _Compiled]:
    static_nums, static_names = _static(self._fun, self._jit_kwargs)
    dyn = (tuple(x for i, x in enumerate(args) if i not in static_nums),
           {k: v for k, v in kwargs.items() if k not in static_names})
    leaves, treedef = jax.tree.flatten(dyn, is_leaf=is_sharded)
    statics = (tuple((i, args[i]) for i in sorted(static_nums) if i < len(args)),
               tuple(sorted((k, kwargs[k]) for k in static_names if k in kwargs)))
    key = (treedef, tuple(_signature(x) for x in leaves), statics)
    if key not in self._cache:
      self._cache[key] = self._build(args, kwargs, dyn, leaves)
    return leaves, self._cache[key]

  def _build(self, args: tuple, kwargs: dict, dyn: tuple, leaves: list) -> _Compiled:
    paths = _arg_paths(self._fun, args, dyn, _static(self._fun, self._jit_kwargs)[0])
    declared = _declared(self._jit_kwargs.get("in_shardings"), dyn[0], leaves)
    mesh = _mesh_of(leaves, declared)
    declared = [_named(s, mesh) for s in declared]
    axes = _batch_axes(leaves, declared, mesh)
    whole = [_abstract(x, mesh) for x in leaves]
    traced = self._trace(args, kwargs, whole)
    out_tree = traced.out_tree

    def unchanged(reason: str) -> _Compiled:
      plan = _unchanged_plan(traced.jaxpr.jaxpr, paths, axes, mesh, reason)
      return _Compiled(plan, self._jitted, {}, {}, tuple(paths), out_tree, None, axes)

    if mesh is None or not axes:
      return unchanged("no argument is split over a mesh axis (the batch), so there is no "
                       "data parallelism to shard the update over")
    split_state = [paths[i] for i in self._state(args, dyn, traced.out_info).pairs.values()
                   if _batch_axes([leaves[i]], [declared[i]], mesh)]
    if split_state:
      return unchanged(f"state is split over mesh axes itself ({split_state[0]}: tensor or "
                       "fully sharded data parallelism), which wus.jit does not serve yet; "
                       "the step runs as jax.jit runs it")
    flat = _flat(traced.jaxpr, mesh)
    if compat.explicit_axes(mesh) >= set(axes):
      splits = global_view.splits_from_types(flat.jaxpr, frozenset(axes))
    else:
      larger = _flat(self._trace(args, kwargs, [
          x if is_sharded(a) else _larger(x, d or getattr(a, "sharding", None), axes)
          for x, a, d in zip(whole, leaves, declared, strict=True)]).jaxpr, mesh)
      splits = global_view.splits_from_sizes(flat.jaxpr, larger.jaxpr, axes)
      if isinstance(splits, str):
        return unchanged(splits)
    region = global_view.find_region(flat.jaxpr, splits, dict(mesh.shape))
    if isinstance(region, str):
      return unchanged(region)
    return self._compile(flat, region, args, dyn, traced, mesh, axes, paths, declared)

  def _trace(self, args: tuple, kwargs: dict, leaves: list):
    """`jax.jit(fun).trace` on the arguments with `leaves` as their dynamic leaves."""
    static_nums, static_names = _static(self._fun, self._jit_kwargs)
    dyn_pos = [i for i in range(len(args)) if i not in static_nums]
    dyn_args, dyn_kwargs = jax.tree.unflatten(
        _dyn_structure(args, kwargs, static_nums, static_names), leaves)
    full = list(args)
    for i, x in zip(dyn_pos, dyn_args, strict=True):
      full[i] = x
    return self._jitted.trace(*full, **{**kwargs, **dyn_kwargs})

  def _state(self, args: tuple, dyn: tuple, out: Any) -> StateMatch:
    """Which outputs are the next values of which dynamic leaves (`_match_state`)."""
    static = _static(self._fun, self._jit_kwargs)[0]
    signature = Signature.of(self._fun, positions=tuple(i for i in range(len(args))
                                                        if i not in static), keywords=True)
    return match_state((*dyn[0], dyn[1]), out, signature)

  def _compile(self, flat, region: global_view.Region, args: tuple, dyn: tuple, traced,
               mesh: Mesh, axes: tuple, paths: list[str], declared: list) -> _Compiled:
    jaxpr = flat.jaxpr
    inside = set(region.eqns)
    outside_reads = {v for i, e in enumerate(jaxpr.eqns) if i not in inside for v in e.invars
                     if not compat.is_literal(v)}
    in_pos = {v: k for k, v in enumerate(jaxpr.invars)}
    out_shape = traced.out_info
    region_in = {v: k for k, v in enumerate(region.invars)}
    region_out = {v: k for k, v in enumerate(region.outvars)}
    pairs, how = {}, {}
    match = self._state(args, dyn, out_shape)
    for o, i in match.pairs.items():
      ov, iv = jaxpr.outvars[o], jaxpr.invars[i]
      if (not compat.is_literal(ov) and ov in region_out and iv in region_in
          and iv not in outside_reads
          and not any(w is iv for w in jaxpr.outvars if not compat.is_literal(w))):
        pairs[region_out[ov]] = region_in[iv]
        how[region_in[iv]] = match.how[i]
    in_names = [paths[in_pos[v]] if v in in_pos else _produced_by(jaxpr, v)
                for v in region.invars]
    out_paths = ["output" + jax.tree_util.keystr(p)
                 for p, _ in jax.tree_util.tree_flatten_with_path(out_shape)[0]]
    out_names = [next(out_paths[k] for k, w in enumerate(jaxpr.outvars) if w is v)
                 for v in region.outvars]
    step = ShardedStep(
        _region_fn(jaxpr, region, axes), mesh=mesh, in_specs=region.in_specs,
        out_specs=(P(),) * len(region.outvars), check_vma=False, axis_names=frozenset(),
        axis_name=axes, split_reason="split over the batch axes",
        match_state=lambda a, o: StateMatch(dict(pairs), dict(how)),
        names=(in_names, out_names), **self._options)
    region_args = tuple(jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype,
                                             sharding=NamedSharding(mesh, s))
                        for v, s in zip(region.invars, region.in_specs, strict=True))
    _, sub = step._program(region_args)
    # Region input / output positions -> the step's flat leaves.
    state_in = {in_pos[region.invars[k]]: (fmt, P()) for k, (fmt, _) in sub.state_in.items()}
    state_out = {o: sub.plan.state_outputs[region_out[v]] for o, v in enumerate(jaxpr.outvars)
                 if not compat.is_literal(v) and v in region_out
                 and region_out[v] in sub.plan.state_outputs}
    plan = _named_plan(sub.plan, in_names)
    donated = tuple(k for k, info in enumerate(jax.tree.leaves(traced.args_info))
                    if getattr(info, "donated", False))
    shard = NamedSharding(mesh, programs.shard_spec(sub.plan.axes))
    in_shardings = tuple(shard if k in state_in else d or _placement(x, mesh) for k, (x, d) in
                         enumerate(zip(jax.tree.leaves(dyn, is_leaf=is_sharded), declared,
                                       strict=True)))
    wanted = _declared(self._jit_kwargs.get("out_shardings"), out_shape,
                       jax.tree.leaves(out_shape))
    out_shardings = tuple(shard if k in state_out else _named(s, mesh)
                          for k, s in enumerate(wanted))
    run = jax.jit(functools.partial(_run, flat, region, sub), donate_argnums=donated,
                  in_shardings=in_shardings, out_shardings=out_shardings)
    return _Compiled(plan, run, state_in, state_out, tuple(paths), traced.out_tree, sub.mesh,
                     tuple(sub.plan.axes), in_shardings)


def _run(flat, region: global_view.Region, sub, *ops):
  """The step: the forward and backward pass as traced, then the region's sharded step."""
  jaxpr = flat.jaxpr
  env = dict(zip(jaxpr.constvars, flat.consts, strict=True))
  env.update(zip(jaxpr.invars, ops, strict=True))

  def read(v):
    return v.val if compat.is_literal(v) else env[v]
  inside = set(region.eqns)
  for i, eqn in enumerate(jaxpr.eqns):
    if i not in inside:
      env.update(zip(eqn.outvars, compat.bind(eqn, *[read(v) for v in eqn.invars]),
                     strict=True))
  region_ops = [read(region.invars[s[1]]) if s[0] == "arg" else s[1] for s in sub.sources]
  env.update(zip(region.outvars, sub.step(*region_ops), strict=True))
  return tuple(read(v) for v in jaxpr.outvars)


def _region_fn(jaxpr, region: global_view.Region, axes: tuple) -> Callable[..., list]:
  """The region as one replica's program: each sum on its rows, then all-reduced."""
  def fn(*ins):
    env = dict(zip(region.invars, ins, strict=True))

    def read(v):
      return compat.retyped(v.val) if compat.is_literal(v) else env[v]
    for i in region.eqns:
      eqn = jaxpr.eqns[i]
      outs = inline.eval_eqn(eqn, [read(v) for v in eqn.invars], rename={})
      if i in region.moved or i in region.sums:
        with compat.source_of(compat.in_current_mesh(eqn)):
          outs = (lax.optimization_barrier(outs) if i in region.moved
                  else [lax.psum(x, axes) for x in outs])
      env.update(zip(eqn.outvars, outs, strict=True))
    return tuple(read(v) for v in region.outvars)
  return fn


def _produced_by(jaxpr, v) -> str:
  """A name for a value of the forward or backward pass the region reads."""
  eqn = next(e for e in jaxpr.eqns if v in e.outvars)
  return f"<{eqn.primitive} at {compat.source_line(eqn)}>"


def _arg_paths(fun: Callable, args: tuple, dyn: tuple, static: frozenset) -> list[str]:
  """Each dynamic leaf's path under its parameter's name (`opt_state[0].mu['w']`)."""
  try:
    params = [p.name for p in inspect.signature(fun).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
  except (TypeError, ValueError):
    params = []
  dyn_pos = [i for i in range(len(args)) if i not in static]
  out = []
  for path, _ in jax.tree_util.tree_flatten_with_path(dyn, is_leaf=is_sharded)[0]:
    kind, key, rest = path[0].idx, path[1], jax.tree_util.keystr(path[2:])
    if kind == 1:  # A keyword argument.
      out.append(f"{key.key}{rest}")
    else:
      i = dyn_pos[key.idx]
      out.append(f"{params[i] if i < len(params) else f'args[{i}]'}{rest}")
  return out


def _named_plan(plan: Plan, names: list[str]) -> Plan:
  return plan


def _unchanged_plan(jaxpr, paths: list[str], axes: tuple, mesh, reason: str) -> Plan:
  """The Plan of a step wus runs unchanged, every input whole for `reason`."""
  inputs = tuple(InputPlan(name, tuple(v.aval.shape), str(v.aval.dtype), False, reason)
                 for name, v in zip(paths, jaxpr.invars, strict=True))
  n = math.prod(mesh.shape[a] for a in axes) if mesh is not None and axes else 1
  return Plan(tuple(axes), n, 0, inputs, (), Program({}, {}, {}), unchanged=reason)


# --- Arguments. ------------------------------------------------------------------


def _static(fun: Callable, jit_kwargs: dict) -> tuple[frozenset, frozenset]:
  """The static argument positions and names, inferred from each other as `jax.jit` does."""
  return compat.static_args(fun, jit_kwargs.get("static_argnums"),
                            jit_kwargs.get("static_argnames"))


def _dyn_structure(args: tuple, kwargs: dict, static_nums: frozenset, static_names: frozenset):
  """The tree structure of the dynamic arguments, `(args, kwargs)` as `jax.jit` flattens them."""
  return jax.tree.structure(
      (tuple(x for i, x in enumerate(args) if i not in static_nums),
       {k: v for k, v in kwargs.items() if k not in static_names}), is_leaf=is_sharded)


def _signature(x) -> tuple:
  """The cache key of one leaf: logical shape, dtype, weak type, and the mesh axes it is
  split over (sharded state keys as the whole value it stands for)."""
  if is_sharded(x):
    return (x.shape, x.dtype, False, _split(x.spec))
  if isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct)):
    sharding = getattr(x, "sharding", None)
    split = _split(sharding.spec) if isinstance(sharding, NamedSharding) else None
    return (tuple(x.shape), x.dtype, bool(getattr(x, "weak_type", False)), split)
  return (type(x), ())


def _split(spec: P) -> tuple | None:
  """A PartitionSpec without trailing Nones; None when it splits nothing."""
  entries = list(spec)
  while entries and entries[-1] is None:
    entries.pop()
  return tuple(entries) or None


def _declared(shardings: Any, tree: Any, leaves: list) -> list:
  """Per leaf of `tree`, the sharding `in_shardings` / `out_shardings` (a pytree prefix, or
  one for all) gives it; None where it gives none."""
  if shardings is None:
    return [None] * len(leaves)
  def is_leaf(x):
    return x is None or isinstance(x, (jax.sharding.Sharding, P))
  if is_leaf(shardings):
    return [shardings] * len(leaves)
  return jax.tree.leaves(jax.tree.broadcast(shardings, tree, is_leaf=is_leaf),
                         is_leaf=lambda x: x is None or is_leaf(x))


def _named(sharding, mesh: Mesh | None):
  """A PartitionSpec as a NamedSharding on `mesh` (other shardings as they are)."""
  if isinstance(sharding, P) and mesh is not None:
    return NamedSharding(mesh, sharding)
  return sharding


def _placement(x, mesh: Mesh) -> NamedSharding:
  """Where the program takes a whole leaf: as placed on the mesh, else replicated."""
  sharding = getattr(x, "sharding", None)
  if isinstance(sharding, NamedSharding) and sharding.mesh == mesh and not is_sharded(x):
    return sharding
  return NamedSharding(mesh, P())


def _mesh_of(leaves: list, declared: list) -> Mesh | None:
  """The mesh of the arguments (of the largest NamedSharding, `in_shardings` included), or
  the one set with `jax.set_mesh`; None for a single device."""
  shardings = [getattr(x, "sharding", None) for x in leaves if not is_sharded(x)] + declared
  meshes = [x.mesh for x in leaves if is_sharded(x)]
  meshes += [s.mesh for s in shardings if isinstance(s, NamedSharding)]
  meshes = [m for m in meshes if isinstance(m, Mesh) and m.size > 1]
  if meshes:
    return max(meshes, key=lambda m: m.size)
  current = jax.sharding.get_mesh()
  return None if current.empty or current.size == 1 else current


def _batch_axes(leaves: list, declared: list, mesh: Mesh | None) -> tuple:
  """The mesh axes some argument is split over (the batch axes), in mesh order."""
  if mesh is None:
    return ()
  used = set()
  for x, d in zip(leaves, declared, strict=True):
    sharding = d or getattr(x, "sharding", None)
    if not is_sharded(x) and isinstance(sharding, NamedSharding) and sharding.mesh == mesh:
      for e in sharding.spec:
        used.update(() if e is None else e if isinstance(e, tuple) else (e,))
  return tuple(a for a in mesh.axis_names if a in used)


def _abstract(x, mesh: Mesh | None):
  """A leaf as traced: sharded state as the whole value it stands for."""
  if is_sharded(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(x.mesh, x.spec))
  return x


def _larger(x, sharding, axes: tuple):
  """`x` with every dim `sharding` splits over `axes` twice as large (`splits_from_sizes`)."""
  if not isinstance(sharding, NamedSharding):
    return x
  shape = list(np.shape(x))
  for d, e in enumerate(sharding.spec):
    names = () if e is None else e if isinstance(e, tuple) else (e,)
    if set(names) & set(axes):
      shape[d] *= 2
  if shape == list(np.shape(x)):
    return x
  return jax.ShapeDtypeStruct(tuple(shape), x.dtype, sharding=sharding,
                              weak_type=bool(getattr(x, "weak_type", False)))


def _flat(closed, mesh: Mesh):
  """The traced jaxpr with its calls inlined and dead code dropped."""
  avals = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type,
                                sharding=_sharding_of(a, mesh)) for a in closed.in_avals]
  flat = jax.make_jaxpr(inline.inlined(closed))(*avals)
  return compat.ClosedJaxpr(compat.dce(flat.jaxpr), flat.consts)


def _sharding_of(aval, mesh: Mesh):
  spec, _ = compat.sharding_spec(aval)
  return NamedSharding(mesh, P(*spec)) if spec and compat.explicit_axes(mesh) else None


# --- Equinox-style steps. ----------------------------------------------------------


def filter_jit(fun: Callable | None = None, /, *, donate: str = "none", **options
               ) -> Callable:
  """`wus.jit` for steps that take and return non-array leaves, as `equinox.filter_jit`.

  Every JAX or NumPy array (and sharded state) among the arguments is traced;
  every other leaf (an Equinox module's activation function, a Python float)
  is static, part of the cache key. Outputs may hold non-array leaves too.
  The one-line change for an Equinox step: `@eqx.filter_jit` becomes
  `@wus.filter_jit`.

  Args:
    fun: the step.
    donate: "none" or "all" (every array argument donated), as for
      `equinox.filter_jit`; "all-except-first" and "warn" are not supported.
    **options: as for `wus.jit` (`min_shard_size`, `objective`, `topology`).

  Returns:
    The step, called like `fun`.

  Raises:
    ValueError: another `donate`.
    TypeError: at call time, a static leaf that is not hashable.
  """
  if donate not in ("none", "all"):
    raise ValueError(f"filter_jit(donate={donate!r}): pass 'none' or 'all'")

  def make(f: Callable) -> Callable:
    outs: dict = {}  # Static key -> the outputs' structure and static leaves, from tracing.

    def inner(static, *args, **kwargs):
      treedef, static_leaves = static.value
      leaves = [s if a is None else a for a, s in
                zip(treedef.flatten_up_to((args, kwargs)), static_leaves, strict=True)]
      call_args, call_kwargs = jax.tree.unflatten(treedef, leaves)
      out = f(*call_args, **call_kwargs)
      out_leaves, out_def = jax.tree.flatten(out, is_leaf=is_sharded)
      keep = [_is_array(x) for x in out_leaves]
      outs[static] = (out_def, [None if k else x for x, k in zip(out_leaves, keep, strict=True)])
      return jax.tree.unflatten(out_def, [x if k else None for x, k in
                                          zip(out_leaves, keep, strict=True)])

    steps: dict[int, JitStep] = {}  # By the number of positional arguments (donation).

    def step_for(num_args: int) -> JitStep:
      if num_args not in steps:
        donated = tuple(range(1, num_args + 1)) if donate == "all" else None
        steps[num_args] = jit(inner, static_argnums=0, donate_argnums=donated, **options)
      return steps[num_args]

    @functools.wraps(f)
    def wrapped(*args, **kwargs):
      (args, kwargs), static = _filtered(args, kwargs)
      result = step_for(len(args))(static, *args, **kwargs)
      out_def, static_out = outs[static]
      return jax.tree.unflatten(out_def, [s if x is None else x for x, s in
                                          zip(out_def.flatten_up_to(result), static_out,
                                              strict=True)])

    def plan(*args, **kwargs) -> Plan:
      (args, kwargs), static = _filtered(args, kwargs)
      return step_for(len(args)).plan(static, *args, **kwargs)
    wrapped.plan = plan
    return wrapped
  return make if fun is None else make(fun)


def _is_array(x) -> bool:
  return is_sharded(x) or isinstance(x, (jax.Array, np.ndarray, np.generic))


def _filtered(args, kwargs) -> tuple:
  leaves, treedef = jax.tree.flatten((args, kwargs), is_leaf=is_sharded)
  keep = [_is_array(x) for x in leaves]
  arrays = [x if k else None for x, k in zip(leaves, keep, strict=True)]
  static = tuple(None if k else x for x, k in zip(leaves, keep, strict=True))
  return jax.tree.unflatten(treedef, arrays), _Static((treedef, static))


class _Static:
  """Static leaves, hashed by value (by identity where they are not hashable)."""

  def __init__(self, value):
    self.value = value
    try:
      self._key = hash(value)
    except TypeError:
      self._key = None

  def __hash__(self):
    return self._key if self._key is not None else id(self.value)

  def __eq__(self, other):
    if not isinstance(other, _Static):
      return False
    if self._key is None or other._key is None:
      return self.value is other.value
    return self._key == other._key and self.value == other.value
