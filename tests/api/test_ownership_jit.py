"""Ownership under `wus.jit`: Muon steps written for `jax.jit` on a ("data",) mesh.

The steps are written as `tests/test_jit.py` writes its steps (the loss over the
global batch, no collectives), on both mesh kinds. The matrices' Newton-Schulz
updates run on their owners and every result is bit for bit with `jax.jit`, with
one exception on Explicit meshes that the last test pins down (XLA folds fewer
constants in `jax.jit`'s lowering there).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import wus
from helpers import assert_trees_equal, classifier_step, sharded_leaves
from test_jit import _context, _mesh  # How test_jit writes its meshes.
from test_ownership import OPTIMIZERS as ownership_optimizers
from wus.analysis import reasons
from wus.analysis.owned import OwnedFormat


class MLP(nn.Module):
  """Dense layers with biases: `depth` hidden [32,32] kernels and a [32,10] head."""

  depth: int

  @nn.compact
  def __call__(self, x):
    for _ in range(self.depth + 1):
      x = nn.tanh(nn.Dense(32)(x))
    return nn.Dense(10)(x)


OPTIMIZERS = dict(ownership_optimizers)


def _run(step, mesh, model, tx, *, features: int, steps: int = 3):
  """`step` from the same initial state over the same batches: (params, opt_state, metrics)."""
  rng = np.random.default_rng(0)
  data = NamedSharding(mesh, P("data"))
  with _context(mesh):
    params = jax.device_put(model.init(jax.random.key(0), jnp.ones((1, features))),
                            NamedSharding(mesh, P()))
    out = (params, tx.init(params))
    for _ in range(steps):
      n = 4 * mesh.size
      batch = {"x": jax.device_put(rng.normal(size=(n, features)).astype(np.float32), data),
               "y": jax.device_put(rng.integers(0, 10, size=(n,)).astype(np.int32), data)}
      out = step(*out[:2], batch)
    return out, batch


def _owned(tree):
  return [x for x in sharded_leaves(tree) if isinstance(x.format, OwnedFormat)]


@pytest.mark.parametrize("name,n,kind", [  # One by default (the Auto mesh runs in
    ("muon", 8, "explicit"),                 # test_explicit_mesh_computes_...); --slow: all four.
    pytest.param("muon_adamw", 6, "auto", marks=pytest.mark.slow),
    pytest.param("muon", 8, "auto", marks=pytest.mark.slow),
    pytest.param("muon_adamw", 6, "explicit", marks=pytest.mark.slow)])
def test_muon_under_wus_jit_owned_and_bit_for_bit(name, n, kind):
  """The [32,32] kernels are owned (each replica owns some, each kernel one replica's);
  the biases' Adam(W) runs on shards in the same step."""
  mesh, model, tx = _mesh(kind, n), MLP(depth=2 * n), OPTIMIZERS[name]()
  step = classifier_step(model, tx)
  ref, _ = _run(jax.jit(step), mesh, model, tx, features=32)
  ws = wus.jit(step)
  got, batch = _run(ws, mesh, model, tx, features=32)
  assert_trees_equal(ref, wus.unshard(got))
  owned = _owned(got[1])
  assert len(owned) >= 2 * n and {x.format.shape for x in owned} >= {(32, 32)}
  assert {x.format.slot.owner for x in owned} == set(range(n))
  with _context(mesh):
    plan = ws.plan(*got[:2], batch)
  assert sum(c.owner is not None for c in plan.clusters) >= 2 * n
  assert any(c.sharded for c in plan.clusters)  # The biases' Adam(W).
  assert plan.owned is not None and len(plan.owned.units) >= 2 * n
  for c in plan.clusters:  # Each owned cluster says by whom, or with which it is owned.
    if c.owner is not None:
      verdict = c.why.verdict
      assert (verdict.owner == c.owner if isinstance(verdict, reasons.Owned) else
              plan.clusters[verdict.index].owner == c.owner), c.why


def test_explicit_mesh_computes_what_jax_jit_computes_on_an_auto_mesh():
  """A [12,32] kernel, which Muon scales by sqrt(32 / 12), owned under wus.jit.

  On Explicit axes, jax.jit's lowering puts an `sdy.sharding_constraint` after
  every operation, which keeps XLA from folding Muon's shape scale into the
  learning rate (`x * 1.633 * -0.01` stays two roundings); on Auto axes XLA folds
  them, and so does the manual region wus runs the update in on either mesh kind
  (it holds no such constraints). wus.jit thus computes on an Explicit mesh
  exactly what jax.jit computes on an Auto mesh; elementwise updates with a chain
  of constant scalings show the same (not ownership's: the region's)."""
  n, model, tx = 8, MLP(depth=8), OPTIMIZERS["muon"]()
  step = classifier_step(model, tx)
  ref, _ = _run(jax.jit(step), _mesh("auto", n), model, tx, features=12)
  got, _ = _run(wus.jit(step), _mesh("explicit", n), model, tx, features=12)
  assert_trees_equal(ref, wus.unshard(got))
  assert any(x.format.shape == (12, 32) for x in _owned(got[1]))
