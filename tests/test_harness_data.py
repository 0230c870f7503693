"""Tests of wus.harness.data: the corpus, the split, the windows and their placement."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from wus.harness import data

TOKENS = (np.arange(1000) % 256).astype(np.uint8)


def test_stdlib_text_is_a_fixed_prefix():
  text = data.stdlib_text(max_bytes=10_000)
  assert len(text) == 10_000
  assert data.stdlib_text(max_bytes=1_000) == text[:1_000]


def test_load_tokens_reads_the_named_file(tmp_path):
  path = tmp_path / "text.txt"
  path.write_bytes(b"hello")
  tokens = data.load_tokens(str(path))
  assert tokens.dtype == np.uint8
  np.testing.assert_array_equal(tokens, np.frombuffer(b"hello", np.uint8))


def test_split_holds_out_the_end():
  train, held_out = data.split(TOKENS, eval_fraction=0.1)
  assert len(train) == 900
  np.testing.assert_array_equal(np.concatenate([train, held_out]), TOKENS)


def test_windows_are_contiguous_and_deterministic():
  batch = data.windows(TOKENS, seed=3, step=7, batch_size=5, seq_len=16)
  assert batch.shape == (5, 17) and batch.dtype == np.int32
  # TOKENS counts up mod 256, so each window must too.
  np.testing.assert_array_equal(np.diff(batch, axis=1) % 256, 1)
  np.testing.assert_array_equal(batch, data.windows(TOKENS, seed=3, step=7, batch_size=5,
                                                     seq_len=16))
  assert not np.array_equal(batch, data.windows(TOKENS, seed=3, step=8, batch_size=5,
                                                seq_len=16))


def test_windows_need_a_long_enough_text():
  with pytest.raises(ValueError, match="need more than seq_len"):
    data.windows(TOKENS[:16], seed=0, step=0, batch_size=1, seq_len=16)


def test_on_mesh_splits_the_batch_over_data():
  mesh = jax.make_mesh((8,), ("data",))
  batch = data.on_mesh(data.windows(TOKENS, seed=0, step=0, batch_size=16, seq_len=4), mesh)
  assert batch.sharding == NamedSharding(mesh, P("data"))
  assert batch.addressable_shards[0].data.shape == (2, 5)
