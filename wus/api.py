"""`wus.shard_map`: a data-parallel step with its weight update sharded (DESIGN.md §1)."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import inspect
import math
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from wus import collectives
from wus.analysis import clusters, compat, cost, costmodel, redundancy
from wus.analysis.compat import ClosedJaxpr
from wus.analysis.plan import Plan, replicated as replicated_plan
from wus.analysis.planner import make_plan
from wus.errors import StateMismatchError
from wus.sharded import ShardedArray, check_alive, is_sharded, unshard
from wus.transforms import gc_pause, groups, inline, programs


def shard_map(f: Callable | None = None, /, *, out_specs: Any, in_specs: Any = compat.INFER,
              mesh: Mesh | None = None,
              check_vma: bool = True, axis_names: frozenset = frozenset(),
              axis_name: str | Sequence[str] | None = None,
              min_shard_size: int = 0,
              shard_group_size: int | str | None = None,
              objective: str = "memory",
              topology: costmodel.Topology | None = None,
              shard_weights: bool = False,
              donate_argnums: int | Sequence[int] = (),
              donate_argnames: str | Sequence[str] = ()
              ) -> ShardedStep | Callable[[Callable], ShardedStep]:
  """Like `jax.shard_map`, with the weight update sharded across replicas.

  Swap `jax.shard_map` for `wus.shard_map`; nothing else changes. The step is
  traced to a jaxpr, the computation every replica repeats after the gradient
  all-reduce is found (§3), and a rewritten step is compiled in which each
  replica reduce-scatters the gradients, updates its 1/N shard of every weight
  and optimizer-state tensor, and all-gathers the new weights (§4). Optimizer
  state comes back as `wus.ShardedArray` leaves, to pass straight to the next
  call; `wus.unshard` gives whole arrays.

  Args:
    f: the per-replica step, as for `jax.shard_map`.
    out_specs, in_specs, mesh, check_vma, axis_names: as for `jax.shard_map`
      (in_specs inferred from the arguments' shardings when not given; mesh
      from `jax.set_mesh` when not given).
    axis_name: the data-parallel mesh axis (or axes) to shard the update over.
      Default: the axes of the gradient all-reduces (the all-reduces whose
      operands have the shape of a state input, most bytes first), which on a
      1-D mesh is its one axis; every manual axis if the step has none.
    min_shard_size: tensors with fewer elements stay replicated (tensors with
      at most as many elements as replicas always do).
    shard_group_size: G, to shard within groups of G consecutive replicas of
      the data-parallel axis (N = M x G replicas; partial sharding, §5.2,
      Fig. 10): each group reduce-scatters the gradients, the shards are
      all-reduced across the M groups (batched), each replica updates 1/G of
      every tensor and keeps 1/G of the optimizer state, and the group
      all-gathers the weights. Groups are consecutive devices of the axis,
      so in multi-process runs a group can stay inside a process. The step
      is written as before (collectives and `axis_index` over the axis).
      None or N: one group (plain sharding); 1: nothing sharded; "auto": the
      G the cost model predicts fastest on `topology` (§5.2; the Plan's
      `groups` line gives the prediction).
    objective: what a cluster's decision favours when sharding it costs more
      all-gather than the all-reduce it replaces (§3.2): "memory" (default)
      shards it for the optimizer state it keeps sharded; "time" shards it
      only where the cost model predicts its collectives and update are no
      slower than replicated. The Plan prints the prediction either way.
    topology: the devices the update is sharded over, for the cost model: a
      `wus.analysis.costmodel.Topology` of N devices (mesh axes fast to slow,
      latency, bandwidth, memory bandwidth). Default:
      `costmodel.default_topology` with one process's devices as the fast axis.
    shard_weights: also keep sharded between calls the weights the forward
      pass reads only in a narrower float (mixed precision): the step returns
      them as `wus.ShardedArray`s, like optimizer state, and all-gathers them
      in that float at their first read in the next call (Fig. 4 right,
      Fig. 7, §4.2), a 16-bit gather where the all-reduce moved 32 bits. Off
      by default: code other than the step must `wus.unshard` such params
      (which gives the whole float32 weights).
    donate_argnums: positional arguments whose buffers the step may reuse for
      its outputs, as for `jax.jit(jax.shard_map(f, ...), donate_argnums=...)`:
      a donated argument (sharded state included) must not be used after the
      call (passing it again raises ValueError). Whole state that the call
      shards first is not donated itself.
    donate_argnames: the same by parameter name of `f`, as for `jax.jit`.

  Returns:
    A `ShardedStep`: call it like the jit-compiled `jax.shard_map(f, ...)`.
    Used as a decorator without `f`, a function that makes one.

  Raises:
    ValueError: `shard_group_size` is not a positive int, or `objective` is
      not "memory" or "time" (when called: a group size that does not divide
      the axis size, several sharding axes, or a topology of another number
      of devices than the update is sharded over).

  Example:
    >>> step = wus.shard_map(train_step, mesh=mesh,  # doctest: +SKIP
    ...     in_specs=(P(), P(), P("data")), out_specs=(P(), P(), P()))
    >>> params, opt_state, metrics = step(params, opt_state, batch)  # doctest: +SKIP

    Sharding within groups of 4 of the 8 replicas (state 1/4 per device):

    >>> step = wus.shard_map(train_step, mesh=mesh, shard_group_size=4,  # doctest: +SKIP
    ...     in_specs=(P(), P(), P("data")), out_specs=(P(), P(), P()))
  """
  groups.check_group_size(shard_group_size)
  check_objective(objective)

  def make(f: Callable) -> ShardedStep:
    return ShardedStep(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma,
                       axis_names=frozenset(axis_names), axis_name=axis_name,
                       min_shard_size=min_shard_size, shard_group_size=shard_group_size,
                       objective=objective, topology=topology, shard_weights=shard_weights,
                       donate_argnums=donated_positions(f, donate_argnums, donate_argnames))
  return make if f is None else make(f)


def donated_positions(f: Callable, argnums: int | Sequence[int],
                      argnames: str | Sequence[str]) -> frozenset:
  """Positions of `f`'s donated parameters, from numbers and names (as `jax.jit`).

  Raises:
    ValueError: a name that is not a positional parameter of `f`.
  """
  names = [argnames] if isinstance(argnames, str) else list(argnames)
  out = set(_argnums(argnums))
  if names:
    params = [p.name for p in inspect.signature(f).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    for name in names:
      if name not in params:
        raise ValueError(f"donate_argnames: {name!r} is not a positional parameter of "
                         f"{getattr(f, '__name__', f)} (its parameters: {params})")
      out.add(params.index(name))
  return frozenset(out)


@dataclasses.dataclass(frozen=True)
class _Program:
  """Everything compiled for one input signature."""

  plan: Plan
  step: Callable[..., tuple]
  sources: tuple        # Per step operand: ("arg", leaf index) or ("const", value).
  state_in: dict        # Arg leaf index -> (ShardFormat, whole-value spec), inputs passed sharded.
  in_names: tuple[str, ...]
  out_specs: tuple      # Per flat output: its PartitionSpec in the user's program.
  out_replicated: tuple  # Per flat output: identical on every replica of the plan's axes.
  out_tree: Any
  mesh: Mesh            # The mesh the programs run on (derived with shard_group_size).
  user_mesh: Mesh       # The user's mesh: whole values enter and leave on it.
  timings: dict         # Seconds: "trace", "analysis" (inline, plan); "rewrite" once lowered.


class ShardedStep:
  """A data-parallel step whose weight update runs on shards (from `wus.shard_map`)."""

  def __init__(self, f: Callable, *, mesh: Mesh | None, in_specs: Any, out_specs: Any,
               check_vma: bool, axis_names: frozenset, axis_name, min_shard_size: int,
               shard_group_size: int | None = None,
               objective: str = "memory", topology: costmodel.Topology | None = None,
               shard_weights: bool = False, donate_argnums: frozenset = frozenset(),
               split_reason: str = "its in_spec splits it", signature: Signature | None = None,
               match_state: Callable[[tuple, Any], StateMatch] | None = None,
               names: tuple[Sequence[str], Sequence[str]] | None = None):
    self._f = f
    self._signature = Signature.of(f) if signature is None else signature
    self._mesh = mesh  # None: the mesh set with jax.set_mesh at call time.
    self._in_specs, self._out_specs = in_specs, out_specs
    self._check_vma = check_vma
    self._axis_names = axis_names
    self._axis_name = axis_name
    self._min_size = min_shard_size
    groups.check_group_size(shard_group_size)
    self._group_size = (shard_group_size if shard_group_size in (None, "auto")
                        else int(shard_group_size))
    check_objective(objective)
    self._objective, self._topology = objective, topology
    self._shard_weights = bool(shard_weights)
    self._donate_argnums = frozenset(donate_argnums)
    self._split_reason = split_reason
    # A front end that knows its state pairs and names (wus.jit's region) passes them.
    self._match_state = match_state
    self._names = names
    self._cache: dict = {}
    self._warned = False  # Warned once that a call runs as plain jax.shard_map.
    functools.update_wrapper(self, f)

  # --- Public. ---------------------------------------------------------------

  def __call__(self, *args):
    return self.call(args)[0]

  def call(self, args: tuple, replicated: frozenset = frozenset()) -> tuple[Any, list[bool]]:
    """Runs the step; also says which flat outputs are identical on every replica.

    Args:
      args: the positional arguments.
      replicated: flat leaf positions (`jax.tree.leaves(args, is_leaf=
        wus.sharded.is_sharded)`) whose values are identical on every replica
        although their in_spec splits them (the paper's annotated parameters,
        §3.1: `wus.pmap`'s equal per-device copies).

    Returns:
      (the outputs, a bool per flat output leaf).
    """
    if (why := self._inside_transform(args)) is not None:
      return self._as_jax_shard_map(args, why)
    leaves, prog = self._program(args, replicated)
    outs = prog.step(*self._operands(leaves, prog))
    wrapped = [ShardedArray(x, prog.plan.state_outputs[k], prog.plan.axes, prog.out_specs[k],
                            prog.mesh)
               if k in prog.plan.state_outputs else x for k, x in enumerate(outs)]
    return jax.tree.unflatten(prog.out_tree, wrapped), list(prog.out_replicated)

  def _inside_transform(self, args: tuple) -> str | None:
    """Why this call runs as plain `jax.shard_map`: it is inside `jax.grad`, `jax.vmap` or
    another transformation (its arguments are their tracers), or inside `jax.jit` with
    the mesh to come from `jax.set_mesh`; None otherwise."""
    leaves = [x.data if is_sharded(x) else x for x in jax.tree.leaves(args, is_leaf=is_sharded)]
    if any(isinstance(x, jax.core.Tracer) and not compat.is_staging_tracer(x) for x in leaves):
      return "inside jax.grad, jax.vmap or another transformation of a function that calls it"
    if self._mesh is None and any(isinstance(x, jax.core.Tracer) for x in leaves):
      return "inside jax.jit with the mesh from jax.set_mesh"
    return None

  def _as_jax_shard_map(self, args: tuple, why: str) -> tuple[Any, list[bool]]:
    """The call as `jax.shard_map` makes it: there is no weight update inside to shard
    (the update, if any, is outside the mapped function)."""
    if not self._warned:
      self._warned = True
      warnings.warn(
          f"wus.shard_map({getattr(self._f, '__name__', self._f)}) called {why}: it runs as "
          "jax.shard_map, with nothing sharded. To shard the weight update of a jax.jit "
          "training step, use wus.jit on the step.", stacklevel=4)
    smap = jax.shard_map(self._f, mesh=self._mesh, in_specs=self._in_specs,
                         out_specs=self._out_specs, check_vma=self._check_vma,
                         axis_names=self._axis_names)
    out = smap(*unshard(args))
    return out, [False] * len(jax.tree.leaves(out))

  def plan(self, *args, replicated: frozenset = frozenset()) -> Plan:
    """The Plan for these arguments (whole or sharded state alike).

    Raises:
      TypeError: no arguments (the plan is made for the arguments' shapes and dtypes).
    """
    needs_arguments(args, "plan")
    return self._program(args, replicated)[1].plan

  def state_target(self, *args, replicated: frozenset = frozenset()) -> tuple:
    """The arguments as this step reads them, abstract: the target to restore a checkpoint into.

    Pass the parts you saved to Orbax's restore (`ocp.StandardCheckpointer().
    restore(path, target)`, `ocp.args.StandardRestore(target)`): it returns state
    this step accepts as it is, the state it keeps sharded as `wus.ShardedArray`s
    in this step's format, for its mesh and replica count (a checkpoint saved at
    another replica count, or with whole arrays by plain `jax.shard_map` code,
    restores the same way). Each process reads only what its devices hold.

    Args:
      args: the step's arguments, concrete or abstract (`jax.eval_shape`), whole
        or sharded.
      replicated: as for `call`.

    Returns:
      A tuple like `args`, in the same pytree structures (NamedTuples of optax
      states included): `jax.ShapeDtypeStruct`s with the step's shardings for
      what it reads whole, `wus.checkpoint.LogicalView`s (of the logical shapes)
      for what it keeps sharded.

    Example:
      >>> params, opt_state, _ = step.state_target(params, opt_state, batch)  # doctest: +SKIP
      >>> ckptr = ocp.StandardCheckpointer()  # doctest: +SKIP
      >>> params, opt_state = ckptr.restore(path, (params, opt_state))  # doctest: +SKIP
    """
    from wus import checkpoint  # noqa: PLC0415 -- imports Orbax only when checkpoints are used
    leaves, prog = self._program(args, replicated)
    mesh = prog.user_mesh
    if self._in_specs is compat.INFER:
      specs = [_user_spec(x) if is_sharded(x) else x.sharding.spec for x in leaves]
    else:
      specs = jax.tree.leaves(jax.tree.broadcast(self._in_specs, args, is_leaf=is_sharded))
    out = []
    for k, (x, spec) in enumerate(zip(leaves, specs, strict=True)):
      if k in prog.state_in:
        fmt, spec = prog.state_in[k]
        out.append(checkpoint.restore_target(fmt, prog.plan.axes, spec, prog.mesh, x.dtype))
      else:
        out.append(jax.ShapeDtypeStruct(np.shape(x), _aval(x)[1],
                                        sharding=NamedSharding(mesh, spec),
                                        weak_type=bool(getattr(x, "weak_type", False))))
    return tuple(jax.tree.unflatten(jax.tree.structure(args, is_leaf=is_sharded), out))

  def timings(self, *args) -> dict[str, float]:
    """Seconds wus spends on these arguments' program, beside XLA's compile time.

    Returns:
      {"trace": tracing `f` to a jaxpr, as `jax.jit` does too; "analysis":
      inlining calls, the redundancy analysis and the Plan; "rewrite": the
      rewrite interpreter emitting the sharded step, present once the step
      has been called or lowered}.
    """
    return dict(self._program(args)[1].timings)

  def lower(self, *args, replicated: frozenset = frozenset()) -> jax.stages.Lowered:
    """Lowers the steady-state step program (optimizer state already sharded).

    Returns:
      A `jax.stages.Lowered`; `.compile().memory_analysis()` gives per-device
      bytes, `.compile().as_text()` the optimized HLO.
    """
    leaves, prog = self._program(args, replicated)
    spec = NamedSharding(prog.mesh, programs.shard_spec(prog.plan.axes))
    ops = []
    for src in prog.sources:
      if src[0] == "arg" and src[1] in prog.state_in:
        fmt = prog.state_in[src[1]][0]
        ops.append(jax.ShapeDtypeStruct(fmt.padded_shape, leaves[src[1]].dtype, sharding=spec))
      else:
        ops.append(src[1] if src[0] == "const" else leaves[src[1]])
    return prog.step.lower(*ops)

  # --- Runtime. --------------------------------------------------------------

  @staticmethod
  def _operands(leaves: list, prog: _Program) -> list:
    """The step's operands: sharded state checked, whole state sharded (§4.2).

    Sharded state this step's plan holds another way (the step's signature
    changed between calls, so its plan did) is gathered and re-sharded on the
    same mesh, each conversion one program.

    Raises:
      ValueError: an argument's buffer was donated to an earlier call.
      StateMismatchError: sharded state made for another mesh.
    """
    ops: list = []
    expected = NamedSharding(prog.mesh, programs.shard_spec(prog.plan.axes))
    whole_state = []  # (operand position, leaf, format, spec): sharded by one program.
    regather = []     # (operand position, sharded leaf): gathered first.
    for src in prog.sources:
      if src[0] == "const":
        ops.append(src[1])
        continue
      k = src[1]
      x, (fmt, spec) = leaves[k], prog.state_in.get(k, (None, None))
      check_alive(x, prog.in_names[k])
      if is_sharded(x) and _fits(x, fmt, spec, prog.plan.axes, expected, prog.in_names[k]):
        ops.append(x.data)
      elif is_sharded(x):
        regather.append((len(ops), x))
        ops.append(None)
      elif fmt is not None:
        whole_state.append((len(ops), x, fmt, spec))
        ops.append(None)
      else:
        ops.append(x)
    if regather:
      pos, xs = zip(*regather, strict=True)
      for p, x in zip(pos, unshard(list(xs)), strict=True):
        fmt, spec = prog.state_in.get(prog.sources[p][1], (None, None))
        if fmt is None:
          ops[p] = x
        else:
          whole_state.append((p, x, fmt, spec))
    if whole_state:
      pos, xs, fmts, specs = zip(*whole_state, strict=True)
      shards = programs.shard_program(fmts, prog.mesh, prog.plan.axes, specs)(*xs)
      for p, x in zip(pos, shards, strict=True):
        ops[p] = x
    return ops

  def _program(self, args: tuple, replicated: frozenset = frozenset()) -> tuple[list, _Program]:
    leaves, treedef = jax.tree.flatten(args, is_leaf=is_sharded)
    mesh = self._mesh if self._mesh is not None else jax.sharding.get_mesh()
    if mesh.empty:
      raise ValueError("wus.shard_map needs a mesh: pass mesh=, or call it inside "
                       "`with jax.set_mesh(mesh):`")
    key = (treedef, tuple(_signature(x) for x in leaves), frozenset(replicated), mesh)
    if key not in self._cache:
      with gc_pause.paused():
        build = functools.partial(self._build, args, leaves, treedef, frozenset(replicated), mesh)
        if self._group_size != "auto":
          self._cache[key] = build(self._group_size)
        else:
          whole = build(None)
          g, why = cost.auto_group_size(whole.plan, self._topology_for(
              whole.mesh, whole.plan.axes, whole.plan.num_shards))
          prog = whole if g is None else build(g)
          self._cache[key] = dataclasses.replace(prog, plan=dataclasses.replace(
              prog.plan, groups="; ".join(filter(None, [why, prog.plan.groups]))))
    return leaves, self._cache[key]

  def _build(self, args: tuple, leaves: list, treedef, replicated: frozenset,
             mesh: Mesh, group_size: int | None) -> _Program:
    start = time.perf_counter()
    # 1. Trace the user's step exactly as jax.shard_map would.
    traced = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, _user_spec(x)))
              if is_sharded(x) else x for x in leaves]
    smap = jax.shard_map(self._f, mesh=mesh, in_specs=self._in_specs,
                         out_specs=self._out_specs, check_vma=self._check_vma,
                         axis_names=self._axis_names)
    outer, out_shape = jax.make_jaxpr(smap, return_shape=True)(*jax.tree.unflatten(treedef, traced))
    eqn = compat.shard_map_eqn(outer)
    body, _, in_specs, out_specs, manual, check_vma = compat.shard_map_params(eqn)
    if list(outer.jaxpr.outvars) != list(eqn.outvars):
      raise NotImplementedError("wus.shard_map expects f's outputs to come from shard_map")
    arg_pos = {v: k for k, v in enumerate(outer.jaxpr.invars)}
    const_val = dict(zip(outer.jaxpr.constvars, outer.consts, strict=True))
    sources = tuple(("arg", arg_pos[v]) if v in arg_pos else ("const", const_val[v])
                    for v in eqn.invars)
    operand_avals = [traced[s[1]] if s[0] == "arg" else s[1] for s in sources]
    body_pos = {s[1]: k for k, s in enumerate(sources) if s[0] == "arg"}
    match = (self._match_state(args, out_shape) if self._match_state is not None
             else _match_state(args, out_shape, self._signature))
    pairs = {o: body_pos[i] for o, i in match.pairs.items() if i in body_pos}
    out_leaves, out_tree = jax.tree.flatten(out_shape)
    out_names = [jax.tree_util.keystr(p)
                 for p, _ in jax.tree_util.tree_flatten_with_path(out_shape)[0]]
    if self._names is not None:
      out_names = list(self._names[1])
    # What the Plan says of each input's next value (the state matching).
    matched = {body_pos[i]: why for i, why in match.how.items() if i in body_pos}
    matched.update({body_pos[i]: f"next value {out_names[o]} (by {match.how[i]})"
                    for o, i in match.pairs.items() if i in body_pos})
    user_mesh, home, rename, grouping, whole_reason = mesh, None, None, "", None
    if group_size is not None:
      axes = self._replica_axes(mesh, manual, body, [body.invars[i] for i in pairs.values()])
      home, grouping, whole_reason = self._groups(mesh, axes, group_size)
    if home is not None:
      # 1b. The programs run on the mesh derived for the groups; the step is
      # renamed onto it while it is inlined (transforms/groups.py).
      mesh, rename = home.derived, home.rename
      in_specs = tuple(home.derived_spec(p) for p in in_specs)
      out_specs = tuple(home.derived_spec(p) for p in out_specs)
      manual = (manual - {home.axis}) | {home.outer, home.inner}
      operand_avals = [jax.ShapeDtypeStruct(np.shape(x), _aval(x)[1],
                                            sharding=NamedSharding(mesh, p),
                                            weak_type=bool(getattr(x, "weak_type", False)))
                       for x, p in zip(operand_avals, in_specs, strict=True)]
      axes = (home.inner,)

    traced_at = time.perf_counter()
    # 2. Inline calls and retrace, then drop dead code (as jax.jit does before
    # lowering): the analysis works on one flat jaxpr, and an unused read of
    # optimizer state does not keep it whole.
    with groups.on(mesh) if home is not None else contextlib.nullcontext():
      flat_outer = jax.make_jaxpr(jax.shard_map(
          lambda *a: tuple(inline.inlined(ClosedJaxpr(body, ()), rename)(*a)), mesh=mesh,
          in_specs=tuple(in_specs), out_specs=tuple(out_specs), check_vma=check_vma,
          axis_names=manual))(*operand_avals)
    flat = compat.dce(compat.shard_map_params(compat.shard_map_eqn(flat_outer))[0])
    if group_size is None:
      axes = self._replica_axes(mesh, manual, flat, [flat.invars[i] for i in pairs.values()])
    # State split over other mesh axes too (tensor parallelism) stays whole
    # between steps: sharded state is laid out over the replica axes only. Its
    # update still runs on shards of this device's block.
    replica = set(axes) | ({home.outer} if home is not None else set())
    split_state = {}
    for o, i in list(pairs.items()):
      if other := (_spec_axes(in_specs[i]) | _spec_axes(out_specs[o])) - replica:
        split_state[i] = (f"state split over {sorted(other)} by its in_spec or out_spec: kept "
                          f"whole between steps (sharded state is laid out over {list(axes)} "
                          "only)")
        del pairs[o]

    # 3. Analyse and plan.
    arg_of_leaf = [a for a, arg in enumerate(args)
                   for _ in jax.tree.leaves(arg, is_leaf=is_sharded)]
    in_rep = [frozenset(manual) if s[0] == "arg" and s[1] in replicated
              else manual - _spec_axes(spec) for spec, s in zip(in_specs, sources, strict=True)]
    facts = redundancy.analyze(flat, in_rep, manual)
    names = argument_paths(self._f, args, self._signature.keywords)
    if self._names is not None:
      names = list(self._names[0])
    in_names = [names[s[1]] if s[0] == "arg" else "<constant>" for s in sources]
    num_shards = math.prod(mesh.shape[a] for a in axes)
    plan = make_plan(flat, facts, axes=axes, num_shards=num_shards,
                     in_names=in_names, out_names=out_names, state_pairs=pairs,
                     state_whole=split_state, matched=matched,
                     min_size=self._min_size, split_reason=self._split_reason,
                     objective=self._objective, shard_weights=self._shard_weights,
                     topology=self._topology_for(mesh, axes, num_shards))
    if whole_reason is not None:
      plan = replicated_plan(plan, whole_reason)
    if group_size is not None:
      across = _across_groups(plan) if home is not None else 0
      if across:
        grouping += (f"; the gradient shards are all-reduced across the {home.num_groups} "
                     f"groups in {across} batched all-reduce(s)")
      plan = dataclasses.replace(plan, group_size=group_size, groups=grouping,
                                 across_groups=across)

    # 4. Compile the rewritten step.
    timings = {"trace": traced_at - start, "analysis": time.perf_counter() - traced_at}
    donated = [k for k, s in enumerate(sources)
               if s[0] == "arg" and arg_of_leaf[s[1]] in self._donate_argnums]
    step = programs.step_program(ClosedJaxpr(flat, ()), plan, mesh=mesh, in_specs=in_specs,
                                 out_specs=out_specs, axis_names=manual, check_vma=check_vma,
                                 donate_argnums=donated, timings=timings, home=home)
    state_in = {sources[k][1]: (fmt, in_specs[k]) for k, fmt in plan.state_inputs.items()}
    # Identical on every replica: of all the data-parallel axes, also across groups.
    same = frozenset(axes) | (frozenset((home.outer, home.inner)) if home is not None else set())
    out_replicated = tuple(facts.is_redundant(v, same) for v in flat.outvars)
    return _Program(plan, step, sources, state_in, tuple(names), tuple(out_specs),
                    out_replicated, out_tree, mesh, user_mesh, timings)

  def _groups(self, mesh: Mesh, axes: tuple,
              group_size: int) -> tuple[groups.Groups | None, str, str | None]:
    """The sharding groups of `shard_group_size` (§5.2): (the Groups, None for
    G = N or G = 1; the grouping in words, for the Plan; the reason the update
    stays replicated for G = 1, else None).

    Raises:
      ValueError: several sharding axes, or a G that does not divide N.
    """
    if len(axes) != 1:
      raise ValueError(
          f"shard_group_size groups the replicas of one mesh axis, but the update would be "
          f"sharded over {list(axes)}; pass axis_name= one of them, or drop shard_group_size "
          "and name the sharding axes of a mesh with the groups as an axis (partial sharding, "
          "§5.2)")
    (axis,) = axes
    size, g = mesh.shape[axis], group_size
    found = groups.derive(mesh, axis, g)  # Raises for a G that does not divide N.
    if g == 1:
      why = (f"shard_group_size=1: groups of one replica of {axis!r}, so nothing is sharded; "
             "the update runs replicated as in the original step")
      return None, why, why
    if g == size:
      return None, (f"shard_group_size={g}: one group of all {size} replicas of {axis!r} "
                    "(plain sharding)"), None
    return found, found.describe(), None

  def _topology_for(self, mesh: Mesh, axes: tuple, num_shards: int) -> costmodel.Topology:
    """The cost model's devices: the user's topology (of a sharding group's devices
    when it describes all of the axis), or one from the mesh's processes."""
    t = self._topology
    if t is not None:
      if t.num_devices == num_shards:
        return t
      try:  # Sharding groups: the axes of one group of consecutive devices.
        return dataclasses.replace(t, axes=t.split(num_shards)[0])
      except ValueError:
        raise ValueError(f"topology= describes {t.num_devices} devices, but the update is "
                         f"sharded over {num_shards} ({list(axes)}); describe those (or all "
                         "the devices of the axis, for shard_group_size)") from None
    # The devices of one sharding group (the other axes at 0), fast axis last.
    group = mesh.devices[tuple(slice(None) if a in axes else 0 for a in mesh.axis_names)]
    first = group.flat[0].process_index
    local = sum(d.process_index == first for d in group.flat)
    return costmodel.default_topology(num_shards, local if num_shards % local == 0 else None)

  def _replica_axes(self, mesh: Mesh, manual: frozenset, jaxpr, state: list) -> tuple:
    """The data-parallel axes, in mesh order."""
    if self._axis_name is None:
      wanted = clusters.gradient_axes(jaxpr, {tuple(v.aval.shape) for v in state}) or manual
    else:
      wanted = frozenset([self._axis_name] if isinstance(self._axis_name, str) else self._axis_name)
      if not wanted <= manual:
        raise ValueError(f"axis_name {sorted(wanted)} must be manual axes of the shard_map; "
                         f"they are {sorted(manual)}")
    return tuple(a for a in mesh.axis_names if a in wanted)


def argument_paths(f: Callable, args: tuple, keywords: bool = False) -> list[str]:
  """Each flat leaf of `args` as `jax.tree_util.keystr` prints its path under the name of
  `f`'s parameter it is passed to: `opt_state[0].mu['Dense_0']['kernel']` (`[1]` where
  the parameter has no name). With `keywords`, the last argument is a dict of keyword
  arguments (`wus.pmap`), each leaf named under its keyword: `mom['w1']`."""
  try:
    params = list(inspect.signature(f).parameters.values())
  except (TypeError, ValueError):  # No signature (a builtin): positions.
    params = []
  named = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
  rest = next((p.name for p in params if p.kind == p.VAR_POSITIONAL), None)
  out = []
  for i, arg in enumerate(args):
    flat = jax.tree_util.tree_flatten_with_path(arg, is_leaf=is_sharded)[0]
    if keywords and i == len(args) - 1:
      out += [f"{p[0].key}{jax.tree_util.keystr(p[1:])}" for p, _ in flat]
      continue
    name = (named[i] if i < len(named) else f"{rest}[{i - len(named)}]" if rest else f"[{i}]")
    out += [name + jax.tree_util.keystr(p) for p, _ in flat]
  return out


def needs_arguments(args: tuple, method: str) -> None:
  """Raises TypeError for `step.<method>()` called without the step's arguments."""
  if not args:
    raise TypeError(
        f"step.{method}() needs the step's arguments, as for a call: step.{method}(params, "
        "opt_state, batch); the plan is made for their shapes and dtypes (concrete arrays, "
        "or jax.ShapeDtypeStruct from jax.eval_shape)")


def check_objective(objective: str) -> None:
  """Raises ValueError unless `objective` is one `cost.decide` knows."""
  if objective not in cost.OBJECTIVES:
    raise ValueError(f"objective={objective!r}: pass one of {list(cost.OBJECTIVES)} (\"memory\" "
                     "shards for the optimizer state it keeps sharded, \"time\" only where the "
                     "cost model predicts no slower steps)")


def _across_groups(plan: Plan) -> int:
  """The batched all-reduces of the gradient shards across sharding groups (§5.2)."""
  grads = [t for c in plan.clusters if c.sharded for t in c.tensors
           if t.role == "gradient" and t.format is not None]
  return len(collectives.batched.dtype_buckets(
      [t.dtype for t in grads], [t.format.shard_size * t.itemsize for t in grads],
      plan.bucket_bytes))


def _argnums(argnums: int | Sequence[int]) -> frozenset:
  return frozenset([argnums] if isinstance(argnums, int) else argnums)


def _signature(x) -> tuple:
  """The cache key of one argument leaf: logical shape, dtype, weak type."""
  if is_sharded(x):
    return (x.shape, x.dtype, False)
  if isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct)):
    return (tuple(x.shape), x.dtype, bool(getattr(x, "weak_type", False)))
  return (type(x), ())


def _aval(x) -> tuple:
  """(shape, dtype) of an argument or output leaf, without touching its data."""
  dtype = getattr(x, "dtype", None)
  return tuple(np.shape(x)), dtype if dtype is not None else np.result_type(type(x))


def _spec_axes(spec: P) -> frozenset:
  """The mesh axes a PartitionSpec splits over."""
  out = set()
  for entry in spec:
    if entry is None:
      continue
    out.update(entry if isinstance(entry, tuple) else (entry,))
  return frozenset(out)


def _normal(spec: P) -> tuple:
  """A PartitionSpec without trailing Nones: P() and P(None,) lay out alike."""
  entries = list(spec)
  while entries and entries[-1] is None:
    entries.pop()
  return tuple(entries)


def _fits(x: ShardedArray, fmt, spec, axes: tuple, expected: NamedSharding, name: str) -> bool:
  """Whether `x` is sharded exactly as this step expects; False if it only needs
  converting (same mesh, another format or a tensor this step reads whole; or
  sharded in groups of another size on the same mesh, `shard_group_size`).

  Raises:
    StateMismatchError: `x` lives on another mesh.
  """
  if x.mesh != expected.mesh and _user_mesh(x.mesh) == _user_mesh(expected.mesh):
    return False
  if x.mesh != expected.mesh:
    raise StateMismatchError(
        f"argument {name} was sharded on another mesh ({x}, on {x.mesh}); this step runs on "
        f"{expected.mesh}. Pass wus.unshard(state), placed on this step's mesh, to re-shard it "
        "for this step.")
  traced = isinstance(x.data, jax.core.Tracer)  # Under jax.jit: its in_shardings decide.
  return (fmt is not None and x.format == fmt and x.axes == axes
          and _normal(x.spec) == _normal(spec)
          and (traced or x.data.sharding.is_equivalent_to(expected, x.data.ndim)))


def _user_spec(x: ShardedArray) -> P:
  """The PartitionSpec of `x`'s whole value over the user's mesh."""
  home = groups.home(x.mesh)
  return x.spec if home is None else home.user_spec(x.spec)


def _user_mesh(mesh: Mesh) -> Mesh:
  """The user's mesh `mesh` was derived from for sharding groups, or `mesh`."""
  home = groups.home(mesh)
  return mesh if home is None else home.mesh


# --- State matching: which output is the next value of which input. --------


@dataclasses.dataclass(frozen=True)
class Signature:
  """How a front end's positional arguments map to the user's parameters.

  Attributes:
    names: the user function's positional parameter names, in order (empty
      when its signature cannot be read: `*args`, builtins).
    positions: per positional argument the step receives, its parameter
      position (`wus.pmap` drops static arguments); None: 0, 1, 2, ...
    keywords: the last argument is a dict of keyword arguments (`wus.pmap`),
      each standing for the parameter of its name.
  """

  names: tuple[str, ...] = ()
  positions: tuple[int, ...] | None = None
  keywords: bool = False

  @classmethod
  def of(cls, f: Callable, **kw) -> Signature:
    """`f`'s positional parameter names (none if they cannot be read)."""
    try:
      params = inspect.signature(f).parameters.values()
    except (TypeError, ValueError):
      return cls((), **kw)
    return cls(tuple(p.name for p in params
                     if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)), **kw)


@dataclasses.dataclass(frozen=True)
class StateMatch:
  """Which outputs are the next values of which inputs (the step's state).

  Attributes:
    pairs: flat output leaf position -> flat input leaf position.
    how: flat input leaf position -> the rule that paired it ("position",
      "name 'mom'", "structure"), or why it has no next value although
      outputs share its tree structure; for the Plan.
  """

  pairs: dict[int, int]
  how: dict[int, str]


@dataclasses.dataclass(frozen=True)
class _Part:
  """A subtree of the arguments or of the outputs, as `_match_state` compares them."""

  position: int | None  # Parameter position (inputs) or tuple position (outputs), top level.
  name: str | None      # Parameter name, keyword, dict key or attribute name.
  label: str            # Its path, for the Plan.
  level: int            # 0: an argument or output element (-1: the whole output); 1: one down.
  treedef: Any
  avals: tuple
  start: int            # Its first flat leaf.

  @property
  def leaves(self) -> range:
    return range(self.start, self.start + len(self.avals))


def _parts(entries, start: int, level: int) -> list[tuple[_Part, Any]]:
  """(part, subtree) per (position, name, label, subtree) entry, from flat leaf `start` on."""
  out = []
  for position, name, label, tree in entries:
    leaves, treedef = jax.tree.flatten(tree, is_leaf=is_sharded)
    out.append((_Part(position, name, label, level, treedef, tuple(map(_aval, leaves)), start),
                tree))
    start += len(leaves)
  return out


def _kids(part: _Part, tree, positions: bool = False) -> list[tuple[_Part, Any]]:
  """The parts one level below `tree` (none for a leaf), named by dict key or attribute."""
  if is_sharded(tree):
    return []
  flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is not tree)[0]
  if len(flat) == 1 and not flat[0][0]:
    return []
  entries = []
  for k, ((key,), kid) in enumerate(flat):
    name = getattr(key, "name", getattr(key, "key", None))
    entries.append((k if positions else None, name if isinstance(name, str) else None,
                    part.label + jax.tree_util.keystr((key,)), kid))
  return _parts(entries, part.start, part.level + 1)


def _match_state(args: tuple, out: Any, signature: Signature = Signature()) -> StateMatch:
  """Pairs output leaves with the input leaves they are the next value of.

  Parts of the arguments (each argument or keyword argument, and its entries
  one level down) are paired with parts of the output (the whole output, its
  elements, and their entries one level down) by these rules, in order, each
  for the parts still unpaired:

    1. position: element i of a tuple output is the next value of the argument
       at parameter position i (a keyword argument at its parameter's
       position): `(params, opt_state, batch) -> (params, opt_state, metrics)`,
       also when `wus.pmap` passes them as keywords;
    2. name: an output under dict key or attribute k is the next value of the
       parameter, keyword argument or argument entry named k (jaxline's
       `{"params": ..., "mom": ...}` from `(params, mom, batch)`); a name that
       several unpaired parts of one side carry decides nothing;
    3. structure: an input part and an output part pair when their tree
       structures, shapes and dtypes agree and no other unpaired part of
       either side has them (`return opt_update(...)`; `(params, opt)` from
       one tuple argument); then the same with tree structures alone. One
       level down, only subtrees (not bare arrays) pair by structure. Parts
       that several others match stay unpaired, and the Plan says why.

  Rules 1 and 2 need equal tree structures; within paired parts, leaves pair
  where shape and dtype agree (a hyperparameter whose dtype the update
  changes stays unpaired).

  Args:
    args: the step's positional arguments (`wus.pmap`: and a dict of keywords).
    out: its output tree (leaves with `shape` and `dtype`).
    signature: how the arguments map to the user function's parameters.

  Returns:
    The StateMatch, in flat leaf positions (`jax.tree.leaves(args,
    is_leaf=wus.sharded.is_sharded)`, `jax.tree.leaves(out)`).
  """
  names = signature.names
  positional = args[:-1] if signature.keywords else args
  positions = signature.positions or tuple(range(len(positional)))
  entries = [(p, names[p] if p < len(names) else None, f"[{p}]", a)
             for p, a in zip(positions, positional, strict=True)]
  if signature.keywords:
    entries += [(names.index(k) if k in names else None, k, k, a)
                for k, a in sorted(args[-1].items())]
  top_in = _parts(entries, 0, 0)
  ins = [p for p, _ in top_in] + [k for p, a in top_in for k, _ in _kids(p, a)]
  (whole, _), = _parts([(None, None, "", out)], 0, -1)
  top_out = _kids(whole, out, positions=isinstance(out, (tuple, list)))
  tops = [p for p, _ in top_out]
  outs = [whole, *tops, *(k for p, o in top_out for k, _ in _kids(p, o))]

  pairs: dict[int, int] = {}
  how: dict[int, str] = {}

  def free(part: _Part, taken) -> bool:
    return bool(part.avals) and not any(j in taken for j in part.leaves)

  def pair(i: _Part, o: _Part, rule: str) -> None:
    for j, (x, y) in enumerate(zip(i.avals, o.avals, strict=True)):
      if x == y:
        pairs[o.start + j] = i.start + j
        how[i.start + j] = rule
    paired_out.update(o.leaves)
    paired_in.update(i.leaves)

  paired_in: set[int] = set()
  paired_out: set[int] = set()
  # 1. Position.
  for i in ins:
    o = next((o for o in tops if o.position is not None and o.position == i.position), None)
    if (i.level == 0 and o is not None and o.treedef == i.treedef and free(i, paired_in)
        and free(o, paired_out)):
      pair(i, o, "position")
  # 2. Name, arguments before their entries.
  for level in (0, 1):
    by_name = collections.defaultdict(list)
    for i in ins:
      if i.level == level and i.name is not None and free(i, paired_in):
        by_name[i.name].append(i)
    for name, found in by_name.items():
      cands = [o for o in outs if o.name == name and free(o, paired_out)]
      if len(found) == 1 and len(cands) == 1 and cands[0].treedef == found[0].treedef:
        pair(found[0], cands[0], f"name {name!r}")
  # 3. Structure, where one part of each side matches; one level down only
  # subtrees (a bare array there matches too much).
  ins, outs = ([p for p in parts if p.level < 1 or p.treedef.num_nodes > 1]
               for parts in (ins, outs))
  for exact in (True, False):
    def same(i: _Part, o: _Part) -> bool:
      return i.treedef == o.treedef and (not exact or i.avals == o.avals)
    changed = True
    while changed:
      changed = False
      for i in ins:
        if not free(i, paired_in):
          continue
        cands = [o for o in outs if free(o, paired_out) and same(i, o)]
        if (len(cands) == 1 and
            [j for j in ins if free(j, paired_in) and same(j, cands[0])] == [i]):
          pair(i, cands[0], "structure")
          changed = True
  # Parts left ambiguous.
  for i in ins:
    cands = [o.label or "the whole output" for o in outs if free(o, paired_out)
             and o.treedef == i.treedef and o.avals == i.avals]
    if free(i, paired_in) and cands:
      others = [j.label for j in ins if j is not i and free(j, paired_in)
                and j.treedef == i.treedef and j.avals == i.avals]
      why = (f"no next value: its tree structure, shapes and dtypes match output(s) "
             f"{', '.join(cands)}" + (f" and input(s) {', '.join(others)}" if others else "")
             + ", so neither position nor name decides; return it at its argument's position "
             "or under its parameter's name")
      how.update(dict.fromkeys(i.leaves, why))
  return StateMatch(pairs, how)
