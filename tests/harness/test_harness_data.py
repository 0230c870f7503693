"""Tests of wus.harness.data.text: the corpus, the split, the windows."""

import numpy as np
import pytest

from wus.harness.data import text as data

TOKENS = (np.arange(1000) % 256).astype(np.uint8)


def test_stdlib_text_is_a_fixed_prefix():
  text = data.stdlib_text(max_bytes=10_000)
  assert len(text) == 10_000
  assert data.stdlib_text(max_bytes=1_000) == text[:1_000]


def test_load_tokens_reads_a_file(tmp_path):
  path = tmp_path / "text.txt"
  path.write_bytes(b"hello")
  tokens = data.load_tokens(str(path))
  assert tokens.dtype == np.uint8
  np.testing.assert_array_equal(tokens, np.frombuffer(b"hello", np.uint8))


def test_load_tokens_concatenates_a_folder_in_path_order(tmp_path):
  (tmp_path / "b").mkdir()
  (tmp_path / "b" / "x.txt").write_bytes(b"world")
  (tmp_path / "a.txt").write_bytes(b"hello ")
  np.testing.assert_array_equal(data.load_tokens(tmp_path),
                                np.frombuffer(b"hello world", np.uint8))


def test_split_holds_out_the_end():
  train, held_out = data.split(TOKENS, eval_fraction=0.1)
  assert len(train) == 900
  np.testing.assert_array_equal(np.concatenate([train, held_out]), TOKENS)


def test_windows_are_contiguous_and_a_function_of_seed_and_step():
  starts = data.window_starts(len(TOKENS), seed=3, step=7, batch_size=5, seq_len=16)
  batch = data.gather_windows(TOKENS, starts, seq_len=16)
  assert batch.shape == (5, 17) and batch.dtype == np.int32
  # TOKENS counts up mod 256, so each window must too.
  np.testing.assert_array_equal(np.diff(batch, axis=1) % 256, 1)
  np.testing.assert_array_equal(
      starts, data.window_starts(len(TOKENS), seed=3, step=7, batch_size=5, seq_len=16))
  assert not np.array_equal(
      starts, data.window_starts(len(TOKENS), seed=3, step=8, batch_size=5, seq_len=16))


def test_windows_need_a_long_enough_text():
  with pytest.raises(ValueError, match="need more than seq_len"):
    data.window_starts(16, seed=0, step=0, batch_size=1, seq_len=16)
