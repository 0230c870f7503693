"""analysis/loops.py: the loop bodies the planner plans, their iteration counters, and
the conditionals those counters make rare (§3.2, §4.2). Plain jaxprs, no mesh."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from wus.analysis import compat, loops


def _jaxpr(f, *args):
  return jax.make_jaxpr(f)(*args).jaxpr


def test_while_body_pairs_leave_out_the_carry_the_condition_reads():
  """The condition reads the counter: it stays whole (no state pair); the other
  carries pair output k with body input k; the counter is found as one."""
  def f(w, m):
    def body(c):
      i, w, m = c
      m = 0.9 * m + w
      return i + 1, w - 0.1 * m, m
    return lax.while_loop(lambda c: c[0] < 3, body, (0, w, m))

  jaxpr = _jaxpr(f, jnp.ones(16), jnp.ones(16))
  (i, body), = loops.bodies(jaxpr, ["w", "m"], "outer: ").items()
  loop = compat.loop(jaxpr.eqns[i])
  carry = loop.body_carry
  assert dict(body.state_pairs) == {1: carry[1], 2: carry[2]}
  assert body.counters == frozenset({body.jaxpr.invars[carry[0]]})
  assert body.label.startswith("outer: loop at ") and "test_loop_bodies.py" in body.label
  # Carries named after the step inputs they start from; the literal counter is not one.
  assert [body.in_names[j] for j in carry] == ["loop input 0", "w", "m"]
  assert body.out_names == tuple(body.in_names[j] for j in carry)


def test_scan_body_names_its_stacked_outputs():
  def f(w, xs):
    return lax.scan(lambda w, x: (w * x, jnp.sum(w)), w, xs)

  jaxpr = _jaxpr(f, jnp.ones(16), jnp.ones((3, 16)))
  (_, body), = loops.bodies(jaxpr, ["w", "xs"], "").items()
  assert body.out_names == ("w", "loop output 0") and body.counters == frozenset()


def test_counts_finds_only_an_increment_by_one():
  def f(a, b):
    return lax.while_loop(lambda c: c[0] < 9, lambda c: (c[0] + 1, c[1] + 2), (a, b))

  jaxpr = _jaxpr(f, 0, 0)
  loop = compat.loop(jaxpr.eqns[0])
  body, carry = loop.body.jaxpr, loop.body_carry
  assert loops.counts(body, carry[0], 0) and not loops.counts(body, carry[1], 1)


def test_rare_conds_follow_the_counter_not_the_data():
  """A conditional whose predicate depends on the counter runs every k steps; one on
  the data does not."""
  def f(i, x):
    every_other = lax.cond(i % 2 == 1, jnp.sin, jnp.cos, x)
    on_data = lax.cond(x.sum() > 0, jnp.sin, jnp.cos, x)
    return every_other, on_data

  jaxpr = _jaxpr(f, 0, jnp.ones(4))
  conds = [k for k, e in enumerate(jaxpr.eqns) if e.primitive is compat.cond_p]
  assert len(conds) == 2
  assert loops.rare_conds(jaxpr, frozenset({jaxpr.invars[0]})) == {conds[0]}
  assert loops.rare_conds(jaxpr, frozenset()) == set()
