"""Collectives of tensors sharded over the replica axes and over axes they are identical
across (`copies`: a tensor-parallel step's "model" for a weight no spec splits).

The reduce-scatter sums over the replica axes only and each replica of `copies` keeps
its part of the block it receives; the result must be the shard a local slice of the
all-reduced tensor gives over both (`formatted.shard`), and the all-gather over both
axes the all-reduced tensor itself. Integer-valued floats: every summation order is exact.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from wus.analysis.formats import ShardFormat
from wus.collectives import batched, formatted

SHAPES = [(13,), (16,), (5, 3)]  # Padded over 6 and 8 replicas, or not.


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "novma"])
@pytest.mark.parametrize("n_data", [4, 3])
def test_reduce_scatter_keeps_this_copys_part_and_all_gather_restores(n_data, check_vma):
  mesh = jax.make_mesh((n_data, 2), ("data", "model"), devices=jax.devices()[:2 * n_data])
  fmts = [ShardFormat((5, 3), (5, 3), 2 * n_data) if s == (5, 3) else
          ShardFormat.flat(s, 2 * n_data) for s in SHAPES]
  r = np.random.RandomState(0)
  xs = [jnp.asarray(r.randint(-9, 9, (n_data, *s)), jnp.float32) for s in SHAPES]

  def per_replica(*xs):
    xs = [x[0] for x in xs]  # Differs over "data", the same on both model ranks.
    together = batched.reduce_scatter(xs, fmts, "data", 1 << 20, copies=("model",))
    alone = [formatted.reduce_scatter(x, f, "data", ("model",)) for x, f in zip(xs, fmts)]
    sums = [lax.psum(x, "data") for x in xs]
    expected = [formatted.shard(s, f, ("data", "model")) for s, f in zip(sums, fmts)]
    wholes = batched.all_gather(together, fmts, ("data", "model"), 1 << 20)
    return [y[None] for y in (*together, *alone, *expected)], [w[None] for w in wholes], sums

  n = len(SHAPES)
  shards = P(("data", "model"))
  outs = jax.jit(jax.shard_map(
      per_replica, mesh=mesh, in_specs=(P("data"),) * n,
      out_specs=([shards] * 3 * n, [shards] * n, [P()] * n), check_vma=check_vma))(
          *[jax.device_put(x, NamedSharding(mesh, P("data"))) for x in xs])
  parts, wholes, sums = outs
  for k in range(n):
    together, alone, expected = (np.asarray(parts[j * n + k]) for j in range(3))
    np.testing.assert_array_equal(together, expected)
    np.testing.assert_array_equal(alone, expected)
    assert together.shape == (2 * n_data, *fmts[k].shard_shape)
    for w in np.asarray(wholes[k]):
      np.testing.assert_array_equal(w, np.asarray(sums[k]))
