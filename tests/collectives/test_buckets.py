"""The bucket size of the batched collectives (§5.2) is the cost model's choice:
the Plan records and prints it, and the compiled step holds as many
reduce-scatters and all-gathers as it predicts. Batching copies each tensor
into and out of its bucket: where that costs more than a collective's
latency, large tensors keep collectives of their own and are not copied."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import wus
from helpers import (assert_trees_equal, classifier_batches, collectives, fused_kernels, mesh,
                     moved_bytes, run_both)
from wus.analysis import network, sizing

N = 8
TX = optax.adam(1e-2)
WIDTH = 256  # Six [256, 256] weights and biases: 1.6 MB of gradients.


def step(params, opt_state, x):
  def loss(p):
    h = x
    for k in sorted(p):
      h = jnp.tanh(h @ p[k]["w"] + p[k]["b"])
    return jnp.mean(h ** 2)

  grads = lax.pmean(jax.grad(loss)(params), "data")
  updates, opt_state = TX.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state


def _inputs():
  keys = jax.random.split(jax.random.key(0), 6)
  params = {f"layer{i}": {"w": jax.random.normal(k, (WIDTH, WIDTH)) / WIDTH ** 0.5,
                          "b": jnp.zeros(WIDTH)} for i, k in enumerate(keys)}
  xs = [jax.device_put(jax.random.normal(jax.random.key(10 + i), (2 * N, WIDTH)),
                       NamedSharding(mesh(N), P("data"))) for i in range(3)]
  return params, TX.init(params), xs


def _topology(alpha, memory_bandwidth=1e10):
  return network.Topology((network.Axis("data", N, alpha=alpha, bandwidth=1e9),),
                            memory_bandwidth=memory_bandwidth)


# Collectives behind a 50 us rendezvous, memory at 1 GB/s per device (CPU
# devices): copying a 256 KiB weight into and out of a bucket (1 MiB of
# memory traffic, about 1 ms) costs more than its own reduce-scatter and
# all-gather (0.7 ms of latency).
CPU = _topology(5e-5, memory_bandwidth=1e9)


def _wus(alpha):
  return wus.shard_map(step, mesh=mesh(N), in_specs=(P(), P(), P("data")),
                       out_specs=(P(), P()), topology=_topology(alpha))


def _predicted(plan) -> list[int]:
  """The reduce-scatters and all-gathers the Plan's bucket line predicts."""
  m = re.search(r"(\d+) reduce-scatter\(s\), (\d+) all-gather\(s\)", plan.buckets)
  return [int(m.group(1)), int(m.group(2))]


@pytest.mark.parametrize("alpha, buckets", [(1e-4, 1), (1e-9, None)])
def test_compiled_step_has_the_buckets_the_plan_predicts(alpha, buckets):
  """Latency-bound (alpha 100 us): one bucket is the choice. Bandwidth-bound
  (alpha 1 ns): the smallest bucket within 1% of one bucket's time, so many
  collectives; each is counted in the compiled HLO."""
  params, opt_state, xs = _inputs()
  wrapped = _wus(alpha)
  plan = wrapped.plan(params, opt_state, xs[0])
  assert plan.bucket_bytes in sizing.BUCKET_CANDIDATES
  hlo = wrapped.lower(params, opt_state, xs[0]).compile().as_text()
  counts = collectives(hlo)
  predicted = _predicted(plan)
  assert [counts["reduce-scatter"].count, counts["all-gather"].count] == predicted
  if buckets is not None:
    assert predicted == [buckets, buckets]
  else:
    assert predicted[0] > 1 and plan.bucket_bytes < 2 ** 20


def test_bucket_size_leaves_the_result_bit_for_bit():
  """However the tensors are bucketed, every element sums the same values in
  the same order: the step equals the unmodified one bit for bit."""
  params, opt_state, xs = _inputs()
  for alpha in (1e-4, 1e-9):
    want, got, _ = run_both(step, (params, opt_state), xs,
                            wus_kw=dict(topology=_topology(alpha)), mesh=mesh(N),
                            in_specs=(P(), P(), P("data")), out_specs=(P(), P()))
    assert_trees_equal(wus.unshard(got), want)


@pytest.mark.parametrize("objective", ["memory", "time"])
def test_memory_objective_keeps_buckets_at_most_4_mib(objective):
  """25 MB of gradients on a latency-bound topology with fast memory (copies
  cost little): "time" takes the one bucket the model prices fastest;
  "memory" (the default) no more than 4 MiB, as a bucket's concatenated
  buffers are temporary memory."""
  params = {f"layer{i}": {"w": jnp.zeros((1024, 1024)), "b": jnp.zeros(1024)} for i in range(6)}
  x = jax.device_put(jnp.zeros((2 * N, 1024)), NamedSharding(mesh(N), P("data")))
  wrapped = wus.shard_map(step, mesh=mesh(N), in_specs=(P(), P(), P("data")),
                          out_specs=(P(), P()), topology=_topology(1e-4, 1e12),
                          objective=objective)
  plan = wrapped.plan(params, TX.init(params), x)
  assert all(c.sharded for c in plan.clusters)
  if objective == "memory":
    # Each 4 MiB weight is a bucket of its own and closes the reduce-scatters' one
    # before it: b0 | w0 | b1 | w1 ... (the keys' order), 12; the all-gathers' bucket
    # of the biases spans the weights: 7.
    assert plan.bucket_bytes == 4 * 2 ** 20 and _predicted(plan) == [12, 7]
  else:
    assert plan.bucket_bytes >= 25 * 10 ** 6 and _predicted(plan) == [1, 1]
  assert plan.alone_bytes is None  # Every copy is cheaper than a collective's latency.


def test_large_tensors_keep_their_own_collectives_and_are_not_copied():
  """On CPU-like devices the six 256 KiB weights each have a reduce-scatter
  and an all-gather of their own, with no concatenate or slice of their
  bytes; each closes the reduce-scatters' bucket before it, so each 1 KiB bias
  is alone there too (b0 | w0 | b1 | w1 ..., the keys' order), not held in one
  bucket until the first layer's gradient, the last of the backward pass; the
  biases share one all-gather (the update has run for all). With memory 10x
  faster, all twelve share buckets, and the compiled step copies every
  weight into and out of them. Bit for bit either way."""
  params, opt_state, xs = _inputs()
  weights, biases = 6 * WIDTH * WIDTH * 4, 6 * WIDTH * 4
  specs = dict(mesh=mesh(N), in_specs=(P(), P(), P("data")), out_specs=(P(), P()))
  moved = {}
  for name, topology in [("cpu", CPU), ("fast memory", _topology(5e-5))]:
    wrapped = wus.shard_map(step, topology=topology, **specs)
    plan = wrapped.plan(params, opt_state, xs[0])
    hlo = wrapped.lower(params, opt_state, xs[0]).compile().as_text()
    counts = collectives(hlo)
    assert [counts["reduce-scatter"].count, counts["all-gather"].count] == _predicted(plan)
    moved[name] = {k: moved_bytes(hlo, k) for k in ("concatenate", "slice")}
    want, got, _ = run_both(step, (params, opt_state), xs, wus_kw=dict(topology=topology),
                            **specs)
    assert_trees_equal(wus.unshard(got), want)
    if name == "cpu":
      assert plan.alone_bytes is not None and plan.alone_bytes <= WIDTH * WIDTH * 4
      alone = [t for c in plan.clusters if c.sharded for t in c.tensors
               if t.role == "gradient" and t.nbytes >= plan.alone_bytes]
      assert len(alone) == 6 and _predicted(plan) == [12, 7]
    else:
      assert plan.alone_bytes is None and _predicted(plan) == [1, 1]
  cpu, fast = moved["cpu"], moved["fast memory"]
  assert cpu["concatenate"] + cpu["slice"] <= 3 * biases
  assert fast["concatenate"] >= weights and fast["slice"] >= weights


def _norm_step(params, opt_state, x):
  """A LayerNorm-like scale per layer: equal small tensors that share a bucket."""
  def loss(p):
    h = x
    for k in sorted(p):
      h = jnp.tanh(h * p[k])
    return jnp.mean(h ** 2)

  grads = lax.pmean(jax.grad(loss)(params), "data")
  updates, opt_state = TX.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state


@pytest.mark.parametrize("layers", [4, 16])
def test_updates_of_equal_tensors_in_a_bucket_share_their_kernels(layers):
  """Each tensor of a bucket is cut out of the reduce-scattered (and the
  all-gathered) buffer at its own offset. Read as a constant, the offset made
  every tensor's update a distinct fused computation, so a kernel of its own
  that XLA:CPU compiles (1.9x the replicated step's compile time on a
  100-tensor Transformer, issue 22). The compiled step of 16 equal tensors in
  one bucket has as many distinct fused computations as that of 4 (with
  constant offsets, about 3 more per tensor), and is bit for bit the
  unmodified step."""
  params = {f"layer{i:02d}": 1.0 + 0.1 * jax.random.normal(jax.random.key(i), (40,))
            for i in range(layers)}
  opt_state = TX.init(params)
  m = mesh(N)
  xs = [jax.device_put(jax.random.normal(jax.random.key(100 + i), (2 * N, 40)),
                       NamedSharding(m, P("data"))) for i in range(2)]
  specs = dict(mesh=m, in_specs=(P(), P(), P("data")), out_specs=(P(), P()))
  wrapped = wus.shard_map(_norm_step, **specs)
  plan = wrapped.plan(params, opt_state, xs[0])
  assert _predicted(plan) == [1, 1], plan.buckets  # One bucket each way.
  hlo = wrapped.lower(params, opt_state, xs[0]).compile().as_text()
  kernels = fused_kernels(hlo)
  replicated = jax.jit(jax.shard_map(_norm_step, **specs)).lower(params, opt_state, xs[0])
  assert kernels <= fused_kernels(replicated.compile().as_text()) + 12, kernels
  want, got, _ = run_both(_norm_step, (params, opt_state), xs, **specs)
  assert_trees_equal(wus.unshard(got), want)


class _MLP(nn.Module):
  """The harness's mlp_deep (core tests do not import the harness), 256 wide."""

  @nn.compact
  def __call__(self, x):
    for _ in range(5):
      x = nn.relu(nn.Dense(256)(x))
    return nn.Dense(10)(x)


def test_reduce_scatters_close_buckets_at_tensors_alone_and_all_gathers_span_them():
  """A global-view step (a Flax classifier's step under wus.jit) reduce-scatters its
  gradients in the backward pass's order, Dense_5 first, and all-gathers the new
  weights in the outputs' order, Dense_0 first. On CPU-like devices the five
  256-wide kernels have collectives of their own. A reduce-scatter's bucket closes
  at each (b5 k5 b4 | k4 | b3 | k3 | b2 | k2 | b1 | k1 | b0 | k0: 10), so none
  waits for the backward pass of a kernel; an all-gather's bucket spans them (the
  seven small tensors in one: 6). The Plan predicts both from their own orders
  (priced as a mirror of the reduce-scatters, the all-gathers were 10 in the Plan
  and 11 in the compiled step when they closed too), and the step is bit for bit
  jax.jit's."""
  m = mesh(N)  # `jax.make_mesh`'s axis types.
  model, tx = _MLP(), optax.adam(1e-3)
  batches = classifier_batches(m, 2, batch=32, features=300)
  params = jax.device_put(model.init(jax.random.key(0), jnp.ones((1, 300))),
                          NamedSharding(m, P()))
  opt_state = jax.device_put(tx.init(params), NamedSharding(m, P()))

  def train_step(params, opt_state, batch):
    def loss_fn(params):  # Flax's MNIST example's loss (examples/mnist/train.py).
      logits = model.apply(params, batch["x"])
      one_hot = jax.nn.one_hot(batch["y"], 10)
      loss = jnp.mean(optax.softmax_cross_entropy(logits=logits, labels=one_hot))
      return loss, logits
    (loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  wrapped = wus.jit(train_step, topology=CPU)
  plan = wrapped.plan(params, opt_state, batches[0])
  counts = collectives(wrapped.lower(params, opt_state, batches[0]).compile().as_text())
  assert [counts["reduce-scatter"].count, counts["all-gather"].count] == _predicted(plan)
  assert _predicted(plan) == [10, 6]
  want, got = (params, opt_state), (params, opt_state)
  for batch in batches:
    want = jax.jit(train_step)(*want[:2], batch)
    got = wrapped(*got[:2], batch)
  assert_trees_equal(wus.unshard(got[:2]), want[:2])
