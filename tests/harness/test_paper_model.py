"""The paper's named optimizers as cost-model workloads (`wus.harness.tools.paper_model`)."""

import math

import pytest

from wus.analysis import costmodel as cm
from wus.analysis import network as net
from wus.harness.tools import paper_model


def test_optimizer_traffic():
  bytes_ = {k: o.bytes_per_element() for k, o in paper_model.OPTIMIZERS.items()}
  # SGD reads w, g and writes w; Adam reads w, g, m, v and writes w, m, v.
  assert bytes_ == {"sgd": 12, "momentum": 20, "adam": 28, "lars": 28, "lamb": 40}
  assert paper_model.OPTIMIZERS["adam"].bytes_per_element(copy_bytes=2) == 30
  assert paper_model.OPTIMIZERS["adam"].bytes_per_element(state_bytes=2) == 14


def test_workload_holds_the_optimizers_traffic_and_norms():
  w = paper_model.workload((1000, 3), "lamb", gather_bytes=2, copy_bytes=2)
  assert w.gradients == ((1000, 4), (3, 4)) and w.gathered == ((1000, 2), (3, 2))
  assert w.updated == ((1000, 42), (3, 42)) and w.norms == 2 and w.num_elements == 1003
  t = net.Topology((net.Axis("a", 8, 1e-6, 1e9),), memory_bandwidth=1e10)
  assert cm.update_seconds(w, t) == pytest.approx(1003 * 42 / 1e10)
  with pytest.raises(KeyError):
    paper_model.workload((8,), "adagrad")


@pytest.mark.parametrize("optimizer", sorted(paper_model.OPTIMIZERS))
@pytest.mark.parametrize("tile", [1, 128])
def test_group_of_one_is_no_sharding(optimizer, tile):
  t = net.Topology(tuple(net.Axis(f"a{i}", n, 3e-6, 1e9) for i, n in enumerate((2, 4))),
                   memory_bandwidth=1e11, tile_elements=tile)
  w = paper_model.workload((1000, 3, 70000), optimizer, gather_bytes=2, copy_bytes=2)
  for bucket in (math.inf, 4096):
    assert cm.predict_sharded(w, t, 1, rest=0.5, bucket_bytes=bucket) == cm.predict_replicated(
        w, t, rest=0.5, bucket_bytes=bucket)
