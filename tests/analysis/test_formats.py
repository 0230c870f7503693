"""Properties of `ShardFormat` and the format-fused collectives (DESIGN.md §3, Formats; §4.1)."""

from __future__ import annotations

import functools
import math

import jax
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from wus import collectives
from wus.analysis import formats
from wus.analysis.formats import Format, ShardFormat
from wus.analysis.owned import OwnedFormat, Slot, build_bank

# Every example that runs JAX compiles (eager ops included): few examples, no deadline.
compiled = settings(max_examples=25, deadline=None)


@st.composite
def shapes(draw, max_size=4096):
  """Rank 1-4, dims 1-40, at most `max_size` elements."""
  shape = []
  for _ in range(draw(st.integers(1, 4))):
    shape.append(draw(st.integers(1, min(40, max_size))))
    max_size //= shape[-1]
  return tuple(shape)


@st.composite
def shard_formats(draw, max_shards=8):
  """A format merging random runs of adjacent dims of a random shape."""
  shape = draw(shapes())
  merged = [shape[0]]
  for d in shape[1:]:
    if draw(st.booleans()):
      merged[-1] *= d
    else:
      merged.append(d)
  return ShardFormat(shape, tuple(merged), draw(st.integers(1, max_shards)))


DTYPES = st.sampled_from([np.float32, np.int32])


def random_array(shape, dtype, seed) -> np.ndarray:
  rng = np.random.default_rng(seed)
  if dtype == np.int32:
    return rng.integers(-1000, 1000, shape, dtype=np.int32)
  return rng.standard_normal(shape, dtype=np.float32)


@functools.cache
def mesh(n):
  return jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])


def assert_bitwise_equal(a, b):
  a, b = np.asarray(a), np.asarray(b)
  assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
  np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


# --- ShardFormat arithmetic. ---------------------------------------------------

@given(shard_formats())
def test_format_splits_the_padded_leading_dim_evenly(fmt):
  n, rows = fmt.num_shards, fmt.merged_shape[0]
  assert math.prod(fmt.merged_shape) == math.prod(fmt.shape)
  assert 0 <= fmt.padding < n
  assert fmt.padded_shape == (rows + fmt.padding, *fmt.merged_shape[1:])
  assert fmt.shard_rows * n == fmt.padded_shape[0]
  assert fmt.shard_shape == (fmt.shard_rows, *fmt.merged_shape[1:])
  assert fmt.shard_size == math.prod(fmt.shard_shape)
  assert fmt.shard_bytes(np.float32) == 4 * fmt.shard_size


@given(shapes(), st.integers(1, 8))
def test_flat_merges_every_dim(shape, n):
  fmt = ShardFormat.flat(shape, n)
  assert fmt.merged_shape == (math.prod(shape),) and fmt.shape == shape and fmt.num_shards == n


@given(shard_formats())
def test_str_mentions_the_padding_when_there_is_some(fmt):
  assert (f"pad {fmt.padding}" in str(fmt)) == (fmt.padding > 0)
  assert ("pad" in str(fmt)) == (fmt.padding > 0)


@given(shapes(), st.integers(1, 8), st.integers(1, 5))
def test_rejects_a_merged_shape_of_another_size(shape, n, extra):
  size = math.prod(shape)
  for merged in [(size + extra,), (size, extra + 1), ()]:
    with pytest.raises(ValueError):
      ShardFormat(shape, merged, n)


@given(shapes(), st.integers(-3, 0))
def test_rejects_fewer_than_one_shard(shape, n):
  with pytest.raises(ValueError):
    ShardFormat.flat(shape, n)


@pytest.mark.parametrize("shape,merged", [((2, 3), (3, 2)), ((6,), (2, 3)), ((2, 3, 4), (4, 6))])
def test_rejects_a_merged_shape_that_is_not_a_merge_of_adjacent_dims(shape, merged):
  with pytest.raises(ValueError):
    ShardFormat(shape, merged, 2)


@given(st.integers(1, 8), st.integers(0, 100))
def test_scalars_are_never_shardable(n, min_size):
  assert not formats.is_shardable_shape((), n, min_size)


@given(shapes(), st.integers(1, 8), st.integers(0, 100))
def test_shardable_iff_more_than_num_shards_and_at_least_min_size_elements(shape, n, min_size):
  size = math.prod(shape)
  assert formats.is_shardable_shape(shape, n, min_size) == (size > n and size >= min_size)


# --- pad / unpad (local, no communication). ---------------------------------------

@compiled
@given(shard_formats(), DTYPES, st.integers(0, 2**32 - 1))
def test_pad_appends_zero_rows_and_unpad_inverts_it(fmt, dtype, seed):
  # Random bits, NaNs and -0.0 included: nothing may be rewritten.
  x = np.random.default_rng(seed).integers(0, 2**32, fmt.shape, dtype=np.uint32).view(dtype)
  padded = np.asarray(collectives.pad(x, fmt))
  assert padded.shape == fmt.padded_shape and padded.dtype == x.dtype
  # Row-major: the flat padded tensor starts with x's elements in order.
  assert_bitwise_equal(padded.reshape(-1)[:x.size], x.reshape(-1))
  assert not padded[fmt.merged_shape[0]:].any()
  assert_bitwise_equal(collectives.unpad(padded, fmt), x)


# --- Per-replica collectives inside shard_map. --------------------------------------

@compiled
@given(shard_formats(), DTYPES, st.integers(0, 2**32 - 1))
def test_shard_is_this_replicas_rows_and_all_gather_restores_the_whole(fmt, dtype, seed):
  n, rows = fmt.num_shards, fmt.shard_rows
  x = random_array(fmt.shape, dtype, seed)

  def f(x):
    s = collectives.shard(x, fmt, "data")
    return s[None], collectives.all_gather(s, fmt, "data")

  shards, whole = jax.jit(jax.shard_map(f, mesh=mesh(n), in_specs=P(),
                                        out_specs=(P("data"), P())))(x)
  shards = np.asarray(shards)
  assert shards.shape == (n, *fmt.shard_shape)  # Every replica's shard has one shape.
  padded = np.asarray(collectives.pad(x, fmt))
  for r in range(n):
    assert_bitwise_equal(shards[r], padded[r * rows:(r + 1) * rows])
  assert_bitwise_equal(whole, x)


@compiled
@given(shard_formats(), DTYPES, st.integers(0, 2**32 - 1))
def test_reduce_scatter_is_the_shard_of_the_psum(fmt, dtype, seed):
  n = fmt.num_shards
  xs = random_array((n, *fmt.shape), dtype, seed)  # A different x on every replica.

  def f(x):
    x = x[0]
    return (collectives.reduce_scatter(x, fmt, "data")[None],
            collectives.shard(lax.psum(x, "data"), fmt, "data")[None])

  got, want = jax.jit(jax.shard_map(f, mesh=mesh(n), in_specs=P("data"),
                                    out_specs=(P("data"), P("data"))))(
      jax.device_put(xs, NamedSharding(mesh(n), P("data"))))
  assert got.shape == want.shape == (n, *fmt.shard_shape) and got.dtype == xs.dtype
  if dtype == np.int32:
    np.testing.assert_array_equal(got, want)
  else:
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  # And both are the padded sum (a check on the reference too).
  total = collectives.pad(xs.sum(0, dtype=xs.dtype), fmt)
  np.testing.assert_allclose(np.asarray(want).reshape(fmt.padded_shape), total, rtol=1e-5,
                             atol=1e-5)


# --- Batched collectives (§5.2). ------------------------------------------------------

@given(st.lists(st.tuples(st.integers(0, 100), st.booleans()), max_size=30),
       st.integers(1, 120), st.none() | st.integers(0, 120))
def test_buckets_keep_every_tensor_once_in_order_within_the_limit(tensors, limit, alone):
  sizes, padded = [s for s, _ in tensors], [p for _, p in tensors]
  got = collectives.batched.buckets(sizes, limit, alone, padded)
  assert sorted(k for b in got for k in b) == list(range(len(sizes)))
  alone = limit if alone is None else alone
  for b in got:
    assert b == sorted(b)
    assert len(b) == 1 or sum(sizes[k] for k in b) <= limit
    assert len(b) == 1 or all(sizes[k] < limit for k in b)  # A big tensor travels alone,
    assert len(b) == 1 or all(padded[k] or sizes[k] < alone for k in b)  # and an unpadded one.
  shared = [k for b in got if len(b) > 1 for k in b]
  assert all(sizes[k] < limit and (padded[k] or sizes[k] < alone) for k in shared)


@compiled
@given(st.integers(2, 8).flatmap(lambda n: st.lists(
    shard_formats(max_shards=n).map(lambda f: ShardFormat(f.shape, f.merged_shape, n)),
    min_size=1, max_size=4)), DTYPES, st.integers(0, 2**32 - 1), st.sampled_from([16, 2 ** 22]),
    st.sampled_from([None, 1, 64]))
def test_batched_collectives_equal_one_collective_per_tensor(fmts, dtype, seed, limit, alone):
  """One reduce-scatter and one all-gather per bucket of tensors (unpadded
  tensors of `alone` bytes or more in their own): bit for bit what the
  single-tensor collectives give, each replica's part holding its shard of
  every tensor."""
  n = fmts[0].num_shards
  xs = [random_array((n, *f.shape), dtype, seed + k) for k, f in enumerate(fmts)]

  def f(*xs):
    xs = [x[0] for x in xs]
    one = [collectives.reduce_scatter(x, f, "data") for x, f in zip(xs, fmts)]
    batched = collectives.batched.reduce_scatter(xs, fmts, "data", limit, alone)
    whole = [collectives.all_gather(s, f, "data") for s, f in zip(one, fmts)]
    gathered = collectives.batched.all_gather(batched, fmts, "data", limit, alone)
    return [s[None] for s in one + batched], whole + gathered

  spec = NamedSharding(mesh(n), P("data"))
  shards, wholes = jax.jit(jax.shard_map(
      f, mesh=mesh(n), in_specs=P("data"),
      out_specs=([P("data")] * 2 * len(fmts), [P()] * 2 * len(fmts))))(
          *[jax.device_put(x, spec) for x in xs])
  k = len(fmts)
  for a, b in zip(shards[:k] + wholes[:k], shards[k:] + wholes[k:]):
    assert a.shape == b.shape and a.dtype == b.dtype
    assert_bitwise_equal(b, a)


def test_after_returns_its_values_bit_for_bit():
  """`collectives.after` orders, it changes no bit: NaN payloads, -0.0,
  infinities, integers, booleans and 16-bit floats come back as they went,
  with one token or many (combined by a sort), tokens of any dtype."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  f32 = np.array([np.nan, -0.0, np.inf, -np.inf, 1e-45, 3.5], np.float32)
  f32 = np.concatenate([f32, np.frombuffer(np.uint32(0x7FC00123).tobytes(), np.float32)])
  values = [f32, f32.astype(jnp.bfloat16), np.array([-7, 2 ** 31 - 1], np.int32),
            np.array([True, False]), np.array([255, 0], np.uint8)]
  for count in (1, 7):
    def body(*vals):
      tokens = [vals[0] * k for k in range(count)] + [vals[3], jnp.zeros((0,))]
      return collectives.after(list(vals), tokens)
    got = jax.jit(body)(*values)
    for a, b in zip(values, got, strict=True):
      assert_bitwise_equal(np.asarray(b), a)


def test_shard_formats_and_owned_rows_are_both_formats():
  """One protocol (`formats.Format`, issue 31 item 5): a ShardFormat (§4.1) and an owned
  tensor's row (`owned.OwnedFormat`) answer what the runtime asks of a format alike."""
  sharded = ShardFormat.flat((3, 5), 4)
  bank = build_bank("float32", 4, [(3, 5), (2,)], [Slot(0, 0, 15), Slot(1, 0, 2)], 15)
  owned = OwnedFormat(bank, 0)
  for fmt in (sharded, owned):
    assert isinstance(fmt, Format)
    assert fmt.shape == (3, 5) and fmt.num_shards == 4
    assert fmt.padded_shape[0] == fmt.num_shards * fmt.shard_rows
    assert math.prod(fmt.shard_shape) == fmt.shard_size
    assert fmt.shard_bytes(np.float32) == 4 * fmt.shard_size
  assert not isinstance(object(), Format)
