"""Unit tests of the control-flow records of `wus.analysis.compat` (`loop`, `cond`).

Each test traces a function whose only control-flow equation takes the
jaxpr's inputs as operands, checks that the record names the right atoms, and
re-binds the equation through the record with its own jaxprs: the results are
those of the original equation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from wus.analysis import compat


def _only(jaxpr, primitive):
  """The single equation of `primitive` in `jaxpr`."""
  (eqn,) = [e for e in jaxpr.eqns if e.primitive is primitive]
  return eqn


def _evaluator(closed):
  """`closed` as a function of a list of values, as `Loop.bind` and `Cond.bind` take it."""
  return lambda args: jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *args)


def _scan(a, init0, init1, xs):
  def step(carry, x):
    c0, c1 = carry
    return (c0 + a * x, c1 * a), c0 - x
  return lax.scan(step, (init0, init1), xs, reverse=True, unroll=2)


def test_scan_parts():
  args = (np.float32(2.0), np.float32(1.0), np.float32(3.0), np.arange(5, dtype=np.float32))
  closed = jax.make_jaxpr(_scan)(*args)
  a, init0, init1, xs = closed.jaxpr.invars
  loop = compat.loop(_only(closed.jaxpr, compat.scan_p))
  assert loop.kind == "scan"
  assert loop.cond is None and loop.cond_consts == ()
  assert loop.consts == (a,)
  assert loop.carry == (init0, init1)
  assert loop.xs == (xs,)
  assert loop.options == {"length": 5, "reverse": True, "unroll": 2}
  assert (loop.num_consts, loop.num_carry) == (1, 2)
  assert loop.body_operands == (a, init0, init1, xs)
  assert loop.body_carry == range(1, 3)
  assert len(loop.body.jaxpr.invars) == 4 and len(loop.body.jaxpr.outvars) == 3
  assert loop.split(["a", "i0", "i1", "xs"]) == ([], ["a"], ["i0", "i1"], ["xs"])
  assert loop.cond_reads() == set()


def test_scan_bind_reproduces_outputs():
  args = (np.float32(2.0), np.float32(1.0), np.float32(3.0), np.arange(5, dtype=np.float32))
  closed = jax.make_jaxpr(_scan)(*args)
  loop = compat.loop(_only(closed.jaxpr, compat.scan_p))
  want = jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *args)
  got = loop.bind(list(args), _evaluator(loop.body))
  assert len(got) == len(want) == 3
  for g, w in zip(got, want, strict=True):
    np.testing.assert_array_equal(g, w)
  # Re-bound under a trace, it is again a scan with the same options.
  rebound = jax.make_jaxpr(lambda *a: loop.bind(list(a), _evaluator(loop.body)))(*args)
  assert compat.loop(_only(rebound.jaxpr, compat.scan_p)).options == loop.options


def _while(limit, factor, i, x):
  return lax.while_loop(lambda c: c[0] < limit, lambda c: (c[0] + 1, c[1] * factor), (i, x))


def test_while_parts():
  args = (np.int32(4), np.float32(1.5), np.int32(0), np.ones(3, np.float32))
  closed = jax.make_jaxpr(_while)(*args)
  limit, factor, i, x = closed.jaxpr.invars
  loop = compat.loop(_only(closed.jaxpr, compat.while_p))
  assert loop.kind == "while"
  assert loop.cond_consts == (limit,)
  assert loop.consts == (factor,)
  assert loop.carry == (i, x)
  assert loop.xs == () and loop.options == {}
  assert loop.body_operands == (factor, i, x)
  assert loop.body_carry == range(1, 3)
  assert len(loop.cond.jaxpr.invars) == 3 and len(loop.cond.jaxpr.outvars) == 1
  assert loop.split(["l", "f", "i", "x"]) == (["l"], ["f"], ["i", "x"], [])
  assert loop.cond_reads() == {0}  # The counter, not x.


def test_while_bind_reproduces_outputs():
  args = (np.int32(4), np.float32(1.5), np.int32(0), np.ones(3, np.float32))
  closed = jax.make_jaxpr(_while)(*args)
  loop = compat.loop(_only(closed.jaxpr, compat.while_p))
  want = jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *args)
  got = loop.bind(list(args), _evaluator(loop.body), _evaluator(loop.cond))
  for g, w in zip(got, want, strict=True):
    np.testing.assert_array_equal(g, w)
  with pytest.raises(TypeError, match="cond"):
    loop.bind(list(args), _evaluator(loop.body))


def _switch(index, x, y):
  return lax.switch(index, [lambda x, y: x + y, lambda x, y: x * y, lambda x, y: x - 2 * y], x, y)


def test_cond_parts():
  args = (np.int32(1), np.float32(3.0), np.arange(4, dtype=np.float32))
  closed = jax.make_jaxpr(_switch)(*args)
  eqn = _only(closed.jaxpr, compat.cond_p)
  cond = compat.cond(eqn)
  _, x, y = closed.jaxpr.invars
  (clamp,) = [e for e in closed.jaxpr.eqns if e is not eqn]  # lax.switch clamps the index.
  assert cond.index is clamp.outvars[0]
  assert cond.operands == (x, y)
  assert len(cond.branches) == 3
  assert all(len(b.jaxpr.invars) == 2 for b in cond.branches)
  assert cond.split(["k", "x", "y"]) == ("k", ["x", "y"])


@pytest.mark.parametrize("index", [0, 1, 2])
def test_cond_bind_reproduces_outputs(index):
  args = (np.int32(index), np.float32(3.0), np.arange(4, dtype=np.float32))
  closed = jax.make_jaxpr(_switch)(*args)
  cond = compat.cond(_only(closed.jaxpr, compat.cond_p))
  (want,) = jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *args)
  (got,) = cond.bind([jnp.int32(index), *args[1:]], [_evaluator(b) for b in cond.branches])
  np.testing.assert_array_equal(got, want)


def test_loop_of_another_primitive_raises():
  closed = jax.make_jaxpr(_switch)(np.int32(0), np.float32(1.0), np.ones(4, np.float32))
  with pytest.raises(ValueError, match="not a loop"):
    compat.loop(_only(closed.jaxpr, compat.cond_p))
