"""What the compiled wus step does: collectives from its HLO, memory from memory_analysis (§4.2)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

import wus
from helpers import SPECS, assert_trees_equal, batches, make_params, make_step, run
from wus.harness import report

N = 8


def _compiled(tx, check_vma=True):
  mesh = jax.make_mesh((N,), ("data",))
  params = make_params()
  state = tx.init(params)
  extra = {"counter": jnp.arange(16, dtype=jnp.int32)}
  (batch,) = batches(mesh, 1)
  step = make_step(tx)
  ref = jax.jit(jax.shard_map(step, mesh=mesh, check_vma=check_vma, **SPECS))
  ws = wus.shard_map(step, mesh=mesh, check_vma=check_vma, **SPECS)
  args = (params, state, extra, batch)
  return ref.lower(*args).compile(), ws.lower(*args).compile(), ws.plan(*args), state


def _collective_shapes(hlo: str, kind: str) -> list[int]:
  """Result bytes of every `kind` instruction in optimized HLO text."""
  out = []
  for line in hlo.splitlines():
    m = re.match(r"\s*(?:ROOT )?%\S+ = (\(.*?\)|\S+) " + kind + r"(?:-start)?\(", line)
    if m:
      out.append(report.shape_bytes(m.group(1)))
  return out


def test_gradients_reduce_scattered_and_weights_all_gathered():
  ref, ws, plan, _ = _compiled(optax.adam(1e-2))
  sharded = [c for c in plan.clusters if c.sharded]
  assert len(sharded) == 4  # big, conv, bias, half; scalar and [7] stay whole.
  assert {t.name for c in sharded for t in c.tensors if t.role == "state"} == {
      f"[1][0].{m}['{k}']" for m in ("mu", "nu") for k in ("big", "conv", "bias", "half")}
  text = ws.as_text()
  assert len(_collective_shapes(text, "reduce-scatter")) >= len(sharded)
  assert len(_collective_shapes(text, "all-gather")) >= len(sharded)
  # The 4 MiB gradient of `big` is reduce-scattered (each device gets 512 KiB)
  # and no longer all-reduced; what is still all-reduced is small (the loss,
  # tensors kept whole, the [16,16] cotangent of `big[:16, :16]`, whose pad
  # has no shard rule).
  big = 1024 * 1024 * 4
  assert sum(_collective_shapes(text, "all-reduce")) < big // N
  assert sum(_collective_shapes(text, "reduce-scatter")) >= big // N
  assert max(_collective_shapes(ref.as_text(), "all-reduce")) >= big
  assert any("pad" in c.reason and not c.sharded for c in plan.clusters)


def test_argument_bytes_drop_by_optimizer_state_shards():
  """Per-device argument bytes go from W + V to W + V/N (§4.2)."""
  ref, ws, plan, state = _compiled(optax.adam(1e-2))
  big = [x for x in jax.tree.leaves(state) if x.size >= N]
  v = sum(x.nbytes for x in big)  # Optimizer state wus shards (mu and nu of each big leaf).
  drop = ref.memory_analysis().argument_size_in_bytes - ws.memory_analysis().argument_size_in_bytes
  assert abs(drop - v * (1 - 1 / N)) <= 0.01 * v, (drop, v)
  whole, shard = plan.state_bytes
  assert whole == v and shard * N >= v


def test_step_without_gradient_all_reduce_is_unchanged():
  """Nothing to shard: same collectives, empty Plan, same result."""
  mesh = jax.make_mesh((N,), ("data",))
  def evaluate(params, x):
    return jax.lax.pmean(jnp.sum(jnp.tanh(x @ params["w"])), "data")
  params = {"w": jnp.ones((16, 16))}
  (x,) = batches(mesh, 1)
  specs = dict(mesh=mesh, in_specs=(P(), P("data")), out_specs=P())
  ref = jax.jit(jax.shard_map(evaluate, **specs))
  ws = wus.shard_map(evaluate, **specs)
  assert ws.plan(params, x).clusters == ()
  assert report.collectives(ws.lower(params, x).compile().as_text()) == \
      report.collectives(ref.lower(params, x).compile().as_text())
  np.testing.assert_array_equal(ref(params, x), ws(params, x))


def test_global_norm_clip_adds_one_small_all_reduce_not_one_per_tensor():
  clip = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))
  _, plain, _, _ = _compiled(optax.adam(1e-2))
  _, clipped, plan, _ = _compiled(clip)
  added = (len(_collective_shapes(clipped.as_text(), "all-reduce"))
           - len(_collective_shapes(plain.as_text(), "all-reduce")))
  assert added <= 1
  sharded = sum(c.sharded for c in plan.clusters)
  assert sharded == 4
  # One partial sum per sharded tensor, all in one all-reduce (maybe combined
  # by XLA with others): at most a few floats more than without clipping.
  extra = sum(_collective_shapes(clipped.as_text(), "all-reduce")) - \
      sum(_collective_shapes(plain.as_text(), "all-reduce"))
  assert 0 < extra <= 4 * (sharded + 1)


def test_donated_state_is_updated_in_place():
  """With donate_argnums, the step reuses the weight and sharded state buffers
  (memory_analysis alias bytes), and computes what it computes without."""
  mesh = jax.make_mesh((N,), ("data",))
  tx = optax.adam(1e-2)
  params = make_params()
  data = batches(mesh, 3)
  extra = {"counter": jnp.arange(16, dtype=jnp.int32)}
  plain = wus.shard_map(make_step(tx), mesh=mesh, **SPECS)
  donating = wus.shard_map(make_step(tx), mesh=mesh, donate_argnums=(0, 1), **SPECS)
  expected = run(plain, params, tx.init(params), extra, data)
  fresh = make_params()
  state = tx.init(fresh)
  compiled = donating.lower(fresh, state, extra, data[0]).compile()
  got = run(donating, fresh, state, extra, data)
  assert_trees_equal(wus.unshard(got), wus.unshard(expected))
  assert fresh["big"].is_deleted()  # donated on the first call, as jax.jit would
  per_device = sum(x.nbytes for x in jax.tree.leaves(params)) + sum(
      x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(got[1]))
  assert compiled.memory_analysis().alias_size_in_bytes == per_device
