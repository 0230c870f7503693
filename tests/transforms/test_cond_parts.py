"""A conditional split into its independent parts (`transforms.cond_parts`).

The parts are what a wrapper such as `optax.MultiSteps` or `optax.apply_if_finite` puts
under one `cond`: each tensor's update, sharing only scalars (the step count). A global
norm joins every tensor it reads. The split program computes the same values.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.extend.core import jaxpr_as_fun

from wus.analysis import compat
from wus.transforms import cond_parts, inline


def _cond(closed):
  (eqn,) = [e for e in closed.jaxpr.eqns if e.primitive is compat.cond_p]
  return eqn


def _operands():
  rng = np.random.default_rng(0)
  return (rng.standard_normal((4, 3)).astype(np.float32),
          rng.standard_normal((5,)).astype(np.float32), np.int32(3), np.bool_(True))


def test_each_tensor_a_part_the_shared_count_computed_in_each():
  def f(a, b, count, pred):
    def update(a, b, count):
      scale = 0.9 ** (count + 1).astype(jnp.float32)  # A bias correction: shared, scalar.
      return a * scale, b / scale, count + 1
    return lax.cond(pred, update, lambda a, b, c: (a, b, c), a, b, count)
  closed = jax.make_jaxpr(f)(*_operands())
  assert cond_parts.parts(_cond(closed)) == [[0], [1], [2]]
  split = cond_parts.split(closed)
  assert sum(e.primitive is compat.cond_p for e in split.jaxpr.eqns) == 3
  for x, y in zip(jaxpr_as_fun(closed)(*_operands()), jaxpr_as_fun(split)(*_operands()),
                  strict=True):
    np.testing.assert_array_equal(x, y)


def _clipped(a, b, count, pred):
  """Both tensors divided by their global norm, under a conditional."""
  def clipped(a, b, count):
    norm = jnp.sqrt(jnp.sum(a * a) + jnp.sum(b * b))
    return a / norm, b / norm, count + 1
  return lax.cond(pred, clipped, lambda a, b, c: (a, b, c), a, b, count)


def test_a_global_norm_joins_the_tensors_it_reads():
  closed = jax.make_jaxpr(_clipped)(*_operands())
  assert cond_parts.parts(_cond(closed)) == [[0, 1], [2]]


def test_a_global_norm_run_before_the_conditional_leaves_each_tensor_a_part():
  closed = jax.make_jaxpr(_clipped)(*_operands())
  assert cond_parts.parts(_cond(closed), hoist=True) == [[0], [1], [2]]
  split = cond_parts.split(closed)
  conds = [e for e in split.jaxpr.eqns if e.primitive is compat.cond_p]
  assert len(conds) == 3
  assert all(e.primitive is not lax.reduce_sum_p for c in conds
             for b in compat.cond(c).branches for e in b.jaxpr.eqns)  # The sums run before.
  for x, y in zip(jaxpr_as_fun(closed)(*_operands()), jaxpr_as_fun(split)(*_operands()),
                  strict=True):
    np.testing.assert_allclose(x, y, rtol=1e-6)


def test_a_conditional_in_a_branch_is_split_first():
  """`MultiSteps` around `apply_if_finite`: the outer branch holds the inner conditional,
  which alone would join the tensors."""
  def f(a, b, count, pred):
    def inner(a, b, count):
      return lax.cond(count > 2, lambda a, b: (a * 2, b * 3), lambda a, b: (a, b), a, b)
    return lax.cond(pred, inner, lambda a, b, c: (a, b), a, b, count)
  closed = jax.make_jaxpr(f)(*_operands())
  assert len(cond_parts.parts(_cond(closed))) == 1
  split = cond_parts.split(closed)

  def conds(jaxpr):  # Every conditional, its branches' included.
    for e in jaxpr.eqns:
      if e.primitive is compat.cond_p:
        yield e
        for b in compat.cond(e).branches:
          yield from conds(b.jaxpr)
  shapes = [{v.aval.shape for v in e.outvars} for e in conds(split.jaxpr)]
  assert len(shapes) == 4 and all(len(s) == 1 for s in shapes), shapes
  for x, y in zip(jaxpr_as_fun(closed)(*_operands()), jaxpr_as_fun(split)(*_operands()),
                  strict=True):
    np.testing.assert_array_equal(x, y)


def test_an_optax_wrapper_around_adam_splits_per_tensor():
  """`optax.apply_if_finite` around Adam: per tensor, its update, mu and nu are one part
  (the calls in its branches inlined first, as `wus.jit`'s flat jaxpr has them)."""
  tx = optax.apply_if_finite(optax.adam(1e-2), 2)
  params = {"a": jnp.ones((4, 3)), "b": jnp.ones((5,))}
  closed = jax.make_jaxpr(lambda g, s: tx.update(g, s, params))(params, tx.init(params))
  # As wus.jit splits it: calls inlined (optax's `tree_bias_correction` is a jit of both).
  closed = jax.make_jaxpr(inline.inlined(closed))(*closed.in_avals)
  groups = cond_parts.parts(_cond(closed))
  shapes = [{_cond(closed).outvars[k].aval.shape for k in g} for g in groups]
  assert sorted(shapes, key=str) == sorted([{(4, 3)}, {(5,)}, {()}], key=str), shapes


def test_a_conditional_with_effects_stays_whole():
  def f(a, b, count, pred):
    def noisy(a, b, count):
      jax.debug.print("{}", count)
      return a * 2, b * 2, count
    return lax.cond(pred, noisy, lambda a, b, c: (a, b, c), a, b, count)
  closed = jax.make_jaxpr(f)(*_operands())
  assert len(cond_parts.parts(_cond(closed))) == 1
  assert cond_parts.split(closed) is closed


def test_only_the_update_conditionals_of_a_global_step_are_split():
  """`wus.jit` splits the conditionals that read a gradient sum (`global_view.reads_sum`:
  MultiSteps' around Adam) and leaves the forward pass's as the user wrote them, though
  its outputs are independent too (a weight and a bias picked by a flag)."""
  from jax.sharding import NamedSharding, PartitionSpec as P

  from wus import jit_placement, jit_region
  from wus.analysis import global_view

  tx = optax.MultiSteps(optax.adam(1e-2), 2)

  def step(params, opt_state, x, y):
    def loss_fn(p):
      w, b = lax.cond(jnp.sum(p["b"]) > -1e9, lambda w, b: (w, 2 * b),
                      lambda w, b: (0.5 * w, b), p["w"], p["b"])
      return jnp.mean((jnp.tanh(x @ w + b) - y) ** 2)
    grads = jax.grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  params = {"w": jax.device_put(jnp.ones((16, 8)), NamedSharding(mesh, P("data"))),
            "b": jax.device_put(jnp.zeros((8,)), NamedSharding(mesh, P()))}
  data = NamedSharding(mesh, P("data"))
  x, y = jax.device_put(jnp.ones((32, 16)), data), jax.device_put(jnp.ones((32, 8)), data)
  args = (params, tx.init(params), x, y)
  leaves = jax.tree.leaves(args)
  flat = jit_region.flat_jaxpr(jax.jit(step).trace(*args).jaxpr, mesh)
  state = frozenset(range(len(leaves) - 2))
  splits = jit_placement.batch_splits(flat.jaxpr, leaves, [None] * len(leaves), mesh, state)
  reads_sum = global_view.reads_sum(flat.jaxpr, splits)
  conds = [e for e in flat.jaxpr.eqns if e.primitive is compat.cond_p]
  forward = [e for e in conds if not reads_sum(e)]
  update = [e for e in conds if reads_sum(e)]
  assert len(forward) == 1 and len(update) >= 1, conds
  assert len(cond_parts.parts(forward[0])) == 2  # Independent parts, not split.
  split = cond_parts.split(flat, reads_sum)
  after = [e for e in split.jaxpr.eqns if e.primitive is compat.cond_p]
  assert sum(e.params["branches"] == forward[0].params["branches"] for e in after) == 1
  assert len(after) > len(conds)  # The update's conditional, per tensor.
  assert cond_parts.split(flat, lambda eqn: False) is flat
  ins = [*jax.tree.leaves(args)]
  np.testing.assert_array_equal(
      np.concatenate([np.ravel(a) for a in jaxpr_as_fun(split)(*ins)]),
      np.concatenate([np.ravel(a) for a in jaxpr_as_fun(flat)(*ins)]))
