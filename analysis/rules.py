"""Rule tables: one typed dict per pass, each rule registered by a decorator beside it.

The pattern of JAX's own tables (`ad.primitive_jvps`, `pe.dce_rules`): a module-level
dict keyed by a primitive or a `shardable.Kind`, one function per key. Here the
decorator sits on the rule itself, so that adding a primitive or a Kind is one
registration per pass, at the rule:

  layout_rules: dict[Kind, LayoutRule] = {}
  layout_rule = rules.registrar(layout_rules, "layout rule")

  @layout_rule(Kind.BROADCAST, Kind.SCATTER_BLOCKS)
  def _broadcast(c, eqn, ins, outs, nested): ...
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Hashable
from typing import TypeVar

F = TypeVar("F", bound=Callable)


def where(rule: Callable) -> str:
  """`file:line` of a rule's definition (for messages naming it)."""
  code = inspect.unwrap(rule).__code__
  return f"{code.co_filename}:{code.co_firstlineno}"


def registrar(table: dict, what: str) -> Callable[..., Callable[[F], F]]:
  """A decorator factory filling `table`: `@register(*keys)` makes the function its rule.

  Args:
    table: the rule table, keyed by primitive or `Kind`.
    what: the rule's name in messages ("layout rule").

  Returns:
    `register(*keys)`, a decorator that records the function for every key and
    returns it unchanged.

  Raises:
    ValueError: (at import) a key registered twice, naming both rules' lines.
  """

  def register(*keys: Hashable) -> Callable[[F], F]:
    def decorate(rule: F) -> F:
      for key in keys:
        if key in table:
          raise ValueError(f"two {what}s for {key}: {where(table[key])} and {where(rule)}")
        table[key] = rule
      return rule
    return decorate

  return register


def distinct(*keys: Hashable) -> tuple:
  """`keys` once each, in the order given, None left out: the keys of one registration.

  `compat` hands out primitives as the installed JAX has them: two names may be one
  object (a release can alias one primitive under two names), and a primitive the
  release lacks is None. The registrar refuses a key registered twice, so a rule
  registered for a set of primitives names them through `distinct`.
  """
  return tuple(k for k in dict.fromkeys(keys) if k is not None)
