"""`transformer.TransformerLM` tensor-parallel, Megatron-style, for one device of a shard_map.

The same weights (the Flax parameter tree of `TransformerLM`), split over the
mesh axis MODEL_AXIS as Megatron-LM splits them (Shoeybi et al. 2019, §3) and
the JAX shard_map tutorial writes it ("Tensor parallelism"): in each block,
attention's query, key and value projections are column-parallel (each model
rank holds `num_heads / model` whole heads) and its output projection
row-parallel; the MLP's first Dense is column-parallel (`mlp_dim / model`
hidden units per rank) and its second row-parallel. A `psum` over MODEL_AXIS
follows each row-parallel matmul, and the row-parallel layers' biases (kept
whole) are added after it. Embedding, position embedding and LayerNorms are
whole on every rank, and so is the residual stream between blocks.

`forward` runs inside a shard_map whose in_spec for the parameters is
`param_specs(params)`; under check_vma=True the gradients of the whole
weights are summed over MODEL_AXIS by JAX's AD (the transpose of the implicit
`pvary` where a whole activation meets a split weight: Megatron's "f"), and
those of the split weights are their blocks'.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

MODEL_AXIS = "model"

# Per-block parameter path (inside DecoderBlock_i) -> PartitionSpec; every other
# parameter is whole (P()).
_BLOCK_SPECS = {
    **{("MultiHeadDotProductAttention_0", name, "kernel"): P(None, MODEL_AXIS, None)
       for name in ("query", "key", "value")},  # [emb, heads, head_dim]: column-parallel
    **{("MultiHeadDotProductAttention_0", name, "bias"): P(MODEL_AXIS, None)
       for name in ("query", "key", "value")},  # [heads, head_dim]
    ("MultiHeadDotProductAttention_0", "out", "kernel"): P(MODEL_AXIS, None, None),  # row
    ("MlpBlock_0", "Dense_0", "kernel"): P(None, MODEL_AXIS),  # [emb, mlp]: column-parallel
    ("MlpBlock_0", "Dense_0", "bias"): P(MODEL_AXIS),
    ("MlpBlock_0", "Dense_1", "kernel"): P(MODEL_AXIS, None),  # [mlp, emb]: row-parallel
}


def param_specs(params) -> Any:
  """The PartitionSpec of each weight of a `TransformerLM` parameter tree (same structure).

  Heads and the MLP hidden dim are split over MODEL_AXIS; `num_heads` and
  `mlp_dim` must be divisible by its size (`check_divisible`).
  """
  def spec(path, _):
    keys = tuple(k.key for k in path)
    return _BLOCK_SPECS.get(keys[1:], P()) if keys[0].startswith("DecoderBlock_") else P()
  return jax.tree_util.tree_map_with_path(spec, params)


def check_divisible(config, model_parallel: int) -> str | None:
  """Why `config` cannot be split `model_parallel` ways, or None if it can."""
  for name in ("num_heads", "mlp_dim"):
    if getattr(config, name) % model_parallel:
      return f"its {name}={getattr(config, name)} is not divisible by {model_parallel}"
  return None


def _layer_norm(p, x):
  return nn.LayerNorm().apply({"params": p}, x)


def _attention(p, x, mask):
  """Causal self-attention over this rank's heads; the output summed over MODEL_AXIS."""
  q, k, v = (jnp.einsum("bld,dhk->blhk", x, p[n]["kernel"]) + p[n]["bias"]
             for n in ("query", "key", "value"))
  heads = nn.dot_product_attention(q, k, v, mask=mask)  # [batch, length, heads/model, head_dim]
  out = jnp.einsum("blhk,hkd->bld", heads, p["out"]["kernel"])
  return jax.lax.psum(out, MODEL_AXIS) + p["out"]["bias"]


def _mlp(p, x):
  """Dense -> GELU -> Dense over this rank's hidden units; the output summed over MODEL_AXIS."""
  h = nn.gelu(x @ p["Dense_0"]["kernel"] + p["Dense_0"]["bias"])
  return jax.lax.psum(h @ p["Dense_1"]["kernel"], MODEL_AXIS) + p["Dense_1"]["bias"]


def forward(config, params, tokens):
  """Logits of `TransformerLM(config)` at `params`, on one device of a shard_map.

  Args:
    config: the model's `transformer.TransformerConfig`.
    params: this device's blocks of the parameters (split by `param_specs`).
    tokens: int32 [batch, length], this replica's, whole over MODEL_AXIS.

  Returns:
    float32 [batch, length, vocab_size], the same on every model rank; equal to
    `TransformerLM(config).apply` of the whole weights up to summation order.
  """
  embedding = params["Embed_0"]["embedding"]
  x = embedding[tokens] + params["pos_embedding"][: tokens.shape[1]]
  mask = nn.make_causal_mask(tokens)
  for i in range(config.num_layers):
    p = params[f"DecoderBlock_{i}"]
    x = x + _attention(p["MultiHeadDotProductAttention_0"], _layer_norm(p["LayerNorm_0"], x),
                       mask)
    x = x + _mlp(p["MlpBlock_0"], _layer_norm(p["LayerNorm_1"], x))
  x = _layer_norm(params["LayerNorm_0"], x)
  return x @ embedding.T / jnp.sqrt(config.emb_dim)
