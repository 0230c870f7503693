"""Errors and warnings `wus` raises, and the one-line form of a library error quoted in them."""

import os
import sys
import traceback

from wus.analysis import refusals
from wus.analysis.reasons import Reason


class StateMismatchError(ValueError):
  """Sharded state does not fit the step it was passed to.

  Raised when a `wus.ShardedArray` was made on another mesh (other devices or
  replica count). Recover with `wus.unshard(state)`, placed on the new mesh:
  whole state is always accepted and re-sharded for the step that receives
  it. Sharded state on the same mesh that the step holds another way is
  converted without asking.
  """


class CheckpointError(ValueError):
  """A checkpoint's array cannot be restored as the state it claims to be.

  Raised by `wus.checkpointable`'s Orbax handler at restore when an array has
  another shape than the target, or its files are damaged; the message is one
  line naming the array and the checkpoint directory. The restore target is
  left untouched.
  """


class NotShardedWarning(UserWarning):
  """A wus step that saves little: it runs unchanged, or keeps most of its weight update
  whole (`wus.saving.not_sharded` says exactly when).

  Warned once per compiled signature, where the step is first called (or planned) with
  it, with the Plan's first reason and the usual fix (place the batch over a mesh axis,
  `NamedSharding(mesh, P("data"))`). The step still runs, as its JAX function would.
  Silence it with `warnings.filterwarnings("ignore", category=wus.NotShardedWarning)`.
  """


def first_line(error: BaseException) -> str:
  """`error`'s first line without TensorStore's spec dump, at most 300 characters.

  Orbax and TensorStore errors run to pages (the array's spec, source
  locations); a `CheckpointError` or a harness error quotes this line.
  """
  text = (str(error).strip().splitlines() or [type(error).__name__])[0]
  text = text.split(" [tensorstore_spec")[0].split(" [source locations")[0]
  return text if len(text) <= 300 else text[:297] + "..."


def own_error(error: BaseException) -> Reason:
  """A Plan's `unchanged` reason for one of wus's own errors while analysing a step: where
  it was raised and what it says (`refusals.OwnError`; the step then runs as `jax.jit`
  runs it)."""
  return Reason(refusals.OwnError(where(error), type(error).__name__, str(error)))


def where(error: BaseException) -> str:
  """`file:line` of the innermost frame of `error`'s traceback in wus's own code (the
  innermost frame at all if none is), for a Plan that quotes one of wus's own errors."""
  import wus.analysis  # noqa: PLC0415 -- the packages' folders, not their contents.
  import wus.collectives  # noqa: PLC0415
  import wus.transforms  # noqa: PLC0415
  roots = tuple(os.path.dirname(m.__file__) + os.sep for m in (
      sys.modules["wus"], wus.analysis, wus.transforms, wus.collectives))
  frames = traceback.extract_tb(error.__traceback__)
  ours = [f for f in frames if os.path.abspath(f.filename).startswith(roots)] or frames
  if not ours:
    return "<unknown>"
  return f"{os.path.basename(os.path.dirname(ours[-1].filename))}/" \
         f"{os.path.basename(ours[-1].filename)}:{ours[-1].lineno}"
