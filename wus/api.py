"""`wus.shard_map`: a data-parallel step with its weight update sharded (DESIGN.md §1).

The front end of `jax.shard_map` steps: `ShardedStep` translates the
`jax.shard_map` calling convention into the pipeline's `Step` and `Options`
(`wus.pipeline`) and runs the compiled step with the shared runtime
(`wus.runtime`). `wus.pmap` and `wus.jit` build on it.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from wus import pipeline, runtime, saving
from wus.analysis import compat, network
from wus.analysis.causes import SPEC_SPLITS
from wus.analysis.plan import Plan
from wus.matching import Signature, StateMatch, aval
from wus.options import Options
from wus.sharded import ShardedArray, is_sharded


def shard_map(f: Callable | None = None, /, *, out_specs: Any, in_specs: Any = compat.INFER,
              mesh: Mesh | None = None,
              check_vma: bool = True, axis_names: frozenset = frozenset(),
              axis_name: str | Sequence[str] | None = None,
              min_shard_size: int = 0,
              shard_group_size: int | str | None = None,
              objective: str = "memory",
              topology: network.Topology | None = None,
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
    out_specs: as for `jax.shard_map`.
    in_specs: as for `jax.shard_map`; inferred from the arguments' shardings
      when not given.
    mesh: as for `jax.shard_map`; from `jax.set_mesh` when not given.
    check_vma: as for `jax.shard_map`.
    axis_names: as for `jax.shard_map`.
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
      `wus.analysis.network.Topology` of N devices (mesh axes fast to slow,
      latency, bandwidth, memory bandwidth), or of every device of a mesh with
      other axes (tensor parallelism), in the mesh's order: the cost model then
      prices each model rank's data group (`Topology.strided`). Default:
      `network.default_topology` with one process's devices as the fast axis.
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
  options = Options(min_shard_size, shard_group_size, objective, topology, shard_weights,
                    axis_name)

  def make(f: Callable) -> ShardedStep:
    return ShardedStep(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma,
                       axis_names=frozenset(axis_names), options=options,
                       donate_argnums=runtime.donated_positions(f, donate_argnums,
                                                                  donate_argnames))
  return make if f is None else make(f)


class ShardedStep:
  """A data-parallel step whose weight update runs on shards (from `wus.shard_map`).

  Called like the jit-compiled `jax.shard_map(f, ...)` it replaces:
  `step(*args)` returns `f`'s outputs, the state it keeps sharded (optimizer
  state, §4.2) as `wus.ShardedArray`s of 1/N of each tensor per device, to pass
  to the next call as they are. The first call with an argument signature
  traces, analyses (§3) and compiles the sharded step for it; later calls with
  the same shapes, dtypes and shardings reuse it.

  A call raises `wus.StateMismatchError` for sharded state made on another
  mesh (pass `wus.unshard(state)`), and `ValueError` for an argument whose
  buffer was donated to an earlier call; sharded state read by the user's own
  JAX code (a `jax.jit` of a plain function, an optax call) raises `TypeError`.
  """

  def __init__(self, f: Callable, *, mesh: Mesh | None, in_specs: Any, out_specs: Any,
               check_vma: bool, axis_names: frozenset, axis_name=None, min_shard_size: int = 0,
               shard_group_size: int | str | None = None,
               objective: str = "memory", topology: network.Topology | None = None,
               shard_weights: bool = False, donate_argnums: frozenset = frozenset(),
               split_reason: object = SPEC_SPLITS, signature: Signature | None = None,
               match_state: Callable[[tuple, Any], StateMatch] | None = None,
               names: tuple[Sequence[str], Sequence[str]] | None = None,
               options: Options | None = None,
               split_by: str = "its spec", outside: tuple[str, ...] = ()):
    """The step of `f`; `options` (built and validated by a front end) or, without it,
    the option arguments (validated here: ValueError as for `Options`)."""
    self._f = f
    self._step = pipeline.Step(
        f, in_specs, out_specs, check_vma, frozenset(axis_names), split_reason,
        Signature.of(f) if signature is None else signature, match_state=match_state,
        names=names, split_by=split_by, outside=outside)
    self._options = options if options is not None else Options(
        min_shard_size, shard_group_size, objective, topology, shard_weights, axis_name)
    self._mesh = mesh  # None: the mesh set with jax.set_mesh at call time.
    self._donate_argnums = frozenset(donate_argnums)
    self._cache: dict = {}
    self._warned = False  # Warned once that a call runs as plain jax.shard_map.
    # What `saving.warn_if_not_sharded` calls the step (`wus.pmap` names its own).
    self.front_end = f"wus.shard_map({getattr(f, '__name__', 'step')})"
    functools.update_wrapper(self, f)

  # --- Public. ---------------------------------------------------------------

  def __call__(self, *args):
    if (why := self._inside_transform(args)) is not None:
      return self._as_jax_shard_map(args, why)[0]
    return self.run(self.per_call(args))[0]

  def per_call(self, args: tuple, replicated: frozenset = frozenset()) -> pipeline.Call:
    """The pipeline's input for a call with `args`: one value for everything per call.

    Args:
      args: the positional arguments.
      replicated: flat leaf positions (`jax.tree.leaves(args, is_leaf=
        wus.sharded.is_sharded)`) whose values are identical on every replica
        although their in_spec splits them (the paper's annotated parameters,
        §3.1: `wus.pmap`'s equal per-device copies).

    Raises:
      ValueError: no mesh (neither `mesh=` nor `jax.set_mesh`).
    """
    leaves, treedef = jax.tree.flatten(args, is_leaf=is_sharded)
    mesh = self._mesh if self._mesh is not None else jax.sharding.get_mesh()
    if mesh.empty:
      raise ValueError("wus.shard_map needs a mesh: pass mesh=, or call it inside "
                       "`with jax.set_mesh(mesh):`")
    return pipeline.Call(self._step, self._options, tuple(args), tuple(leaves), treedef,
                         frozenset(replicated), mesh, self._donate_argnums)

  def run(self, call: pipeline.Call) -> tuple[Any, list[bool]]:
    """Runs the step on `call`'s arguments (`per_call`); also says which flat outputs are
    identical on every replica.

    Returns:
      (the outputs, a bool per flat output leaf).
    """
    if (why := self._inside_transform(call.args)) is not None:
      return self._as_jax_shard_map(call.args, why)
    leaves, compiled = list(call.leaves), self.compiled(call)
    outs = compiled.step(*runtime.operands(leaves, compiled))
    wrapped = [ShardedArray(x, compiled.sharded_outputs[k]) if k in compiled.sharded_outputs else x
               for k, x in enumerate(outs)]
    return jax.tree.unflatten(compiled.out_tree, wrapped), list(compiled.out_replicated)

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
    s = self._step
    smap = jax.shard_map(s.f, mesh=self._mesh, in_specs=s.in_specs, out_specs=s.out_specs,
                         check_vma=s.check_vma, axis_names=s.axis_names)
    out = smap(*runtime.unshard(args))
    return out, [False] * len(jax.tree.leaves(out))

  def plan(self, *args) -> Plan:
    """The Plan for these arguments (whole or sharded state alike).

    Args:
      *args: the step's arguments, concrete or abstract (`jax.eval_shape`),
        whole or sharded.

    Returns:
      The `wus.Plan`: each weight-update cluster (§3.2), sharded, owned or
      replicated and why, with its tensors' formats (§4.1) and the cost
      model's prediction; which inputs stay sharded between steps.

    Raises:
      TypeError: no arguments (the plan is made for the arguments' shapes and dtypes).
    """
    runtime.needs_arguments(args, "plan")
    return self.compiled(self.per_call(args)).plan

  def state_target(self, *args) -> tuple:
    """The arguments as this step reads them, abstract: the target to restore a checkpoint into.

    Pass the parts you saved to Orbax's restore (`ocp.StandardCheckpointer().
    restore(path, target)`, `ocp.args.StandardRestore(target)`): it returns state
    this step accepts as it is, the state it keeps sharded as `wus.ShardedArray`s
    in this step's format, for its mesh and replica count (a checkpoint saved at
    another replica count, or with whole arrays by plain `jax.shard_map` code,
    restores the same way). Each process reads only what its devices hold.

    Args:
      *args: the step's arguments, concrete or abstract (`jax.eval_shape`), whole
        or sharded.

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
    return self.state_target_of(self.per_call(args))

  def state_target_of(self, call: pipeline.Call) -> tuple:
    """`state_target` for `call`'s arguments (`per_call`)."""
    from wus import checkpoint  # noqa: PLC0415 -- imports Orbax only when checkpoints are used
    args, leaves, compiled = call.args, list(call.leaves), self.compiled(call)
    mesh = compiled.user_mesh
    if self._step.in_specs is compat.INFER:
      specs = [x.layout.user_spec if is_sharded(x) else x.sharding.spec for x in leaves]
    else:
      specs = jax.tree.leaves(jax.tree.broadcast(self._step.in_specs, args, is_leaf=is_sharded))
    out = []
    for k, (x, spec) in enumerate(zip(leaves, specs, strict=True)):
      if k in compiled.sharded_leaves:
        out.append(checkpoint.restore_target(compiled.sharded_leaves[k], x.dtype))
      else:
        out.append(jax.ShapeDtypeStruct(np.shape(x), aval(x)[1],
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
    return dict(self.compiled(self.per_call(args)).timings)

  def lower(self, *args) -> jax.stages.Lowered:
    """Lowers the steady-state step program (optimizer state already sharded).

    Returns:
      A `jax.stages.Lowered`; `.compile().memory_analysis()` gives per-device
      bytes, `.compile().as_text()` the optimized HLO.
    """
    return self.lower_of(self.per_call(args))

  def lower_of(self, call: pipeline.Call) -> jax.stages.Lowered:
    """`lower` for `call`'s arguments (`per_call`)."""
    leaves, compiled = list(call.leaves), self.compiled(call)
    ops = []
    for src in compiled.sources:
      if src[0] == "arg" and src[1] in compiled.sharded_leaves:
        layout = compiled.sharded_leaves[src[1]]
        ops.append(jax.ShapeDtypeStruct(layout.padded_shape, leaves[src[1]].dtype,
                                        sharding=layout.data_sharding))
      else:
        ops.append(src[1] if src[0] == "const" else leaves[src[1]])
    return compiled.step.lower(*ops)

  def compiled(self, call: pipeline.Call) -> pipeline.Compiled:
    """The compiled step for `call` (`per_call`): compiled once per input signature."""
    key = (call.treedef, tuple(runtime.leaf_signature(x) for x in call.leaves),
           call.replicated, call.mesh)
    if key not in self._cache:
      self._cache[key] = pipeline.compile_step(call)
      saving.warn_if_not_sharded(self._cache[key].plan, self)
    return self._cache[key]
