"""Python's cyclic garbage collector paused while wus traces.

Tracing allocates a few hundred thousand short-lived objects. Each time they
trigger a full collection, the collector walks every object in the process
(the user's model and JAX's caches included): on ResNet-50 that took as long
as the rewrite itself. Reference counting still frees what the block drops;
garbage with cycles waits for the first collection after it, which finds it
among the young objects.
"""

from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def paused():
  """Runs the block with the cyclic collector off; restores it as it was."""
  if not gc.isenabled():
    yield
    return
  gc.disable()
  try:
    yield
  finally:
    gc.enable()
