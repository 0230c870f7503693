"""analysis/global_view.py: the gradient sums and update region of a jax.jit step, given the
batch splits `analysis.propagation` derives."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from wus.analysis import global_view, propagation, refusals
from wus.analysis.reasons import Reason
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


def test_splits_on_an_explicit_mesh_follow_the_types():
  """On Explicit axes the types lay the batch out (`propagation`, `types=True`)."""
  mesh = _mesh("explicit")
  with jax.set_mesh(mesh):
    params, x = _args(mesh)
    tx = optax.sgd(0.1)
    jaxpr = _jaxpr(_step(tx), params, tx.init(params), x)
  x_var, state = jaxpr.invars[-1], frozenset(jaxpr.invars[:-1])
  splits = propagation.batch_splits(jaxpr, {x_var: (("data",), None)}, state, {"data": N},
                                    types=True)
  w, b = jaxpr.invars[1], jaxpr.invars[0]
  assert splits[x_var] == (("data",), None)
  assert w not in splits and b not in splits
  assert not any(v in splits for v in jaxpr.outvars)


def _region(f, mesh, *args):
  """The region of `f`, its last argument the batch over "data"."""
  jaxpr = _jaxpr(f, *args)
  x = jaxpr.invars[-1]
  splits = propagation.batch_splits(jaxpr, {x: (("data",), None)},
                                    frozenset(jaxpr.invars[:-1]), {"data": N})
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
  assert region == Reason(refusals.NoUpdate()), region
  assert str(region) == ("no update reads only whole values (the step's forward and backward "
                         "pass read every result)")
  (eqn,) = [e for e in jaxpr.eqns if e.primitive is lax.reduce_sum_p]
  rule, batch = propagation.sum_rules[lax.reduce_sum_p], (("data",), None)
  assert eqn.params["axes"] == (1,) and not rule(eqn, [batch], lambda v: False)
  assert rule(eqn.replace(params={**eqn.params, "axes": (0,)}), [batch], lambda v: False)
