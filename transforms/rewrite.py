"""The rewrite: evaluate the step's jaxpr and retrace it with the weight update on shards.

An evaluate-and-retrace interpreter (the loop of `jax.core.eval_jaxpr`). Each
variable may be held whole, as this replica's shard, or both; the other form
is made on demand (`wus.transforms.values.Env`): a shard from a whole value
that is identical on every replica is a local slice (`collectives.shard`), a
whole value from a shard is an all-gather (`collectives.all_gather`).
Equations the Plan puts on shards run by the rule for their `Kind`
(`@shard_rule`); every other equation is re-bound unchanged on whole values.
A gradient all-reduce becomes a reduce-scatter with the padding fused in (Fig. 3).

Before/after for one Adam tensor (N = 8, w: f32[4,3] → flat [12] → pad 4 →
8 shards of [2]):

  g = psum_invariant[axes=(data,)] dw        g  = psum_scatter(pad(dw))      # [2]
  m2 = add (mul 0.1 g) (mul 0.9 m)           m2 = add (mul 0.1 g) (mul 0.9 m) # shard of m passed in
  w2 = add w (mul -lr (div m2 ...))          w2 = add (slice w) (...)         # [2]
  return w2, m2                              return all_gather(w2), m2
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from wus import collectives
from wus.analysis import compat, formats, rules
from wus.analysis.compat import ClosedJaxpr, JaxprEqn
from wus.analysis.formats import ShardFormat
from wus.analysis.plan import JaxprPlan, Plan
from wus.analysis.primitives import REDUCTIONS, Reduction
from wus.analysis.shardable import Kind
from wus.transforms import interpret, schedule
from wus.transforms.values import Env, Held


ShardRule = Callable[[JaxprEqn, Env], list[Any]]
shard_rules: dict[Kind, ShardRule] = {}
shard_rule = rules.registrar(shard_rules, "shard rule")


@shard_rule(Kind.ELEMENTWISE)
def _elementwise(eqn: JaxprEqn, env: Env) -> list[Any]:
  y = eqn.outvars[0]
  ins = [env.whole(x) if compat.is_literal(x) or not x.aval.shape else
         env.shard(x) if x.aval.shape == y.aval.shape else
         _broadcast_shard(env, x, y, range(len(y.aval.shape)))  # Implicit size-1 broadcast.
         for x in eqn.invars]
  # Scalars meeting shards are cast to varying once per variable or literal value.
  keys = [_literal_key(x) if compat.is_literal(x) else x if x.aval.shape in ((), y.aval.shape)
          else None for x in eqn.invars]
  # A result layout describes the whole value; shards have none.
  return compat.bind_elementwise(eqn, *compat.match_varying(ins, keys, env.casts),
                                 **compat.without_result_layout(eqn))


def _literal_key(atom) -> tuple:
  """A key for a literal's value and type (-0.0 and 0.0 differ)."""
  return ("literal", np.asarray(atom.val).tobytes(), atom.aval)


@shard_rule(Kind.LAYOUT, Kind.IDENTITY)
def _same_shard(eqn: JaxprEqn, env: Env) -> list[Any]:
  # Same elements in the same row-major order; IDENTITY: pmax / pmin of equal values.
  return [env.shard(eqn.invars[0])]


@shard_rule(Kind.REDUCE_UNIT)
def _reduce_unit(eqn: JaxprEqn, env: Env) -> list[Any]:
  # Each output element reduces one input element: reduce a unit dim of the shard.
  x = env.shard(eqn.invars[0])
  return [_bind_reduce(eqn, x[..., None], (x.ndim,))]


def _bind_reduce(eqn: JaxprEqn, x, axes: tuple[int, ...]) -> Any:
  extra = {"out_sharding": None} if "out_sharding" in eqn.params else {}
  (out,) = compat.bind(eqn, x, axes=tuple(axes), **extra)
  return out


def _masked(env: Env, v, x, reduction: Reduction) -> Any:
  """The shard `x` of `v` with its padding rows set to the reduction's identity."""
  fmt = env.fmt(v)
  if not fmt.padding:
    return x
  mask = collectives.row_mask(fmt, env.axes(v)).reshape((-1,) + (1,) * (x.ndim - 1))
  return jnp.where(mask, x, reduction.identity(x.dtype))


@shard_rule(Kind.REDUCE)
def _reduce(eqn: JaxprEqn, env: Env) -> list[Any]:
  # The format keeps reduced and kept dims in separate merged dims. A kept
  # shard dim makes the reduction local; a reduced one gives partial results.
  (v,), (y,) = eqn.invars, eqn.outvars
  reduction, axes = REDUCTIONS[eqn.primitive], set(eqn.params["axes"])
  reduced = tuple(k for k, g in enumerate(formats.merged_dims(env.fmt(v))) if g and g[0] in axes)
  x = env.shard(v)
  if 0 not in reduced:
    return [jnp.reshape(_bind_reduce(eqn, x, reduced), env.fmt(y).shard_shape)]
  partial = _bind_reduce(eqn, _masked(env, v, x, reduction), reduced)
  return [_Partial(jnp.reshape(partial, y.aval.shape), reduction.op, env.axes(v))]


@shard_rule(Kind.BROADCAST_DIMS)
def _broadcast_dims(eqn: JaxprEqn, env: Env) -> list[Any]:
  (x,), (y,) = eqn.invars, eqn.outvars
  return [_broadcast_shard(env, x, y, eqn.params["broadcast_dimensions"])]


def _broadcast_shard(env: Env, x, y, dims) -> Any:
  """y's shard of `x` broadcast to y's shape (x's dim i at y's dim dims[i]).

  Every merged dim of y's format holds dims that all come from x or are all
  new. With y's shard dim from x, x's shard supplies the rows; otherwise every
  row is the same and x is read whole.
  """
  fy = env.fmt(y)
  mapped = {dims[i] for i in formats.nonunit_dims(x.aval.shape)}
  dims_of = formats.merged_dims(fy)
  from_x = [bool(g) and g[0] in mapped for g in dims_of]
  if not from_x[0]:
    source, rows = env.whole(x), 1
  elif env.big(x):
    source, rows = env.shard(x), fy.shard_rows
  else:  # A small x supplies the shard dim: slice its rows locally.
    merged = tuple(fy.merged_shape[k] for k, f in enumerate(from_x) if f)
    fx = ShardFormat(tuple(x.aval.shape), merged, fy.num_shards)
    source, rows = collectives.shard(env.whole(x), fx, env.axes(y)), fy.shard_rows
  target = [(rows if k == 0 else fy.merged_shape[k]) if f else 1 for k, f in enumerate(from_x)]
  return jnp.broadcast_to(jnp.reshape(source, target), fy.shard_shape)


@shard_rule(Kind.REDUCE_ALL)
def _reduce_all(eqn: JaxprEqn, env: Env) -> list[Any]:
  # Mask the padding with the reduction's identity, reduce locally; the partial
  # results of all replicas are combined by one batched all-reduce (Fig. 6).
  (v,) = eqn.invars
  reduction = REDUCTIONS[eqn.primitive]
  x = _masked(env, v, env.shard(v), reduction)
  return [_Partial(_bind_reduce(eqn, x, tuple(range(x.ndim))), reduction.op, env.axes(v))]


@shard_rule(Kind.DOT_ALL)
def _dot_all(eqn: JaxprEqn, env: Env) -> list[Any]:
  # An inner product: the local dot of both shards, padding zeroed in both
  # (0 * inf would be NaN), summed across replicas with the other partials.
  sum_ = REDUCTIONS[lax.reduce_sum_p]
  a, b = (_masked(env, v, env.shard(v), sum_) for v in eqn.invars)
  dims = tuple(range(a.ndim))
  (out,) = compat.bind(eqn, *compat.match_varying([a, b]),
                       dimension_numbers=((dims, dims), ((), ())))
  return [_Partial(out, "sum", env.axes(eqn.invars[0]))]


class _Partial(tuple):
  """Marks a rule's output as a partial result: (value, op, the mesh axes to all-reduce
  it over: those of the shards it was reduced from)."""

  def __new__(cls, value, op, axes):
    return super().__new__(cls, (value, op, tuple(axes)))


@shard_rule(Kind.BROADCAST)
def _broadcast(eqn: JaxprEqn, env: Env) -> list[Any]:
  one = jnp.reshape(env.whole(eqn.invars[0]), ())
  return [jnp.broadcast_to(one, env.fmt(eqn.outvars[0]).shard_shape)]


@shard_rule(Kind.REDUCE_SCATTER)
def _reduce_scatter(eqn: JaxprEqn, env: Env) -> list[Any]:
  # Waits for its first reader, which reduce-scatters every waiting gradient
  # together (`Env.scatter`).
  (v,) = eqn.invars  # Differs across replicas: always held whole.
  env.summands.append(eqn.outvars[0])
  across = tuple(a for a in compat.collective_axes(eqn) if a not in env.plan.axes)
  return [Held(summand=env.whole(v), across=across)]


@shard_rule(Kind.SUM_OF_COPIES)
def _sum_of_copies(eqn: JaxprEqn, env: Env) -> list[Any]:
  copies = math.prod(lax.axis_size(a) for a in compat.collective_axes(eqn))
  return [collectives.sum_of_copies(env.shard(eqn.invars[0]), copies)]


@shard_rule(Kind.COND)
def _cond(eqn: JaxprEqn, env: Env) -> list[Any]:
  # Big operands enter every branch as shards; each branch is rewritten by its
  # own JaxprPlan and returns its big results as shards.
  branch_plans = env.jaxpr_plan.bodies[env.current]
  cond = compat.cond(eqn)
  ops = [env.shard(v) if k in branch_plans[0].sharded_in else env.whole(v)
         for k, v in enumerate(cond.operands)]
  fns = [functools.partial(_run, b, p, env.plan)
         for b, p in zip(cond.branches, branch_plans, strict=True)]
  return cond.bind([env.whole(cond.index), *ops], fns)


@shard_rule(Kind.LOOP)
def _loop(eqn: JaxprEqn, env: Env) -> list[Held]:
  # Carries the body's JaxprPlan holds as shards enter as shards (sliced before
  # the loop) and leave as shards; they are gathered after the loop only where
  # something reads them whole (Fig. 4).
  (body_plan,) = env.jaxpr_plan.bodies[env.current]
  loop = compat.loop(eqn)
  fmts = [body_plan.sharded_in.get(j) for j in loop.body_carry]  # Per carry: its format or None.
  ops = [*(env.whole(v) for v in loop.cond_consts + loop.consts),
         *(env.shard_as(v, f) if f else env.whole(v)
           for v, f in zip(loop.carry, fmts, strict=True)),
         *(env.whole(v) for v in loop.xs)]
  whole = JaxprPlan({}, {}, {})  # The condition reads only whole carries.
  outs = loop.bind(ops, functools.partial(_run, loop.body, body_plan, env.plan),
                   lambda a: _run(loop.cond, whole, env.plan, a))
  return [Held(shard=x) if k < loop.num_carry and fmts[k] else Held(whole=x)
          for k, x in enumerate(outs)]


@shard_rule(Kind.OWNED_SCATTER, Kind.OWNED)
def _owned(eqn: JaxprEqn, env: Env) -> list[Any]:
  # Owned updates run on whole tensors, each on its owner (`owned.OwnedUpdates.meet`).
  columns = env.owned.meet(eqn, env.jaxpr_plan.shard_eqns[env.current], env)
  return [Held(shard=x) for x in columns]


@shard_rule(Kind.SCATTER_BLOCKS)
def _scatter_blocks(eqn: JaxprEqn, env: Env) -> list[Any]:
  # A gradient all-reduce read by nothing else: one reduce-scatter over the replica axes
  # of every block, then over the blocks' axes. Otherwise the all-reduced value, the
  # reduce-scatter as written, and this replica's slice.
  (x,), (y,) = eqn.invars, eqn.outvars
  h, jaxpr = env.held[x], env.jaxpr
  if (h.summand is not None and not h.across and x in env.summands and x not in jaxpr.outvars
      and sum(x in e.invars for e in jaxpr.eqns) == 1):
    env.summands.remove(x)
    summand, h.summand = h.summand, None  # Held no more: no token (`Env.tokens`).
    return [collectives.scatter_blocks(summand, env.fmt(y), env.plan.axes,
                                       compat.collective_axes(eqn))]
  (whole,) = compat.bind(eqn, env.whole(x))
  return [collectives.shard(whole, env.fmt(y), env.axes(y))]


def rewrite(jaxpr: ClosedJaxpr, plan: Plan) -> Callable[..., list[Any]]:
  """The per-replica step with the Plan's weight update on shards.

  Args:
    jaxpr: the flat per-replica jaxpr the Plan was made from.
    plan: the Plan.

  Returns:
    A function to run inside `shard_map` over the same mesh. It takes one
    value per `jaxpr` input (inputs in `plan.rewrite.sharded_in` as this replica's
    shard, shape `format.shard_shape`; the rest whole) and returns one value per
    output (outputs in `plan.rewrite.sharded_out` as shards, the rest whole).
  """
  return lambda *args: _run(jaxpr, plan.rewrite, plan, args)


def _run(jaxpr: ClosedJaxpr, jaxpr_plan: JaxprPlan, plan: Plan, args) -> list[Any]:
  """Evaluates `jaxpr` by `jaxpr_plan` under the current trace (on `interpret.eval_eqns`, in
  the schedule's order, each value `Held`)."""
  env = Env(plan, jaxpr_plan)
  inner = env.jaxpr = jaxpr.jaxpr
  env.held.update(zip(inner.constvars, [Held(whole=c) for c in jaxpr.consts], strict=True))
  env.held.update(zip(inner.invars, [Held(shard=x) if k in jaxpr_plan.sharded_in
                                     else Held(whole=x) for k, x in enumerate(args)],
                      strict=True))
  interpret.eval_eqns(inner, env.held, functools.partial(_held, env),
                      schedule.schedule(inner, jaxpr_plan))
  return _outputs(env, inner, jaxpr_plan)


def _held(env: Env, i: int, eqn: JaxprEqn, ins: list[Held]) -> list[Held]:
  """Equation `i` rewritten (`_run`'s `interpret.Hook`): re-bound on whole values, or by
  the shard rule for its Kind. Its inputs are read from `env`, in the form the rule needs."""
  del ins
  env.current = i
  kind = env.jaxpr_plan.shard_eqns.get(i)
  if kind is None:
    return [Held(whole=x) for x in compat.bind(eqn, *[env.whole(v) for v in eqn.invars])]
  with compat.source_of(eqn):
    outs = shard_rules[kind](eqn, env)
  held = [x if isinstance(x, Held) else Held(partial=x) if isinstance(x, _Partial)
          else Held(shard=x) if env.big(v) else Held(whole=x)
          for v, x in zip(eqn.outvars, outs, strict=True)]
  env.pending += [v for v, h in zip(eqn.outvars, held) if h.partial is not None]
  return held


def _outputs(env: Env, inner, jaxpr_plan: JaxprPlan) -> list[Any]:
  """The jaxpr's outputs, each whole or as shards as `jaxpr_plan` returns it."""
  # The weights the step returns whole are all-gathered together, each bucket after
  # its outputs' `jaxpr_plan.gather_after`; an output computed whole that is tied
  # reads one of the gathered values that follows its own values too and is the
  # same on every replica, as it is (one that varies over no axis the output does
  # not: a weight split over a model axis cannot tie a count).
  gathered = list(dict.fromkeys(
      v for k, v in enumerate(inner.outvars) if k not in jaxpr_plan.sharded_out
      and not compat.is_literal(v) and env.held[v].whole is None
      and (env.held[v].shard is not None or env.held[v].summand is not None
           or (env.owned is not None and v in env.owned.own.outputs))))
  after: dict = {}  # Per output variable, the values its all-gather follows.
  for v, a in zip(inner.outvars, jaxpr_plan.gather_after):
    if a:  # A literal output follows nothing (and is no key).
      after.setdefault(v, {}).update(dict.fromkeys(a))
  env.gather(gathered, {v: tuple(after.get(v, ())) for v in gathered})
  outs = [env.shard(v) if k in jaxpr_plan.sharded_out else env.whole(v)
          for k, v in enumerate(inner.outvars)]
  tied = sorted(jaxpr_plan.tied_outputs) if gathered else []
  by_token: dict[Any, list[int]] = {}
  for k in tied:
    vma = compat.varying_axes(jax.typeof(outs[k]))
    t = next((u for u in gathered if set(jaxpr_plan.gather_after[k]) <= set(after.get(u, ()))
              and compat.varying_axes(jax.typeof(env.whole(u))) <= vma), None)
    if t is not None:
      by_token.setdefault(t, []).append(k)
  for t, ks in by_token.items():
    for k, x in zip(ks, collectives.after([outs[k] for k in ks], [env.whole(t)]), strict=True):
      outs[k] = x
  return outs
