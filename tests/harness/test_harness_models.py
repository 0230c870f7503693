"""Tests of wus.harness.models.resnet, models and tasks: sizes, batch norm across replicas."""

import functools
import json
import math

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from wus.harness.training import loop
from wus.harness.models import tasks


def num_params(tree) -> int:
  return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))


def test_resnet50_has_mlperf_size():
  task = tasks.make("resnet50", num_classes=1000, seq_len=0, axis_name="data")
  params, model_state = jax.eval_shape(
      lambda: task.init(0, {"image": np.zeros((1, 224, 224, 3), np.float32)}))
  assert num_params(params) == 25_557_032  # as the Flax ImageNet example's ResNet-50
  assert num_params(model_state["batch_stats"]) == 53_120  # a mean and a variance per channel


@pytest.mark.parametrize("name, size", [("transformer_base", 19_111_936),
                                        ("transformer_small", 445_952),
                                        ("transformer_wide", 6_502_400)])
def test_transformer_sizes(name, size):
  task = tasks.make(name, num_classes=None, seq_len=128, axis_name="data")
  params, model_state = jax.eval_shape(
      lambda: task.init(0, {"tokens": np.zeros((1, 129), np.int32)}))
  assert num_params(params) == size and model_state == {}
  assert json.loads(json.dumps(task.identity()))["config"]["max_len"] == 128


def test_batch_norm_averages_statistics_across_replicas():
  """Eight replicas of 4 images each keep the running statistics of the 32 images."""
  task = tasks.make("resnet_small", num_classes=10, seq_len=0, axis_name="data")
  rng = np.random.default_rng(0)
  batch = {"image": rng.normal(size=(32, 8, 8, 1)).astype(np.float32),
           "label": rng.integers(0, 10, 32).astype(np.int32)}
  params, model_state = jax.jit(lambda: task.init(0, batch),
                                compiler_options=loop.INIT_COMPILER_OPTIONS)()
  mesh = jax.make_mesh((8,), ("data",))

  def replica(params, model_state, batch):
    _, (new_state, metrics) = task.loss(params, model_state, batch)
    return new_state, jax.lax.pmean(metrics, "data")

  mapped = jax.jit(jax.shard_map(replica, mesh=mesh, in_specs=(P(), P(), P("data")),
                                 out_specs=P()))
  new_state, _ = mapped(params, model_state,
                        jax.device_put(batch, NamedSharding(mesh, P("data"))))

  whole = tasks.make("resnet_small", num_classes=10, seq_len=0, axis_name=None)
  _, (expected, _) = jax.jit(whole.loss)(params, model_state, batch)
  jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-4, atol=1e-6),
               jax.device_get(new_state), jax.device_get(expected))
  assert not np.allclose(new_state["batch_stats"]["bn_init"]["mean"],
                         model_state["batch_stats"]["bn_init"]["mean"])
