"""Unit tests of `wus.analysis.rules`: a rule table filled by decorators at the rules."""

from __future__ import annotations

import importlib.util
import sys

import jax
import jax.numpy as jnp
import pytest
from jax import lax

from wus.analysis import (compat, dims, layouts, primitives, propagation, redundancy,
                          region_dims, rules, shardable)
from wus.analysis.shardable import Kind
from wus.transforms import model_local


def test_a_decorator_registers_its_function_for_every_key_unchanged():
  table: dict = {}
  register = rules.registrar(table, "test rule")

  def rule(x):
    return x + 1

  assert register("a", "b")(rule) is rule
  assert table == {"a": rule, "b": rule}


def test_a_key_registered_twice_raises_naming_both_rules():
  table: dict = {}
  register = rules.registrar(table, "test rule")

  @register("a")
  def first():
    pass

  def second():
    pass

  with pytest.raises(ValueError, match="two test rules for a") as e:
    register("b", "a")(second)
  assert rules.where(first) in str(e.value) and rules.where(second) in str(e.value)
  assert table["a"] is first


def test_a_second_layout_rule_for_a_kind_is_refused():
  """The real tables refuse an overwrite: a new rule cannot silently replace one."""
  before = dict(layouts.layout_rules)
  with pytest.raises(ValueError, match="two layout rules for Kind.REDUCE"):
    layouts.layout_rule(Kind.REDUCE)(lambda c, eqn, ins, outs, nested: None)
  assert layouts.layout_rules == before


def test_where_names_the_file_and_line_of_the_definition():
  def rule():
    pass

  assert rules.where(rule) == f"{__file__}:{rule.__code__.co_firstlineno}"


def test_distinct_names_each_key_once_in_the_order_given_without_none():
  """None: a primitive the installed JAX lacks (`compat.relayout_p` on jax 0.10)."""
  assert rules.distinct("a", "b", None, "a", "c", "b") == ("a", "b", "c")


def test_two_names_of_one_primitive_register_through_distinct():
  """A JAX release may alias a primitive under two names (psum / psum_invariant): the
  registrar still refuses the key twice; `distinct` names it once."""
  table: dict = {}
  register = rules.registrar(table, "test rule")
  alias = compat.psum_p

  def rule():
    pass

  with pytest.raises(ValueError, match="two test rules for psum"):
    register(compat.psum_p, alias)(rule)
  table.clear()
  register(*rules.distinct(compat.psum_p, alias))(rule)
  assert table == {compat.psum_p: rule}


def _load_fresh(module, monkeypatch):
  """Runs `module`'s source again as a new module (its registrations at import included)."""
  name = f"{module.__name__}_fresh"
  spec = importlib.util.spec_from_file_location(name, module.__file__)
  fresh = importlib.util.module_from_spec(spec)
  monkeypatch.setitem(sys.modules, name, fresh)
  spec.loader.exec_module(fresh)
  return fresh


def test_the_tables_import_when_compat_names_one_primitive_twice(monkeypatch):
  """As they would on a JAX that aliased them: each rule registers the object once."""
  aliased = {compat.psum_invariant_p, compat.all_gather_invariant_p}
  monkeypatch.setattr(compat, "psum_invariant_p", compat.psum_p)
  monkeypatch.setattr(compat, "all_gather_invariant_p", compat.all_gather_p)
  fresh = _load_fresh(redundancy, monkeypatch)
  assert fresh.redundancy_rules[compat.psum_p] is fresh._all_reduce_rule
  assert set(fresh.redundancy_rules) == set(redundancy.redundancy_rules) - aliased
  fresh = _load_fresh(shardable, monkeypatch)
  assert fresh.shardable_rules[compat.psum_p] is fresh._psum_rule


@pytest.mark.parametrize("module, table, decorator, key, what", [
    (redundancy, "redundancy_rules", "redundancy_rule", lax.add_p, "redundancy rules for add"),
    (shardable, "shardable_rules", "shardable_rule", lax.add_p, "shardable rules for add"),
    (propagation, "sum_rules", "sum_rule", lax.dot_general_p, "sum rules for dot_general"),
    (dims, "dim_rules", "dim_rule", lax.reshape_p, "dim rules for reshape"),
    (model_local, "local_params", "local_params_rule", lax.reshape_p,
     "local params rules for reshape"),
])
def test_a_second_rule_for_a_primitive_is_refused(module, table, decorator, key, what):
  before = dict(getattr(module, table))
  with pytest.raises(ValueError, match=f"two {what}"):
    getattr(module, decorator)(key)(lambda *args: None)
  assert getattr(module, table) == before


# Every primitive that communicates between replicas or reads the replica's index
# (`compat.has_manual_code`'s, less shard_map): a rule of its own, not the meet.
COLLECTIVES = (compat.psum_p, compat.psum_invariant_p, compat.pmax_p, compat.pmin_p,
               compat.pvary_p, compat.all_gather_p, compat.all_gather_invariant_p,
               compat.reduce_scatter_p, compat.all_to_all_p, compat.ragged_all_to_all_p,
               compat.ppermute_p, compat.pbroadcast_p, compat.axis_index_p)


def test_every_redundancy_rule_is_registered_once_and_the_table_covers_the_passes():
  """Pure primitives take the meet; collectives, calls and control flow have rules of
  their own (the recursive ones see effects inside); nothing else is in the table."""
  table = redundancy.redundancy_rules
  pure = primitives.ELEMENTWISE | primitives.PURE
  recursive = {*compat.CALL_JAXPR_PARAM, compat.cond_p, compat.while_p, compat.scan_p}
  assert {p for p, r in table.items() if r is redundancy._standard_rule} == pure
  assert set(table) == pure | set(COLLECTIVES) | recursive
  assert not any(table[p] is redundancy._standard_rule for p in (*COLLECTIVES, *recursive))
  assert redundancy._RECURSIVE == recursive


# What each fact of `primitives` needs of the per-primitive tables (docs/layout.md's
# checklist): the family's rules are registered from the facts, so a primitive added to a
# set and missing from a table it needs is a registration gone wrong.
_NEEDS = {
    "ELEMENTWISE": (primitives.ELEMENTWISE, ("redundancy", "shardable", "dim")),
    "REDUCTIONS": (frozenset(primitives.REDUCTIONS), ("redundancy", "shardable", "dim",
                                                      "combine")),
    "PURE": (primitives.PURE, ("redundancy",)),
}


def _tables() -> dict:
  return {"redundancy": redundancy.redundancy_rules, "shardable": shardable.shardable_rules,
          "dim": dims.dim_rules, "combine": dims.COMBINE}


def missing_rules() -> list[str]:
  """"prim (FACT): no X rule" for every primitive missing a table its fact needs."""
  tables = _tables()
  return [f"{p.name} ({fact}): no {what} rule" for fact, (prims, needs) in _NEEDS.items()
          for p in sorted(prims, key=lambda q: q.name) for what in needs
          if p not in tables[what]]


def test_every_primitive_has_the_rules_its_facts_need():
  assert not missing_rules(), missing_rules()


def test_a_primitive_missing_a_rule_it_needs_is_named(monkeypatch):
  monkeypatch.delitem(dims.dim_rules, lax.exp_p)
  monkeypatch.delitem(dims.COMBINE, lax.reduce_max_p)
  assert missing_rules() == ["exp (ELEMENTWISE): no dim rule",
                             "reduce_max (REDUCTIONS): no combine rule"]


def test_each_table_names_its_default_the_conservative_answer():
  """As `pe.dce_rules.get(prim, default)`: a primitive with no rule sees whole tensors, sums
  nothing, may differ on every replica, needs every dim whole, keeps its params on blocks."""
  jaxpr = jax.make_jaxpr(lambda x: lax.fft(x, "FFT", (4,)))(
      jax.ShapeDtypeStruct((4,), jnp.complex64))
  eqn = jaxpr.jaxpr.eqns[0]
  assert eqn.primitive not in shardable.shardable_rules
  assert shardable.shard_kind(eqn, None) is None and shardable.whole(eqn, None) is None
  assert propagation.is_sum(eqn, [None], lambda v: False) is False
  assert redundancy.varying(eqn, [frozenset({"data"})], None) == [frozenset()]
  assert region_dims.of(eqn) == dims.whole(eqn)
  assert model_local.local_params.get(eqn.primitive, model_local.same_params) is (
      model_local.same_params)
  assert model_local.same_params(eqn, (4,)) == {}
