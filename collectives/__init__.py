"""Reduce-scatter, all-gather and local sharding with a sharding format fused in (§5).

Usable by hand inside `jax.shard_map`, as the rewritten step uses them.

Modules, one concern each:
  formatted  reduce-scatter, all-gather and local shards with a sharding format fused in (§5.1)
  batched    many small tensors in one collective, in buckets (§5.2, Fig. 10)
  owned      rows of whole tensors, one row per replica: the layout of owned updates
  order      data dependencies XLA keeps: `after` orders a computation, `opaque` hides constants
"""

from wus.collectives import batched
from wus.collectives.order import after
from wus.collectives.batched import all_reduce
from wus.collectives.formatted import all_gather
from wus.collectives.formatted import pad
from wus.collectives.formatted import reduce_scatter
from wus.collectives.formatted import scatter_blocks
from wus.collectives.formatted import shard
from wus.collectives.formatted import sum_of_copies
from wus.collectives.formatted import row_mask
from wus.collectives.formatted import unpad
