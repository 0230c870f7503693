"""`wus.jit` on global-view `jax.jit` steps, written as the JAX and Flax guides write them.

Every test runs the unmodified `jax.jit` step and the `wus.jit` step from the
same inputs and compares them (bit for bit for elementwise updates), on both
mesh kinds: `jax.make_mesh`'s default Explicit axes (with `jax.set_mesh`, as
the JAX sharding guide writes it) and Auto axes (`jax.sharding.Mesh`,
MaxText, big_vision).
"""

import contextlib
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import wus
from helpers import assert_trees_equal, classifier_batches, classifier_step, collective_arrays
from wus.analysis import reasons
from wus.sharded import is_sharded

KINDS = ["auto", "explicit"]


def _mesh(kind: str, n: int = 8):
  return jax.make_mesh((n,), ("data",), devices=jax.devices()[:n],
                       axis_types=(AxisType.Auto if kind == "auto" else AxisType.Explicit,))


def _context(mesh):
  """What the user writes around the step: `jax.set_mesh` for Explicit axes."""
  return jax.set_mesh(mesh) if mesh.axis_types[0] == AxisType.Explicit else contextlib.nullcontext()


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(32)(x))
    x = nn.LayerNorm()(x)
    return nn.Dense(10)(x)


_batches = classifier_batches  # A classifier's batches over "data" (tests/helpers.py).


def _init(mesh, model, tx, features=12):
  params = model.init(jax.random.key(0), jnp.ones((1, features)))
  params = jax.device_put(params, NamedSharding(mesh, P()))
  return params, tx.init(params)


def _run(step, args, batches):
  params, opt_state = args
  for b in batches:
    params, opt_state, metrics = step(params, opt_state, b)
  return params, opt_state, metrics


def _jit_and_wus(mesh, tx, steps, batch=48):
  """`MLP`'s Flax step with `tx`, run `steps` times by `jax.jit` and by `wus.jit` from
  the same state, as the user writes it (`_context`): both (params, opt_state, metrics)."""
  model = MLP()
  step = classifier_step(model, tx)
  with _context(mesh):
    args = _init(mesh, model, tx)
    batches = _batches(mesh, steps, batch=batch)
    return _run(jax.jit(step), args, batches), _run(wus.jit(step), args, batches)


def _float_state(tree, n):
  return [x for x in jax.tree.leaves(tree, is_leaf=is_sharded)
          if jnp.issubdtype(x.dtype, jnp.floating) and int(np.prod(x.shape)) > n]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [8, 6])
def test_flax_adam_step_bit_for_bit_with_state_sharded(kind, n):
  mesh = _mesh(kind, n)
  ref, out = _jit_and_wus(mesh, optax.adam(1e-2), 3, batch=8 * n)
  assert_trees_equal(ref, wus.unshard(out))
  state = _float_state(out[1], n)
  assert state and all(is_sharded(x) for x in state), [type(x) for x in state]


@pytest.mark.parametrize("kind", KINDS)
def test_gradients_reduce_scattered_and_weights_all_gathered(kind):
  mesh = _mesh(kind)
  model, tx = MLP(), optax.adam(1e-2)
  step = classifier_step(model, tx)
  with _context(mesh):
    params, opt_state = _init(mesh, model, tx)
    (batch,) = _batches(mesh, 1)
    ws = wus.jit(step)
    _, opt_state, _ = ws(params, opt_state, batch)
    wus_hlo = ws.lower(params, opt_state, batch).compile().as_text().splitlines()
    ref_hlo = jax.jit(step).lower(params, tx.init(params), batch).compile().as_text().splitlines()
  # The unmodified step all-reduces the gradients (and the loss); wus reduce-scatters
  # the gradients and all-reduces only the loss.
  grads = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
  ref_reduced = collective_arrays(ref_hlo, "all-reduce")
  assert sum(_elements(a) for a in ref_reduced) == grads + 1, ref_reduced
  assert collective_arrays(wus_hlo, "all-reduce") == ["f32[]"]
  scattered = collective_arrays(wus_hlo, "reduce-scatter")
  gathered = collective_arrays(wus_hlo, "all-gather")
  assert scattered and gathered
  assert 8 * sum(_elements(a) for a in scattered) >= grads
  assert 8 * sum(_elements(a) for a in scattered) == sum(_elements(a) for a in gathered)


def _elements(array: str) -> int:
  dims = re.search(r"\[([\d,]*)\]", array).group(1)
  return int(np.prod([int(d) for d in dims.split(",") if d]))


@pytest.mark.parametrize("kind", KINDS)
def test_no_recompilation_across_calls_and_donation_honoured(kind):
  mesh = _mesh(kind)
  model, tx = MLP(), optax.adam(1e-2)
  traces = []
  inner = classifier_step(model, tx)

  def step(params, opt_state, batch):
    traces.append(1)
    return inner(params, opt_state, batch)
  with _context(mesh):
    params, opt_state = _init(mesh, model, tx)
    batches = _batches(mesh, 3)
    ws = wus.jit(step, donate_argnums=(0, 1))
    params, opt_state, _ = ws(params, opt_state, batches[0])
    first = len(traces)
    for b in batches[1:]:
      old = opt_state
      params, opt_state, _ = ws(params, opt_state, b)
    assert len(traces) == first
    assert ws._compiled((params, opt_state, batches[0]), {})[1].step._cache_size() == 1
    assert all(x.data.is_deleted() for x in jax.tree.leaves(old, is_leaf=is_sharded)
               if is_sharded(x))
    with pytest.raises(ValueError, match="donated"):
      ws(params, old, batches[0])


@pytest.mark.parametrize("kind", KINDS)
def test_flax_train_state(kind):
  mesh = _mesh(kind)
  model, tx = MLP(), optax.adamw(1e-2, weight_decay=1e-2)

  @jax.jit
  def train_step(state, batch):
    def loss_fn(params):
      logits = state.apply_fn({"params": params}, batch["x"])
      return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    grads = jax.grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads)

  with _context(mesh):
    params = jax.device_put(model.init(jax.random.key(0), jnp.ones((1, 12)))["params"],
                            NamedSharding(mesh, P()))
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    batches = _batches(mesh, 3)
    ws = wus.jit(train_step.__wrapped__)
    # `TrainState.create` starts `step` at the Python int 0: served from the first call.
    assert isinstance(state.step, int)
    plan = ws.plan(state, batches[0])
    assert not plan.unchanged, plan.unchanged
    ref, out = state, state
    for b in batches:
      ref, out = train_step(ref, b), ws(out, b)
  assert_trees_equal(ref, wus.unshard(out))
  assert all(is_sharded(x) for x in _float_state(out.opt_state, 8))


@pytest.mark.parametrize("kind", KINDS)
def test_global_norm_clipping_within_summation_order(kind):
  tx = optax.chain(optax.clip_by_global_norm(0.1), optax.adam(1e-2))
  ref, out = _jit_and_wus(_mesh(kind), tx, 3)
  assert_trees_equal(ref, wus.unshard(out), rtol=1e-5, atol=1e-7)
  assert all(is_sharded(x) for x in _float_state(out[1], 8))


def test_no_batch_split_runs_unchanged_with_the_reason():
  mesh = _mesh("auto")
  model, tx = MLP(), optax.adam(1e-2)
  step = classifier_step(model, tx)
  params, opt_state = _init(mesh, model, tx)
  batch = {"x": jnp.ones((16, 12)), "y": jnp.zeros((16,), jnp.int32)}
  ws = wus.jit(step)
  out = ws(params, opt_state, batch)
  assert_trees_equal(jax.jit(step)(params, opt_state, batch), out)
  plan = ws.plan(params, opt_state, batch)
  assert not plan.state_inputs
  assert "no argument is split" in str(plan)


@pytest.mark.parametrize("kind", KINDS)
def test_plan_lists_the_step_arguments_not_the_region_operands(kind):
  """The Plan's inputs are the step's argument leaves, by path and in order, with the same
  decisions the region's inputs carry; arguments only the forward pass reads say so, and
  the weights (whose next value the step returns) count as state kept whole."""
  mesh = _mesh(kind)
  model, tx = MLP(), optax.adam(1e-2)
  step = classifier_step(model, tx)
  with _context(mesh):
    params, opt_state = _init(mesh, model, tx)
    batch = _batches(mesh, 1)[0]
    plan = wus.jit(step).plan(params, opt_state, batch)
  paths = ["params" + jax.tree_util.keystr(p) for p, _ in
           jax.tree_util.tree_flatten_with_path(params)[0]]
  paths += ["opt_state" + jax.tree_util.keystr(p) for p, _ in
            jax.tree_util.tree_flatten_with_path(opt_state)[0]]
  paths += ["batch" + jax.tree_util.keystr(p) for p, _ in
            jax.tree_util.tree_flatten_with_path(batch)[0]]
  assert [i.name for i in plan.inputs] == paths
  by_name = {i.name: i for i in plan.inputs}
  moments = [i for i in plan.inputs if ".mu[" in i.name or ".nu[" in i.name]
  assert moments and all(i.sharded and i.state for i in moments)
  assert plan.state_bytes[0] == sum(i.nbytes for i in moments)
  weights = [i for i in plan.inputs if i.name.startswith("params")]
  assert all(i.state and not i.sharded and "next value output[0]" in i.matched for i in weights)
  assert plan.whole_state_bytes == sum(i.nbytes for i in weights) + 4  # + Adam's count.
  labels = by_name["batch['y']"]
  assert not labels.sharded and not labels.state and "forward and backward" in labels.reason
  # Every sharded input of the region is an argument, and says where it is kept.
  assert sorted(plan.state_inputs) == sorted(paths.index(i.name) for i in moments)
  assert all("sharded over ['data'] by wus" in line for line in plan.details().splitlines()
             if ".mu[" in line and "float32" in line and "kernel" in line and "[" in line
             and line.startswith("    opt_state"))


@pytest.mark.parametrize("kind", KINDS)
def test_refs_made_inside_the_step_are_discharged_and_the_update_sharded(kind):
  """A step that keeps its momentum in `jax.new_ref`s it makes itself and updates them in
  place (`ref[...] = ...`): the refs are discharged into values, so the momentum is
  kept sharded, bit for bit with jax.jit."""
  mesh = _mesh(kind)
  model = MLP()

  def train_step(params, momentum, batch):
    def loss_fn(p):
      logits = model.apply(p, batch["x"])
      return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    loss, grads = jax.value_and_grad(loss_fn)(params)
    p_refs, m_refs = jax.tree.map(jax.new_ref, params), jax.tree.map(jax.new_ref, momentum)

    def sgd(p, m, g):
      m[...] = 0.9 * m[...] + g
      p[...] -= 0.05 * m[...]
    jax.tree.map(sgd, p_refs, m_refs, grads)
    return jax.tree.map(jax.ref.get, p_refs), jax.tree.map(jax.ref.get, m_refs), {"loss": loss}

  with _context(mesh):
    params, _ = _init(mesh, model, optax.sgd(0.1))
    momentum = jax.tree.map(jnp.zeros_like, params)
    batches = _batches(mesh, 3)
    ref, out = (params, momentum), (params, momentum)
    ws = wus.jit(train_step)
    for b in batches:
      *ref, ref_m = jax.jit(train_step)(*ref, b)
      *out, out_m = ws(*out, b)
    assert_trees_equal((ref, ref_m), (wus.unshard(out), out_m))
    plan = ws.plan(*out, batches[0])
  assert all(is_sharded(x) for x in _float_state(out[1], 8))
  assert {i.name for i in plan.inputs if i.sharded} == {
      "momentum" + jax.tree_util.keystr(p) for p, x in
      jax.tree_util.tree_flatten_with_path(momentum)[0] if x.size > 8}


@pytest.mark.parametrize("lookup", ["at_get", "auto_axes"])
def test_embedding_lookup_on_an_explicit_mesh(lookup):
  """The JAX sharding guide's embedding lookup on an Explicit mesh, `emb.at[ids].get(
  out_sharding=P("data", None))` (JAX asks for it), or a lookup in a function wrapped by
  `jax.sharding.auto_axes`: both compute in Auto axes inside the Explicit mesh. wus.jit
  used to raise on them (it took the retyping reshard of the table for a placement).
  Now the table's gradient is summed as GSPMD sums it (its scatter-add computes in Auto
  axes) and sliced locally, the Adam state is sharded, and the step matches jax.jit's
  within an ulp (the table's update, whole in jax.jit and on slices here, fuses and
  rounds differently on XLA:CPU, as tests/analysis/test_roots.py records)."""
  mesh = _mesh("explicit")
  vocab, dim = 32, 16

  def logits(p, ids):
    if lookup == "at_get":
      h = p["emb"].at[ids].get(out_sharding=P("data", None))
    else:
      h = jax.sharding.auto_axes(lambda e, i: jnp.take(e, i, axis=0))(
          p["emb"], ids, out_sharding=P("data", None))
    return jnp.tanh(h) @ p["w"]

  tx = optax.adam(1e-2)

  def train_step(params, opt_state, batch):
    def loss_fn(p):
      return optax.softmax_cross_entropy_with_integer_labels(
          logits(p, batch["ids"]), batch["y"]).mean()
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  rng = np.random.default_rng(0)
  with jax.set_mesh(mesh):
    params = jax.device_put({"emb": rng.normal(size=(vocab, dim)).astype(np.float32),
                             "w": rng.normal(size=(dim, vocab)).astype(np.float32)}, P())
    batches = [jax.device_put({"ids": rng.integers(0, vocab, (16,)).astype(np.int32),
                               "y": rng.integers(0, vocab, (16,)).astype(np.int32)}, P("data"))
               for _ in range(3)]
    ref = out = (params, tx.init(params))
    ws = wus.jit(train_step)
    for b in batches:
      *ref, ref_loss = jax.jit(train_step)(*ref, b)
      *out, out_loss = ws(*out, b)
  assert_trees_equal((ref, ref_loss), (wus.unshard(out), out_loss), rtol=1e-5, atol=1e-6)
  assert all(is_sharded(x) for x in _float_state(out[1], 8))

# --- Steps as the Flax examples and guides write them (Auto mesh: Flax's Embed
# cannot take a split batch on an Explicit mesh without an out_sharding). ---------


class Block(nn.Module):
  @nn.compact
  def __call__(self, x, train):
    h = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=16, deterministic=not train,
                                        dropout_rate=0.1)(nn.LayerNorm()(x))
    x = x + h
    h = nn.Dense(16)(nn.Dropout(0.1, deterministic=not train)(nn.gelu(nn.Dense(32)(
        nn.LayerNorm()(x)))))
    return x + h


class LM(nn.Module):
  """A tied-embedding language model with a learned position table."""

  @nn.compact
  def __call__(self, tokens, train=True):
    embed = nn.Embed(64, 16)
    pos = self.param("pos", nn.initializers.normal(0.02), (8, 16))
    x = Block()(embed(tokens) + pos[None], train)
    return embed.attend(nn.LayerNorm()(x))


def test_transformer_with_dropout_and_a_state_dict_holding_step_and_rng():
  mesh = _mesh("auto")
  model, tx = LM(), optax.adamw(1e-2)

  def train_step(state, batch):
    rng, dropout = jax.random.split(state["rng"])

    def loss_fn(params):
      logits = model.apply(params, batch[:, :-1], rngs={"dropout": dropout})
      return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()
    grads = jax.grad(loss_fn)(state["params"])
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state,
            "step": state["step"] + 1, "rng": rng}

  params = jax.device_put(model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32),
                                     train=False), NamedSharding(mesh, P()))
  state = {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32),
           "rng": jax.random.key(1)}
  rng = np.random.default_rng(0)
  batches = [jax.device_put(rng.integers(0, 64, (16, 9)).astype(np.int32),
                            NamedSharding(mesh, P("data"))) for _ in range(3)]
  ref, out = state, state
  ws = wus.jit(train_step)
  for b in batches:
    ref, out = jax.jit(train_step)(ref, b), ws(out, b)
  assert_trees_equal(ref, wus.unshard(out))
  # Every optimizer-state tensor, the tied embedding and the position table included.
  assert all(is_sharded(x) for x in _float_state(out["opt_state"], 8))
  # The RNG key is state the forward pass updates, outside the region: the Plan says so,
  # not that only the forward and backward pass read it.
  (rng_input,) = [i for i in ws.plan(out, batches[0]).inputs if i.name == "state['rng']"]
  assert rng_input.why.verdict == reasons.OutsideRegion(state=True), rng_input
  assert str(rng_input.why).startswith("state the rest of the step updates"), rng_input


class CNN(nn.Module):
  @nn.compact
  def __call__(self, x, train=True):
    x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(nn.Conv(8, (3, 3))(x)))
    return nn.Dense(10)(x.mean(axis=(1, 2)))


def test_cnn_with_batch_norm_statistics_and_momentum():
  mesh = _mesh("auto")
  model, tx = CNN(), optax.sgd(0.1, momentum=0.9)

  def train_step(state, batch):
    params, batch_stats, opt_state = state

    def loss_fn(p):
      logits, updates = model.apply({"params": p, "batch_stats": batch_stats}, batch["x"],
                                    mutable=["batch_stats"])
      return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), updates
    (_, new), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), new["batch_stats"], opt_state

  variables = jax.device_put(model.init(jax.random.key(0), jnp.ones((1, 8, 8, 3)), train=False),
                             NamedSharding(mesh, P()))
  state = (variables["params"], variables["batch_stats"], tx.init(variables["params"]))
  rng = np.random.default_rng(0)
  data = NamedSharding(mesh, P("data"))
  batches = [{"x": jax.device_put(rng.normal(size=(16, 8, 8, 3)).astype(np.float32), data),
              "y": jax.device_put(rng.integers(0, 10, 16).astype(np.int32), data)}
             for _ in range(3)]
  ref, out = state, state
  ws = wus.jit(train_step)
  for b in batches:
    ref, out = jax.jit(train_step)(ref, b), ws(out, b)
  assert_trees_equal(ref, wus.unshard(out))
  assert all(is_sharded(x) for x in _float_state(out[2], 8))


def test_flax_nnx_split_merge_step():
  from flax import nnx

  class Model(nnx.Module):
    def __init__(self, rngs):
      self.l1, self.l2 = nnx.Linear(12, 32, rngs=rngs), nnx.Linear(32, 10, rngs=rngs)

    def __call__(self, x):
      return self.l2(nnx.relu(self.l1(x)))

  mesh = _mesh("auto")
  model = Model(nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
  graphdef, state = nnx.split((model, optimizer))
  state = jax.device_put(state, NamedSharding(mesh, P()))

  def train_step(state, batch):  # The Flax performance guide's functional form.
    model, optimizer = nnx.merge(graphdef, state)

    def loss_fn(model):
      return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]),
                                                             batch["y"]).mean()
    grads = nnx.grad(loss_fn)(model)
    optimizer.update(model, grads)
    return nnx.state((model, optimizer))

  ref, out = state, state
  ws = wus.jit(train_step)
  for b in _batches(mesh, 3):
    ref, out = jax.jit(train_step)(ref, b), ws(out, b)
  assert_trees_equal(ref, wus.unshard(out))
  opt_state = out[1]
  assert all(is_sharded(x) for x in _float_state(opt_state, 8))


def test_multi_steps_apply_if_finite_and_bfloat16_moments():
  tx = optax.MultiSteps(optax.apply_if_finite(optax.chain(
      optax.clip_by_global_norm(1.0), optax.adam(1e-2, mu_dtype=jnp.bfloat16)), 3), 2)
  ref, out = _jit_and_wus(_mesh("auto"), tx, 4)
  assert_trees_equal(ref, wus.unshard(out), rtol=1e-5, atol=1e-7)
  assert all(is_sharded(x) for x in _float_state(out[1], 8))


@pytest.mark.parametrize("form", ["in_shardings", "keywords"])
def test_jit_arguments_mean_what_they_mean_to_jax_jit(form):
  """Decorator use; in_shardings placing an unplaced batch and out_shardings; a static
  argument, keyword arguments and donate_argnames."""
  mesh = _mesh("auto")
  model, tx = MLP(), optax.adam(1e-2)
  inner = classifier_step(model, tx)
  data, whole = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
  rng = np.random.default_rng(0)
  batches = [{"x": rng.normal(size=(48, 12)).astype(np.float32),
              "y": rng.integers(0, 10, size=(48,)).astype(np.int32)} for _ in range(3)]
  if form == "in_shardings":
    def train_step(params, opt_state, batch):
      return inner(params, opt_state, batch)
    kw = dict(in_shardings=(whole, whole, data), out_shardings=(whole, None, whole))
    call = {}
  else:
    def train_step(params, opt_state, batch, scale, *, extra):
      params, opt_state, metrics = inner(params, opt_state, batch)
      return params, opt_state, {"loss": metrics["loss"] * scale + extra}
    kw = dict(static_argnums=3, donate_argnames="opt_state")
    batches = [jax.device_put(b, data) for b in batches]
    call = dict(extra=jnp.float32(1))
  extra_args = () if form == "in_shardings" else (2.0,)
  ref_step = jax.jit(train_step, **kw)
  ws = wus.jit(**kw)(train_step)
  params, opt_state = _init(mesh, model, tx)
  ref, out = (params, jax.tree.map(jnp.copy, opt_state)), (params, opt_state)
  for b in batches:
    *ref, ref_m = ref_step(*ref, b, *extra_args, **call)
    *out, out_m = ws(*out, b, *extra_args, **call)
  assert_trees_equal((ref, ref_m), (wus.unshard(out), out_m))
  assert all(is_sharded(x) for x in _float_state(out[1], 8))
  assert out[0]["params"]["Dense_0"]["kernel"].sharding.is_equivalent_to(whole, 2)
  names = [i.name for i in ws.plan(*out, batches[0], *extra_args, **call).inputs]
  assert "opt_state[0].mu['params']['Dense_0']['kernel']" in names, names
  target = ws.state_target(*out, batches[0], *extra_args, **call)
  if form == "keywords":
    assert target[0][3] == 2.0 and set(target[1]) == {"extra"}


def test_equinox_filter_jit_step_with_donation():
  """The Equinox CNN example's step: `@eqx.filter_jit` becomes `@wus.filter_jit`."""
  eqx = pytest.importorskip("equinox")

  class CNN(eqx.Module):
    layers: list

    def __init__(self, key):
      k1, k2, k3 = jax.random.split(key, 3)
      self.layers = [eqx.nn.Conv2d(1, 4, kernel_size=3, key=k1), jax.nn.relu, jnp.ravel,
                     eqx.nn.Linear(4 * 6 * 6, 32, key=k2), jax.nn.sigmoid,
                     eqx.nn.Linear(32, 10, key=k3)]

    def __call__(self, x):
      for layer in self.layers:
        x = layer(x)
      return jax.nn.log_softmax(x)

  def loss(model, x, y):
    pred = jax.vmap(model)(x)
    return -jnp.mean(jnp.take_along_axis(pred, y[:, None], axis=1))

  optim = optax.adamw(3e-3)

  def make_step(model, opt_state, x, y):
    loss_value, grads = eqx.filter_value_and_grad(loss)(model, x, y)
    updates, opt_state = optim.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state, loss_value

  mesh = _mesh("auto")
  model = eqx.filter_shard(CNN(jax.random.key(0)), NamedSharding(mesh, P()))
  opt_state = optim.init(eqx.filter(model, eqx.is_array))
  rng = np.random.default_rng(0)
  data = NamedSharding(mesh, P("data"))
  batches = [(jax.device_put(rng.normal(size=(16, 1, 8, 8)).astype(np.float32), data),
              jax.device_put(rng.integers(0, 10, 16).astype(np.int32), data)) for _ in range(3)]

  def copy(tree):
    return jax.tree.map(lambda x: jnp.copy(x) if eqx.is_array(x) else x, tree)
  ref_step = eqx.filter_jit(make_step, donate="all")
  ws = wus.filter_jit(make_step, donate="all")
  ref, out = (copy(model), copy(opt_state)), (model, opt_state)
  for x, y in batches:
    *ref, ref_loss = ref_step(*ref, x, y)
    old = out
    *out, out_loss = ws(*out, x, y)
    assert ref_loss == out_loss
  assert_trees_equal(eqx.filter(ref, eqx.is_array), eqx.filter(wus.unshard(out), eqx.is_array))
  assert all(is_sharded(x) for x in _float_state(out[1], 8))
  with pytest.raises(ValueError, match="donated"):
    ws(*old, *batches[0])


def test_flax_nnx_jit_step_updating_model_optimizer_and_metrics_in_place():
  """The Flax NNX MNIST tutorial's step: `@nnx.jit` becomes `@wus.nnx_jit`."""
  from flax import nnx

  class CNN(nnx.Module):
    def __init__(self, *, rngs):
      self.conv = nnx.Conv(1, 4, kernel_size=(3, 3), rngs=rngs)
      self.linear = nnx.Linear(4 * 8 * 8, 10, rngs=rngs)

    def __call__(self, x):
      x = nnx.relu(self.conv(x))
      return self.linear(x.reshape(x.shape[0], -1))

  def loss_fn(model, batch):
    logits = model(batch["image"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean(), logits

  def train_step(model, optimizer, metrics, batch):
    (loss, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, batch)
    metrics.update(loss=loss, logits=logits, labels=batch["label"])
    optimizer.update(model, grads)

  def make():
    model = CNN(rngs=nnx.Rngs(0))
    return (model, nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param),
            nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss")))

  mesh = _mesh("auto")
  rng = np.random.default_rng(0)
  data = NamedSharding(mesh, P("data"))
  batches = [{"image": jax.device_put(rng.normal(size=(16, 8, 8, 1)).astype(np.float32), data),
              "label": jax.device_put(rng.integers(0, 10, 16).astype(np.int32), data)}
             for _ in range(3)]
  ref, out = make(), make()
  ref_step, ws = nnx.jit(train_step), wus.nnx_jit(train_step)
  for b in batches:
    ref_step(*ref, b)
    ws(*out, b)
  assert_trees_equal(nnx.state(ref), wus.unshard(nnx.state(out)))
  assert all(is_sharded(x) for x in _float_state(nnx.state(out[1]), 8))


def test_boxed_partitioned_params_and_a_shard_map_inside_the_step():
  """A linen TrainState whose params are boxed `nn.Partitioned` (logical axis metadata,
  MaxText-style), and a per-replica augmentation written as a shard_map inside the step."""
  mesh = _mesh("auto")

  class Boxed(nn.Module):
    @nn.compact
    def __call__(self, x):
      dense = nn.Dense(32, kernel_init=nn.with_partitioning(nn.initializers.lecun_normal(),
                                                            (None, None)))
      return nn.Dense(10)(nn.relu(dense(x)))

  model, tx = Boxed(), optax.adam(1e-2)

  def augment(x):  # Each replica flips the sign of its rows with its own key.
    key = jax.random.fold_in(jax.random.key(0), jax.lax.axis_index("data"))
    return x * jnp.where(jax.random.bernoulli(key, 0.5, (x.shape[0], 1)), -1.0, 1.0)

  def train_step(state, batch):
    x = jax.shard_map(augment, mesh=mesh, in_specs=P("data"), out_specs=P("data"))(batch["x"])

    def loss_fn(params):
      logits = state.apply_fn({"params": params}, x)
      return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return state.apply_gradients(grads=jax.grad(loss_fn)(state.params))

  params = model.init(jax.random.key(0), jnp.ones((1, 12)))["params"]
  assert isinstance(params["Dense_0"]["kernel"], nn.Partitioned)
  state = train_state.TrainState.create(apply_fn=model.apply,
                                        params=jax.device_put(params, NamedSharding(mesh, P())),
                                        tx=tx)
  ref, out = state, state
  ws = wus.jit(train_step)
  for b in _batches(mesh, 3):
    ref, out = jax.jit(train_step)(ref, b), ws(out, b)
  assert_trees_equal(ref, wus.unshard(out))
  assert all(is_sharded(x) for x in _float_state(out.opt_state, 8))


def test_state_split_over_the_batch_axis_is_fsdp_and_the_rest_is_served():
  """FSDP (weights split over the batch axis itself, issue 29 item 3): their state stays as
  placed and the Plan says FSDP; the state of the weights left whole is sharded by wus.
  Bit for bit. (Weights split over "model": tests/api/test_jit_tensor_parallel.py; FSDP
  and HSDP programs: tests/api/test_jit_fsdp.py.)"""
  mesh = _mesh("auto", 8)
  model, tx = MLP(), optax.adam(1e-2)
  step = classifier_step(model, tx)
  params = model.init(jax.random.key(0), jnp.ones((1, 12)))
  params = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(
      mesh, P("data") if x.shape[0] % 8 == 0 else P())), params)
  opt_state = tx.init(params)
  batches = _batches(mesh, 2)
  ws = wus.jit(step)
  ref = _run(jax.jit(step), (params, opt_state), batches)
  out = _run(ws, (params, opt_state), batches)
  assert_trees_equal(ref, wus.unshard(out))
  details = ws.plan(*out[:2], batches[0]).details()
  assert "FSDP over ['data']: already split by its placement" in details
  mu = out[1][0].mu["params"]
  assert not is_sharded(mu["Dense_0"]["bias"]) and mu["Dense_0"]["bias"].sharding.spec == P(
      "data")
  assert is_sharded(mu["Dense_0"]["kernel"])  # [12, 32]: placed whole, sharded by wus.


def test_checkpoint_saved_at_8_restored_at_4_with_state_target(tmp_path):
  """wus.jit state saved with stock Orbax (`wus.checkpointable`) and restored sharded for a
  step on 4 devices: equal to the saved state, and training on from it matches jax.jit from
  the same state."""
  import orbax.checkpoint as ocp
  model, tx = MLP(), optax.adam(1e-2)
  step = classifier_step(model, tx)
  mesh8, mesh4 = _mesh("auto", 8), _mesh("auto", 4)
  params, opt_state = _init(mesh8, model, tx)
  params, opt_state, _ = _run(wus.jit(step), (params, opt_state), _batches(mesh8, 2))
  ckptr = ocp.StandardCheckpointer()
  ckptr.save(tmp_path / "ckpt", wus.checkpointable({"params": params, "opt_state": opt_state}))
  ckptr.wait_until_finished()
  whole = jax.device_put(jax.tree.map(np.asarray, wus.unshard((params, opt_state))),
                         NamedSharding(mesh4, P()))
  (batch,) = _batches(mesh4, 1, batch=32)
  ws = wus.jit(step)
  target_params, target_opt, _ = ws.state_target(*whole, batch)
  restored = ckptr.restore(tmp_path / "ckpt", {"params": target_params, "opt_state": target_opt})
  assert all(is_sharded(x) for x in _float_state(restored["opt_state"], 4))
  assert_trees_equal(whole, wus.unshard((restored["params"], restored["opt_state"])))
  ref = jax.jit(step)(*whole, batch)
  out = ws(restored["params"], restored["opt_state"], batch)
  assert_trees_equal(ref, wus.unshard(out))


class ScannedLayers(nn.Module):
  """MaxText-style stacked layers: nn.scan over nn.remat, then an output Dense."""

  @nn.compact
  def __call__(self, x):
    class Layer(nn.Module):
      @nn.compact
      def __call__(self, x, _):
        return nn.relu(nn.Dense(16)(x)), None
    x, _ = nn.scan(nn.remat(Layer), variable_axes={"params": 0}, split_rngs={"params": True},
                   length=3)()(x, None)
    return nn.Dense(10)(x)


@pytest.mark.parametrize("form", ["scanned_layers", "accumulation"])
def test_gradients_summed_inside_scan_or_remat_shard_from_local_slices(form):
  """A gradient GSPMD sums inside a loop (nn.scan over nn.remat layers; gradient
  accumulation over micro-batches in a lax.scan) stays as the unmodified step computes it;
  the update reads it whole and slices it locally, and the optimizer state shards."""
  mesh = _mesh("auto")
  model, tx = (ScannedLayers(), optax.adam(1e-2)) if form == "scanned_layers" else (
      MLP(), optax.adam(1e-2))

  def train_step(params, opt_state, batch):
    def grads_of(p, x, y):
      return jax.grad(lambda p: optax.softmax_cross_entropy_with_integer_labels(
          model.apply(p, x), y).mean())(p)
    if form == "scanned_layers":
      grads = grads_of(params, batch["x"], batch["y"])
    else:
      micro = jax.tree.map(lambda v: v.reshape(2, -1, *v.shape[1:]), batch)
      grads, _ = jax.lax.scan(lambda g, b: (jax.tree.map(jnp.add, g, grads_of(
          params, b["x"], b["y"])), None), jax.tree.map(jnp.zeros_like, params), micro)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  features = 16 if form == "scanned_layers" else 12
  params = jax.device_put(model.init(jax.random.key(0), jnp.ones((1, features))),
                          NamedSharding(mesh, P()))
  rng = np.random.default_rng(0)
  data = NamedSharding(mesh, P("data"))
  batches = [{"x": jax.device_put(rng.normal(size=(32, features)).astype(np.float32), data),
              "y": jax.device_put(rng.integers(0, 10, 32).astype(np.int32), data)}
             for _ in range(3)]
  ref, out = (params, tx.init(params)), (params, tx.init(params))
  ws = wus.jit(train_step)
  for b in batches:
    ref, out = jax.jit(train_step)(*ref, b), ws(*out, b)
  assert_trees_equal(ref, wus.unshard(out))
  assert all(is_sharded(x) for x in _float_state(out[1], 8))
