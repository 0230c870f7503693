"""FSDP and HSDP (issue 29 item 3), and norms and matrix-wise updates of weights split
over a model axis (items 5 and 6), under `wus.shard_map`; each against the unmodified
`jax.shard_map` step (tests/tensor_parallel.py)."""


import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import PartitionSpec as P

import wus
from helpers import assert_trees_equal, sharded_leaves
from tensor_parallel import (GELU_SPEC, HSDP_SPEC, TX, gelu_inputs, gelu_step, hsdp_step,
                             megatron_inputs, run, two_axis_mesh, use_tx)
from wus.analysis import causes, reasons

# --- FSDP + TP (the tutorial's "FSDP + TP" section) and HSDP (issue 29 item 3). -----------


def predict_fsdp_tp(params_frag, inputs):
  for W_frag, b_frag in params_frag:
    W = jax.lax.all_gather(W_frag, "data", tiled=True)
    b = jax.lax.all_gather(b_frag, "data", tiled=True)
    block_result = jnp.dot(inputs, W)
    outputs = jax.lax.psum_scatter(block_result, "model", scatter_dimension=1, tiled=True) + b
    inputs = jax.nn.relu(outputs)
  return outputs


def loss_fsdp_tp(local_params, local_batch):
  inputs, targets = local_batch
  layers, out_scale = local_params
  predictions = predict_fsdp_tp(layers, inputs) * out_scale
  sq_err = jax.lax.psum(jnp.sum((predictions - targets) ** 2, axis=-1), "model")
  return jax.lax.pmean(jnp.mean(sq_err), "data")


def fsdp_tp_step(params, opt_state, batch):
  loss, grads = jax.value_and_grad(loss_fsdp_tp)(params, batch)
  updates, opt_state = TX.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss


def test_fsdp_plus_tp_weights_say_fsdp_and_the_rest_of_the_step_is_served():
  """The tutorial's FSDP + TP layers (split over model x data: nothing repeated over
  "data", their gradients arrive reduce-scattered) beside an output scale split over
  "model" only, whose gradient AD all-reduces over "data": the Plan says FSDP for the
  former, and the latter's update is sharded over "data". (N_data = 3 has no such
  step: jax.shard_map needs the layers' rows divisible by data x model.)"""
  n_data = 4
  layers, batches = megatron_inputs(n_data)
  width = layers[0][0].shape[0]
  params = (layers, jnp.linspace(0.5, 1.5, width, dtype=jnp.float32))
  fsdp = P(("model", "data"))
  spec = ([(fsdp, fsdp)] * 3, P("model"))
  a, b, ws, batch = run(two_axis_mesh(n_data, 2), fsdp_tp_step, spec, params, batches,
                        batch_spec=P("data", "model"))
  assert_trees_equal(a, wus.unshard(b))
  plan = ws.plan(*b, batch)
  inputs = {i.name: i for i in plan.inputs}
  for name in ("params[0][0][0]", "opt_state[0].mu[0][0][0]"):
    # State its spec already splits over "data": FSDP, nothing repeated there to shard.
    i = inputs[name]
    assert i.state and i.fsdp == (("data", 4),) and not i.sharded, i
  assert not inputs["batch[0]"].state  # Split over "data" too, but a batch: no FSDP.
  scale = [x for x in sharded_leaves(b[1]) if x.shape == (width,)]
  assert len(scale) == 2 and all(x.layout.split_axes == ("model",) for x in scale)
  assert sum(c.sharded for c in plan.clusters) == 1, str(plan)


def test_hsdp_state_one_over_replica_times_fsdp_and_bit_for_bit():
  """HSDP on ("replica", "fsdp") = (2, 4): weights split over "fsdp" (all-gathered in the
  forward pass) and replicated over "replica"; the update of each fsdp part is sharded
  over "replica" (ZeRO-1 outside, FSDP inside): 1/8 of the state per device."""
  mesh = jax.make_mesh((2, 4), ("replica", "fsdp"))
  params, batches = megatron_inputs(8)
  a, b, ws, batch = run(mesh, hsdp_step, HSDP_SPEC, params, batches,
                        batch_spec=P(("replica", "fsdp")))
  assert_trees_equal(a, wus.unshard(b))
  sharded = sharded_leaves(b[1])
  assert len(sharded) == 12
  for x in sharded:
    assert x.nbytes_per_device * 8 == x.size * x.dtype.itemsize, x
    assert x.data.sharding.spec == P(("fsdp", "replica")), x
  assert ws.plan(*b, batch).axes == ("replica",)


# --- Item 5 and item 6: reductions and matrix-wise updates under tensor parallelism. ------

REDUCING = [
    ("clip_adam", lambda: optax.chain(optax.clip_by_global_norm(0.1), optax.adam(1e-2))),
    ("lamb", lambda: optax.lamb(1e-2)),
]


def _run_tx(monkeypatch, tx):
  params, batches = gelu_inputs(4)
  use_tx(monkeypatch, tx, params)
  return run(two_axis_mesh(4, 2), gelu_step, GELU_SPEC, params, batches)


@pytest.mark.parametrize("name,make_tx", REDUCING, ids=[n for n, _ in REDUCING])
def test_norms_of_model_split_blocks_combine_as_the_unmodified_step(monkeypatch, name, make_tx):
  """Global-norm clipping and LAMB's trust ratios on blocks split over "model": the
  sharded step sums each block's squares over its data shards (masked local sums and an
  all-reduce over "data"), as the unmodified step sums the block; up to summation order."""
  a, b, ws, batch = _run_tx(monkeypatch, make_tx())
  assert_trees_equal(a, wus.unshard(b), rtol=2e-6, atol=1e-7)
  assert len(sharded_leaves(b)) == 4
  assert all(c.sharded for c in ws.plan(*b, batch).clusters)


def test_muon_on_model_split_blocks_runs_as_written_with_the_reason(monkeypatch):
  """Item 6, decided: a matrix split over "model" cannot be orthogonalized from its
  data shard, and owning a block per data replica is not implemented: the update runs
  as the step wrote it (on each model rank's block, on every data replica), bit for
  bit, and the Plan says why. Never an error."""
  a, b, ws, batch = _run_tx(monkeypatch, optax.contrib.muon(1e-2))
  assert_trees_equal(a, wus.unshard(b))
  plan = ws.plan(*b, batch)
  kernels = [c for c in plan.clusters if any(t.shape in ((16, 16),) for t in c.tensors)]
  assert kernels and all(not c.sharded and c.owner is None for c in kernels)
  for c in kernels:  # Replicated, and not owned: its gradient is one model rank's block.
    note = c.why.notes[-1]
    assert isinstance(note, reasons.NotOwned) and isinstance(note.why, causes.BlockOfSplit), c.why
    assert note.why.split == ("model",), note.why
