"""Facts about primitives that every pass reads: one table, keyed by primitive.

The redundancy analysis (§3.1), the shard rules (§4.1), the layouts and the
rewrite all ask the same questions of a primitive: is it a pure function of
its operands, does it act element by element, and if it is a reduction, how
do partial results over shards combine. Each answer lives here once.

  ELEMENTWISE  pure, outputs shaped like the operands (size-1 dims and rank-0
               operands broadcast): the same op runs on shards.
  PURE         pure and deterministic but not elementwise (structure,
               indexing, linear algebra, functional PRNG): identical inputs
               give identical outputs on every replica.
  REDUCTIONS   reductions whose partial results over shards combine with an
               all-reduce (§4.1, Fig. 6): the combining op and its identity,
               which masks the padding.

Primitives in neither set (effects, callbacks, collectives, calls and control
flow, which have rules of their own) are treated conservatively by each pass:
different on every replica, and never run on shards.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax
from jax.lax import linalg

from wus.analysis import compat

ELEMENTWISE: frozenset = frozenset({
    # Arithmetic, comparison, logic.
    lax.abs_p, lax.add_p, compat.add_any_p, lax.and_p, lax.atan2_p, lax.cbrt_p, lax.ceil_p,
    lax.clamp_p, lax.clz_p, lax.complex_p, lax.conj_p, lax.convert_element_type_p,
    lax.copy_p, lax.div_p, lax.eq_p, lax.floor_p, lax.ge_p, lax.gt_p, lax.imag_p,
    lax.integer_pow_p, lax.is_finite_p, lax.le_p, lax.lt_p, lax.max_p, lax.min_p, lax.mul_p,
    lax.ne_p, lax.neg_p, lax.nextafter_p, lax.not_p, lax.or_p, lax.population_count_p,
    lax.pow_p, lax.real_p, lax.reduce_precision_p, lax.rem_p, lax.round_p, lax.rsqrt_p,
    lax.select_n_p, lax.shift_left_p, lax.shift_right_arithmetic_p, lax.shift_right_logical_p,
    lax.sign_p, lax.sqrt_p, lax.square_p, lax.sub_p, lax.xor_p, compat.mulhi_p,
    # The operand itself, named for a remat policy (`checkpoint_name`).
    compat.name_p,
    # Transcendental and special functions.
    lax.acos_p, lax.acosh_p, lax.asin_p, lax.asinh_p, lax.atan_p, lax.atanh_p,
    lax.bessel_i0e_p, lax.bessel_i1e_p, lax.cos_p, lax.cosh_p, lax.digamma_p, lax.erf_inv_p,
    lax.erf_p, lax.erfc_p, lax.exp2_p, lax.exp_p, lax.expm1_p, lax.igamma_p,
    lax.igamma_grad_a_p, lax.igammac_p, lax.lgamma_p, lax.log1p_p, lax.log_p, lax.logistic_p,
    lax.polygamma_p, lax.sin_p, lax.sinh_p, lax.tan_p,
    lax.tanh_p, lax.zeta_p,
    # Later JAX releases (None on jax 0.10): jnp.log2; 1 - x^2 as (1 + x)(1 - x);
    # Horner's rule on x with broadcast coefficients (jnp.polyval).
    compat.log2_p, compat.one_minus_square_p, compat.polynomial_p,
}) - {None}
# PURE only: bitcast_convert_type changes the shape when the widths differ;
# regularized_incomplete_beta is elementwise, but JAX 0.10 lowers it with a
# while loop whose carries break check_vma on varying (sharded) operands.

PURE: frozenset = frozenset({
    # Structure and indexing.
    lax.bitcast_convert_type_p, lax.regularized_incomplete_beta_p, lax.broadcast_in_dim_p,
    lax.concatenate_p,
    lax.dynamic_slice_p, lax.dynamic_update_slice_p, lax.gather_p, lax.iota_p, lax.pad_p,
    lax.reshape_p, lax.rev_p, lax.scatter_add_p, lax.scatter_max_p, lax.scatter_min_p,
    lax.scatter_mul_p, lax.scatter_p, lax.scatter_sub_p, lax.slice_p, lax.split_p,
    lax.squeeze_p, lax.transpose_p, compat.stack_p, compat.unstack_p, compat.tile_p,
    # Reductions, scans, sorting, windows.
    lax.argmax_p, lax.argmin_p, lax.cumlogsumexp_p, lax.cummax_p, lax.cummin_p,
    lax.cumprod_p, lax.cumsum_p, lax.reduce_and_p, lax.reduce_max_p, lax.reduce_min_p,
    lax.reduce_or_p, lax.reduce_p, lax.reduce_prod_p, lax.reduce_sum_p, lax.reduce_xor_p,
    lax.sort_p, lax.top_k_p, compat.approx_top_k_p, lax.reduce_window_p,
    lax.reduce_window_sum_p, lax.reduce_window_max_p, lax.reduce_window_min_p,
    lax.select_and_gather_add_p, lax.select_and_scatter_add_p, lax.select_and_scatter_p,
    # Linear algebra.
    lax.conv_general_dilated_p, lax.dot_general_p, compat.ragged_dot_general_p, lax.fft_p,
    linalg.cholesky_p, linalg.cholesky_update_p, linalg.eig_p, linalg.eigh_p,
    linalg.hessenberg_p, linalg.householder_product_p, linalg.lu_p,
    linalg.lu_pivots_to_permutation_p, linalg.ormqr_p, linalg.qr_p, linalg.schur_p,
    linalg.svd_p, compat.geqrf_p, compat.geqp3_p,
    linalg.symmetric_product_p, linalg.triangular_solve_p, linalg.tridiagonal_p,
    linalg.tridiagonal_solve_p,
    # Values unchanged, only their placement or differentiation.
    lax.stop_gradient_p, lax.optimization_barrier_p, lax.sharding_constraint_p,
    compat.reshard_p, compat.layout_constraint_p, compat.device_put_p, compat.zeros_like_p,
    compat.relayout_p,
    # The same platform runs every replica.
    compat.platform_index_p,
    # Functional PRNG: the same key gives the same bits everywhere.
    lax.rng_bit_generator_p, compat.threefry2x32_p, compat.threefry4x32_p,
    compat.philox2x32_p, compat.philox4x32_p, compat.iota_2x32_shape_p,
    compat.random_bits_p, compat.random_split_p, compat.random_fold_in_p,
    compat.random_seed_p, compat.random_wrap_p, compat.random_unwrap_p,
    compat.random_gamma_p, compat.random_clone_p,
}) - {None}
# Deliberately in neither set, hence varying: rng_uniform (stateful),
# callbacks (io_callback, pure_callback: the host may answer differently per
# device), nested shard_map, pbroadcast_dynamic (a broadcast from a replica
# chosen at run time; JAX lowers it for GPUs only, so no rule of ours could be
# tested here), and any primitive JAX adds later.


@dataclasses.dataclass(frozen=True)
class Reduction:
  """How partial reductions over shards combine (§4.1, Fig. 6).

  Attributes:
    op: the all-reduce that combines the partial results of all replicas:
      "sum", "max", "min", or for booleans "and" (all) / "or" (any); the
      collectives implement each name (`wus.collectives.all_reduce`).
  """

  op: str

  def identity(self, dtype) -> jnp.ndarray:
    """The value padding is masked with: it leaves the reduction unchanged."""
    if self.op == "sum":
      return jnp.zeros((), dtype)
    if self.op in ("and", "or"):
      return jnp.asarray(self.op == "and", dtype)
    big = jnp.inf if jnp.issubdtype(dtype, jnp.inexact) else jnp.iinfo(dtype).max
    return jnp.asarray(-big if self.op == "max" else big, dtype)


REDUCTIONS: dict = {
    lax.reduce_sum_p: Reduction("sum"), lax.reduce_max_p: Reduction("max"),
    lax.reduce_min_p: Reduction("min"), lax.reduce_and_p: Reduction("and"),
    lax.reduce_or_p: Reduction("or"),
}
# reduce_prod, reduce_xor and the generic reduce have no exact combine:
# a reduction of that kind over the shard dim keeps its cluster whole.
REDUCE_OVER_UNIT_DIMS: frozenset = frozenset({*REDUCTIONS, lax.reduce_prod_p})
