"""Unit tests of `wus.analysis.redundancy` (DESIGN.md §3, Redundancy; paper §3.1).

Programs run on a 4x2 ("data", "model") mesh so that facts are sets of several
axes. Every input is a global array whose per-replica block has shape (4,), so
that inputs with different in_specs combine elementwise: a P() input is
redundant over both axes (`ALL`), a P("data") one over "model" only (`MODEL`),
a P("model") one over "data" only (`DATA`), a P(("data", "model")) one over
neither (`NONE`).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.experimental import io_callback
from jax.extend.core import Primitive
from jax.sharding import NamedSharding, PartitionSpec as P

from wus.analysis import compat, redundancy

ALL = frozenset({"data", "model"})
DATA = frozenset({"data"})
MODEL = frozenset({"model"})
NONE = frozenset()

R, D, M, DM = P(), P("data"), P("model"), P(("data", "model"))


@functools.cache
def mesh():
  return jax.make_mesh((4, 2), ("data", "model"))


def spec_axes(spec) -> frozenset:
  return frozenset(a for entry in spec if entry is not None
                   for a in (entry if isinstance(entry, tuple) else (entry,)))


def vec(spec, dtype=jnp.float32) -> jax.ShapeDtypeStruct:
  """A global array laid out by `spec` whose per-replica block has shape (4,)."""
  n = math.prod(mesh().shape[a] for a in spec_axes(spec))
  return jax.ShapeDtypeStruct((4 * n,), dtype, sharding=NamedSharding(mesh(), spec))


def trace(f: Callable, *args, check_vma: bool = False, out_specs: Any = None):
  """Analyses the per-replica body of `jax.shard_map(f)` on `args`.

  Args:
    f: the per-replica function.
    *args: global arrays or ShapeDtypeStructs (pytrees allowed) with a
      NamedSharding; their specs are the in_specs.
    check_vma: as for `jax.shard_map`.
    out_specs: default P() without check_vma (always allowed), and
      P(("data", "model")) with it (allowed for any rank-1+ output).

  Returns:
    (body jaxpr, facts).
  """
  if out_specs is None:
    out_specs = DM if check_vma else R
  in_specs = jax.tree.map(lambda a: a.sharding.spec, args)
  closed = jax.make_jaxpr(jax.shard_map(f, mesh=mesh(), in_specs=in_specs,
                                        out_specs=out_specs, check_vma=check_vma))(*args)
  body, _, flat_specs, _, manual, _ = compat.shard_map_params(compat.shard_map_eqn(closed))
  assert manual == ALL
  in_rep = [manual - spec_axes(s) for s in flat_specs]
  return body, redundancy.analyze(body, in_rep, manual)


def all_jaxprs(jaxpr):
  """`jaxpr` and every jaxpr nested in it."""
  yield jaxpr
  for eqn in jaxpr.eqns:
    for sub in compat.sub_jaxprs(eqn):
      yield from all_jaxprs(sub)


def primitives(jaxpr) -> set:
  return {e.primitive for j in all_jaxprs(jaxpr) for e in j.eqns}


# --- Sources. ------------------------------------------------------------------

@pytest.mark.parametrize("spec,expected", [(R, ALL), (D, MODEL), (M, DATA), (DM, NONE)],
                         ids=["P()", "P(data)", "P(model)", "P(data,model)"])
def test_input_is_redundant_over_exactly_its_unsplit_axes(spec, expected):
  body, facts = trace(jnp.sin, vec(spec))
  assert facts.of(body.invars[0]) == expected
  assert redundancy.out_rep(body, facts) == [expected]


def test_literal_is_redundant_and_does_not_lift_the_meet():
  body, facts = trace(lambda x: x * 2.0, vec(DM))
  (eqn,) = body.eqns
  assert compat.is_literal(eqn.invars[1]) and facts.of(eqn.invars[1]) == ALL
  assert redundancy.out_rep(body, facts) == [NONE]


def test_constants_of_a_closed_jaxpr_are_redundant():
  const = np.arange(4.0, dtype=np.float32)
  closed = jax.make_jaxpr(lambda x: (jnp.asarray(const) * 2, x + const))(np.zeros(4, np.float32))
  assert closed.jaxpr.constvars
  facts = redundancy.analyze(closed, [MODEL], ALL)
  assert redundancy.out_rep(closed, facts) == [ALL, MODEL]


def test_gradient_of_a_replicated_param_is_redundant_but_the_loss_is_not():
  def step(w, x):
    loss, grad = jax.value_and_grad(lambda w: jnp.sum(jnp.sin(w * x)))(w)
    return loss[None], grad
  body, facts = trace(step, vec(R), vec(D), check_vma=True, out_specs=(D, R))
  assert compat.psum_invariant_p in primitives(body)  # Inserted by AD.
  assert redundancy.out_rep(body, facts) == [MODEL, ALL]


# --- Absent primitives and effects: varying even on redundant inputs. ------------

_unknown_p = Primitive("wus_test_unknown")
_unknown_p.def_abstract_eval(lambda x: x)
_unknown_p.def_impl(lambda x: x)

_f32x4 = jax.ShapeDtypeStruct((4,), jnp.float32)
ABSENT = [
    ("io_callback", lambda x: io_callback(lambda a: a, _f32x4, x)),
    ("pure_callback", lambda x: jax.pure_callback(lambda a: a, _f32x4, x)),
    ("rng_uniform", lambda x: x + lax.rng_uniform(0.0, 1.0, (4,))),
    ("unknown", _unknown_p.bind),
]


@pytest.mark.parametrize("name,f", ABSENT, ids=[n for n, _ in ABSENT])
def test_primitive_without_a_rule_is_varying(name, f):
  body, facts = trace(f, vec(R))
  assert primitives(body) - set(redundancy.redundancy_rules)
  assert redundancy.out_rep(body, facts) == [NONE]


def test_effect_overrides_a_pure_rule(monkeypatch):
  body, _ = trace(ABSENT[0][1], vec(R))
  (eqn,) = body.eqns
  assert compat.side_effects(eqn)
  monkeypatch.setitem(redundancy.redundancy_rules, eqn.primitive, redundancy._standard_rule)
  facts = redundancy.analyze(body, [ALL], ALL)
  assert redundancy.out_rep(body, facts) == [NONE]


def test_effect_inside_a_call_is_seen():
  body, facts = trace(jax.jit(ABSENT[0][1]), vec(R))
  assert redundancy.out_rep(body, facts) == [NONE]


# --- One case per rule that is not the standard meet. ---------------------------

class Case(NamedTuple):
  """A program exercising `prim`, and the facts expected of its outputs."""
  prim: Any
  id: str
  f: Callable
  in_specs: tuple
  expected: tuple
  check_vma: bool = False


def _swap(a, b):
  return jnp.sin(b), a * 2


@jax.custom_jvp
def _swap_jvp(a, b):
  return _swap(a, b)


_swap_jvp.defjvp(lambda p, t: (_swap_jvp(*p), (jnp.cos(p[1]) * t[1], 2 * t[0])))


@jax.custom_vjp
def _swap_vjp(a, b):
  return _swap(a, b)


_swap_vjp.defvjp(lambda a, b: (_swap(a, b), b), lambda b, g: (2 * g[1], jnp.cos(b) * g[0]))


def _closed_call(a, b):
  inner = jax.make_jaxpr(_swap)(a, b)
  return compat.closed_call_p.bind(
      a, b, **compat.closed_call_p.get_bind_params({"call_jaxpr": inner}))


def _ragged_all_to_all(x, out):
  zeros = jnp.zeros((4,), jnp.int32)
  return lax.ragged_all_to_all(x, out, zeros, zeros, zeros, zeros, axis_name="data")


def _while_shifts_a_varying_value_in(x, y):
  # Carries (i, a, b) start redundant; the body returns (i + 1, b, x). After one
  # pass `a` is still redundant (it got `b`'s initial fact); only the second
  # pass makes it varying, so a single pass would be wrong.
  def body(c):
    i, a, b = c
    return i + 1, b, x
  return lax.while_loop(lambda c: c[0] < 3, body, (0, y, y))


def _while_varying_predicate(x, y):
  n = x[0]  # Differs across "data".

  def body(c):
    i, s = c
    return i + 1.0, s + y
  return lax.while_loop(lambda c: c[0] < n, body, (0.0, y))


def _while_redundant(y):
  def body(c):
    i, s = c
    return i + 1, jnp.sin(s) + i
  return lax.while_loop(lambda c: c[0] < 3, body, (0, y))


def _scan_shifts_a_varying_value_in(x, y):
  def body(c, _):
    a, b = c
    return (b, x), a
  return lax.scan(body, (y, y), length=3)


def _scan_over_xs(xs):
  return lax.scan(lambda c, xi: (c + xi, xi * 2), 0.0, xs)


def _scan_with_consts(xs, c):
  return lax.scan(lambda carry, xi: (carry + 1.0, xi * c), 0.0, xs)


CASES = [
    # All-reduces and all-gathers gain the reduced axis and keep the others.
    Case(compat.psum_p, "psum", lambda x: lax.psum(x, "data"), (DM,), (DATA,)),
    Case(compat.psum_p, "psum-2d", lambda x: lax.psum(x, ("data", "model")), (DM,), (ALL,)),
    Case(compat.psum_p, "pmean", lambda x: lax.pmean(x, "model"), (DM,), (MODEL,)),
    Case(compat.psum_invariant_p, "psum-vma", lambda x: lax.psum(x, "data"), (DM,), (DATA,),
         check_vma=True),
    Case(compat.psum_invariant_p, "pmean-vma", lambda x: lax.pmean(x, "data"), (D,), (ALL,),
         check_vma=True),
    Case(compat.pmax_p, "pmax", lambda x: lax.pmax(x, "data"), (DM,), (DATA,)),
    Case(compat.pmin_p, "pmin", lambda x: lax.pmin(x, "data"), (DM,), (DATA,)),
    Case(compat.all_gather_p, "all_gather", lambda x: lax.all_gather(x, "data", tiled=True),
         (DM,), (DATA,)),
    Case(compat.all_gather_invariant_p, "all_gather_invariant",
         lambda x: lax.all_gather(x, "data", tiled=True, to="invarying"), (DM,), (DATA,),
         check_vma=True),
    Case(compat.pbroadcast_p, "pbroadcast", lambda x: lax.pbroadcast(x, ("data",), 0), (DM,),
         (DATA,)),
    # Subgroups differ from each other: the axis is lost, not gained.
    Case(compat.psum_p, "psum-groups",
         lambda x: lax.psum(x, "data", axis_index_groups=[[0, 1], [2, 3]]), (R,), (MODEL,)),
    # Scatters and permutations lose the axis.
    Case(compat.reduce_scatter_p, "psum_scatter",
         lambda x: lax.psum_scatter(x, "data", tiled=True), (R,), (MODEL,)),
    Case(compat.ppermute_p, "ppermute",
         lambda x: lax.ppermute(x, "data", [(i, (i + 1) % 4) for i in range(4)]), (R,), (MODEL,)),
    Case(compat.all_to_all_p, "all_to_all", lambda x: lax.all_to_all(x, "data", 0, 0, tiled=True),
         (R,), (MODEL,)),
    Case(compat.ragged_all_to_all_p, "ragged_all_to_all", _ragged_all_to_all, (R, R), (MODEL,)),
    Case(compat.axis_index_p, "axis_index", lambda x: x + lax.axis_index("data"), (R,), (MODEL,)),
    Case(compat.axis_index_p, "axis_index-2d", lambda x: x * lax.axis_index(("data", "model")),
         (R,), (NONE,)),
    # pvary changes a type, not a value.
    Case(compat.pvary_p, "pvary", lambda x: lax.pcast(x, "data", to="varying"), (M,), (DATA,),
         check_vma=True),
    Case(compat.pvary_p, "pvary-redundant", lambda x: lax.pcast(x, "data", to="varying"), (R,),
         (ALL,), check_vma=True),
    # Calls: facts flow through, input by input.
    Case(compat.jit_p, "jit", jax.jit(_swap), (R, D), (MODEL, ALL)),
    Case(compat.closed_call_p, "closed_call", _closed_call, (R, D), (MODEL, ALL)),
    Case(compat.remat_p, "checkpoint", jax.checkpoint(_swap), (R, D), (MODEL, ALL)),
    Case(compat.custom_jvp_call_p, "custom_jvp", _swap_jvp, (R, D), (MODEL, ALL)),
    Case(compat.custom_vjp_call_p, "custom_vjp", _swap_vjp, (R, D), (MODEL, ALL)),
    # cond: predicate ∩ every branch.
    Case(compat.cond_p, "cond-redundant",
         lambda y: lax.cond(y[0] > 0, lambda: y * 2, lambda: y + 1), (R,), (ALL,)),
    Case(compat.cond_p, "cond-varying-predicate",
         lambda x: lax.cond(x[0] > 0, lambda: 1.0, lambda: 2.0), (D,), (MODEL,)),
    Case(compat.cond_p, "cond-varying-last-branch",
         lambda x, y: lax.switch(jnp.int32(y[0]), [lambda: y, lambda: y * 2, lambda: x]),
         (D, R), (MODEL,)),
    # while: bounded fixed point over the carries.
    Case(compat.while_p, "while-fixed-point", _while_shifts_a_varying_value_in, (D, R),
         (ALL, MODEL, MODEL)),
    Case(compat.while_p, "while-varying-predicate", _while_varying_predicate, (D, R),
         (MODEL, MODEL)),
    Case(compat.while_p, "while-redundant", _while_redundant, (R,), (ALL, ALL)),
    # scan: the same fixed point; xs and consts flow into the body.
    Case(compat.scan_p, "scan-fixed-point", _scan_shifts_a_varying_value_in, (D, R),
         (MODEL, MODEL, MODEL)),
    Case(compat.scan_p, "scan-split-xs", _scan_over_xs, (D,), (MODEL, MODEL)),
    Case(compat.scan_p, "scan-redundant-xs", _scan_over_xs, (R,), (ALL, ALL)),
    Case(compat.scan_p, "scan-consts", _scan_with_consts, (R, M), (ALL, DATA)),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_rule(case):
  body, facts = trace(case.f, *map(vec, case.in_specs), check_vma=case.check_vma)
  assert case.prim in primitives(body)
  assert redundancy.out_rep(body, facts) == list(case.expected)


def test_ragged_all_to_all_result_depends_on_its_output_buffer():
  # Nothing is sent (all sizes 0), so the result is `output`, which differs over "model".
  body, facts = trace(_ragged_all_to_all, vec(R), vec(M))
  assert redundancy.out_rep(body, facts) == [NONE]


# --- Declarative entries: the standard rule is the meet of the inputs. -----------

def _key_fold_in(a, b):
  key = jax.random.fold_in(jax.random.key(0), b[0].astype(jnp.uint32))
  return jax.random.uniform(key, (4,)) + a


STANDARD_CASES = [
    (jax.lax.add_p, lambda a, b: a + b),
    (jax.lax.sin_p, lambda a, b: jnp.sin(a)),
    (jax.lax.dot_general_p, lambda a, b: jnp.dot(a, b)),
    (jax.lax.reduce_sum_p, lambda a, b: jnp.sum(a * b)),
    (jax.lax.select_n_p, lambda a, b: jnp.where(a > 0, a, b)),
    (jax.lax.dynamic_slice_p, lambda a, b: lax.dynamic_slice(a, (b[0].astype(jnp.int32),), (2,))),
    (jax.lax.concatenate_p, lambda a, b: jnp.concatenate([a, b])),
    (jax.lax.sort_p, lambda a, b: lax.sort((a, b), num_keys=1)),
    (jax.lax.cumsum_p, lambda a, b: jnp.cumsum(a)),
    (jax.lax.gather_p, lambda a, b: a[b.astype(jnp.int32)]),
    (jax.lax.convert_element_type_p, lambda a, b: a.astype(jnp.int32)),
    (compat.random_fold_in_p, _key_fold_in),
]


@pytest.mark.parametrize("prim,f", STANDARD_CASES, ids=[str(p) for p, _ in STANDARD_CASES])
@pytest.mark.parametrize("specs", [(D, M), (D, R), (DM, R)], ids=["D,M", "D,R", "DM,R"])
def test_standard_rule_is_the_meet(prim, f, specs):
  assert redundancy.redundancy_rules[prim] is redundancy._standard_rule
  body, facts = trace(f, *map(vec, specs))
  eqns = [e for j in all_jaxprs(body) for e in j.eqns if e.primitive is prim]
  assert eqns
  for eqn in eqns:
    meet = ALL.intersection(*(facts.of(v) for v in eqn.invars))
    assert all(facts.of(v) == meet for v in eqn.outvars), eqn


def test_every_rule_has_a_case():
  rules = redundancy.redundancy_rules
  standard = {p for p, rule in rules.items() if rule is redundancy._standard_rule}
  assert {p for p, _ in STANDARD_CASES} <= standard
  missing = set(rules) - standard - {c.prim for c in CASES}
  assert not missing, f"rules without a case in CASES: {sorted(map(str, missing))}"


# --- Cross-check against JAX's varying-manual-axes types (check_vma=True). --------

def _adam_step():
  tx = optax.adam(1e-2)
  params = {"w": jnp.zeros((4, 3)), "b": jnp.zeros((3,))}
  state = tx.init(params)

  def loss(params, batch):
    return jnp.mean(jnp.tanh(batch @ params["w"] + params["b"]))

  def step(params, state, batch):
    value, grads = jax.value_and_grad(loss)(params, batch)
    grads = lax.pmean(grads, "data")
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, value[None]

  def put(tree, spec):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(
        a.shape, a.dtype, sharding=NamedSharding(mesh(), spec)), tree)

  args = put(params, R), put(state, R), put(jnp.zeros((16, 4)), D)
  return step, args, (R, R, D)


def _cond_vma(x, y):
  varying = lax.cond(x[0] > 0, lambda: lax.pcast(y * 2, "data", to="varying"), lambda: y + x)
  return varying, lax.cond(y[0] > 0, lambda: y * 2, lambda: y + 1)


def _while_vma(x, y):
  def body(c):
    i, a, b = c
    return i + 1, b, x * a
  y = lax.pcast(y, "data", to="varying")
  return lax.while_loop(lambda c: c[0] < 3, body, (0, y, y))[1:]


def _scan_vma(xs, c, y):
  def body(carry, xi):
    k, s = carry
    return (k + y, s + xi * c), xi * c + k
  return lax.scan(body, (y, lax.pcast(y, ("data", "model"), to="varying")), xs)


CROSS_CHECK = [
    ("adam", _adam_step),
    ("cond", lambda: (_cond_vma, (vec(D), vec(R)), DM)),
    ("while", lambda: (_while_vma, (vec(D), vec(R)), DM)),
    ("scan", lambda: (_scan_vma, (vec(DM), vec(M), vec(R)), DM)),
]


@pytest.mark.parametrize("name,make", CROSS_CHECK, ids=[n for n, _ in CROSS_CHECK])
def test_never_varying_where_jax_types_invariant(name, make):
  f, args, out_specs = make()
  body, facts = trace(f, *args, check_vma=True, out_specs=out_specs)
  checked = varying = 0
  for jaxpr in all_jaxprs(body):
    for v in [*jaxpr.invars, *(o for e in jaxpr.eqns for o in e.outvars)]:
      if isinstance(v, compat.DropVar) or not hasattr(v.aval, "shape"):
        continue
      invariant = ALL - compat.varying_axes(v.aval)
      assert invariant <= facts.of(v), (v, v.aval, facts.of(v))
      checked += 1
      varying += invariant != ALL
  assert checked > 10 and varying > 0  # Not vacuous.
