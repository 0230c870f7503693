"""The pipeline every front end shares: trace, match state, analyse, plan, build (§3, §4).

A front end (`wus.shard_map`, `wus.pmap`, `wus.jit`'s update region)
translates its calling convention into a `Step` (the per-replica function,
its in/out specs and what the front end knows about its arguments) and the
user's `Options`; `compile_step` returns a `Compiled` step: the complete Plan,
the jit-compiled sharded step program and how its operands map to the
arguments. `wus.runtime` runs it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from wus import runtime
from wus.analysis import clusters, compat, cost, network, redundancy
from wus.analysis.compat import ClosedJaxpr
from wus.analysis.plan import Grouping, Plan
from wus.analysis.planner import make_plan
from wus.matching import Signature, StateMatch, argument_paths, aval, match_state
from wus.options import Options
from wus.sharded import is_sharded
from wus.transforms import gc_pause, groups, inline, programs
from wus.transforms.layout import ShardedLayout, split_axes


@dataclasses.dataclass(frozen=True)
class Step:
  """A per-replica step as the pipeline reads it: what a front end knows.

  Attributes:
    f: the per-replica step.
    in_specs, out_specs, check_vma, axis_names: as for `jax.shard_map`.
    split_reason: why an input its in_spec splits differs across replicas
      (for the Plan; `wus.pmap` names its per-device copies).
    signature: how the positional arguments map to the user's parameters.
    match_state: the front end's own state pairs (`wus.jit`'s region), or None
      for `matching.match_state`.
    names: the front end's names of the flat inputs and outputs, or None for
      the argument paths.
    copies: whether an update identical across the other manual axes is sharded
      over them too (`Plan.copy_axes`); None: unless the user's `axis_name=`
      names the sharding axes (`wus.jit` names them itself and allows it).
  """

  f: Callable
  in_specs: Any
  out_specs: Any
  check_vma: bool = True
  axis_names: frozenset = frozenset()
  split_reason: str = "its in_spec splits it"
  signature: Signature = Signature()
  match_state: Callable[[tuple, Any], StateMatch] | None = None
  names: tuple[Sequence[str], Sequence[str]] | None = None
  copies: bool | None = None


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
  mesh: Mesh            # The mesh the programs run on (derived with shard_group_size).
  user_mesh: Mesh       # The user's mesh: whole values enter and leave on it.
  timings: dict         # Seconds: "trace", "analysis" (inline, plan); "rewrite" once lowered.


def compile_step(step: Step, options: Options, args: tuple, leaves: list, treedef,
                 replicated: frozenset, mesh: Mesh, donate_argnums: frozenset) -> Compiled:
  """The pipeline: trace, match state, analyse, plan and build the programs (§3, §4).

  Every front end calls this once per input signature; everything the Plan
  says is decided here, `shard_group_size="auto"` included (§5.2).

  Args:
    step: the per-replica step and the facts its front end knows.
    options: the user's options.
    args, leaves, treedef: the positional arguments and their flat leaves
      (sharded state as `ShardedArray` leaves).
    replicated: flat leaf positions identical on every replica although their
      in_spec splits them (`wus.pmap`'s equal per-device copies, §3.1).
    mesh: the user's mesh.
    donate_argnums: positional arguments whose buffers the step may reuse.

  Returns:
    The Compiled step.
  """
  with gc_pause.paused():
    build = functools.partial(_build, step, options, args, leaves, treedef, frozenset(replicated),
                              mesh, donate_argnums)
    if options.shard_group_size != "auto":
      return build(options.shard_group_size)
    whole = build(None)
    g, why = cost.auto_group_size(whole.plan, _topology_for(
        options.topology, whole.mesh, whole.plan.axes, whole.plan.num_shards))
    return build(g, why)


def _build(step: Step, options: Options, args: tuple, leaves: list, treedef,
           replicated: frozenset, mesh: Mesh, donate_argnums: frozenset,
           group_size: int | None, chosen: str = "") -> Compiled:
  start = time.perf_counter()
  # 1. Trace the user's step exactly as jax.shard_map would.
  traced = [jax.ShapeDtypeStruct(x.shape, x.dtype,
                                 sharding=NamedSharding(mesh, x.layout.user_spec))
            if is_sharded(x) else x for x in leaves]
  smap = jax.shard_map(step.f, mesh=mesh, in_specs=step.in_specs,
                       out_specs=step.out_specs, check_vma=step.check_vma,
                       axis_names=step.axis_names)
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
  match = (step.match_state(args, out_shape) if step.match_state is not None
           else match_state(args, out_shape, step.signature))
  pairs = {o: body_pos[i] for o, i in match.pairs.items() if i in body_pos}
  out_leaves, out_tree = jax.tree.flatten(out_shape)
  out_names = [jax.tree_util.keystr(p)
               for p, _ in jax.tree_util.tree_flatten_with_path(out_shape)[0]]
  if step.names is not None:
    out_names = list(step.names[1])
  # What the Plan says of each input's next value (the state matching).
  matched = {body_pos[i]: why for i, why in match.how.items() if i in body_pos}
  matched.update({body_pos[i]: f"next value {out_names[o]} (by {match.how[i]})"
                  for o, i in match.pairs.items() if i in body_pos})
  user_mesh, home, rename, grouping = mesh, None, None, Grouping(chosen) if chosen else None
  if group_size is not None:
    axes = _replica_axes(options.axis_name, mesh, manual, body,
                         [body.invars[i] for i in pairs.values()])
    home, words = _groups(mesh, axes, group_size)
    grouping = Grouping(chosen, words, home.num_groups if home is not None else 0)
  if home is not None:
    # 1b. The programs run on the mesh derived for the groups; the step is
    # renamed onto it while it is inlined (transforms/groups.py).
    mesh, rename = home.derived, home.rename
    in_specs = tuple(home.derived_spec(p) for p in in_specs)
    out_specs = tuple(home.derived_spec(p) for p in out_specs)
    manual = (manual - {home.axis}) | {home.outer, home.inner}
    operand_avals = [jax.ShapeDtypeStruct(np.shape(x), aval(x)[1],
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
  flat = compat.body_without_dead_code(compat.shard_map_eqn(flat_outer))
  if group_size is None:
    axes = _replica_axes(options.axis_name, mesh, manual, flat,
                         [flat.invars[i] for i in pairs.values()])
  # State split over other mesh axes too (tensor parallelism): each block is sharded
  # over the replica axes (ShardedLayout.split_axes), if it comes back as it came in.
  split_state = _split_differently(pairs, in_specs, out_specs, out_names)
  for i in split_state:
    del pairs[next(o for o, k in pairs.items() if k == i)]

  # 3. Analyse and plan.
  arg_of_leaf = [a for a, arg in enumerate(args)
                 for _ in jax.tree.leaves(arg, is_leaf=is_sharded)]
  # An axis of size 1 splits nothing: a value its spec splits over one is the same on
  # its one replica (a (8, 1) mesh plans as the 1-D mesh).
  single = frozenset(a for a in manual if mesh.shape[a] == 1)
  in_rep = [frozenset(manual) if s[0] == "arg" and s[1] in replicated
            else manual - (runtime.spec_axes(spec) - single)
            for spec, s in zip(in_specs, sources, strict=True)]
  facts = redundancy.analyze(flat, in_rep, manual)
  names = argument_paths(step.f, args, step.signature.keywords)
  if step.names is not None:
    names = list(step.names[0])
  in_names = [names[s[1]] if s[0] == "arg" else "<constant>" for s in sources]
  num_shards = math.prod(mesh.shape[a] for a in axes)
  plan = make_plan(flat, facts, axes=axes, num_shards=num_shards,
                   in_names=in_names, out_names=out_names, state_pairs=pairs,
                   state_whole=split_state, matched=matched,
                   split=_split(in_specs, axes, mesh, home),
                   fsdp=_fsdp(in_specs, sources, replicated, axes, mesh),
                   min_size=options.min_shard_size, split_reason=step.split_reason,
                   objective=options.objective, shard_weights=options.shard_weights,
                   topology=_topology_for(options.topology, mesh, axes, num_shards),
                   copies=_copies(options.axis_name is None if step.copies is None
                                  else step.copies, mesh, manual, axes, home),
                   group_size=group_size, grouping=grouping)

  # 4. Compile the rewritten step.
  timings = {"trace": traced_at - start, "analysis": time.perf_counter() - traced_at}
  donated = [k for k, s in enumerate(sources)
             if s[0] == "arg" and arg_of_leaf[s[1]] in donate_argnums]
  step = programs.step_program(ClosedJaxpr(flat, ()), plan, mesh=mesh, in_specs=in_specs,
                               out_specs=out_specs, axis_names=manual, check_vma=check_vma,
                               donate_argnums=donated, timings=timings, home=home)
  # The Plan's state inputs are positions among the step's operands; the runtime's are
  # positions among the user's flat argument leaves.
  sharded_leaves = {sources[k][1]: ShardedLayout(fmt, plan.shard_axes(fmt), in_specs[k], mesh,
                                                 home) for k, fmt in plan.state_inputs.items()}
  sharded_outputs = {k: ShardedLayout(fmt, plan.shard_axes(fmt), out_specs[k], mesh, home)
                     for k, fmt in plan.state_outputs.items()}
  # Identical on every replica: of all the data-parallel axes, also across groups.
  same = frozenset(axes) | (frozenset((home.outer, home.inner)) if home is not None else set())
  out_replicated = tuple(facts.is_redundant(v, same) for v in flat.outvars)
  return Compiled(plan, step, sources, sharded_leaves, sharded_outputs, tuple(names),
                  tuple(out_specs), out_replicated, out_tree, mesh, user_mesh, timings)


def _copies(allowed: bool, mesh: Mesh, manual: frozenset, axes: tuple, home) -> dict:
  """The other manual axes (size > 1, mesh order) an update repeated on all their replicas
  is sharded over too (`Plan.copy_axes`): none unless `allowed` (`Step.copies`), nor
  with sharding groups."""
  if not allowed or home is not None:
    return {}
  return {a: mesh.shape[a] for a in mesh.axis_names
          if a in manual and a not in axes and mesh.shape[a] > 1}


def _split(in_specs: Sequence, axes: tuple, mesh: Mesh, home) -> dict:
  """Operand position -> the axes of size > 1 (and their sizes) its in_spec splits it
  over besides the replica axes (tensor parallelism), for the Plan."""
  out = {}
  for k, spec in enumerate(in_specs):
    names = [a for a in split_axes(spec, axes, mesh, home) if mesh.shape[a] > 1]
    if names:
      out[k] = tuple((a, mesh.shape[a]) for a in names)
  return out


def _fsdp(in_specs: Sequence, sources: tuple, replicated: frozenset, axes: tuple,
          mesh: Mesh) -> dict:
  """Operand position -> the replica axes of size > 1 its in_spec splits it over itself
  (FSDP), for the Plan; not `wus.pmap`'s equal per-device copies (`replicated`)."""
  out = {}
  for k, (spec, src) in enumerate(zip(in_specs, sources, strict=True)):
    fsdp = tuple(a for a in axes if a in runtime.spec_axes(spec) and mesh.shape[a] > 1)
    if fsdp and not (src[0] == "arg" and src[1] in replicated):
      out[k] = fsdp
  return out


def _split_differently(pairs: dict, in_specs: Sequence, out_specs: Sequence,
                       out_names: Sequence[str]) -> dict:
  """State whose in_spec and out_spec split it differently (by input position, with the
  reason for the Plan): kept whole between steps, since its shards would lie one way
  when read and another when returned."""
  out = {}
  for o, i in pairs.items():
    if runtime.normal(in_specs[i]) != runtime.normal(out_specs[o]):
      out[i] = (f"its in_spec {in_specs[i]} and the out_spec {out_specs[o]} of its next value "
                f"{out_names[o]} split it differently: kept whole between steps")
  return out


def _groups(mesh: Mesh, axes: tuple, group_size: int) -> tuple[groups.Groups | None, str]:
  """The sharding groups of `shard_group_size` (§5.2): (the Groups, None for
  G = N or G = 1; the grouping in words, for the Plan, for G = 1 the reason the
  update stays replicated).

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
    return None, why
  if g == size:
    return None, (f"shard_group_size={g}: one group of all {size} replicas of {axis!r} "
                  "(plain sharding)")
  return found, found.describe()

def _topology_for(topology: network.Topology | None, mesh: Mesh, axes: tuple,
                  num_shards: int) -> network.Topology:
  """The cost model's devices: the user's topology (of a sharding group's devices
  when it describes all of the axis; of one data group, `Topology.strided`, when it
  describes every device of the mesh, listed in the mesh's order), or one from the
  mesh's processes."""
  t = topology
  if t is not None:
    if t.num_devices == num_shards:
      return t
    names = list(mesh.axis_names)
    first, last = min(map(names.index, axes)), max(map(names.index, axes))
    between = [a for a in names[first:last + 1] if a not in axes and mesh.shape[a] > 1]
    stride = math.prod(mesh.shape[a] for a in names[last + 1:])
    try:  # Sharding groups, or the data groups of a data x model mesh.
      if t.num_devices == mesh.size and not between:
        return t.strided(stride, num_shards)
      return dataclasses.replace(t, axes=t.split(num_shards)[0])
    except ValueError:
      raise ValueError(f"topology= describes {t.num_devices} devices, but the update is "
                       f"sharded over {num_shards} ({list(axes)}); describe those (or all "
                       "the devices of the axis, for shard_group_size, or of the mesh, in "
                       "the mesh's order)") from None
  # The devices of one sharding group (the other axes at 0), fast axis last.
  group = mesh.devices[tuple(slice(None) if a in axes else 0 for a in mesh.axis_names)]
  first = group.flat[0].process_index
  local = sum(d.process_index == first for d in group.flat)
  host = sum(d.process_index == first for d in mesh.devices.flat)
  return network.default_topology(num_shards, local if num_shards % local == 0 else None,
                                  platform=group.flat[0].platform, host_devices=host)

def _replica_axes(axis_name, mesh: Mesh, manual: frozenset, jaxpr, state: list) -> tuple:
  """The data-parallel axes, in mesh order."""
  if axis_name is None:
    wanted = clusters.gradient_axes(jaxpr, {tuple(v.aval.shape) for v in state}) or manual
  else:
    wanted = frozenset([axis_name] if isinstance(axis_name, str) else axis_name)
    if not wanted <= manual:
      raise ValueError(f"axis_name {sorted(wanted)} must be manual axes of the shard_map; "
                       f"they are {sorted(manual)}")
  return tuple(a for a in mesh.axis_names if a in wanted)
