"""The parts of a sharded training step, each compiled alone: what no sharded step can beat.

A data-parallel step whose weight update is sharded N ways does, per update
and per device, at least: the forward and backward pass (`steps.make_gradient_step`,
which writes each replica's gradients), a reduce-scatter of every gradient
byte and an all-gather of every weight byte, and the optimizer's update of a
1/N shard of every weight. `wus-bench` times each part alone in the same
interleaved rounds as the steps, and calls the sum of their medians the
limit of the machine for that model; a step at the limit wastes nothing (no
copy, no extra pass over memory, no collective latency beyond two).

The parts, with every tensor's elements laid end to end and padded to a
multiple of N (`flat_elements`):

  collectives  one reduce-scatter of all the gradients ([N k] floats per
               device) and one all-gather of all the weights ([k] per
               device), writing into buffers the previous call returned
               (donated), as a copy-free step would.
  update       the optimizer (optax) on one flat [k] shard of the weights, its
               gradients and its state, state and weights donated.

The collectives' and the update's inputs are made once; their values do not
matter to the time (no data-dependent control flow).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


def flat_elements(sizes: Sequence[int], num_shards: int) -> int:
  """Elements of every tensor laid end to end, padded to a multiple of `num_shards`."""
  return -(-sum(sizes) // num_shards) * num_shards


class Parts:
  """The collectives and the update of a step on `sizes` weights, as zero-argument calls.

  Attributes:
    collectives: runs the reduce-scatter and the all-gather once (blocking
      not included); reuses the buffers it returned last.
    update: runs the optimizer's update of one flat shard once.
    update_per_tensor: the same update of each tensor's own shard (padded).
    elements: the flat elements (`flat_elements`): N k.
  """

  def __init__(self, sizes: Sequence[int], tx: optax.GradientTransformation, mesh: Mesh,
               axis: str, dtype=jnp.float32):
    n = mesh.shape[axis]
    self.elements = flat_elements(sizes, n)
    split = NamedSharding(mesh, P(axis))
    # Each device's whole gradient buffer ([N k]) and its weight shard ([k]):
    # global arrays of N N k and N k elements split over the axis.
    self._grads = jax.device_put(jnp.ones((n * self.elements,), dtype), split)
    shard = jax.device_put(jnp.ones((self.elements,), dtype), split)
    self._buffers = (jax.device_put(jnp.zeros((self.elements,), dtype), split),
                     jax.device_put(jnp.zeros((n * self.elements,), dtype), split))

    def collectives(grads, weights, reduced, gathered):
      del reduced, gathered  # Their buffers only: the outputs are written into them.
      return (lax.psum_scatter(grads, axis, tiled=True),
              lax.all_gather(weights, axis, tiled=True))

    self._collectives = jax.jit(jax.shard_map(
        collectives, mesh=mesh, in_specs=P(axis), out_specs=P(axis), check_vma=False),
        donate_argnums=(2, 3), keep_unused=True)
    self._weights = shard
    self._flat = _Update(tx, mesh, axis, [self.elements], dtype)
    # The same update on each tensor's shard (padded to a multiple of N), as a step that
    # shards tensor by tensor runs it: what that costs beside one flat shard.
    self._per_tensor = _Update(tx, mesh, axis, [flat_elements([k], n) for k in sizes], dtype)

  def collectives(self) -> object:
    self._buffers = self._collectives(self._grads, self._weights, *self._buffers)
    return self._buffers

  def update(self) -> object:
    return self._flat()

  def update_per_tensor(self) -> object:
    return self._per_tensor()


class _Update:
  """The optimizer's update of 1/N shards of flat tensors of `elements` (each a multiple
  of N), state and weights donated, as a zero-argument call."""

  def __init__(self, tx: optax.GradientTransformation, mesh: Mesh, axis: str,
               elements: Sequence[int], dtype):
    n, split = mesh.shape[axis], NamedSharding(mesh, P(axis))

    def update(params, grads, state):
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state

    shards = [jax.ShapeDtypeStruct((k // n,), dtype) for k in elements]
    shapes = jax.eval_shape(tx.init, shards)
    specs = jax.tree.map(lambda x: P(axis) if x.ndim else P(), shapes)
    ones = [jax.device_put(jnp.ones((k,), dtype), split) for k in elements]
    state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(axis), out_specs=specs,
                                  check_vma=False))(ones)
    self._update = jax.jit(jax.shard_map(update, mesh=mesh, in_specs=(P(axis), P(axis), specs),
                                         out_specs=(P(axis), specs), check_vma=False),
                           donate_argnums=(0, 2))
    self._state = ([jax.device_put(jnp.ones((k,), dtype), split) for k in elements], state)
    self._grads = [jax.device_put(jnp.full((k,), 1e-3, dtype), split) for k in elements]

  def __call__(self) -> object:
    params, state = self._state
    self._state = self._update(params, self._grads, state)
    return self._state


def sizes_of(params) -> list[int]:
  """Elements of each leaf of a params tree."""
  return [math.prod(x.shape) for x in jax.tree.leaves(params)]
