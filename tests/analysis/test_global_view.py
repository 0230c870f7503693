"""analysis/global_view.py: the batch splits, gradient sums and update region of a jax.jit step."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from wus.analysis import global_view
from wus.transforms import inline

N = 8


def _mesh(kind):
  return jax.make_mesh((N,), ("data",), axis_types=(
      AxisType.Auto if kind == "auto" else AxisType.Explicit,))


def _jaxpr(f, *args):
  """The flat global jaxpr of `jax.jit(f)` (calls inlined), as wus.jit analyses it."""
  closed = jax.jit(f).trace(*args).jaxpr
  avals = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=getattr(x, "sharding", None))
           for a, x in zip(closed.in_avals, jax.tree.leaves(args), strict=True)]
  return jax.make_jaxpr(inline.inlined(closed))(*avals).jaxpr


def _step(tx, cast=False):
  def step(params, opt_state, x):
    def loss(p):
      w = p["w"].astype(jnp.bfloat16) if cast else p["w"]
      return jnp.mean(jnp.tanh(x @ w + p["b"]).astype(jnp.float32) ** 2)
    grads = jax.grad(loss)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state
  return step


def _args(mesh, batch=16):
  params = jax.device_put({"w": jnp.ones((4, 3)), "b": jnp.zeros(3)}, NamedSharding(mesh, P()))
  x = jax.device_put(np.ones((batch, 4), np.float32), NamedSharding(mesh, P("data")))
  return params, x


def test_splits_from_types_on_an_explicit_mesh():
  mesh = _mesh("explicit")
  with jax.set_mesh(mesh):
    params, x = _args(mesh)
    tx = optax.sgd(0.1)
    jaxpr = _jaxpr(_step(tx), params, tx.init(params), x)
  splits = global_view.splits_from_types(jaxpr, frozenset({"data"}))
  w, b, x_var = jaxpr.invars[1], jaxpr.invars[0], jaxpr.invars[-1]
  assert splits[x_var] == (("data",), None)
  assert w not in splits and b not in splits


def test_splits_from_sizes_follow_the_batch_and_refuse_another_structure():
  mesh = _mesh("auto")
  params, x = _args(mesh)
  tx = optax.sgd(0.1)
  small = _jaxpr(_step(tx), params, tx.init(params), x)
  _, x2 = _args(mesh, batch=32)
  large = _jaxpr(_step(tx), params, tx.init(params), x2)
  splits = global_view.splits_from_sizes(small, large, ("data",))
  assert splits[small.invars[-1]] == (("data",), None)
  assert small.invars[0] not in splits

  def branchy(params, opt_state, x):  # Python control flow on the batch size.
    return _step(tx)(params, opt_state, x if x.shape[0] < 20 else x * 2)
  other = _jaxpr(branchy, params, tx.init(params), x2)
  assert global_view.splits_from_sizes(small, other, ("data",)) == (
      "the step's equations change with the batch size")


def _region(f, mesh, *args):
  jaxpr = _jaxpr(f, *args)
  _, x2 = _args(mesh, batch=32)
  large = _jaxpr(f, *args[:-1], x2)
  splits = global_view.splits_from_sizes(jaxpr, large, ("data",))
  return jaxpr, global_view.find_region(jaxpr, splits, {"data": N})


def test_region_holds_the_gradient_sums_and_the_update_not_the_forward_pass():
  mesh = _mesh("auto")
  params, x = _args(mesh)
  tx = optax.adam(1e-2)
  jaxpr, region = _region(_step(tx, cast=True), mesh, params, tx.init(params), x)
  prims = {i: jaxpr.eqns[i].primitive for i in region.eqns}
  sums = [prims[i] for i in region.sums]
  # The kernel's gradient and the bias's, each psum moved past the layout change after
  # it (a transpose; a reshape to [1, 3]).
  assert sorted(map(str, sums)) == ["reshape", "transpose"]
  assert {jaxpr.eqns[i].primitive for i in region.moved} == {lax.dot_general_p, lax.reduce_sum_p}
  # The bfloat16 cast the forward pass reads is outside; Adam's sqrt is inside.
  w = jaxpr.invars[1]
  casts = [i for i, e in enumerate(jaxpr.eqns) if e.primitive is lax.convert_element_type_p
           and e.invars[0] is w]
  assert len(casts) == 1 and casts[0] not in region.eqns
  assert lax.sqrt_p in prims.values()
  # The region reads the batch only through the sums' operands, split over "data".
  assert P("data", None) in region.in_specs or P("data") in region.in_specs


def test_a_maximum_over_the_batch_is_no_sum_and_enters_the_region_whole():
  mesh = _mesh("auto")
  params, x = _args(mesh)
  tx = optax.sgd(0.1)

  def step(params, opt_state, x):
    scale = jnp.max(jnp.abs(x))  # Not a sum: GSPMD all-reduces it with max.
    grads = jax.grad(lambda p: jnp.mean(x @ p["w"] + p["b"]))(params)
    updates, opt_state = tx.update(jax.tree.map(lambda g: g / scale, grads), opt_state, params)
    return optax.apply_updates(params, updates), opt_state
  jaxpr, region = _region(step, mesh, params, tx.init(params), x)
  maxes = [i for i, e in enumerate(jaxpr.eqns) if e.primitive is lax.reduce_max_p]
  assert maxes and not set(maxes) & set(region.eqns)
  assert jaxpr.eqns[maxes[0]].outvars[0] in region.invars


def test_sum_rules_need_every_split_dim_summed():
  """A sum over the features of the batch is no gradient sum: the reduce_sum rule refuses
  it (the same equation summing over the batch dim is one), and a step with nothing else
  has no region, for the reason that nothing reads only whole values."""
  mesh = _mesh("auto")
  params, x = _args(mesh)

  def features(params, opt_state, x):  # Sums over the features, not the batch.
    return params, opt_state, jnp.sum(x, axis=1)
  jaxpr, region = _region(features, mesh, params, (), x)
  assert region == ("no update reads only whole values (the step's forward and backward pass "
                    "read every result)")
  (eqn,) = [e for e in jaxpr.eqns if e.primitive is lax.reduce_sum_p]
  rule, batch = global_view.sum_rules[lax.reduce_sum_p], (("data",), None)
  assert eqn.params["axes"] == (1,) and not rule(eqn, [batch], lambda v: False)
  assert rule(eqn.replace(params={**eqn.params, "axes": (0,)}), [batch], lambda v: False)
