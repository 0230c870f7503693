"""Where an equation came from in the user's code."""

from __future__ import annotations

import os
import sys

from jax._src import source_info_util as _source_info

from wus.analysis.compat.handles import JaxprEqn

# Libraries whose frames are not the user's code: a gradient all-reduce that AD makes from a
# Flax layer's broadcast is located at the user's call of the layer, not inside Flax. Frames
# in any installed package (site-packages, dist-packages) are skipped too.
_LIBRARIES = ("flax", "optax", "chex", "orbax", "wus", "equinox", "keras", "haiku",
              "jaxtyping", "lineax", "optimistix", "diffrax", "treescope", "penzai")
_INSTALLED = (os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep)


def _library_roots() -> tuple[str, ...]:
  """The folders of the `_LIBRARIES` imported (and wus's sub-packages, installed apart)."""
  names = (*_LIBRARIES, "wus.analysis", "wus.transforms", "wus.collectives", "wus.harness")
  modules = [sys.modules.get(name) for name in names]
  return tuple(os.path.dirname(m.__file__) + os.sep for m in modules
               if m is not None and getattr(m, "__file__", None))


def source_line(eqn: JaxprEqn) -> str:
  """Where in the user's code `eqn` came from, as "file:line:column (function)": the
  innermost frame outside JAX, the libraries of `_LIBRARIES` and installed packages
  (Equinox's and Keras' layers included) (or JAX's own choice, or
  the name stack, "jit(_where)", when tracing kept no such frame)."""
  roots = _library_roots()
  for frame in _source_info.user_frames(eqn.source_info.traceback):
    if not frame.file_name.startswith(roots) and not any(
        p in frame.file_name for p in _INSTALLED):
      return f"{frame.file_name}:{frame.start_line}:{frame.start_column} ({frame.function_name})"
  return (_source_info.summarize(eqn.source_info) or str(eqn.source_info.name_stack)
          or "an unknown place")


def has_user_frame(eqn: JaxprEqn) -> bool:
  """Whether `eqn`'s traceback reaches user code (not only JAX's own helpers)."""
  tb = eqn.source_info.traceback
  return tb is not None and _source_info.user_frame(tb) is not None
