"""`wus.pmap(..., shard_weights=True)` on the Haiku ImageNet example's
mixed-precision step (dm-haiku examples/imagenet/train.py, the jmp version):

  @functools.partial(jax.pmap, axis_name='i', donate_argnums=(0,))
  def train_step(train_state, batch):
    ...grads = jax.grad(loss_fn, has_aux=True)(params, state, loss_scale, batch)
    grads = policy.cast_to_compute(grads)          # bfloat16
    grads = jax.lax.pmean(grads, axis_name='i')     # the all-reduce in bfloat16
    grads = policy.cast_to_param(grads)             # float32
    updates, opt_state = make_optimizer().update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)

with the policy `p=f32,c=bf16,o=f32` written out with Flax linen (each layer
casts its float32 params to bfloat16; BatchNorm computes in float32, as the
example's BatchNorm policy does), and its L2 weight decay over the float32
params but BatchNorm's. pmap squeezes the mapped axis off every argument, so
the update and the forward pass both read the squeezed weight; the squeeze
runs on the shard and the forward pass gathers the squeezed weight in
bfloat16 (analysis/precision.py).
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import wus
from helpers import assert_trees_equal, collective_arrays, sharded_leaves
from wus.analysis import causes, network, precision, reasons, verdicts
from wus.analysis.graph import Graph
from wus.analysis.reasons import Reason

N = 8
TX = optax.sgd(optax.linear_schedule(0.0, 0.1, 5), momentum=0.9, nesterov=True)
WEIGHT_DECAY = 1e-4


class ResNetish(nn.Module):
  """Two conv-BatchNorm-relu blocks and a dense head, mixed precision."""

  @nn.compact
  def __call__(self, x):
    conv = functools.partial(nn.Conv, kernel_size=(3, 3), use_bias=False, dtype=jnp.bfloat16,
                             param_dtype=jnp.float32)
    # The example's BatchNorm policy: float32 params and compute, bfloat16 out.
    norm = functools.partial(nn.BatchNorm, use_running_average=False, momentum=0.9,
                             dtype=jnp.float32, param_dtype=jnp.float32)
    x = x.astype(jnp.bfloat16)
    for _ in range(2):
      x = nn.relu(norm()(conv(16)(x))).astype(jnp.bfloat16)
    x = jnp.mean(x, axis=(1, 2))
    return nn.Dense(10, dtype=jnp.bfloat16, param_dtype=jnp.float32)(x).astype(jnp.float32)


MODEL = ResNetish()


def _cast(tree, dtype):
  return jax.tree.map(lambda x: x.astype(dtype), tree)


def make_step(weight_decay: bool):
  """The example's per-device train step (NoOpLossScale: bfloat16 needs none)."""
  def loss_fn(params, state, batch):
    logits, state = MODEL.apply({"params": params, "batch_stats": state}, batch["images"],
                                mutable=["batch_stats"])
    labels = jax.nn.one_hot(batch["labels"], 10)
    loss = jnp.mean(optax.softmax_cross_entropy(logits, labels))
    if weight_decay:
      l2_params = [p for path, p in jax.tree_util.tree_flatten_with_path(params)[0]
                   if "BatchNorm" not in jax.tree_util.keystr(path)]
      loss += WEIGHT_DECAY * 0.5 * sum(jnp.sum(jnp.square(p)) for p in l2_params)
    return loss, (loss, state["batch_stats"])

  def train_step(train_state, batch):
    params, state, opt_state = train_state
    grads, (loss, state) = jax.grad(loss_fn, has_aux=True)(params, state, batch)
    grads = _cast(grads, jnp.bfloat16)  # policy.cast_to_compute
    grads = jax.lax.pmean(grads, axis_name="i")
    grads = _cast(grads, jnp.float32)  # policy.cast_to_param
    updates, opt_state = TX.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    scalars = jax.lax.pmean({"train_loss": loss}, axis_name="i")
    return (params, state, opt_state), scalars

  return train_step


def _batch(i: int) -> dict:
  k1, k2 = jax.random.split(jax.random.key(100 + i))
  return {"images": jax.random.normal(k1, (N, 2, 8, 8, 3)),
          "labels": jax.random.randint(k2, (N, 2), 0, 10)}


def _train_state():
  """Fresh per-device copies (each step donates its own)."""
  variables = MODEL.init(jax.random.key(0), jnp.zeros((2, 8, 8, 3)))
  params, state = variables["params"], variables["batch_stats"]
  return jax.tree.map(lambda x: jnp.broadcast_to(x, (N, *x.shape)),
                      (params, state, TX.init(params)))


KERNELS = ["['Conv_0']['kernel']", "['Conv_1']['kernel']", "['Dense_0']['kernel']"]


def _run(weight_decay: bool, steps: int = 3, **kw):
  """The unmodified step and wus.pmap's, from the same inputs."""
  step = make_step(weight_decay)
  ref = jax.pmap(step, axis_name="i", donate_argnums=(0,))
  ws = wus.pmap(step, axis_name="i", donate_argnums=(0,), **kw)
  a, b = _train_state(), _train_state()
  for i in range(steps):
    (a, ma), (b, mb) = ref(a, _batch(i)), ws(b, _batch(i))
    assert_trees_equal(ma, mb)
  return a, b, ws


def _clusters(plan, names) -> list:
  """The Plan's clusters that update one of `names` (train_state[0]'s paths)."""
  return [c for c in plan.clusters if {t.name for t in c.tensors} & {
      f"{prefix}{k}" for k in names for prefix in ("train_state[0]", "[0][0]")}]


def _input(plan, name: str):
  (i,) = [i for i in plan.inputs if i.name == name]
  return i


def _named(tree) -> dict:
  return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(
      tree, is_leaf=lambda v: isinstance(v, wus.ShardedArray))[0]}


@pytest.mark.slow  # Both objectives end to end (a minute each); the other tests here stay.
@pytest.mark.parametrize("objective", ["memory", "time"])
def test_weights_stay_sharded_and_match_jax_pmap(objective):
  a, b, ws = _run(weight_decay=False, shard_weights=True, objective=objective)
  params = _named(b[0])
  # The conv and dense weights, read by the layers only as bfloat16; BatchNorm
  # reads its scale and bias in float32, and they come back whole.
  narrow = [*KERNELS, "['Dense_0']['bias']"]
  assert all(isinstance(params[k], wus.ShardedArray) for k in narrow)
  assert not any(isinstance(x, wus.ShardedArray) for k, x in params.items() if "BatchNorm" in k)
  got = wus.unshard(b[0])
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(got))
  assert_trees_equal(a[0], got)  # Elementwise update; the same bfloat16 copies.
  assert_trees_equal(a[1], b[1])  # BatchNorm statistics, per device.
  assert_trees_equal(a[2], wus.unshard(b[2]))
  plan = ws.plan(b, _batch(0))
  gathers = [g for c in plan.clusters for note in c.why.notes
             if isinstance(note, reasons.KeptShardedWeights) for g in note.gathers]
  assert sorted(g.name for g in gathers) == sorted(f"train_state[0]{k}" for k in narrow)
  assert all(g.dtype == "bfloat16" and g.narrow for g in gathers), gathers
  # Sharded under "time" too: the gather moves as many bytes as the bfloat16
  # all-reduce's second half. BatchNorm's are slower sharded (a float32 gather).
  clusters = _clusters(plan, narrow)
  assert len(clusters) == len(narrow) and all(c.sharded for c in clusters), plan


@pytest.mark.slow  # tests/transforms/test_shard_weights.py checks the 16-bit gather by default.
def test_the_weight_all_gather_is_bfloat16():
  """The narrow weights are gathered as 16-bit words in one batched all-gather;
  only BatchNorm's float32 scale and bias are gathered in float32."""
  _, b, ws = _run(weight_decay=False, steps=1, shard_weights=True)
  params = _named(b[0])
  lines = ws.lower(b, _batch(1)).compile().as_text().splitlines()
  gathers = collective_arrays(lines, "all-gather")
  elements = lambda dtype: sum(int(np.prod([int(d) for d in a[4:-1].split(",")]))
                               for a in gathers if a.startswith(dtype + "["))
  # A ShardedArray's data: every device's shard, padding included.
  narrow = sum(x.data.size for x in params.values() if isinstance(x, wus.ShardedArray))
  assert elements("u16") + elements("bf16") == narrow, gathers
  whole = [x for k, x in params.items() if "BatchNorm" in k]  # Stacked [N, 16].
  assert elements("f32") == sum(-(-x[0].size // N) * N for x in whole), gathers


@pytest.mark.slow  # 37 s; test_shard_weights.py checks which weights stay whole by default.
def test_weight_decay_keeps_the_weights_whole():
  """The L2 term reads every weight but BatchNorm's whole, in float32: a
  bfloat16 gather cannot feed it, and a float32 one would move as many bytes
  as returning the weight whole. The weights stay whole (jax.pmap's stacked
  copies), the Plan says why, and their optimizer state is sharded."""
  a, b, ws = _run(weight_decay=True, shard_weights=True)
  assert not sharded_leaves(b[0])
  assert_trees_equal(a[0], b[0])
  assert_trees_equal(a[2], wus.unshard(b[2]))
  assert sharded_leaves(b[2])
  plan = ws.plan(b, _batch(0))
  for k in KERNELS:  # Whole, updated by its cluster: the L2 term's square reads it in float32.
    kernel = _input(plan, f"train_state[0]{k}")
    assert not kernel.sharded and isinstance(kernel.why.verdict, reasons.ClusterUpdates)
    assert plan.clusters[kernel.why.verdict.index].sharded  # For its optimizer state.
    (note,) = kernel.why.notes
    assert isinstance(note, reasons.NotKeptByShardWeights), kernel.why
    assert isinstance(note.why, causes.ReadsIn) and not note.why.converted, note.why
    assert (note.why.eqn.primitive, note.why.dtype) == ("square", "float32"), note.why


def test_without_shard_weights_time_keeps_bfloat16_gradient_updates_replicated():
  """Issue 13: with bfloat16 gradients the float32 weight all-gather costs more
  than the bfloat16 all-reduce it replaces. "memory" (the default) still
  shards for the optimizer state; "time" keeps those clusters replicated;
  shard_weights gathers in bfloat16 and "time" shards them (test above)."""
  step = make_step(weight_decay=False)
  args = (_train_state(), _batch(0))
  memory = wus.pmap(step, axis_name="i").plan(*args)
  # On accelerator-class figures (on CPU devices the links are as fast as memory).
  time = wus.pmap(step, axis_name="i", objective="time",
                  topology=network.default_topology(8, platform="tpu")).plan(*args)
  assert len(_clusters(memory, KERNELS)) == len(_clusters(time, KERNELS)) == len(KERNELS)
  assert all(c.sharded and isinstance(c.why.verdict, verdicts.KeepsStateSharded)
             for c in _clusters(memory, KERNELS)), memory
  assert all(not c.sharded and isinstance(c.why.verdict, verdicts.SlowerSharded)
             for c in _clusters(time, KERNELS)), time


def test_off_by_default():
  a, b, _ = _run(weight_decay=False, steps=1)
  assert not sharded_leaves(b[0]) and sharded_leaves(b[2])
  assert_trees_equal(a[0], b[0])


# --- A dense step: how the forward pass reaches the weight. -------------------------

def dense_step(variant: str = ""):
  """A bfloat16 dense layer, the example's casts around the gradient pmean.

  variant "reshape": the forward pass reshapes the float32 weight before its
  cast (followed on the narrow whole value); "returned": the step also
  returns the weight it read (whole in float32, so kept whole).
  """
  tx = optax.sgd(1e-2, momentum=0.9, nesterov=True)

  def step(params, opt_state, x):
    def loss(p):
      w = p["w"].reshape(8, 8, 96).reshape(64, 96) if variant == "reshape" else p["w"]
      h = jnp.tanh(x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16) + p["b"].astype(jnp.bfloat16))
      return jnp.mean(h.astype(jnp.float32) ** 2)

    value, grads = jax.value_and_grad(loss)(params)
    grads = _cast(jax.lax.pmean(_cast(grads, jnp.bfloat16), "i"), jnp.float32)
    updates, new_opt_state = tx.update(grads, opt_state, params)
    out = optax.apply_updates(params, updates), new_opt_state, jax.lax.pmean(value, "i")
    return (*out, params["w"]) if variant == "returned" else out

  k = jax.random.split(jax.random.key(0), 2)
  params = {"w": 0.1 * jax.random.normal(k[0], (64, 96)), "b": jnp.zeros(96)}
  return step, (params, tx.init(params))


def _run_dense(variant="", in_axes=0, out_axes=0, steps=3, same_metrics=True, **kw):
  step, state = dense_step(variant)
  ref = jax.pmap(step, axis_name="i", in_axes=in_axes, out_axes=out_axes)
  ws = wus.pmap(step, axis_name="i", in_axes=in_axes, out_axes=out_axes, shard_weights=True,
                **kw)
  if in_axes == 0:
    state = jax.tree.map(lambda x: jnp.broadcast_to(x, (N, *x.shape)), state)
  a = b = state
  for i in range(steps):
    x = jax.random.normal(jax.random.key(10 + i), (N, 2, 64))
    ra, rb = ref(*a, x), ws(*b, x)
    a, b = ra[:2], rb[:2]
    if same_metrics:
      assert_trees_equal(ra[2:], rb[2:])
  return a, b, ws, x


@pytest.mark.parametrize("variant", ["", "reshape"])
def test_dense_weights_stay_sharded(variant):
  a, b, ws, x = _run_dense(variant)
  assert len(sharded_leaves(b[0])) == 2
  assert_trees_equal(a, wus.unshard(b))
  w = _input(ws.plan(*b, x), "params['w']")
  assert w.sharded and w.why == Reason(reasons.NarrowWeight(w.why.verdict.index, "bfloat16"))


def test_a_weight_the_step_returns_stays_whole():
  """Returned, the weight is read whole in float32: a bfloat16 gather would return it narrow."""
  a, b, ws, x = _run_dense("returned")
  assert isinstance(b[0]["b"], wus.ShardedArray) and not isinstance(b[0]["w"], wus.ShardedArray)
  assert_trees_equal(a, wus.unshard(b))
  w = _input(ws.plan(*b, x), "params['w']")
  assert w.why.notes == (reasons.NotKeptByShardWeights(causes.Returned("float32[1,64,96]")),), (
      w.why)


def test_unmapped_params_as_the_flax_imagenet_example():
  """in_axes=None, out_axes=None: no squeeze between the weight and its reads."""
  a, b, _, _ = _run_dense(in_axes=(None, None, 0), out_axes=(None, None, None))
  assert len(sharded_leaves(b[0])) == 2
  assert_trees_equal(a, wus.unshard(b))


def test_partial_sharding_gathers_narrow_too():
  """With groups of 4 the gradient sums in another order than jax.pmap's
  all-reduce (docs/options.md); bit for bit with the same groups without shard_weights."""
  _, b, _, _ = _run_dense(shard_group_size=4, same_metrics=False)
  step, state = dense_step()
  plain = wus.pmap(step, axis_name="i", shard_group_size=4)
  c = jax.tree.map(lambda x: jnp.broadcast_to(x, (N, *x.shape)), state)
  for i in range(3):
    c = plain(*c, jax.random.normal(jax.random.key(10 + i), (N, 2, 64)))[:2]
  assert len(sharded_leaves(b[0])) == 2
  assert_trees_equal(wus.unshard(c), wus.unshard(b))


# --- The precision pass through a squeeze. ----------------------------------------

def _squeezed(forward):
  """(graph, update) of `w = squeeze(w3)`, `forward(w)`, and the update `w + u`."""
  def f(w3, u):
    w = jnp.squeeze(w3, 0)
    return forward(w), w + u
  jaxpr = jax.make_jaxpr(f)(jnp.zeros((1, 4, 4)), jnp.zeros((4, 4))).jaxpr
  return Graph(jaxpr, N), {len(jaxpr.eqns) - 1}  # The update: the last equation.


def test_narrowed_follows_the_squeeze_the_update_reads_through():
  graph, update = _squeezed(lambda w: w.astype(jnp.bfloat16) * 2)
  (squeeze, convert, *_), x = graph.jaxpr.eqns, graph.jaxpr.invars[0]
  read = precision.narrowed(graph, x, update)
  # The squeeze joins the update; its result is gathered narrow, in its shape.
  assert read == precision.Narrowed(np.dtype(jnp.bfloat16), (0,), (squeeze.outvars[0],))
  assert precision.narrowed(graph, x, update | {0}).copies == ()
  graph, update = _squeezed(lambda w: w.astype(jnp.bfloat16) * jnp.sum(w * w))
  why = precision.narrowed(graph, graph.jaxpr.invars[0], update)
  assert isinstance(why, causes.ReadsIn) and (why.eqn.primitive, why.dtype) == ("mul", "float32")
