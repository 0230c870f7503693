"""The dims rules of the primitives that index along a dim: slices, pads, reversals,
cumulative ops, concatenations and splits, sorts, gathers and scatters (registered in
`dims.dim_rules`, read through `analysis.region_dims`).

Each keeps the split of a dim it takes whole, block for block; a dim it indexes (slices
at an offset, pads, reverses, runs along, joins or cuts, sorts, gathers from or scatters
into) is whole: a block there does not hold the elements the equation reads.
"""

from __future__ import annotations

from jax import lax

from wus.analysis import rules
from wus.analysis.dims import Dims, dim_rule, is_var, keep, shape_of


@dim_rule(lax.slice_p)
def _slice(eqn) -> Dims:
  """A dim the slice keeps whole (from 0 to its end, stride 1) keeps its split."""
  (v,), (out,) = eqn.invars, eqn.outvars
  return keep(eqn, v, out, lambda d: shape_of(v)[d] == shape_of(out)[d]
               and (eqn.params["strides"] is None or eqn.params["strides"][d] == 1))


@dim_rule(lax.dynamic_slice_p)
def _dynamic_slice(eqn) -> Dims:
  """A dim the slice takes whole (its start index is then 0) keeps its split."""
  v, out = eqn.invars[0], eqn.outvars[0]
  return keep(eqn, v, out, lambda d: shape_of(v)[d] == shape_of(out)[d])


@dim_rule(lax.dynamic_update_slice_p)
def _dynamic_update_slice(eqn) -> Dims:
  """The operand's dims are the result's; an update dim as long as the operand's is one
  with them, a shorter one (written at an offset) needs all three whole."""
  v, update, out = eqn.invars[0], eqn.invars[1], eqn.outvars[0]
  full = lambda d: shape_of(update)[d] == shape_of(out)[d]  # noqa: E731
  joins, whole_, _ = keep(eqn, v, out, full)
  if is_var(update):
    for d in range(len(shape_of(out))):
      (joins.append(((update, d), (out, d))) if full(d) else whole_.append((update, d)))
  return Dims(joins, whole_)


@dim_rule(lax.pad_p)
def _pad(eqn) -> Dims:
  """A dim without padding keeps its split."""
  v, out = eqn.invars[0], eqn.outvars[0]
  config = eqn.params["padding_config"]
  return keep(eqn, v, out, lambda d: tuple(config[d]) == (0, 0, 0))


@dim_rule(lax.rev_p)
def _rev(eqn) -> Dims:
  (v,), (out,) = eqn.invars, eqn.outvars
  return keep(eqn, v, out, lambda d: d not in eqn.params["dimensions"])


@dim_rule(lax.cumsum_p, lax.cumprod_p, lax.cummax_p, lax.cummin_p, lax.cumlogsumexp_p)
def _cumulative(eqn) -> Dims:
  (v,), (out,) = eqn.invars, eqn.outvars
  return keep(eqn, v, out, lambda d: d != eqn.params["axis"])


@dim_rule(lax.concatenate_p)
def _concatenate(eqn) -> Dims:
  """The dims along which operands are not joined are one dim in all of them."""
  out, axis = eqn.outvars[0], eqn.params["dimension"]
  joins, whole_ = [], [(out, axis)]
  for v in filter(is_var, eqn.invars):
    joins += [((v, d), (out, d)) for d in range(len(shape_of(out))) if d != axis]
    whole_.append((v, axis))
  return Dims(joins, whole_)


@dim_rule(*rules.distinct(lax.split_p))
def _split(eqn) -> Dims:
  (v,), axis = eqn.invars, eqn.params["axis"]
  joins = [((v, d), (o, d)) for o in eqn.outvars for d in range(len(shape_of(v))) if d != axis]
  return Dims(joins, [(v, axis), *((o, axis) for o in eqn.outvars)])


@dim_rule(lax.sort_p)
def _sort(eqn) -> Dims:
  """Every operand and result are one dim but the sorted one."""
  dim, first = eqn.params["dimension"], eqn.invars[0]
  rank = len(shape_of(first))
  vals = [*filter(is_var, eqn.invars), *eqn.outvars]
  joins = [((first, d), (v, d)) for v in vals[1:] for d in range(rank) if d != dim]
  return Dims(joins, [(v, dim) for v in vals])


@dim_rule(lax.top_k_p)
def _top_k(eqn) -> Dims:
  (v,) = eqn.invars
  last = len(shape_of(v)) - 1
  joins = [((v, d), (o, d)) for o in eqn.outvars for d in range(last)]
  return Dims(joins, [(v, last), *((o, last) for o in eqn.outvars)])


@dim_rule(lax.gather_p)
def _gather(eqn) -> Dims:
  """The indices' batch dims are the result's batch dims (an embedding lookup keeps
  the tokens' split); an operand dim sliced whole and not indexed is its offset dim;
  operand and index batching dims are one with the result's; the rest is whole."""
  operand, indices = eqn.invars
  (out,) = eqn.outvars
  dn, sizes = eqn.params["dimension_numbers"], eqn.params["slice_sizes"]
  index_rank = len(shape_of(indices))
  index_batch = [d for d in range(index_rank) if d != index_rank - 1]
  out_batch = [d for d in range(len(shape_of(out))) if d not in dn.offset_dims]
  joins = [((indices, d), (out, e)) for d, e in zip(index_batch, out_batch, strict=True)]
  for od, id_ in zip(dn.operand_batching_dims, dn.start_indices_batching_dims, strict=True):
    joins.append(((operand, od), (indices, id_)))
  offset = [d for d in range(len(shape_of(operand)))
            if d not in dn.collapsed_slice_dims and d not in dn.operand_batching_dims]
  whole_ = [(indices, index_rank - 1)]
  for d, e in zip(offset, dn.offset_dims, strict=True):
    if sizes[d] == shape_of(operand)[d] and d not in dn.start_index_map:
      joins.append(((operand, d), (out, e)))
    else:
      whole_ += [(operand, d), (out, e)]
  whole_ += [(operand, d) for d in dn.collapsed_slice_dims]
  return Dims([(a, b) for a, b in joins if is_var(a[0]) and is_var(b[0])], whole_)


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
  rank = len(shape_of(out))
  joins = [((operand, d), (out, d)) for d in range(rank)]
  window = [d for d in range(rank)
            if d not in dn.inserted_window_dims and d not in dn.operand_batching_dims]
  whole_ = []
  for d, u in zip(window, dn.update_window_dims, strict=True):
    if shape_of(updates)[u] == shape_of(out)[d] and d not in dn.scatter_dims_to_operand_dims:
      joins.append(((updates, u), (out, d)))
    else:
      whole_ += [(updates, u), (out, d)]
  whole_ += [(out, d) for d in dn.inserted_window_dims]
  index_rank = len(shape_of(indices))
  scatter_dims = [d for d in range(len(shape_of(updates))) if d not in dn.update_window_dims]
  index_batch = [d for d in range(index_rank) if d != index_rank - 1]
  joins += [((indices, d), (updates, e)) for d, e in zip(index_batch, scatter_dims,
                                                         strict=True)]
  batching = {}  # Updates scatter dim -> the operand batching dim it stays in.
  for od, id_ in zip(dn.operand_batching_dims, dn.scatter_indices_batching_dims, strict=True):
    joins.append(((operand, od), (indices, id_)))
    batching[scatter_dims[index_batch.index(id_)]] = od
  whole_ += [(updates, d) for d in scatter_dims if d not in batching]
  whole_.append((indices, index_rank - 1))
  return Dims([(a, b) for a, b in joins if is_var(a[0]) and is_var(b[0])],
              [n for n in whole_ if is_var(n[0])])
