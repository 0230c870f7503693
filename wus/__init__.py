"""wus: automatic weight-update sharding for data-parallel JAX training.

Example: a `jax.jit` training step, the batch placed over the mesh's "data" axis, and
`wus.jit` in `jax.jit`'s place; the optimizer state then lives 1/8 on each device.

    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    batch = jax.device_put(batch, NamedSharding(mesh, P("data")))  # split over "data"

    @wus.jit                                  # was: @jax.jit
    def train_step(params, opt_state, batch):
      grads = jax.grad(loss_fn)(params, batch)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state

    params, opt_state = train_step(params, tx.init(params), batch)
    print(wus.bytes_per_device(opt_state))    # DeviceBytes(... 0.125 of a copy ...)

`wus.shard_map`, `wus.pmap`, `wus.filter_jit` (Equinox), `wus.nnx_jit` (Flax NNX) and
`wus.named_jit` (haliax, Levanter) take the place of `jax.shard_map`, `jax.pmap`,
`eqx.filter_jit`, `nnx.jit` and `haliax.named_jit` the same way. `step.plan(*args)`
says what is sharded and why; a step that saves little warns once
(`wus.NotShardedWarning`). The repository's examples/ folder has whole programs.

Xu et al., "Automatic Cross-Replica Sharding of Weight Update in
Data-Parallel Training", arXiv:2004.13336 (2020).

`import wus` imports JAX, NumPy and wus's own modules only. The names that
need another library import it when first used (PEP 562 module `__getattr__`):
`wus.nnx_jit` imports Flax, `wus.checkpoint` and `wus.checkpointable` import Orbax
and TensorStore (also imported by the steps' `state_target`). Where that library is
missing, the name is a stand-in that raises an ImportError naming what to install when
called or read from, so that `help(wus)` and `dir(wus)` work in every install.

Modules, one concern each:
  api            `wus.shard_map` (`ShardedStep`): the front end of `jax.shard_map` steps
  pmap           `wus.pmap`: a drop-in for `jax.pmap`
  jit            `wus.jit` (`JitStep`): a global-view `jax.jit` step
  jit_arguments  `jax.jit`'s calling convention as `wus.jit` reads it: keywords and leaves
  jit_placement  what `wus.jit` derives from the placements: the mesh, the batch axes, splits
  jit_region     how `wus.jit` finds a step's update region: what runs as a shard_map, what not
  jit_operands   the step's arguments as the update region's operands: state pairs, names
  pjit           `wus.pjit`: `pjit`'s signature and rules, on `wus.jit`
  filter_jit     `wus.filter_jit`: `wus.jit` for steps with non-array leaves (Equinox)
  named_jit      `wus.named_jit`: `wus.jit` for haliax's `named_jit` (Levanter)
  nnx            `wus.nnx_jit`: `flax.nnx.jit` for steps that update NNX objects in place
  options        `Options`: what a user tells wus besides the step, validated once
  matching       state matching: which output of a step is the next value of which input
  mesh_axes      what each mesh axis is to a step: its role, the replica axes, groups, devices
  spec_splits    what a step's specs split of each operand besides the replica axes (the Plan)
  pipeline       the seven stages every front end shares, each one value to the next
  stages         the values the pipeline's stages hand each other: what the next one reads
  runtime        the runtime every front end shares: operands in, sharded state out
  sharded        `ShardedArray`: the tensors wus keeps sharded between steps
  saving         what a step saves: the warning when it saves little, bytes per device
  errors         the errors and warnings wus raises
  checkpoint     checkpoints of sharded state with stock Orbax, restored at any N (a package)
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
from wus.errors import NotShardedWarning
from wus.errors import StateMismatchError
from wus.jit import JitStep
from wus.filter_jit import filter_jit
from wus.jit import jit
from wus.named_jit import named_jit
from wus.pjit import pjit
from wus.pmap import pmap
from wus.saving import DeviceBytes
from wus.saving import bytes_per_device
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

__all__ = ["CheckpointError", "DeviceBytes", "JitStep", "NotShardedWarning", "Plan",
           "ShardFormat", "ShardedArray", "ShardedStep", "StateMismatchError",
           "bytes_per_device", "checkpoint", "checkpointable", "filter_jit", "is_sharded",
           "jit", "named_jit", "nnx_jit", "pjit", "pmap", "shard_map", "unreplicate",
           "unshard"]


def _orbax_saves_wus_state() -> None:
  """Once Orbax is imported, makes its `jax.Array` handler wus's (`wus.checkpoint.register`),
  so that an Orbax save of sharded state as it is (its padded shards: `wus.checkpointable`
  not called) fails at save time, saying what to save instead."""
  if "orbax.checkpoint" in sys.modules:
    importlib.import_module("wus.checkpoint").register()


_sharded.ShardsKey.on_key_path = staticmethod(_orbax_saves_wus_state)


class _Missing:
  """`wus.<name>` where the library it needs is not installed: listed by `dir(wus)` and
  `help(wus)`; calling it, or reading an attribute of it, raises the ImportError."""

  def __init__(self, name: str, distribution: str, error: ModuleNotFoundError):
    self._name, self._distribution, self._error = name, distribution, error

  def _raise(self):
    raise ImportError(f"wus.{self._name} needs {self._distribution}, which is not installed "
                      f"(No module named {self._error.name!r}): pip install "
                      f"{self._distribution}") from self._error

  def __call__(self, *args, **kwargs):
    self._raise()

  def __getattr__(self, attribute: str):
    if attribute.startswith("_"):  # What pydoc, copy and IPython ask of any object.
      raise AttributeError(attribute)
    self._raise()

  def __repr__(self) -> str:
    return f"<wus.{self._name}: needs {self._distribution}, not installed>"


def __getattr__(name: str):
  """Imports `wus.nnx_jit` (Flax), `wus.checkpoint` and `wus.checkpointable` (Orbax) when
  first used.

  Returns:
    The name's value; where the library it needs is missing, a stand-in that raises an
    ImportError naming what to install when called or read from.

  Raises:
    AttributeError: `name` is not a name of wus.
  """
  if name not in _LAZY:
    raise AttributeError(f"module 'wus' has no attribute {name!r}")
  module_name, attribute, distribution = _LAZY[name]
  try:
    module = importlib.import_module(module_name)
  except ModuleNotFoundError as e:
    if e.name is None or e.name.startswith("wus"):
      raise
    return _Missing(name, distribution, e)
  value = module if attribute is None else getattr(module, attribute)
  globals()[name] = value
  return value


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(_LAZY))
