"""The runtime every front end shares: operands in, sharded state out (§4.2).

A front end translates its calling convention into the flat argument leaves
of one input signature and the `Compiled` step the pipeline made for it; the
runtime does the rest, the same for every front end: `call` runs the step
(`operands` checks what the caller passes, donated buffers, state made for
another mesh or another plan, and shards whole state in one program, as the
paper's runtime "invokes the sharding program when there is a state
mismatch"; the state the step keeps sharded comes back as `ShardedArray`s),
`lower` lowers its steady-state program, `state_target` makes the targets to
restore a checkpoint into, and `compiled_once` compiles each input signature
once. `Compiled` is what the pipeline compiles for one input signature and
what these functions read.
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from wus import saving
from wus.analysis import compat
from wus.analysis.plan import Plan
from wus.errors import StateMismatchError
from wus.matching import aval
from wus.sharded import ShardedArray, check_alive, is_sharded, unshard
from wus.transforms import programs
from wus.transforms.layout import ShardedLayout


def trace(leaves: list, compiled: Compiled) -> None:
  """Traces the programs the first call with `leaves` runs, without running them: the
  sharding program for the whole state among them, then the step's program. An error of
  the rewrite's own then surfaces while the step is built, where the front end can run the
  step as JAX runs it instead, not at the user's call."""
  whole = [(layout, leaves[k]) for k, layout in compiled.sharded_leaves.items()
           if not is_sharded(leaves[k])]
  if whole:
    programs.shard_program(tuple(layout for layout, _ in whole)).trace(
        *[jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=getattr(x, "sharding", None))
          for _, x in whole])
  compiled.step.trace(*abstract_operands(leaves, compiled))


def operands(leaves: list, compiled: Compiled) -> list:
  """The step's operands: sharded state checked, whole state sharded (§4.2).

  `compiled` is a compiled step (`Compiled`, the pipeline's or `wus.jit`'s): its
  `sources` (per operand: ("arg", leaf index) or ("const", value)), `sharded_leaves`
  (leaf index -> the `ShardedLayout` of an input passed sharded), `in_names`,
  `mesh` (where the programs run) and `user_mesh` (the mesh `mesh` was derived
  from for sharding groups, or `mesh`).

  Sharded state this step's plan holds another way (the step's signature
  changed between calls, so its plan did) is gathered and re-sharded on the
  same mesh, each conversion one program.

  Raises:
    ValueError: an argument's buffer was donated to an earlier call.
    StateMismatchError: sharded state made for another mesh.
  """
  ops: list = []
  whole_state = []  # (operand position, leaf, layout): sharded by one program.
  regather = []     # (operand position, sharded leaf): gathered first.
  for src in compiled.sources:
    if src[0] == "const":
      ops.append(src[1])
      continue
    k = src[1]
    x, layout = leaves[k], compiled.sharded_leaves.get(k)
    check_alive(x, compiled.in_names[k])
    if is_sharded(x) and fits(x, layout, compiled.mesh, compiled.user_mesh, compiled.in_names[k]):
      ops.append(x.data)
    elif is_sharded(x):
      regather.append((len(ops), x))
      ops.append(None)
    elif layout is not None:
      whole_state.append((len(ops), x, layout))
      ops.append(None)
    else:
      ops.append(x)
  if regather:
    pos, xs = zip(*regather, strict=True)
    for p, x in zip(pos, unshard(list(xs)), strict=True):
      layout = compiled.sharded_leaves.get(compiled.sources[p][1])
      if layout is None:
        ops[p] = x
      else:
        whole_state.append((p, x, layout))
  if whole_state:
    pos, xs, layouts = zip(*whole_state, strict=True)
    shards = programs.shard_program(tuple(layouts))(*xs)
    for p, x in zip(pos, shards, strict=True):
      ops[p] = x
  return ops


def call(leaves: list, compiled: Compiled) -> Any:
  """Runs `compiled` on the flat argument leaves of its input signature (§4.2).

  The operands go where the program takes them (`Compiled.in_shardings`, where
  given), so that the next call compiles nothing new.

  Returns:
    The step's outputs as the user's pytree, the state it keeps sharded as
    `ShardedArray`s.

  Raises:
    As `operands`.
  """
  ops = operands(leaves, compiled)
  if compiled.in_shardings:
    ops = [x if getattr(x, "sharding", None) == s else jax.device_put(x, s)
           for x, s in zip(ops, compiled.in_shardings, strict=True)]
  outs = compiled.step(*ops)
  return jax.tree.unflatten(compiled.out_tree, [
      ShardedArray(x, compiled.sharded_outputs[k]) if k in compiled.sharded_outputs else x
      for k, x in enumerate(outs)])


def abstract_operands(leaves: list, compiled: Compiled) -> list:
  """The step program's operands for `leaves` in the steady state: the state it keeps
  sharded as its padded shards, abstract; the rest abstract where the program takes it
  (`Compiled.in_shardings`), or as given."""
  ops = []
  for src in compiled.sources:
    if src[0] == "const":
      ops.append(src[1])
      continue
    k, x = src[1], leaves[src[1]]
    if k in compiled.sharded_leaves:
      layout = compiled.sharded_leaves[k]
      ops.append(jax.ShapeDtypeStruct(layout.padded_shape, x.dtype,
                                      sharding=layout.data_sharding))
    elif compiled.in_shardings:
      # A Python scalar (Flax's `TrainState.create` starts `step` at 0) is typed as
      # jax.jit types it: weakly typed, of JAX's default dtype.
      x = x if hasattr(x, "dtype") else jax.typeof(x)
      ops.append(jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=compiled.in_shardings[k],
                                      weak_type=bool(getattr(x, "weak_type", False))))
    else:
      ops.append(x)
  return ops


def lower(leaves: list, compiled: Compiled) -> jax.stages.Lowered:
  """Lowers `compiled`'s steady-state program (the state it keeps sharded already
  sharded) for the flat argument leaves `leaves`."""
  return compiled.step.lower(*abstract_operands(leaves, compiled))


def state_target(leaves: list, compiled: Compiled, shardings: Sequence) -> list:
  """The target to restore each flat argument leaf into (a checkpoint's, §4.2).

  Args:
    leaves: the flat argument leaves, concrete or abstract, whole or sharded.
    compiled: the step compiled for them.
    shardings: per leaf, where the front end reads it whole.

  Returns:
    Per leaf: a `wus.checkpoint.LogicalView` (of the logical shape) in the step's
    format for the state it keeps sharded; a `jax.ShapeDtypeStruct` placed at
    `shardings[k]` for the rest.
  """
  from wus import checkpoint  # noqa: PLC0415 -- imports Orbax only when checkpoints are used
  return [checkpoint.restore_target(compiled.sharded_leaves[k], x.dtype)
          if k in compiled.sharded_leaves else
          jax.ShapeDtypeStruct(np.shape(x), aval(x)[1], sharding=sharding,
                               weak_type=bool(getattr(x, "weak_type", False)))
          for k, (x, sharding) in enumerate(zip(leaves, shardings, strict=True))]


def compiled_once(cache: dict, key: Hashable, build: Callable[[], Compiled],
                  front_end: Any) -> Compiled:
  """The step compiled for the input signature `key`: `build()` once, its Plan then
  read by `saving.warn_if_not_sharded` for `front_end` (the step the user called)."""
  if key not in cache:
    cache[key] = build()
    saving.warn_if_not_sharded(cache[key].plan, front_end)
  return cache[key]


def inside_transform(leaves: list, mesh_from_context: bool) -> str | None:
  """Why a call with the flat argument leaves `leaves` runs as plain `jax.shard_map`
  (`as_jax_shard_map`): it is inside `jax.grad`, `jax.vmap` or another transformation (its
  arguments are their tracers), or inside `jax.jit` with the mesh to come from
  `jax.set_mesh` (`mesh_from_context`); None otherwise."""
  data = [x.data if is_sharded(x) else x for x in leaves]
  if any(isinstance(x, jax.core.Tracer) and not compat.is_staging_tracer(x) for x in data):
    return "inside jax.grad, jax.vmap or another transformation of a function that calls it"
  if mesh_from_context and any(isinstance(x, jax.core.Tracer) for x in data):
    return "inside jax.jit with the mesh from jax.set_mesh"
  return None


def as_jax_shard_map(step, mesh: Mesh | None, args: tuple, why: str | None,
                     stacklevel: int = 4) -> Any:
  """The call as `jax.shard_map` makes it, sharded state passed whole: a call inside
  another transformation (`inside_transform`) has no weight update inside to shard.

  Args:
    step: the `pipeline.Step` (its `f` and `jax.shard_map`'s arguments).
    mesh: the mesh; None: `jax.set_mesh`'s.
    args: the positional arguments.
    why: `inside_transform`'s reason, to warn with; None: warned already.
    stacklevel: the warning's, as for `warnings.warn`, from this function.
  """
  if why is not None:
    warnings.warn(
        f"wus.shard_map({getattr(step.f, '__name__', step.f)}) called {why}: it runs as "
        "jax.shard_map, with nothing sharded. To shard the weight update of a jax.jit "
        "training step, use wus.jit on the step.", stacklevel=stacklevel)
  smap = jax.shard_map(step.f, mesh=mesh, in_specs=step.in_specs, out_specs=step.out_specs,
                       check_vma=step.check_vma, axis_names=step.axis_names)
  return smap(*unshard(args))


def donated_positions(f: Callable, argnums: int | Sequence[int],
                      argnames: str | Sequence[str]) -> frozenset:
  """Positions of `f`'s donated parameters, from numbers and names (as `jax.jit`).

  Raises:
    ValueError: a name that is not a positional parameter of `f`.
  """
  names = [argnames] if isinstance(argnames, str) else list(argnames)
  out = set(as_positions(argnums))
  if names:
    params = [p.name for p in inspect.signature(f).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    for name in names:
      if name not in params:
        raise ValueError(f"donate_argnames: {name!r} is not a positional parameter of "
                         f"{getattr(f, '__name__', f)} (its parameters: {params})")
      out.add(params.index(name))
  return frozenset(out)


def needs_arguments(args: tuple, method: str) -> None:
  """Raises TypeError for `step.<method>()` called without the step's arguments."""
  if not args:
    raise TypeError(
        f"step.{method}() needs the step's arguments, as for a call: step.{method}(params, "
        "opt_state, batch); the plan is made for their shapes and dtypes (concrete arrays, "
        "or jax.ShapeDtypeStruct from jax.eval_shape)")


def as_positions(positions: int | Sequence[int]) -> frozenset:
  """One position or several, as a frozenset."""
  return frozenset([positions] if isinstance(positions, int) else positions)


def leaf_signature(x) -> tuple:
  """The cache key of one argument leaf: logical shape, dtype, weak type."""
  if is_sharded(x):
    return (x.shape, x.dtype, False)
  if isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct)):
    return (tuple(x.shape), x.dtype, bool(getattr(x, "weak_type", False)))
  return (type(x), ())


def normal(spec: P) -> tuple:
  """A PartitionSpec without trailing Nones: P() and P(None,) lay out alike."""
  entries = list(spec)
  while entries and entries[-1] is None:
    entries.pop()
  return tuple(entries)


def fits(x: ShardedArray, layout: ShardedLayout | None, mesh: Mesh, user_mesh: Mesh,
         name: str) -> bool:
  """Whether `x` is sharded exactly as a step on `mesh` expects (`layout`; None: the
  step reads it whole); False if it only needs converting (same mesh, another format
  or a tensor the step reads whole; or sharded in groups of another size on the same
  devices, `shard_group_size`: `user_mesh` is the mesh `mesh` was derived from).

  Raises:
    StateMismatchError: `x` lives on another mesh.
  """
  if x.mesh != mesh and x.layout.user_mesh == user_mesh:
    return False
  if x.mesh != mesh:
    raise StateMismatchError(
        f"argument {name} was sharded on another mesh ({x}, on {x.mesh}); this step runs on "
        f"{mesh}. Pass wus.unshard(state), placed on this step's mesh, to re-shard it "
        "for this step.")
  traced = isinstance(x.data, jax.core.Tracer)  # Under jax.jit: its in_shardings decide.
  return (layout is not None and x.format == layout.format and x.axes == layout.axes
          and normal(x.spec) == normal(layout.spec)
          and (traced or x.data.sharding.is_equivalent_to(layout.data_sharding, x.data.ndim)))


@dataclasses.dataclass(frozen=True)
class Compiled:
  """Everything compiled for one input signature: the pipeline's result."""

  plan: Plan
  step: Callable[..., tuple]
  sources: tuple        # Per step operand: ("arg", leaf index) or ("const", value).
  sharded_leaves: dict  # Arg leaf index -> its ShardedLayout, for inputs passed sharded.
  sharded_outputs: dict  # Flat output -> its ShardedLayout, for outputs returned sharded.
  in_names: tuple[str, ...]
  out_specs: tuple      # Per flat output: its PartitionSpec in the user's step.
  out_replicated: tuple  # Per flat output: identical on every replica of the plan's axes.
  out_tree: Any
  mesh: Mesh | None     # The mesh the programs run on (derived with shard_group_size);
                        # None: `wus.jit`'s step runs unchanged, as `jax.jit` runs it.
  user_mesh: Mesh | None  # The user's mesh: whole values enter and leave on it.
  seconds: Mapping[str, float]  # Seconds of "trace" and "analysis" (inline, plan).
  lowering: Mapping[str, float]  # The program's record, "rewrite" seconds once lowered.
  in_shardings: tuple = ()  # `wus.jit`: per flat leaf, where its program takes it.
  # `wus.jit`'s region: operand leaf -> its ShardedLayout, for the values that are no
  # state its program takes as the global arrays of their padded shards (`analysis.presliced`).
  presliced: Mapping = dataclasses.field(default_factory=dict)

  @property
  def timings(self) -> dict[str, float]:
    """Seconds: "trace", "analysis"; "rewrite" once the step is lowered."""
    return {**self.seconds, **self.lowering}
