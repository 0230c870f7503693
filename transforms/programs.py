"""The programs of §4.2: shard_state, step and unshard_state.

Without a training loop inside the program, the rewritten step is split from
the (rare) conversions of state between whole and sharded: the runtime calls
`shard_program` the first time it sees whole state, then passes sharded state
straight from one step to the next, and `unshard_program` gives whole arrays
back when the user asks for them.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from wus import collectives
from wus.analysis import compat, owned, sizing
from wus.analysis.compat import ClosedJaxpr
from wus.analysis.formats import ShardFormat
from wus.analysis.plan import Plan
from wus.collectives import owned as owned_rows
from wus.transforms import gc_pause, groups
from wus.transforms.layout import ShardedLayout, padded_spec, shard_spec  # noqa: F401 -- wus.jit
from wus.transforms.rewrite import rewrite


def step_program(jaxpr: ClosedJaxpr, plan: Plan, *, mesh: Mesh, in_specs: Sequence[P],
                 out_specs: Sequence[P], axis_names: frozenset, check_vma: bool,
                 donate_argnums: Sequence[int] = (),
                 timings: dict | None = None,
                 home: groups.Groups | None = None) -> Callable[..., tuple]:
  """The jit-compiled sharded step (sharded state in, sharded state out).

  Args:
    jaxpr: the flat per-replica jaxpr the Plan was made from.
    plan: the Plan.
    mesh: the mesh of the original shard_map.
    in_specs, out_specs: the original per-input / per-output specs.
    axis_names: the manual axes of the original shard_map.
    check_vma: as the original shard_map: the rewrite keeps JAX's types exact
      (shards vary over the replica axes, gathered values are invariant).
    donate_argnums: inputs (positions in `jaxpr.invars`) whose buffers the
      step may reuse for its outputs, as `jax.jit`'s.
    timings: if given, `timings["rewrite"]` is set to the seconds the rewrite
      interpreter takes each time the step is traced (on lowering).
    home: when `mesh` is derived for sharding groups (`shard_group_size`), its
      Groups: inputs may arrive on the user's mesh and whole outputs leave on
      it (the same layout on the same devices: no data moves).

  Returns:
    A jitted function of one global array per `jaxpr` input; state inputs
    (`plan.rewrite.sharded_in`) are the global arrays of their padded shards
    (`ShardedLayout.padded_shape`: each block's `format.padded_shape` for a
    tensor its spec splits over other axes too) laid out by `padded_spec`. It
    returns one global array per output, state outputs in the same padded layout.
  """
  def padded(spec: P, fmt) -> P:
    return padded_spec(spec, plan.shard_axes(fmt), mesh, home)
  ins = tuple(padded(s, plan.rewrite.sharded_in[k]) if k in plan.rewrite.sharded_in else s
              for k, s in enumerate(in_specs))
  outs = tuple(padded(s, plan.rewrite.sharded_out[k]) if k in plan.rewrite.sharded_out else s
               for k, s in enumerate(out_specs))
  body = rewrite(jaxpr, plan)

  def timed_body(*args):
    start = time.perf_counter()
    with gc_pause.paused():
      out = tuple(body(*args))
    if timings is not None:
      timings["rewrite"] = time.perf_counter() - start
    return out

  fn = jax.shard_map(timed_body, mesh=mesh, in_specs=ins, out_specs=outs,
                     check_vma=check_vma, axis_names=axis_names)
  if home is not None:
    fn = _placed(fn, mesh, ins, outs, set(plan.rewrite.sharded_out), home)
  return jax.jit(fn, donate_argnums=tuple(donate_argnums))


def _placed(fn: Callable, mesh: Mesh, ins: Sequence[P], outs: Sequence[P], sharded: set,
            home: groups.Groups) -> Callable:
  """`fn` on the derived mesh, taking and returning values on the user's (sharded state
  stays on the derived mesh)."""
  def placed(*args):
    with groups.on(mesh):
      outs_ = fn(*[groups.place(x, NamedSharding(mesh, s)) for x, s in zip(args, ins, strict=True)])
    return tuple(y if k in sharded else groups.place(y, NamedSharding(home.mesh, home.user_spec(s)))
                 for k, (y, s) in enumerate(zip(outs_, outs, strict=True)))
  return placed


@functools.lru_cache(maxsize=None)
def shard_program(layouts: tuple[ShardedLayout, ...]) -> Callable[..., list[jax.Array]]:
  """Whole tensors -> sharded global arrays (the sharding program of §4.2).

  One program for all of a step's state. Each device takes its own shard of
  its whole value (shape `format.shape`, laid out by `spec` as the step's
  in_spec lays it out) with a local slice: no communication. Owned state
  (`wus.analysis.owned`) is converted by bank, all of a bank's members together.

  Args:
    layouts: a layout per tensor, all on one mesh and sharding groups.

  Returns:
    A function of one array per layout returning, per tensor, a global array
    of shape `padded_shape` laid out by its `data_sharding`.
  """
  fmts, specs, mesh, axes, home = _common(layouts)
  padded = [x.data_sharding.spec for x in layouts]

  def body(*xs):
    return _shard_all(xs, fmts, axes)
  if home is None:
    sharded = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=padded)
    # A whole value typed with an axis of size 1 (Explicit axes) takes the spec's type.
    return jax.jit(lambda *xs: sharded(*[compat.laid_out(x, s)
                                         for x, s in zip(xs, specs, strict=True)]))
  # A mesh derived for sharding groups: whole values may come on the user's mesh,
  # and `wus.pmap`'s stacked copies, split over the groups too, are equal copies.
  split = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=padded, check_vma=False)

  def placed(*xs):
    with groups.on(mesh):
      return split(*[groups.place(x, NamedSharding(mesh, s))
                     for x, s in zip(xs, specs, strict=True)])
  return jax.jit(placed)


@functools.lru_cache(maxsize=None)
def unshard_program(layouts: tuple[ShardedLayout, ...]) -> Callable[..., list[jax.Array]]:
  """Sharded global arrays -> the whole tensors on every device, in one program.

  The all-gathers are batched (§5.2, `collectives.batched.all_gather`), so a
  tree of many tensors costs a few collectives and one dispatch. Owned state
  is gathered by bank: a member is whole only with all of its bank's columns.

  Args:
    layouts: a layout per tensor, all on one mesh and sharding groups;
      each `spec` lays out the per-device whole values (the step's out_spec;
      P(): one replicated array).

  Returns:
    A function of one global array per layout (shape `padded_shape`)
    returning the whole arrays (each device's value of shape `format.shape`),
    on the user's mesh. A tensor split over other axes too (`split_axes`) is
    gathered over `axes` only: each device gets its block, laid out by `spec`.
  """
  fmts, specs, mesh, axes, home = _common(layouts)

  def body(*shards):
    return _gather_all(shards, fmts, axes)
  gather = jax.shard_map(body, mesh=mesh, in_specs=tuple(x.data_sharding.spec for x in layouts),
                         out_specs=list(specs))
  if home is None:
    return jax.jit(gather)
  # State sharded in groups (`shard_group_size`): whole values on the user's mesh.

  def placed(*shards):
    with groups.on(mesh):
      wholes = gather(*shards)
    return [groups.place(x, NamedSharding(home.mesh, home.user_spec(s)))
            for x, s in zip(wholes, specs, strict=True)]
  return jax.jit(placed)


def _common(layouts: Sequence[ShardedLayout]) -> tuple:
  """(formats, specs, mesh, the axes of each, groups) of layouts that share mesh and groups
  (the axes differ for an update sharded over `Plan.copy_axes` too).

  Raises:
    ValueError: the layouts live on different meshes or groups.
  """
  first = layouts[0]
  if any((x.mesh, x.groups) != (first.mesh, first.groups) for x in layouts):
    raise ValueError("one shard or unshard program converts tensors of one mesh and sharding "
                     "groups")
  return (tuple(x.format for x in layouts), tuple(x.spec for x in layouts), first.mesh,
          tuple(tuple(x.axes) for x in layouts), first.groups)


def banks(fmts: Sequence) -> dict:
  """Owned formats among `fmts` by bank: bank -> [position of member 0, 1, ...].

  Raises:
    ValueError: a bank with members missing (owned state is whole only with
      all of its bank, `wus.analysis.owned`).
  """
  out: dict = {}
  for k, f in enumerate(fmts):
    if owned.is_owned(f):
      out.setdefault(f.bank, {})[f.index] = k
  for bank, members in out.items():
    if len(members) != len(bank.shapes):
      raise ValueError(
          f"owned optimizer state: {len(members)} of the {len(bank.shapes)} tensors of one bank "
          f"({bank.dtype}, shapes {[list(s) for s in bank.shapes]}) were given; each lives whole "
          "only on its owner, in rows that span the arrays of all of them. Pass the whole "
          "optimizer state together (to wus.unshard, wus.checkpointable, a restore, or the step).")
  return {bank: [members[t] for t in range(len(bank.shapes))] for bank, members in out.items()}


def _shard_all(xs: Sequence, fmts: Sequence, axes: Sequence[tuple]) -> list:
  """Per replica: each whole value's shard in its format over its axes; owned state by
  bank."""
  by_bank = banks(fmts)
  out = [None if owned.is_owned(f) else collectives.shard(x, f, a)
         for x, f, a in zip(xs, fmts, axes, strict=True)]
  for bank, ks in by_bank.items():
    for k, col in zip(ks, owned_rows.shard_bank([xs[k] for k in ks], bank.slots, bank.widths,
                                                axes[ks[0]]), strict=True):
      out[k] = col
  return out


def _gather_all(shards: Sequence, fmts: Sequence, axes: Sequence[tuple]) -> list:
  """Per replica: the whole values of shards, batched (§5.2) per axes; owned state by
  bank."""
  flat = [ShardFormat.flat(f.padded_shape, f.num_shards) if owned.is_owned(f) else f
          for f in fmts]
  out = collectives.batched.grouped(
      list(axes), lambda over, xs, fs: collectives.batched.all_gather(
          xs, fs, over, sizing.DEFAULT_BUCKET_BYTES,
          keys=[compat.varying_axes(jax.typeof(x)) for x in xs]), list(shards), flat)
  for bank, ks in banks(fmts).items():
    for k, whole in zip(ks, owned_rows.bank_wholes([out[k] for k in ks], bank.slots,
                                                   bank.widths, bank.shapes), strict=True):
      out[k] = whole
  return out
