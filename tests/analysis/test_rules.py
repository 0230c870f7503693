"""Unit tests of `wus.analysis.rules`: a rule table filled by decorators at the rules."""

from __future__ import annotations

import pytest

from wus.analysis import layouts, rules
from wus.analysis.shardable import Kind


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
