"""transforms/interpret.py alone: the one interpreter loop the rewrites run on (issue 31 item 4).

The programs are optax's quickstart step (optax docs, "Getting started": a linear model fit
by Adam) and two with control flow, literals and captured constants."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

from helpers import assert_trees_equal
from wus.transforms import interpret

TX = optax.adam(learning_rate=1e-2)
TABLE = np.linspace(-1.0, 1.0, 6, dtype=np.float32)  # Captured: a constvar of the jaxpr.


def _loss(params, x, y):
  return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


def adam_step(params, opt_state, x, y):
  grads = jax.grad(_loss)(params, x, y)
  updates, opt_state = TX.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state


def control_flow(w, x):
  w = lax.cond(jnp.sum(x) > 0, lambda w: w * 2.0, lambda w: jnp.sin(w), w)
  w = lax.fori_loop(0, 3, lambda i, w: w - 0.1 * jnp.tanh(w * TABLE), w)
  return w, jnp.float32(3.0)  # A literal output.


def swapped(w, x):
  """The program of `test_a_hook_that_replaces_one_primitive` with its sin written as cos."""
  return w + jnp.cos(x) * 2.0


def _adam_args():
  params = {"w": jnp.linspace(-1.0, 1.0, 12).reshape(6, 2), "b": jnp.zeros((2,))}
  x = jnp.linspace(0.0, 1.0, 24).reshape(4, 6)
  return params, TX.init(params), x, jnp.ones((4, 2))


def _control_args():
  return jnp.linspace(-1.0, 1.0, 6), jnp.linspace(0.5, 1.5, 6)


PROGRAMS = [pytest.param(adam_step, _adam_args, id="adam"),
            pytest.param(control_flow, _control_args, id="control_flow")]


@pytest.mark.parametrize("f, make_args", PROGRAMS)
def test_default_hook_retraces_an_equal_jaxpr(f, make_args):
  """Nothing to rewrite gives an equal jaxpr (equinox's `_finalise_jaxpr` test)."""
  args = jax.tree.leaves(make_args())
  closed = jax.make_jaxpr(lambda *a: f(*jax.tree.unflatten(jax.tree.structure(make_args()),
                                                           a)))(*args)
  again = jax.make_jaxpr(
      lambda *a: interpret.eval_jaxpr(closed.jaxpr, closed.consts, a))(*args)
  assert str(again) == str(closed)


@pytest.mark.parametrize("f, make_args", PROGRAMS)
def test_default_hook_computes_what_jit_computes(f, make_args):
  args = jax.tree.leaves(make_args())
  treedef = jax.tree.structure(make_args())
  flat = lambda *a: jax.tree.leaves(f(*jax.tree.unflatten(treedef, a)))
  closed = jax.make_jaxpr(flat)(*args)
  got = jax.jit(lambda *a: interpret.eval_jaxpr(closed.jaxpr, closed.consts, a))(*args)
  assert_trees_equal(got, jax.jit(flat)(*args))


def test_hook_sees_each_equation_once_in_order_with_its_inputs():
  closed = jax.make_jaxpr(control_flow)(*_control_args())
  seen = []

  def hook(i, eqn, ins):
    assert eqn is closed.jaxpr.eqns[i]
    assert [jnp.shape(x) for x in ins] == [tuple(v.aval.shape) for v in eqn.invars]
    seen.append(i)
    return interpret.bind(i, eqn, ins)
  interpret.eval_jaxpr(closed.jaxpr, closed.consts, _control_args(), hook)
  assert seen == list(range(len(closed.jaxpr.eqns)))


def test_a_hook_that_replaces_one_primitive():
  """The hook's outputs are the equation's: sin bound as cos gives the program with cos."""
  closed = jax.make_jaxpr(lambda w, x: w + jnp.sin(x) * 2.0)(*_control_args())

  def hook(i, eqn, ins):
    return [jnp.cos(*ins)] if eqn.primitive is lax.sin_p else interpret.bind(i, eqn, ins)
  got = jax.jit(lambda *a: interpret.eval_jaxpr(closed.jaxpr, closed.consts, a, hook))(
      *_control_args())
  assert_trees_equal(got, [jax.jit(swapped)(*_control_args())])


def test_eval_eqns_runs_the_given_equations_in_the_given_order():
  """`order` picks equations of a jaxpr (a region of it) and the order they run in; the
  environment holds what they read and receives what they write."""
  closed = jax.make_jaxpr(lambda a, b: (jnp.sin(a), jnp.cos(b), jnp.exp(a)))(1.0, 2.0)
  (a, b), eqns = closed.jaxpr.invars, closed.jaxpr.eqns
  seen = []

  def hook(i, eqn, ins):
    seen.append(i)
    return interpret.bind(i, eqn, ins)
  env = interpret.eval_eqns(closed.jaxpr, {a: 1.0, b: 2.0}, hook, [2, 0])
  assert seen == [2, 0]
  assert set(env) == {a, b, eqns[0].outvars[0], eqns[2].outvars[0]}
  assert env[eqns[2].outvars[0]] == jnp.exp(1.0)
