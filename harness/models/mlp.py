"""A multilayer perceptron image classifier: large weights, little compute per example.

The weight-update-bound case of the memory report and the benchmark (issue 5):
its weights are a few large matrices, so at a small per-replica batch the
optimizer's pass over weights and state costs as much as the forward and
backward passes, the regime where sharding the update pays most (§2.2).
"""

import dataclasses
from collections.abc import Sequence

import flax.linen as nn
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class MLPConfig:
  """Hyperparameters of `MLP`.

  Attributes:
    hidden: the width of each hidden layer (ReLU); the input is the flattened
      image and the output the class logits.
  """

  hidden: Sequence[int]


CONFIGS = {
    # 3 x 4096 on 32x32x3 images: 46 M parameters (184 MB in float32).
    "large": MLPConfig(hidden=(4096, 4096, 4096)),
    # 5 x 1024: 12 tensors, 7.3 M parameters on 32x32x3 images: `wus-bench`'s
    # weight-update-bound regime at a size that times in minutes.
    "deep": MLPConfig(hidden=(1024,) * 5),
    # 2 x 1024: 4.2 M parameters on 32x32x3 images; trains on two CPU cores.
    "small": MLPConfig(hidden=(1024, 1024)),
}


class MLP(nn.Module):
  """Image classifier: images float32 [batch, height, width, channels] -> logits
  float32 [batch, num_classes]. `train` is accepted for the ResNet's signature
  and changes nothing."""

  config: MLPConfig
  num_classes: int

  @nn.compact
  def __call__(self, images, train: bool = False):
    x = jnp.reshape(images, (images.shape[0], -1))
    for width in self.config.hidden:
      x = nn.relu(nn.Dense(width)(x))
    return nn.Dense(self.num_classes)(x)
