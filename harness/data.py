"""Byte-level text data: loading, a held-out split, and batches on the mesh.

The default corpus is Python's own standard library: the `.py` files under
`sysconfig.get_paths()["stdlib"]` (without `site-packages`), in sorted path
order, concatenated, truncated to a fixed prefix. It is on every machine that
runs this code, so nothing is downloaded; it is identical across machines with
the same Python version.
"""

import pathlib
import sysconfig

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

STDLIB_PREFIX_BYTES = 8 << 20  # 8 MiB of the standard library is plenty


def stdlib_text(max_bytes: int = STDLIB_PREFIX_BYTES) -> bytes:
  """The first `max_bytes` bytes of the standard library's `.py` sources."""
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  paths = sorted(
      p.relative_to(root).as_posix()
      for p in root.rglob("*.py")
      if not {"site-packages", "dist-packages"} & set(p.relative_to(root).parts)
  )
  chunks, size = [], 0
  for path in paths:
    if size >= max_bytes:
      break
    chunks.append((root / path).read_bytes())
    size += len(chunks[-1])
  return b"".join(chunks)[:max_bytes]


def load_tokens(path: str | None = None) -> np.ndarray:
  """Byte tokens of the file at `path`, or of `stdlib_text()` if `path` is None.

  Returns:
    uint8 [num_bytes]: the bytes, each a token id in [0, 256).
  """
  text = pathlib.Path(path).read_bytes() if path else stdlib_text()
  return np.frombuffer(text, np.uint8)


def split(tokens: np.ndarray, eval_fraction: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
  """Splits `tokens` into a training prefix and a held-out suffix.

  Args:
    tokens: uint8 [num_bytes].
    eval_fraction: share of the bytes, at the end, held out for evaluation.

  Returns:
    (train, eval): uint8 [num_train], uint8 [num_bytes - num_train].
  """
  num_train = int(len(tokens) * (1 - eval_fraction))
  return tokens[:num_train], tokens[num_train:]


def windows(tokens: np.ndarray, *, seed: int, step: int, batch_size: int,
            seq_len: int) -> np.ndarray:
  """Random contiguous windows of `tokens`, a pure function of (seed, step).

  Args:
    tokens: uint8 [num_bytes], `num_bytes > seq_len`.
    seed: data seed, non-negative.
    step: training step, non-negative; each step draws its own windows.
    batch_size: number of windows (the global batch).
    seq_len: model input length; each window has `seq_len + 1` tokens.

  Returns:
    int32 [batch_size, seq_len + 1].

  Raises:
    ValueError: if `tokens` is not longer than `seq_len`.
  """
  if len(tokens) <= seq_len:
    raise ValueError(f"The text has {len(tokens)} bytes; need more than seq_len={seq_len}.")
  rng = np.random.default_rng((seed, step))
  starts = rng.integers(0, len(tokens) - seq_len, size=batch_size)
  return tokens[starts[:, None] + np.arange(seq_len + 1)].astype(np.int32)


def on_mesh(batch: np.ndarray, mesh: Mesh, axis_name: str = "data") -> jax.Array:
  """Places `batch` on `mesh`, its leading dim split over `axis_name`.

  Args:
    batch: [global_batch, ...], `global_batch` divisible by the axis size.
    mesh: the device mesh.
    axis_name: the data-parallel mesh axis.

  Returns:
    The same values as a global jax.Array with sharding
    NamedSharding(mesh, P(axis_name)): each device holds
    [global_batch / mesh.shape[axis_name], ...].
  """
  return jax.device_put(batch, NamedSharding(mesh, P(axis_name)))
