"""`wus.nnx_jit`, `wus.filter_jit` and `wus.jit` take every keyword `nnx.jit`,
`equinox.filter_jit` and `jax.jit` take (issue 40 item 4), each run beside the unmodified
front end with the same keywords from the same inputs: bit for bit under the suite's
flags, donated buffers consumed where the front end consumes them.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import wus
from helpers import assert_trees_equal
from wus.analysis import refusals
from wus.sharded import is_sharded


def _mesh():
  return jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))


def _batches(mesh, n, batch=16):
  rng = np.random.default_rng(0)
  data = NamedSharding(mesh, P("data"))
  return [{"x": jax.device_put(rng.normal(size=(batch, 12)).astype(np.float32), data),
           "y": jax.device_put(rng.integers(0, 10, batch).astype(np.int32), data)}
          for _ in range(n)]


class MLP(nnx.Module):
  def __init__(self, *, rngs):
    self.l1 = nnx.Linear(12, 32, rngs=rngs)
    self.dropout = nnx.Dropout(0.5, rngs=rngs)
    self.l2 = nnx.Linear(32, 10, rngs=rngs)

  def __call__(self, x):
    return self.l2(self.dropout(nnx.relu(self.l1(x))))


def _train_step(model, optimizer, batch, loss_fn, smoothing=0.0):
  """The NNX tutorials' step, with a static loss (a function) and a static float."""
  def loss(model):
    logits = model(batch["x"])
    labels = optax.smooth_labels(jax.nn.one_hot(batch["y"], 10), smoothing)
    return loss_fn(logits, labels).mean()
  value, grads = nnx.value_and_grad(loss)(model)
  optimizer.update(model, grads)
  return value


def _make():
  model = MLP(rngs=nnx.Rngs(0))
  return model, nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)


def _opt_leaves(optimizer):
  return [x for x in jax.tree.leaves(nnx.state(optimizer, nnx.optimizer.OptState),
                                     is_leaf=is_sharded) if x.size > 8]


@pytest.mark.parametrize("keywords", [
    dict(static_argnames=("loss_fn", "smoothing"), donate_argnames=("model", "optimizer")),
    dict(static_argnums=(3, 4), donate_argnums=(0, 1)),
    pytest.param(dict(static_argnames="loss_fn", donate_argnums=1, keep_unused=True),
                 marks=pytest.mark.slow),
], ids=["names", "numbers", "mixed"])
def test_nnx_step_with_static_and_donated_arguments(keywords):
  """Static arguments passed by position and by keyword, donated model and optimizer: as
  `nnx.jit` with the same keywords; each donated state consumed by the call, the
  optimizer state sharded."""
  mesh = _mesh()
  ref, out = _make(), _make()
  ref_step = nnx.jit(_train_step, **keywords)
  ws = wus.nnx_jit(_train_step, **keywords)
  static = "smoothing" in keywords.get("static_argnames", ()) or "static_argnums" in keywords
  calls = [((optax.softmax_cross_entropy,), {}),
           ((), {"loss_fn": optax.softmax_cross_entropy}),
           ((optax.softmax_cross_entropy, 0.1) if static else (optax.softmax_cross_entropy,),
            {})]
  for k, (b, (extra, kw)) in enumerate(zip(_batches(mesh, 3), calls, strict=True)):
    ref_params, out_params = ref[0].l1.kernel[...], out[0].l1.kernel[...]
    ref_opt, out_opt = _opt_leaves(ref[1]), _opt_leaves(out[1])
    assert ref_step(*ref, b, *extra, **kw) == ws(*out, b, *extra, **kw)
    donated = [k for k in ("model", "optimizer") if k in keywords.get("donate_argnames", ())]
    donated += [("model", "optimizer")[k] for k in np.atleast_1d(
        keywords.get("donate_argnums", ())).tolist()]
    assert ref_params.is_deleted() == out_params.is_deleted() == ("model" in donated)
    # The first call copies the whole optimizer state into shards (nothing to donate).
    assert all(x.is_deleted() == ("optimizer" in donated) for x in ref_opt)
    assert all(getattr(x, "data", x).is_deleted() == ("optimizer" in donated and k > 0)
               for x in out_opt)
  assert_trees_equal(nnx.state(ref), wus.unshard(nnx.state(out)))
  assert all(is_sharded(x) for x in _opt_leaves(out[1]))
  plan = ws.plan(*out, b, optax.softmax_cross_entropy)
  names = [i.name for i in plan.inputs]
  assert "model['l1']['kernel'].value" in names, names
  assert any(n.startswith("optimizer['opt_state']") for n in names), names


def test_nnx_step_with_in_and_out_shardings():
  """`in_shardings` for the model and optimizer states (replicated) and the batch (split
  over "data"), `out_shardings` for the loss: the model's new state comes back with its
  `in_shardings` entry, as `nnx.jit` gives it."""
  mesh = _mesh()
  whole, data = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
  keywords = dict(in_shardings=(whole, whole, data), out_shardings=whole,
                  static_argnames="loss_fn", donate_argnames="optimizer")
  ref, out = _make(), _make()
  ref_step, ws = nnx.jit(_train_step, **keywords), wus.nnx_jit(_train_step, **keywords)
  for b in _batches(mesh, 2):
    assert ref_step(*ref, b, optax.softmax_cross_entropy) == ws(*out, b,
                                                                optax.softmax_cross_entropy)
  assert_trees_equal(nnx.state(ref), wus.unshard(nnx.state(out)))
  assert out[0].l1.kernel[...].sharding.is_equivalent_to(whole, 2)
  assert all(is_sharded(x) for x in _opt_leaves(out[1]))


def test_nnx_jit_keywords_are_nnx_jits():
  """Every keyword `nnx.jit` takes, `wus.nnx_jit` takes (graph mode runs tree-mode programs
  the same, so `graph=False` is taken as given)."""
  import inspect
  ours = set(inspect.signature(wus.nnx_jit).parameters)
  assert set(inspect.signature(nnx.jit).parameters) <= ours
  mesh = _mesh()
  ref, out = _make(), _make()
  ws = wus.nnx_jit(_train_step, static_argnums=3, graph=False, graph_updates=False,
                   inline=False, backend=None)
  b = _batches(mesh, 1)[0]
  assert nnx.jit(_train_step, static_argnums=3)(*ref, b, optax.softmax_cross_entropy) == ws(
      *out, b, optax.softmax_cross_entropy)


# --- Equinox: the keywords of `eqx.filter_jit`. ------------------------------------------


def _eqx_problem(mesh):
  eqx = pytest.importorskip("equinox")
  model = eqx.nn.MLP(12, 10, 32, 2, key=jax.random.key(0))
  model = eqx.filter_shard(model, NamedSharding(mesh, P()))
  optim = optax.adam(1e-2)

  def make_step(model, opt_state, x, y):
    def loss(model):
      logits = jax.vmap(model)(x)
      return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    value, grads = eqx.filter_value_and_grad(loss)(model)
    updates, opt_state = optim.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state, value
  return eqx, model, optim.init(eqx.filter(model, eqx.is_array)), make_step


@pytest.mark.parametrize("donate", [  # "all-except-first" and its warn form with --slow.
    "none", "all", pytest.param("all-except-first", marks=pytest.mark.slow), "warn",
    pytest.param("warn-except-first", marks=pytest.mark.slow)])
def test_filter_jit_donate_modes(donate):
  """Each of Equinox's `donate=` modes, with `jax.jit` keywords through `jitkwargs`: the
  same results as `eqx.filter_jit`, and the same arguments consumed."""
  mesh = _mesh()
  eqx, model, opt_state, make_step = _eqx_problem(mesh)
  kw = dict(donate=donate, keep_unused=True,
            compiler_options={"xla_cpu_enable_fast_math": False})
  ref_step, ws = eqx.filter_jit(make_step, **kw), wus.filter_jit(make_step, **kw)

  def copy(tree):
    return jax.tree.map(lambda x: jnp.copy(x) if eqx.is_array(x) else x, tree)

  def arrays(tree):
    return jax.tree.leaves(eqx.filter(tree, eqx.is_array), is_leaf=is_sharded)
  ref, out = (copy(model), copy(opt_state)), (model, opt_state)
  for k, b in enumerate(_batches(mesh, 3)):
    ref_args, out_args = (*ref, *copy((b["x"], b["y"]))), (*out, b["x"], b["y"])
    *ref, ref_loss = ref_step(*ref_args)
    *out, out_loss = ws(*out_args)
    assert ref_loss == out_loss
    # The first call copies the whole optimizer state into shards (nothing to donate).
    pairs = [p for j, (a, c) in enumerate(zip(ref_args, out_args, strict=True))
             if k > 0 or j != 1 for p in zip(arrays(a), arrays(c), strict=True)]
    assert [a.is_deleted() for a, _ in pairs] == [
        getattr(c, "data", c).is_deleted() for _, c in pairs], donate
    if donate != "none" and k > 0:
      assert any(a.is_deleted() for a, _ in pairs)
  assert_trees_equal(eqx.filter(ref, eqx.is_array), eqx.filter(wus.unshard(out), eqx.is_array))


def test_filter_jit_refuses_what_equinox_refuses():
  for k in ("static_argnums", "static_argnames", "donate_argnums", "in_shardings",
            "out_shardings"):
    eqx = pytest.importorskip("equinox")
    with pytest.raises(ValueError):
      eqx.filter_jit(lambda x: x, **{k: 0})
    with pytest.raises(ValueError, match="cannot contain"):
      wus.filter_jit(lambda x: x, **{k: 0})
  with pytest.raises(ValueError, match="donate"):
    wus.filter_jit(lambda x: x, donate="some")
  with pytest.raises(TypeError):
    wus.filter_jit(lambda x: x, not_a_keyword=1)


# --- wus.jit: the rest of jax.jit's keywords. ---------------------------------------------


def _jit_step(params, opt_state, batch, tx=optax.adam(1e-2)):
  def loss(p):
    return jnp.mean((jnp.tanh(batch["x"] @ p["w"]) - jax.nn.one_hot(batch["y"], 10)) ** 2)
  value, grads = jax.value_and_grad(loss)(params)
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, value


def test_jit_keywords_are_jax_jits():
  import inspect
  assert set(inspect.signature(jax.jit).parameters) <= set(inspect.signature(wus.jit).parameters)


@pytest.mark.filterwarnings("ignore:backend and device argument on jit is deprecated")
def test_jit_device_pins_the_step_and_it_runs_as_jax_jit_runs_it():
  params = {"w": jnp.ones((12, 10)) / 10}
  opt_state = optax.adam(1e-2).init(params)
  b = jax.tree.map(np.asarray, _batches(_mesh(), 1)[0])
  device = jax.devices()[3]
  ws = wus.jit(_jit_step, device=device)
  ref = jax.jit(_jit_step, device=device)(params, opt_state, b)
  out = ws(params, opt_state, b)
  assert_trees_equal(ref, out)
  assert out[0]["w"].devices() == {device}
  unchanged = ws.plan(params, opt_state, b).unchanged
  assert unchanged.verdict == refusals.Pinned((("device", repr(device)),)), unchanged
  assert str(unchanged) == (f"device={device!r} pins the step to one device, so there is no "
                            "data parallelism to shard the update over")


def test_jit_compiler_options_reach_wus_program():
  """An XLA option the compiler does not know fails the step's compile under `wus.jit` as
  under `jax.jit`: the options reach wus's own program."""
  mesh = _mesh()
  params = jax.device_put({"w": jnp.ones((12, 10)) / 10}, NamedSharding(mesh, P()))
  opt_state = optax.adam(1e-2).init(params)
  b = _batches(mesh, 1)[0]
  good = wus.jit(_jit_step, compiler_options={"xla_cpu_enable_fast_math": False})
  assert_trees_equal(jax.jit(_jit_step)(params, opt_state, b), wus.unshard(
      good(params, opt_state, b)))
  assert not good.plan(params, opt_state, b).unchanged
  bad = {"xla_no_such_option_h40": True}
  with pytest.raises(Exception) as ref:
    jax.jit(_jit_step, compiler_options=bad)(params, opt_state, b)
  with pytest.raises(type(ref.value)):
    wus.jit(_jit_step, compiler_options=bad)(params, opt_state, b)
