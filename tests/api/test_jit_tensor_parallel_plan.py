"""`wus.jit` on 2-D meshes (issue 29 item 2): the compiled step's collectives, the Plan, the
reductions over model-split weights, the steps it runs as jax.jit does and why, and the
state's life outside the step (`wus.unshard`, `state_target`, Orbax checkpoints).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import wus
from helpers import assert_trees_equal, classifier_step, collective_lines, replica_groups
from wus.analysis import refusals
from wus.sharded import is_sharded
from jit_tensor_parallel import (LogicalMLP, assert_split_state, batches, linen_args,
                                 linen_step, make_mesh, mlp_inputs, mlp_run, mlp_step, run_both,
                                 sharded)


def test_model_split_gradients_reduce_scattered_over_the_data_groups():
  """The compiled step: every gradient is reduce-scattered and every new weight (block)
  all-gathered within each model rank's data group; the only all-reduces over "data"
  left are scalars (the loss), none for a gradient."""
  ws, args, batch, mesh = linen_step()
  hlo = ws.lower(*args, batch).compile().as_text()
  data_groups = sorted(tuple(int(d.id) for d in mesh.devices[:, m]) for m in range(2))

  def over_data(kind):
    return [ln for ln in collective_lines(hlo, kind) if sorted(replica_groups(ln)) == data_groups]
  assert over_data("reduce-scatter") and over_data("all-gather")
  scattered = sum(int(np.prod(re.findall(r"\[([\d,]+)\]", ln)[0].split(","), dtype=int))
                  for ln in over_data("reduce-scatter"))
  split_elements = sum(x.size for x in jax.tree.leaves(args[0]) if x.sharding.spec != P())
  assert 4 * 2 * scattered >= split_elements  # Each device reduce-scatters its block's shard.
  for line in over_data("all-reduce"):
    assert re.findall(r"\b[a-z]+\d*\[[\d,]*\]", line.split(" all-reduce")[0]) == ["f32[]"], line


def test_megatron_mlp_no_new_collective_over_model():
  """The forward and backward pass keep the unmodified step's collectives over "model"
  (the row-parallel all-reduce): the update adds only reduce-scatters and all-gathers
  over the data groups. Bit for bit over three steps (SGD with momentum)."""
  tx = optax.sgd(1e-2, momentum=0.9)
  mesh = make_mesh(4)
  params, data = mlp_inputs(mesh)
  step, ws = mlp_step(tx), wus.jit(mlp_step(tx))
  _, out = run_both(step, ws, (params, tx.init(params)), data)
  assert_split_state(out[1], 4)
  hlo = ws.lower(*out, data[0]).compile().as_text()
  ref = jax.jit(step).lower(params, tx.init(params), data[0]).compile().as_text()
  model_groups = sorted(tuple(int(d.id) for d in mesh.devices[k]) for k in range(4))

  def over_model(text):
    return sorted((kind, ln.split(" = ")[1].split(" ")[0])
                  for kind in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all")
                  for ln in collective_lines(text, kind)
                  if sorted(replica_groups(ln)) == model_groups)
  assert over_model(hlo) == over_model(ref) and over_model(ref), over_model(hlo)


def test_the_plan_says_each_tensor_is_split_by_its_placement_and_sharded_by_wus():
  ws, args, batch, _ = linen_step()
  plan = ws.plan(*args, batch)
  lines = {ln.split()[0]: ln for ln in plan.details().split("\ninputs:\n")[1].splitlines()
           if ln.startswith("    ")}
  kernel = "['params']['Dense_0']['kernel'].value"
  mu = lines[f"opt_state[0].mu{kernel}"]
  assert mu.endswith("[split over ['model'] by its placement, sharded over ['data'] by wus: "
                     "192 B per device of 1.5 KiB]"), mu  # [12, 32]: blocks [12, 16] over 4.
  assert lines[f"params{kernel}"].endswith("[split over ['model'] by its placement]")
  scale = lines["opt_state[0].mu['params']['LayerNorm_0']['scale']"]
  # Whole over "model" and updated alike on both model ranks: over data x model (1/8).
  assert scale.endswith("[sharded over ['data', 'model'] by wus: 16 B per device of 128 B]"), scale
  assert "of what the specs alone leave on a device" in str(plan), str(plan)
  assert "runs unchanged" not in str(plan) and "state is split" not in str(plan), str(plan)
  assert all(c.sharded for c in plan.clusters), str(plan)


@pytest.mark.parametrize("tx", [
    optax.chain(optax.clip_by_global_norm(1e-3), optax.adam(1e-2)),
    pytest.param(optax.lamb(1e-2), marks=pytest.mark.slow)], ids=["clip_by_global_norm", "lamb"])
def test_reductions_over_model_split_weights_within_summation_order(tx):
  """The global norm (and LAMB's per-tensor norms) of split weights: each rank's partial
  sum combined over "model" as well as over "data"; equal to the unmodified step up to
  summation order, the state still sharded over data x model."""
  mesh = make_mesh(4)
  model, params = linen_args(mesh, tx)
  step = classifier_step(model, tx)
  ref = out = (params, tx.init(params))
  ws = wus.jit(step)
  for b in batches(mesh, 3):
    ref, out = jax.jit(step)(*ref, b)[:2], ws(*out, b)[:2]
  assert_trees_equal(ref, wus.unshard(out), rtol=1e-5, atol=1e-7)
  assert_split_state(out[1], 4)
  assert all(c.sharded for c in ws.plan(*out, b).clusters)


def test_adafactor_factored_moments_of_split_matrices_within_summation_order():
  """Adafactor's row and column means of a split matrix: the mean over the split dim is a
  partial sum completed over "model". Equal to summation order, state sharded."""
  tx = optax.adafactor(1e-2, min_dim_size_to_factor=8)  # Factors the [16, 32] and [32, 16].
  ws, out, b = mlp_run(tx, rtol=1e-5, atol=1e-7)
  assert all(c.sharded for c in ws.plan(*out, b).clusters), str(ws.plan(*out, b))
  factored = [x for x in jax.tree.leaves(out[1], is_leaf=is_sharded) if np.ndim(x) == 1]
  assert len(factored) >= 4, factored  # v_row and v_col of both matrices.


@pytest.mark.parametrize("tx", [
    optax.apply_if_finite(optax.sgd(1e-2, momentum=0.9), 3),
    optax.MultiSteps(optax.sgd(1e-2, momentum=0.9), 2)], ids=["apply_if_finite", "multi_steps"])
def test_a_conditional_in_the_update_runs_on_blocks(tx):
  """The `cond` of apply_if_finite and MultiSteps around every tensor's update, reading
  model-split tensors: its branches run on each rank's blocks (the all-finite check an
  "and" completed over "model"), so the state is sharded over data x model. Bit for bit
  (`mlp_run` compares every step)."""
  ws, out, b = mlp_run(tx)
  plan = ws.plan(*out, b)
  assert not plan.unchanged and not plan.outside, str(plan)
  assert_split_state(out[1], 4)


@pytest.mark.parametrize("kind", ["auto", "explicit"])
@pytest.mark.parametrize("tx", [
    optax.apply_if_finite(optax.adam(1e-2), 2),
    optax.MultiSteps(optax.adam(1e-2), 2)], ids=["apply_if_finite", "multi_steps"])
def test_a_conditional_on_blocks_under_the_users_mesh(tx, kind):
  """Regression (fuzz case: TP on an Auto (3, 2, 1) mesh, apply_if_finite): a step called
  under `jax.set_mesh(mesh)`, as JAX's sharding guide calls steps (Explicit axes need it).
  The conditional's branches were traced on blocks inside the region's shard_map with the
  user's mesh as the context, against an index typed on the region's manual mesh: JAX
  refused (`lax.switch`'s clamp: "context mesh ... should match the aval mesh"), and the
  step ran unchanged with that error as the reason. Served, bit for bit (Adam)."""
  mesh = make_mesh(4, kind)
  rng = np.random.default_rng(0)

  def step(params, opt_state, batch):
    loss = lambda p: jnp.mean(jnp.tanh(batch @ p["w"] + p["b"]) ** 2)  # Column-parallel.
    updates, opt_state = tx.update(jax.grad(loss)(params), opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  with jax.set_mesh(mesh):
    params = {k: jax.device_put(0.3 * rng.standard_normal(shape).astype(np.float32),
                                NamedSharding(mesh, spec))
              for k, shape, spec in (("w", (16, 8), P(None, "model")), ("b", (8,), P("model")))}
    ws, ref = wus.jit(step), jax.jit(step)
    want = got = (params, tx.init(params))
    for _ in range(3):
      batch = jax.device_put(rng.standard_normal((8, 16)).astype(np.float32),
                             NamedSharding(mesh, P("data")))
      want, got = ref(*want, batch), ws(*got, batch)
    plan = ws.plan(*got, batch)
  assert_trees_equal(want, wus.unshard(got))
  assert not plan.unchanged, plan.unchanged
  assert_split_state(got[1], 4)


@pytest.mark.slow  # Muon's Newton-Schulz loop, compiled twice (a minute or more).
def test_muon_on_split_matrices_runs_as_jax_jit_the_rest_is_served():
  """Muon orthogonalizes each matrix in a `scan` over its whole dims, which a matrix
  split over "model" cannot give it (issue 29 item 6): each such update runs as jax.jit
  runs it, with the reason in the Plan, and the rest of the step is served (the biases'
  and LayerNorm's Adam state sharded over data x model). Bit for bit."""
  tx = optax.contrib.muon(1e-2)
  mesh = make_mesh(4)
  model, params = linen_args(mesh, tx)
  step, ws = classifier_step(model, tx), wus.jit(classifier_step(model, tx))
  ref = out = (params, tx.init(params))
  for b in batches(mesh, 3):
    ref, out = jax.jit(step)(*ref, b)[:2], ws(*out, b)[:2]
  assert_trees_equal(ref, wus.unshard(out))
  plan = ws.plan(*out, b)
  assert len(plan.outside) == 3, plan.outside  # The three kernels.
  whole = [why.verdict for why in plan.outside]
  assert all(isinstance(x, refusals.NeedsWhole) and x.primitive == "scan"
             and x.axes == ("model",) and re.fullmatch(r"float32\[1,\d+,\d+\]", x.aval)
             for x in whole), plan.outside
  assert all(re.match(r"scan at .* needs dim \d of float32\[1,\d+,\d+\] whole, which is "
                      r"split over \['model'\]", str(why)) for why in plan.outside), plan.outside
  kept = sharded(out[1])
  assert kept and all(x.ndim == 1 for x in kept), kept
  assert all(not is_sharded(x) for x in jax.tree.leaves(
      out[1], is_leaf=is_sharded) if np.ndim(x) == 2)


def test_unshard_state_target_and_lower_of_state_split_over_data_x_model():
  ws, (params, opt_state), batch, mesh = linen_step()
  whole = wus.unshard(opt_state)
  mu = whole[0].mu["params"]["Dense_0"]["kernel"].value
  assert mu.shape == (12, 32) and mu.sharding.spec == P(None, "model"), mu.sharding
  target = ws.state_target(params, opt_state, batch)
  mu_target = target[1][0].mu["params"]["Dense_0"]["kernel"].value
  assert mu_target.shape == (12, 32), mu_target
  lowered = ws.lower(params, whole, batch)  # Whole state: the steady-state program all the same.
  assert lowered.compile().memory_analysis() is not None
  again = ws(params, whole, batch)  # Whole state passed back: sharded on the way in.
  assert_trees_equal(wus.unshard(again[1]), wus.unshard(ws(params, opt_state, batch)[1]))


def test_checkpoint_saved_on_4x2_restored_on_2x2_through_state_target(tmp_path):
  """State saved with stock Orbax (`wus.checkpointable`) on (4, 2) restores on (2, 2)
  through `state_target` (same model, fewer data replicas), equal to the saved state, and
  trains on as jax.jit does from it, its state sharded over data x model again. (The
  checkpoint holds model-split state whole, laid out by its placement: `wus.sharded`'s
  `checkpointable`.)"""
  import orbax.checkpoint as ocp  # noqa: PLC0415
  tx = optax.adam(1e-2)
  ws, (params, opt_state), _, _ = linen_step(4, tx)
  ckptr = ocp.StandardCheckpointer()
  ckptr.save(tmp_path / "ckpt", wus.checkpointable({"params": params, "opt_state": opt_state}))
  ckptr.wait_until_finished()
  small = make_mesh(2)
  saved = wus.unshard((params, opt_state))
  whole = jax.tree.map(lambda x: jax.device_put(np.asarray(x), NamedSharding(
      small, x.sharding.spec)), saved)
  (batch,) = batches(small, 1, batch=8)
  step = classifier_step(LogicalMLP(), tx)
  ws2 = wus.jit(step)
  target_params, target_opt, _ = ws2.state_target(*whole, batch)
  restored = ckptr.restore(tmp_path / "ckpt", {"params": target_params, "opt_state": target_opt})
  assert_trees_equal(whole, wus.unshard((restored["params"], restored["opt_state"])))
  out = ws2(restored["params"], restored["opt_state"], batch)
  assert_trees_equal(jax.jit(step)(*whole, batch)[:2], wus.unshard(out[:2]))
  assert_split_state(out[1], 2)
