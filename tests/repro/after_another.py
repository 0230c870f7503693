"""On XLA:CPU two programs run back to back cost more than each run after itself (issue 42).

The smallest program behind the part of a sharded step's time that none of its
parts timed alone accounts for (`wus-bench`'s limit, docs/measurements.md). Two
programs on 8 simulated CPU devices, each its own `jax.jit`, written as the
limit's parts are (`wus.harness.tools.bench.limit`):

  A  the forward and backward pass of an MLP (6 layers of 1024 x 1024, 24 MiB of
     weights) on each device's 4 examples;
  B  Adam on one flat 1/8 shard of those weights, state and weights donated.

Each round, in a new random order: A after A, B after B (each timed warm, after an
untimed call of itself, as the limit times its parts), and A then B (A to
completion, then B, as a step's parts follow each other). It prints the medians
and the median over rounds of (A then B) / (A alone + B alone). Nothing of wus
runs here: a ratio above 1 is what any program whose parts follow each other pays
on these devices, wus's step or a hand-written one.

  python tests/repro/after_another.py [ROUNDS]
"""

import os
import statistics
import sys
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

WIDTH, LAYERS, BATCH = 1024, 6, 4


def main(rounds: int) -> None:
  mesh = jax.make_mesh((8,), ("data",))
  split, whole = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
  keys = jax.random.split(jax.random.key(0), LAYERS)
  params = jax.device_put([(jax.random.normal(k, (WIDTH, WIDTH)) / WIDTH**0.5,
                            jnp.zeros((WIDTH,))) for k in keys], whole)
  x = jax.device_put(jax.random.normal(jax.random.key(1), (8 * BATCH, WIDTH)), split)

  def loss(params, x):
    for w, b in params:
      x = jnp.tanh(x @ w + b)
    return jnp.mean(x**2)

  def gradients(params, x):
    return jax.tree.map(lambda g: g[None], jax.grad(loss)(params, x))

  a = jax.jit(jax.shard_map(gradients, mesh=mesh, in_specs=(P(), P("data")),
                            out_specs=P("data")))
  tx = optax.adam(1e-3)
  k = sum(w.size + b.size for w, b in params) // 8

  def update(w, g, state):
    updates, state = tx.update(g, state, w)
    return optax.apply_updates(w, updates), state

  shards = jax.device_put(jnp.ones((8 * k,)), split)
  grads = jax.device_put(jnp.full((8 * k,), 1e-3), split)
  specs = jax.tree.map(lambda s: P("data") if s.ndim else P(), jax.eval_shape(tx.init, shards))
  state = jax.jit(tx.init, out_shardings=jax.tree.map(lambda s: NamedSharding(mesh, s),
                                                      specs))(shards)
  b = jax.jit(jax.shard_map(update, mesh=mesh, in_specs=(P("data"), P("data"), specs),
                            out_specs=(P("data"), specs)), donate_argnums=(0, 2))
  held = [shards, state]

  def run_a():
    jax.block_until_ready(a(params, x))

  def run_b():
    held[:] = jax.block_until_ready(b(held[0], grads, held[1]))

  def run_ab():
    run_a()
    run_b()

  calls = {"A": run_a, "B": run_b, "A then B": run_ab}
  seconds = {name: [] for name in calls}
  order = np.random.default_rng(0)
  for name in calls:
    calls[name]()  # Compile.
  for _ in range(rounds):
    for name in order.permutation(list(calls)):
      calls[name]()  # Untimed: warm, after itself.
      start = time.perf_counter()
      calls[name]()
      seconds[name].append(time.perf_counter() - start)
  for name, times in seconds.items():
    print(f"{name}: {1e3 * statistics.median(times):.2f} ms (median of {rounds})")
  ratios = [ab / (ta + tb) for ta, tb, ab in zip(*seconds.values(), strict=True)]
  print(f"(A then B) / (A alone + B alone): {statistics.median(ratios):.3f} "
        f"(median of per-round ratios; min {min(ratios):.3f}, max {max(ratios):.3f})")


if __name__ == "__main__":
  main(int(sys.argv[1]) if len(sys.argv) > 1 else 30)
