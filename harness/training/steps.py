"""The per-replica training and evaluation steps, mapped over the data axis.

The training step is written the way the published `jax.shard_map` examples
write a data-parallel step, under the default `check_vma=True`, for one
replica: the loss is the global mean, `jax.lax.pmean` of this replica's mean
loss over AXIS_NAME, inside the differentiated function; the gradients are
those of the replicated (`P()`) params, straight from `jax.value_and_grad`;
then an optax update.

Why there is no `pmean` of the gradients: with `check_vma=True`, JAX knows
that the params are the same on every replica ("invariant") and the batch is
not ("varying"). Using an invariant value where varying ones are combined
casts it implicitly (`pvary`), and the transpose of that cast is a `psum`, so
`jax.grad` at P() params already sums the gradient over the replicas: the
gradient of the global mean loss is the gradient all-reduce, once. A `pmean`
after it would all-reduce a second time. (With `check_vma=False` there are no
such casts, the gradients come out per replica, and one would `pmean` them
instead.)

Batch-norm statistics (`model_state`) are returned as the model computes them
(averaged over AXIS_NAME by the ResNet's `nn.BatchNorm(axis_name=...)`).

`map_train_step` maps the step over the mesh either the plain JAX way
(`replicated`: `jax.jit(jax.shard_map(...))`, every replica updates every
weight) or with `wus.shard_map` (`wus`: the weight update is sharded,
optimizer state stays sharded between steps). Nothing else differs between
the two modes.

With a tensor-parallel task (`tasks.TensorParallelLM`, `wus-train
--model_parallel`), the mesh has a second axis MODEL_AXIS and the same step
runs on each device's blocks of the weights (`state_specs`); the task's loss
has the psums over MODEL_AXIS inside, so the gradients still come from
`jax.value_and_grad` alone.
"""

from typing import Any, NamedTuple

import jax
import optax
from jax.sharding import AxisType, Mesh, PartitionSpec as P

import wus
from wus.harness.models import tasks

AXIS_NAME = "data"
MODEL_AXIS = "model"  # the tensor-parallel axis of a mesh with --model_parallel > 1
MODES = ("replicated", "wus")
STEP_STYLES = ("shard_map", "jit")


def make_mesh(step: str = "shard_map", model_parallel: int = 1) -> Mesh:
  """The 1-D mesh over every device with the axis AXIS_NAME; with `model_parallel` > 1,
  the 2-D mesh (AXIS_NAME: devices / model_parallel, MODEL_AXIS: model_parallel), the
  devices of a model group adjacent. For "jit" steps its axes are Auto
  (`jax.sharding.Mesh`'s kind): Flax's `nn.Embed` cannot take a batch split over an
  Explicit axis (`jax.make_mesh`'s default) without an out_sharding."""
  if model_parallel > 1:
    shape, names = (jax.device_count() // model_parallel, model_parallel), (AXIS_NAME, MODEL_AXIS)
  else:
    shape, names = (jax.device_count(),), (AXIS_NAME,)
  types = (AxisType.Auto,) * len(shape) if step == "jit" else None
  return jax.make_mesh(shape, names, axis_types=types)


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


def state_specs(task: tasks.Task, tx: optax.GradientTransformation, state) -> TrainState:
  """The PartitionSpec of each leaf of `state` (a TrainState, arrays or abstract) over the
  mesh: the weights as `task.param_specs` splits them, each optimizer-state leaf shaped
  like a weight as that weight (`optax.tree_map_params`), everything else whole."""
  params = task.param_specs(state.params)
  whole = lambda tree: jax.tree.map(lambda _: P(), tree)  # noqa: E731
  opt = optax.tree_map_params(tx, lambda _, spec: spec, state.opt_state, params,
                              transform_non_params=lambda _: P(),
                              is_leaf=lambda x: isinstance(x, P))
  return TrainState(params, whole(state.model_state), opt)


def _loss_fn(task: tasks.Task, compute_dtype):
  """`task.loss`, reading the weights in `compute_dtype` if given."""
  def loss(params, model_state, batch):
    if compute_dtype is not None:
      params = jax.tree.map(lambda w: w.astype(compute_dtype), params)
    return task.loss(params, model_state, batch)
  return loss


def gradients(task: tasks.Task, params, model_state, batch,
              compute_dtype=None) -> tuple[Any, Any, dict]:
  """Gradients of the global mean loss at the replicated params (inside a shard_map
  over AXIS_NAME with check_vma=True), as a user writes them.

  Args:
    task: the model.
    params, model_state: as in `TrainState` (replicated, `P()`).
    batch: this replica's share of the batch.
    compute_dtype: if given (e.g. jnp.bfloat16), the forward and backward
      pass read the weights converted to it (mixed precision); the gradients
      are still of the float32 weights.

  Returns:
    (grads, model_state, metrics): gradients of the mean loss over all
    replicas, shaped like `params` and the same on every replica (JAX's AD
    all-reduces them; see the module docstring); the updated model state; this
    replica's metrics.
  """
  local_loss = _loss_fn(task, compute_dtype)

  def loss(params, model_state, batch):
    value, aux = local_loss(params, model_state, batch)
    return jax.lax.pmean(value, AXIS_NAME), aux

  (_, (model_state, metrics)), grads = jax.value_and_grad(loss, has_aux=True)(
      params, model_state, batch)
  return grads, model_state, metrics


def local_gradients(task: tasks.Task, params, model_state, batch,
                    compute_dtype=None) -> tuple[Any, Any, dict]:
  """This replica's own gradients, before any all-reduce (inside a shard_map over
  AXIS_NAME with check_vma=True).

  Not what the training step uses (that is `gradients`): for the hand-written
  ZeRO of `zero.py`, which reduce-scatters per-replica gradients itself, and
  for measuring the forward and backward pass alone. They differentiate at a
  per-replica ("varying") copy of the weights, `jax.lax.pcast(params,
  AXIS_NAME, to="varying")`, so that AD does not sum them.

  Args and returns: as `gradients`, but the gradients are of this replica's
  mean loss and vary over AXIS_NAME.
  """
  local_params = jax.lax.pcast(params, AXIS_NAME, to="varying")
  (_, (model_state, metrics)), grads = jax.value_and_grad(
      _loss_fn(task, compute_dtype), has_aux=True)(local_params, model_state, batch)
  return grads, model_state, metrics


def make_train_step(task: tasks.Task, tx: optax.GradientTransformation,
                    step: str = "shard_map"):
  """The step: (params, model_state, opt_state, batch) -> (..., metrics).

  With step "shard_map", per replica: `batch` is this replica's share; with
  "jit", on global arrays as a `jax.jit` step is written (`batch` is the
  global batch, the loss its mean). `metrics` ({"loss", "accuracy"}, float32
  scalars) are means over the global batch either way.
  """
  if step == "jit":
    return _global_train_step(task, tx)

  def train_step(params, model_state, opt_state, batch):
    grads, model_state, metrics = gradients(task, params, model_state, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, model_state, opt_state, jax.lax.pmean(metrics, AXIS_NAME)

  return train_step


def _global_train_step(task: tasks.Task, tx: optax.GradientTransformation):
  """The step on global arrays, as a `jax.jit` step is written (no collectives)."""

  def train_step(params, model_state, opt_state, batch):
    (_, (model_state, metrics)), grads = jax.value_and_grad(task.loss, has_aux=True)(
        params, model_state, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), model_state, opt_state, metrics

  return train_step


def map_train_step(mode: str, train_step, mesh: Mesh, group_size: int | None = None,
                   step: str = "shard_map", *, donate: bool = True, topology=None,
                   specs: TrainState | None = None):
  """`train_step` over `mesh`, compiled by `jax.jit(jax.shard_map(...))` or by wus.

  Args:
    mode: "replicated" or "wus".
    train_step: from `make_train_step`.
    mesh: a mesh with the axis AXIS_NAME.
    group_size: wus only: `shard_group_size` (partial sharding, §5.2).
    step: "shard_map", or "jit" for a step on global arrays (`jax.jit` or
      `wus.jit`; the batch must be placed split over AXIS_NAME).
    donate: donate the state arguments (the default, as MLPerf-style loops
      update it in place).
    topology: wus only: the devices, for its cost model
      (`wus.analysis.network.Topology`); None: its default.
    specs: "shard_map" only: the state's PartitionSpecs (`state_specs`; a
      tensor-parallel model's weights split over MODEL_AXIS); None: all whole.

  Returns:
    (params, model_state, opt_state, batch) -> (params, model_state, opt_state,
    metrics), with the global batch split over AXIS_NAME; with `donate`, the
    state arguments are donated (do not use them after the call). Both
    results have `.lower(*args)` for the compiled program.
  """
  donated = (0, 1, 2) if donate else ()
  if step == "jit":
    if mode == "replicated":
      return jax.jit(train_step, donate_argnums=donated)
    return wus.jit(train_step, donate_argnums=donated, topology=topology)
  state = tuple(specs) if specs is not None else (P(), P(), P())
  specs = {"in_specs": (*state, P(AXIS_NAME)), "out_specs": (*state, P())}
  if mode == "replicated":
    return jax.jit(jax.shard_map(train_step, mesh=mesh, **specs), donate_argnums=donated)
  return wus.shard_map(train_step, mesh=mesh, donate_argnums=donated,
                       shard_group_size=group_size, topology=topology, **specs)


def make_update_step(tx: optax.GradientTransformation):
  """The rest of `make_train_step` after the forward and backward pass, alone.

  (params, opt_state, grads) -> (params, opt_state), per replica: `grads` is
  this replica's own gradients with a leading dim of 1 (`make_gradient_step`'s
  output, split over AXIS_NAME); they are all-reduced by `pmean`, then the
  optax update runs. Mapped by `map_update_step`, it is the gradient
  collectives and weight update of a step in either mode, for timing them.
  """

  def update_step(params, opt_state, grads):
    grads = jax.lax.pmean(jax.tree.map(lambda g: g[0], grads), AXIS_NAME)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return update_step


def map_update_step(mode: str, update_step, mesh: Mesh):
  """`update_step` over `mesh` as `map_train_step` maps a training step (state donated)."""
  specs = {"in_specs": (P(), P(), P(AXIS_NAME)), "out_specs": (P(), P())}
  if mode == "replicated":
    return jax.jit(jax.shard_map(update_step, mesh=mesh, **specs), donate_argnums=(0, 1))
  return wus.shard_map(update_step, mesh=mesh, donate_argnums=(0, 1), **specs)


def make_gradient_step(task: tasks.Task, mesh: Mesh):
  """Forward and backward alone, compiled: (params, model_state, batch) -> each replica's
  gradients (`local_gradients`), stacked along a leading dim of 1 per device.

  No all-reduce and no update: what is left of a training step without them,
  for measurements (`wus-memory`'s P; the input of `make_update_step`).
  """
  def grads(params, model_state, batch):
    g, _, _ = local_gradients(task, params, model_state, batch)
    return jax.tree.map(lambda x: x[None], g)
  return jax.jit(jax.shard_map(grads, mesh=mesh, in_specs=(P(), P(), P(AXIS_NAME)),
                               out_specs=P(AXIS_NAME)))


def make_eval_step(task: tasks.Task, mesh: Mesh, param_specs=P()):
  """Compiled (params, model_state, batch) -> {"loss", "correct", "count"} summed over the
  batch; the params split as `param_specs` says (default: whole)."""

  def eval_step(params, model_state, batch):
    return jax.lax.psum(task.eval_sums(params, model_state, batch), AXIS_NAME)

  return jax.jit(jax.shard_map(eval_step, mesh=mesh, in_specs=(param_specs, P(), P(AXIS_NAME)),
                               out_specs=P()))
