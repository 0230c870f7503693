"""A decoder-only Transformer language model over bytes.

The architecture follows the Flax lm1b example (pre-LayerNorm decoder blocks,
causal self-attention, a learned position embedding, output logits tied to the
token embedding), in plain float32 and without dropout, so that a training step
is a deterministic function of its inputs.
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

VOCAB_SIZE = 256  # byte-level tokens


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """Hyperparameters of `TransformerLM`.

  Attributes:
    num_layers: number of decoder blocks.
    emb_dim: width of the residual stream (d_model).
    num_heads: attention heads; must divide `emb_dim`.
    mlp_dim: hidden width of the feed-forward block.
    max_len: longest input sequence, in tokens.
    vocab_size: number of token ids.
  """

  num_layers: int
  emb_dim: int
  num_heads: int
  mlp_dim: int
  max_len: int = 2048
  vocab_size: int = VOCAB_SIZE


CONFIGS = {
    # Small enough to train on two CPU cores in a couple of minutes.
    "small": TransformerConfig(num_layers=2, emb_dim=128, num_heads=4, mlp_dim=512),
    # Two blocks at the base model's widths: 6.5 M weights, large next to the
    # activations of a small per-replica batch, so that the weight update is a
    # visible part of the step on two CPU cores, as it is at the paper's scale.
    "wide": TransformerConfig(num_layers=2, emb_dim=512, num_heads=8, mlp_dim=2048),
    # The "base" Transformer of the Flax WMT and lm1b examples.
    "base": TransformerConfig(num_layers=6, emb_dim=512, num_heads=8, mlp_dim=2048),
    # 100 tensors of mixed sizes (320 to 411 k elements; the six [1284] MLP
    # biases not divisible by 8), 7.6 M weights: `wus-bench`'s many-small-tensors
    # regime, where batching the collectives of small tensors matters (§5.2).
    "mixed": TransformerConfig(num_layers=6, emb_dim=320, num_heads=5, mlp_dim=1284),
}


class MlpBlock(nn.Module):
  """Feed-forward block: Dense(mlp_dim) -> GELU -> Dense(emb_dim)."""

  config: TransformerConfig

  @nn.compact
  def __call__(self, x):
    x = nn.gelu(nn.Dense(self.config.mlp_dim)(x))
    return nn.Dense(self.config.emb_dim)(x)


class DecoderBlock(nn.Module):
  """Pre-LayerNorm block: causal self-attention then MLP, each residual."""

  config: TransformerConfig

  @nn.compact
  def __call__(self, x, mask):
    attention = nn.MultiHeadDotProductAttention(num_heads=self.config.num_heads)
    x = x + attention(nn.LayerNorm()(x), mask=mask)
    return x + MlpBlock(self.config)(nn.LayerNorm()(x))


class TransformerLM(nn.Module):
  """Causal language model.

  Call with `tokens`: int32 [batch, length], `length <= config.max_len`.
  Returns logits: float32 [batch, length, vocab_size], where position `t`
  predicts token `t + 1` from tokens `0..t`.
  """

  config: TransformerConfig

  @nn.compact
  def __call__(self, tokens):
    cfg = self.config
    embed = nn.Embed(cfg.vocab_size, cfg.emb_dim, embedding_init=nn.initializers.normal(1.0))
    pos = self.param("pos_embedding", nn.initializers.normal(0.02), (cfg.max_len, cfg.emb_dim))
    x = embed(tokens) + pos[: tokens.shape[1]]
    mask = nn.make_causal_mask(tokens)
    for _ in range(cfg.num_layers):
      x = DecoderBlock(cfg)(x, mask)
    # Tied output embedding, scaled as in the lm1b example.
    return embed.attend(nn.LayerNorm()(x)) / jnp.sqrt(cfg.emb_dim)


def init(model: TransformerLM, seed: int):
  """Initial parameters (float32) of `model`, a pure function of integer `seed`."""
  return model.init(jax.random.key(seed), jnp.zeros((1, model.config.max_len), jnp.int32))["params"]
