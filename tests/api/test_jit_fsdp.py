"""`wus.jit` on FSDP and HSDP steps (issue 29 item 3): a global-view step whose weights are
placed over the batch axis itself (MaxText's "embed" -> "fsdp" logical axis rule). Those
weights' gradients arrive reduce-scattered to their blocks and their update is already
split: the Plan says FSDP for them, and the rest of the step is served (the biases' and
LayerNorm's state sharded by wus). With a replica axis beside the FSDP axis (HSDP), each
FSDP block's update is sharded over "replica" too (ZeRO-1 outside, FSDP inside). Each step
runs beside the unmodified `jax.jit` step from the same inputs."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P, reshard

import wus
from helpers import assert_trees_equal, classifier_step
from wus.sharded import is_sharded


class FSDPMLP(nn.Module):
  """Flax's logical axis annotations, shrunk: kernels over ("embed", "mlp") and back, a
  LayerNorm and biases between."""

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(32, kernel_init=nn.with_logical_partitioning(
        nn.initializers.lecun_normal(), ("embed", "mlp")))(x)
    x = nn.LayerNorm()(nn.relu(x))
    x = nn.Dense(16, kernel_init=nn.with_logical_partitioning(
        nn.initializers.lecun_normal(), ("mlp", "embed")))(x)
    return nn.Dense(8, kernel_init=nn.with_logical_partitioning(
        nn.initializers.lecun_normal(), ("embed", "heads")))(nn.relu(x))


# MaxText's rules, shrunk: the batch over every data-parallel axis, "embed" over "fsdp".
FSDP = (("batch", "data"), ("embed", "data"), ("mlp", None), ("heads", None))
FSDP_TP = (("batch", "data"), ("embed", "data"), ("mlp", "model"), ("heads", "model"))
HSDP = (("batch", ("replica", "fsdp")), ("embed", "fsdp"), ("mlp", None), ("heads", None))


def _mesh(shape, names, kind="auto"):
  types = (AxisType.Auto if kind == "auto" else AxisType.Explicit,) * len(shape)
  return jax.make_mesh(shape, names, axis_types=types,
                       devices=jax.devices()[:int(np.prod(shape))])


def _setup(mesh, rules, tx, steps=3):
  model = FSDPMLP()
  with nn.logical_axis_rules(rules):
    abstract = jax.eval_shape(model.init, jax.random.key(0), jnp.ones((1, 16)))
    shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, rules)
  params = jax.jit(model.init, out_shardings=shardings)(jax.random.key(0), jnp.ones((1, 16)))
  batch_spec = P(*nn.logical_to_mesh_axes(("batch",), rules))
  rng = np.random.default_rng(0)
  data = NamedSharding(mesh, batch_spec)
  batches = [{"x": jax.device_put(rng.normal(size=(32, 16)).astype(np.float32), data),
              "y": jax.device_put(rng.integers(0, 8, size=(32,)).astype(np.int32), data)}
             for _ in range(steps)]
  return classifier_step(model, tx), (params, tx.init(params)), batches


def _run(step, args, batches, **tol):
  ws = wus.jit(step)
  ref = out = args
  for b in batches:
    *ref, ref_aux = jax.jit(step)(*ref, b)
    *out, out_aux = ws(*out, b)
    assert_trees_equal(ref_aux, out_aux, **tol)
  assert_trees_equal(ref, wus.unshard(out), **tol)
  return ref, out, ws.plan(*out, batches[0])


def _lines(plan) -> dict:
  return {ln.split()[0]: ln for ln in plan.details().split("\ninputs:\n")[1].splitlines()
          if ln.startswith("    ")}


def _sharded(tree) -> list:
  return [x for x in jax.tree.leaves(tree, is_leaf=is_sharded) if is_sharded(x)]


@pytest.mark.parametrize("tx", [
    optax.adam(1e-2), pytest.param(optax.sgd(1e-2, momentum=0.9), marks=pytest.mark.slow)],
    ids=["adam", "momentum"])
def test_fsdp_kernels_say_fsdp_the_rest_sharded_bit_for_bit(tx):
  """On ("data", "model") = (8, 1) (a size-1 model axis, as users name it) the kernels
  are placed over "data": their state stays as placed, 1/8 per device, and the Plan says
  FSDP; the biases' and LayerNorm's state is sharded by wus. Bit for bit."""
  mesh = _mesh((8, 1), ("data", "model"))
  step, args, batches = _setup(mesh, FSDP, tx)
  _, out, plan = _run(step, args, batches)
  assert not plan.unchanged, plan.unchanged
  lines = _lines(plan)
  kernels = [k for k in lines if "['kernel']" in k and k.startswith("opt_state")]
  assert kernels and all("FSDP over ['data']" in lines[k] for k in kernels), lines
  biases = [x for x in _sharded(out[1]) if x.ndim == 1]
  # The moments of 2 biases and LayerNorm's scale and bias (Dense_2's bias of 8 is tiny).
  assert len(biases) == len([x for x in jax.tree.leaves(args[1]) if x.ndim == 1 and x.size > 8])
  assert len(biases) in (4, 8)
  for x in biases:
    assert x.nbytes_per_device * 8 == x.size * x.dtype.itemsize, x
  moments = out[1][0].mu if hasattr(out[1][0], "mu") else out[1][0].trace
  for k in (0, 1, 2):
    leaf = moments["params"][f"Dense_{k}"]["kernel"].value
    assert not is_sharded(leaf) and "data" in str(leaf.sharding.spec), leaf.sharding


def _dict_step(tx):
  """A step on a dict of arrays, as the JAX docs write one: tanh MLP, mean squared error."""
  def step(params, opt_state, x, y):
    def loss_fn(p):
      h = jnp.tanh(x @ p["w1"] + p["b1"])
      return jnp.mean((h @ p["w2"] + p["b2"] - y) ** 2)
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss
  return step


def _dict_args(mesh, tx, fsdp, batch_spec, steps=3):
  keys = jax.random.split(jax.random.key(0), 4)
  params = {"w1": jax.random.normal(keys[0], (16, 32)) * 0.1, "b1": jnp.zeros((32,)),
            "w2": jax.random.normal(keys[1], (32, 8)) * 0.1, "b2": jnp.linspace(0, 1, 16)[:8]}
  params = {k: jax.device_put(v, NamedSharding(mesh, P(fsdp) if v.ndim == 2 else P()))
            for k, v in params.items()}
  data = NamedSharding(mesh, batch_spec)
  xs = [(jax.device_put(jax.random.normal(jax.random.fold_in(keys[2], i), (32, 16)), data),
         jax.device_put(jax.random.normal(jax.random.fold_in(keys[3], i), (32, 8)), data))
        for i in range(steps)]
  return (params, tx.init(params)), xs


def _run_dict(mesh, tx, fsdp, batch_spec, steps=3, **tol):
  step = _dict_step(tx)
  args, xs = _dict_args(mesh, tx, fsdp, batch_spec, steps)
  ws = wus.jit(step)
  ref = out = args
  for x, y in xs:
    *ref, ref_loss = jax.jit(step)(*ref, x, y)
    *out, out_loss = ws(*out, x, y)
    assert_trees_equal(ref_loss, out_loss, **tol)
  return ref, out, ws.plan(*out, *xs[0])


@pytest.mark.parametrize("kind", ["auto", "explicit"])
def test_fsdp_on_a_one_axis_mesh_auto_and_explicit_bit_for_bit(kind):
  """`jax.make_mesh((8,), ("data",))` (Explicit axes by default) with the weights placed
  P("data"): Adam bit for bit, the weights' state as placed, the biases' sharded by wus."""
  mesh = _mesh((8,), ("data",), kind)
  ref, out, plan = _run_dict(mesh, optax.adam(1e-2), "data", P("data"))
  assert_trees_equal(ref, wus.unshard(out))
  lines = _lines(plan)
  assert "FSDP over ['data']" in lines["opt_state[0].mu['w1']"], lines
  assert "sharded over ['data'] by wus" in lines["opt_state[0].mu['b1']"], lines
  assert is_sharded(out[1][0].mu["b1"]) and not is_sharded(out[1][0].mu["w1"])
  spec = out[1][0].mu["w1"].sharding.spec
  assert tuple(spec)[:1] == ("data",) and set(tuple(spec)[1:]) <= {None}, spec


def test_hsdp_blocks_sharded_over_replica_weights_bit_for_bit_in_one_step():
  """HSDP on ("replica", "fsdp") = (2, 4), the batch over both, the weights over "fsdp":
  each fsdp block's state is sharded over "replica" (1/8 of it per device); the weights'
  gradients are summed over "fsdp" then "replica", as GSPMD sums them: bit for bit in one
  step. A bias's sum is one all-reduce over both axes in the unmodified step, a
  reduce-scatter over both here (in phases, "fsdp" first, §5.1): 1/8 of its state per
  device, within summation order."""
  mesh = _mesh((2, 4), ("replica", "fsdp"))
  batch = P(("replica", "fsdp"))
  ref, out, plan = _run_dict(mesh, optax.adam(1e-2), "fsdp", batch, steps=1)
  whole = wus.unshard(out)
  for k in ("w1", "w2"):
    assert_trees_equal(ref[0][k], whole[0][k])
    assert_trees_equal(ref[1][0].mu[k], whole[1][0].mu[k])
    mu = out[1][0].mu[k]
    assert is_sharded(mu) and mu.nbytes_per_device * 8 == mu.size * 4, mu
  assert_trees_equal(ref, whole, rtol=1e-6, atol=1e-9)
  assert plan.axes == ("replica",)
  # The bias of 32, summed over both axes, is reduce-scattered over both: 1/8 per device.
  mu = out[1][0].mu["b1"]
  assert is_sharded(mu) and mu.nbytes_per_device * 8 == mu.size * 4, mu
  line = next(ln for ln in str(plan).splitlines() if "params['b1']" in ln)
  assert "its gradient all-reduce runs over ['fsdp'] too" in line, line
  ref, out, _ = _run_dict(mesh, optax.adam(1e-2), "fsdp", batch, rtol=1e-6)
  assert_trees_equal(ref, wus.unshard(out), rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("name,make_tx", [
    ("clip_adamw", lambda: optax.chain(optax.clip_by_global_norm(0.1), optax.adamw(1e-2))),
    pytest.param("lamb", lambda: optax.lamb(1e-2), marks=pytest.mark.slow),
])
def test_fsdp_norms_combine_across_blocks_within_summation_order(name, make_tx):
  """Global-norm clipping and LAMB's trust ratios read the FSDP kernels' blocks: their
  partial sums are completed over "data" as the unmodified step completes them."""
  mesh = _mesh((8, 1), ("data", "model"))
  step, args, batches = _setup(mesh, FSDP, make_tx())
  _, _, plan = _run(step, args, batches, rtol=1e-6, atol=1e-8)
  assert not plan.unchanged, plan.unchanged


def test_fsdp_plus_tensor_parallel_linen_bit_for_bit():
  """MaxText's rules on ("data", "model") = (4, 2): "embed" over "data" (FSDP), "mlp"
  and "heads" over "model" (tensor parallelism), Adam bit for bit; the kernels' state as
  placed over data x model, the biases' over "model" sharded by wus over "data"."""
  mesh = _mesh((4, 2), ("data", "model"))
  step, args, batches = _setup(mesh, FSDP_TP, optax.adam(1e-2))
  _, out, plan = _run(step, args, batches)
  assert not plan.unchanged, plan.unchanged
  lines = _lines(plan)
  name = "opt_state[0].mu['params']['Dense_0']['kernel'].value"
  assert "FSDP over ['data']" in lines[name], lines[name]
  bias = out[1][0].mu["params"]["Dense_0"]["bias"]
  assert is_sharded(bias) and bias.layout.split_axes == ("model",), bias


def test_hsdp_checkpoint_restores_on_fsdp_alone_through_state_target(tmp_path):
  """HSDP state (2 x 4) saved with stock Orbax (`wus.checkpointable`) restores through
  `state_target` on ("data",) = (4,) (FSDP alone, fewer replicas), equal to the saved
  state, and trains on as jax.jit does from it."""
  import orbax.checkpoint as ocp  # noqa: PLC0415
  tx = optax.adam(1e-2)
  _, out, _ = _run_dict(_mesh((2, 4), ("replica", "fsdp")), tx, "fsdp", P(("replica", "fsdp")),
                        steps=1)
  ckptr = ocp.StandardCheckpointer()
  ckptr.save(tmp_path / "ckpt", wus.checkpointable({"params": out[0], "opt_state": out[1]}))
  ckptr.wait_until_finished()
  small = _mesh((4,), ("data",))
  saved = wus.unshard((out[0], out[1]))
  whole = jax.tree.map(lambda x: jax.device_put(np.asarray(x), NamedSharding(
      small, P("data") if x.ndim == 2 else P())), saved)
  (x, y), = _dict_args(small, tx, "data", P("data"), steps=1)[1]
  step = _dict_step(tx)
  ws = wus.jit(step)
  target_params, target_opt, _, _ = ws.state_target(*whole, x, y)
  restored = ckptr.restore(tmp_path / "ckpt", {"params": target_params, "opt_state": target_opt})
  assert_trees_equal(whole, wus.unshard((restored["params"], restored["opt_state"])))
  again = ws(restored["params"], restored["opt_state"], x, y)
  assert_trees_equal(jax.jit(step)(*whole, x, y), wus.unshard(again))
  assert is_sharded(again[1][0].mu["b1"]) and not is_sharded(again[1][0].mu["w1"])


def _embedding_run(tx, steps=3):
  """An embedding table placed over "data" (FSDP), a whole dense head: the table's
  gradient is a scatter-add of the batch's rows."""
  mesh = _mesh((8,), ("data",))
  keys = jax.random.split(jax.random.key(3), 3)
  params = {"table": jax.device_put(jax.random.normal(keys[0], (16, 8)),
                                    NamedSharding(mesh, P("data"))),
            "w": jax.device_put(jax.random.normal(keys[1], (8, 4)) * 0.1,
                                NamedSharding(mesh, P()))}

  def step(params, opt_state, ids, y):
    def loss_fn(p):
      return jnp.mean((jnp.take(p["table"], ids, axis=0) @ p["w"] - y) ** 2)
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  data = NamedSharding(mesh, P("data"))
  batches = [(jax.device_put(jax.random.randint(jax.random.fold_in(keys[2], i), (32,), 0, 16),
                             data),
              jax.device_put(jax.random.normal(jax.random.fold_in(keys[2], 100 + i), (32, 4)),
                             data)) for i in range(steps)]
  ws = wus.jit(step)
  ref = out = (params, tx.init(params))
  for ids, y in batches:
    ref, out = jax.jit(step)(*ref, ids, y)[:2], ws(*out, ids, y)[:2]
  assert_trees_equal(ref, wus.unshard(out))
  return out, ws.plan(*out, *batches[0])


def test_fsdp_embedding_summed_as_gspmd_sums_it_bit_for_bit():
  """An FSDP embedding table's gradient (a scatter-add) is summed outside the region, as
  GSPMD sums it (a sum wus would reduce-scatter itself reorders the rows' sums); its block
  enters the region, the dense head's state is sharded by wus. Bit for bit."""
  out, plan = _embedding_run(optax.adam(1e-2))
  assert not plan.unchanged, plan.unchanged
  assert is_sharded(out[1][0].mu["w"]) and not is_sharded(out[1][0].mu["table"])


def test_fsdp_embedding_under_multi_steps_served_bit_for_bit():
  """Regression (fuzz case: an FSDP [10, 1] table, MultiSteps of nesterov momentum): the
  MultiSteps `cond` ran on the table's block in the region and read the head's update
  whole, so nothing was left to shard and the whole step ran as jax.jit runs it. Served
  since the conditional is split into its independent parts (`transforms.cond_parts`):
  the table's momentum stays as placed, the head's is sharded. Bit for bit."""
  out, plan = _embedding_run(optax.MultiSteps(optax.trace(0.9, nesterov=True), 2))
  assert not plan.unchanged, plan.unchanged
  trace = out[1].inner_opt_state.trace
  assert is_sharded(trace["w"]) and not is_sharded(trace["table"]), plan


@pytest.mark.parametrize("kind", ["auto", pytest.param("explicit", marks=pytest.mark.slow)])
def test_fsdp_position_embedding_summed_outside_the_rest_served(kind):
  """A GPT's token and learned position embeddings placed over "fsdp" (1-D FSDP), looked
  up as JAX asks on each mesh kind: their gradients are scatter-adds, summed outside the
  region as GSPMD sums them (issue 37 item 4: one equation no longer refuses the step);
  the bias's state is sharded. Bit for bit."""
  mesh = _mesh((8,), ("fsdp",), kind)
  explicit = kind == "explicit"
  vocab, seq, embed = 64, 16, 32

  def loss(p, idx):
    pos = jnp.arange(idx.shape[1])
    if explicit:
      x = (p["wte"].at[idx].get(out_sharding=P("fsdp", None, None))
           + p["wpe"].at[pos].get(out_sharding=P(None, None)))
    else:
      x = p["wte"][idx] + p["wpe"][pos]
    h = jnp.tanh(x @ p["w"] + p["b"])
    logits = jnp.einsum("bte,ve->btv", h, p["wte"],
                        out_sharding=P("fsdp", None, None) if explicit else None)
    return optax.softmax_cross_entropy_with_integer_labels(logits, idx).mean()
  tx, rng = optax.adamw(1e-2), np.random.default_rng(0)

  def step(p, s, idx):
    value, grads = jax.value_and_grad(loss)(p, idx)
    updates, s = tx.update(grads, s, p)
    return optax.apply_updates(p, updates), s, value
  shapes = {"wte": (vocab, embed), "wpe": (seq, embed), "w": (embed, embed), "b": (embed,)}
  with jax.set_mesh(mesh):
    params = {k: jax.device_put(rng.normal(size=s).astype(np.float32) * 0.02,
                                NamedSharding(mesh, P("fsdp") if len(s) == 2 else P()))
              for k, s in shapes.items()}
    batches = [jax.device_put(rng.integers(0, vocab, (16, seq)).astype(np.int32),
                              NamedSharding(mesh, P("fsdp"))) for _ in range(2)]
    _, out, plan = _run(step, (params, tx.init(params)), batches)
  assert not plan.unchanged, plan.unchanged
  assert [x.shape for x in _sharded(out[1])] == [(embed,)] * 2  # mu and nu of the bias.


def _levanter_step(mesh, tx):
  """Levanter's step, shrunk: stacked layers under a scan (haliax's `Stacked`) and the loss
  per token computed inside a shard_map (its fused cross-entropy, `check_vma=False`)."""
  batch = P(("replica", "data"))

  def loss_fn(p, x, y):
    def layer(h, w):
      return h + jax.nn.relu((h * w["norm"]) @ w["w1"]) @ w["w2"], None
    h, _ = jax.lax.scan(layer, x, {k: p[k] for k in ("w1", "w2", "norm")})

    def cross_entropy(h, y, head):
      return optax.softmax_cross_entropy_with_integer_labels(h @ head, y)
    return jax.shard_map(cross_entropy, mesh=mesh, in_specs=(batch, batch, P()),
                         out_specs=batch, check_vma=False)(h, y, p["head"]).mean()

  def step(params, opt_state, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss
  return step


def test_hsdp_stacked_layers_and_a_shard_map_loss_as_levanter_writes_them():
  """Levanter on ("data", "replica", "model") = (2, 2, 2): the kernels over "data" (FSDP)
  and "model", the batch over ("replica", "data"). The loss's shard_map passes its
  gradient's residuals on stacked over every mesh axis, "model" among them: no layout of
  the batch, so "model" stays a model axis. Every gradient is summed inside the scan or
  the shard_map, so each block reaches the update summed, repeated over "replica", which
  shards it: 1/8 of the kernels' moments per device, 1/4 of the blocks
  whole over "model". Weights bit for bit, the loss (summed in
  phases) within summation order."""
  mesh = _mesh((2, 2, 2), ("data", "replica", "model"))
  tx = optax.adam(1e-2)
  rng = np.random.default_rng(0)
  shapes = {"w1": ((2, 16, 32), P(None, "data", "model")),
            "w2": ((2, 32, 16), P(None, "model", "data")),
            "norm": ((2, 16), P(None, "data")), "head": ((16, 8), P("data", None))}
  params = {k: jax.device_put(rng.normal(size=s).astype(np.float32) * 0.1,
                              NamedSharding(mesh, spec)) for k, (s, spec) in shapes.items()}
  data = NamedSharding(mesh, P(("replica", "data")))
  batches = [(jax.device_put(rng.normal(size=(16, 16)).astype(np.float32), data),
              jax.device_put(rng.integers(0, 8, size=(16,)).astype(np.int32), data))
             for _ in range(3)]
  step = _levanter_step(mesh, tx)
  ws = wus.jit(step)
  ref = out = (params, tx.init(params))
  for x, y in batches:
    *ref, ref_loss = jax.jit(step)(*ref, x, y)
    *out, out_loss = ws(*out, x, y)
    assert_trees_equal(ref_loss, out_loss, rtol=1e-6)
  assert_trees_equal(ref, wus.unshard(out))
  plan = ws.plan(*out, *batches[0])
  assert plan.axes == ("replica",), plan
  for k in shapes:
    mu = out[1][0].mu[k]
    # A block whole over "model" (norm, head) is repeated there too, and sharded over it.
    assert is_sharded(mu) and mu.nbytes_per_device * 8 == mu.size * 4, (k, mu)


def _fsdp_tp_step(tx, explicit):
  """FSDP + TP as the JAX sharding guide writes it, shrunk: every kernel's rows over
  "fsdp", the hidden dim over "model" (w1 column-parallel, w2 row-parallel), an input and
  an output projection whole over "model" (FSDP alone). The activations are laid out as
  pjit-era code lays them out on Auto axes (`with_sharding_constraint`; unconstrained,
  GSPMD may split their products over the idle "model" axis too, another summation order
  than the update region's), and on Explicit axes each kernel is resharded before use
  (FSDP's all-gather) and the row-parallel product says its layout."""
  uses = {"w_in": P(), "w1": P(None, "model"), "w2": P("model", None), "w_out": P()}

  def lay(x, *spec):
    return x if explicit else jax.lax.with_sharding_constraint(x, P(*spec))

  def loss_fn(p, x, y):
    if explicit:
      p = {k: reshard(v, uses[k]) for k, v in p.items()}
    h = lay(x @ p["w_in"], "fsdp", None)
    z = lay(jnp.tanh(h @ p["w1"]), "fsdp", "model")
    h = h + lay(jnp.einsum("bh,he->be", z, p["w2"],
                           out_sharding=P("fsdp", None) if explicit else None), "fsdp", None)
    return jnp.mean((h @ p["w_out"] - y) ** 2)

  def step(params, opt_state, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss
  return step


@pytest.mark.parametrize("kind", ["auto", "explicit"])
def test_fsdp_blocks_whole_over_model_sharded_over_it_bit_for_bit(kind):
  """FSDP + TP on ("fsdp", "model") = (4, 2): the projections' blocks over "fsdp" are
  whole over "model", whose every replica repeats their update; each keeps half of its
  block's state (1/8 of a copy per device) and all-gathers the new block over "model".
  The hidden kernels' blocks, split over "model" too, stay as placed (their updates
  differ across it). AdamW bit for bit against jax.jit over 3 steps."""
  mesh = _mesh((4, 2), ("fsdp", "model"), kind)
  tx = optax.adamw(1e-2)
  specs = {"w_in": P("fsdp", None), "w1": P("fsdp", "model"), "w2": P("model", "fsdp"),
           "w_out": P("fsdp", None)}
  shapes = {"w_in": (16, 32), "w1": (32, 64), "w2": (64, 32), "w_out": (32, 8)}
  rng = np.random.default_rng(0)
  params = {k: jax.device_put(rng.normal(size=shapes[k]).astype(np.float32) * 0.1,
                              NamedSharding(mesh, specs[k])) for k in specs}
  data = NamedSharding(mesh, P("fsdp"))
  batches = [(jax.device_put(rng.normal(size=(16, 16)).astype(np.float32), data),
              jax.device_put(rng.normal(size=(16, 8)).astype(np.float32), data))
             for _ in range(3)]
  step = _fsdp_tp_step(tx, kind == "explicit")
  ws = wus.jit(step)
  ref = out = (params, tx.init(params))
  with jax.set_mesh(mesh):
    for x, y in batches:
      *ref, ref_loss = jax.jit(step)(*ref, x, y)
      *out, out_loss = ws(*out, x, y)
      assert_trees_equal(ref_loss, out_loss)
    plan = ws.plan(*out, *batches[0])
  assert_trees_equal(ref, wus.unshard(out))
  assert not plan.unchanged, plan.unchanged
  lines, adam = _lines(plan), out[1][0]
  for k in ("w_in", "w_out"):
    mu = adam.mu[k]
    assert is_sharded(mu) and (mu.layout.axes, mu.layout.split_axes) == (("model",), ("fsdp",))
    assert "FSDP over ['fsdp'], sharded over ['model'] by wus" in lines[f"opt_state[0].mu['{k}']"]
  for k in ("w1", "w2"):
    assert not is_sharded(adam.mu[k]) and "FSDP over ['fsdp']" in lines[f"opt_state[0].mu['{k}']"]
  leaves = [x for x in jax.tree.leaves(out[1], is_leaf=is_sharded) if np.size(x) > 8]
  whole = sum(np.size(x) * 4 for x in leaves)
  per_device = sum(x.nbytes_per_device if is_sharded(x) else
                   x.addressable_shards[0].data.nbytes for x in leaves)
  assert per_device <= 1.15 * whole / 8, (per_device, whole, plan)
