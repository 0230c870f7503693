"""The program of a global-view step (`wus.jit`): its forward and backward pass as traced,
then the update region as a shard_map through the rewrite (`analysis/global_view.py`).
"""

from __future__ import annotations

from collections.abc import Callable

from jax import lax

from wus.analysis import compat, global_view
from wus.transforms import inline


def run(flat, region: global_view.Region, sub, *ops):
  """The step: the forward and backward pass as traced, then the region's sharded step.

  Args:
    flat: the step's global jaxpr (calls inlined), closed.
    region: its update region.
    sub: the region's compiled sharded step (`pipeline.Compiled`).
    *ops: one value per input of `flat` (sharded state as its padded shards).

  Returns:
    A tuple, one value per output of `flat`.
  """
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


def region_fn(jaxpr, region: global_view.Region, axes: tuple) -> Callable[..., tuple]:
  """The region as one replica's program, to trace inside a shard_map over `axes`: each
  gradient sum on this replica's rows, then all-reduced (`psum`), which the rewrite
  turns into a reduce-scatter; the update's equations as they are."""
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
