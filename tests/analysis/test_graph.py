"""analysis/graph.py: one set of maps per jaxpr, however many passes make a Graph of it
(issue 31 item 5)."""

import gc
import weakref

import jax
import jax.numpy as jnp

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
