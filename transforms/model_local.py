"""One equation of a global step's update region run on model blocks (`wus.jit` on a
data x model mesh; the splits from `analysis.model_splits`).

Inside the region's shard_map, manual over every mesh axis, a value split over
"model" is its rank's block. An equation with no shape in its params (an
elementwise op, a transpose, a dot_general) runs on blocks as it is; one whose
params give the result's shape (a broadcast, a reshape) gets the block's shape
(`local_params`, keyed by primitive, registered at each rule by
`@local_params_rule(prim)`; `same_params` the default); a sharding constraint is the
identity (the block is laid out as it asks); a reduction over a split dim gives this rank's
partial result, which an all-reduce over the model axes completes, as the
partitioner's all-reduce completes it in the unmodified step (exact up to
summation order: the global norm of optax.clip_by_global_norm, LAMB's trust
ratios).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jax import lax

from wus.analysis import compat, dims, rules
from wus.transforms import inline, interpret
from wus.analysis.model_splits import ModelSplits

_ALL_REDUCE = {
    "sum": lax.psum, "max": lax.pmax, "min": lax.pmin,
    # All (any) over the ranks' booleans: the least (greatest) of them as integers.
    "and": lambda x, axes: lax.pmin(x.astype("int32"), axes).astype(bool),
    "or": lambda x, axes: lax.pmax(x.astype("int32"), axes).astype(bool),
}


def local_shape(shape: Sequence[int], split: tuple | None,
                axis_sizes: Mapping[str, int]) -> tuple[int, ...]:
  """The shape of one model rank's block of a value of `shape` split as `split`."""
  if not split:
    return tuple(shape)
  return tuple(n // math.prod(axis_sizes[a] for a in e) if e else n
               for n, e in zip(shape, split, strict=True))


# Params giving a result's shape, as a block's: primitive -> (eqn, block shape) -> params.
LocalParams = Callable[[Any, tuple], dict]
local_params: dict[compat.Primitive, LocalParams] = {}
local_params_rule = rules.registrar(local_params, "local params rule")


def same_params(eqn, shape: tuple) -> dict:
  """The default: no param gives the result's shape, so the equation's are the block's."""
  del eqn, shape
  return {}


@local_params_rule(lax.broadcast_in_dim_p)
def _broadcast_params(eqn, shape: tuple) -> dict:
  del eqn
  return {"shape": shape}


@local_params_rule(lax.reshape_p)
def _reshape_params(eqn, shape: tuple) -> dict:
  del eqn
  return {"new_sizes": shape}


def is_local(eqn, position, splits: ModelSplits) -> bool:
  """Whether the equation reads or writes a block (and must run as one here); a
  conditional, whether one of its branches' equations does."""
  if (position in splits.reduced
      or any(splits.split(v) for v in (*eqn.invars, *eqn.outvars))):
    return True
  return eqn.primitive is compat.cond_p and any(
      is_local(e, (position, b, j), splits)
      for b, branch in enumerate(compat.cond(eqn).branches)
      for j, e in enumerate(branch.jaxpr.eqns))


def eval_local(eqn, position, ins: Sequence[Any], splits: ModelSplits,
               axis_sizes: Mapping[str, int]) -> list[Any]:
  """`eqn` on this rank's blocks of `ins`.

  Args:
    eqn: an equation of the region (`is_local`).
    position: its position in the step's jaxpr (`ModelSplits.reduced` key; inside a
      conditional's branch, its `region_dims.nested` key).
    ins: its operands, the split ones as this rank's blocks.
    splits: the region's model splits.
    axis_sizes: mesh axis -> size.

  Returns:
    Its results, the split ones as this rank's blocks.
  """
  if compat.is_sharding_constraint(eqn) or eqn.primitive is lax.optimization_barrier_p:
    outs = list(ins) if compat.is_sharding_constraint(eqn) else lax.optimization_barrier(ins)
  elif eqn.primitive is compat.cond_p:
    cond = compat.cond(eqn)
    # The Plan names the user's line; the branches are traced on the region's mesh.
    with compat.source_of(compat.in_current_mesh(eqn)):
      outs = cond.bind(ins, [functools.partial(_branch, branch, (position, b), splits,
                                               axis_sizes)
                             for b, branch in enumerate(cond.branches)])
  else:
    # On the region's mesh, every axis manual: a result's layout names none of them.
    eqn = compat.in_current_mesh(eqn)
    params = compat.renamed_axes(eqn, {a: () for a in axis_sizes})
    if (rule := local_params.get(eqn.primitive, same_params)) is not same_params:
      out = eqn.outvars[0]
      params.update(rule(eqn, local_shape(out.aval.shape, splits.computed(position, out),
                                          axis_sizes)))
    outs = compat.rebind(eqn, *ins, **params)
  if (axes := splits.reduced.get(position)):
    combine = _ALL_REDUCE[dims.combine(eqn)]
    with compat.source_of(compat.in_current_mesh(eqn)):
      outs = [combine(x, axes) for x in outs]
  return list(outs)


def _branch(branch, key: tuple, splits: ModelSplits, axis_sizes: Mapping[str, int],
            ins: list) -> list:
  """One branch of a conditional on this rank's blocks: each equation as `eval_local`
  runs it (keyed `key + (position,)`), or as it is where it touches no block."""
  def hook(j, eqn, args):
    if is_local(eqn, (*key, j), splits):
      return eval_local(eqn, (*key, j), args, splits, axis_sizes)
    return inline.eval_eqn(eqn, args, rename={})
  return interpret.eval_jaxpr(branch.jaxpr, branch.consts, ins, hook, interpret.retyped)
