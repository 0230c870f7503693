"""Unit tests of `wus.analysis.layouts` (DESIGN.md §3, Formats; paper §4.1, Fig. 6).

Each step all-reduces a gradient `x * 2` and updates a replicated weight with
it through one kind of operation (elementwise, a reshape, a reduction, a
broadcast); the tests check the formats `layouts.assign` chooses for the
cluster's tensors, mostly for a [3,3,5,7] weight (315 elements, which 8 and 6
do not divide).
"""

from __future__ import annotations

import importlib
import inspect

import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from helpers import analysed_body, mesh
from wus.analysis import causes, clusters, layouts
from wus.analysis.formats import ShardFormat
from wus.analysis.graph import Graph
from wus.analysis.shardable import Kind

R, X = P(), P("data")
CONV = (3, 3, 5, 7)


def assign(f, in_specs, shapes, out_specs, n=8):
  """(jaxpr, its one cluster, the cluster's layout or the reason it has none)."""
  jaxpr, facts = analysed_body(f, in_specs, shapes, out_specs, mesh=mesh(n))
  (c,) = clusters.find_clusters(jaxpr, facts, frozenset({"data"}), n)
  return jaxpr, c, layouts.assign(jaxpr, c, n, Graph(jaxpr, n).big)


def outputs_of(jaxpr, prim) -> list:
  return [v for e in jaxpr.eqns if e.primitive is prim for v in e.outvars]


@pytest.mark.parametrize("shape,n,rows,padding", [(CONV, 8, 40, 5), (CONV, 6, 53, 3),
                                                 ((16, 24), 8, 48, 0)])
def test_elementwise_update_is_flat_and_padded(shape, n, rows, padding):
  def sgd(w, x):
    return (w - 0.1 * lax.pmean(x * 2.0, "data"),)

  jaxpr, c, layout = assign(sgd, [R, X], [shape] * 2, (R,), n)
  flat = ShardFormat(shape, (rows * n - padding,), n)
  assert (flat.shard_shape, flat.padding) == ((rows,), padding)
  # Every tensor the cluster holds or reads: the weight, the local gradient
  # it reduce-scatters, and every result up to the new weight.
  assert set(layout.formats) == set(c.sharded) | set(c.reads)
  assert jaxpr.invars[0] in layout.formats and jaxpr.outvars[0] in layout.formats
  assert set(layout.formats.values()) == {flat}
  assert layout.whole_reads == frozenset() and layout.partial == frozenset()


def test_reshape_that_regroups_dims_gives_both_sides_the_flat_format():
  def step(w, x):
    return (w - 0.1 * lax.pmean(x * 2.0, "data").reshape(9, 35),)

  jaxpr, _, layout = assign(step, [R, X], [(9, 35), CONV], (R,))
  (y,) = outputs_of(jaxpr, lax.reshape_p)
  x = next(e for e in jaxpr.eqns if e.primitive is lax.reshape_p).invars[0]
  assert layout.formats[x] == ShardFormat(CONV, (315,), 8)
  assert layout.formats[y] == ShardFormat((9, 35), (315,), 8)
  assert layout.formats[jaxpr.invars[0]] == layout.formats[y]


def test_reduction_over_trailing_dims_keeps_them_apart_and_shards_the_kept_ones():
  """Adafactor-like row statistics: mean over the last dim. The reduced dim
  is never merged with the kept ones, so the shard dim [45] is kept and the
  reduction is local; the statistic shares the kept dims' format."""
  def step(w, x):
    g = lax.pmean(x * 2.0, "data")
    r = jnp.mean(g * g, axis=-1, keepdims=True)
    return (w - 0.1 * g / jnp.sqrt(r + 1e-30),)

  jaxpr, _, layout = assign(step, [R, X], [CONV] * 2, (R,))
  fmt = layout.formats[jaxpr.invars[0]]
  assert fmt == ShardFormat(CONV, (45, 7), 8)
  assert (fmt.shard_shape, fmt.padding) == ((6, 7), 3)
  (stat,) = outputs_of(jaxpr, lax.reduce_sum_p)
  assert layout.formats[stat] == ShardFormat((3, 3, 5), (45,), 8)
  assert all(f.merged_shape in ((45, 7), (45,)) for f in layout.formats.values())
  assert layout.partial == frozenset()  # Local: the shard dim is kept.


def test_reduction_over_the_leading_dim_leaves_partial_results():
  def step(w, x):
    g = lax.pmean(x * 2.0, "data")
    return (w - 0.1 * g * jnp.sum(g * g, axis=0),)

  jaxpr, _, layout = assign(step, [R, X], [CONV] * 2, (R,))
  fmt = layout.formats[jaxpr.invars[0]]
  assert fmt == ShardFormat(CONV, (3, 105), 8)  # The reduced dim alone is the shard dim.
  assert (fmt.shard_shape, fmt.padding) == ((1, 105), 5)
  (stat,) = outputs_of(jaxpr, lax.reduce_sum_p)
  assert layout.partial == {stat}  # Masked partial sums, then an all-reduce (Fig. 6).


def test_reduction_to_a_scalar_keeps_the_flat_format():
  def lars(w, x):
    g = lax.pmean(x * 2.0, "data")
    return (w - 0.1 * jnp.sqrt(jnp.sum(w * w)) * g,)

  jaxpr, _, layout = assign(lars, [R, X], [CONV] * 2, (R,))
  assert set(layout.formats.values()) == {ShardFormat(CONV, (315,), 8)}
  assert layout.partial == frozenset()  # A scalar: never a format, all-reduced whole.


def test_reshape_that_regroups_dims_a_reduction_keeps_apart_has_no_layout():
  def step(w, x):
    g = lax.pmean(x * 2.0, "data").reshape(9, 35)
    return (w - 0.1 * g / jnp.sum(g, axis=1, keepdims=True),)

  _, _, why = assign(step, [R, X], [(9, 35), CONV], (R,))
  assert why == causes.Regroups("float32[9,35]"), why


def test_reduction_keeping_the_shard_dim_with_a_result_too_small_to_shard_has_no_layout():
  def step(w, x):
    g = lax.pmean(x * 2.0, "data")
    return (w - 0.1 * g * jnp.sum(g, axis=1, keepdims=True),)

  _, _, why = assign(step, [R, X], [(8, 5)] * 2, (R,))
  assert isinstance(why, causes.SmallReduction) and "float32[8]" in causes.words(why), why


def test_operand_broadcast_along_a_new_leading_dim_is_read_whole():
  def step(w, x, b):
    g = lax.pmean(x * 2.0, "data")
    return (w - 0.1 * g * b[None, :],)

  jaxpr, _, layout = assign(step, [R, X, R], [(4, 64), (4, 64), (64,)], (R,))
  (row,) = outputs_of(jaxpr, lax.broadcast_in_dim_p)
  assert row.aval.shape == (1, 64) and layout.whole_reads == {row}
  # The new leading dim stays apart from the operand's: [4,64] is not merged.
  assert layout.formats[jaxpr.invars[0]] == ShardFormat((4, 64), (4, 64), 8)


def test_reduction_over_a_middle_dim_carries_its_boundaries_to_the_statistic():
  """sum over dim 2 of [3,3,5,7]: the weight is [9,5,7]; its statistic
  [3,3,7] keeps the boundary between the dims on either side of the reduced
  one, [9,7], so that the two shards hold the same rows."""
  def step(w, x):
    g = lax.pmean(x * 2.0, "data")
    return (w - 0.1 * g * jnp.sum(g * g, axis=2, keepdims=True),)

  jaxpr, _, layout = assign(step, [R, X], [CONV] * 2, (R,))
  fmt = layout.formats[jaxpr.invars[0]]
  assert fmt == ShardFormat(CONV, (9, 5, 7), 8)
  assert (fmt.shard_shape, fmt.padding) == ((2, 5, 7), 7)
  (stat,) = outputs_of(jaxpr, lax.reduce_sum_p)
  assert layout.formats[stat] == ShardFormat((3, 3, 7), (9, 7), 8)
  assert layout.partial == frozenset()


def test_boundaries_of_a_reduced_statistic_come_back_to_the_weight():
  """A row statistic [3,3,5] reduced again over its dim 1 must keep dims 0, 1
  and 2 apart; so must the weight whose rows it shares: nothing is merged."""
  def step(w, x):
    g = lax.pmean(x * 2.0, "data")
    r = jnp.sum(g * g, axis=3)
    return (w - 0.1 * g * jnp.sum(jnp.sum(r, axis=1)),)

  jaxpr, _, layout = assign(step, [R, X], [CONV] * 2, (R,))
  fmt = layout.formats[jaxpr.invars[0]]
  assert fmt == ShardFormat(CONV, CONV, 8) and fmt.shard_shape == (1, 3, 5, 7)
  first, second, _ = outputs_of(jaxpr, lax.reduce_sum_p)
  assert layout.formats[first] == ShardFormat((3, 3, 5), (3, 3, 5), 8)
  assert layout.formats[second] == ShardFormat((3, 5), (3, 5), 8)


def _declared_at(kind: Kind) -> str:
  """`file:line` of `kind`'s member in `shardable.Kind`."""
  lines, start = inspect.getsourcelines(Kind)
  k = next(k for k, line in enumerate(lines) if line.lstrip().startswith(f"{kind.name} = "))
  return f"{inspect.getsourcefile(Kind)}:{start + k}"


@pytest.mark.parametrize("module, table, decorator", [
    ("wus.analysis.layouts", "layout_rules", "layout_rule"),
    ("wus.transforms.rewrite", "shard_rules", "shard_rule"),
])
def test_every_kind_has_a_layout_rule_and_a_shard_rule(module, table, decorator):
  """A Kind added without its layout constraint or its rewrite fails here, not in a user's
  step, naming the Kind's line and where its rule goes."""
  mod = importlib.import_module(module)
  missing = [f"{k} ({_declared_at(k)}): add @{decorator}({k}) at its rule in "
             f"{inspect.getsourcefile(mod)}" for k in Kind if k not in getattr(mod, table)]
  assert not missing, "\n".join(missing)
  assert set(getattr(mod, table)) == set(Kind)
