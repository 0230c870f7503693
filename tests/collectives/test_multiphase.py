"""Multi-phase reduce-scatter and all-gather over several mesh axes (§5.1).

Sharding over a ("replica", "data") mesh reduce-scatters along "data" (the
minor, fastest axis) on the whole tensor, then along "replica" on what is
left; the all-gather runs the phases in reverse. Replica r still ends with
row block r of the padded tensor, so formats, the local slice of state and
the masks of sharded reductions are unchanged.
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import wus
from helpers import (assert_trees_equal, collective_lines, replica_groups, sharded_leaves,
                     two_axis_run)
from wus.collectives import formatted


@pytest.mark.parametrize("shape", [(2, 4), (4, 2), (2, 2, 2)])
def test_phases_place_rows_as_one_collective_does(shape):
  """Integer-valued floats: every order of summation is exact, so the phased
  collectives must equal the one-phase ones element for element."""
  names = ("a", "b", "c")[:len(shape)]
  mesh = jax.make_mesh(shape, names)
  n = int(np.prod(shape))
  x = jnp.arange(n * n * 3 * 5, dtype=jnp.float32).reshape(n, n * 3, 5) % 7

  def per_replica(x):
    x = x[0]
    return (formatted.scatter_rows(x, names)[None],
            lax.psum_scatter(x, names, scatter_dimension=0, tiled=True)[None],
            formatted.gather_rows(x[:3], names, tiled=True)[None],
            formatted.gather_rows(x[:3], names, tiled=False)[None])

  spec = P(names)
  outs = jax.jit(jax.shard_map(per_replica, mesh=mesh, in_specs=spec, out_specs=spec,
                               check_vma=False))(jax.device_put(x, NamedSharding(mesh, spec)))
  phased, single, tiled, stacked = map(np.asarray, outs)
  np.testing.assert_array_equal(phased, single)
  everyone = np.asarray(x)[:, :3]  # Replica r's x[:3] is row block r.
  for r in range(n):
    np.testing.assert_array_equal(tiled[r], everyone.reshape(n * 3, 5))
    np.testing.assert_array_equal(stacked[r], everyone)


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "novma"])
@pytest.mark.parametrize("shape", [(2, 4), (4, 2)], ids=["2x4", "4x2"])
def test_sharded_over_both_axes_in_two_phases(shape, check_vma):
  mesh, a, b, ws, x = two_axis_run(shape, check_vma, 41)
  # The gradient sums within "data" first, then across "replica": rounding only.
  assert_trees_equal(a[0], b[0], rtol=1e-6, atol=1e-7)
  assert_trees_equal(a[1], wus.unshard(b[1]), rtol=1e-6, atol=1e-7)
  assert {x.format.num_shards for x in sharded_leaves(b[1])} == {8}
  # Each collective runs once per phase, within the groups of its axis.
  hlo = ws.lower(*b, x).compile().as_text()
  # Each collective's group size, in whichever form this XLA prints its replica groups.
  groups = lambda kind: sorted(len(replica_groups(ln)[0]) for ln in collective_lines(hlo, kind))
  data, replica = shape[1], shape[0]
  assert groups("reduce-scatter") == sorted([data, replica])
  assert groups("all-gather") == sorted([data, replica])
