"""The Plan names every cluster's tensors and decision; unsupported updates stay replicated."""

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import wus
from helpers import REDUCING, assert_trees_equal, batches, both, loop_setup, make_params
from wus.analysis import causes, reasons, verdicts
from wus.analysis.reasons import Reason


def _mesh():
  return jax.make_mesh((8,), ("data",))


def _plan(step, tx):
  params = make_params()
  (b,) = batches(_mesh(), 1)
  return step.plan(params, tx.init(params), {"counter": jax.numpy.zeros(16, "int32")}, b)


def test_adam_plan_lists_every_state_tensor():
  _, _, step = both(optax.adam(1e-2), _mesh(), steps=1)
  plan = _plan(step, optax.adam(1e-2))
  inputs = {i.name: i for i in plan.inputs}
  for k in ("big", "conv", "bias", "half"):
    # Adam's mu and nu of a weight: kept sharded, as only the cluster that updates it reads
    # them, and that cluster (which names the weight) runs on shards.
    mu, nu = inputs[f"opt_state[0].mu['{k}']"], inputs[f"opt_state[0].nu['{k}']"]
    assert mu.sharded and nu.sharded and mu.why == nu.why
    (index,) = [c.index for c in plan.clusters if f"params['{k}']" in {t.name for t in c.tensors}]
    assert mu.why == Reason(reasons.OnlyCluster(index)) and plan.clusters[index].sharded
  count = inputs["opt_state[0].count"]
  assert not count.sharded and count.why == Reason(reasons.Tiny(8, plan.min_size))
  whole, shard = plan.state_bytes
  assert 0 < shard * 8 - whole < 8 * 8 * 4 * 8  # Padding is less than N rows per tensor.


# AGC and clipping (tests/collectives/), and the trust ratio alone (LARS and LAMB have it),
# with --slow.
@pytest.mark.parametrize("name,make_tx", [
    pytest.param(*r, id=r[0],
                 marks=pytest.mark.slow if r[0] in ("agc", "clip_adam", "trust_ratio") else ())
    for r in REDUCING])
def test_norms_run_on_shards_within_summation_order(name, make_tx):
  """Norms: masked local sums, combined by one all-reduce per phase (§4.1, Fig. 6)."""
  ref, got, step = both(make_tx(), _mesh())
  assert_trees_equal(ref[0], got[0], rtol=2e-6, atol=1e-7)
  assert_trees_equal(ref[1], wus.unshard(got[1]), rtol=2e-6, atol=1e-7)
  plan = _plan(step, make_tx())
  big = [c for c in plan.clusters if any(t.shape == (1024, 1024) for t in c.tensors)]
  assert big and all(c.sharded and isinstance(c.why.verdict, verdicts.OnShards) for c in big)
  assert all(c.why.verdict.reductions > 0 for c in big), [c.why for c in big]


def _transform(update):
  """A stateless optax transformation applying `update` to every gradient leaf."""
  return optax.chain(optax.GradientTransformation(
      lambda params: optax.EmptyState(),
      lambda grads, state, params=None: (jax.tree.map(update, grads), state)), optax.sgd(0.1))


def _whole_reader(why: Reason) -> str:
  """The reader with no shard rule that keeps the update whole (`reasons.KeptWhole`)."""
  (kept,) = [x for x in (why.verdict, *why.notes) if isinstance(x, reasons.KeptWhole)]
  return kept.parts[0].reader.primitive


UNSHARDABLE = [
    ("reduce_prod", lambda: _transform(lambda g: g / jax.numpy.prod(1 + 1e-3 * g)),
     lambda why: _whole_reader(why) == "reduce_prod"),
    ("regroup", lambda: _transform(
        lambda g: g + jax.numpy.sum(g.reshape(512, 2048), axis=0).mean() if g.shape == (1024, 1024)
        else g),  # The layout's refusal.
     lambda why: why.verdict == causes.Regroups("float32[512,2048]")),
    ("muon", lambda: optax.contrib.muon(1e-2),  # Newton-Schulz matmuls in a loop.
     lambda why: _whole_reader(why) == "scan"),
]


@pytest.mark.parametrize("name,make_tx,why", [  # Muon's loop (a minute) with --slow.
    pytest.param(*u, id=u[0], marks=pytest.mark.slow if u[0] == "muon" else ())
    for u in UNSHARDABLE])
def test_update_the_rules_cannot_shard_stays_replicated_and_exact(name, make_tx, why):
  """A reduction with no exact shard rule, a reshape that regroups reduced dims,
  matmuls on the weight (Muon): those clusters stay replicated, with the reason."""
  ref, got, step = both(make_tx(), _mesh())
  assert_trees_equal(ref[0]["big"], got[0]["big"])  # Replicated: bit for bit.
  plan = _plan(step, make_tx())
  big = [c for c in plan.clusters if any(t.shape == (1024, 1024) for t in c.tensors)]
  assert big and not any(c.sharded for c in big)
  (update,) = [c for c in big if "params['big']" in {t.name for t in c.tensors}]
  assert why(update.why) and isinstance(update.why.notes[-1], reasons.NotOwned), update.why


def _dp_step(tx):
  """A step on a 2-D (data, model) mesh whose gradient all-reduce is over "data" only."""
  def step(params, opt_state, x):
    loss = lambda p: jnp.sum(jnp.tanh(x @ p["w"])) + jnp.sum(p["b"] * x.mean())
    grads = jax.lax.pmean(jax.grad(loss)(jax.lax.pcast(params, "data", to="varying")), "data")
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state
  return step


def test_default_axis_name_is_the_gradient_all_reduce_axis_on_a_2d_mesh():
  """On a (data, model) mesh the gradients are all-reduced over "data" only: the
  default shards over "data" (N=4), where the all-reduce becomes a reduce-scatter."""
  mesh = jax.make_mesh((4, 2), ("data", "model"))
  tx = optax.adam(1e-2)
  params = {"w": 0.1 * jnp.ones((64, 33)), "b": jnp.ones((3,))}
  kw = dict(mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P()))
  ref = jax.jit(jax.shard_map(_dp_step(tx), **kw))
  step = wus.shard_map(_dp_step(tx), **kw)
  a = b = (params, tx.init(params))
  for i in range(3):
    x = jax.device_put(jax.random.normal(jax.random.key(i), (8, 64)),
                       NamedSharding(mesh, P("data")))
    a, b = ref(*a, x), step(*b, x)
  assert_trees_equal(a, wus.unshard(b))
  plan = step.plan(*b, x)
  assert plan.axes == ("data",) and plan.num_shards == 4
  assert {i.name for i in plan.inputs if i.sharded} == {"opt_state[0].mu['w']",
                                                          "opt_state[0].nu['w']"}
  # Forced over both axes, no all-reduce spans them: the one over "data" runs
  # whole, and its result, identical on all 8 devices, is the update's root,
  # sliced locally (roots.find_roots). The Plan says so; the step is exact.
  forced = wus.shard_map(_dp_step(tx), **kw, axis_name=("data", "model"))
  c = b = (params, tx.init(params))
  for i in range(3):
    x = jax.device_put(jax.random.normal(jax.random.key(i), (8, 64)),
                       NamedSharding(mesh, P("data")))
    c = forced(*c, x)
  assert_trees_equal(a, wus.unshard(c))
  both_axes = forced.plan(*c, x)
  assert both_axes.num_shards == 8
  assert {i.name for i in both_axes.inputs if i.sharded} == {"opt_state[0].mu['w']",
                                                          "opt_state[0].nu['w']"}
  (cluster,) = [c for c in both_axes.clusters if c.sharded]
  assert isinstance(cluster.why.verdict, verdicts.RootsSliced), cluster.why
  assert cluster.why.verdict.what.startswith("psum_invariant at "), cluster.why


def test_totals_count_state_kept_whole():
  """Tiny state (the count, a [3] bias) and weights stay whole: the totals say how much."""
  mesh = jax.make_mesh((8,), ("data",))
  tx = optax.adam(1e-2)
  params = {"w": jnp.ones((64, 32)), "b": jnp.ones((3,))}
  step = wus.shard_map(_dp_step(tx), mesh=mesh, in_specs=(P(), P(), P("data")),
                       out_specs=(P(), P()))
  x = jax.device_put(jnp.ones((16, 64)), NamedSharding(mesh, P("data")))
  plan = step.plan(params, tx.init(params), x)
  whole = 64 * 32 * 4 + 3 * 4 + 4 + 2 * 3 * 4  # w, b, count, mu['b'], nu['b'].
  assert plan.whole_state_bytes == whole
  assert plan.state_bytes == (2 * 64 * 32 * 4, 2 * 64 * 32 * 4 // 8)
  assert not next(i for i in plan.inputs if i.name == "x").state


def test_state_leaf_whose_dtype_changes_stays_unpaired_and_the_rest_shards():
  """An optimizer whose update returns one state leaf in another dtype: that leaf
  is not the next value of its input, but the other leaves still shard on the
  first call (state is matched leaf by leaf within the pytree)."""
  def halve_dtype():
    init = lambda params: {"scale": jnp.float32(1.0), "m": jax.tree.map(jnp.zeros_like, params)}

    def update(grads, state, params=None):
      m = jax.tree.map(lambda m, g: 0.9 * m + g, state["m"], grads)
      return (jax.tree.map(lambda m: -0.1 * m, m),
              {"scale": state["scale"].astype(jnp.bfloat16), "m": m})
    return optax.GradientTransformation(init, update)

  mesh = jax.make_mesh((8,), ("data",))
  tx = halve_dtype()
  params = {"w": jnp.ones((64, 32)), "b": jnp.ones((3,))}
  step = wus.shard_map(_dp_step(tx), mesh=mesh, in_specs=(P(), P(), P("data")),
                       out_specs=(P(), P()))
  x = jax.device_put(jnp.ones((16, 64)), NamedSharding(mesh, P("data")))
  plan = step.plan(params, tx.init(params), x)
  assert [i.name for i in plan.inputs if i.sharded] == ["opt_state['m']['w']"]
  assert not next(i for i in plan.inputs if i.name == "opt_state['scale']").state
  _, state = step(params, tx.init(params), x)
  assert isinstance(state["m"]["w"], wus.ShardedArray) and state["scale"].dtype == jnp.bfloat16


def test_pmap_finds_equal_copies_and_says_which_differ():
  """wus.pmap compares per-device copies itself: equal ones are sharded, differing
  ones stay whole with the reason in the Plan."""
  tx = optax.sgd(0.1, momentum=0.9)

  def step(params, opt_state, x):
    grads = jax.lax.pmean(jax.grad(lambda p: jnp.sum(jnp.tanh(x @ p)))(params), "batch")
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state
  params = jnp.ones((8, 64, 32))
  state = jax.tree.map(lambda a: jnp.broadcast_to(a, (8, *a.shape)), tx.init(params[0]))
  x = jax.random.normal(jax.random.key(0), (8, 2, 64))  # Differs per device.
  assert any(i.sharded for i in wus.pmap(step, axis_name="batch").plan(params, state, x).inputs)
  differ = state.at[3, 0, 0].set(1.0) if hasattr(state, "at") else jax.tree.map(
      lambda a: a.at[3, 0, 0].set(1.0), state)
  plan = wus.pmap(step, axis_name="batch").plan(params, differ, x)
  momentum = [i for i in plan.inputs if i.shape == (1, 64, 32) and i.name.startswith("opt_state")]
  assert momentum and not any(i.sharded for i in momentum)
  differs = reasons.Differs(("batch",), causes.MAPPED_COPIES_DIFFER)
  assert all(i.why == Reason(differs) for i in momentum), [i.why for i in momentum]


def test_loop_plan_says_where_each_weight_is_gathered():
  """In a training loop the Plan names the placement of every weight's all-gather
  (Fig. 4): float32 weights read whole in float32 are gathered at the end of
  each iteration (left), since gathering before the forward pass moves as many bytes."""
  params, state, xs, _, step = loop_setup(_mesh(), optax.adam(1e-2), "fori")
  whys = [c.why for c in step.plan(params, state, xs).clusters if c.sharded]
  gathers = [g for why in whys for note in why.notes if isinstance(note, reasons.LoopGathers)
             for g in note.gathers]
  assert len(gathers) == len(whys) and not any(g.narrow for g in gathers), whys  # Fig. 4 left.
  (big,) = [g for g in gathers if g.name.endswith("['big']")]
  assert big == reasons.Gather(big.name, "float32", 4194304, 4194304, False)
