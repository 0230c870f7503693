"""wus: automatic weight-update sharding for data-parallel JAX training.

Xu et al., "Automatic Cross-Replica Sharding of Weight Update in
Data-Parallel Training", arXiv:2004.13336 (2020).
"""

from wus.analysis.formats import ShardFormat
from wus.analysis.plan import Plan
from wus.api import ShardedStep
from wus.api import shard_map
from wus.errors import CheckpointError
from wus.errors import StateMismatchError
from wus.jit import JitStep
from wus.filter_jit import filter_jit
from wus.jit import jit
from wus.nnx import nnx_jit
from wus.pmap import pmap
from wus.sharded import ShardedArray
from wus.sharded import checkpointable
from wus.sharded import is_sharded
from wus.sharded import unreplicate
from wus.runtime import unshard

__version__ = "0.1.0"
