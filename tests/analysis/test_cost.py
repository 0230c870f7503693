"""Unit tests of `wus.analysis.cost` (DESIGN.md §3, Cost; paper §3.2).

`cost.decide` on the one cluster of small steps whose byte counts are worked
out by hand below: each step all-reduces a gradient `x * 2` (`pmean`) and
updates a replicated weight `w` and momentum `m` with it. With N = 8:

  all_reduce_bytes  bytes of the gradient all-reduce the cluster replaces;
  all_gather_bytes  bytes of every sharded value someone needs whole: the new
                    weight (an output that does not stay sharded), outputs
                    read by computation that differs across replicas;
  saved_bytes       (1 - 1/N) of the program inputs the cluster reads and the
                    outputs it writes (the momentum counts twice: read, written).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from helpers import analysed_body, mesh
from wus.analysis import clusters, cost, layouts, reasons, verdicts
from wus.analysis.cost import Decision
from wus.analysis.reasons import Reason
from wus.analysis.graph import Graph

N = 8
AXES = frozenset({"data"})
R, X = P(), P("data")


def decide(f, in_specs, shapes, out_specs, state_outputs=()) -> Decision:
  """The decision on the one cluster of `f`; `state_outputs` stay sharded between steps."""
  jaxpr, facts = analysed_body(f, in_specs, shapes, out_specs, mesh=mesh(N))
  (c,) = clusters.find_clusters(jaxpr, facts, AXES, N)
  layout = layouts.assign(jaxpr, c, N, Graph(jaxpr, N).big)
  assert not isinstance(layout, str), layout
  return cost.decide(c, layout, jaxpr, facts, AXES, set(state_outputs), N)


def momentum(w, m, x):
  g = lax.pmean(x * 2.0, "data")
  m = 0.9 * m + g
  return w - 0.1 * m, m


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_momentum_kept_sharded_saves_seven_eighths_of_its_state_traffic(dtype):
  shapes = [jax.ShapeDtypeStruct((1000,), dtype)] * 3
  d = decide(momentum, [R, R, X], shapes, (R, R), state_outputs={1})
  tensor = 1000 * jnp.dtype(dtype).itemsize
  # Replaces one all-reduce of the gradient; gathers the new weight only (the
  # momentum stays sharded); reads w and m, writes w and m: 4 tensors.
  assert d == Decision(True, Reason(verdicts.OnShards(0, 1)),
                       all_reduce_bytes=tensor, all_gather_bytes=tensor,
                       saved_bytes=4 * tensor - 4 * tensor // N)


def test_momentum_gathered_every_step_costs_more_than_the_all_reduce_and_is_refused():
  d = decide(momentum, [R, R, X], [(1000,)] * 3, (R, R))
  assert d == Decision(False, Reason(verdicts.MoreAllGather(8000, 4000)),
                       all_reduce_bytes=4000, all_gather_bytes=8000,
                       saved_bytes=16000 - 16000 // N)


def test_state_also_returned_whole_is_taken_for_the_state_kept_sharded():
  """The new momentum is state (output 1, stays sharded) and a metric
  (output 2, gathered): 8000 B gathered against the 4000 + 4000/8 B that the
  reduce-scatter's all-gather phase leaves room for."""
  def step(w, m, x):
    w, m = momentum(w, m, x)
    return w, m, m

  d = decide(step, [R, R, X], [(1000,)] * 3, (R, R, R), state_outputs={1})
  assert d.shard and (d.all_reduce_bytes, d.all_gather_bytes) == (4000, 8000)
  assert d.why == Reason(verdicts.KeepsStateSharded(3500))
  assert d.saved_bytes == 20000 - 20000 // N  # w, m read; w written once, m twice.


def test_update_that_reads_and_returns_no_state_saves_nothing_and_is_refused():
  def step(x):
    g = lax.pmean(x * 2.0, "data")
    return (x * g,)  # Only computation that differs across replicas reads g.

  d = decide(step, [X], [(64,)], (X,))
  assert d == Decision(False, Reason(verdicts.SavesNothing()),
                       all_reduce_bytes=256, all_gather_bytes=256, saved_bytes=0)


def test_refusal_names_the_reader_that_needs_a_sharded_value_whole():
  def step(w, x):
    g = lax.pmean(x * 2.0, "data")
    return w - 0.1 * g, x * g

  d = decide(step, [R, X], [(64,)] * 2, (R, X))
  assert not d.shard and (d.all_reduce_bytes, d.all_gather_bytes) == (256, 512)
  assert d.why.verdict == verdicts.MoreAllGather(512, 256, d.why.verdict.reader)
  reader = d.why.verdict.reader
  assert (reader.aval, reader.reader.primitive) == ("float32[64]{V:data}", "mul"), d.why
  assert reader.differs is not None, d.why
  assert str(d.why).endswith(", which differs across replicas: "
                             f"{reasons.render(reasons.Reason(reader.differs))})"), d.why


def test_norm_counts_as_a_reduction_and_its_scalar_is_not_gathered():
  def lars(w, x):
    g = lax.pmean(x * 2.0, "data")
    return (w - 0.1 * jnp.sqrt(jnp.sum(w * w)) * g,)

  d = decide(lars, [R, X], [(64,)] * 2, (R,))
  assert d == Decision(True, Reason(verdicts.OnShards(1, 1)),
                       all_reduce_bytes=256, all_gather_bytes=256, saved_bytes=512 - 512 // N)


def test_partial_result_returned_is_all_reduced_not_gathered():
  """Column sums of the gradient (a reduction over the shard dim) leave the
  cluster whole after their all-reduce: only the new weight is gathered."""
  def step(w, x):
    g = lax.pmean(x * 2.0, "data")
    return w - 0.1 * g, jnp.sum(g * g, axis=0)

  d = decide(step, [R, X], [(64, 32)] * 2, (R, R))
  assert d == Decision(True, Reason(verdicts.OnShards(1, 1)),
                       all_reduce_bytes=8192, all_gather_bytes=8192,
                       saved_bytes=(8192 * 2 + 128) - (8192 * 2 + 128) // N)


def test_every_gradient_all_reduce_of_the_cluster_is_counted():
  """A tied weight gets two gradients, each all-reduced: one cluster, two seeds."""
  def step(w, x, y):
    g1, g2 = lax.pmean(x * 2.0, "data"), lax.pmean(y * 3.0, "data")
    return (w - 0.1 * (g1 + g2),)

  d = decide(step, [R, X, X], [(1000,)] * 3, (R,))
  assert d == Decision(True, Reason(verdicts.OnShards(0, 1)), all_reduce_bytes=8000,
                       all_gather_bytes=4000, saved_bytes=8000 - 8000 // N)
