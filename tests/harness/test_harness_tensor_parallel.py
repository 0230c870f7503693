"""Tests of the tensor-parallel Transformer and `wus-train --model_parallel` (issue 29 item 9)."""

import dataclasses
import math

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from wus.harness.models import tasks, transformer, transformer_tp

SMALL = dataclasses.replace(transformer.CONFIGS["small"], max_len=16)


def _params(config, seed=0):
  return transformer.init(transformer.TransformerLM(config), seed)


def test_param_specs_split_heads_and_mlp_hidden_units_only():
  params = jax.eval_shape(lambda: _params(SMALL))
  specs = transformer_tp.param_specs(params)
  split = [(leaf.shape, spec) for leaf, spec in zip(jax.tree.leaves(params), jax.tree.leaves(
      specs, is_leaf=lambda x: isinstance(x, P))) if spec != P()]
  # Per block: q, k, v kernels and biases, out kernel, MLP Dense_0 kernel and bias, Dense_1 kernel.
  assert len(split) == 10 * SMALL.num_layers
  for shape, spec in split:
    assert shape[list(spec).index("model")] in (SMALL.num_heads, SMALL.mlp_dim), (shape, spec)
  mlp = specs["DecoderBlock_0"]["MlpBlock_0"]
  assert mlp["Dense_1"]["bias"] == P()  # added once, after the row-parallel psum


@pytest.mark.parametrize("mesh_shape", [(4, 2), (2, 4)])
def test_tp_forward_equals_the_unsharded_model(mesh_shape):
  """Logits of the Megatron-split forward under shard_map (check_vma=True) equal those of
  `TransformerLM.apply` at the same whole weights, to rounding, on every model rank."""
  mesh = jax.make_mesh(mesh_shape, ("data", "model"))
  params = _params(SMALL)
  tokens = np.random.default_rng(0).integers(0, 256, (2 * mesh_shape[0], 16)).astype(np.int32)
  specs = transformer_tp.param_specs(params)
  tp = jax.jit(jax.shard_map(lambda p, t: transformer_tp.forward(SMALL, p, t), mesh=mesh,
                             in_specs=(specs, P("data")), out_specs=P("data")))
  placed = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, specs)
  got = tp(placed, jax.device_put(tokens, NamedSharding(mesh, P("data"))))
  want = jax.jit(transformer.TransformerLM(SMALL).apply)({"params": params}, tokens)
  assert got.shape == (2 * mesh_shape[0], 16, 256)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  # The blocks each device holds: 1/model of every split weight.
  q = placed["DecoderBlock_0"]["MultiHeadDotProductAttention_0"]["query"]["kernel"]
  assert q.addressable_shards[0].data.shape[1] == SMALL.num_heads // mesh_shape[1]


def test_a_model_that_cannot_be_split_says_why():
  with pytest.raises(ValueError, match="not a Transformer"):
    tasks.make("mlp_small", num_classes=10, seq_len=0, axis_name="data", model_parallel=2)
  with pytest.raises(ValueError, match="num_heads=5 is not divisible by 2"):
    tasks.make("transformer_mixed", num_classes=None, seq_len=8, axis_name="data",
               model_parallel=2)
