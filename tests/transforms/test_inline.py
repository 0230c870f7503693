"""transforms/inline.py: `spliced` (calls spliced in on the jaxpr's structure) builds the
jaxpr `inlined` traces, and declines where only the trace applies.

The programs are published ones: Flax's MNIST example's `apply_model` (its CNN, shrunk,
`optax.softmax_cross_entropy`) and its update by AdamW, a `jax.checkpoint`-ed layer and a
`lax.scan` over layers with calls inside (JAX docs, "Control flow")."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.extend.core import jaxpr_as_fun

from helpers import assert_trees_equal
from wus.analysis import compat
from wus.transforms import inline

TX = optax.adamw(learning_rate=1e-3)


class CNN(nn.Module):
  """Flax's examples/mnist/train.py model, shrunk."""

  @nn.compact
  def __call__(self, x):
    x = nn.Conv(features=4, kernel_size=(3, 3))(x)
    x = nn.relu(x)
    x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
    x = x.reshape((x.shape[0], -1))
    x = nn.relu(nn.Dense(features=8)(x))
    return nn.Dense(features=10)(x)


def apply_model(params, images, labels):
  """Flax's examples/mnist/train.py `apply_model`, the state's apply_fn as CNN().apply."""
  def loss_fn(params):
    logits = CNN().apply({"params": params}, images)
    one_hot = jax.nn.one_hot(labels, 10)
    loss = jnp.mean(optax.softmax_cross_entropy(logits=logits, labels=one_hot))
    return loss, logits
  (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
  accuracy = jnp.mean(jnp.argmax(logits, -1) == labels)
  return grads, loss, accuracy


def mnist_step(params, opt_state, images, labels):
  """`apply_model`, then the update as the example's `TrainState.apply_gradients` runs it."""
  grads, loss, _ = apply_model(params, images, labels)
  updates, opt_state = TX.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss


def scanned_layers(ws, x):
  """A scan over stacked layers whose body calls jitted jnp functions (jnp.where, softmax),
  and a cond whose branches do too."""
  def layer(h, w):
    h = jax.nn.softmax(jnp.where(h > 0, h @ w, -h @ w))
    return h, jnp.sum(h)
  h, sums = lax.scan(layer, x, ws)
  h = lax.cond(sums[0] > 0.5, lambda h: jnp.where(h > 0.1, h, 0.0), jax.nn.relu, h)
  return jnp.sum(h), sums


def _all_primitives(jaxpr):
  for eqn in jaxpr.eqns:
    yield eqn.primitive
    for sub in compat.sub_jaxprs(eqn):
      yield from _all_primitives(sub)


def _flat_cases():
  rng = np.random.default_rng(0)
  images = jnp.asarray(rng.normal(size=(4, 8, 8, 1)), jnp.float32)
  labels = jnp.asarray([1, 0, 7, 3], jnp.int32)
  cnn = CNN().init(jax.random.key(0), images)["params"]
  ws = jnp.asarray(rng.normal(size=(3, 4, 4)), jnp.float32)
  h = jnp.asarray(rng.normal(size=(2, 4)), jnp.float32)
  return [(mnist_step, (cnn, TX.init(cnn), images, labels)),
          (apply_model, (cnn, images, labels)),
          (jax.grad(lambda ws, h: scanned_layers(ws, h)[0]), (ws, h))]


def test_spliced_computes_what_the_traced_program_computes():
  for fn, args in _flat_cases():
    closed = jax.make_jaxpr(fn)(*args)
    assert any(p in inline.INLINED for p in _all_primitives(closed.jaxpr)), fn.__name__
    flat = inline.spliced(closed)
    assert flat is not None, fn.__name__
    assert not any(p in inline.INLINED for p in _all_primitives(flat.jaxpr)), fn.__name__
    traced = jax.make_jaxpr(inline.inlined(closed))(*closed.in_avals)
    leaves = jax.tree.leaves(args)
    # Compiled, as the step runs (XLA inlines the calls; run op by op they would round
    # apart from the fused program).
    want = jax.jit(jaxpr_as_fun(closed))(*leaves)
    assert_trees_equal(jax.jit(jaxpr_as_fun(flat))(*leaves), want)
    assert_trees_equal(jax.jit(jaxpr_as_fun(traced))(*leaves), want)
    if any(p in (lax.cond_p, lax.scan_p) for p in _all_primitives(closed.jaxpr)):
      continue  # The trace re-binds control flow by lax's functions (a switch's clamp).
    # The same equations as the trace, once dead code is dropped from both.
    count = sorted(str(p) for p in _all_primitives(compat.dce(flat.jaxpr)))
    assert count == sorted(str(p) for p in _all_primitives(compat.dce(traced.jaxpr))), fn.__name__


def test_spliced_equations_of_a_library_call_point_at_the_users_line():
  def relu_where(x):
    return jnp.where(x > 0, x, 0.0)  # jnp.where's equations are in a jit of JAX's own.
  closed = jax.make_jaxpr(relu_where)(jnp.ones((3,)))
  flat = inline.spliced(closed)
  (select,) = [e for e in flat.jaxpr.eqns if e.primitive.name == "select_n"]
  assert "test_inline.py" in compat.source_line(select)


def test_a_call_used_twice_gets_fresh_variables_each_time():
  @jax.jit
  def f(x):
    return jnp.sin(x) * 2.0

  def g(x):
    return f(x) + f(x + 1.0)
  closed = jax.make_jaxpr(g)(jnp.ones((3,)))
  flat = inline.spliced(closed)
  defined = [v for e in flat.jaxpr.eqns for v in e.outvars]
  assert len(defined) == len(set(defined))
  x = jnp.arange(3.0)
  assert_trees_equal(jax.jit(jaxpr_as_fun(flat))(x), [jax.jit(g)(x)])


def test_splicing_declines_where_only_the_trace_applies():
  # A remat: `inlined` re-binds it and hoists all-reduces out of it.
  remat = jax.make_jaxpr(jax.grad(lambda w, x: jnp.sum(jax.checkpoint(jnp.tanh)(x @ w))))(
      jnp.ones((3, 3)), jnp.ones((2, 3)))
  assert inline.spliced(remat) is None
  # An all-reduce inside a scan (a shard_map body's): `inlined` hoists it after the scan.
  mesh = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:2])

  def body(ws, x):
    return lax.scan(lambda h, w: (h, lax.psum(jnp.sum(h * w), "data")), x, ws)
  smapped = jax.shard_map(body, mesh=mesh, in_specs=(jax.P(), jax.P("data")),
                          out_specs=(jax.P("data"), jax.P()))
  outer = jax.make_jaxpr(smapped)(jnp.ones((2, 3)), jnp.ones((2, 3)))
  smap = compat.shard_map_eqn(outer)
  assert inline.spliced(compat.ClosedJaxpr(compat.shard_map_params(smap)[0], ())) is None
