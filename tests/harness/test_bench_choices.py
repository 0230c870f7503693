"""wus-bench's batching choices (issue 30): each program makes the collectives it is
priced for, and gives every replica its shard of the sum."""

import jax
import numpy as np
import pytest

from wus.analysis import costmodel, network
from wus.harness.tools import report
from wus.harness.tools.bench import choices

# Mixed sizes, two not divisible by 8 (padded, so batched whatever alone_bytes says).
WORKLOAD = costmodel.Workload(gradients=((4096, 4), (3001, 4), (64, 4), (10, 4), (8192, 4)))


@pytest.mark.parametrize("name", ["plan", "one_bucket", "alone"])
def test_each_batching_runs_the_collectives_it_is_priced_for(name):
  mesh = jax.make_mesh((8,), ("data",))
  bucket, alone = choices.choices(16384, 8192)[name]
  run, args = choices.program(WORKLOAD, mesh, "data", bucket, alone)
  reduced, gathered = run(*args)
  count = choices.collective_counts(WORKLOAD, 8, bucket, alone)
  assert count == {"plan": 3, "one_bucket": 1, "alone": 5}[name]
  kinds = report.collectives(run.lower(*args).compile().as_text(), per_run=True)
  assert kinds["reduce-scatter"].count == count and kinds["all-gather"].count == count
  for (e, _), r, g in zip(WORKLOAD.gradients, reduced, gathered, strict=True):
    # Every replica's gradient is ones: the sum is 8 on every real element.
    assert np.all(np.asarray(r)[:e] == 8)
    assert np.asarray(g).shape[0] == 8 * e and np.all(np.asarray(g) == 1)


def test_prediction_counts_copies_only_where_batching_copies():
  t = network.default_topology(8, platform="cpu")
  copies = {name: costmodel.predict_sharded(WORKLOAD, t, 8, bucket_bytes=b, alone_bytes=a).copies
            for name, (b, a) in choices.choices(16384, 8192).items()}
  assert copies["one_bucket"] > copies["plan"] > copies["alone"] >= 0
