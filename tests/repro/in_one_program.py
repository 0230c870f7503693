"""On XLA:CPU a sharded step's parts in one program cost more than each run alone (issue 42).

The smallest program behind what a data-parallel step with its update sharded
costs beyond its parts timed alone (`wus-bench`'s limit, docs/measurements.md),
written by hand with nothing of wus. On 8 simulated CPU devices, an MLP (6
layers of 1024 x 1024, 24 MiB of weights), each device 4 examples:

  A   the forward and backward pass (each device's gradients);
  C   one flat reduce-scatter of every gradient byte and one flat all-gather of
      every weight byte, into buffers the previous call returned (donated);
  R   the reduce-scatter alone (into a donated buffer);
  AR  A and R in one program: the gradients laid end to end, reduce-scattered;
  B   Adam on one flat 1/8 shard of the weights, state and weights donated;
  ACB the three in one program: the forward and backward pass, the gradients
      laid end to end, the reduce-scatter, Adam on its shard, the all-gather
      into a donated buffer.

Each round, in a new random order, each program is timed warm, after an
untimed call of itself (as `wus-bench` times them). It prints the medians and
the medians over rounds of AR / (A + R) and ACB / (A + C + B): above 1 is what
running these parts in one program costs on these devices, for wus's step or
any other.

Beside each time, the process's minor page faults during the call: pages mapped
afresh (XLA:CPU allocates a program's temporaries each run).

  python tests/repro/in_one_program.py [ROUNDS]
"""

import os
import resource
import statistics
import sys
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

WIDTH, LAYERS, BATCH, N = 1024, 6, 4, 8


def programs(mesh, tx, k):
  """name -> (jitted program, the indices of its arguments it donates)."""

  def loss(params, x):
    for w, b in params:
      x = jnp.tanh(x @ w + b)
    return jnp.mean(x**2)

  def flat_gradients(params, x):
    grads = jax.grad(loss)(lax.pcast(params, "data", to="varying"), x)
    return jnp.concatenate([g.reshape(-1) for g in jax.tree.leaves(grads)])

  def update(w, g, state):
    updates, state = tx.update(g, state, w)
    return optax.apply_updates(w, updates), state

  def collectives(grads, shard, reduced, gathered):
    del reduced, gathered  # Their buffers only.
    return (lax.psum_scatter(grads, "data", tiled=True),
            lax.all_gather(shard, "data", tiled=True))

  def step(params, x, shard, state, gathered):
    del gathered
    shard, state = update(shard, lax.psum_scatter(flat_gradients(params, x), "data",
                                                  tiled=True), state)
    return shard, state, lax.all_gather(shard, "data", tiled=True)

  d, w = P("data"), P()
  specs = jax.tree.map(lambda s: d if s.ndim else w,
                       jax.eval_shape(tx.init, jax.ShapeDtypeStruct((k,), jnp.float32)))

  def compiled(f, in_specs, out_specs, donate):
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs),
                   donate_argnums=donate, keep_unused=True)

  def reduced(params, x, out):
    del out
    return lax.psum_scatter(flat_gradients(params, x), "data", tiled=True)

  return {"A": compiled(lambda p, x: flat_gradients(p, x)[None], (w, d), d, ()),
          "R": compiled(lambda g, out: lax.psum_scatter(g, "data", tiled=True), d, d, (1,)),
          "AR": compiled(reduced, (w, d, d), d, (2,)),
          "C": compiled(collectives, d, d, (2, 3)),
          "B": compiled(update, (d, d, specs), (d, specs), (0, 2)),
          "ACB": compiled(step, (w, d, d, specs, d), (d, specs, d), (2, 3, 4))}, specs


def main(rounds: int) -> None:
  mesh = jax.make_mesh((N,), ("data",))
  split, whole = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
  keys = jax.random.split(jax.random.key(0), LAYERS)
  params = jax.device_put([(jax.random.normal(key, (WIDTH, WIDTH)) / WIDTH**0.5,
                            jnp.zeros((WIDTH,))) for key in keys], whole)
  x = jax.device_put(jax.random.normal(jax.random.key(1), (N * BATCH, WIDTH)), split)
  k = LAYERS * (WIDTH * WIDTH + WIDTH) // N
  tx = optax.adam(1e-3)
  run, specs = programs(mesh, tx, k)
  flat = lambda size, value: jax.device_put(jnp.full((size,), value), split)  # noqa: E731
  init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P("data"), out_specs=specs))
  held = {"shard": flat(N * k, 1.0), "grads": flat(N * N * k, 1e-3),
          "grad_shard": flat(N * k, 1e-3), "reduced": flat(N * k, 0.0),
          "gathered": flat(N * N * k, 0.0)}
  held["state"] = init(held["shard"])

  def call(name):
    h = held
    if name == "A":
      jax.block_until_ready(run["A"](params, x))
    elif name == "R":
      h["reduced"] = jax.block_until_ready(run["R"](h["grads"], h["reduced"]))
    elif name == "AR":
      h["reduced"] = jax.block_until_ready(run["AR"](params, x, h["reduced"]))
    elif name == "C":
      h["reduced"], h["gathered"] = jax.block_until_ready(
          run["C"](h["grads"], h["shard"], h["reduced"], h["gathered"]))
    elif name == "B":
      h["shard"], h["state"] = jax.block_until_ready(
          run["B"](h["shard"], h["grad_shard"], h["state"]))
    else:
      h["shard"], h["state"], h["gathered"] = jax.block_until_ready(
          run["ACB"](params, x, h["shard"], h["state"], h["gathered"]))

  seconds, faults = {name: [] for name in run}, {name: [] for name in run}
  order = np.random.default_rng(0)
  for name in run:
    call(name)  # Compile.
  for _ in range(rounds):
    for name in map(str, order.permutation(list(run))):
      call(name)  # Untimed: warm, after itself.
      before, start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
      call(name)
      seconds[name].append(time.perf_counter() - start)
      faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
  for name, times in seconds.items():
    print(f"{name}: {1e3 * statistics.median(times):.2f} ms, "
          f"{statistics.median(faults[name]):.0f} minor page faults (medians of {rounds})")
  t = seconds
  for label, num, den in (("AR / (A + R)", t["AR"], [t["A"], t["R"]]),
                          ("ACB / (A + C + B)", t["ACB"], [t["A"], t["C"], t["B"]])):
    ratios = [x / sum(parts) for x, *parts in zip(num, *den, strict=True)]
    print(f"{label}: {statistics.median(ratios):.3f} "
          f"(median of per-round ratios; min {min(ratios):.3f}, max {max(ratios):.3f})")


if __name__ == "__main__":
  main(int(sys.argv[1]) if len(sys.argv) > 1 else 30)
