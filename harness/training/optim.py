"""MLPerf-style optimizers, from optax: LARS for ResNet, Adam for the Transformer.

References:
  You, Gitman, Ginsburg. Large Batch Training of Convolutional Networks
  (LARS), arXiv:1708.03888 (2017); MLPerf Training ResNet-50 reference rules
  (linear warmup, polynomial decay of power 2, no weight decay or trust ratio
  on batch-norm parameters and biases).
  Vaswani et al. Attention Is All You Need, arXiv:1706.03762 (2017), §5.3:
  linear warmup, then decay with the inverse square root of the step.
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

OPTIMIZERS = ("lars", "adam")


def lars_schedule(peak: float, warmup_steps: int, total_steps: int,
                  end_value: float = 0.0, power: float = 2.0) -> optax.Schedule:
  """Linear warmup from 0 to `peak`, then polynomial decay to `end_value` at `total_steps`."""
  return optax.join_schedules(
      [optax.linear_schedule(0.0, peak, warmup_steps),
       optax.polynomial_schedule(peak, end_value, power, max(total_steps - warmup_steps, 1))],
      [warmup_steps])


def rsqrt_schedule(peak: float, warmup_steps: int) -> optax.Schedule:
  """Linear warmup from 0 to `peak`, then `peak * sqrt(warmup_steps / step)`."""
  warmup = max(warmup_steps, 1)
  return optax.join_schedules(
      [optax.linear_schedule(0.0, peak, warmup),
       # join_schedules also evaluates this before the boundary (count < 0).
       lambda count: peak * jnp.sqrt(warmup / jnp.maximum(count + warmup, warmup))],
      [warmup])


def _is_matrix(params):
  """Mask of the leaves with more than one dim: weights, not biases or batch-norm scales."""
  return jax.tree.map(lambda p: p.ndim > 1, params)


def lars(*, learning_rate: float, warmup_steps: int, total_steps: int, weight_decay: float,
         momentum: float) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """LARS with warmup and polynomial decay; biases and batch-norm parameters skip
  weight decay and the trust ratio, as in MLPerf.

  Args:
    learning_rate: peak learning rate (the trust ratio scales it per layer).
    warmup_steps: steps of linear warmup.
    total_steps: the step at which the rate reaches 0.
    weight_decay: L2 coefficient on weight matrices and kernels.
    momentum: heavy-ball momentum.

  Returns:
    (optimizer, schedule): the schedule maps an update count to its rate.
  """
  schedule = lars_schedule(learning_rate, warmup_steps, total_steps)
  tx = optax.lars(schedule, weight_decay=weight_decay, weight_decay_mask=_is_matrix,
                  trust_ratio_mask=_is_matrix, momentum=momentum)
  return tx, schedule


def adam(*, learning_rate: float, warmup_steps: int, b1: float, b2: float,
         eps: float) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """Adam with warmup and inverse-square-root decay (Transformer, §5.3).

  Args:
    learning_rate: the rate at the end of warmup.
    warmup_steps: steps of linear warmup.
    b1, b2, eps: Adam's moment decay rates and denominator epsilon.

  Returns:
    (optimizer, schedule): the schedule maps an update count to its rate.
  """
  schedule = rsqrt_schedule(learning_rate, warmup_steps)
  return optax.adam(schedule, b1=b1, b2=b2, eps=eps), schedule


def make(name: str, **hyperparameters) -> tuple[optax.GradientTransformation, Callable]:
  """`lars(...)` or `adam(...)` by name (one of OPTIMIZERS)."""
  return {"lars": lars, "adam": adam}[name](**hyperparameters)
