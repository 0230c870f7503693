"""The rewrite: evaluate the step's jaxpr and retrace it with the weight update on shards.

An evaluate-and-retrace interpreter (the loop of `jax.core.eval_jaxpr`). Each
variable may be held whole, as this replica's shard, or both; the other form
is made on demand: a shard from a whole value that is identical on every
replica is a local slice (`collectives.shard`), a whole value from a shard is
an all-gather (`collectives.all_gather`). Equations the Plan puts on shards
run by the rule for their `Kind` (`shard_rules`); every other equation is
re-bound unchanged on whole values. A gradient all-reduce becomes a
reduce-scatter with the padding fused in (Fig. 3).

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
from wus.analysis import compat, formats
from wus.analysis.compat import ClosedJaxpr, JaxprEqn
from wus.analysis.formats import ShardFormat
from wus.analysis.plan import JaxprPlan, Plan
from wus.analysis.primitives import REDUCTIONS, Reduction
from wus.analysis.shardable import Kind
from wus.transforms import owned, schedule


class _Held:
  """A variable's value in the rewritten program: whole, shard, or both.

  `partial` is this replica's part of a reduction still to be all-reduced,
  as (value, op, axes); the whole value appears when it is first read. `summand`
  is this replica's addend of a gradient all-reduce still to be
  reduce-scattered, and `across` the mesh axes beyond the sharding axes its
  all-reduce spans (partial sharding, §5.2); the shard appears when it is
  first read.
  """

  __slots__ = ("whole", "shard", "partial", "summand", "across")

  def __init__(self, whole=None, shard=None, partial=None, summand=None, across=()):
    self.whole, self.shard, self.partial, self.summand = whole, shard, partial, summand
    self.across = across


class _Env:
  """Variable values of one jaxpr, converting between whole and shard on demand."""

  def __init__(self, plan: Plan, jaxpr_plan: JaxprPlan):
    self.plan, self.jaxpr_plan = plan, jaxpr_plan
    self.held: dict = {}
    self.pending: list = []  # Variables holding partial results.
    self.summands: list = []  # Variables waiting for their reduce-scatter.
    self.casts: dict = {}    # Whole values cast to varying (compat.match_varying).
    self.current = -1        # Index of the equation being rewritten.
    self.owned = (owned.Region(plan) if plan.owned is not None and jaxpr_plan is plan.jaxpr_plan
                  else None)

  def fmt(self, v) -> ShardFormat:
    return self.plan.formats[v]

  def axes(self, v) -> tuple:
    """The mesh axes `v`'s shards lie over (`Plan.shard_axes`)."""
    return self.plan.shard_axes(self.fmt(v))

  def big(self, v) -> bool:
    """Whether the Plan holds `v` as shards where the update reads or writes it."""
    return not compat.is_literal(v) and v in self.plan.formats

  def whole(self, v) -> Any:
    if compat.is_literal(v):
      return v.val
    h = self.held[v]
    if h.partial is not None:
      self.flush()
    if h.whole is None and h.shard is None:
      self.scatter()
    if h.whole is None and v in self.plan.gather_dtypes:
      # Weights kept sharded across a loop's iterations, read by the forward
      # pass in a narrower float: gathered in it (Fig. 4 right, Fig. 7), all
      # together at the first read (§5.2).
      self.gather([u for u, held in self.held.items() if u in self.plan.gather_dtypes
                   and held.whole is None and held.shard is not None])
    if h.whole is None:
      h.whole = collectives.all_gather(h.shard, self.fmt(v), self.axes(v))
    return h.whole

  def shard(self, v) -> Any:
    h = self.held[v]
    if h.summand is not None:
      self.scatter()
    if h.shard is None:
      h.shard = collectives.shard(self.whole(v), self.fmt(v), self.axes(v))
    return h.shard

  def flush(self) -> None:
    """All-reduces every pending partial result: one collective per op, dtype and the
    axes of the shards it was reduced from (§5.2)."""
    groups: dict = {}
    for v in self.pending:
      value, op, axes = self.held[v].partial
      groups.setdefault((op, value.dtype, axes), []).append(v)
    for (op, _, axes), vs in groups.items():
      outs = collectives.all_reduce([self.held[v].partial[0] for v in vs], op, axes)
      for v, x in zip(vs, outs, strict=True):
        self.held[v].whole, self.held[v].partial = x, None
    self.pending = []

  def scatter(self) -> None:
    """Reduce-scatters every waiting gradient, batched (§5.2); in partial
    sharding the shards are then all-reduced across the groups, batched too
    (Fig. 10). Gradients of updates sharded over `Plan.copy_axes` too are summed
    over the replica axes alone, in collectives of their own."""
    vs, self.summands = self.summands, []
    dtypes, rows, row_fmts = self.owned.to_scatter() if self.owned is not None else ([], [], [])
    values = [self.held[v].summand for v in vs] + rows
    outs = collectives.batched.grouped(
        [self.axes(v)[len(self.plan.axes):] for v in vs] + [()] * len(rows),
        lambda copies, xs, fmts: collectives.batched.reduce_scatter(
            xs, fmts, self.plan.axes, self.plan.bucket_bytes, self.plan.alone_bytes,
            keys=_vma(xs), copies=copies),
        values, [self.fmt(v) for v in vs] + row_fmts)
    if dtypes:  # Rows of owned gradients, in the same batched reduce-scatters.
      self.owned.scattered(dtypes, outs[len(vs):])
    groups: dict = {}
    for v, x in zip(vs, outs[:len(vs)], strict=True):
      self.held[v].shard, self.held[v].summand = x, None
      if self.held[v].across:
        groups.setdefault(self.held[v].across, []).append(v)
    for across, us in groups.items():
      shards = [self.held[u].shard for u in us]
      summed = collectives.batched.all_reduce_bucketed(shards, across, self.plan.bucket_bytes,
                                                       keys=_vma(shards))
      for u, x in zip(us, summed, strict=True):
        self.held[u].shard = x

  def gather(self, vs: list, after: tuple = ()) -> None:
    """Gives each of `vs` (held as shards) its whole value, batched (§5.2); in
    the narrower float of `plan.gather_dtypes` where it has one (Fig. 7). The
    all-gathers follow the values `after` (`JaxprPlan.gather_after`)."""
    narrow = self.plan.gather_dtypes
    mine = [v for v in vs if self.owned is None or v not in self.owned.own.outputs]
    shards = [self.shard(v) if v not in narrow else self.shard(v).astype(narrow[v]) for v in mine]
    # Rows of owned new weights join the same batched all-gathers (§5.2).
    dtypes, rows, row_fmts = self.owned.to_gather() if len(mine) < len(vs) else ([], [], [])
    shards += rows
    if after and shards:
      shards = collectives.after(shards, self.tokens(after))
    outs = collectives.batched.grouped(  # Shards over `copy_axes` too: collectives of their own.
        [self.axes(v) for v in mine] + [tuple(self.plan.axes)] * len(rows),
        lambda over, xs, fmts: collectives.batched.all_gather(
            xs, fmts, over, self.plan.bucket_bytes, self.plan.alone_bytes, keys=_vma(xs)),
        shards, [self.fmt(v) for v in mine] + row_fmts)
    wholes = dict(zip(mine, outs, strict=False))
    if dtypes:
      wholes.update(self.owned.gathered(dtypes, outs[len(mine):]))
    for v in vs:
      self.held[v].whole = wholes[v]

  def tokens(self, vs) -> list:
    """The values of `vs` that vary over no mesh axis but the sharding axes (as
    shards or whole): what `collectives.after` may tie the values gathered over
    those axes to and leave them the same across the others (partial sharding)."""
    values = [self.shard(u) if u in self.plan.formats else self.whole(u) for u in vs]
    return [x for x in values if compat.varying_axes(jax.typeof(x)) <= set(self.plan.axes)]

  def shard_as(self, v, fmt: ShardFormat) -> Any:
    """The shard of `v` in `fmt`, which may differ from the plan's format for `v`."""
    if self.plan.formats.get(v) == fmt:
      return self.shard(v)
    return collectives.shard(self.whole(v), fmt, self.plan.shard_axes(fmt))


def _vma(values) -> list[frozenset]:
  """The mesh axes each value varies over (JAX's types under check_vma): the batched
  collectives' bucket keys (a weight split over a model axis never shares a bucket
  with a replicated one)."""
  return [compat.varying_axes(jax.typeof(x)) for x in values]


ShardRule = Callable[[JaxprEqn, _Env], list[Any]]
shard_rules: dict[Kind, ShardRule] = {}


def _elementwise(eqn: JaxprEqn, env: _Env) -> list[Any]:
  y = eqn.outvars[0]
  ins = [env.whole(x) if compat.is_literal(x) or not x.aval.shape else
         env.shard(x) if x.aval.shape == y.aval.shape else
         _broadcast_shard(env, x, y, range(len(y.aval.shape)))  # Implicit size-1 broadcast.
         for x in eqn.invars]
  # Scalars meeting shards are cast to varying once per variable or literal value.
  keys = [_literal_key(x) if compat.is_literal(x) else x if x.aval.shape in ((), y.aval.shape)
          else None for x in eqn.invars]
  # A result layout describes the whole value; shards have none.
  return compat.bind(eqn, *compat.match_varying(ins, keys, env.casts),
                     **compat.without_result_layout(eqn))


def _literal_key(atom) -> tuple:
  """A key for a literal's value and type (-0.0 and 0.0 differ)."""
  return ("literal", np.asarray(atom.val).tobytes(), atom.aval)


def _same_shard(eqn: JaxprEqn, env: _Env) -> list[Any]:
  return [env.shard(eqn.invars[0])]  # Same elements in the same row-major order.


def _reduce_unit(eqn: JaxprEqn, env: _Env) -> list[Any]:
  # Each output element reduces one input element: reduce a unit dim of the shard.
  x = env.shard(eqn.invars[0])
  return [_bind_reduce(eqn, x[..., None], (x.ndim,))]


def _bind_reduce(eqn: JaxprEqn, x, axes: tuple[int, ...]) -> Any:
  extra = {"out_sharding": None} if "out_sharding" in eqn.params else {}
  (out,) = compat.bind(eqn, x, axes=tuple(axes), **extra)
  return out


def _masked(env: _Env, v, x, reduction: Reduction) -> Any:
  """The shard `x` of `v` with its padding rows set to the reduction's identity."""
  fmt = env.fmt(v)
  if not fmt.padding:
    return x
  mask = collectives.row_mask(fmt, env.axes(v)).reshape((-1,) + (1,) * (x.ndim - 1))
  return jnp.where(mask, x, reduction.identity(x.dtype))


def _reduce(eqn: JaxprEqn, env: _Env) -> list[Any]:
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


def _broadcast_dims(eqn: JaxprEqn, env: _Env) -> list[Any]:
  (x,), (y,) = eqn.invars, eqn.outvars
  return [_broadcast_shard(env, x, y, eqn.params["broadcast_dimensions"])]


def _broadcast_shard(env: _Env, x, y, dims) -> Any:
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


def _reduce_all(eqn: JaxprEqn, env: _Env) -> list[Any]:
  # Mask the padding with the reduction's identity, reduce locally; the partial
  # results of all replicas are combined by one batched all-reduce (Fig. 6).
  (v,) = eqn.invars
  reduction = REDUCTIONS[eqn.primitive]
  x = _masked(env, v, env.shard(v), reduction)
  return [_Partial(_bind_reduce(eqn, x, tuple(range(x.ndim))), reduction.op, env.axes(v))]


def _dot_all(eqn: JaxprEqn, env: _Env) -> list[Any]:
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


def _broadcast(eqn: JaxprEqn, env: _Env) -> list[Any]:
  one = jnp.reshape(env.whole(eqn.invars[0]), ())
  return [jnp.broadcast_to(one, env.fmt(eqn.outvars[0]).shard_shape)]


def _reduce_scatter(eqn: JaxprEqn, env: _Env) -> list[Any]:
  # Waits for its first reader, which reduce-scatters every waiting gradient
  # together (`_Env.scatter`).
  (v,) = eqn.invars  # Differs across replicas: always held whole.
  env.summands.append(eqn.outvars[0])
  across = tuple(a for a in compat.collective_axes(eqn) if a not in env.plan.axes)
  return [_Held(summand=env.whole(v), across=across)]


def _sum_of_copies(eqn: JaxprEqn, env: _Env) -> list[Any]:
  copies = math.prod(lax.axis_size(a) for a in compat.collective_axes(eqn))
  return [collectives.sum_of_copies(env.shard(eqn.invars[0]), copies)]


shard_rules.update({Kind.ELEMENTWISE: _elementwise, Kind.LAYOUT: _same_shard,
                    Kind.REDUCE_UNIT: _reduce_unit, Kind.REDUCE_ALL: _reduce_all,
                    Kind.REDUCE: _reduce, Kind.DOT_ALL: _dot_all,
                    Kind.BROADCAST_DIMS: _broadcast_dims})


def _cond(eqn: JaxprEqn, env: _Env) -> list[Any]:
  # Big operands enter every branch as shards; each branch is rewritten by its
  # own JaxprPlan and returns its big results as shards.
  branch_plans = env.jaxpr_plan.bodies[env.current]
  cond = compat.cond(eqn)
  ops = [env.shard(v) if k in branch_plans[0].sharded_in else env.whole(v)
         for k, v in enumerate(cond.operands)]
  fns = [functools.partial(_run, b, p, env.plan)
         for b, p in zip(cond.branches, branch_plans, strict=True)]
  return cond.bind([env.whole(cond.index), *ops], fns)


shard_rules[Kind.COND] = _cond


def _loop(eqn: JaxprEqn, env: _Env) -> list[_Held]:
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
  return [_Held(shard=x) if k < loop.num_carry and fmts[k] else _Held(whole=x)
          for k, x in enumerate(outs)]


shard_rules[Kind.LOOP] = _loop


def _owned(eqn: JaxprEqn, env: _Env) -> list[Any]:
  # Owned updates run on whole tensors, each on its owner (`owned.Region.meet`).
  columns = env.owned.meet(eqn, env.jaxpr_plan.shard_eqns[env.current], env)
  return [_Held(shard=x) for x in columns]


shard_rules.update({Kind.OWNED_SCATTER: _owned, Kind.OWNED: _owned, Kind.BROADCAST: _broadcast,
                    Kind.REDUCE_SCATTER: _reduce_scatter, Kind.SUM_OF_COPIES: _sum_of_copies,
                    Kind.IDENTITY: _same_shard})  # IDENTITY: pmax / pmin of equal values.


def rewrite(jaxpr: ClosedJaxpr, plan: Plan) -> Callable[..., list[Any]]:
  """The per-replica step with the Plan's weight update on shards.

  Args:
    jaxpr: the flat per-replica jaxpr the Plan was made from.
    plan: the Plan.

  Returns:
    A function to run inside `shard_map` over the same mesh. It takes one
    value per `jaxpr` input (inputs in `plan.state_inputs` as this replica's
    shard, shape `format.shard_shape`; the rest whole) and returns one value per
    output (outputs in `plan.state_outputs` as shards, the rest whole).
  """
  return lambda *args: _run(jaxpr, plan.jaxpr_plan, plan, args)


def _run(jaxpr: ClosedJaxpr, jaxpr_plan: JaxprPlan, plan: Plan, args) -> list[Any]:
  """Evaluates `jaxpr` by `jaxpr_plan` under the current trace (the interpreter loop)."""
  env = _Env(plan, jaxpr_plan)
  inner = env.jaxpr = jaxpr.jaxpr
  for v, c in zip(inner.constvars, jaxpr.consts, strict=True):
    env.held[v] = _Held(whole=c)
  for k, (v, x) in enumerate(zip(inner.invars, args, strict=True)):
    env.held[v] = _Held(shard=x) if k in jaxpr_plan.sharded_in else _Held(whole=x)
  for i in schedule.schedule(inner, jaxpr_plan):
    eqn, env.current = inner.eqns[i], i
    kind = jaxpr_plan.shard_eqns.get(i)
    if kind is None:
      outs = compat.bind(eqn, *[env.whole(v) for v in eqn.invars])
      held = [_Held(whole=x) for x in outs]
    else:
      with compat.source_of(eqn):
        outs = shard_rules[kind](eqn, env)
      held = [x if isinstance(x, _Held) else _Held(partial=x) if isinstance(x, _Partial)
              else _Held(shard=x) if env.big(v) else _Held(whole=x)
              for v, x in zip(eqn.outvars, outs, strict=True)]
      env.pending += [v for v, h in zip(eqn.outvars, held) if h.partial is not None]
    for v, h in zip(eqn.outvars, held, strict=True):
      env.held[v] = h
  # The weights the step returns whole are all-gathered together, after
  # `jaxpr_plan.gather_after`; the outputs computed whole that are tied to them
  # read one of the gathered values, which follows those values too and is
  # the same on every replica, as they are (one that varies over no axis the
  # output does not: a weight split over a model axis cannot tie a count).
  gathered = list(dict.fromkeys(
      v for k, v in enumerate(inner.outvars) if k not in jaxpr_plan.sharded_out
      and not compat.is_literal(v) and env.held[v].whole is None
      and (env.held[v].shard is not None or env.held[v].summand is not None
           or (env.owned is not None and v in env.owned.own.outputs))))
  after = jaxpr_plan.gather_after
  env.gather(gathered, after)
  outs = [env.shard(v) if k in jaxpr_plan.sharded_out else env.whole(v)
          for k, v in enumerate(inner.outvars)]
  tied = sorted(jaxpr_plan.tied_outputs) if gathered and after else []
  wholes = [env.whole(v) for v in gathered]
  by_token: dict[int, list[int]] = {}
  for k in tied:
    vma = compat.varying_axes(jax.typeof(outs[k]))
    t = next((t for t, x in enumerate(wholes) if compat.varying_axes(jax.typeof(x)) <= vma), None)
    if t is not None:
      by_token.setdefault(t, []).append(k)
  for t, ks in by_token.items():
    for k, x in zip(ks, collectives.after([outs[k] for k in ks], [wholes[t]]), strict=True):
      outs[k] = x
  return outs
