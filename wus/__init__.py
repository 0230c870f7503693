"""wus: automatic weight-update sharding for data-parallel JAX training.

Xu et al., "Automatic Cross-Replica Sharding of Weight Update in
Data-Parallel Training", arXiv:2004.13336 (2020).

`import wus` imports JAX, NumPy and wus's own modules only. The names that
need another library import it when first used (PEP 562 module `__getattr__`):
`wus.nnx_jit` imports Flax, `wus.checkpoint` and `wus.checkpointable` import Orbax
and TensorStore (also imported by the steps' `state_target`).
"""

import importlib
import sys
from typing import TYPE_CHECKING

from wus import sharded as _sharded

from wus.analysis.formats import ShardFormat
from wus.analysis.plan import Plan
from wus.api import ShardedStep
from wus.api import shard_map
from wus.errors import CheckpointError
from wus.errors import StateMismatchError
from wus.jit import JitStep
from wus.filter_jit import filter_jit
from wus.jit import jit
from wus.pjit import pjit
from wus.pmap import pmap
from wus.sharded import ShardedArray
from wus.sharded import is_sharded
from wus.sharded import unreplicate
from wus.sharded import unshard

__version__ = "0.1.0"

if TYPE_CHECKING:  # For type checkers and the API reference; at run time, `__getattr__`.
  from wus import checkpoint
  from wus.checkpoint import checkpointable
  from wus.nnx import nnx_jit

# name -> (module, attribute or None for the module itself, the distribution it needs).
_LAZY = {
    "nnx_jit": ("wus.nnx", "nnx_jit", "flax"),
    "checkpoint": ("wus.checkpoint", None, "orbax-checkpoint"),
    "checkpointable": ("wus.checkpoint", "checkpointable", "orbax-checkpoint"),
}

__all__ = ["CheckpointError", "JitStep", "Plan", "ShardFormat", "ShardedArray", "ShardedStep",
           "StateMismatchError", "checkpoint", "checkpointable", "filter_jit", "is_sharded",
           "jit", "nnx_jit", "pjit", "pmap", "shard_map", "unreplicate", "unshard"]


def _orbax_saves_wus_state() -> None:
  """Once Orbax is imported, makes its `jax.Array` handler wus's (`wus.checkpoint.register`),
  so that an Orbax save of sharded state as it is (its padded shards: `wus.checkpointable`
  not called) fails at save time, saying what to save instead."""
  if "orbax.checkpoint" in sys.modules:
    importlib.import_module("wus.checkpoint").register()


_sharded.ShardsKey.on_key_path = staticmethod(_orbax_saves_wus_state)


def __getattr__(name: str):
  """Imports `wus.nnx_jit` (Flax), `wus.checkpoint` and `wus.checkpointable` (Orbax) when
  first used.

  Raises:
    AttributeError: `name` is not a name of wus.
    ImportError: the library the name needs is not installed (the message says
      which to install).
  """
  if name not in _LAZY:
    raise AttributeError(f"module 'wus' has no attribute {name!r}")
  module_name, attribute, distribution = _LAZY[name]
  try:
    module = importlib.import_module(module_name)
  except ModuleNotFoundError as e:
    if e.name is None or e.name.startswith("wus"):
      raise
    raise ImportError(f"wus.{name} needs {distribution}, which is not installed "
                      f"(No module named {e.name!r}): pip install {distribution}") from e
  value = module if attribute is None else getattr(module, attribute)
  globals()[name] = value
  return value


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(_LAZY))
