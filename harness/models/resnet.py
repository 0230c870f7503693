"""ResNets with batch normalization across replicas, after the Flax ImageNet example.

`ResNet` is the model of the Flax ImageNet example (v1.5: the stride of a
bottleneck block is on its 3x3 convolution), with two changes that matter here:

* batch statistics are averaged over the data-parallel mesh axis
  (`nn.BatchNorm(axis_name=...)`) while training, as in MLPerf's ResNet-50, so
  every replica normalizes with the statistics of the global batch and the
  running averages stay identical on all replicas;
* a "small" stem (one 3x3 convolution, stride 1, no max-pooling) for tiny
  images such as the 8x8 handwritten digits, next to the ImageNet stem (7x7
  convolution, stride 2, then 3x3 max-pooling).

Everything is float32 and deterministic.
"""

import dataclasses
import functools
from collections.abc import Sequence

import flax.linen as nn
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class ResNetConfig:
  """Hyperparameters of `ResNet`.

  Attributes:
    stage_sizes: blocks per stage; stage i has `num_filters * 2**i` filters
      and (for i > 0) halves the resolution in its first block.
    bottleneck: bottleneck blocks (1x1, 3x3, 1x1 with 4x expansion, as in
      ResNet-50) instead of basic blocks (two 3x3).
    num_filters: filters of the first stage.
    small_stem: the 3x3, stride-1 stem without pooling, for tiny images.
  """

  stage_sizes: Sequence[int]
  bottleneck: bool
  num_filters: int
  small_stem: bool


CONFIGS = {
    # MLPerf's model: 25.6 M parameters with 1000 classes.
    "resnet50": ResNetConfig(stage_sizes=(3, 4, 6, 3), bottleneck=True, num_filters=64,
                             small_stem=False),
    # Small enough to train on the 8x8 digits on two CPU cores in seconds.
    "resnet_small": ResNetConfig(stage_sizes=(1, 1), bottleneck=False, num_filters=16,
                                 small_stem=True),
}


class BasicBlock(nn.Module):
  """Two 3x3 convolutions with a residual connection (ResNet-18/34)."""

  filters: int
  norm: functools.partial
  strides: tuple[int, int] = (1, 1)

  @nn.compact
  def __call__(self, x):
    conv = functools.partial(nn.Conv, use_bias=False)
    y = nn.relu(self.norm()(conv(self.filters, (3, 3), self.strides)(x)))
    y = self.norm(scale_init=nn.initializers.zeros)(conv(self.filters, (3, 3))(y))
    if x.shape != y.shape:
      x = self.norm(name="norm_proj")(conv(self.filters, (1, 1), self.strides,
                                           name="conv_proj")(x))
    return nn.relu(x + y)


class BottleneckBlock(nn.Module):
  """1x1, 3x3 (strided), 1x1 with 4x expansion, and a residual (ResNet-50 v1.5)."""

  filters: int
  norm: functools.partial
  strides: tuple[int, int] = (1, 1)

  @nn.compact
  def __call__(self, x):
    conv = functools.partial(nn.Conv, use_bias=False)
    y = nn.relu(self.norm()(conv(self.filters, (1, 1))(x)))
    y = nn.relu(self.norm()(conv(self.filters, (3, 3), self.strides)(y)))
    y = self.norm(scale_init=nn.initializers.zeros)(conv(self.filters * 4, (1, 1))(y))
    if x.shape != y.shape:
      x = self.norm(name="norm_proj")(conv(self.filters * 4, (1, 1), self.strides,
                                           name="conv_proj")(x))
    return nn.relu(x + y)


class ResNet(nn.Module):
  """Image classifier.

  Call with `images`: float32 [batch, height, width, channels] and `train`.
  Returns logits: float32 [batch, num_classes]. With `train=True`, batch
  normalization uses the statistics of the batch, averaged over the mesh axis
  `axis_name` (call it inside a `shard_map` over that axis), and updates the
  "batch_stats" collection (pass `mutable=["batch_stats"]`); with
  `train=False` it uses the running averages.
  """

  config: ResNetConfig
  num_classes: int
  axis_name: str = "data"

  @nn.compact
  def __call__(self, images, train: bool):
    cfg = self.config
    norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9,
                             epsilon=1e-5, axis_name=self.axis_name if train else None)
    if cfg.small_stem:
      x = nn.Conv(cfg.num_filters, (3, 3), use_bias=False, name="conv_init")(images)
      x = nn.relu(norm(name="bn_init")(x))
    else:
      x = nn.Conv(cfg.num_filters, (7, 7), (2, 2), padding=[(3, 3), (3, 3)], use_bias=False,
                  name="conv_init")(images)
      x = nn.relu(norm(name="bn_init")(x))
      x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
    block = BottleneckBlock if cfg.bottleneck else BasicBlock
    for i, num_blocks in enumerate(cfg.stage_sizes):
      for j in range(num_blocks):
        strides = (2, 2) if i > 0 and j == 0 else (1, 1)
        x = block(cfg.num_filters * 2**i, norm, strides)(x)
    x = jnp.mean(x, axis=(1, 2))
    return nn.Dense(self.num_classes)(x)
