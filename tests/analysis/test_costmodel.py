"""The alpha-beta cost model: properties a wrong model would break. Pure Python, fast."""

import dataclasses
import math

import pytest

from wus.analysis import sizing as sz
from wus.analysis import costmodel as cm
from wus.analysis import network as net
from wus.collectives import batched

A = net.Axis("a", 4, alpha=1e-6, bandwidth=1e9)


def _topology(*sizes, alpha=1e-6, bandwidth=1e9, memory=1e11, tile=1):
  return net.Topology(tuple(net.Axis(f"a{i}", n, alpha, bandwidth) for i, n in enumerate(sizes)),
                     memory_bandwidth=memory, tile_elements=tile)


def _workload(tensors=(4096, 1024, 65536, 256), update=28, norms=0, gather_bytes=4):
  """Float32 gradients of `tensors` elements, gathered in `gather_bytes`; the update
  moves `update` bytes per element (Adam's 28: reads w, g, m, v, writes w, m, v)."""
  return cm.Workload(gradients=tuple((n, 4) for n in tensors),
                     gathered=tuple((n, gather_bytes) for n in tensors),
                     updated=tuple((n, update) for n in tensors), norms=norms)


# --- Ring formulas ------------------------------------------------------------------


def test_ring_formulas_by_hand():
  d = 4e6
  # n = 4: 3 steps, each alpha + d / (4 B) = 1 us + 1 ms.
  assert net.ring_reduce_scatter(d, A) == pytest.approx(3 * (1e-6 + 1e-3))
  assert net.ring_all_gather(d, A) == pytest.approx(3.003e-3)
  assert net.ring_all_reduce(d, A) == pytest.approx(6.006e-3)
  two = dataclasses.replace(A, size=2)
  assert net.ring_reduce_scatter(d, two) == pytest.approx(1e-6 + 2e-3)
  assert net.ring_all_reduce(d, two) == pytest.approx(2 * (1e-6 + 2e-3))
  assert net.ring_all_reduce(d, dataclasses.replace(A, size=1)) == 0


def test_multi_phase_by_hand():
  """§5.1: along the fast axis on D, then along the slow one on D / n_fast."""
  fast = net.Axis("fast", 2, alpha=1e-6, bandwidth=4e9)
  slow = net.Axis("slow", 4, alpha=5e-6, bandwidth=1e9)
  d = 8e6
  expected = 1 * (1e-6 + d / (2 * 4e9)) + 3 * (5e-6 + (d / 2) / (4 * 1e9))
  assert net.reduce_scatter(d, (fast, slow)) == pytest.approx(expected)
  assert net.all_gather(d, (fast, slow)) == pytest.approx(expected)
  # Fast axis first moves fewer bytes over the slow links than slow first.
  assert net.reduce_scatter(d, (fast, slow)) < net.reduce_scatter(d, (slow, fast))


@pytest.mark.parametrize("axes", [(A,),
                                  (net.Axis("f", 2, 1e-7, 5e9), A, net.Axis("s", 3, 1e-5, 1e8))])
def test_reduce_scatter_and_all_gather_make_an_all_reduce(axes):
  d = 3e6
  assert net.reduce_scatter(d, axes) + net.all_gather(d, axes) == pytest.approx(
      net.all_reduce(d, axes))
  assert (cm.wire_bytes(d, axes, "reduce-scatter") + cm.wire_bytes(d, axes, "all-gather")
          == pytest.approx(cm.wire_bytes(d, axes, "all-reduce")))


def test_wire_bytes_match_the_ring_count_of_the_hlo_report():
  # report._WIRE: an all-reduce of D bytes in groups of g sends 2 (g - 1) D / g.
  assert cm.wire_bytes(4e6, (A,), "all-reduce") == pytest.approx(2 * 3 * 1e6)
  assert cm.wire_bytes(4e6, (A,), "all-gather") == pytest.approx(3 * 1e6)


def test_full_sharding_communicates_what_the_all_reduce_did():
  """One bucket, same dtype, no padding: reduce-scatter + all-gather = the all-reduce (§2.2)."""
  t = _topology(2, 4)
  w = _workload(gather_bytes=4)
  rep = cm.predict_replicated(w, t)
  full = cm.predict_sharded(w, t, t.num_devices)
  assert full.reduce_scatter + full.all_gather == pytest.approx(rep.all_reduce)
  assert full.all_reduce == 0
  assert full.wire_bytes == pytest.approx(rep.wire_bytes)


def test_a_cluster_is_priced_by_the_step_formula_without_latency():
  """`cluster_seconds`: `predict_replicated` / `predict_sharded` over all N, alpha 0,
  one bucket: the same model, not a second formula."""
  t = _topology(2, 4, alpha=1e-3)
  w = cm.Workload(gradients=((2000, 4), (96, 2)), gathered=((2000, 4),),
                  updated=((2000, 4), (2000, 4), (2000, 8)))
  replicated, sharded = cm.cluster_seconds(w, t)
  zero = t.without_latency()
  assert all(a.alpha == 0 for a in zero.axes) and zero.num_devices == t.num_devices
  assert replicated == cm.predict_replicated(w, zero).total
  assert sharded == cm.predict_sharded(w, zero, 8).total
  # By hand: all-reduce of 8192 B over 2 then 4; the update's 32000 B at 1e11 B/s.
  d = 8000 + 192
  assert replicated == pytest.approx(2 * (d / 2 / 1e9 + 3 * (d / 2) / 4 / 1e9) + 32000 / 1e11)


def test_the_update_moves_its_own_bytes_and_a_tiny_tensor_stays_whole():
  t = _topology(8, memory=1e9)
  w = cm.Workload(gradients=(), updated=((8000, 4), (1, 4), (800, 2)))
  assert cm.update_seconds(w, t) == pytest.approx((32000 + 4 + 1600) / 1e9)
  assert cm.update_seconds(w, t, 8) == pytest.approx((4000 + 4 + 200) / 1e9)


# --- Batching and partial sharding -----------------------------------------------


@pytest.mark.parametrize("collective,kind", [(net.reduce_scatter, "reduce-scatter"),
                                             (net.all_gather, "all-gather"),
                                             (net.all_reduce, "all-reduce")])
@pytest.mark.parametrize("k", [1, 2, 7])
def test_batching_k_tensors_saves_k_minus_1_latencies(collective, kind, k):
  axes = (net.Axis("f", 2, 2e-6, 5e9), A)
  sizes = [1e5] * k
  apart, n_apart = net.batched(collective, sizes, axes, bucket_bytes=1e5)  # each its own
  together, n_together = net.batched(collective, sizes, axes)
  assert (n_apart, n_together) == (k, 1)
  assert apart - together == pytest.approx((k - 1) * net.latency(axes, kind))


def test_buckets():
  """Buckets fill in order; a tensor with a collective of its own closes the
  bucket before it, so no reduce-scatter's bucket spans one (its members'
  gradients would wait for the backward pass of the tensors between them); an
  all-gather's (`closes=False`) spans it."""
  assert batched.buckets([10, 10, 30, 5, 5], limit=25) == [[0, 1], [2], [3, 4]]
  assert batched.buckets([10, 10, 10], limit=25) == [[0, 1], [2]]
  assert batched.buckets([1, 1, 5, 1, 1], limit=100, alone_bytes=5) == [[0, 1], [2], [3, 4]]
  assert batched.buckets([1, 5, 1], 100, 5, padded=[False, True]) == [[0, 1, 2]]
  assert batched.buckets([10, 10], limit=math.inf) == [[0, 1]]
  assert batched.buckets([1, 1, 5, 1, 1], 100, 5, closes=False) == [[2], [0, 1, 3, 4]]
  assert batched.buckets([10, 10, 30, 5, 5], limit=25, closes=False) == [[2], [0, 1, 3], [4]]


def test_group_of_everyone_is_full_sharding():
  """G = N: reduce-scatter and all-gather over every axis, the update on 1/N, nothing across."""
  t = _topology(2, 4, 2)
  w = _workload(norms=2, gather_bytes=2)  # LARS: |w| and |g| per tensor.
  n = t.num_devices
  p = cm.predict_sharded(w, t, n)
  grads = [4 * x for x, _ in w.gradients]
  assert p.reduce_scatter == pytest.approx(net.reduce_scatter(sum(grads), t.axes))
  assert p.all_gather == pytest.approx(net.all_gather(sum(grads) / 2, t.axes))
  assert p.all_reduce == 0
  assert p.norm_all_reduce == pytest.approx(net.all_reduce(2 * 4 * len(w.gradients), t.axes))
  assert p.update == pytest.approx(cm.update_seconds(w, t) / n)
  assert p.collectives == {"reduce-scatter": 1, "all-reduce": 1, "all-gather": 1}


@pytest.mark.parametrize("norms", [0, 2])
@pytest.mark.parametrize("tile", [1, 128])
def test_group_of_one_is_no_sharding(norms, tile):
  t = _topology(2, 4, alpha=3e-6, tile=tile)
  w = _workload(tensors=(1000, 3, 70000), update=30, norms=norms, gather_bytes=2)
  for bucket in (math.inf, 4096):
    assert cm.predict_sharded(w, t, 1, rest=0.5, bucket_bytes=bucket) == cm.predict_replicated(
        w, t, rest=0.5, bucket_bytes=bucket)


def test_partial_sharding_follows_fig_10():
  """G = 2 of 2 x 4: reduce-scatter over the fast axis, all-reduce of halves over the slow."""
  t = _topology(2, 4)
  w = _workload()
  p = cm.predict_sharded(w, t, 2)
  d = 4 * w.num_elements
  assert p.reduce_scatter == pytest.approx(net.reduce_scatter(d, t.axes[:1]))
  assert p.all_reduce == pytest.approx(net.all_reduce(d / 2, t.axes[1:]))
  assert p.all_gather == pytest.approx(net.all_gather(d, t.axes[:1]))
  # One bucket: every gradient copied into it (d), every weight out of the
  # gathered one (d), the shards across groups into and out of theirs (d / 2).
  assert p.copies == pytest.approx(2 * (d + d + d / 2) / t.memory_bandwidth)
  assert p.total == pytest.approx(p.rest + p.reduce_scatter + p.all_reduce + p.update
                                  + p.all_gather)
  assert p.with_copies == pytest.approx(p.total + p.copies)


def test_tensors_alone_are_not_copied_and_padded_ones_always_are():
  """`alone_bytes`: unpadded tensors that large keep their own collectives and
  are not copied (§5.2 batches for latency; the copy is memory traffic). A
  padded tensor is copied by its padding either way, so it stays batched."""
  sizes, padded = [100, 5000, 5000, 20], [False, False, True, False]
  assert batched.buckets(sizes, 1e6, 1000, padded) == [[0], [1], [2, 3]]
  assert net.copied(sizes, 1e6, 1000, padded) == 5000 + 20  # [0] is alone too: before [1].
  assert net.copied(sizes, 1e6, None, padded) == sum(sizes)
  t = _topology(8, alpha=1e-5, memory=1e9)
  w = _workload(tensors=(8 * 1000, 8 * 1000, 3))  # The [3] pads.
  alone = cm.predict_sharded(w, t, 8, alone_bytes=4000)
  shared = cm.predict_sharded(w, t, 8)
  assert (alone.collectives["reduce-scatter"], shared.collectives["reduce-scatter"]) == (3, 1)
  assert alone.copies == pytest.approx(2 * 2 * 3 * 4 / 1e9)  # The [3] (padded), each way.
  assert shared.copies == pytest.approx(2 * 2 * (2 * 32000 + 12) / 1e9)


@pytest.mark.parametrize("memory, alone", [(1e9, True), (1e13, False)])
def test_choose_batching_weighs_copies_against_latency(memory, alone):
  """Slow memory (CPU devices): 256 KiB tensors keep their own collectives;
  fast memory (HBM): copying them costs less than a collective's latency."""
  t = _topology(8, alpha=2e-5, memory=memory)
  w = _workload(tensors=(65536,) * 8 + (256,) * 8)
  limit, chosen = sz.choose_batching(w, t, 8)
  assert limit in sz.BUCKET_CANDIDATES
  if alone:
    assert chosen is not None and 256 * 4 * 8 < chosen <= 65536 * 4
    p = cm.predict_sharded(w, t, 8, bucket_bytes=limit, alone_bytes=chosen)
    assert p.collectives["reduce-scatter"] == 9  # 8 alone, the biases in one bucket.
  else:
    assert chosen is None


def test_choose_batching_prices_a_tensor_alone_wherever_it_sits():
  """Layers of a 256 KiB kernel and a 1 KiB bias, in layer order, on CPU-like
  devices (a collective's latency 0.35 ms, copying a kernel into and out of a
  bucket 1.05 ms): each kernel keeps its own collectives, as when the kernels
  come last. Each kernel closes the bias bucket before it (`buckets`), so the
  step has 16 reduce-scatters, not 9 (the all-gathers' buckets span the kernels:
  9); priced in this order, those 7 more latencies would make copying every
  kernel look cheaper, though the bucket they split off runs behind the kernel's
  backward pass."""
  t = _topology(8, alpha=5e-5, memory=1e9)
  layers = _workload(tensors=(65536, 256) * 8)
  last = _workload(tensors=(256,) * 8 + (65536,) * 8)
  limit, chosen = sz.choose_batching(layers, t, 8)
  assert (limit, chosen) == sz.choose_batching(last, t, 8)
  assert chosen is not None and 256 * 4 < chosen <= 65536 * 4
  p = cm.predict_sharded(layers, t, 8, bucket_bytes=limit, alone_bytes=chosen)
  assert (p.collectives["reduce-scatter"], p.collectives["all-gather"]) == (16, 9)
  # A bias alone between two kernels is not copied; the biases' all-gather copies them.
  assert p.copies == pytest.approx(net.copy_seconds(8 * 256 * 4, t))


def test_small_shards_combine_into_fewer_all_reduces():
  """§5.2: the all-reduce across groups is batched on shards, G times smaller."""
  t = _topology(8, 4)
  w = _workload(tensors=(8192,) * 16)  # 32 KiB each
  p = cm.predict_sharded(w, t, 8, bucket_bytes=64 * 1024)
  assert p.collectives["reduce-scatter"] == 8   # two whole tensors per bucket
  assert p.collectives["all-reduce"] == 1       # 16 shards of 4 KiB in one


# --- Topology ------------------------------------------------------------------------


def test_split_into_groups():
  t = _topology(2, 4, 4)
  assert [a.size for a in t.split(8)[0]] == [2, 4] and [a.size for a in t.split(8)[1]] == [4]
  inner, outer = t.split(4)  # the group ends inside the second axis
  assert [a.size for a in inner] == [2, 2] and [a.size for a in outer] == [2, 4]
  # The ring across groups: neighbours 2 apart, sharing the axis's links.
  assert (outer[0].alpha, outer[0].bandwidth) == (2 * t.axes[1].alpha, t.axes[1].bandwidth / 2)
  assert (inner[1].alpha, inner[1].bandwidth) == (t.axes[1].alpha, t.axes[1].bandwidth)
  assert t.split(1) == ((), t.axes) and t.split(32) == (t.axes, ())
  with pytest.raises(ValueError, match="unevenly"):
    _topology(4, 3).split(6)  # 6 cuts the first axis of 4
  with pytest.raises(ValueError, match="does not divide"):
    t.split(5)
  assert _topology(4, 3).group_sizes() == [1, 2, 4, 12]


def test_default_topology_has_the_process_as_fast_axis():
  t = net.default_topology(8, 4)
  assert [(a.name, a.size) for a in t.axes] == [("process", 4), ("host", 2)]
  assert t.axes[0].bandwidth > t.axes[1].bandwidth and t.axes[0].alpha < t.axes[1].alpha
  assert [a.size for a in net.default_topology(8).axes] == [8]
  with pytest.raises(ValueError):
    net.default_topology(8, 3)


def test_cpu_devices_share_the_hosts_bandwidths():
  """XLA:CPU devices are threads of one host: 8 of them get 1/8 of its memory and ring
  bandwidth each, and one of 8 busy devices in a group of 2 as little (issue 30)."""
  one, eight = net.default_topology(1, platform="cpu"), net.default_topology(8, platform="cpu")
  assert eight.memory_bandwidth == pytest.approx(one.memory_bandwidth / 8)
  assert eight.axes[0].bandwidth == pytest.approx(one.axes[0].bandwidth / 8)
  pair = net.default_topology(2, platform="cpu", host_devices=8)
  assert pair.memory_bandwidth == pytest.approx(eight.memory_bandwidth)
  assert net.default_topology(8, platform="tpu") == net.default_topology(8)
  assert net.default_topology(8, platform="gpu", host_devices=2) == net.default_topology(8)


def test_batching_on_cpu_devices_keeps_large_tensors_apart():
  """Where a copy costs about what a ring step of the same bytes costs (CPU devices),
  copying a 1 MiB tensor into a bucket costs more than the latency it saves; on
  accelerator-class figures (memory 20x faster than the links) batching it pays."""
  w = cm.Workload(gradients=((2 ** 18, 4),) * 8 + ((64, 4),) * 8)
  w = dataclasses.replace(w, gathered=w.gradients)
  _, alone = sz.choose_batching(w, net.default_topology(8, platform="cpu"), 8)
  assert alone is not None and alone <= 2 ** 20
  _, alone = sz.choose_batching(w, net.default_topology(8), 8)
  assert alone is None or alone > 2 ** 20


# --- The update ----------------------------------------------------------------------


@pytest.mark.parametrize("g", [1, 2, 4, 8, 16])
def test_update_time_scales_as_one_over_g(g):
  t = _topology(16, memory=2e11)
  w = _workload(tensors=(4096, 65536, 16))
  full = w.num_elements * 28 / 2e11
  assert cm.update_seconds(w, t) == pytest.approx(full)
  assert cm.update_seconds(w, t, g) == pytest.approx(full / g)
  assert cm.predict_sharded(w, t, g).update == pytest.approx(full / g)


def test_tiles_pad_small_shards():
  assert cm.shard_elements(1000, 4, tile=128) == 256   # 8 tiles -> 2 per shard
  assert cm.shard_elements(1000, 16, tile=128) == 128  # less than a tile each
  assert cm.shard_elements(1000, 3) == 334
  t = _topology(64, tile=1024)
  w = _workload(tensors=(1024,) * 10)
  # Each of 64 shards of a one-tile tensor is a whole tile: 64x the bytes.
  assert cm.update_seconds(w, t, 64) == pytest.approx(cm.update_seconds(w, t))


# --- Choices -------------------------------------------------------------------------


@pytest.mark.parametrize("sizes", [(64,), (2, 8, 4)])
def test_full_sharding_when_latency_is_negligible(sizes):
  t = _topology(*sizes, alpha=0.0)
  w = _workload(tensors=(2 ** 20, 2 ** 16, 2 ** 12))
  assert sz.choose_group_size(w, t) == t.num_devices


def test_splitting_an_axis_saves_no_latency_by_itself():
  t = _topology(4096, alpha=1e-3)
  for g in (2, 64, 512):
    inner, outer = t.split(g)
    assert net.latency(inner, "all-reduce") + net.latency(outer, "all-reduce") == pytest.approx(
        net.latency(t.axes, "all-reduce"))


def test_groups_when_latency_dominates():
  """Tiny tensors, one bucket each, on 4096 devices: the shards of G tensors share one
  all-reduce across groups (Fig. 10), the reduce-scatters and all-gathers stay short."""
  t = _topology(4096, alpha=1e-3)
  w = _workload(tensors=(4096,) * 64)  # 16 KiB each
  g = sz.choose_group_size(w, t, bucket_bytes=16 * 1024)
  assert g == 64
  best = cm.predict_sharded(w, t, g, bucket_bytes=16 * 1024)
  assert best.collectives == {"reduce-scatter": 64, "all-reduce": 1, "all-gather": 64}
  assert best.total < cm.predict_sharded(w, t, 4096, bucket_bytes=16 * 1024).total / 10
  assert best.total < cm.predict_replicated(w, t, bucket_bytes=16 * 1024).total / 10


def test_no_sharding_when_there_is_nothing_to_save():
  """Fast memory, a cheap update, and sharding adds the all-reduce of LARS's norms: G = 1."""
  t = net.Topology((net.Axis("a", 8, 1e-3, 1e9),), memory_bandwidth=1e15)
  w = _workload(tensors=(16,) * 100, norms=2)  # LARS's norms.
  assert sz.choose_group_size(w, t) == 1


def test_bucket_choice():
  w = _workload(tensors=(2 ** 18,) * 64)  # 1 MiB each
  candidates = [2 ** k for k in range(16, 28)]
  # No latency: buckets cost nothing, the smallest will do.
  assert sz.choose_bucket_bytes(w, _topology(8, alpha=0.0), candidates=candidates) == 2 ** 16
  # Latency-heavy: few buckets needed.
  big = sz.choose_bucket_bytes(w, _topology(8, alpha=1e-3), candidates=candidates)
  assert big >= 2 ** 25
  slow = cm.predict_replicated(w, _topology(8, alpha=1e-3), bucket_bytes=big)
  one = cm.predict_replicated(w, _topology(8, alpha=1e-3))
  assert slow.communication <= 1.01 * one.communication


def test_predictions_are_labelled_and_add_up():
  p = cm.predict_sharded(_workload(update=40, norms=2), _topology(2, 4), 4, rest=0.01)  # LAMB
  assert "prediction" in cm.StepPrediction.__doc__
  assert p.total == pytest.approx(0.01 + p.communication + p.update)
  assert p.copies > 0  # One bucket: every tensor copied into it and out.
  assert p.communication == pytest.approx(p.reduce_scatter + p.all_reduce + p.norm_all_reduce
                                          + p.all_gather)
