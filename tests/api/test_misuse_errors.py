"""Misuse says what to do (issue 23 item 6): wus.pmap without `replicate`, a donated
buffer read by wus.unshard or wus.checkpointable (a crash of the process before), and
`step.plan()` without the step's arguments."""

import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import wus
from helpers import dense_inputs, dense_step, mesh

TX = optax.adam(1e-2)


def pmap_step(params, opt_state, x, lr):
  grads = lax.pmean(jax.grad(lambda p: jnp.mean(jnp.tanh(x @ p["w"]) ** 2))(params), "batch")
  updates, opt_state = TX.update(grads, opt_state, params)
  return optax.apply_updates(params, jax.tree.map(lambda u: lr * u, updates)), opt_state


def test_pmap_of_an_unmapped_python_number_says_to_replicate():
  params = {"w": jnp.ones((16, 64))}
  state = jax.tree.map(lambda a: jnp.stack([a] * 8), (params, TX.init(params)))
  x = np.zeros((8, 2, 16), np.float32)
  with pytest.raises(ValueError, match=r"argument \[3\] \(a float .*in_axes=None"):
    wus.pmap(pmap_step, axis_name="batch")(*state, x, 1.0)
  with pytest.raises(ValueError,
                     match=r"16 \(e.g. argument \[0\]\['w'\]\).*flax\.jax_utils\.replicate"):
    wus.pmap(pmap_step, axis_name="batch")(params, state[1], x, np.ones(8, np.float32))


# Run in a subprocess: before the check, gathering a donated buffer killed the process.
DONATED = textwrap.dedent("""
    import sys; sys.path.insert(0, {tests!r})
    import conftest, jax, optax, wus
    from jax.sharding import PartitionSpec as P
    from helpers import dense_inputs, dense_step, mesh
    TX = optax.adam(1e-2)
    params, xs = dense_inputs(mesh())
    step = wus.shard_map(dense_step(TX), mesh=mesh(), in_specs=(P(), P(), P("data")),
                         out_specs=(P(), P()), donate_argnums=(1,))
    params, opt_state = step(params, TX.init(params), xs[0])
    step(params, opt_state, xs[1])  # donates opt_state
    for read in (wus.unshard, wus.checkpointable):
      try:
        read(opt_state)
      except ValueError as e:
        print(e)
""")


def test_reading_donated_state_raises_instead_of_crashing():
  import os  # noqa: PLC0415
  tests = os.path.dirname(os.path.dirname(__file__))  # helpers.py's folder
  out = subprocess.run([sys.executable, "-c", DONATED.format(tests=tests)], capture_output=True,
                       text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-2000:]
  lines = out.stdout.splitlines()
  assert len(lines) == 2, out.stdout
  for line, reader in zip(lines, ("wus.unshard", "wus.checkpointable"), strict=True):
    assert line.startswith(f"{reader} got argument [0].count, whose buffer was donated"), line


def test_plan_without_arguments_says_it_needs_them():
  m = mesh()
  params, xs = dense_inputs(m, steps=1)
  step = wus.shard_map(dense_step(TX), mesh=m, in_specs=(P(), P(), P("data")),
                       out_specs=(P(), P()))
  with pytest.raises(TypeError, match=r"step\.plan\(\) needs the step's arguments"):
    step.plan()
  with pytest.raises(TypeError, match=r"step\.plan\(\) needs the step's arguments"):
    wus.pmap(pmap_step, axis_name="batch").plan()
  assert step.plan(params, TX.init(params), xs[0]).clusters
