"""The bucket size of the batched collectives (§5.2) is the cost model's choice:
the Plan records and prints it, and the compiled step holds as many
reduce-scatters and all-gathers as it predicts."""

import jax
import jax.numpy as jnp
import optax
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import wus
from helpers import assert_trees_equal, mesh, run_both
from wus.analysis import costmodel
from wus.harness import report

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


def _topology(alpha):
  return costmodel.Topology((costmodel.Axis("data", N, alpha=alpha, bandwidth=1e9),),
                            memory_bandwidth=1e10)


def _wus(alpha):
  return wus.shard_map(step, mesh=mesh(N), in_specs=(P(), P(), P("data")),
                       out_specs=(P(), P()), topology=_topology(alpha))


@pytest.mark.parametrize("alpha, buckets", [(1e-4, 1), (1e-9, None)])
def test_compiled_step_has_the_buckets_the_plan_predicts(alpha, buckets):
  """Latency-bound (alpha 100 us): one bucket is the choice. Bandwidth-bound
  (alpha 1 ns): the smallest bucket within 1% of one bucket's time, so many
  collectives; each is counted in the compiled HLO."""
  params, opt_state, xs = _inputs()
  wrapped = _wus(alpha)
  plan = wrapped.plan(params, opt_state, xs[0])
  assert plan.bucket_bytes in costmodel.BUCKET_CANDIDATES
  assert "collectives batched in buckets of at most" in str(plan)
  hlo = wrapped.lower(params, opt_state, xs[0]).compile().as_text()
  counts = report.collectives(hlo)
  predicted = [int(w) for w in plan.buckets.split(": ")[1].split()[::2][:2]]
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
  """25 MB of gradients on a latency-bound topology: "time" takes the one
  bucket the model prices fastest; "memory" (the default) no more than 4 MiB,
  as a bucket's concatenated buffers are temporary memory."""
  params = {f"layer{i}": {"w": jnp.zeros((1024, 1024)), "b": jnp.zeros(1024)} for i in range(6)}
  x = jax.device_put(jnp.zeros((2 * N, 1024)), NamedSharding(mesh(N), P("data")))
  wrapped = wus.shard_map(step, mesh=mesh(N), in_specs=(P(), P(), P("data")),
                          out_specs=(P(), P()), topology=_topology(1e-4), objective=objective)
  plan = wrapped.plan(params, TX.init(params), x)
  assert all(c.sharded for c in plan.clusters)
  if objective == "memory":
    assert plan.bucket_bytes == 4 * 2 ** 20 and "4 MiB: 7 reduce-scatter(s)" in plan.buckets
  else:
    assert plan.bucket_bytes >= 25 * 10 ** 6 and "1 reduce-scatter(s)" in plan.buckets
