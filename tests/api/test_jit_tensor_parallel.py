"""`wus.jit`, `wus.nnx_jit` and `wus.filter_jit` on 2-D meshes (issue 29 item 2), on the
steps users write: a global-view step with the batch over "data" and the weights placed over
"model" (tensor parallelism) by linen's logical axis rules, `nnx.with_partitioning`, a
NamedSharding or `in_shardings`, Auto and Explicit axes. The update region runs manual over
both axes: each model rank's block of a split weight has its gradient reduce-scattered
over its data group and its optimizer state sharded over data x model. Each step runs
beside the unmodified step from the same inputs, bit for bit under the suite's flags
(Adam to a few ulps where a known XLA rewrite differs: `NNX_TXS`).
"""

from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import wus
from helpers import assert_trees_equal, classifier_step
from jit_tensor_parallel import (RULES, LogicalMLP, assert_split_state, batches, linen_args,
                                 make_mesh, mlp_run, mlp_step, run_both, sharded)


# --- linen, logical axis rules mapping "mlp" and "heads" to "model". --------------------


@pytest.mark.parametrize("n_data,tx", [  # Adam on 4 x 2 by default; the rest with --slow.
    pytest.param(4, optax.adam(1e-2), id="adam-4"),
    pytest.param(3, optax.adam(1e-2), id="adam-3", marks=pytest.mark.slow),
    pytest.param(4, optax.sgd(1e-2, momentum=0.9), id="momentum-4", marks=pytest.mark.slow),
    pytest.param(3, optax.sgd(1e-2, momentum=0.9), id="momentum-3", marks=pytest.mark.slow)])
def test_linen_logical_axis_rules_bit_for_bit_state_over_data_x_model(n_data, tx):
  mesh = make_mesh(n_data)
  model, params = linen_args(mesh, tx)
  assert params["params"]["Dense_0"]["kernel"].value.sharding.spec == P(None, "model")
  _, out = run_both(classifier_step(model, tx), wus.jit(classifier_step(model, tx)),
                     (params, tx.init(params)), batches(mesh, 3))
  assert_split_state(out[1], n_data)
  split_params = [x for x in jax.tree.leaves(params) if "model" in str(x.sharding.spec)]
  moments = len(jax.tree.leaves(tx.init(params))) // len(jax.tree.leaves(params))
  assert len(split_params) == 4  # Dense_0 kernel and bias, Dense_1 and Dense_2 kernels.
  assert len([x for x in sharded(out[1]) if x.layout.split_axes == ("model",)]) == (
      moments * len(split_params))


# --- Flax NNX, the "Scale up on multiple devices" guide's DotReluDot, shrunk. ----------


class DotReluDot(nnx.Module):
  """The guide's model (depth 1024 -> 32): a column-parallel Linear, a row-parallel Param,
  and a constraint on the activations over ("data", "model")."""

  def __init__(self, depth: int, rngs: nnx.Rngs):
    init_fn = nnx.initializers.lecun_normal()
    self.dot1 = nnx.Linear(
        depth, depth,
        kernel_init=nnx.with_partitioning(init_fn, (None, "model")),
        use_bias=False,
        rngs=rngs)
    self.w2 = nnx.Param(
        init_fn(rngs.params(), (depth, depth)),
        out_sharding=("model", None),  # The guide's `sharding=`, renamed in Flax 0.12.
    )

  def __call__(self, x: jax.Array):
    y = self.dot1(x)
    y = jax.nn.relu(y)
    y = jax.lax.with_sharding_constraint(y, P("data", "model"))
    z = jnp.dot(y, self.w2[...])
    return z


def train_step(model, optimizer, x, y):
  def loss_fn(model: DotReluDot):
    y_pred = model(x)
    return jnp.mean((y_pred - y) ** 2)

  loss, grads = nnx.value_and_grad(loss_fn)(model)
  optimizer.update(model, grads)
  return loss


def _nnx_run(mesh, tx, steps=3, depth=32, **tol):
  def make():
    with jax.set_mesh(mesh):
      model = DotReluDot(depth, rngs=nnx.Rngs(0))
      return model, nnx.Optimizer(model, tx, wrt=nnx.Param)
  ref, out = make(), make()
  assert out[0].dot1.kernel[...].sharding.spec == P(None, "model")
  assert out[0].w2[...].sharding.spec == P("model", None)
  rngs = nnx.Rngs(1)
  ws = wus.nnx_jit(train_step)
  with jax.set_mesh(mesh):
    for _ in range(steps):
      x = jax.device_put(rngs.normal((4 * mesh.shape["data"], depth)), P("data", None))
      y = jax.device_put(rngs.normal((4 * mesh.shape["data"], depth)), P("data", None))
      assert_trees_equal(nnx.jit(train_step)(*ref, x, y), ws(*out, x, y), **tol)
  assert_trees_equal(nnx.state(ref), wus.unshard(nnx.state(out)), **tol)
  return out, ws, (x, y)


# Adam rounds a few ulps off on these shapes, as on a 1-D mesh: the two kernels' blocks
# ([32, 16] and [16, 32]) have shards of one shape, XLA merges their bias corrections'
# broadcasts and rewrites one division into a multiplication by the reciprocal (the known
# xfail test_tensor_parallel.py::test_equal_shards_of_different_shapes_round_as_the_
# unmodified_step). SGD with momentum divides by nothing: bit for bit.


NNX_TXS = [(optax.sgd(1e-3, momentum=0.9), {}), (optax.adam(1e-3), dict(rtol=1e-6, atol=1e-9))]


@pytest.mark.parametrize("n_data", [4, 3])
@pytest.mark.parametrize("tx,tol", NNX_TXS, ids=["momentum", "adam"])
def test_nnx_guide_dot_relu_dot_state_over_data_x_model(n_data, tx, tol):
  out, _, _ = _nnx_run(make_mesh(n_data), tx, **tol)
  state = nnx.state(out[1], nnx.optimizer.OptState)
  assert_split_state(state, n_data)
  moments = 2 if tol else 1
  assert len([x for x in sharded(state) if x.layout.split_axes == ("model",)]) == 2 * moments


# --- Explicit axes: the guide's ExplicitDotReluDot. -----------------------------------


class ExplicitDotReluDot(nnx.Module):
  """The "Scale up on multiple devices" guide's Explicit-sharding model, shrunk."""

  def __init__(self, depth: int, rngs: nnx.Rngs):
    init_fn = nnx.initializers.lecun_normal()
    self.dot1 = nnx.Linear(
        depth, depth,
        kernel_init=partial(init_fn, out_sharding=P(None, "model")),
        use_bias=False,
        rngs=rngs)
    self.w2 = nnx.Param(
        init_fn(rngs.params(), (depth, depth), out_sharding=P("model", None)),
    )
    self.b2 = nnx.Param(jnp.zeros((depth, ), out_sharding=P(None,)))

  def __call__(self, x: jax.Array):
    y = self.dot1(x)
    y = jax.nn.relu(y)
    z = jnp.dot(y, self.w2[...], out_sharding=P("data", None))
    z = z + self.b2
    return z


@pytest.mark.parametrize("n_data", [4, 3])
@pytest.mark.parametrize("tx,tol", NNX_TXS, ids=["momentum", "adam"])
def test_explicit_axes_guide_model_state_over_data_x_model(n_data, tx, tol):
  mesh = make_mesh(n_data, "explicit")

  def make():
    with jax.set_mesh(mesh):
      model = ExplicitDotReluDot(32, rngs=nnx.Rngs(0))
      return model, nnx.Optimizer(model, tx, wrt=nnx.Param)
  ref, out = make(), make()
  ws, rngs = wus.nnx_jit(train_step), nnx.Rngs(1)
  with jax.set_mesh(mesh):
    for _ in range(3):
      x = jax.device_put(rngs.normal((4 * n_data, 32)), P("data", None))
      y = jax.device_put(rngs.normal((4 * n_data, 32)), P("data", None))
      assert_trees_equal(nnx.jit(train_step)(*ref, x, y), ws(*out, x, y), **tol)
    plan = ws.plan(*out, x, y)
  assert_trees_equal(nnx.state(ref), wus.unshard(nnx.state(out)), **tol)
  state = nnx.state(out[1], nnx.optimizer.OptState)
  assert_split_state(state, n_data)
  assert "by its placement, sharded over ['data'] by wus" in plan.details(), plan.details()


# --- Equinox: wus.filter_jit. --------------------------------------------------------


def test_equinox_mlp_placed_over_model_under_filter_jit():
  """An `eqx.nn.MLP` whose hidden layer is split Megatron-style by the arrays' placements,
  trained by an `eqx.filter_jit` step (Equinox's docs' shape): bit for bit with SGD with
  momentum, the split layers' state over data x model."""
  import equinox as eqx  # noqa: PLC0415
  mesh, tx = make_mesh(4), optax.sgd(1e-2, momentum=0.9)
  specs = {(32, 16): P("model", None), (16, 32): P(None, "model"), (32,): P("model")}

  def place(x):
    return jax.device_put(x, NamedSharding(mesh, specs.get(x.shape, P()))) if eqx.is_array(
        x) else x
  model = jax.tree.map(place, eqx.nn.MLP(16, 16, 32, 1, key=jax.random.key(0)))

  def step(model, opt_state, x, y):
    def loss(m):
      return jnp.mean((jax.vmap(m)(x) - y) ** 2)
    value, grads = eqx.filter_value_and_grad(loss)(model)
    updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state, value
  r, data = np.random.RandomState(0), NamedSharding(mesh, P("data"))
  ref = out = (model, tx.init(eqx.filter(model, eqx.is_array)))
  ws = wus.filter_jit(step)
  for _ in range(3):
    x, y = (jax.device_put(r.randn(16, 16).astype(np.float32), data) for _ in range(2))
    *ref, ref_loss = eqx.filter_jit(step)(*ref, x, y)
    *out, out_loss = ws(*out, x, y)
    assert_trees_equal(ref_loss, out_loss)
  assert_trees_equal(eqx.filter(ref, eqx.is_array), eqx.filter(wus.unshard(out), eqx.is_array))
  assert_split_state(out[1], 4)


# --- Whole weights, in_shardings, constraints. ----------------------------------------


def test_whole_weights_on_a_2d_mesh_are_served_as_on_1d():
  """Weights whole over both axes, the batch over "data" of a (4, 2) mesh: every replica
  of "model" repeats the update, so the state is sharded over data x model (8 shards, each
  model rank keeping its part of its data shard), bit for bit."""
  tx = optax.adam(1e-2)
  mesh = make_mesh(4)
  model = LogicalMLP()
  with nn.logical_axis_rules(RULES):
    params = model.init(jax.random.key(0), jnp.ones((1, 12)))
  params = jax.device_put(nn.unbox(params), NamedSharding(mesh, P()))
  step = classifier_step(model, tx)
  _, out = run_both(step, wus.jit(step), (params, tx.init(params)), batches(mesh, 3))
  state = sharded(out[1])
  assert state and all(x.layout.split_axes == () for x in state)
  assert all(x.format.num_shards == 8 for x in state)
  assert all(x.layout.data_sharding.spec == P(("data", "model")) for x in state), state


def test_weights_placed_by_in_shardings():
  """Whole numpy weights, their placement given by `in_shardings` (and kept by
  `out_shardings`) as jax.jit takes them."""
  tx = optax.sgd(1e-2, momentum=0.9)
  mesh = make_mesh(4)
  model, params = linen_args(mesh, tx)
  shardings = jax.tree.map(lambda x: x.sharding, params)
  opt_shardings = jax.tree.map(lambda x: x.sharding, tx.init(params))
  host = jax.tree.map(np.asarray, params)
  kw = dict(in_shardings=(shardings, opt_shardings, NamedSharding(mesh, P("data"))),
            out_shardings=(shardings, opt_shardings, NamedSharding(mesh, P())))
  step = classifier_step(model, tx)
  ref = out = (host, jax.tree.map(np.asarray, tx.init(params)))
  ws = wus.jit(step, **kw)
  for b in batches(mesh, 3):
    ref, out = jax.jit(step, **kw)(*ref, b)[:2], ws(*out, b)[:2]
  assert_trees_equal(ref, wus.unshard(out))
  assert_split_state(out[1], 4)


def test_a_constraint_on_the_model_axis_inside_the_update_keeps_its_meaning():
  """The step lays its new weights out over "model" (as MaxText and the Flax guides'
  `with_sharding_constraint(state, specs)` do): the region keeps that layout for the
  blocks it computes, the weights come back placed so, and the state is sharded."""
  tx = optax.adam(1e-2)
  mesh = make_mesh(4)
  model, params = linen_args(mesh, tx)
  specs = jax.tree.map(lambda x: x.sharding, params)

  def step(params, opt_state, batch):
    params, opt_state, metrics = classifier_step(model, tx)(params, opt_state, batch)
    return jax.lax.with_sharding_constraint(params, specs), opt_state, metrics
  _, out = run_both(step, wus.jit(step), (params, tx.init(params)), batches(mesh, 3))
  kernel = out[0]["params"]["Dense_0"]["kernel"].value
  assert kernel.sharding.spec == P(None, "model"), kernel.sharding
  assert_split_state(out[1], 4)


def test_a_constraint_replicating_split_weights_keeps_its_meaning():
  """A step that lays its new weights out whole (`with_sharding_constraint(params, P())`)
  although they came in split over "model": no block can be laid out so, and the step runs
  as jax.jit runs it, the weights coming back whole, with the reason in the Plan."""
  tx = optax.sgd(1e-2, momentum=0.9)
  inner = mlp_step(tx)

  def step(params, opt_state, batch):
    params, opt_state, loss = inner(params, opt_state, batch)
    whole = NamedSharding(make_mesh(4), P())
    return jax.lax.with_sharding_constraint(params, whole), opt_state, loss
  ws, out, b = mlp_run(tx, lambda tx: step)
  assert out[0]["w1"].sharding.is_fully_replicated
  assert "needs dim" in str(ws.plan(*out, b)) and not sharded(out)
