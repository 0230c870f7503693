"""`wus.jit`, `wus.filter_jit` and `wus.nnx_jit` on steps as Flax, Equinox and optax publish
them (issue 28): meshes with size-1 axes their weights are annotated for, replicating
sharding constraints inside the step, JAX refs, and state that the published evaluation
code reads outside the step. Each runs beside the unmodified step from the same inputs:
bit for bit under the suite's flags, the optimizer state at most 1.05 x V/N per device
plus the shards' padding.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import wus
from helpers import assert_trees_equal, classifier_step
from wus.sharded import is_sharded


def _auto_mesh(shape, names):
  return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))


def _batches(mesh, n, batch=48, features=12, batch_axes="data"):
  rng = np.random.default_rng(0)
  data = NamedSharding(mesh, P(batch_axes))
  return [{"x": jax.device_put(rng.normal(size=(batch, features)).astype(np.float32), data),
           "y": jax.device_put(rng.integers(0, 10, size=(batch,)).astype(np.int32), data)}
          for _ in range(n)]


def assert_state_sharded(state, n):
  """Optimizer state per device <= 1.05 x V/N + the shards' padding; every float tensor of
  more than n elements sharded."""
  leaves = [x for x in jax.tree.leaves(state, is_leaf=is_sharded) if hasattr(x, "dtype")]
  big = [x for x in leaves if jnp.issubdtype(x.dtype, jnp.floating) and x.size > n]
  assert big and all(is_sharded(x) for x in big), [type(x).__name__ for x in big]
  whole = sum(x.nbytes for x in leaves)
  per_device = sum(x.nbytes_per_device if is_sharded(x) else x.nbytes for x in leaves)
  padding = sum(x.nbytes_per_device - x.nbytes / n for x in big)
  assert per_device <= 1.05 * whole / n + padding, (per_device, whole, padding)


class LogicalMLP(nn.Module):
  """Flax's logical axis annotations (the "Scale up Flax modules" guide), shrunk."""

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(32, kernel_init=nn.with_logical_partitioning(
        nn.initializers.lecun_normal(), ("embed", "mlp")))(x)
    x = nn.LayerNorm()(nn.relu(x))
    return nn.Dense(10, kernel_init=nn.with_logical_partitioning(
        nn.initializers.lecun_normal(), ("mlp", "embed")))(x)


def _run_both(step, ws, args, batches):
  ref = out = args
  for b in batches:
    *ref, ref_aux = jax.jit(step)(*ref, b)
    *out, out_aux = ws(*out, b)
    assert_trees_equal(ref_aux, out_aux)
  assert_trees_equal(ref, wus.unshard(out))
  return ref, out


def test_linen_logical_axis_rules_on_a_mesh_with_size_1_axes():
  """A ("data", "fsdp", "tensor") mesh of shape (8, 1, 1) with the weights placed by logical
  axis rules for the unused axes: served as the 8-device data-parallel mesh, with the
  Plan of the 1-D mesh."""
  mesh = _auto_mesh((8, 1, 1), ("data", "fsdp", "tensor"))
  rules = (("batch", "data"), ("embed", "fsdp"), ("mlp", "tensor"))
  model, tx = LogicalMLP(), optax.adam(1e-2)
  with nn.logical_axis_rules(rules):
    abstract = jax.eval_shape(model.init, jax.random.key(0), jnp.ones((1, 12)))
    shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, rules)
  params = jax.jit(model.init, out_shardings=shardings)(jax.random.key(0), jnp.ones((1, 12)))
  assert params["params"]["Dense_0"]["kernel"].value.sharding.spec == P("fsdp", "tensor")
  step, traces = classifier_step(model, tx), []

  @functools.wraps(step)
  def counted(*args):
    traces.append(1)
    return step(*args)
  ws = wus.jit(counted)
  batches = _batches(mesh, 3)
  _, out = _run_both(step, ws, (params, tx.init(params)), batches)
  assert_state_sharded(out[1], 8)
  again = wus.jit(counted)
  new = again(params, tx.init(params), batches[0])
  first = len(traces)
  again(*new[:2], batches[1])  # Weights now placed P(), not P("fsdp", "tensor"): one program.
  assert len(traces) == first, "recompiled for a placement over size-1 axes"
  flat = _auto_mesh((8,), ("data",))
  whole = jax.device_put(jax.tree.map(np.asarray, params), NamedSharding(flat, P()))
  flat_batch = jax.device_put(jax.tree.map(np.asarray, batches[0]), NamedSharding(flat, P("data")))
  assert str(ws.plan(params, tx.init(params), batches[0])) == str(
      wus.jit(step).plan(whole, tx.init(whole), flat_batch))


class NnxMLP(nnx.Module):
  """NNX layers with `out_sharding` metadata for a ("data", "model") mesh (the NNX
  "Scale up" guide's annotations, shrunk)."""

  def __init__(self, *, rngs):
    self.l1 = nnx.Linear(12, 32, rngs=rngs, kernel_metadata={"out_sharding": (None, "model")},
                         bias_metadata={"out_sharding": ("model",)})
    self.ln = nnx.LayerNorm(32, rngs=rngs)
    self.l2 = nnx.Linear(32, 10, rngs=rngs, kernel_metadata={"out_sharding": ("model", None)})

  def __call__(self, x):
    return self.l2(self.ln(nnx.relu(self.l1(x))))


def _nnx_step(model, optimizer, batch):
  def loss_fn(model):
    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
  loss, grads = nnx.value_and_grad(loss_fn)(model)
  optimizer.update(model, grads)
  return loss


def test_nnx_out_sharding_metadata_on_an_8_by_1_mesh():
  mesh = _auto_mesh((8, 1), ("data", "model"))

  def make():
    with jax.set_mesh(mesh):
      model = NnxMLP(rngs=nnx.Rngs(0))
      return model, nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
  ref, out = make(), make()
  assert out[0].l1.kernel[...].sharding.spec == P(None, "model")
  ref_step, ws = nnx.jit(_nnx_step), wus.nnx_jit(_nnx_step)
  with jax.set_mesh(mesh):
    for b in _batches(mesh, 3, batch=16):
      assert ref_step(*ref, b) == ws(*out, b)
  assert_trees_equal(nnx.state(ref), wus.unshard(nnx.state(out)))
  assert_state_sharded(nnx.state(out[1], nnx.optimizer.OptState), 8)
  plan = ws.plan(*out, b)
  text = str(plan) + plan.details()
  assert "split over mesh axes itself" not in text
  assert "model['l1']['kernel'].value" in text and "optimizer['opt_state']" in text, text
  assert "states[" not in text and "site-packages" not in text and __file__ in text


# --- State the published evaluation code reads outside the step. ----------------------


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(10)(nn.LayerNorm()(nn.relu(nn.Dense(32)(x))))


def _loss_accuracy(model, params, batch):
  logits = model.apply(params, batch["x"])
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
  return loss, (logits.argmax(-1) == batch["y"]).mean()


def test_optax_lookahead_slow_weights_evaluated_as_its_notebook_does():
  """optax's lookahead notebook: `loss_accuracy(params.slow, ...)` under jax.jit, on the
  slow weights wus keeps sharded (only the update reads them)."""
  mesh = _auto_mesh((8,), ("data",))
  model = MLP()
  tx = optax.lookahead(optax.adam(1e-2), sync_period=2, slow_step_size=0.5)
  params = jax.device_put(model.init(jax.random.key(0), jnp.ones((1, 12))),
                          NamedSharding(mesh, P()))
  params = optax.LookaheadParams.init_synced(params)

  def train_step(params, opt_state, batch):
    grads = jax.grad(lambda p: _loss_accuracy(model, p, batch)[0])(params.fast)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, None
  batches = _batches(mesh, 3)
  ref, out = _run_both(train_step, wus.jit(train_step), (params, tx.init(params)), batches)
  assert any(is_sharded(x) for x in jax.tree.leaves(out[0].slow, is_leaf=is_sharded))
  assert_state_sharded(out[1], 8)
  evaluate = jax.jit(lambda p, b: _loss_accuracy(model, p, b))
  assert_trees_equal(evaluate(ref[0].slow, batches[0]), evaluate(out[0].slow, batches[0]))


def test_state_replicated_on_a_mesh_of_its_own_over_the_batch_devices():
  """Keras's "Multi-GPU distributed training with JAX" guide: the state replicated on
  `Mesh(devices, ("_",))`, the batch split on `Mesh(devices, ("batch",))`, the same devices;
  jax.jit takes both. wus plans on the batch's mesh and shards the update (it took the
  first mesh and failed with a KeyError, then left every update outside the region, its
  values typed on the other mesh's Auto axes). Here with Flax and optax."""
  devices = np.array(jax.devices()[:8])
  replicated = NamedSharding(jax.sharding.Mesh(devices, ("_",)), P())
  batch_mesh = jax.sharding.Mesh(devices, ("batch",))
  model, tx = MLP(), optax.adam(1e-2)
  params = jax.device_put(model.init(jax.random.key(0), jnp.ones((1, 12))), replicated)
  opt_state = jax.device_put(tx.init(params), replicated)
  train_step = classifier_step(model, tx)
  batches = _batches(batch_mesh, 3, batch_axes="batch")
  ws = wus.jit(train_step)
  plan = ws.plan(params, opt_state, batches[0])
  assert not plan.unchanged and plan.axes == ("batch",), plan
  _, out = _run_both(train_step, ws, (params, opt_state), batches)
  assert_state_sharded(out[1], 8)


def test_schedule_free_eval_params_as_optax_documents_them():
  """`optax.contrib.schedule_free_eval_params(opt_state, params)` on the step's outputs,
  then the user's jitted evaluation."""
  mesh = _auto_mesh((8,), ("data",))
  model = MLP()
  tx = optax.contrib.schedule_free_adamw(1e-2, warmup_steps=2)
  params = jax.device_put(model.init(jax.random.key(0), jnp.ones((1, 12))),
                          NamedSharding(mesh, P()))
  step = classifier_step(model, tx)
  batches = _batches(mesh, 3)
  ref, out = _run_both(step, wus.jit(step), (params, tx.init(params)), batches)
  assert_state_sharded(out[1], 8)
  ref_eval = optax.contrib.schedule_free_eval_params(ref[1], ref[0])
  out_eval = optax.contrib.schedule_free_eval_params(out[1], out[0])
  assert_trees_equal(ref_eval, out_eval)
  evaluate = jax.jit(lambda p, b: _loss_accuracy(model, p, b))
  assert_trees_equal(evaluate(ref_eval, batches[0]), evaluate(out_eval, batches[0]))


# --- Sharding constraints inside the step. ------------------------------------------------


@pytest.mark.parametrize("shape", [(8,), pytest.param((8, 1), marks=pytest.mark.slow)])
def test_equinox_data_parallel_example_with_filter_shard(shape):
  """Equinox's data-parallel example (examples/parallelism), shrunk: `eqx.filter_shard` of
  the model and optimizer state to `replicated` at the start and end of the step. The
  optimizer state is sharded anyway; the weights come back whole, as asked. On a
  ("batch", "model") mesh of shape (8, 1) the same."""
  eqx = pytest.importorskip("equinox")
  mesh = _auto_mesh(shape, ("batch", "model")[:len(shape)])
  sharding = NamedSharding(mesh, P("batch"))
  replicated = NamedSharding(mesh, P())
  model = eqx.nn.MLP(in_size=12, out_size=10, width_size=32, depth=2, key=jax.random.key(0))
  optim = optax.adam(1e-2)

  def compute_loss(model, x, y):
    pred_y = jax.vmap(model)(x)
    return jnp.mean((y - pred_y) ** 2)

  def train_step(model, opt_state, x, y):
    model, opt_state = eqx.filter_shard((model, opt_state), replicated)
    x, y = eqx.filter_shard((x, y), sharding)
    grads = eqx.filter_grad(compute_loss)(model, x, y)
    updates, opt_state = optim.update(grads, opt_state)
    model = eqx.apply_updates(model, updates)
    model, opt_state = eqx.filter_shard((model, opt_state), replicated)
    return model, opt_state

  rng = np.random.default_rng(0)
  data = [eqx.filter_shard((rng.normal(size=(16, 12)).astype(np.float32),
                            rng.normal(size=(16, 10)).astype(np.float32)), sharding)
          for _ in range(3)]
  ref = out = (model, optim.init(eqx.filter(model, eqx.is_array)))
  ref_step = eqx.filter_jit(train_step)
  ws = wus.filter_jit(train_step)
  for x, y in data:
    ref, out = ref_step(*ref, x, y), ws(*out, x, y)
  assert_trees_equal(eqx.filter(ref, eqx.is_array), eqx.filter(wus.unshard(out), eqx.is_array))
  assert_state_sharded(out[1], 8)
  weights = jax.tree.leaves(eqx.filter(out[0], eqx.is_array))
  assert all(w.sharding.is_fully_replicated for w in weights)
  # The Plan names the step's parameters and the user's lines (issue 28 item 5).
  plan = ws.plan(*out, x, y)
  text = str(plan) + plan.details()
  assert "model.layers[0].weight" in text and "opt_state[0].mu.layers[0].weight" in text, text
  assert "site-packages" not in text and "sharding_constraint" not in text, text
  assert __file__ in text


@pytest.mark.parametrize("constraint", [
    pytest.param(lambda mesh: P(), id="P()"),
    pytest.param(lambda mesh: NamedSharding(mesh, P()), id="NamedSharding(mesh, P())",
                 marks=pytest.mark.slow),
    pytest.param(lambda mesh: NamedSharding(mesh, P(None, "model")), id="size-1 axis"),
])
def test_with_sharding_constraint_replicating_weights_and_state(constraint):
  """`jax.lax.with_sharding_constraint` on the new params and optimizer state, replicating
  them (or naming only a size-1 axis) on an (8, 1) mesh: no split, sharded all the same."""
  mesh = _auto_mesh((8, 1), ("data", "model"))
  model, tx = MLP(), optax.adam(1e-2)
  inner = classifier_step(model, tx)

  def train_step(params, opt_state, batch):
    params, opt_state, loss = inner(params, opt_state, batch)
    spec = constraint(mesh)

    def place(x):  # The size-1 axis on matrices' columns.
      return jax.lax.with_sharding_constraint(x, spec if x.ndim == 2 else P())
    return jax.tree.map(place, params), jax.tree.map(place, opt_state), loss

  params = jax.device_put(model.init(jax.random.key(0), jnp.ones((1, 12))),
                          NamedSharding(mesh, P()))
  with jax.set_mesh(mesh):
    _, out = _run_both(train_step, wus.jit(train_step), (params, optax.adam(1e-2).init(params)),
                       _batches(mesh, 3))
  assert_state_sharded(out[1], 8)


# --- JAX refs. ---------------------------------------------------------------------------


def _ref_loss(params, x, y):
  return jnp.mean((jnp.tanh(x @ params["w"] + params["b"]) - y) ** 2)


def _ref_data(mesh, n=3):
  rng = np.random.default_rng(0)
  data = NamedSharding(mesh, P("data"))
  return [{"x": jax.device_put(rng.normal(size=(16, 12)).astype(np.float32), data),
           "y": jax.device_put(rng.normal(size=(16, 32)).astype(np.float32), data)}
          for _ in range(n)]


def test_a_step_accumulating_its_loss_in_a_ref_is_sharded():
  """A ref the step makes (`jax.new_ref`, `ref[...] +=`, as the JAX refs guide writes
  accumulators): the update reads and writes ordinary values, so it is sharded."""
  mesh = _auto_mesh((8,), ("data",))
  tx = optax.adam(1e-2)

  def train_step(params, opt_state, batch):
    total = jax.new_ref(jnp.zeros(()))
    for half in (slice(0, 8), slice(8, 16)):
      total[...] += _ref_loss(params, batch["x"][half], batch["y"][half])
    grads = jax.grad(_ref_loss)(params, batch["x"], batch["y"])
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, total[...] / 2

  params = jax.device_put({"w": 0.1 * jnp.ones((12, 32)), "b": jnp.zeros((32,))},
                          NamedSharding(mesh, P()))
  _, out = _run_both(train_step, wus.jit(train_step), (params, tx.init(params)),
                     _ref_data(mesh))
  assert_state_sharded(out[1], 8)


def test_a_step_writing_weights_into_refs_runs_as_jax_jit_with_the_reason():
  """Weights passed as refs and written in place (`ref[...] = new`): the step runs as
  jax.jit runs it, never an error, and the Plan names the ref."""
  mesh = _auto_mesh((8,), ("data",))
  tx = optax.adam(1e-2)

  def train_step(refs, opt_state, batch):
    params = jax.tree.map(lambda r: r[...], refs)
    grads = jax.grad(_ref_loss)(params, batch["x"], batch["y"])
    updates, opt_state = tx.update(grads, opt_state, params)
    jax.tree.map(lambda r, w: r.__setitem__(..., w), refs, optax.apply_updates(params, updates))
    return opt_state

  params = jax.device_put({"w": 0.1 * jnp.ones((12, 32)), "b": jnp.zeros((32,))},
                          NamedSharding(mesh, P()))
  ref_refs, refs = jax.tree.map(jax.new_ref, params), jax.tree.map(jax.new_ref, params)
  ref_state = state = tx.init(params)
  ws = wus.jit(train_step)
  for b in _ref_data(mesh):
    ref_state, state = jax.jit(train_step)(ref_refs, ref_state, b), ws(refs, state, b)
  assert_trees_equal((jax.tree.map(lambda r: r[...], ref_refs), ref_state),
                     (jax.tree.map(lambda r: r[...], refs), state))
  assert "JAX refs it does not create (refs['b'])" in str(ws.plan(refs, state, b))


def test_a_constraint_splitting_state_over_the_batch_is_honoured():
  """ZeRO-1 written by hand (the new optimizer state constrained to P("data") where it
  divides): GSPMD keeps the user's layout, the step never raises, and once the state
  comes back split the Plan says it is split by its placement (FSDP, whose constraint
  runs outside the update region) and wus shards the rest."""
  mesh = _auto_mesh((8,), ("data",))
  model, tx = MLP(), optax.adam(1e-2)
  inner = classifier_step(model, tx)

  def train_step(params, opt_state, batch):
    params, opt_state, loss = inner(params, opt_state, batch)
    opt_state = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, NamedSharding(
        mesh, P("data") if x.ndim and x.shape[0] % 8 == 0 else P())), opt_state)
    return params, opt_state, loss

  params = jax.device_put(model.init(jax.random.key(0), jnp.ones((1, 12))),
                          NamedSharding(mesh, P()))
  ws = wus.jit(train_step)
  batches = _batches(mesh, 3)
  _, out = _run_both(train_step, ws, (params, tx.init(params)), batches)
  kernel = out[1][0].mu["params"]["Dense_0"]["kernel"]  # [32, 10]: split as the user asked.
  assert kernel.sharding.spec == P("data")
  lines = {ln.split()[0]: ln for ln in ws.plan(*out[:2], batches[0]).details().split(
      "\ninputs:\n")[1].splitlines() if ln.startswith("    ")}
  assert "FSDP over ['data']" in lines["opt_state[0].mu['params']['Dense_0']['kernel']"]


def test_jax_docs_data_parallel_step_returning_only_its_new_params():
  """The JAX docs' "Distributed arrays and automatic parallelization", 8-way batch data
  parallelism, shrunk: the params a list of (W, b) pairs placed replicated, the batch an
  (inputs, targets) pair split over the mesh, `train_step(params, batch)` returning only
  the new params (SGD written by hand). Every layer's next value is found (the second
  layer's pair has the batch's tree structure, not its shapes) and the weight update
  runs on shards; bit for bit over 3 steps."""
  mesh = jax.make_mesh((8,), ("batch",))  # As the docs make it: Explicit axes.
  sizes = [24, 16, 16, 16, 4]
  keys = jax.random.split(jax.random.key(0), len(sizes) - 1)
  params = [(jax.random.normal(k, (m, n)) / jnp.sqrt(m), jax.random.normal(k, (n,)))
            for k, m, n in zip(keys, sizes[:-1], sizes[1:], strict=True)]

  def predict(params, inputs):
    for w, b in params:
      outputs = jnp.dot(inputs, w) + b
      inputs = jax.nn.relu(outputs)
    return outputs

  def loss(params, batch):
    inputs, targets = batch
    return jnp.mean(jnp.sum((predict(params, inputs) - targets) ** 2, axis=-1))

  def train_step(params, batch):
    grads = jax.grad(loss)(params, batch)
    return [(w - 0.005 * dw, b - 0.005 * db) for (w, b), (dw, db) in zip(params, grads)]

  params = jax.device_put(params, NamedSharding(mesh, P()))
  rng = np.random.default_rng(0)
  batches = [jax.device_put((rng.standard_normal((32, 24)).astype(np.float32),
                             rng.standard_normal((32, 4)).astype(np.float32)),
                            NamedSharding(mesh, P("batch"))) for _ in range(3)]
  ws, ref, out = wus.jit(train_step), params, params
  for b in batches:
    ref, out = jax.jit(train_step)(ref, b), ws(out, b)
  assert_trees_equal(ref, wus.unshard(out))
  plan = ws.plan(out, batches[0])
  assert not plan.unchanged, plan.unchanged
  assert all(i.matched for i in plan.inputs if i.name.startswith("params")), plan.details()
