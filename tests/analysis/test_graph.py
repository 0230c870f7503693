"""analysis/graph.py: one set of maps per jaxpr, however many passes make a Graph of it
(issue 31 item 5)."""

import gc
import weakref

import jax
import jax.numpy as jnp

from wus.analysis import compat
from wus.analysis import graph as graph_lib
from wus.analysis.graph import Graph


def _jaxpr():
  return jax.make_jaxpr(lambda x, y: (x * x + y, jnp.sin(x), x))(jnp.ones(3), jnp.ones(3)).jaxpr


def test_graphs_of_one_jaxpr_share_its_maps():
  jaxpr = _jaxpr()
  a, b = Graph(jaxpr), Graph(jaxpr, 8, 4)
  assert a.producer is b.producer and a.outputs is b.outputs
  assert Graph(_jaxpr()).producer is not a.producer  # Another jaxpr, its own maps.
  assert (a.num_shards, b.num_shards) == (1, 8)


def test_uses_count_every_read_and_every_output_position():
  jaxpr = _jaxpr()
  g = Graph(jaxpr)
  x, y = jaxpr.invars
  assert g.uses(x) == 2 + 1 + 1  # x * x, sin x, returned.
  assert g.readers(x) == (0, 2)  # Each reading equation once.
  assert g.uses(y) == 1 and g.uses(jaxpr.eqns[1].outvars[0]) == 1


def test_the_maps_live_as_long_as_the_jaxpr():
  jaxpr = _jaxpr()
  Graph(jaxpr)
  ref = weakref.ref(jaxpr)
  assert jaxpr in graph_lib._MAPS
  del jaxpr
  gc.collect()
  assert ref() is None


def test_producing_is_the_equation_that_computes_a_value():
  jaxpr = _jaxpr()
  g = Graph(jaxpr)
  for eqn in jaxpr.eqns:
    assert all(g.producing(v) is eqn for v in eqn.outvars)
  assert all(g.producing(v) is None for v in jaxpr.invars)  # Inputs: no equation.


def test_is_zero_is_a_literal_zero_or_a_broadcast_of_one():
  def f(x):
    return jnp.zeros(3), jnp.ones(3), x * 0, x + 1

  jaxpr = jax.make_jaxpr(f)(jnp.ones(3)).jaxpr
  g = Graph(jaxpr)
  (zeros, ones, times_zero, _), (x,) = jaxpr.outvars, jaxpr.invars
  assert g.is_zero(zeros) and g.producing(zeros).primitive is jax.lax.broadcast_in_dim_p
  assert not g.is_zero(ones) and not g.is_zero(times_zero) and not g.is_zero(x)
  literals = [v for e in jaxpr.eqns for v in e.invars if compat.is_literal(v)]
  assert {float(v.val) for v in literals} == {0.0, 1.0}
  assert all(g.is_zero(v) == (v.val == 0) and g.producing(v) is None for v in literals)
