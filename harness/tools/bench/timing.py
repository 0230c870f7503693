"""Timing calls interleaved, as a training loop runs them: warm, in no fixed order.

On these CPU devices an update that runs right after a different program ran
up to 1.25x slower than one after an update of its own program (measured:
`replicated, wus_undonated, wus` in that order each round gave the undonated
step 188 ms and the donated one 158 ms; the order `wus, wus_undonated` turned
the ratio round). A fixed order of neighbours (one rotated each round keeps
them) biases every ratio. So each round takes a new random order, and every
timed call follows an untimed call of the same program, as in a training loop.

Beside the time, each timed call's minor page faults (`getrusage`): pages the
process touched for the first time since they were mapped. A step whose
temporaries XLA:CPU's allocator maps afresh every call (a bucket's
concatenated buffer, say) pays for them in faults, which a step that writes
into donated or reused buffers does not (issue 30).
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable, Mapping

import numpy as np


def interleaved(calls: Mapping[str, Callable[[int], object]], rounds: int, *, seed: int = 0,
                progress: Callable[[str], object] | None = None,
                faults: dict[str, list[int]] | None = None) -> dict[str, list[float]]:
  """Seconds of each call in each round (module docstring).

  Args:
    calls: name -> a call taking the round (0, 1, ...) that runs one update to
      completion (blocking on its results); it keeps its own state.
    rounds: timed calls per name; each name also runs `rounds` untimed calls.
    seed: of the rounds' orders.
    progress: called with the name after each timed call, or None.
    faults: if given, filled with name -> the minor page faults of each timed
      call (the whole process's: every device thread's), in round order.

  Returns:
    name -> `rounds` wall-clock times in seconds, in round order.
  """
  seconds = {name: [] for name in calls}
  shuffle = np.random.default_rng(seed)
  for r in range(rounds):
    for name in map(str, shuffle.permutation(list(calls))):
      calls[name](r)  # Untimed: the program warm.
      before, start = _minor_faults(), time.perf_counter()
      calls[name](r)
      seconds[name].append(time.perf_counter() - start)
      if faults is not None:
        faults.setdefault(name, []).append(_minor_faults() - before)
      if progress:
        progress(name)
  return seconds


def _minor_faults() -> int:
  """Minor page faults of this process so far (all its threads)."""
  return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
