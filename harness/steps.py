"""The per-replica training and evaluation steps, mapped over the data axis.

The training step is an ordinary data-parallel step written for one replica:
forward and backward on this replica's share of the batch, `pmean` of the
gradients, an optax update. `map_train_step` maps it over the mesh either the
plain JAX way (`replicated`: every replica updates every weight) or with
`wus.shard_map` (`wus`: the weight update is sharded, optimizer state stays
sharded between steps). Nothing else differs between the two modes.
"""

from typing import Any, NamedTuple

import jax
import optax
from jax.sharding import Mesh, PartitionSpec as P

import wus
from wus.harness import tasks

AXIS_NAME = "data"
MODES = ("replicated", "wus")


class TrainState(NamedTuple):
  """What a training step reads and returns, besides the batch.

  params: float32 weights, whole on every replica.
  model_state: non-trained variables (batch-norm averages), whole; {} if none.
  opt_state: the optimizer's state; in `wus` mode its sharded tensors are
    `wus.ShardedArray`s after the first step.
  """

  params: Any
  model_state: Any
  opt_state: Any


def local_gradients(task: tasks.Task, params, model_state, batch,
                    compute_dtype=None) -> tuple[Any, Any, dict]:
  """This replica's gradients, before any all-reduce (inside a shard_map over AXIS_NAME).

  Args:
    task: the model.
    params, model_state: as in `TrainState`.
    batch: this replica's share of the batch.
    compute_dtype: if given (e.g. jnp.bfloat16), the forward and backward
      pass read the weights converted to it (mixed precision); the gradients
      are still of the float32 weights.

  Returns:
    (grads, model_state, metrics): gradients of this replica's mean loss, shaped
    like `params` and varying over AXIS_NAME; the updated model state; this
    replica's metrics.
  """
  # Differentiate at a per-replica ("varying") copy of the weights so that the
  # gradients are this replica's own and the caller's all-reduce is their one
  # all-reduce (with check_vma=True, AD at the replicated params would already
  # sum them).
  local_params = jax.lax.pcast(params, AXIS_NAME, to="varying")

  def loss(params, model_state, batch):
    if compute_dtype is not None:
      params = jax.tree.map(lambda w: w.astype(compute_dtype), params)
    return task.loss(params, model_state, batch)

  (_, (model_state, metrics)), grads = jax.value_and_grad(loss, has_aux=True)(
      local_params, model_state, batch)
  return grads, model_state, metrics


def make_train_step(task: tasks.Task, tx: optax.GradientTransformation):
  """The per-replica step: (params, model_state, opt_state, batch) -> (..., metrics).

  `batch` is this replica's share; `metrics` ({"loss", "accuracy"}, float32
  scalars) are means over all replicas.
  """

  def train_step(params, model_state, opt_state, batch):
    grads, model_state, metrics = local_gradients(task, params, model_state, batch)
    grads = jax.lax.pmean(grads, AXIS_NAME)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, model_state, opt_state, jax.lax.pmean(metrics, AXIS_NAME)

  return train_step


def map_train_step(mode: str, train_step, mesh: Mesh):
  """`train_step` over `mesh`, compiled by `jax.jit(jax.shard_map(...))` or by wus.

  Args:
    mode: "replicated" or "wus".
    train_step: from `make_train_step`.
    mesh: a mesh with the axis AXIS_NAME.

  Returns:
    (params, model_state, opt_state, batch) -> (params, model_state, opt_state,
    metrics), with the global batch split over AXIS_NAME; the state
    arguments are donated (do not use them after the call). Both results have
    `.lower(*args)` for the compiled program.
  """
  specs = {"in_specs": (P(), P(), P(), P(AXIS_NAME)), "out_specs": (P(), P(), P(), P())}
  donate = (0, 1, 2)  # The state is updated in place, as MLPerf-style loops do.
  if mode == "replicated":
    return jax.jit(jax.shard_map(train_step, mesh=mesh, **specs), donate_argnums=donate)
  return wus.shard_map(train_step, mesh=mesh, donate_argnums=donate, **specs)


def make_eval_step(task: tasks.Task, mesh: Mesh):
  """Compiled (params, model_state, batch) -> {"loss", "correct", "count"} summed over the mesh."""

  def eval_step(params, model_state, batch):
    return jax.lax.psum(task.eval_sums(params, model_state, batch), AXIS_NAME)

  return jax.jit(jax.shard_map(eval_step, mesh=mesh, in_specs=(P(), P(), P(AXIS_NAME)),
                               out_specs=P()))
