"""A corpus of real Flax models and training steps, written as published examples write them.

The models are Flax linen layers (`Dense`, `Conv`, `BatchNorm`, `LayerNorm`,
`Embed`, `Dropout`, `MultiHeadDotProductAttention`) and a Flax NNX module
split into state pytrees (`nnx.split` / `nnx.merge`). The steps follow the
Flax examples (google/flax, examples/imagenet/train.py, examples/wmt/train.py,
examples/lm1b/train.py): a `flax.training.train_state.TrainState` argument,
the batch, a dropout key, a metrics dict returned; BatchNorm statistics synced
across replicas, weight decay, dynamic loss scaling with skipped steps,
learning-rate schedules, label smoothing, AdamW with a weight-decay mask.

Every step takes the mapped axis name (`"batch"` under pmap, as the examples
write it; `"data"` for a shard_map mesh) and a `grad_form`:
  * "pmean_grads": `grads = lax.pmean(jax.grad(loss)(params), axis)` (the examples);
  * "pmean_loss": the loss is `lax.pmean(local_loss, axis)` and the gradients
    come straight from `jax.grad` (under `check_vma=True` AD all-reduces them).

Widths are tiny and the batch is 2 examples per replica so that compiles are
fast. No test functions here: `test_corpus.py` runs them.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.training import common_utils
from flax.training import dynamic_scale as dynamic_scale_lib
from flax.training import train_state
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

PER_REPLICA = 2  # Examples per replica and step.


# ---------------------------------------------------------------------------
# Train states (as the examples define them)
# ---------------------------------------------------------------------------


class TrainState(train_state.TrainState):
  """ImageNet's TrainState: BatchNorm statistics and the dynamic loss scale."""
  batch_stats: Any
  dynamic_scale: dynamic_scale_lib.DynamicScale


class WmtTrainState(train_state.TrainState):
  """WMT's TrainState: the dynamic loss scale only."""
  dynamic_scale: dynamic_scale_lib.DynamicScale


# ---------------------------------------------------------------------------
# Linen models
# ---------------------------------------------------------------------------


class MLP(nn.Module):
  """`nn.Dense` layers with biases."""
  features: tuple = (24, 16)
  num_classes: int = 10

  @nn.compact
  def __call__(self, x):
    for f in self.features:
      x = nn.relu(nn.Dense(f)(x))
    return nn.Dense(self.num_classes)(x)


class CNN(nn.Module):
  """A tiny ResNet-like net shaped as examples/imagenet/models.py writes it.

  `bn_axis_name`: the BatchNorm `axis_name` ("batch" in the example): batch
  statistics are `pmean`-ed across replicas inside the layer; None keeps
  them per replica (the step then `pmean`s the new batch_stats itself)."""
  num_classes: int = 10
  num_filters: int = 8
  dtype: Any = jnp.float32
  bn_axis_name: str | None = None

  @nn.compact
  def __call__(self, x, train: bool = True):
    conv = functools.partial(nn.Conv, use_bias=False, dtype=self.dtype)
    norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9,
                             epsilon=1e-5, dtype=self.dtype, axis_name=self.bn_axis_name)
    x = conv(self.num_filters, (3, 3), (2, 2), name="conv_init")(x)
    x = norm(name="bn_init")(x)
    x = nn.relu(x)
    residual = x
    y = conv(self.num_filters, (3, 3))(x)
    y = norm()(y)
    y = nn.relu(y)
    y = conv(self.num_filters, (3, 3))(y)
    y = norm()(y)
    x = nn.relu(residual + y)
    x = jnp.mean(x, axis=(1, 2))
    x = nn.Dense(self.num_classes, dtype=self.dtype)(x)
    x = jnp.asarray(x, self.dtype)
    return x


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """The hyperparameters of examples/wmt/models.py and lm1b/models.py, tiny."""
  vocab_size: int = 32
  emb_dim: int = 16
  num_heads: int = 2
  num_layers: int = 1
  qkv_dim: int = 16
  mlp_dim: int = 32
  max_len: int = 8
  dropout_rate: float = 0.1
  attention_dropout_rate: float = 0.1
  deterministic: bool = False
  dtype: Any = jnp.float32

  def replace(self, **kw):
    return dataclasses.replace(self, **kw)


class MlpBlock(nn.Module):
  config: TransformerConfig

  @nn.compact
  def __call__(self, inputs):
    cfg = self.config
    x = nn.Dense(cfg.mlp_dim, dtype=cfg.dtype)(inputs)
    x = nn.relu(x)
    x = nn.Dropout(rate=cfg.dropout_rate)(x, deterministic=cfg.deterministic)
    x = nn.Dense(inputs.shape[-1], dtype=cfg.dtype)(x)
    return nn.Dropout(rate=cfg.dropout_rate)(x, deterministic=cfg.deterministic)


class AddPositionEmbs(nn.Module):
  """Learned position embeddings (a param added to the token embeddings)."""
  config: TransformerConfig

  @nn.compact
  def __call__(self, inputs):
    pe = self.param("pos_embedding", nn.initializers.normal(stddev=0.02),
                    (1, self.config.max_len, inputs.shape[-1]))
    return inputs + pe[:, :inputs.shape[1], :]


class EncoderBlock(nn.Module):
  config: TransformerConfig

  @nn.compact
  def __call__(self, inputs, mask=None):
    cfg = self.config
    x = nn.LayerNorm(dtype=cfg.dtype)(inputs)
    x = nn.MultiHeadDotProductAttention(
        num_heads=cfg.num_heads, dtype=cfg.dtype, qkv_features=cfg.qkv_dim,
        broadcast_dropout=False, dropout_rate=cfg.attention_dropout_rate,
        deterministic=cfg.deterministic)(x, mask=mask)
    x = nn.Dropout(rate=cfg.dropout_rate)(x, deterministic=cfg.deterministic)
    x = x + inputs
    y = nn.LayerNorm(dtype=cfg.dtype)(x)
    return x + MlpBlock(cfg)(y)


class DecoderBlock(nn.Module):
  """Causal self-attention, cross-attention to the encoder, MLP."""
  config: TransformerConfig

  @nn.compact
  def __call__(self, targets, encoded, decoder_mask=None, encdec_mask=None):
    cfg = self.config
    attention = functools.partial(
        nn.MultiHeadDotProductAttention, num_heads=cfg.num_heads, dtype=cfg.dtype,
        qkv_features=cfg.qkv_dim, broadcast_dropout=False,
        dropout_rate=cfg.attention_dropout_rate, deterministic=cfg.deterministic)
    x = nn.LayerNorm(dtype=cfg.dtype)(targets)
    x = attention()(x, mask=decoder_mask)
    x = nn.Dropout(rate=cfg.dropout_rate)(x, deterministic=cfg.deterministic)
    x = x + targets
    y = nn.LayerNorm(dtype=cfg.dtype)(x)
    y = attention()(y, encoded, mask=encdec_mask)
    y = nn.Dropout(rate=cfg.dropout_rate)(y, deterministic=cfg.deterministic)
    y = y + x
    z = nn.LayerNorm(dtype=cfg.dtype)(y)
    return y + MlpBlock(cfg)(z)


def shift_right(x):
  return jnp.pad(x, ((0, 0), (1, 0)))[:, :-1]


class TransformerLM(nn.Module):
  """Decoder-only LM as lm1b/models.py: shared embedding, causal mask, dropout."""
  config: TransformerConfig

  @nn.compact
  def __call__(self, inputs):
    cfg = self.config
    embed = nn.Embed(cfg.vocab_size, cfg.emb_dim,
                     embedding_init=nn.initializers.normal(stddev=1.0), name="embed")
    decoder_mask = nn.combine_masks(nn.make_attention_mask(inputs > 0, inputs > 0),
                                    nn.make_causal_mask(inputs))
    y = embed(shift_right(inputs).astype("int32"))
    y = AddPositionEmbs(cfg)(y)
    y = nn.Dropout(rate=cfg.dropout_rate)(y, deterministic=cfg.deterministic)
    for _ in range(cfg.num_layers):
      y = EncoderBlock(cfg, name=None)(y, mask=decoder_mask)
    y = nn.LayerNorm(dtype=cfg.dtype, name="decoder_norm")(y)
    logits = embed.attend(y.astype(jnp.float32))
    return logits / jnp.sqrt(y.shape[-1])


class Transformer(nn.Module):
  """Encoder-decoder as wmt/models.py: a shared embedding for both sides."""
  config: TransformerConfig

  @nn.compact
  def __call__(self, inputs, targets):
    cfg = self.config
    embed = nn.Embed(cfg.vocab_size, cfg.emb_dim,
                     embedding_init=nn.initializers.normal(stddev=1.0), name="shared_embedding")
    src_mask = nn.make_attention_mask(inputs > 0, inputs > 0)
    x = AddPositionEmbs(cfg, name="posembed_input")(embed(inputs.astype("int32")))
    x = nn.Dropout(rate=cfg.dropout_rate)(x, deterministic=cfg.deterministic)
    for _ in range(cfg.num_layers):
      x = EncoderBlock(cfg)(x, mask=src_mask)
    encoded = nn.LayerNorm(dtype=cfg.dtype, name="encoder_norm")(x)

    decoder_mask = nn.combine_masks(nn.make_attention_mask(targets > 0, targets > 0),
                                    nn.make_causal_mask(targets))
    encdec_mask = nn.make_attention_mask(targets > 0, inputs > 0)
    y = AddPositionEmbs(cfg, name="posembed_output")(embed(shift_right(targets).astype("int32")))
    y = nn.Dropout(rate=cfg.dropout_rate)(y, deterministic=cfg.deterministic)
    for _ in range(cfg.num_layers):
      y = DecoderBlock(cfg)(y, encoded, decoder_mask=decoder_mask, encdec_mask=encdec_mask)
    y = nn.LayerNorm(dtype=cfg.dtype, name="decoder_norm")(y)
    return nn.Dense(cfg.vocab_size, dtype=cfg.dtype, name="logitdense")(y)


# ---------------------------------------------------------------------------
# Losses and metrics (examples/imagenet, examples/wmt, examples/lm1b)
# ---------------------------------------------------------------------------


def cross_entropy_loss(logits, labels, num_classes):
  one_hot_labels = common_utils.onehot(labels, num_classes=num_classes)
  xentropy = optax.softmax_cross_entropy(logits=logits, labels=one_hot_labels)
  return jnp.mean(xentropy)


def compute_metrics(logits, labels, num_classes, axis):
  loss = cross_entropy_loss(logits, labels, num_classes)
  accuracy = jnp.mean(jnp.argmax(logits, -1) == labels)
  metrics = {"loss": loss, "accuracy": accuracy}
  return lax.pmean(metrics, axis_name=axis)


def compute_weighted_cross_entropy(logits, targets, weights=None, label_smoothing=0.0):
  vocab_size = logits.shape[-1]
  confidence = 1.0 - label_smoothing
  low_confidence = (1.0 - confidence) / (vocab_size - 1)
  normalizing_constant = -(confidence * jnp.log(confidence)
                           + (vocab_size - 1) * low_confidence * jnp.log(low_confidence + 1e-20))
  soft_targets = common_utils.onehot(targets, vocab_size, on_value=confidence,
                                     off_value=low_confidence)
  loss = -jnp.sum(soft_targets * nn.log_softmax(logits), axis=-1)
  loss = loss - normalizing_constant
  normalizing_factor = np.prod(targets.shape)
  if weights is not None:
    loss = loss * weights
    normalizing_factor = weights.sum()
  return loss.sum(), normalizing_factor


def compute_weighted_accuracy(logits, targets, weights=None):
  loss = jnp.equal(jnp.argmax(logits, axis=-1), targets)
  normalizing_factor = np.prod(logits.shape[:-1])
  if weights is not None:
    loss = loss * weights
    normalizing_factor = weights.sum()
  return loss.sum(), normalizing_factor


def compute_weighted_metrics(logits, labels, weights, axis, label_smoothing=0.0):
  loss, weight_sum = compute_weighted_cross_entropy(logits, labels, weights, label_smoothing)
  acc, _ = compute_weighted_accuracy(logits, labels, weights)
  metrics = {"loss": loss, "accuracy": acc, "denominator": weight_sum}
  return lax.psum(metrics, axis_name=axis)


# ---------------------------------------------------------------------------
# Schedules
# ---------------------------------------------------------------------------


def imagenet_learning_rate_fn(base_learning_rate=0.1, warmup_steps=2, decay_steps=10):
  """Linear warmup then cosine decay, joined (examples/imagenet)."""
  warmup_fn = optax.linear_schedule(init_value=0., end_value=base_learning_rate,
                                    transition_steps=warmup_steps)
  cosine_fn = optax.cosine_decay_schedule(init_value=base_learning_rate, decay_steps=decay_steps)
  return optax.join_schedules(schedules=[warmup_fn, cosine_fn], boundaries=[warmup_steps])


def rsqrt_schedule(init_value: float, shift: int = 0):
  def schedule(count):
    return init_value * (count + shift) ** -0.5 * shift ** 0.5
  return schedule


def create_learning_rate_schedule(learning_rate: float, warmup_steps: int):
  """Linear warmup then reverse square root (examples/wmt, examples/lm1b)."""
  return optax.join_schedules(
      [optax.linear_schedule(init_value=0, end_value=learning_rate, transition_steps=warmup_steps),
       rsqrt_schedule(init_value=learning_rate, shift=warmup_steps)],
      boundaries=[warmup_steps])


def decay_mask(params):
  """The usual AdamW weight-decay mask: kernels and embeddings, not biases and norm scales."""
  return jax.tree_util.tree_map(lambda x: x.ndim > 1, params)


# ---------------------------------------------------------------------------
# Train steps
# ---------------------------------------------------------------------------


def imagenet_train_step(state, batch, learning_rate_fn, *, axis="batch", grad_form="pmean_grads",
                        sync_batch_stats=False, num_classes=10):
  """examples/imagenet/train.py's train_step.

  `sync_batch_stats`: the model's BatchNorm has no axis_name, so the step
  `pmean`s the new batch statistics across replicas itself."""
  def loss_fn(params):
    logits, new_model_state = state.apply_fn(
        {"params": params, "batch_stats": state.batch_stats}, batch["image"],
        mutable=["batch_stats"])
    loss = cross_entropy_loss(logits, batch["label"], num_classes)
    weight_penalty_params = jax.tree_util.tree_leaves(params)
    weight_decay = 0.0001
    weight_l2 = sum(jnp.sum(x ** 2) for x in weight_penalty_params if x.ndim > 1)
    weight_penalty = weight_decay * 0.5 * weight_l2
    loss = loss + weight_penalty
    if grad_form == "pmean_loss":
      loss = lax.pmean(loss, axis_name=axis)
    return loss, (new_model_state, logits)

  step = state.step
  dynamic_scale = state.dynamic_scale
  lr = learning_rate_fn(step)

  if dynamic_scale:
    grad_fn = dynamic_scale.value_and_grad(
        loss_fn, has_aux=True, axis_name=axis if grad_form == "pmean_grads" else None)
    dynamic_scale, is_fin, aux, grads = grad_fn(state.params)
    # dynamic loss takes care of averaging gradients across replicas
  else:
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    aux, grads = grad_fn(state.params)
    if grad_form == "pmean_grads":
      grads = lax.pmean(grads, axis_name=axis)
  new_model_state, logits = aux[1]
  metrics = compute_metrics(logits, batch["label"], num_classes, axis)
  metrics["learning_rate"] = lr

  batch_stats = new_model_state["batch_stats"]
  if sync_batch_stats:
    batch_stats = lax.pmean(batch_stats, axis_name=axis)
  new_state = state.apply_gradients(grads=grads, batch_stats=batch_stats)
  if dynamic_scale:
    # if is_fin == False the gradients contain Inf/NaNs and optimizer state and
    # params should be restored (= skip this step).
    new_state = new_state.replace(
        opt_state=jax.tree_util.tree_map(functools.partial(jnp.where, is_fin),
                                         new_state.opt_state, state.opt_state),
        params=jax.tree_util.tree_map(functools.partial(jnp.where, is_fin),
                                      new_state.params, state.params),
        dynamic_scale=dynamic_scale)
    metrics["scale"] = dynamic_scale.scale
  return new_state, metrics


def wmt_train_step(state, batch, config, learning_rate_fn, label_smoothing=0.0, dropout_rng=None,
                   *, axis="batch", grad_form="pmean_grads", fold_in_replica=False):
  """examples/wmt/train.py's train_step (`fold_in_replica`: fold the replica
  index into the dropout key, for a shard_map step that gets one key)."""
  inputs, targets = batch["inputs"], batch["targets"]
  weights = jnp.where(targets > 0, 1, 0).astype(jnp.float32)
  if fold_in_replica:
    dropout_rng = jax.random.fold_in(dropout_rng, lax.axis_index(axis))
  dropout_rng = jax.random.fold_in(dropout_rng, state.step)

  def loss_fn(params):
    logits = Transformer(config).apply({"params": params}, inputs, targets,
                                       rngs={"dropout": dropout_rng})
    loss, weight_sum = compute_weighted_cross_entropy(logits, targets, weights, label_smoothing)
    mean_loss = loss / weight_sum
    if grad_form == "pmean_loss":
      mean_loss = lax.pmean(mean_loss, axis_name=axis)
    return mean_loss, logits

  step = state.step
  if state.dynamic_scale:
    grad_fn = state.dynamic_scale.value_and_grad(
        loss_fn, has_aux=True, axis_name=axis if grad_form == "pmean_grads" else None)
    dynamic_scale, is_fin, (_, logits), grads = grad_fn(state.params)
    state = state.replace(dynamic_scale=dynamic_scale)
  else:
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    (_, logits), grads = grad_fn(state.params)
    if grad_form == "pmean_grads":
      grads = jax.lax.pmean(grads, axis_name=axis)

  new_state = state.apply_gradients(grads=grads)
  metrics = compute_weighted_metrics(logits, targets, weights, axis)
  metrics["learning_rate"] = learning_rate_fn(step)

  if state.dynamic_scale:
    select_fn = functools.partial(jnp.where, is_fin)
    new_state = new_state.replace(
        opt_state=jax.tree_util.tree_map(select_fn, new_state.opt_state, state.opt_state),
        params=jax.tree_util.tree_map(select_fn, new_state.params, state.params))
    metrics["loss_scale"] = dynamic_scale.scale * metrics["denominator"]
  return new_state, metrics


def lm1b_train_step(state, batch, config, learning_rate_fn, label_smoothing=0.0, dropout_rng=None,
                    *, axis="batch", grad_form="pmean_grads", fold_in_replica=False):
  """examples/lm1b/train.py's train_step."""
  inputs = batch["inputs"]
  weights = jnp.where(inputs > 0, 1, 0).astype(jnp.float32)
  if fold_in_replica:
    dropout_rng = jax.random.fold_in(dropout_rng, lax.axis_index(axis))
  dropout_rng = jax.random.fold_in(dropout_rng, state.step)

  def loss_fn(params):
    logits = TransformerLM(config).apply({"params": params}, inputs, rngs={"dropout": dropout_rng})
    loss, weight_sum = compute_weighted_cross_entropy(logits, inputs, weights, label_smoothing)
    mean_loss = loss / weight_sum
    if grad_form == "pmean_loss":
      mean_loss = lax.pmean(mean_loss, axis_name=axis)
    return mean_loss, logits

  step = state.step
  lr = learning_rate_fn(step)
  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
  (_, logits), grads = grad_fn(state.params)
  if grad_form == "pmean_grads":
    grads = jax.lax.pmean(grads, axis)
  new_state = state.apply_gradients(grads=grads)
  metrics = compute_weighted_metrics(logits, inputs, weights, axis)
  metrics["learning_rate"] = lr
  return new_state, metrics


def mlp_train_step(state, batch, dropout_rng, *, axis="batch", grad_form="pmean_grads"):
  """The smallest TrainState step: an MLP of `nn.Dense` layers (dropout_rng unused)."""
  del dropout_rng

  def loss_fn(params):
    logits = state.apply_fn({"params": params}, batch["x"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
    if grad_form == "pmean_loss":
      loss = lax.pmean(loss, axis_name=axis)
    return loss, logits

  (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  if grad_form == "pmean_grads":
    grads = lax.pmean(grads, axis_name=axis)
  new_state = state.apply_gradients(grads=grads)
  return new_state, compute_metrics(logits, batch["label"], 10, axis)


# ---------------------------------------------------------------------------
# Flax NNX: a module split into state pytrees for the step
# ---------------------------------------------------------------------------


class NNXNet(nnx.Module):
  """nnx.Linear, nnx.BatchNorm (synced over `axis_name`), nnx.Dropout, nnx.LayerNorm."""

  def __init__(self, din, dmid, dout, *, axis_name, rngs: nnx.Rngs):
    self.linear1 = nnx.Linear(din, dmid, rngs=rngs)
    self.bn = nnx.BatchNorm(dmid, momentum=0.9, axis_name=axis_name, rngs=rngs)
    self.dropout = nnx.Dropout(0.1)
    self.norm = nnx.LayerNorm(dmid, rngs=rngs)
    self.linear2 = nnx.Linear(dmid, dout, rngs=rngs)

  def __call__(self, x, *, rngs=None):
    x = nnx.relu(self.bn(self.linear1(x)))
    x = self.dropout(x, rngs=rngs)
    return self.linear2(self.norm(x))


def nnx_model(axis_name):
  return NNXNet(12, 24, 10, axis_name=axis_name, rngs=nnx.Rngs(0))


def nnx_train_step(graphdef, tx, params, batch_stats, opt_state, batch, dropout_rng, *,
                   axis="batch", grad_form="pmean_grads"):
  """(params, batch_stats, opt_state, batch, rng) -> (params, batch_stats, opt_state, metrics)."""
  dropout_rng = jax.random.fold_in(dropout_rng, lax.axis_index(axis))

  def loss_fn(params):
    model = nnx.merge(graphdef, params, batch_stats, copy=True)
    logits = model(batch["x"], rngs=dropout_rng)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
    if grad_form == "pmean_loss":
      loss = lax.pmean(loss, axis_name=axis)
    _, _, new_batch_stats = nnx.split(model, nnx.Param, nnx.BatchStat)
    return loss, (new_batch_stats, logits)

  (loss, (new_batch_stats, logits)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
  if grad_form == "pmean_grads":
    grads = lax.pmean(grads, axis_name=axis)
  updates, opt_state = tx.update(grads, opt_state, params)
  params = optax.apply_updates(params, updates)
  return params, new_batch_stats, opt_state, compute_metrics(logits, batch["label"], 10, axis)


# ---------------------------------------------------------------------------
# Cases: a model, its optimizer, its step, its state and its data
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
  """One corpus entry.

  `make_step(axis, grad_form, shard_map)` returns the per-replica step;
  `init(axis)` the state arguments for a step over `axis` (fresh each
  call: steps may donate them);
  `inputs(num_replicas, i)` the other arguments of step i as whole (global)
  arrays, the batch first; `input_specs` their shard_map in_specs;
  `opt_state(state_args)` picks the optimizer state out of the state
  arguments; `rtol` is nonzero only where the optimizer itself reduces
  across tensors (global-norm clipping), which changes summation order."""
  name: str
  make_step: Callable[..., Callable]
  init: Callable[[str], tuple]
  inputs: Callable[[int, int], tuple]
  input_specs: tuple
  opt_state: Callable[[tuple], Any]
  rtol: float = 0.0


def _image_batch(num_replicas, i, size=8, dtype=np.float32):
  rng = np.random.default_rng(1000 + i)
  b = num_replicas * PER_REPLICA
  return {"image": rng.normal(size=(b, size, size, 3)).astype(dtype),
          "label": rng.integers(0, 10, size=(b,)).astype(np.int32)}


def _token_batch(num_replicas, i, keys=("inputs",), length=8, vocab=32):
  rng = np.random.default_rng(2000 + i)
  b = num_replicas * PER_REPLICA
  out = {}
  for k in keys:
    toks = rng.integers(1, vocab, size=(b, length)).astype(np.int32)
    lengths = rng.integers(length // 2, length + 1, size=(b,))
    toks[np.arange(length)[None, :] >= lengths[:, None]] = 0  # Padding: weights 0.
    out[k] = toks
  return out


def _dense_batch(num_replicas, i, din=12):
  rng = np.random.default_rng(3000 + i)
  b = num_replicas * PER_REPLICA
  return {"x": rng.normal(size=(b, din)).astype(np.float32),
          "label": rng.integers(0, 10, size=(b,)).astype(np.int32)}


def _key(i):
  return jax.random.key(10 + i)


def mlp_case(tx_name="adam"):
  """An MLP of `nn.Dense` layers with biases, TrainState; Adam, or
  `clip_by_global_norm` then AdamW with a weight-decay mask and a schedule
  (the global norm reduces over every gradient: tolerance)."""
  model = MLP()
  # One optimizer object, so that the TrainState static fields of every state compare equal.
  tx = {"adam": lambda: optax.adam(1e-2),
        "clip_adamw": lambda: optax.chain(
            optax.clip_by_global_norm(0.05),
            optax.adamw(create_learning_rate_schedule(0.05, 2), b1=0.9, b2=0.98, eps=1e-9,
                        weight_decay=0.1, mask=decay_mask))}[tx_name]()

  def init(axis):
    params = model.init(jax.random.key(0), jnp.ones((1, 12)))["params"]
    return (train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx),)

  return Case(
      name=f"mlp_{tx_name}",
      make_step=lambda axis, grad_form, shard_map: functools.partial(
          mlp_train_step, axis=axis, grad_form=grad_form),
      init=init,
      inputs=lambda n, i: (_dense_batch(n, i), _key(i)),
      input_specs=(P("data"), P()),
      opt_state=lambda s: s[0].opt_state,
      rtol=1e-6 if tx_name == "clip_adamw" else 0.0)


def imagenet_case(*, bn="axis_name", half_precision=False, dynamic_scale=False):
  """ResNet-like CNN + SGD Nesterov momentum with a warmup-cosine schedule,
  L2 weight decay in the loss, BatchNorm stats synced (by the layer's
  axis_name as the example's models.py does, or by an explicit `lax.pmean`
  of the new batch_stats); with `dynamic_scale` a float16 model and flax's
  DynamicScale skipping the non-finite step (the initial scale 2**17 makes
  the float16 backward pass of step 1 overflow, so that step is skipped)."""
  learning_rate_fn = imagenet_learning_rate_fn()
  tx = optax.sgd(learning_rate=learning_rate_fn, momentum=0.9, nesterov=True)
  dtype = jnp.float16 if half_precision else jnp.float32

  @functools.cache
  def model_for(axis):
    # The example builds the model with BatchNorm(axis_name="batch"), its pmap
    # axis; a shard_map step names its mesh axis ("data").
    return CNN(dtype=dtype, bn_axis_name=axis if bn == "axis_name" else None)

  @functools.cache
  def variables_for(axis):
    return jax.jit(model_for(axis).init)({"params": jax.random.key(0)},
                                         jnp.ones((1, 8, 8, 3), dtype))

  def init(axis):
    model = model_for(axis)
    variables = variables_for(axis)
    ds = dynamic_scale_lib.DynamicScale(scale=2.0 ** 17) if dynamic_scale else None
    return (TrainState.create(apply_fn=model.apply, params=variables["params"], tx=tx,
                              batch_stats=variables["batch_stats"], dynamic_scale=ds),)

  def make_step(axis, grad_form, shard_map):
    return functools.partial(imagenet_train_step, learning_rate_fn=learning_rate_fn, axis=axis,
                             grad_form=grad_form, sync_batch_stats=(bn == "pmean"))

  name = ("imagenet" + ("_fp16_dynscale" if dynamic_scale else "")
          + ("_bnpmean" if bn == "pmean" else ""))
  return Case(
      name=name, make_step=make_step, init=init,
      inputs=lambda n, i: (_image_batch(n, i),),
      input_specs=(P("data"),),
      opt_state=lambda s: s[0].opt_state)


# Each dropout site costs about a second of XLA compile time on CPU (its
# threefry bits), so the corpus keeps a few: LM1B drops activations (not
# attention weights), WMT drops attention weights (not activations).
LM1B_CONFIG = TransformerConfig(dropout_rate=0.1, attention_dropout_rate=0.0)
WMT_CONFIG = TransformerConfig(dropout_rate=0.0, attention_dropout_rate=0.1)


def wmt_case():
  """Encoder-decoder Transformer + AdamW (weight-decay mask) with warmup-rsqrt
  schedule, label smoothing 0.1, dropout."""
  learning_rate_fn = create_learning_rate_schedule(learning_rate=0.05, warmup_steps=2)
  tx = optax.adamw(learning_rate=learning_rate_fn, b1=0.9, b2=0.98, eps=1e-9,
                   weight_decay=0.1, mask=decay_mask)
  config = WMT_CONFIG
  eval_config = config.replace(deterministic=True)
  apply_fn = Transformer(eval_config).apply

  @functools.cache
  def variables():
    return jax.jit(Transformer(eval_config).init)(
        jax.random.key(0), jnp.ones((PER_REPLICA, config.max_len), jnp.float32),
        jnp.ones((PER_REPLICA, config.max_len), jnp.float32))

  def init(axis):
    return (WmtTrainState.create(apply_fn=apply_fn, params=variables()["params"], tx=tx,
                                 dynamic_scale=None),)

  def make_step(axis, grad_form, shard_map):
    p_step = functools.partial(wmt_train_step, config=config, learning_rate_fn=learning_rate_fn,
                               label_smoothing=0.1, axis=axis, grad_form=grad_form,
                               fold_in_replica=shard_map)
    return _rng_by_position(p_step, shard_map)

  return Case(
      name="wmt", make_step=make_step, init=init,
      inputs=lambda n, i: (_token_batch(n, i, keys=("inputs", "targets")), _key(i)),
      input_specs=(P("data"), P()),
      opt_state=lambda s: s[0].opt_state)


def _rng_by_position(p_step, shard_map: bool):
  """A Flax example's step as the example calls it (`p_train_step(state, batch,
  dropout_rng=...)`), or for shard_map, which passes arguments by position, with the
  key third."""
  if not shard_map:
    return p_step

  def train_step(state, batch, dropout_rng):
    return p_step(state, batch, dropout_rng=dropout_rng)
  return train_step


def lm1b_case():
  """Decoder-only Transformer LM + AdamW (b2=0.98, eps=1e-9) with warmup-rsqrt schedule, dropout."""
  learning_rate_fn = create_learning_rate_schedule(learning_rate=0.05, warmup_steps=2)
  tx = optax.adamw(learning_rate_fn, b1=0.9, b2=0.98, eps=1e-9, weight_decay=0.1)
  config = LM1B_CONFIG
  eval_config = config.replace(deterministic=True)
  apply_fn = TransformerLM(eval_config).apply

  @functools.cache
  def variables():
    return jax.jit(TransformerLM(eval_config).init)(
        jax.random.PRNGKey(0), jnp.ones((PER_REPLICA, config.max_len), jnp.float32))

  def init(axis):
    return (train_state.TrainState.create(apply_fn=apply_fn, params=variables()["params"], tx=tx),)

  def make_step(axis, grad_form, shard_map):
    p_step = functools.partial(lm1b_train_step, config=config, learning_rate_fn=learning_rate_fn,
                               axis=axis, grad_form=grad_form, fold_in_replica=shard_map)
    return _rng_by_position(p_step, shard_map)

  return Case(
      name="lm1b", make_step=make_step, init=init,
      # lm1b makes its keys with jax.random.PRNGKey (raw uint32[2]).
      inputs=lambda n, i: (_token_batch(n, i), jax.random.PRNGKey(10 + i)),
      input_specs=(P("data"), P()),
      opt_state=lambda s: s[0].opt_state)


def nnx_case():
  """An NNX module split into (params, batch_stats) for a functional step, Adam."""
  tx = optax.adam(1e-2)
  graphdefs: dict = {}

  def graphdef_for(axis):
    if axis not in graphdefs:
      graphdefs[axis] = nnx.split(nnx_model(axis), nnx.Param, nnx.BatchStat)[0]
    return graphdefs[axis]

  def init(axis):
    _, params, batch_stats = nnx.split(nnx_model(axis), nnx.Param, nnx.BatchStat)
    return params, batch_stats, tx.init(params)

  def make_step(axis, grad_form, shard_map):
    return functools.partial(nnx_train_step, graphdef_for(axis), tx, axis=axis, grad_form=grad_form)

  return Case(
      name="nnx", make_step=make_step, init=init,
      inputs=lambda n, i: (_dense_batch(n, i), _key(i)),
      input_specs=(P("data"), P()),
      opt_state=lambda s: s[2])


CASES: dict[str, Callable[[], Case]] = {
    "mlp_adam": lambda: mlp_case("adam"),
    "mlp_clip_adamw": lambda: mlp_case("clip_adamw"),
    "imagenet": lambda: imagenet_case(),
    "imagenet_bnpmean": lambda: imagenet_case(bn="pmean"),
    "imagenet_fp16_dynscale": lambda: imagenet_case(half_precision=True, dynamic_scale=True),
    "wmt": lambda: wmt_case(),
    "lm1b": lambda: lm1b_case(),
    "nnx": lambda: nnx_case(),
}


@functools.cache
def case(name: str) -> Case:
  return CASES[name]()


# ---------------------------------------------------------------------------
# Placing inputs
# ---------------------------------------------------------------------------


def place(mesh, inputs: tuple, specs: tuple) -> tuple:
  """Puts each input on the mesh with its in_spec (JAX 0.10 refuses unplaced P("data") arrays)."""
  return tuple(jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, spec)), a)
               for a, spec in zip(inputs, specs, strict=True))


def per_device(x, n):
  """[n * b, ...] -> [n, b, ...], as `flax.training.common_utils.shard` does."""
  return x.reshape((n, -1) + x.shape[1:])


def sharded_expectation(opt_state, n, *, stacked=False):
  """Paths of the optimizer-state leaves that should be sharded: every float
  tensor with more than n elements per replica (moments, momentum traces; a
  tensor of n elements or fewer stays whole)."""
  out = []
  for path, x in jax.tree_util.tree_flatten_with_path(opt_state)[0]:
    shape = np.shape(x)[1:] if stacked else np.shape(x)
    if jnp.issubdtype(jnp.result_type(x), jnp.floating) and int(np.prod(shape)) > n:
      out.append(jax.tree_util.keystr(path))
  return out
