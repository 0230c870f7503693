"""Which dims of an equation's operands and results are one dim: the rule table that
sharding propagation reads (GSPMD §3.5, `papers/xu2021-gspmd.md`).

A split (a mesh axis dividing a dim into blocks) passes through an equation
where the equation maps each block of an operand dim to the same block of a
result dim: an elementwise op's dims, a transpose's permuted dims, a reduction's
kept dims, a dot_general's batch and free dims, the major factor of the dims a
reshape merges or splits (GSPMD's rule), a slice's dims it keeps whole. Those are
*joined*. A dim the equation sums over (a reduction's axes, a dot_general's
contracting dims) is *summed*: a split there leaves per-block partial results,
which an all-reduce completes. A dim the equation needs whole (a cumulative sum's
axis, a reversed, padded or indexed dim, a size-1 dim broadcast) is *whole*: a
split there cannot pass. Every operand dim of a rule is one of the three; a dim a
rule does not name is treated as whole, and a primitive without a rule
(`dim_rules.get(p, whole)`) needs every dim whole: the conservative default.

Two passes read the table:
  * `analysis.propagation` carries the batch's splits forward through the whole
    step (`wus.jit`): which values the batch axes split, and which equations sum
    them;
  * `analysis.model_splits` solves the model splits of the update region as
    equalities between joined dims (a union-find), each summed dim an all-reduce
    over the model axes.

Adding a primitive: register one `@dim_rule(prim)` here (the checklist is in
docs/layout.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

from jax import lax

from wus.analysis import compat, primitives, rules
from wus.analysis.compat import JaxprEqn

Node = tuple  # (value, dim)


class Dims(NamedTuple):
  """What one equation does to the dims of its operands and results.

  Attributes:
    joins: pairs of (value, dim) that are one dim: split alike, block for block.
    whole: (value, dim) the equation needs whole.
    summed: operand (value, dim) the results sum (or max, min) over: a split there
      leaves a partial result that an all-reduce over its axes completes
      (`combine` says which all-reduce).
  """

  joins: list
  whole: list
  summed: list = []


DimRule = Callable[[JaxprEqn], Dims]
dim_rules: dict[compat.Primitive, DimRule] = {}
dim_rule = rules.registrar(dim_rules, "dim rule")

# The all-reduce completing a partial result over a summed dim, by primitive: a
# reduction's combining op (`primitives.REDUCTIONS`), a contraction's sum.
COMBINE: dict[compat.Primitive, str] = {
    **{p: r.op for p, r in primitives.REDUCTIONS.items()}, lax.dot_general_p: "sum"}


def of(eqn: JaxprEqn) -> Dims:
  """The rule's `Dims` of `eqn` (every dim whole for a primitive without a rule)."""
  return dim_rules.get(eqn.primitive, whole)(eqn)


def _var(v) -> bool:
  return not compat.is_literal(v)


def _shape(v) -> tuple:
  return tuple(getattr(v.aval, "shape", ()))


def whole(eqn: JaxprEqn) -> Dims:
  """The default: every dim of every operand and result needed whole."""
  return Dims([], [(v, d) for v in (*filter(_var, eqn.invars), *eqn.outvars)
                   for d in range(len(_shape(v)))])


def _keep(eqn: JaxprEqn, v, out, kept: Callable[[int], bool]) -> Dims:
  """`v`'s dims joined with `out`'s, one for one, where `kept(d)`; the others whole."""
  if not _var(v):
    return Dims([], [])
  dims = range(len(_shape(v)))
  return Dims([((v, d), (out, d)) for d in dims if kept(d)],
              [n for d in dims if not kept(d) for n in ((v, d), (out, d))])


@dim_rule(*primitives.ELEMENTWISE)
def _elementwise(eqn) -> Dims:
  joins, whole_ = [], []
  for out in eqn.outvars:
    for v in filter(_var, eqn.invars):
      if len(_shape(v)) != len(_shape(out)):
        continue  # A rank-0 operand (select_n's predicate, clamp's bounds).
      for d, (m, n) in enumerate(zip(_shape(v), _shape(out), strict=True)):
        (joins.append(((v, d), (out, d))) if m == n else whole_.append((v, d)))
  return Dims(joins, whole_)


@dim_rule(*rules.distinct(lax.optimization_barrier_p, compat.device_put_p, lax.stop_gradient_p,
                          compat.layout_constraint_p, compat.relayout_p))
def same_dims(eqn) -> Dims:
  """Operand k's dims are result k's (a barrier, a placement or layout, constraints)."""
  return Dims([((v, d), (o, d)) for v, o in zip(eqn.invars, eqn.outvars, strict=True)
               if _var(v) for d in range(len(_shape(o)))], [])


@dim_rule(*rules.distinct(lax.sharding_constraint_p, compat.reshard_p))
def _constraint(eqn) -> Dims:
  """A sharding constraint: its result's dims are its operand's, and a dim its spec leaves
  None is whole (a block the constraint replicates cannot be laid out so: the region then
  does not run on blocks, and the step keeps the constraint's meaning under jax.jit)."""
  joins, _, _ = same_dims(eqn)
  spec = compat.constraint_spec(eqn)
  if spec is None or not compat.lays_out(eqn):  # JAX's own reshards on Auto axes: none.
    return Dims(joins, [])
  out = eqn.outvars[0]
  entries = (*spec, *(None,) * (len(_shape(out)) - len(spec)))
  return Dims(joins, [(out, d) for d, e in enumerate(entries[:len(_shape(out))]) if e is None])


@dim_rule(lax.broadcast_in_dim_p)
def _broadcast(eqn) -> Dims:
  (v, *_), (out,) = eqn.invars, eqn.outvars
  if not _var(v):
    return Dims([], [])
  joins, whole_ = [], []
  for d, e in enumerate(eqn.params["broadcast_dimensions"]):
    (joins.append(((v, d), (out, e))) if _shape(v)[d] == _shape(out)[e]
     else whole_.append((v, d)))
  return Dims(joins, whole_)


@dim_rule(*COMBINE.keys() - {lax.dot_general_p})
def _reduce(eqn) -> Dims:
  (v,), (out,) = eqn.invars, eqn.outvars
  axes = eqn.params["axes"]
  kept = [d for d in range(len(_shape(v))) if d not in axes]
  return Dims([((v, d), (out, e)) for e, d in enumerate(kept)], [],
              [(v, d) for d in axes])


@dim_rule(lax.reduce_prod_p, lax.reduce_xor_p, lax.argmax_p, lax.argmin_p)
def _reduce_whole(eqn) -> Dims:
  """A reduction no all-reduce of ours completes: its reduced dims whole."""
  v, (out,) = eqn.invars[0], eqn.outvars
  axes = eqn.params["axes"]
  kept = [d for d in range(len(_shape(v))) if d not in axes]
  return Dims([((v, d), (out, e)) for e, d in enumerate(kept)], [(v, d) for d in axes])


@dim_rule(lax.transpose_p)
def _transpose(eqn) -> Dims:
  (v,), (out,) = eqn.invars, eqn.outvars
  return Dims([((v, d), (out, e)) for e, d in enumerate(eqn.params["permutation"])], [])


@dim_rule(lax.dot_general_p)
def _dot_general(eqn) -> Dims:
  (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
  lhs, rhs = eqn.invars
  (out,) = eqn.outvars
  joins = [((lhs, d), (rhs, e)) for d, e in zip((*lc, *lb), (*rc, *rb), strict=True)]
  joins += [((lhs, d), (out, k)) for k, d in enumerate(lb)]
  lfree = [d for d in range(len(_shape(lhs))) if d not in (*lc, *lb)]
  rfree = [d for d in range(len(_shape(rhs))) if d not in (*rc, *rb)]
  joins += [((lhs, d), (out, len(lb) + k)) for k, d in enumerate(lfree)]
  joins += [((rhs, d), (out, len(lb) + len(lfree) + k)) for k, d in enumerate(rfree)]
  summed = [(v, d) for v, dims in ((lhs, lc), (rhs, rc)) if _var(v) for d in dims]
  return Dims([(a, b) for a, b in joins if _var(a[0]) and _var(b[0])], [], summed)


def groups(a: tuple, b: tuple) -> list[tuple[list[int], list[int]]]:
  """The dims of two shapes of one size, grouped where their products meet: a reshape
  maps each group of `a`'s dims to the group of `b`'s with the same elements."""
  out, i, j = [], 0, 0
  while i < len(a) or j < len(b):
    ga, gb, pa, pb = [], [], 1, 1
    while True:
      if pa <= pb and i < len(a):
        pa *= a[i]
        ga.append(i)
        i += 1
      elif j < len(b):
        pb *= b[j]
        gb.append(j)
        j += 1
      else:
        break
      if pa == pb and (i == len(a) or a[i] != 1 or j == len(b)):
        break
    out.append((ga, gb))
  return out


@dim_rule(lax.reshape_p)
def _reshape(eqn) -> Dims:
  """GSPMD's rule: in each group of dims a reshape merges or splits, the major (first
  non-1) dims of both sides are one dim; the other dims of the group are whole. A split
  of the major dim is a run of whole rows, the same elements on both sides, where its
  axes divide both major dims (which `model_splits` checks per value)."""
  v, out = eqn.invars[0], eqn.outvars[0]
  if eqn.params.get("dimensions") is not None or not _var(v):
    return whole(eqn)
  a, b = _shape(v), _shape(out)
  joins, whole_ = [], []
  for ga, gb in groups(a, b):
    ma = [d for d in ga if a[d] != 1]
    mb = [d for d in gb if b[d] != 1]
    if ma and mb:
      joins.append(((v, ma[0]), (out, mb[0])))
    whole_ += [(v, d) for d in ma[1:]] + [(out, d) for d in mb[1:]]
  return Dims(joins, whole_)


@dim_rule(lax.squeeze_p)
def _squeeze(eqn) -> Dims:
  (v,), (out,) = eqn.invars, eqn.outvars
  kept = [d for d in range(len(_shape(v))) if d not in eqn.params["dimensions"]]
  return Dims([((v, d), (out, e)) for e, d in enumerate(kept) if _var(v)], [])


@dim_rule(lax.slice_p)
def _slice(eqn) -> Dims:
  """A dim the slice keeps whole (from 0 to its end, stride 1) keeps its split."""
  (v,), (out,) = eqn.invars, eqn.outvars
  return _keep(eqn, v, out, lambda d: _shape(v)[d] == _shape(out)[d]
               and (eqn.params["strides"] is None or eqn.params["strides"][d] == 1))


@dim_rule(lax.dynamic_slice_p)
def _dynamic_slice(eqn) -> Dims:
  """A dim the slice takes whole (its start index is then 0) keeps its split."""
  v, out = eqn.invars[0], eqn.outvars[0]
  return _keep(eqn, v, out, lambda d: _shape(v)[d] == _shape(out)[d])


@dim_rule(lax.dynamic_update_slice_p)
def _dynamic_update_slice(eqn) -> Dims:
  """The operand's dims are the result's; an update dim as long as the operand's is one
  with them, a shorter one (written at an offset) needs all three whole."""
  v, update, out = eqn.invars[0], eqn.invars[1], eqn.outvars[0]
  full = lambda d: _shape(update)[d] == _shape(out)[d]  # noqa: E731
  joins, whole_, _ = _keep(eqn, v, out, full)
  if _var(update):
    for d in range(len(_shape(out))):
      (joins.append(((update, d), (out, d))) if full(d) else whole_.append((update, d)))
  return Dims(joins, whole_)


@dim_rule(lax.pad_p)
def _pad(eqn) -> Dims:
  """A dim without padding keeps its split."""
  v, out = eqn.invars[0], eqn.outvars[0]
  config = eqn.params["padding_config"]
  return _keep(eqn, v, out, lambda d: tuple(config[d]) == (0, 0, 0))


@dim_rule(lax.rev_p)
def _rev(eqn) -> Dims:
  (v,), (out,) = eqn.invars, eqn.outvars
  return _keep(eqn, v, out, lambda d: d not in eqn.params["dimensions"])


@dim_rule(lax.cumsum_p, lax.cumprod_p, lax.cummax_p, lax.cummin_p, lax.cumlogsumexp_p)
def _cumulative(eqn) -> Dims:
  (v,), (out,) = eqn.invars, eqn.outvars
  return _keep(eqn, v, out, lambda d: d != eqn.params["axis"])


@dim_rule(lax.concatenate_p)
def _concatenate(eqn) -> Dims:
  """The dims along which operands are not joined are one dim in all of them."""
  out, axis = eqn.outvars[0], eqn.params["dimension"]
  joins, whole_ = [], [(out, axis)]
  for v in filter(_var, eqn.invars):
    joins += [((v, d), (out, d)) for d in range(len(_shape(out))) if d != axis]
    whole_.append((v, axis))
  return Dims(joins, whole_)


@dim_rule(*rules.distinct(lax.split_p))
def _split(eqn) -> Dims:
  (v,), axis = eqn.invars, eqn.params["axis"]
  joins = [((v, d), (o, d)) for o in eqn.outvars for d in range(len(_shape(v))) if d != axis]
  return Dims(joins, [(v, axis), *((o, axis) for o in eqn.outvars)])


@dim_rule(lax.sort_p)
def _sort(eqn) -> Dims:
  """Every operand and result are one dim but the sorted one."""
  dim, first = eqn.params["dimension"], eqn.invars[0]
  rank = len(_shape(first))
  vals = [*filter(_var, eqn.invars), *eqn.outvars]
  joins = [((first, d), (v, d)) for v in vals[1:] for d in range(rank) if d != dim]
  return Dims(joins, [(v, dim) for v in vals])


@dim_rule(lax.top_k_p)
def _top_k(eqn) -> Dims:
  (v,) = eqn.invars
  last = len(_shape(v)) - 1
  joins = [((v, d), (o, d)) for o in eqn.outvars for d in range(last)]
  return Dims(joins, [(v, last), *((o, last) for o in eqn.outvars)])


@dim_rule(lax.iota_p)
def _iota(eqn) -> Dims:
  """Each block would count from 0: an iota's dims are whole."""
  return whole(eqn)


@dim_rule(lax.gather_p)
def _gather(eqn) -> Dims:
  """The indices' batch dims are the result's batch dims (an embedding lookup keeps
  the tokens' split); an operand dim sliced whole and not indexed is its offset dim;
  operand and index batching dims are one with the result's; the rest is whole."""
  operand, indices = eqn.invars
  (out,) = eqn.outvars
  dn, sizes = eqn.params["dimension_numbers"], eqn.params["slice_sizes"]
  index_rank = len(_shape(indices))
  index_batch = [d for d in range(index_rank) if d != index_rank - 1]
  out_batch = [d for d in range(len(_shape(out))) if d not in dn.offset_dims]
  joins = [((indices, d), (out, e)) for d, e in zip(index_batch, out_batch, strict=True)]
  for od, id_ in zip(dn.operand_batching_dims, dn.start_indices_batching_dims, strict=True):
    joins.append(((operand, od), (indices, id_)))
  offset = [d for d in range(len(_shape(operand)))
            if d not in dn.collapsed_slice_dims and d not in dn.operand_batching_dims]
  whole_ = [(indices, index_rank - 1)]
  for d, e in zip(offset, dn.offset_dims, strict=True):
    if sizes[d] == _shape(operand)[d] and d not in dn.start_index_map:
      joins.append(((operand, d), (out, e)))
    else:
      whole_ += [(operand, d), (out, e)]
  whole_ += [(operand, d) for d in dn.collapsed_slice_dims]
  return Dims([(a, b) for a, b in joins if _var(a[0]) and _var(b[0])], whole_)


@dim_rule(lax.scatter_add_p, lax.scatter_p, lax.scatter_mul_p, lax.scatter_min_p,
          lax.scatter_max_p, *rules.distinct(getattr(lax, "scatter_sub_p", None)))
def _scatter(eqn) -> Dims:
  """The operand's dims are the result's; an update window dim as long as an operand dim
  it is not scattered into is one with it; the updates' scatter dims are the indices'
  batch dims. The scattered dims (where updates land at indexed rows) are whole: a
  scatter-add of split updates is a gradient sum only where `global_view` says so."""
  operand, indices, updates = eqn.invars[:3]
  (out,) = eqn.outvars
  dn = eqn.params["dimension_numbers"]
  rank = len(_shape(out))
  joins = [((operand, d), (out, d)) for d in range(rank)]
  window = [d for d in range(rank)
            if d not in dn.inserted_window_dims and d not in dn.operand_batching_dims]
  whole_ = []
  for d, u in zip(window, dn.update_window_dims, strict=True):
    if _shape(updates)[u] == _shape(out)[d] and d not in dn.scatter_dims_to_operand_dims:
      joins.append(((updates, u), (out, d)))
    else:
      whole_ += [(updates, u), (out, d)]
  whole_ += [(out, d) for d in dn.inserted_window_dims]
  index_rank = len(_shape(indices))
  scatter_dims = [d for d in range(len(_shape(updates))) if d not in dn.update_window_dims]
  index_batch = [d for d in range(index_rank) if d != index_rank - 1]
  joins += [((indices, d), (updates, e)) for d, e in zip(index_batch, scatter_dims,
                                                         strict=True)]
  batching = {}  # Updates scatter dim -> the operand batching dim it stays in.
  for od, id_ in zip(dn.operand_batching_dims, dn.scatter_indices_batching_dims, strict=True):
    joins.append(((operand, od), (indices, id_)))
    batching[scatter_dims[index_batch.index(id_)]] = od
  whole_ += [(updates, d) for d in scatter_dims if d not in batching]
  whole_.append((indices, index_rank - 1))
  return Dims([(a, b) for a, b in joins if _var(a[0]) and _var(b[0])],
              [n for n in whole_ if _var(n[0])])


@dim_rule(lax.conv_general_dilated_p)
def _conv(eqn) -> Dims:
  """The batch dim and the output features pass; the input features are summed; the
  spatial dims (windows cross them) are whole. Grouped convolutions: all whole."""
  if eqn.params["feature_group_count"] != 1 or eqn.params["batch_group_count"] != 1:
    return whole(eqn)
  lhs, rhs = eqn.invars
  (out,) = eqn.outvars
  dn = eqn.params["dimension_numbers"]
  ls, rs, os = dn.lhs_spec, dn.rhs_spec, dn.out_spec
  joins = [((lhs, ls[0]), (out, os[0])), ((rhs, rs[0]), (out, os[1])),
           ((lhs, ls[1]), (rhs, rs[1]))]
  whole_ = [(v, d) for v, spec in ((lhs, ls), (rhs, rs), (out, os)) for d in spec[2:]]
  return Dims([(a, b) for a, b in joins if _var(a[0]) and _var(b[0])],
              [n for n in whole_ if _var(n[0])], [n for n in ((lhs, ls[1]), (rhs, rs[1]))
                                                   if _var(n[0])])


@dim_rule(lax.reduce_window_sum_p, lax.reduce_window_max_p, lax.reduce_window_min_p,
          lax.reduce_window_p, lax.select_and_gather_add_p, lax.select_and_scatter_add_p,
          lax.select_and_scatter_p)
def _window(eqn) -> Dims:
  """Pooling and its gradients: a dim the window does not cross (window 1, stride 1, no
  padding or dilation) keeps its split, block for block; the others are whole. The
  operands of the window's shape (and the results) share those dims; the scalar initial
  values of a generic `reduce_window` have none."""
  p = eqn.params
  rank = len(p["window_dimensions"])
  untouched = [d for d in range(rank) if p["window_dimensions"][d] == 1
               and p["window_strides"][d] == 1 and tuple(p["padding"][d]) == (0, 0)
               and all(p.get(k, (1,) * rank)[d] == 1 for k in ("base_dilation",
                                                              "window_dilation"))]
  arrays = [v for v in (*filter(_var, eqn.invars), *eqn.outvars) if len(_shape(v)) == rank]
  joins = [((a, d), (b, d)) for a, b in zip(arrays, arrays[1:]) for d in untouched]
  return Dims(joins, [(v, d) for v in arrays for d in range(rank) if d not in untouched])


@dim_rule(lax.bitcast_convert_type_p, lax.regularized_incomplete_beta_p, compat.zeros_like_p,
          compat.threefry2x32_p, compat.threefry4x32_p, compat.philox2x32_p,
          compat.philox4x32_p)
def _same_shapes(eqn) -> Dims:
  """Operands and results of one shape, computed element by element (counter-based
  random bits of per-element counters, a bitcast of one width): dim for dim one dim.
  Shapes that differ (a bitcast that adds or drops a dim): all whole."""
  arrays = [*filter(_var, eqn.invars), *eqn.outvars]
  if len({_shape(v) for v in arrays}) != 1:
    return whole(eqn)
  return Dims([((a, d), (b, d)) for a, b in zip(arrays, arrays[1:])
               for d in range(len(_shape(a)))], [])


@dim_rule(compat.cond_p)
def _cond(eqn) -> Dims:
  """A conditional: each operand's dims are each branch's input's, each branch's result's
  the equation's (the branches' own equations are joined by `nested`)."""
  cond = compat.cond(eqn)
  joins = []
  for branch in cond.branches:
    inner = branch.jaxpr
    joins += [((v, d), (w, d)) for v, w in zip(cond.operands, inner.invars, strict=True)
              if _var(v) for d in range(len(_shape(v)))]
    joins += [((w, d), (o, d)) for w, o in zip(inner.outvars, eqn.outvars, strict=True)
              if _var(w) for d in range(len(_shape(o)))]
  return Dims(joins, [])


def nested(eqns) -> list:
  """(key, equation) of `eqns` (pairs of key and equation) and, after each conditional,
  its branches' equations, keyed (key, branch, position), recursively: what one pass over
  the dims of a region with conditionals reads."""
  out = []
  for key, eqn in eqns:
    out.append((key, eqn))
    if eqn.primitive is compat.cond_p:
      for b, branch in enumerate(compat.cond(eqn).branches):
        out += nested(((key, b, j), e) for j, e in enumerate(branch.jaxpr.eqns))
  return out


def top(key) -> int:
  """The position in the region of the equation a `nested` key belongs to."""
  while isinstance(key, tuple):
    key = key[0]
  return key


def combine(eqn: JaxprEqn) -> str:
  """The all-reduce ("sum", "max", "min", "and", "or") completing `eqn`'s partial results
  over a split summed dim."""
  return COMBINE.get(eqn.primitive, "sum")


def divides(n: int, axes, axis_sizes) -> bool:
  """Whether `axes` (a tuple of mesh axes, or None) divide a dim of size `n`."""
  return not axes or n % math.prod(axis_sizes[a] for a in axes) == 0
