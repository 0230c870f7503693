"""`shard_group_size=G` on a 1-D data-parallel axis (§5.2, Fig. 10).

N = M x G replicas of one axis "data": the update is sharded within groups of
G consecutive devices, the gradient shards all-reduced across the M groups.
The user's step is unchanged (`pmean(grads, "data")`, `axis_index("data")`).

Exactness: the gradient sums run in another order than the unmodified step's
one all-reduce over N (within groups, then across), so against it the results
agree to rounding; against partial sharding of a 2-D (M, G) mesh written by
hand, which sums in the same order, they agree bit for bit, every optimizer.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import wus
from helpers import (PMAP_TX, SPECS, assert_trees_equal, collective_lines, dense_inputs,
                     dense_step, inputs, make_params, make_step, mesh, pmap_params, pmap_step,
                     pmap_xs, replica_groups, run, sharded_leaves, stack)
from wus.analysis import reasons
from wus.analysis.reasons import Reason
from wus.analysis.causes import GroupsOfOne

CASES = [(8, 2), (8, 4), (6, 3)]  # (N, G)
CASE_IDS = [f"N{n}G{g}" for n, g in CASES]
# The parity families over every optimizer and vma mode run N = 8, G = 4 by default; the
# other (N, G) are opt-in (--slow; up to 1.5 min each on a loaded machine).
SLOW_CASES = [pytest.param(n, g, id=i, marks=() if (n, g) == (8, 4) else pytest.mark.slow)
              for (n, g), i in zip(CASES, CASE_IDS, strict=True)]
OPTIMIZERS = [
    ("adam", lambda: optax.adam(1e-2)),
    ("lamb", lambda: optax.lamb(1e-2)),
    ("clip_adam", lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))),
]
# The two parity families run adam by default, the reducing optimizers with --slow.
SLOW_OPTIMIZERS = [pytest.param(name, make, id=name,
                                marks=() if name == "adam" else pytest.mark.slow)
                   for name, make in OPTIMIZERS]
ROUNDING = dict(rtol=1e-6, atol=1e-7)  # Sums over N in another order (test_partial.py's).
# Sizes G does not divide (7 for every G; 64 and 315 for some), a bfloat16 leaf, a scalar.
SMALL = {"scalar": (), "v7": (7,), "conv": (3, 3, 5, 7), "big": (40, 24), "bias": (64,)}
DENSE = (P(), P(), P("data"))


def _vma_ids(check_vma):
  return "vma" if check_vma else "novma"


@pytest.mark.parametrize("name,make_tx", SLOW_OPTIMIZERS)
@pytest.mark.parametrize("check_vma", [True, False], ids=_vma_ids)
@pytest.mark.parametrize("n,g", SLOW_CASES)
def test_dense_layer_matches_the_unmodified_step(n, g, check_vma, name, make_tx):
  """A Dense layer with a bias as users write it (w [24, 40], b [40]), three steps."""
  m, tx = mesh(n), make_tx()
  params, xs = dense_inputs(m)
  kw = dict(mesh=m, in_specs=DENSE, out_specs=(P(), P()), check_vma=check_vma)
  ref = jax.jit(jax.shard_map(dense_step(tx), **kw))
  ws = wus.shard_map(dense_step(tx), shard_group_size=g, **kw)
  a = b = (params, tx.init(params))
  for x in xs:
    a, b = ref(*a, x), ws(*b, x)
  assert_trees_equal(a[0], b[0], **ROUNDING)
  assert_trees_equal(a[1], wus.unshard(b[1]), **ROUNDING)
  assert {x.format.num_shards for x in sharded_leaves(b[1])} == {g}
  assert b[0]["w"].sharding.mesh == m  # Whole values leave on the user's mesh.


@pytest.mark.parametrize("name,make_tx", SLOW_OPTIMIZERS)
@pytest.mark.parametrize("check_vma", [True, pytest.param(False, marks=pytest.mark.slow)],
                         ids=_vma_ids)  # Without check_vma: test_dense_layer_matches... above.
@pytest.mark.parametrize("n,g", SLOW_CASES)
def test_bit_for_bit_as_a_two_axis_mesh_sharded_by_hand(n, g, check_vma, name, make_tx):
  """The same step on a hand-made (M, G) mesh, pmean over both axes and
  axis_name= the inner one, sums in the same order: equal bit for bit."""
  m, tx = mesh(n), make_tx()
  m2 = jax.make_mesh((n // g, g), ("groups", "member"), devices=jax.devices()[:n])
  params, state, extra, data = inputs(tx, m, params=make_params(SMALL))
  ws = wus.shard_map(make_step(tx), mesh=m, check_vma=check_vma, shard_group_size=g, **SPECS)
  by_hand = wus.shard_map(make_step(tx, axis=("groups", "member")), mesh=m2, axis_name="member",
                          check_vma=check_vma, in_specs=(P(), P(), P(), P(("groups", "member"))),
                          out_specs=SPECS["out_specs"])
  a = run(by_hand, params, state, extra,
          [jax.device_put(x, NamedSharding(m2, P(("groups", "member")))) for x in data])
  b = run(ws, params, state, extra, data)
  assert_trees_equal(a[0], b[0])
  assert_trees_equal(wus.unshard(a[1]), wus.unshard(b[1]))
  assert_trees_equal(a[2:], b[2:])
  sharded = sharded_leaves(b[1])
  assert {x.format.num_shards for x in sharded} == {g}
  assert len(sharded) == len(sharded_leaves(a[1])) >= 8  # mu and nu of each non-scalar leaf.


@pytest.mark.parametrize("check_vma", [True, False], ids=_vma_ids)
def test_axis_index_and_collectives_over_the_axis_keep_their_meaning(check_vma):
  """axis_index("data") is the replica's index among all N (group * G + index in
  group); an all_gather over "data" orders replicas as before."""
  m, tx = mesh(8), optax.adam(1e-2)

  def gather(v):
    if not check_vma:
      return jax.lax.all_gather(v, "data")
    # Invariant under check_vma: each replica's value at its index, zeros elsewhere, summed.
    return jax.lax.psum(jax.nn.one_hot(jax.lax.axis_index("data"), 8, dtype=v.dtype) * v, "data")

  def step(params, opt_state, x):
    i = jax.lax.axis_index("data")
    x = x * (1.0 + i)  # Each replica's batch scaled by its index.
    loss, grads = jax.value_and_grad(
        lambda p: jnp.mean(jnp.tanh(x @ p["w"] + p["b"]) ** 2))(params)
    grads = jax.lax.pmean(grads, "data")
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state,
            gather(loss), gather(i))

  params, xs = dense_inputs(m, steps=2)
  kw = dict(mesh=m, in_specs=DENSE, out_specs=(P(), P(), P(), P()), check_vma=check_vma)
  ref, ws = jax.jit(jax.shard_map(step, **kw)), wus.shard_map(step, shard_group_size=4, **kw)
  a = b = (params, tx.init(params))
  for k, x in enumerate(xs):
    ra, rb = ref(*a, x), ws(*b, x)
    a, b = ra[:2], rb[:2]
    # Per-replica losses, computed before any sum: equal at first, then rounding.
    assert_trees_equal(ra[2], rb[2], **({} if k == 0 else ROUNDING))
    np.testing.assert_array_equal(rb[3], np.arange(8))
  assert_trees_equal(a[0], b[0], **ROUNDING)
  assert_trees_equal(a[1], wus.unshard(b[1]), **ROUNDING)


def test_pmap_with_a_group_size():
  """wus.pmap(..., shard_group_size=4) against jax.pmap, with a dropout key
  folded with axis_index (Flax WMT style)."""
  params, state = stack(pmap_params()), stack(PMAP_TX.init(pmap_params()))
  rng = jax.random.split(jax.random.key(3), 8)
  ref = jax.pmap(pmap_step, axis_name="batch")
  ws = wus.pmap(pmap_step, axis_name="batch", shard_group_size=4)
  a = b = (params, state)
  for x in pmap_xs():
    ra, rb = ref(*a, x, dropout_rng=rng), ws(*b, x, dropout_rng=rng)
    a, b = ra[:2], rb[:2]
    assert_trees_equal(ra[2], rb[2], **ROUNDING)
  assert_trees_equal(a[0], b[0], **ROUNDING)
  whole = wus.unshard(b[1])
  assert_trees_equal(a[1], whole, **ROUNDING)
  assert {x.format.num_shards for x in sharded_leaves(b[1])} == {4}
  assert whole[0].mu["w"].shape == (8, 24, 40)  # Stacked copies, as jax.pmap returns them.
  plan = ws.plan(*b, pmap_xs()[0], dropout_rng=rng)
  assert plan.group_size == 4 and plan.num_shards == 4


# --- Structure: the compiled step's collectives and memory. ------------------------------


@pytest.mark.parametrize("n,g", SLOW_CASES)
def test_collectives_run_in_groups_of_g_and_across_them_batched(n, g):
  m, tx = mesh(n), optax.adam(1e-2)
  params, state, extra, data = inputs(tx, m, steps=1, params=make_params(SMALL))
  ws = wus.shard_map(make_step(tx), mesh=m, shard_group_size=g, **SPECS)
  params, state, extra, _ = ws(params, state, extra, data[0])
  plan = ws.plan(params, state, extra, data[0])
  hlo = ws.lower(params, state, extra, data[0]).compile().as_text()
  ids = [d.id for d in m.devices.flat]
  within = sorted(tuple(ids[k:k + g]) for k in range(0, n, g))  # Consecutive devices.
  across = sorted(tuple(ids[k::g]) for k in range(g))
  scatters, gathers = collective_lines(hlo, "reduce-scatter"), collective_lines(hlo, "all-gather")
  assert scatters and gathers
  for line in scatters + gathers:
    assert sorted(replica_groups(line)) == within, line
  reduces = [sorted(replica_groups(line)) for line in collective_lines(hlo, "all-reduce")]
  # Batched: 7 sharded gradients (SMALL and the bfloat16 leaf), one all-reduce across.
  assert plan.across_groups == 1
  assert reduces.count(across) == plan.across_groups
  # The rest are the all-reduces the step keeps whole (the loss, the scalar's gradient).
  assert all(r in (across, [tuple(ids)]) for r in reduces)
  assert (plan.group_size, plan.groups.num_groups, plan.groups.across) == (
      g, n // g, plan.across_groups)
  partial = reasons.PartialSharding(("data.in_group",), ("data.groups",))
  assert all(c.why.notes == (partial,) for c in plan.clusters if c.sharded), plan
  assert plan.num_shards == g and sum(c.sharded for c in plan.clusters) >= 5


@pytest.mark.parametrize("n,g", CASES, ids=CASE_IDS)
def test_optimizer_state_per_device_is_one_gth(n, g):
  """Measured from the arrays each device holds: V/G within 1% (Adam on a
  [1024, 1024] matrix and smaller leaves). Device k of the axis holds shard
  k mod G: groups are consecutive devices."""
  m, tx = mesh(n), optax.adam(1e-2)
  params, state, extra, data = inputs(tx, m, steps=1)
  ws = wus.shard_map(make_step(tx), mesh=m, shard_group_size=g, **SPECS)
  _, state, _, _ = ws(params, state, extra, data[0])
  whole = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(wus.unshard(state)))
  leaves = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, wus.ShardedArray))
  for device in m.devices.flat:
    held = sum(s.data.nbytes for x in leaves
               for s in (x.data if isinstance(x, wus.ShardedArray) else x).addressable_shards
               if s.device == device)
    assert abs(held / (whole / g) - 1) < 0.01, (device, held, whole / g)
  mu = state[0].mu["big"]
  for k, device in enumerate(m.devices.flat):
    (index,) = [s.index for s in mu.data.addressable_shards if s.device == device]
    assert index[0].start // mu.format.shard_rows == k % g


# --- State: unshard, checkpoints, another G. ------------------------------------------------


def _adam_run(m, g, steps=2):
  tx = optax.adam(1e-2)
  params, xs = dense_inputs(m, steps=steps)
  ws = wus.shard_map(dense_step(tx), mesh=m, in_specs=DENSE, out_specs=(P(), P()),
                     shard_group_size=g)
  state = (params, tx.init(params))
  for x in xs:
    state = ws(*state, x)
  return ws, state, xs


def test_state_sharded_with_one_g_is_converted_for_another():
  """Same devices, another G (or none): the state is gathered and re-sharded,
  and the result is what the whole state gives."""
  m = mesh(8)
  _, (params, state), xs = _adam_run(m, 2)
  assert {x.format.num_shards for x in sharded_leaves(state)} == {2}
  for g in (4, None, 1):
    step = wus.shard_map(dense_step(optax.adam(1e-2)), mesh=m, in_specs=DENSE,
                         out_specs=(P(), P()), shard_group_size=g)
    got = step(params, state, xs[0])
    want = step(params, wus.unshard(state), xs[0])
    assert_trees_equal(wus.unshard(got), wus.unshard(want))
    assert {x.format.num_shards for x in sharded_leaves(got[1])} == ({4} if g == 4 else
                                                                    {8} if g is None else set())


def test_unshard_and_checkpoint_restore(tmp_path):
  """wus.unshard gives whole arrays on the user's mesh; Orbax saves the
  G-sharded state and restores it for steps with the same G and another."""
  m = mesh(8)
  ws, (params, state), xs = _adam_run(m, 4)
  whole = wus.unshard(state)
  assert whole[0].mu["w"].sharding.mesh == m
  assert whole[0].mu["w"].sharding.is_equivalent_to(NamedSharding(m, P()), 2)
  ckptr = ocp.StandardCheckpointer()
  ckptr.save(tmp_path / "ckpt", wus.checkpointable({"params": params, "opt_state": state}))
  ckptr.wait_until_finished()
  for g in (4, 2):
    step = wus.shard_map(dense_step(optax.adam(1e-2)), mesh=m, in_specs=DENSE,
                         out_specs=(P(), P()), shard_group_size=g)
    p, s, _ = step.state_target(params, state, xs[0])
    restored = ocp.StandardCheckpointer().restore(tmp_path / "ckpt",
                                                  {"params": p, "opt_state": s})
    assert {x.format.num_shards for x in sharded_leaves(restored["opt_state"])} == {g}
    assert_trees_equal(whole, wus.unshard(restored["opt_state"]))
    got = step(restored["params"], restored["opt_state"], xs[0])
    want = step(params, whole, xs[0])
    assert_trees_equal(wus.unshard(got), wus.unshard(want))


# --- G = N, G = 1, bad G. ----------------------------------------------------------------


def test_g_equal_to_n_is_plain_sharding_and_g_one_shards_nothing():
  m, tx = mesh(8), optax.adam(1e-2)
  params, state, extra, data = inputs(tx, m, params=make_params(SMALL))
  kw = dict(mesh=m, **SPECS)
  plain = run(wus.shard_map(make_step(tx), **kw), params, state, extra, data)
  step8 = wus.shard_map(make_step(tx), shard_group_size=8, **kw)
  assert_trees_equal(wus.unshard(plain), wus.unshard(run(step8, params, state, extra, data)))
  plan8 = step8.plan(params, state, extra, data[0])
  assert plan8.num_shards == 8 and plan8.axes == ("data",) and not plan8.groups.num_groups
  assert not any(c.why.notes for c in plan8.clusters if c.sharded)  # No partial sharding.

  ref = run(jax.jit(jax.shard_map(make_step(tx), **kw)), params, state, extra, data)
  step1 = wus.shard_map(make_step(tx), shard_group_size=1, **kw)
  got = run(step1, params, state, extra, data)
  assert_trees_equal(ref, got)  # The step replayed unchanged: bit for bit.
  assert not sharded_leaves(got)
  plan1 = step1.plan(params, state, extra, data[0])
  assert plan1.clusters and not any(c.sharded for c in plan1.clusters)
  # Each cluster's verdict is the groups' own words: one replica per group.
  assert plan1.groups.layout.startswith("shard_group_size=1: groups of one replica")
  assert all(c.why == Reason(GroupsOfOne("data")) for c in plan1.clusters), plan1
  assert all(str(c.why) == plan1.groups.layout for c in plan1.clusters), plan1
  assert not any(i.sharded for i in plan1.inputs)


@pytest.mark.parametrize("bad", [0, -2, 2.5, True, "automatic", "4"])
def test_a_group_size_that_is_not_a_positive_int_is_refused(bad):
  with pytest.raises(ValueError, match=r"shard_group_size must be a positive int"):
    wus.shard_map(dense_step(optax.adam(1e-2)), mesh=mesh(8), in_specs=DENSE,
                  out_specs=(P(), P()), shard_group_size=bad)
  with pytest.raises(ValueError, match=r"shard_group_size must be a positive int"):
    wus.pmap(pmap_step, axis_name="batch", shard_group_size=bad)


@pytest.mark.parametrize("n,g", [(8, 3), (8, 16), (6, 4)])
def test_a_group_size_that_does_not_divide_the_axis_says_what_to_pass(n, g):
  m = mesh(n)
  params, xs = dense_inputs(m, steps=1)
  step = wus.shard_map(dense_step(optax.adam(1e-2)), mesh=m, in_specs=DENSE,
                       out_specs=(P(), P()), shard_group_size=g)
  divisors = [d for d in range(1, n + 1) if n % d == 0]
  with pytest.raises(ValueError, match=re.escape(
      f"shard_group_size={g} must divide the {n} replicas of mesh axis 'data': pass one of "
      f"{divisors}")):
    step(params, optax.adam(1e-2).init(params), xs[0])


def test_a_group_size_with_several_sharding_axes_is_refused():
  m = jax.make_mesh((2, 4), ("replica", "data"))
  spec = P(("replica", "data"))
  step = wus.shard_map(make_step(optax.adam(1e-2), axis=("replica", "data")), mesh=m,
                       shard_group_size=2, in_specs=(P(), P(), P(), spec),
                       out_specs=SPECS["out_specs"])
  params, state, extra, data = inputs(optax.adam(1e-2), m, steps=1, params=make_params(SMALL))
  x = jax.device_put(np.asarray(data[0]), NamedSharding(m, spec))
  with pytest.raises(ValueError, match=r"one mesh axis.*\['replica', 'data'\].*axis_name="):
    step(params, state, extra, x)


def test_embedding_lookup_whose_gradient_scatter_adds():
  """The gradient of `table[ids]` is a scatter-add, which holds a jaxpr (its
  combiner) that names no mesh axis: it runs on the derived mesh unchanged
  (found by wus-bench's image classifier)."""
  m = mesh(8)
  tx = optax.adam(1e-2)

  def step(params, opt_state, ids):
    loss = lambda p: jnp.mean(jnp.tanh(p["table"][ids]).sum(-1) ** 2)
    grads = jax.lax.pmean(jax.grad(loss)(params), "data")
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  params = {"table": 0.5 * jax.random.normal(jax.random.key(0), (40, 16))}
  ids = jax.device_put(jnp.arange(8 * 3).reshape(8, 3) % 40, NamedSharding(m, P("data")))
  kw = dict(mesh=m, in_specs=(P(), P(), P("data")), out_specs=(P(), P()))
  a = jax.jit(jax.shard_map(step, **kw))(params, tx.init(params), ids)
  b = wus.shard_map(step, shard_group_size=4, **kw)(params, tx.init(params), ids)
  assert_trees_equal(a[0], b[0], rtol=1e-6, atol=1e-7)
  assert {x.format.num_shards for x in sharded_leaves(b[1])} == {4}
