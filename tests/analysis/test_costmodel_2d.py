"""The cost model on a data x model mesh (issue 29 item 8) and the forward pass's narrow
copy of the weights (§4.2, Fig. 7). Pure Python, fast."""

import dataclasses

import pytest

from wus.analysis import costmodel as cm
from wus.analysis import network as net


def _axes(topology):
  return [(a.name, a.size, a.alpha, a.bandwidth) for a in topology.axes]


def _tpu(alpha=1e-6):
  """Two cores per chip on a 4 x 8 torus: core, x, y (fast to slow)."""
  return net.Topology((net.Axis("core", 2, alpha, 450e9), net.Axis("x", 4, alpha, 100e9),
                       net.Axis("y", 8, alpha, 100e9)), memory_bandwidth=450e9)


def test_a_data_group_strided_by_the_model_axis_shares_its_links():
  """(4 data x 2 model) on a ring of 8: each data group's ring crosses 2 links per step,
  and the two groups share them (alpha x 2, bandwidth / 2), as `split`'s rings across
  groups do."""
  t = net.Topology((net.Axis("chip", 8, 1e-6, 1e9),), memory_bandwidth=1e10, tile_elements=8)
  group = t.strided(2, 4)
  assert _axes(group) == [("chip/2", 4, 2e-6, 0.5e9)]
  assert (group.memory_bandwidth, group.tile_elements) == (1e10, 8)
  # Consecutive (model slower than data): the first 4 devices, the axis's own links.
  assert _axes(t.strided(1, 4)) == _axes(dataclasses.replace(t, axes=t.split(4)[0]))
  with pytest.raises(ValueError):
    t.strided(3, 2)


def test_on_a_torus_the_data_axis_can_be_one_ring_dimension():
  t = _tpu()
  # Model over the cores and x (64 ... here 8 devices): the data group is the y ring.
  assert _axes(t.strided(8, 8)) == [("y", 8, 1e-6, 100e9)]
  # Model over the 2 cores of a chip: the data group spans x and y (the torus).
  assert [a.name for a in t.strided(2, 32).axes] == ["x", "y"]
  # Half of x and y: x split into rings of 2 chips 2 apart.
  assert _axes(t.strided(4, 16)) == [("x/2", 2, 2e-6, 50e9), ("y", 8, 1e-6, 100e9)]


def test_a_model_split_weight_reduces_1_over_m_of_its_bytes_per_group():
  """The same data group, a tensor split M ways: each group reduce-scatters and
  all-gathers 1/M of the bytes, and its update touches 1/M; bandwidth terms shrink M x."""
  group = _tpu(alpha=0.0).strided(2, 32)
  whole = cm.Workload(gradients=((2 ** 20, 4),), gathered=((2 ** 20, 2),),
                      updated=((2 ** 20, 28),))
  half = cm.Workload(gradients=((2 ** 19, 4),), gathered=((2 ** 19, 2),),
                     updated=((2 ** 19, 28),))
  for g in (1, 8, 32):
    a, b = (cm.predict_sharded(w, group, g) for w in (whole, half))
    assert b.communication == pytest.approx(a.communication / 2)
    assert b.update == pytest.approx(a.update / 2)


def test_the_narrow_copy_is_whole_replicated_and_a_written_shard_sharded():
  """Fig. 7: replicated, every replica reads each float32 weight and writes it in
  bfloat16; sharded, the update writes 1/G of the bfloat16 bytes and reads nothing more."""
  t = _tpu()
  n = 3 * 2 ** 20
  w = cm.Workload(gradients=((n, 4),), gathered=((n, 2),), updated=((n, 28),),
                  cast=((n, 4, 2),))
  rep = cm.predict_replicated(w, t)
  assert rep.cast == pytest.approx(n * 6 / 450e9)
  assert rep.total == pytest.approx(rep.all_reduce + rep.update + rep.cast)
  for g in (2, 8, 64):
    p = cm.predict_sharded(w, t, g)
    assert p.cast == pytest.approx(cm.shard_elements(n, g) * 2 / 450e9)
    assert p.total == pytest.approx(p.communication + p.update + p.cast)
  assert cm.predict_sharded(w, t, 1) == rep
  # Without a narrow copy, nothing changes.
  plain = dataclasses.replace(w, cast=())
  assert cm.predict_replicated(plain, t).cast == 0
  assert cm.predict_replicated(plain, t).total == pytest.approx(rep.total - rep.cast)
