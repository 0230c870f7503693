"""Which dims of an equation's operands and results are one dim: the rule table that
sharding propagation reads (GSPMD §3.5, `papers/xu2021-gspmd.md`), and the rules of the
primitives that keep, permute, reshape, reduce or contract dims.

A split (a mesh axis dividing a dim into blocks) passes through an equation
where the equation maps each block of an operand dim to the same block of a
result dim: an elementwise op's dims, a transpose's permuted dims, a reduction's
kept dims, a dot_general's batch and free dims, the major factor of the dims a
reshape merges or splits (GSPMD's rule), a slice's dims it keeps whole. Those are
*joined*. A dim the equation sums over (a reduction's axes, a dot_general's
contracting dims) is *summed*: a split there leaves per-block partial results,
which an all-reduce completes (`combine` says which). A dim the equation needs
whole (a cumulative sum's axis, a reversed, padded or indexed dim, a size-1 dim
broadcast) is *whole*: a split there cannot pass. Every operand dim of a rule is one
of the three; a dim a rule does not name is treated as whole, and a primitive without
a rule (`dim_rules.get(p, whole)`) needs every dim whole: the conservative default.

The rules of the primitives that index along a dim (slices, pads, sorts, gathers,
scatters) are registered in `analysis.dims_indexing`; the passes read the complete
table through `analysis.region_dims`.

Adding a primitive: register one `@dim_rule(prim)` beside its family's rules, here or
in `dims_indexing` (the checklist is in docs/layout.md).
"""

from __future__ import annotations

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


def is_var(v) -> bool:
  """Whether an operand is a value (not a literal), which a rule names by its dims."""
  return not compat.is_literal(v)


def shape_of(v) -> tuple:
  """A value's shape (a token's or an effect's: ())."""
  return tuple(getattr(v.aval, "shape", ()))


def whole(eqn: JaxprEqn) -> Dims:
  """The default: every dim of every operand and result needed whole."""
  return Dims([], [(v, d) for v in (*filter(is_var, eqn.invars), *eqn.outvars)
                   for d in range(len(shape_of(v)))])


def keep(eqn: JaxprEqn, v, out, kept: Callable[[int], bool]) -> Dims:
  """`v`'s dims joined with `out`'s, one for one, where `kept(d)`; the others whole."""
  if not is_var(v):
    return Dims([], [])
  dims = range(len(shape_of(v)))
  return Dims([((v, d), (out, d)) for d in dims if kept(d)],
              [n for d in dims if not kept(d) for n in ((v, d), (out, d))])


@dim_rule(*primitives.ELEMENTWISE)
def _elementwise(eqn) -> Dims:
  joins, whole_ = [], []
  for out in eqn.outvars:
    for v in filter(is_var, eqn.invars):
      if len(shape_of(v)) != len(shape_of(out)):
        continue  # A rank-0 operand (select_n's predicate, clamp's bounds).
      for d, (m, n) in enumerate(zip(shape_of(v), shape_of(out), strict=True)):
        (joins.append(((v, d), (out, d))) if m == n else whole_.append((v, d)))
  return Dims(joins, whole_)


@dim_rule(*rules.distinct(lax.optimization_barrier_p, compat.device_put_p, lax.stop_gradient_p,
                          compat.layout_constraint_p, compat.relayout_p))
def same_dims(eqn) -> Dims:
  """Operand k's dims are result k's (a barrier, a placement or layout, constraints)."""
  return Dims([((v, d), (o, d)) for v, o in zip(eqn.invars, eqn.outvars, strict=True)
               if is_var(v) for d in range(len(shape_of(o)))], [])


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
  entries = (*spec, *(None,) * (len(shape_of(out)) - len(spec)))
  return Dims(joins, [(out, d) for d, e in enumerate(entries[:len(shape_of(out))]) if e is None])


@dim_rule(lax.broadcast_in_dim_p)
def _broadcast(eqn) -> Dims:
  (v, *_), (out,) = eqn.invars, eqn.outvars
  if not is_var(v):
    return Dims([], [])
  joins, whole_ = [], []
  for d, e in enumerate(eqn.params["broadcast_dimensions"]):
    (joins.append(((v, d), (out, e))) if shape_of(v)[d] == shape_of(out)[e]
     else whole_.append((v, d)))
  return Dims(joins, whole_)


@dim_rule(*COMBINE.keys() - {lax.dot_general_p})
def _reduce(eqn) -> Dims:
  (v,), (out,) = eqn.invars, eqn.outvars
  axes = eqn.params["axes"]
  kept = [d for d in range(len(shape_of(v))) if d not in axes]
  return Dims([((v, d), (out, e)) for e, d in enumerate(kept)], [],
              [(v, d) for d in axes])


@dim_rule(lax.reduce_prod_p, lax.reduce_xor_p, lax.argmax_p, lax.argmin_p)
def _reduce_whole(eqn) -> Dims:
  """A reduction no all-reduce of ours completes: its reduced dims whole."""
  v, (out,) = eqn.invars[0], eqn.outvars
  axes = eqn.params["axes"]
  kept = [d for d in range(len(shape_of(v))) if d not in axes]
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
  lfree = [d for d in range(len(shape_of(lhs))) if d not in (*lc, *lb)]
  rfree = [d for d in range(len(shape_of(rhs))) if d not in (*rc, *rb)]
  joins += [((lhs, d), (out, len(lb) + k)) for k, d in enumerate(lfree)]
  joins += [((rhs, d), (out, len(lb) + len(lfree) + k)) for k, d in enumerate(rfree)]
  summed = [(v, d) for v, dims in ((lhs, lc), (rhs, rc)) if is_var(v) for d in dims]
  return Dims([(a, b) for a, b in joins if is_var(a[0]) and is_var(b[0])], [], summed)


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
  if eqn.params.get("dimensions") is not None or not is_var(v):
    return whole(eqn)
  a, b = shape_of(v), shape_of(out)
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
  kept = [d for d in range(len(shape_of(v))) if d not in eqn.params["dimensions"]]
  return Dims([((v, d), (out, e)) for e, d in enumerate(kept) if is_var(v)], [])


@dim_rule(lax.iota_p)
def _iota(eqn) -> Dims:
  """Each block would count from 0: an iota's dims are whole."""
  return whole(eqn)


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
  return Dims([(a, b) for a, b in joins if is_var(a[0]) and is_var(b[0])],
              [n for n in whole_ if is_var(n[0])], [n for n in ((lhs, ls[1]), (rhs, rs[1]))
                                                   if is_var(n[0])])


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
  arrays = [v for v in (*filter(is_var, eqn.invars), *eqn.outvars) if len(shape_of(v)) == rank]
  joins = [((a, d), (b, d)) for a, b in zip(arrays, arrays[1:]) for d in untouched]
  return Dims(joins, [(v, d) for v in arrays for d in range(rank) if d not in untouched])


@dim_rule(lax.bitcast_convert_type_p, lax.regularized_incomplete_beta_p, compat.zeros_like_p,
          compat.threefry2x32_p, compat.threefry4x32_p, compat.philox2x32_p,
          compat.philox4x32_p)
def _same_shapes(eqn) -> Dims:
  """Operands and results of one shape, computed element by element (counter-based
  random bits of per-element counters, a bitcast of one width): dim for dim one dim.
  Shapes that differ (a bitcast that adds or drops a dim): all whole."""
  arrays = [*filter(is_var, eqn.invars), *eqn.outvars]
  if len({shape_of(v) for v in arrays}) != 1:
    return whole(eqn)
  return Dims([((a, d), (b, d)) for a, b in zip(arrays, arrays[1:])
               for d in range(len(shape_of(a)))], [])


@dim_rule(compat.cond_p)
def _cond(eqn) -> Dims:
  """A conditional: each operand's dims are each branch's input's, each branch's result's
  the equation's (the branches' own equations are joined by `nested`)."""
  cond = compat.cond(eqn)
  joins = []
  for branch in cond.branches:
    inner = branch.jaxpr
    joins += [((v, d), (w, d)) for v, w in zip(cond.operands, inner.invars, strict=True)
              if is_var(v) for d in range(len(shape_of(v)))]
    joins += [((w, d), (o, d)) for w, o in zip(inner.outvars, eqn.outvars, strict=True)
              if is_var(w) for d in range(len(shape_of(o)))]
  return Dims(joins, [])


def combine(eqn: JaxprEqn) -> str:
  """The all-reduce ("sum", "max", "min", "and", "or") completing `eqn`'s partial results
  over a split summed dim."""
  return COMBINE.get(eqn.primitive, "sum")
