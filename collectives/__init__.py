"""Reduce-scatter, all-gather and local sharding with a sharding format fused in (§5).

Usable by hand inside `jax.shard_map`, as the rewritten step uses them.
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
