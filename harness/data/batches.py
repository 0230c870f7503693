"""Global batches on the mesh, each process loading only its own devices' rows.

A global batch is a dict of `jax.Array`s whose leading (example) dim is split
over the data axis. Which examples it holds is decided on every process alike
(`Split.sample`, cheap: ids only); the examples themselves are loaded only for
the row ranges of this process's devices, and placed with
`jax.make_array_from_callback`, which asks for exactly those ranges.
"""

from collections.abc import Callable, Iterator

import jax
import numpy as np
from jax.sharding import NamedSharding


def on_mesh(load_rows: Callable[[int, int], dict[str, np.ndarray]], num_rows: int,
            sharding: NamedSharding) -> dict[str, jax.Array]:
  """A global batch of `num_rows` examples, built from this process's rows only.

  Args:
    load_rows: (start, stop) -> {name: [stop - start, ...] array}: the global
      batch's rows start..stop.
    num_rows: global batch size, divisible by the number of devices the
      sharding splits the leading dim over.
    sharding: the batch's sharding (leading dim split over the data axis).

  Returns:
    {name: jax.Array [num_rows, ...]} with `sharding`. `load_rows` was called
    once per distinct row range of this process's devices.
  """
  ranges = {(s.start or 0, s.stop if s.stop is not None else num_rows)
            for (s,) in sharding.addressable_devices_indices_map((num_rows,)).values()}
  local = {r: load_rows(*r) for r in sorted(ranges)}
  first = next(iter(local.values()))

  def array(name: str) -> jax.Array:
    def rows(index: tuple[slice, ...]) -> np.ndarray:
      s = index[0]
      return local[(s.start or 0, s.stop if s.stop is not None else num_rows)][name]
    return jax.make_array_from_callback((num_rows, *first[name].shape[1:]), sharding, rows)

  return {name: array(name) for name in first}


def train_batch(split, *, seed: int, step: int, batch_size: int,
                sharding: NamedSharding) -> dict[str, jax.Array]:
  """Step `step`'s global training batch of `batch_size` examples (see `on_mesh`)."""
  ids = split.sample(seed=seed, step=step, batch_size=batch_size)
  return on_mesh(lambda start, stop: split.load(ids[start:stop]), batch_size, sharding)


def eval_batches(split, *, batch_size: int, max_examples: int,
                 sharding: NamedSharding) -> Iterator[dict[str, jax.Array]]:
  """The first `max_examples` of the held-out split in global batches, padding weighted 0.

  Yields:
    Batches like `train_batch`'s plus "weight": float32 [batch_size], 1 for an
    example and 0 for the padding that fills the last batch (a repeat of
    example 0).
  """
  ids = split.eval_ids()[:max_examples]
  for begin in range(0, len(ids), batch_size):
    chunk = ids[begin:begin + batch_size]
    weight = np.zeros(batch_size, np.float32)
    weight[:len(chunk)] = 1
    chunk = np.concatenate([chunk, np.full(batch_size - len(chunk), ids[0])])

    def load_rows(start, stop, chunk=chunk, weight=weight):
      return {**split.load(chunk[start:stop]), "weight": weight[start:stop]}

    yield on_mesh(load_rows, batch_size, sharding)
