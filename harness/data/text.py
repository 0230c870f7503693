"""Byte-level text: loading, a held-out split, random windows.

The default corpus is Python's own standard library: the `.py` files under
`sysconfig.get_paths()["stdlib"]` (without `site-packages`), in sorted path
order, concatenated, truncated to a fixed prefix. It is on every machine that
runs this code, so nothing is downloaded; it is identical across machines with
the same Python version.
"""

import pathlib
import sysconfig

import numpy as np

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


def load_tokens(path: str | pathlib.Path | None = None) -> np.ndarray:
  """Byte tokens of a file, of the files under a folder, or of `stdlib_text()`.

  Args:
    path: a file (memory-mapped, so only the bytes used are read), a folder
      (its files in sorted path order, concatenated), or None.

  Returns:
    uint8 [num_bytes]: the bytes, each a token id in [0, 256).
  """
  if path is None:
    return np.frombuffer(stdlib_text(), np.uint8)
  path = pathlib.Path(path)
  if path.is_file():
    return np.memmap(path, np.uint8, mode="r") if path.stat().st_size else np.zeros(0, np.uint8)
  files = sorted(f for f in path.rglob("*") if f.is_file())
  return np.frombuffer(b"".join(f.read_bytes() for f in files), np.uint8)


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


def window_starts(num_tokens: int, *, seed: int, step: int, batch_size: int,
                  seq_len: int) -> np.ndarray:
  """Start offsets of random windows of a text, a pure function of (seed, step).

  Args:
    num_tokens: length of the text, `num_tokens > seq_len`.
    seed: data seed, non-negative.
    step: training step, non-negative; each step draws its own windows.
    batch_size: number of windows (the global batch).
    seq_len: model input length; each window has `seq_len + 1` tokens.

  Returns:
    int64 [batch_size], each in [0, num_tokens - seq_len).

  Raises:
    ValueError: if the text is not longer than `seq_len`.
  """
  if num_tokens <= seq_len:
    raise ValueError(f"The text has {num_tokens} bytes; need more than seq_len={seq_len}.")
  rng = np.random.default_rng((seed, step))
  return rng.integers(0, num_tokens - seq_len, size=batch_size)


def gather_windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> np.ndarray:
  """The windows of `tokens` at `starts`: int32 [len(starts), seq_len + 1]."""
  return np.asarray(tokens[starts[:, None] + np.arange(seq_len + 1)], np.int32)
