"""This machine's collective and memory costs, measured, as a `network.Topology`.

`wus-bench` feeds the result to the cost model (`wus.analysis.costmodel`, the
model `wus-scale` applies to the paper's TPU figures) to predict its own
step times, and prints the predictions beside what it measured (issue 13).

Two measurements, each on every device of the mesh at once (simulated CPU
devices share the host's cores, so a per-device figure is only meaningful
with all of them busy, as they are in a step):

* All-reduce: `lax.psum` of D bytes per device over the axis, at a small D
  (latency-bound) and a large one (bandwidth-bound). A ring all-reduce of n
  devices takes 2 (n - 1)(alpha + D / (n B)): the slope b of the line through
  the two points gives B = 2 (n - 1) / (n b). Its intercept also holds the
  cost of launching a program (about 0.8 ms here, 14 x a collective's own
  latency), which a collective inside a step does not pay; so alpha comes
  from one program of `CHAIN` dependent all-reduces of the small size against
  one of a single all-reduce: t = (t_chain - t_one) / (CHAIN - 1) is one
  collective inside a program, alpha = (t - 2 (n - 1) D / (n B)) / (2 (n - 1)).
* Memory bandwidth: an elementwise `x * c + y` on D bytes per device, which
  reads 2 D and writes D: 3 D / t bytes per second.

Times are medians of repeated calls (seconds, `time.perf_counter`), the
measurements interleaved call by call so that they share the machine's noise.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from wus.analysis import network

# Bytes per device of the calibration all-reduces (latency-bound, bandwidth-bound)
# and of the elementwise pass.
ALL_REDUCE_BYTES = (2 ** 12, 2 ** 22)
MEMORY_BYTES = 2 ** 24
# Dependent all-reduces in the program that measures a collective's latency inside a program.
CHAIN = 9


def median_seconds(calls: Sequence[Callable[[], object]], repeats: int) -> list[float]:
  """Median seconds of each call (blocked until ready) over `repeats` rounds, interleaved.

  One warm-up call each first (compilation)."""
  jax.block_until_ready([f() for f in calls])
  times = [[] for _ in calls]
  for _ in range(repeats):
    for f, t in zip(calls, times):
      start = time.perf_counter()
      jax.block_until_ready(f())
      t.append(time.perf_counter() - start)
  return [statistics.median(t) for t in times]


def fit_ring(nbytes: tuple[float, float], seconds: tuple[float, float],
             n: int) -> tuple[float, float]:
  """(alpha seconds, bandwidth bytes/s) of the ring all-reduce of n devices through two points.

  The line t = a + b D through (D0, t0) and (D1, t1); alpha = a / (2 (n - 1)),
  B = 2 (n - 1) / (n b). An intercept below 0 (noise) gives alpha 0.

  Raises:
    ValueError: n < 2, or the larger all-reduce was not slower.
  """
  (d0, d1), (t0, t1) = nbytes, seconds
  if n < 2 or d1 <= d0:
    raise ValueError(f"fit_ring needs n >= 2 and increasing sizes, got n={n}, sizes {nbytes}")
  if t1 <= t0:
    raise ValueError(f"the all-reduce of {d1} B ({t1:.3g} s) was not slower than the one of "
                     f"{d0} B ({t0:.3g} s): too noisy to fit; run again on a quieter machine")
  slope = (t1 - t0) / (d1 - d0)
  steps = 2 * (n - 1)
  return max(t0 - slope * d0, 0.0) / steps, steps / (n * slope)


def measure(mesh: Mesh, axis_name: str, *, repeats: int = 15,
            all_reduce_bytes: Sequence[int] = ALL_REDUCE_BYTES,
            memory_bytes: int = MEMORY_BYTES) -> tuple[network.Topology, dict]:
  """Measures the mesh axis's all-reduce and the devices' memory bandwidth.

  Args:
    mesh: the devices, all busy at once.
    axis_name: the axis the collectives run over (the whole mesh if 1-D).
    repeats: timed calls per measurement (median taken).
    all_reduce_bytes: float32 bytes per device of the two all-reduces fitted.
    memory_bytes: float32 bytes per device of the elementwise pass.

  Returns:
    (topology, raw): a one-axis `network.Topology` named "measured", and
    {"all_reduce": [(bytes, seconds), (bytes, seconds)], "chain": (CHAIN, seconds of
    the chained all-reduces), "memory": (bytes, seconds)}.

  Raises:
    ValueError: from `fit_ring`, when noise hid the all-reduce's growth.
  """
  n = mesh.shape[axis_name]
  spec = NamedSharding(mesh, P(axis_name))
  reduce = jax.jit(jax.shard_map(lambda x: lax.psum(x, axis_name), mesh=mesh,
                                 in_specs=P(axis_name), out_specs=P(axis_name)))
  chain = jax.jit(jax.shard_map(lambda x: _chained(x, axis_name), mesh=mesh,
                                in_specs=P(axis_name), out_specs=P(axis_name)))
  axpy = jax.jit(jax.shard_map(lambda x, y: x * 0.999 + y, mesh=mesh,
                               in_specs=(P(axis_name), P(axis_name)), out_specs=P(axis_name)))
  ones = lambda nbytes: jax.device_put(jnp.ones((n * nbytes // 4,), jnp.float32), spec)
  small, large, x, y = (ones(all_reduce_bytes[0]), ones(all_reduce_bytes[1]),
                        ones(memory_bytes), ones(memory_bytes))
  t_small, t_large, t_chain, memory_seconds = median_seconds(
      [lambda: reduce(small), lambda: reduce(large), lambda: chain(small),
       lambda: axpy(x, y)], repeats)
  _, bandwidth = fit_ring(tuple(all_reduce_bytes), (t_small, t_large), n)
  steps = 2 * (n - 1)
  inside = (t_chain - t_small) / (CHAIN - 1)
  alpha = max(inside - steps * all_reduce_bytes[0] / (n * bandwidth), 0.0) / steps
  topology = network.Topology((network.Axis("measured", n, alpha, bandwidth),),
                                memory_bandwidth=3 * memory_bytes / memory_seconds)
  return topology, {"all_reduce": list(zip(all_reduce_bytes, (t_small, t_large))),
                    "chain": (CHAIN, t_chain), "memory": (memory_bytes, memory_seconds)}


def _chained(x, axis_name):
  """`CHAIN` all-reduces, each reading the last one's result plus the replica index (so
  that no all-reduce sums equal values, which XLA would turn into a multiply)."""
  for _ in range(CHAIN):
    x = lax.psum(x, axis_name) + lax.axis_index(axis_name).astype(x.dtype)
  return x
