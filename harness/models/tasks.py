"""The models `wus-train` trains, each with its loss, metrics and kind of data.

A task is a Flax module together with what the training loop needs from it:
its initial variables, the per-replica training loss (with the updated
non-trained state, such as batch-norm running averages, and metrics), and
per-replica sums for held-out evaluation. Batches are dicts of arrays:

* image classifiers read {"image": float32 [batch, height, width, channels],
  "label": int32 [batch]};
* language models read {"tokens": int32 [batch, seq_len + 1]}: the model sees
  the first `seq_len` tokens and predicts the last `seq_len`.

Evaluation batches also hold "weight": float32 [batch], 1 for a real example
and 0 for padding, so that a held-out set of any size is summed exactly.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from wus.harness.models import mlp, resnet, transformer, transformer_tp

IMAGES, TEXT = "images", "text"
# Model name -> (kind of data, config). The transformers are byte-level LMs.
MODELS = {
    "resnet50": (IMAGES, resnet.CONFIGS["resnet50"]),
    "resnet_small": (IMAGES, resnet.CONFIGS["resnet_small"]),
    "transformer_base": (TEXT, transformer.CONFIGS["base"]),
    "transformer_small": (TEXT, transformer.CONFIGS["small"]),
    "transformer_wide": (TEXT, transformer.CONFIGS["wide"]),
    "transformer_mixed": (TEXT, transformer.CONFIGS["mixed"]),
    "mlp_large": (IMAGES, mlp.CONFIGS["large"]),
    "mlp_small": (IMAGES, mlp.CONFIGS["small"]),
    "mlp_deep": (IMAGES, mlp.CONFIGS["deep"]),
}


class Task(abc.ABC):
  """A model, its loss and metrics. Methods are per replica, inside a shard_map."""

  name: str
  module: nn.Module

  @abc.abstractmethod
  def init(self, seed: int, batch: dict) -> tuple[Any, Any]:
    """(params, model_state): float32 variables, a pure function of `seed`.

    `batch` is an example batch (only its shapes are used); `model_state` is
    every non-trained collection (e.g. {"batch_stats": ...}), possibly {}.
    """

  @abc.abstractmethod
  def loss(self, params, model_state, batch: dict) -> tuple[jax.Array, tuple[Any, dict]]:
    """Training loss of this replica's batch.

    Returns:
      (loss, (model_state, metrics)): float32 scalar mean cross-entropy in
      nats; the updated model state; {"loss", "accuracy"} float32 scalars,
      means over this replica's examples (or predicted tokens).
    """

  @abc.abstractmethod
  def eval_sums(self, params, model_state, batch: dict) -> dict[str, jax.Array]:
    """Weighted sums over this replica's evaluation batch.

    Returns:
      {"loss": sum of cross-entropy in nats, "correct": number of correct
      predictions, "count": number of predictions}, float32 scalars, padding
      (weight 0) excluded.
    """

  def identity(self) -> dict:
    """What a checkpoint must match to be restored into this task (JSON-ready)."""
    return {"model": self.name, "config": dataclasses.asdict(self.module.config)}

  def param_specs(self, params) -> Any:
    """PartitionSpec of each weight over the mesh: whole (P()) on every device."""
    return jax.tree.map(lambda _: P(), params)


class ImageClassifier(Task):
  """A ResNet (batch norm averaged over `axis_name`) or an MLP on {"image", "label"} batches."""

  def __init__(self, name: str, config: resnet.ResNetConfig | mlp.MLPConfig, num_classes: int,
               axis_name: str):
    self.name = name
    self.module = (mlp.MLP(config, num_classes) if isinstance(config, mlp.MLPConfig)
                   else resnet.ResNet(config, num_classes, axis_name))

  def identity(self):
    return {**super().identity(), "num_classes": self.module.num_classes}

  def init(self, seed, batch):
    variables = dict(self.module.init(jax.random.key(seed), batch["image"][:1], train=False))
    return variables.pop("params"), variables

  def loss(self, params, model_state, batch):
    logits, model_state = self.module.apply({"params": params, **model_state}, batch["image"],
                                            train=True, mutable=["batch_stats"])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
    accuracy = jnp.mean(jnp.argmax(logits, -1) == batch["label"])
    return losses.mean(), (model_state, {"loss": losses.mean(), "accuracy": accuracy})

  def eval_sums(self, params, model_state, batch):
    logits = self.module.apply({"params": params, **model_state}, batch["image"], train=False)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
    correct = jnp.argmax(logits, -1) == batch["label"]
    w = batch["weight"]
    return {"loss": jnp.sum(w * losses), "correct": jnp.sum(w * correct), "count": jnp.sum(w)}


class LanguageModel(Task):
  """A byte-level causal Transformer LM on {"tokens"} batches."""

  def __init__(self, name: str, config: transformer.TransformerConfig, seq_len: int):
    self.name = name
    self.module = transformer.TransformerLM(dataclasses.replace(config, max_len=seq_len))

  def init(self, seed, batch):
    return transformer.init(self.module, seed), {}

  def _losses(self, params, tokens):
    """Per-token cross-entropy and correctness, both [batch, seq_len]."""
    logits = self.module.apply({"params": params}, tokens[:, :-1])
    targets = tokens[:, 1:]
    return (optax.softmax_cross_entropy_with_integer_labels(logits, targets),
            jnp.argmax(logits, -1) == targets)

  def loss(self, params, model_state, batch):
    losses, correct = self._losses(params, batch["tokens"])
    return losses.mean(), (model_state, {"loss": losses.mean(), "accuracy": correct.mean()})

  def eval_sums(self, params, model_state, batch):
    losses, correct = self._losses(params, batch["tokens"])
    w = batch["weight"][:, None]
    return {"loss": jnp.sum(w * losses), "correct": jnp.sum(w * correct),
            "count": jnp.sum(w * jnp.ones_like(losses))}


class TensorParallelLM(LanguageModel):
  """`LanguageModel` with Megatron-style tensor parallelism over `transformer_tp.MODEL_AXIS`.

  Same weights, initialization and losses. With `manual` (a shard_map step),
  `loss` and `eval_sums` run per device of a ("data", "model") mesh on the
  blocks `param_specs` gives (`transformer_tp`), and their results are the
  same on every model rank; without (a `jax.jit` step on global arrays), they
  are `LanguageModel`'s and only `param_specs` says where the weights lie.
  """

  def __init__(self, name: str, config: transformer.TransformerConfig, seq_len: int,
               model_parallel: int, manual: bool = True):
    super().__init__(name, config, seq_len)
    self.model_parallel, self.manual = model_parallel, manual

  def identity(self):
    return {**super().identity(), "model_parallel": self.model_parallel}

  def _losses(self, params, tokens):
    if not self.manual:
      return super()._losses(params, tokens)
    logits = transformer_tp.forward(self.module.config, params, tokens[:, :-1])
    targets = tokens[:, 1:]
    return (optax.softmax_cross_entropy_with_integer_labels(logits, targets),
            jnp.argmax(logits, -1) == targets)

  def param_specs(self, params):
    return transformer_tp.param_specs(params)


def make(name: str, *, num_classes: int, seq_len: int, axis_name: str,
         model_parallel: int = 1, manual: bool = True) -> Task:
  """The task for model `name` (a key of MODELS).

  Args:
    name: model name.
    num_classes: classes of an image classifier (ignored for text).
    seq_len: tokens a language model reads per example (ignored for images).
    axis_name: the data-parallel mesh axis batch norm averages over.
    model_parallel: above 1, a Transformer split Megatron-style over that many
      devices of the mesh axis "model" (`TensorParallelLM`).
    manual: with model_parallel > 1: the losses for a shard_map step (True) or
      for a `jax.jit` step on global arrays (False).

  Raises:
    ValueError: model_parallel > 1 for a model that is not a Transformer, or
      one whose heads or MLP width it does not divide.
  """
  kind, config = MODELS[name]
  if model_parallel > 1:
    why = ("it is not a Transformer" if kind != TEXT
           else transformer_tp.check_divisible(config, model_parallel))
    if why:
      raise ValueError(f"{name} cannot be split over {model_parallel} devices: {why}")
    return TensorParallelLM(name, config, seq_len, model_parallel, manual)
  if kind == IMAGES:
    return ImageClassifier(name, config, num_classes, axis_name)
  return LanguageModel(name, config, seq_len)
