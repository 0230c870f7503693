"""A Plan people can scan (issue 23 item 7): paths under the step's argument names, each
gradient all-reduce at the user's own line (not inside Flax), one line per cluster with
the totals first (the table behind `plan.details()`), times in units, none below what the
cost model resolves."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import wus
from helpers import mesh
from wus.analysis import network

TX = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(64)(x))  # The gradient all-reduces of Dense_0 are located here,
    return nn.Dense(10)(x)        # and those of Dense_1 here: AD makes them inside Flax.


MODEL = MLP()
LINES = {name: next(i for i, line in enumerate(open(__file__), 1) if f"nn.Dense({width})" in line)
         for name, width in (("Dense_0", 64), ("Dense_1", 10))}


def train_step(params, opt_state, batch):
  """As the shard_map examples write it under check_vma=True: the pmean of the loss."""
  def loss_fn(p):
    return jax.lax.pmean(jnp.mean((MODEL.apply({"params": p}, batch) - 1.0) ** 2), "data")
  loss, grads = jax.value_and_grad(loss_fn)(params)
  updates, opt_state = TX.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss


def plan_of(**kw):
  m = mesh()
  params = MODEL.init(jax.random.key(0), jnp.zeros((1, 32)))["params"]
  batch = jax.device_put(np.random.default_rng(0).normal(size=(16, 32)).astype(np.float32),
                         NamedSharding(m, P("data")))
  step = wus.shard_map(train_step, mesh=m, in_specs=(P(), P(), P("data")),
                       out_specs=(P(), P(), P()), **kw)
  return step.plan(params, TX.init(params), batch)


@pytest.fixture(scope="module")
def plan():
  return plan_of()


def test_paths_are_under_the_arguments_names(plan):
  names = {i.name for i in plan.inputs}
  assert {"params['Dense_0']['kernel']", "opt_state[1][0].mu['Dense_0']['kernel']",
          "opt_state[1][0].nu['Dense_1']['bias']", "opt_state[1][0].count", "batch"} <= names
  sharded = {i.name for i in plan.inputs if i.sharded}
  assert "opt_state[1][0].mu['Dense_0']['kernel']" in sharded


def test_each_gradient_all_reduce_is_at_the_users_line(plan):
  grads = [t for c in plan.clusters for t in c.tensors if t.role == "gradient"]
  assert grads
  for t in grads:
    layer = "Dense_0" if any("Dense_0" in u.name for c in plan.clusters if t in c.tensors
                             for u in c.tensors) else "Dense_1"
    assert re.fullmatch(rf"all-reduce at {re.escape(__file__)}:{LINES[layer]}:\d+ "
                        r"\(MLP.__call__\)", t.name), t.name


def test_compact_by_default_with_the_details_behind_a_call(plan):
  text = str(plan).splitlines()
  assert text[0].startswith(f"wus plan: {len(plan.clusters)} of {len(plan.clusters)} "
                            "weight-update clusters sharded over ('data',) (N=8)")
  assert "state kept sharded between steps" in text[1]
  cluster_lines = [line for line in text if line.startswith("cluster ")]
  assert len(cluster_lines) == len(plan.clusters)
  assert len(text) <= len(plan.clusters) + 6
  assert text[-1].startswith("inputs: ") and "plan.details()" in text[-1]
  details = plan.details()
  for c in plan.clusters:
    for t in c.tensors:
      assert t.name in details
  for i in plan.inputs:
    assert f"{i.name} " in details


def _times(text: str) -> list[float]:
  """Every time printed, in seconds; fails on a time without a unit."""
  scale = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}
  found = re.findall(r"([\d.e+-]+) (ns|us|ms|s)\b", text)
  assert not re.search(r"\b0\.0\d* (us|ms|s)\b", text), text
  return [float(v) * scale[u] for v, u in found]


def test_no_prediction_below_the_models_resolution(plan):
  # Planned with the defaults for the CPU devices the suite runs on.
  assert plan.resolution == network.resolution(network.default_topology(8, platform="cpu")) > 0
  lines = [line for line in str(plan).splitlines() if line.startswith("cluster ")]
  below = f"< {network.format_seconds(plan.resolution)}"
  for line in lines:
    for seconds in _times(line.replace(below, "")):
      assert seconds >= plan.resolution, line
  # A cluster whose sharded update the model puts below one ring step says so.
  assert any(f"predicted {below} sharded" in line for line in lines), lines
  # A topology without latency resolves every cluster: each line gives its prediction.
  fine = plan_of(topology=network.Topology((network.Axis("x", 8, 0.0, 1e10),), 1e10))
  lines = [line for line in str(fine).splitlines() if line.startswith("cluster ")]
  assert all("predicted" in line for line in lines)
  for line in lines:
    assert all(t > 0 for t in _times(line)), line
  assert network.format_seconds(1.43e-9) == "1.43 ns"
  assert network.format_seconds(7.13e-5) == "71.3 us"
  assert network.format_seconds(0.0117) == "11.7 ms"


def test_source_lines_skip_flax_optax_and_jax():
  """What a Plan names an equation by: the innermost frame of the user's code. A Dense
  layer's matmul is traced inside flax/linen/linear.py (which JAX counts as user code); the
  Plan names the model's line that calls the layer instead."""
  from wus.analysis import compat  # noqa: PLC0415
  params = MODEL.init(jax.random.key(0), jnp.zeros((1, 32)))["params"]
  jaxpr = jax.make_jaxpr(lambda p, x: MODEL.apply({"params": p}, x))(params, jnp.zeros((2, 32)))
  dots = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]
  assert len(dots) == 2
  for eqn, layer in zip(dots, ("Dense_0", "Dense_1"), strict=True):
    assert compat.source_line(eqn).startswith(f"{__file__}:{LINES[layer]}:"), \
        compat.source_line(eqn)
