"""What a JAX user can write today to shard optimizer state (ZeRO-1), for the benchmark.

Both compute the same update as `steps.make_train_step` (up to summation
order) and take and return `steps.TrainState`-shaped arguments, with the
state donated:

* `gspmd_step`: the global step under `jax.jit`, with the optimizer state given
  a `NamedSharding` over the data axis (GSPMD, arXiv:2105.04663 §2.1: "weight
  update sharding or optimizer state sharding"). As users write it: each
  tensor is split along its first dim divisible by N; a tensor with none stays
  replicated. XLA then places the collectives.
* `handwritten_step`: a `jax.shard_map` step with the collectives written by
  hand, as a careful person would: each gradient flattened, padded to a
  multiple of N and reduce-scattered (`psum_scatter`), the optimizer run on the
  shards, each weight all-gathered. Optimizer state is kept as those flat
  shards. Valid for elementwise optimizers (Adam, SGD): a norm over a
  tensor would need partial sums combined by hand.
* `flat_step`: the same with one collective each way, as ZeRO
  implementations with a flat buffer do: every gradient concatenated into one
  vector, one reduce-scatter, the optimizer on one flat shard (its state
  kept as that shard), one all-gather, each weight sliced out of it.

Batch norm across replicas needs the mesh axis inside the model, which the
global GSPMD step does not have: use models without it (the MLP, the
Transformer).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from wus.harness.training import steps
from wus.harness.models import tasks

AXIS = steps.AXIS_NAME


def zero1_spec(shape: tuple[int, ...], num_shards: int) -> P:
  """The spec a user gives an optimizer-state tensor: its first dim divisible by N split."""
  for d, size in enumerate(shape):
    if size % num_shards == 0:
      return P(*([None] * d), AXIS)
  return P()


def gspmd_step(task: tasks.Task, tx: optax.GradientTransformation, mesh: Mesh, opt_state):
  """ZeRO-1 with GSPMD: `jax.jit` of the global step, optimizer state sharded.

  Args:
    task: the model (without collectives inside, see the module doc).
    tx: the optimizer.
    mesh: a 1-D mesh with the axis `steps.AXIS_NAME`.
    opt_state: the optimizer state (or its shapes), for its shardings.

  Returns:
    (step, place): `step(params, model_state, opt_state, batch)` returns the
    new (params, model_state, opt_state, metrics), with `opt_state` laid out
    by the shardings; `place(opt_state)` lays out a whole optimizer state so.
  """
  replicated = NamedSharding(mesh, P())
  opt_shardings = jax.tree.map(lambda x: NamedSharding(mesh, zero1_spec(x.shape, mesh.size)),
                               opt_state)

  jitted = jax.jit(steps.make_train_step(task, tx, "jit"),
                   in_shardings=(replicated, replicated, opt_shardings,
                                 NamedSharding(mesh, P(AXIS))),
                   out_shardings=(replicated, replicated, opt_shardings, replicated),
                   donate_argnums=(0, 1, 2))
  return jitted, lambda state: jax.device_put(state, opt_shardings)


def _flat_shard(x: jax.Array, num_shards: int) -> jax.Array:
  """This replica's shard of `x` flattened and zero-padded to a multiple of N."""
  flat = x.reshape(-1)
  size = -(-flat.size // num_shards)
  flat = jnp.pad(flat, (0, size * num_shards - flat.size))
  return lax.dynamic_slice_in_dim(flat, lax.axis_index(AXIS) * size, size)


def handwritten_step(task: tasks.Task, tx: optax.GradientTransformation, mesh: Mesh, opt_state):
  """ZeRO-1 written by hand with `jax.shard_map`, `psum_scatter` and `all_gather`.

  Args:
    task: the model.
    tx: an elementwise optimizer.
    mesh: a 1-D mesh with the axis `steps.AXIS_NAME`.
    opt_state: the optimizer state (or its shapes), whole.

  Returns:
    (step, place): `step(params, model_state, opt_state, batch)` as
    `gspmd_step`'s, its `opt_state` holding flat shards (a float32 [N * k]
    array split over the mesh per tensor, scalars whole); `place(opt_state)`
    turns a whole optimizer state into that.
  """
  n = mesh.size
  specs = jax.tree.map(lambda x: P(AXIS) if x.ndim else P(), opt_state)

  def step(params, model_state, opt_shards, batch):
    grads, model_state, metrics = steps.local_gradients(task, params, model_state, batch)
    grad_shards = jax.tree.map(
        lambda g: lax.psum_scatter(jnp.pad(g.reshape(-1), (0, -g.size % n)), AXIS,
                                   tiled=True) / n, grads)
    param_shards = jax.tree.map(lambda p: _flat_shard(p, n), params)
    updates, opt_shards = tx.update(grad_shards, opt_shards, param_shards)
    new_shards = optax.apply_updates(param_shards, updates)
    params = jax.tree.map(
        lambda s, p: lax.all_gather(s, AXIS, tiled=True, to="invarying")[:p.size].reshape(p.shape),
        new_shards, params)
    return params, model_state, opt_shards, lax.pmean(metrics, AXIS)

  mapped = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), specs, P(AXIS)),
                                 out_specs=(P(), P(), specs, P())), donate_argnums=(0, 1, 2))
  to_shards = jax.jit(jax.shard_map(
      lambda s: jax.tree.map(lambda x: _flat_shard(x, n) if x.ndim else x, s), mesh=mesh,
      in_specs=(P(),), out_specs=specs))
  return mapped, to_shards


def _flat(tree, total: int) -> jax.Array:
  """Every leaf of `tree` raveled, laid end to end and zero-padded to `total` elements."""
  leaves = [x.reshape(-1) for x in jax.tree.leaves(tree)]
  size = sum(x.size for x in leaves)
  return jnp.concatenate(leaves + [jnp.zeros((total - size,), leaves[0].dtype)])


def flat_step(task: tasks.Task, tx: optax.GradientTransformation, mesh: Mesh, opt_state,
              params):
  """ZeRO-1 written by hand with one flat buffer: one reduce-scatter, one all-gather.

  Args:
    task: the model.
    tx: an elementwise optimizer.
    mesh: a 1-D mesh with the axis `steps.AXIS_NAME`.
    opt_state: the optimizer state (or its shapes), whole.
    params: the weights (or their shapes): the flat buffer's layout.

  Returns:
    (step, place): `step(params, model_state, opt_state, batch)` as
    `gspmd_step`'s, its `opt_state` holding the state of one flat vector of all
    weights, padded to a multiple of N and split over the mesh (scalars
    whole); `place(opt_state)` turns a whole optimizer state into that.
  """
  n = mesh.size
  total = -(-sum(x.size for x in jax.tree.leaves(params)) // n) * n
  treedef = jax.tree.structure(params)
  shapes = [x.shape for x in jax.tree.leaves(params)]
  is_params = lambda x: jax.tree.structure(x) == treedef  # noqa: E731

  def flat_state(state):
    """The state with every params-shaped subtree as one flat vector."""
    return jax.tree.map(lambda t: _flat(t, total) if is_params(t) else t, state, is_leaf=is_params)

  specs = jax.tree.map(lambda x: P(AXIS) if x.ndim else P(),
                       jax.eval_shape(flat_state, opt_state))

  def step(params, model_state, opt_shard, batch):
    grads, model_state, metrics = steps.local_gradients(task, params, model_state, batch)
    grad_shard = lax.psum_scatter(_flat(grads, total), AXIS, tiled=True) / n
    k = total // n
    param_shard = lax.dynamic_slice_in_dim(_flat(params, total), lax.axis_index(AXIS) * k, k)
    updates, opt_shard = tx.update(grad_shard, opt_shard, param_shard)
    every = lax.all_gather(optax.apply_updates(param_shard, updates), AXIS, tiled=True,
                           to="invarying")
    starts = [0]
    for shape in shapes:
      starts.append(starts[-1] + math.prod(shape))
    leaves = [every[a:b].reshape(shape) for a, b, shape in zip(starts, starts[1:], shapes)]
    return (jax.tree.unflatten(treedef, leaves), model_state, opt_shard,
            lax.pmean(metrics, AXIS))

  mapped = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), specs, P(AXIS)),
                                 out_specs=(P(), P(), specs, P())), donate_argnums=(0, 1, 2))
  to_shards = jax.jit(jax.shard_map(
      lambda s: jax.tree.map(
          lambda x: lax.dynamic_slice_in_dim(x, lax.axis_index(AXIS) * (total // n), total // n)
          if x.ndim else x, flat_state(s)),
      mesh=mesh, in_specs=(P(),), out_specs=specs))
  return mapped, to_shards
