"""The program of a global-view step (`wus.jit`): its forward and backward pass as traced,
then the update region as a shard_map through the rewrite (`analysis/global_view.py`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping

import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from wus.analysis import compat, global_view
from wus.analysis.model_splits import ModelSplits
from wus.analysis.primitives import ELEMENTWISE
from wus.transforms import inline, interpret, model_local
from wus.transforms.layout import ShardedLayout


def run(flat, region: global_view.Region, sub, in_specs: tuple, *ops):
  """The step: the forward and backward pass as traced, then the region's sharded step.

  Args:
    flat: the step's global jaxpr (calls inlined), closed.
    region: its update region.
    sub: the region's compiled sharded step (`runtime.Compiled`).
    in_specs: per region input, the PartitionSpec the region reads it by; on a mesh with
      Explicit axes a value typed otherwise (a size-1 axis its type names, a weight
      placed over "fsdp") is resharded to it, as GSPMD would lay it out there.
    *ops: one value per input of `flat` (sharded state as its padded shards).

  Returns:
    A tuple, one value per output of `flat`.
  """
  jaxpr = flat.jaxpr
  env = dict(zip(jaxpr.constvars, flat.consts, strict=True))
  env.update(zip(jaxpr.invars, ops, strict=True))
  inside = set(region.eqns)
  interpret.eval_eqns(jaxpr, env, order=[i for i in range(len(jaxpr.eqns)) if i not in inside])
  region_ops = [s[1] if s[0] != "arg" else
                interpret.read(env, region.invars[s[1]]) if s[1] in sub.sharded_leaves else
                padded_shards(interpret.read(env, region.invars[s[1]]), sub.presliced[s[1]])
                if s[1] in sub.presliced else
                compat.laid_out(interpret.read(env, region.invars[s[1]]), in_specs[s[1]])
                for s in sub.sources]
  env.update(zip(region.outvars, sub.step(*region_ops), strict=True))
  return tuple(interpret.read(env, v) for v in jaxpr.outvars)


def padded_shards(x, layout: ShardedLayout):
  """The global array of `x`'s shards in `layout`, whose format cuts `x`'s leading dim
  into them with no padding (`analysis.presliced`), laid out by `layout.data_sharding`: `x`
  split over the format's axes on its leading dim, then its dims merged as the format
  merges them, so that where `x` is computed (in a loop), each device computes its rows
  alone."""
  spec = layout.data_sharding.spec
  split = lax.with_sharding_constraint(x, NamedSharding(layout.mesh, P(*spec[:1])))
  return lax.with_sharding_constraint(jnp.reshape(split, layout.format.merged_shape),
                                      layout.data_sharding)


def region_fn(jaxpr, region: global_view.Region, axes: tuple,
              model: ModelSplits | None = None,
              axis_sizes: Mapping[str, int] | None = None) -> Callable[..., tuple]:
  """The region as one replica's program, to trace inside a shard_map over `axes`: each
  gradient sum on this replica's rows, then all-reduced (`psum`), which the rewrite
  turns into a reduce-scatter; the update's equations as they are, but placements
  (`Region.placements`), which pass their operand on. With `model` (a data x model
  mesh, or state placed over a batch axis: the shard_map manual over every axis), an
  equation that reads or writes a value split over a model axis runs on this rank's
  blocks (`model_local`), and a sum of an FSDP weight's gradient is reduce-scattered to
  its block (`summed`)."""
  hook = functools.partial(_region_eqn, region, axes, model, axis_sizes)

  def fn(*ins):
    env = interpret.eval_eqns(jaxpr, dict(zip(region.invars, ins, strict=True)), hook,
                              region.eqns, interpret.retyped)
    return tuple(interpret.read(env, v, interpret.retyped) for v in region.outvars)
  return fn


def _region_eqn(region: global_view.Region, axes: tuple, model: ModelSplits | None,
                axis_sizes: Mapping[str, int] | None, i: int, eqn, ins: list) -> list:
  """Equation `i` of the region on this replica (`region_fn`'s `interpret.Hook`)."""
  if i in region.placements:  # Whole already: wus's layout replaces the constraint's.
    return ins
  if model is not None and model_local.is_local(eqn, i, model):
    outs = model_local.eval_local(eqn, i, ins, model, axis_sizes)
  elif eqn.primitive in ELEMENTWISE and not compat.has_result_layout(eqn):
    # Staged with its result type derived from its operands' (`compat.bind_elementwise`):
    # most of an optimizer's equations, a fraction of a bind each.
    outs = compat.bind_elementwise(compat.in_current_mesh(eqn), *[
        v.val if compat.is_literal(v) else x for v, x in zip(eqn.invars, ins, strict=True)])
  else:
    outs = inline.eval_eqn(eqn, ins, rename={})
  if i in region.moved or i in region.sums:
    with compat.source_of(compat.in_current_mesh(eqn)):
      outs = (lax.optimization_barrier(outs) if i in region.moved
              else [summed(x, tuple(a for a in axes if a in region.sum_axes.get(i, axes)),
                           model and model.scattered.get(i), axis_sizes) for x in outs])
  return outs


def summed(x, axes: tuple, scatter: tuple | None, sizes: Mapping[str, int] | None = None):
  """This replica's part of a gradient sum completed over the batch `axes` (those its
  operands are split over): all-reduced, or, for the gradient of a weight placed over
  batch axes itself (FSDP: `scatter`, per dim the axes splitting it), reduce-scattered to
  this replica's block over those axes and all-reduced over the others, in the order
  GSPMD sums it (HSDP: over "fsdp", then "replica", whose all-reduce of the block the
  rewrite turns into a reduce-scatter). A block axis not among `axes` holds copies of
  the sum: its block is a local slice (`sizes`: mesh axis -> size)."""
  if not scatter:
    return lax.psum(x, axes)
  for d, e in enumerate(scatter):
    for run in _runs(e or (), axes):
      if run[0] in axes:
        x = lax.psum_scatter(x, run if len(run) > 1 else run[0], scatter_dimension=d,
                             tiled=True)
      else:
        size = x.shape[d] // math.prod(sizes[a] for a in run)
        x = lax.dynamic_slice_in_dim(x, lax.axis_index(run) * size, size, axis=d)
  over = {a for e in scatter if e for a in e}
  rest = tuple(a for a in axes if a not in over)
  return lax.psum(x, rest) if rest else x


def _runs(names: tuple, axes: tuple) -> list[tuple]:
  """`names` in runs of consecutive axes all among `axes` or all not, major first."""
  out: list[list] = []
  for a in names:
    if out and (out[-1][0] in axes) == (a in axes):
      out[-1].append(a)
    else:
      out.append([a])
  return [tuple(r) for r in out]


def without_input_placements(closed, axis_sizes) -> compat.ClosedJaxpr:
  """`closed` (a flat global jaxpr) in which each placement (`global_view.is_placement`)
  of a step input, or of a constant, is dropped, its result read as its operand: the
  input is placed whole already (the step takes it so), and the update then reads the
  step's argument itself, whose next value it computes (`eqx.filter_shard((model,
  opt_state), replicated)` at the start of Equinox's data-parallel step)."""
  jaxpr = closed.jaxpr
  sources = set(jaxpr.invars) | set(jaxpr.constvars)
  env: dict = {}  # A dropped placement's result -> its operand.

  def read(atom):
    return atom if compat.is_literal(atom) else env.get(atom, atom)
  eqns = []
  for eqn in jaxpr.eqns:
    if (global_view.is_placement(eqn, axis_sizes) and len(eqn.invars) == 1
        and (compat.is_literal(eqn.invars[0]) or eqn.invars[0] in sources)
        and _same_type(eqn.invars[0].aval, eqn.outvars[0].aval)):
      sources.add(eqn.outvars[0])
      env[eqn.outvars[0]] = read(eqn.invars[0])
      continue
    eqns.append(eqn.replace(invars=[read(v) for v in eqn.invars]) if env else eqn)
  return compat.ClosedJaxpr(jaxpr.replace(eqns=eqns, outvars=[read(v) for v in jaxpr.outvars]),
                            closed.consts)


def _same_type(a, b) -> bool:
  """Same shape, dtype, weak type and layout in the type (a mesh with Explicit axes, and
  the types of its axes: a reshard onto Auto axes, `auto_axes`, is no mere placement)."""
  return ((a.shape, a.dtype, a.weak_type, compat.sharding_spec(a), compat.type_axes(a))
          == (b.shape, b.dtype, b.weak_type, compat.sharding_spec(b), compat.type_axes(b)))
