"""XLA:CPU ends the process when one device reaches a collective late (issue 41).

An all-reduce over 8 CPU devices that device 0 reaches DELAY seconds after the
other seven: a host callback sleeps, as a device's thread kept off the cores by
load would be late. XLA:CPU's in-process collectives wait at a rendezvous for
`--xla_cpu_collective_call_warn_stuck_timeout_seconds` (20 s by default), log
that the thread "may be stuck", wait
`--xla_cpu_collective_call_terminate_timeout_seconds` more (40 s) and then end
the process from the waiting device's thread (LOG(FATAL), abort()):

  F... rendezvous.cc:161] [id=0] Termination timeout for `all reduce
  RendezvousKey{...}` of 40 seconds exceeded. Exiting to ensure a consistent
  program state. Expected 8 threads to join the rendezvous, but only 7 of them
  arrived on time.
  Fatal Python error: Aborted

Python's stack is printed where the main thread happens to be (here
block_until_ready; in a test, often a later eager op), not where the collective
is. The program is valid: with a longer timeout it prints the sum, 28.0.

  python tests/repro/late_device.py 65     # aborts after 60 s
  XLA_FLAGS=--xla_cpu_collective_call_terminate_timeout_seconds=600 \\
    python tests/repro/late_device.py 65   # 28.0
"""

import os
import sys
import time

os.environ["XLA_FLAGS"] = ("--xla_force_host_platform_device_count=8 "
                           + os.environ.get("XLA_FLAGS", ""))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402


def main(delay: float) -> None:
  mesh = jax.make_mesh((8,), ("d",))

  def late(i):
    if i == 0:
      time.sleep(delay)
    return np.float32(0)

  @jax.jit
  @jax.shard_map(mesh=mesh, in_specs=P("d"), out_specs=P())
  def total(x):
    wait = jax.pure_callback(late, jax.ShapeDtypeStruct((), jnp.float32), jax.lax.axis_index("d"))
    return jax.lax.psum(x.sum() + wait, "d")

  x = jax.device_put(np.arange(8, dtype=np.float32), NamedSharding(mesh, P("d")))
  print(float(total(x).block_until_ready()), flush=True)


if __name__ == "__main__":
  main(float(sys.argv[1]))
