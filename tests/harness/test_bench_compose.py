"""The limit composed in one program (`compose`): one collective each way, the parts'
values, and the figures `wus-bench` prints from it."""

import jax
import numpy as np
import optax
import pytest

from wus.harness.data import batches, datasets
from wus.harness.models import tasks
from wus.harness.tools import report
from wus.harness.tools.bench import compose, limit, summary
from wus.harness.training import config, steps


@pytest.fixture(scope="module")
def setting():
  mesh = jax.make_mesh((8,), (steps.AXIS_NAME,))
  cfg = config.RunConfig.for_model("mlp_small")
  dataset = datasets.load("synthetic", tasks.MODELS["mlp_small"][0], seq_len=cfg.seq_len,
                          image_size=cfg.image_size, seed=0)
  task = tasks.make("mlp_small", num_classes=dataset.num_classes, seq_len=cfg.seq_len,
                    axis_name=steps.AXIS_NAME)
  params, model_state = task.init(0, dataset.train.load(np.arange(1)))
  sharding = jax.NamedSharding(mesh, jax.P(steps.AXIS_NAME))
  batch = batches.train_batch(dataset.train, seed=0, step=0, batch_size=16, sharding=sharding)
  tx = optax.adam(1e-3)
  return mesh, task, params, model_state, batch, tx, compose.Composed(
      task, params, model_state, tx, mesh)


def test_the_step_runs_one_flat_collective_each_way(setting):
  *_, composed = setting
  assert set(composed.calls) == set(compose.KEYS)
  hlo = composed._programs["step"].lower(*composed.arguments("step", setting[4])).compile()
  counts = {k: c.count for k, c in report.collectives(hlo.as_text()).items() if c.count}
  assert counts == {"reduce-scatter": 1, "all-gather": 1}
  assert composed.elements == limit.flat_elements(limit.sizes_of(setting[2]), 8)


def test_the_step_is_its_parts_composed(setting):
  """The step's gathered weights are Adam's update of the flat shard by the reduce-scatter
  of the replicas' gradients laid end to end: the parts, run one after another."""
  mesh, task, params, model_state, batch, tx, composed = setting
  shard = np.asarray(composed._held["shard"]).copy()
  state = jax.tree.map(lambda x: np.asarray(x).copy(), composed._held["state"])
  gathered = np.asarray(composed.calls["step"](batch))
  grads = steps.make_gradient_step(task, mesh)(params, model_state, batch)
  per_replica = np.stack([np.concatenate([np.asarray(g)[i].reshape(-1)
                                          for g in jax.tree.leaves(grads)]) for i in range(8)])
  flat = np.zeros(composed.elements, np.float32)
  flat[:per_replica.shape[1]] = per_replica.sum(0)
  updates, _ = tx.update(flat, state, shard)
  expected = np.asarray(optax.apply_updates(shard, updates))
  np.testing.assert_allclose(gathered[:composed.elements], expected, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(gathered.reshape(8, -1), np.tile(gathered[:composed.elements],
                                                                 (8, 1)))
  for name, call in composed.calls.items():  # Every program runs on its held buffers.
    assert np.all(np.isfinite(np.asarray(jax.tree.leaves(call(batch))[0]))), name


def test_composition_figures_are_per_round_ratios():
  rounds = {"rest_seconds": [1.0, 2.0, 1.0], "collectives_seconds": [0.5, 0.5, 0.5],
            "update_seconds": [0.5, 1.0, 0.5], "wus": {"step_seconds": [4.0, 8.0, 2.0]},
            compose.KEYS["step"]: [2.0, 4.0, 2.0],
            compose.KEYS["reduce_scatter"]: [0.25, 0.25, 0.25],
            compose.KEYS["all_gather"]: [0.25, 0.25, 0.25],
            compose.KEYS["rest_flat"]: [1.0, 2.5, 1.5],
            compose.KEYS["rest_reduce_scatter"]: [2.5, 5.5, 1.75],
            compose.KEYS["reduce_scatter_update"]: [0.75, 1.25, 0.75],
            compose.KEYS["update_all_gather"]: [1.5, 1.25, 0.75]}
  c = compose.composition(rounds)
  assert c["step"] == 2.0 and c["over_parts"] == 1.0 and c["wus_over_step"] == 2.0
  assert c["flat"] == 0.5 and c["pairs"]["rest_reduce_scatter"] == (2.0, 1.25)
  assert c["pairs"]["reduce_scatter_update"] == (1.0, 0.0)
  assert c["pairs"]["update_all_gather"] == (1.0, 0.0)
  assert "The limit in one program" in compose.markdown(rounds)
  rounds["part_page_faults"] = {"rest_seconds": 3, compose.KEYS["step"]: 5,
                                compose.KEYS["rest_flat"]: 4}
  assert "it 5, forward and backward alone 3, laid end to end 4" in compose.markdown(rounds)
  assert compose.composition({"rest_seconds": [1.0]}) is None
  assert compose.markdown({}) == "" and summary.limit_markdown({}) == ""
