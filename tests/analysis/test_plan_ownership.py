"""analysis/ownership.py's `plan_ownership` alone (issue 31 item 7): the replicated clusters
the planner's stages before it leave (`_find_clusters`, `plan_cluster`), planned as updates
of whole tensors, one owner each, or kept replicated with the reason as a value.

The step is momentum with a Newton-Schulz-style update (`1.5 m - 0.5 (m m^T) m`, as Muon's
iteration): the matmuls need the whole momentum, so no cluster runs on shards, but each
weight's update reads only its own gradient, momentum and weight.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from helpers import analysed_body, mesh
from wus.analysis import causes, compat, network, ownership, planner, reasons
from wus.analysis.graph import Graph
from wus.analysis.owned import OwnedFormat
from wus.analysis.plan_cluster import Planning, Scope, plan_cluster
from wus.analysis.planning import PlanningContext
from wus.analysis.shardable import Kind

N = 8


def _newton_schulz(m):
  return 1.5 * m - 0.5 * (m @ m.T) @ m


def _step(k: int, metric: bool = False):
  """`k` weights and their momenta; with `metric`, a loss on the batch also reads the first
  new weight (a value of its update read whole by computation that differs across replicas)."""
  def step(*args):
    ws, ms, x = args[:k], args[k:2 * k], args[-1]
    gs = jax.grad(lambda ws: sum(jnp.sum(jnp.tanh(x @ w)) for w in ws))(ws)
    gs = [lax.pmean(g, "data") for g in gs]
    ms = [0.9 * m + g for m, g in zip(ms, gs, strict=True)]
    new = [w - 0.1 * _newton_schulz(m) for w, m in zip(ws, ms, strict=True)]
    return (*new, *ms, *([x @ new[0]] if metric else []))
  return step


def _owned(k: int, dim: int = 16, metric: bool = False):
  """(jaxpr, the replicated candidates, what `plan_ownership` adds) for `_step(k)`."""
  out_specs = (P(),) * (2 * k) + ((P("data"),) if metric else ())
  jaxpr, facts = analysed_body(_step(k, metric), [P()] * (2 * k) + [P("data")],
                               [(dim, dim)] * (2 * k) + [(2, dim)], out_specs, mesh=mesh(N))
  names = [f"w{i}" for i in range(k)] + [f"m{i}" for i in range(k)]
  candidates, owned = _own(jaxpr, facts, {i: i for i in range(2 * k)}, [*names, "x"],
                           names + (["metric"] if metric else []))
  return jaxpr, candidates, owned


def _own(jaxpr, facts, state_pairs, in_names, out_names):
  """The planner's stages up to ownership, on N replicas: (the replicated clusters
  ownership may take, what `ownership.plan_ownership` adds)."""
  graph = Graph(jaxpr, N)
  ctx = PlanningContext(facts, frozenset({"data"}), N, 0, graph.big, "memory",
                        network.default_topology(N))
  scope = Scope(graph, state_pairs, in_names, out_names)
  acc = Planning()
  found = planner._find_clusters(scope, ctx, acc)
  clustered = {i for c in found for i in c.eqns}
  for c in found:
    plan_cluster(scope, ctx, acc, c, clustered)
  return acc.candidates, ownership.plan_ownership(graph, ctx, acc.candidates, acc.shard_eqns,
                                                  state_pairs, in_names, out_names)


def test_equal_updates_one_per_replica_each_with_its_own_state_and_weight():
  """Eight updates of one shape on eight replicas: a stack of one per replica. A cluster's
  weight, its momentum's row slot and its gradient all-reduce (OWNED_SCATTER) belong to
  the one owner its Reason names."""
  k = N
  jaxpr, candidates, owned = _owned(k)
  assert len(candidates) == k and all(not cp.sharded for _, _, cp in candidates)
  assert owned.ownership is not None and len(owned.ownership.units) == k
  assert sorted(c.owner for c in owned.clusters.values()) == list(range(N))
  for idx, c in owned.clusters.items():
    assert c.why == reasons.Reason(reasons.Owned(
        c.owner, f"slot {c.owner} of stack 0 (1 contiguous per replica)", 14,
        c.why.verdict.seconds)), c.why
    assert not c.sharded and c.why.verdict.seconds > 0
  # Weight i and momentum k + i: read whole / kept on the same owner, by the same cluster.
  for i in range(k):
    sharded, on_weight = owned.input_reason[i]
    kept, on_state = owned.input_reason[k + i]
    assert not sharded and kept
    assert on_state == reasons.OnOwner(on_weight.owner, on_weight.index, True)
    assert on_weight == reasons.OnOwner(on_state.owner, on_state.index, False)
    assert owned.clusters[on_state.index].owner == on_state.owner
    fmt = owned.sharded_in[k + i]
    assert isinstance(fmt, OwnedFormat) and owned.sharded_out[k + i] == fmt
    assert fmt.bank.slots[fmt.index].owner == on_state.owner
  scatters = [i for i, kind in owned.kinds.items() if kind is Kind.OWNED_SCATTER]
  assert len(scatters) == k
  # pmean under check_vma: psum_invariant.
  assert {jaxpr.eqns[i].primitive for i in scatters} == {compat.psum_invariant_p}
  assert set(owned.kinds) >= {i for u in owned.ownership.units for i in u.eqns}


def test_too_few_updates_to_balance_stay_replicated_with_the_reason():
  """Two updates on eight replicas: rows as long as the busiest replica's pad six of
  them; predicted slower owned, both stay replicated (largest first), nothing owned."""
  _, candidates, owned = _owned(2, dim=64)
  assert owned.ownership is None and not owned.kinds and not owned.sharded_in
  assert set(owned.clusters) == {idx for idx, _, _ in candidates}
  for idx, _, cp in candidates:
    c = owned.clusters[idx]
    assert c.owner is None and c.why.verdict == cp.why.verdict
    assert c.why.notes[:-1] == cp.why.notes
    (last,) = c.why.notes[-1:]
    assert isinstance(last, reasons.NotOwned) and isinstance(last.why, causes.TooLargeToBalance)
    assert last.why.owned > last.why.replicated, last.why


def test_an_update_read_whole_by_computation_that_differs_stays_replicated():
  """A loss on the batch reads the first new weight: the update's value leaves the unit to
  a reader that differs across replicas, so that cluster is not owned (the reader named);
  the other seven are owned."""
  jaxpr, candidates, owned = _owned(N, metric=True)
  not_owned = {idx: c for idx, c in owned.clusters.items() if c.owner is None}
  assert len(not_owned) == 1 and len(owned.ownership.units) == N - 1
  (c,) = not_owned.values()
  note = c.why.notes[-1]
  assert isinstance(note, reasons.NotOwned)
  assert isinstance(note.why, causes.ReadOutside), note.why
  assert note.why.reader.primitive == "dot_general", note.why
  assert note.why.aval.startswith("float32[16,16]"), note.why
  assert note.why.reader.line.endswith("(_step.<locals>.step)"), note.why
  # The weight it leaves whole is w0 (input 0): no owner reads it.
  assert 0 not in owned.input_reason and N not in owned.input_reason


@pytest.mark.parametrize("k", [N, 2 * N])
def test_every_owned_unit_is_one_replicas_and_the_loads_balance(k):
  """k = N, 2N equal updates: k / N per replica, contiguous in one stack."""
  _, _, owned = _owned(k, dim=8)
  units = owned.ownership.units
  per = [sum(u.owner == r for u in units) for r in range(N)]
  assert per == [k // N] * N
  assert max(owned.ownership.loads) == pytest.approx(min(owned.ownership.loads))


class _MLP(nn.Module):
  """Nine [32, 32] hidden Dense kernels and a [32, 4] head, with biases."""

  @nn.compact
  def __call__(self, x):
    for _ in range(N + 1):
      x = nn.tanh(nn.Dense(32)(x))
    return nn.Dense(4)(x)


def test_muon_over_flax_dense_layers_owns_each_kernel_and_its_momentum():
  """optax.contrib.muon on a Flax MLP (the step as the shard_map examples write it, flattened
  for `analysed_body`): the kernels' Newton-Schulz updates are the candidates, each owned
  with its momentum on its owner; the biases' Adam is no candidate (it runs on shards).
  The nine equal kernels fill one round of slots and one remainder; the head is a stack
  of its own."""
  model, tx = _MLP(), optax.contrib.muon(1e-2)
  params = model.init(jax.random.key(0), jnp.zeros((1, 32)))["params"]
  paths, treedef = jax.tree_util.tree_flatten_with_path((params, tx.init(params)))
  k, names = len(paths), [jax.tree_util.keystr(p) for p, _ in paths]

  def step(*args):
    params, opt_state = jax.tree.unflatten(treedef, args[:k])
    loss = lambda p: jnp.mean(model.apply({"params": p}, args[k]) ** 2)  # noqa: E731
    grads = lax.pmean(jax.grad(loss)(params), "data")
    updates, opt_state = tx.update(grads, opt_state, params)
    return tuple(jax.tree.leaves((optax.apply_updates(params, updates), opt_state)))

  shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for _, x in paths] + [(2, 32)]
  jaxpr, facts = analysed_body(step, [P()] * k + [P("data")], shapes, (P(),) * k, mesh=mesh(N))
  candidates, owned = _own(jaxpr, facts, {i: i for i in range(k)}, [*names, "x"], names)
  kernels = {n for n in names if n.endswith("['kernel']")}
  assert len(candidates) == len(owned.ownership.units) == N + 2
  assert {names[p] for p in owned.input_reason} == kernels  # Each kernel and its mu; no bias.
  for p, (kept, on) in owned.input_reason.items():
    assert kept == on.state == ("mu" in names[p]) and owned.clusters[on.index].owner == on.owner
  wheres = sorted(c.why.verdict.where for c in owned.clusters.values())
  assert wheres == sorted([f"slot {r} of stack 1 (1 contiguous per replica)" for r in range(N)]
                          + [f"stack {s} remainder, balanced by predicted cost" for s in (0, 1)])
