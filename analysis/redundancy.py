"""Cross-replica redundancy: which values are identical on every replica (§3.1).

The fact for a value is the set of mesh axes over which it is identical on all
replicas ("replicated over"). Top is every manual axis (constants, inputs whose
in_spec does not split them); bottom is the empty set (may differ across every
axis); the meet of two facts is their intersection.

Sources: literals and constants, inputs not split over an axis, outputs of
all-reduces (psum, psum_invariant, pmax, pmin) and all-gathers. Kills:
axis_index and what depends on it, effects (callbacks, I/O), collectives over
replica subgroups (axis_index_groups), and every primitive without a rule.
Control flow recurses: cond meets its predicate with all branches; while and
scan run a bounded fixed point over their carries.

Rules live in `redundancy_rules`, keyed by primitive, as JAX's own checkers
do. A primitive without a rule is conservatively varying over every axis.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from jax import lax
from jax.lax import linalg

from wus.analysis import compat
from wus.analysis.compat import ClosedJaxpr, Jaxpr, JaxprEqn, Var

Rep = frozenset  # The mesh axes a value is replicated over.


@dataclasses.dataclass
class Redundancy:
  """Facts for every variable of a jaxpr and the jaxprs nested in it.

  Attributes:
    all_axes: the manual mesh axes facts range over (the top element).
    facts: fact per variable. A sub-jaxpr analysed several times (a loop body
      during its fixed point, or a jaxpr shared by two equations) holds the
      facts of its last analysis.
  """

  all_axes: frozenset
  facts: dict[Var, Rep] = dataclasses.field(default_factory=dict)

  def of(self, atom) -> Rep:
    """The fact of a variable or literal (literals are identical everywhere)."""
    return self.all_axes if compat.is_literal(atom) else self.facts[atom]

  def is_redundant(self, atom, axes: frozenset) -> bool:
    """Whether `atom` is identical on every replica of the mesh axes `axes`."""
    return axes <= self.of(atom)

  def repeats(self, eqn: JaxprEqn, axes: frozenset) -> bool:
    """Whether every replica of `axes` runs `eqn` to the same end: all its
    outputs identical across them, and no side effects (§3.1)."""
    return (not compat.side_effects(eqn)
            and all(self.is_redundant(v, axes) for v in eqn.outvars))


def why_differs(jaxpr: Jaxpr, facts: Redundancy, v, axes: frozenset) -> str:
  """Why `v` of `jaxpr` may differ across the replicas of `axes`, in words.

  Follows `v` back to where the difference enters: an input split by its
  in_spec (this replica's batch), `axis_index`, an effect, or a primitive
  without a redundancy rule (which the analysis conservatively calls
  differing). Names the first such equation and its place in user code.
  """
  producer = {u: eqn for eqn in jaxpr.eqns for u in eqn.outvars}
  inputs = {u: k for k, u in enumerate(jaxpr.invars)}
  seen, todo = set(), [v]
  while todo:
    u = todo.pop(0)
    if u in seen or compat.is_literal(u) or facts.is_redundant(u, axes):
      continue
    seen.add(u)
    eqn = producer.get(u)
    if eqn is None:
      if u in inputs:
        return f"it depends on input {inputs[u]}, which differs across replicas"
      continue
    varying = [w for w in eqn.invars if not compat.is_literal(w)
               and not facts.is_redundant(w, axes)]
    if varying:
      todo += varying
      continue
    where = f"{eqn.primitive} at {compat.source_line(eqn)}"
    if eqn.primitive not in redundancy_rules:
      return (f"{where} has no redundancy rule, so wus treats its result as differing "
              "across replicas")
    if compat.side_effects(eqn):
      return f"it depends on {where}, which has side effects"
    return f"it depends on {where}"
  return "it differs across replicas"


RedundancyRule = Callable[[JaxprEqn, list[Rep], Redundancy], list[Rep]]
redundancy_rules: dict[compat.Primitive, RedundancyRule] = {}


def analyze(jaxpr: Jaxpr | ClosedJaxpr, in_rep: Sequence[Rep],
            all_axes: frozenset, result: Redundancy | None = None) -> Redundancy:
  """Runs the redundancy analysis on a shard_map body.

  Args:
    jaxpr: the per-replica jaxpr. Constants of a ClosedJaxpr are identical on
      every replica.
    in_rep: one fact per input variable, for example every manual axis not
      named in the input's in_spec.
    all_axes: the manual mesh axes of the shard_map.
    result: facts to add to (used by the recursive rules).

  Returns:
    The facts of every variable, nested jaxprs included; `out_rep(...)` gives
    the outputs'.
  """
  result = Redundancy(frozenset(all_axes)) if result is None else result
  _eval(jaxpr, in_rep, result)
  return result


def out_rep(jaxpr: Jaxpr | ClosedJaxpr, facts: Redundancy) -> list[Rep]:
  """The facts of a jaxpr's outputs after `analyze`."""
  inner = jaxpr.jaxpr if isinstance(jaxpr, ClosedJaxpr) else jaxpr
  return [facts.of(v) for v in inner.outvars]


def _eval(jaxpr: Jaxpr | ClosedJaxpr, in_rep: Sequence[Rep], facts: Redundancy) -> list[Rep]:
  """One pass over `jaxpr`: the interpreter loop of `jax.core.eval_jaxpr`."""
  inner = jaxpr.jaxpr if isinstance(jaxpr, ClosedJaxpr) else jaxpr
  for v in inner.constvars:
    facts.facts[v] = facts.all_axes
  for v, r in zip(inner.invars, in_rep, strict=True):
    facts.facts[v] = frozenset(r)
  for eqn in inner.eqns:
    ins = [facts.of(v) for v in eqn.invars]
    rule = redundancy_rules.get(eqn.primitive)
    if rule is None or (compat.side_effects(eqn) and eqn.primitive not in _RECURSIVE):
      outs = [frozenset()] * len(eqn.outvars)  # Unknown or effectful: varying.
    else:
      outs = rule(eqn, ins, facts)
    for v, r in zip(eqn.outvars, outs, strict=True):
      facts.facts[v] = r
  return out_rep(inner, facts)


def _meet(reps: Sequence[Rep], top: frozenset) -> Rep:
  out = top
  for r in reps:
    out = out & r
  return out


# --- Pure primitives: the meet of the inputs. -------------------------------

def _standard_rule(eqn: JaxprEqn, ins: list[Rep], facts: Redundancy) -> list[Rep]:
  return [_meet(ins, facts.all_axes)] * len(eqn.outvars)


def register_standard(*prims: compat.Primitive) -> None:
  """Declares primitives pure and deterministic: output fact = meet of inputs."""
  for p in prims:
    redundancy_rules[p] = _standard_rule


register_standard(
    # Elementwise arithmetic, comparison, logic, special functions.
    lax.abs_p, lax.acos_p, lax.acosh_p, lax.add_p, compat.add_any_p, lax.and_p,
    lax.asin_p, lax.asinh_p, lax.atan2_p, lax.atan_p, lax.atanh_p,
    lax.bessel_i0e_p, lax.bessel_i1e_p, lax.cbrt_p, lax.ceil_p, lax.clamp_p,
    lax.clz_p, lax.complex_p, lax.conj_p, lax.convert_element_type_p,
    lax.bitcast_convert_type_p, lax.copy_p, lax.cos_p, lax.cosh_p,
    lax.digamma_p, lax.div_p, lax.eq_p, lax.erf_inv_p, lax.erf_p, lax.erfc_p,
    lax.exp2_p, lax.exp_p, lax.expm1_p, lax.floor_p, lax.ge_p, lax.gt_p,
    lax.igamma_p, lax.igammac_p, lax.igamma_grad_a_p, lax.imag_p,
    lax.integer_pow_p, lax.is_finite_p, lax.le_p, lax.lgamma_p, lax.log1p_p,
    lax.log_p, lax.logistic_p, lax.lt_p, lax.max_p, lax.min_p, lax.mul_p,
    lax.ne_p, lax.neg_p, lax.nextafter_p, lax.not_p, lax.or_p,
    lax.polygamma_p, lax.population_count_p, lax.pow_p, lax.real_p,
    lax.reduce_precision_p, lax.regularized_incomplete_beta_p, lax.rem_p,
    lax.round_p, lax.rsqrt_p, lax.select_n_p, lax.shift_left_p,
    lax.shift_right_arithmetic_p, lax.shift_right_logical_p, lax.sign_p,
    lax.sin_p, lax.sinh_p, lax.sqrt_p, lax.square_p, lax.sub_p, lax.tan_p,
    lax.tanh_p, lax.xor_p, lax.zeta_p,
    # Structure, indexing, reductions, linear algebra: deterministic functions
    # of their operands.
    lax.argmax_p, lax.argmin_p, lax.broadcast_in_dim_p, lax.concatenate_p,
    lax.conv_general_dilated_p, lax.cumlogsumexp_p, lax.cummax_p,
    lax.cummin_p, lax.cumprod_p, lax.cumsum_p, lax.dot_general_p,
    lax.dynamic_slice_p, lax.dynamic_update_slice_p, lax.fft_p, lax.gather_p,
    lax.iota_p, lax.pad_p, lax.reduce_and_p, lax.reduce_max_p,
    lax.reduce_min_p, lax.reduce_or_p, lax.reduce_p, lax.reduce_prod_p,
    lax.reduce_sum_p, lax.reduce_xor_p, lax.reshape_p, lax.rev_p,
    lax.scatter_add_p, lax.scatter_max_p, lax.scatter_min_p,
    lax.scatter_mul_p, lax.scatter_p, lax.scatter_sub_p, lax.slice_p,
    lax.sort_p, lax.split_p, lax.squeeze_p, lax.top_k_p, lax.transpose_p,
    lax.reduce_window_p, lax.reduce_window_sum_p, lax.reduce_window_max_p,
    lax.reduce_window_min_p, lax.select_and_gather_add_p,
    lax.select_and_scatter_add_p, lax.select_and_scatter_p,
    lax.stop_gradient_p, lax.optimization_barrier_p,
    lax.sharding_constraint_p, compat.reshard_p, compat.layout_constraint_p,
    compat.stack_p, compat.unstack_p, compat.tile_p, compat.mulhi_p,
    compat.ragged_dot_general_p, compat.approx_top_k_p,
    # The same platform runs every replica.
    compat.platform_index_p,
    linalg.cholesky_p, linalg.cholesky_update_p, linalg.eig_p, linalg.eigh_p,
    linalg.hessenberg_p, linalg.householder_product_p, linalg.lu_p,
    linalg.lu_pivots_to_permutation_p, linalg.qr_p, linalg.schur_p, linalg.svd_p,
    linalg.symmetric_product_p, linalg.triangular_solve_p, linalg.tridiagonal_p,
    linalg.tridiagonal_solve_p,
    # Functional PRNG: the same key gives the same bits everywhere.
    lax.rng_bit_generator_p, compat.threefry2x32_p, compat.threefry4x32_p,
    compat.philox2x32_p, compat.philox4x32_p, compat.iota_2x32_shape_p,
    compat.random_bits_p, compat.random_split_p, compat.random_fold_in_p,
    compat.random_seed_p, compat.random_wrap_p, compat.random_unwrap_p,
    compat.random_gamma_p, compat.random_clone_p,
)
# Deliberately absent, hence varying: rng_uniform (stateful), callbacks
# (io_callback, pure_callback: the host may answer differently per device),
# nested shard_map, and any primitive JAX adds later.


# --- Collectives. ------------------------------------------------------------

def _all_reduce_rule(eqn: JaxprEqn, ins: list[Rep], facts: Redundancy) -> list[Rep]:
  axes = frozenset(compat.collective_axes(eqn))
  if compat.has_axis_index_groups(eqn):
    return [r - axes for r in ins]  # Subgroups differ from each other.
  return [(r | axes) & facts.all_axes for r in ins]


def _scatter_rule(eqn: JaxprEqn, ins: list[Rep], facts: Redundancy) -> list[Rep]:
  axes = frozenset(compat.collective_axes(eqn))
  return [ins[0] - axes] * len(eqn.outvars)


def _ragged_rule(eqn: JaxprEqn, ins: list[Rep], facts: Redundancy) -> list[Rep]:
  # The result is the `output` operand with received rows written where the
  # offsets and sizes say: it depends on every operand.
  return [_meet(ins, facts.all_axes) - frozenset(compat.collective_axes(eqn))]


def _identity_rule(eqn: JaxprEqn, ins: list[Rep], facts: Redundancy) -> list[Rep]:
  return list(ins)  # pvary changes a type, not a value.


def _axis_index_rule(eqn: JaxprEqn, ins: list[Rep], facts: Redundancy) -> list[Rep]:
  return [facts.all_axes - frozenset(compat.collective_axes(eqn))]


for _p in (compat.psum_p, compat.psum_invariant_p, compat.pmax_p, compat.pmin_p,
           compat.all_gather_p, compat.all_gather_invariant_p, compat.pbroadcast_p):
  redundancy_rules[_p] = _all_reduce_rule
for _p in (compat.reduce_scatter_p, compat.ppermute_p, compat.all_to_all_p):
  redundancy_rules[_p] = _scatter_rule
redundancy_rules[compat.ragged_all_to_all_p] = _ragged_rule
redundancy_rules[compat.pvary_p] = _identity_rule
redundancy_rules[compat.axis_index_p] = _axis_index_rule


# --- Calls and control flow: recurse. --------------------------------------

def _call_rule(eqn: JaxprEqn, ins: list[Rep], facts: Redundancy) -> list[Rep]:
  return _eval(compat.call_jaxpr(eqn), ins, facts)


def _cond_rule(eqn: JaxprEqn, ins: list[Rep], facts: Redundancy) -> list[Rep]:
  pred, ops = ins[0], ins[1:]
  outs = [_eval(b, ops, facts) for b in compat.cond_branches(eqn)]
  return [_meet(rs, facts.all_axes) & pred for rs in zip(*outs, strict=True)]


def _fixed_point(step: Callable[[list[Rep]], list[Rep]], init: list[Rep],
                 num_axes: int, what: str) -> list[Rep]:
  """Iterates carry <- carry ∩ step(carry) until it stops changing.

  Each round that changes removes at least one axis from one carry, so
  1 + len(init) * num_axes rounds always suffice.
  """
  carry = list(init)
  for _ in range(1 + len(carry) * num_axes):
    new = [c & o for c, o in zip(carry, step(carry), strict=True)]
    if new == carry:
      return carry
    carry = new
  raise RuntimeError(f"redundancy of the {what} carry did not reach a fixed point")


def _while_rule(eqn: JaxprEqn, ins: list[Rep], facts: Redundancy) -> list[Rep]:
  cond, cond_nconsts, body, body_nconsts = compat.while_parts(eqn)
  cond_consts = ins[:cond_nconsts]
  body_consts = ins[cond_nconsts:cond_nconsts + body_nconsts]
  init = ins[cond_nconsts + body_nconsts:]

  def step(carry: list[Rep]) -> list[Rep]:
    # A predicate that differs across replicas runs a different number of
    # iterations on each: every carry then varies too.
    (pred,) = _eval(cond, cond_consts + carry, facts)
    return [r & pred for r in _eval(body, body_consts + carry, facts)]

  return _fixed_point(step, init, len(facts.all_axes), "while")


def _scan_rule(eqn: JaxprEqn, ins: list[Rep], facts: Redundancy) -> list[Rep]:
  body, num_consts, num_carry = compat.scan_parts(eqn)
  consts, init = ins[:num_consts], ins[num_consts:num_consts + num_carry]
  xs = ins[num_consts + num_carry:]
  carry = _fixed_point(lambda c: _eval(body, consts + c + xs, facts)[:num_carry],
                       init, len(facts.all_axes), "scan")
  ys = _eval(body, consts + carry + xs, facts)[num_carry:]
  return carry + ys


for _p in compat.CALL_JAXPR_PARAM:
  redundancy_rules[_p] = _call_rule
redundancy_rules[compat.cond_p] = _cond_rule
redundancy_rules[compat.while_p] = _while_rule
redundancy_rules[compat.scan_p] = _scan_rule

# Rules that look inside and see the effects themselves.
_RECURSIVE = frozenset({*compat.CALL_JAXPR_PARAM, compat.cond_p, compat.while_p,
                        compat.scan_p})
