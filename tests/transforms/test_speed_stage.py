"""The fast paths of the interpreters stage exactly what re-binding stages."""

import jax
import jax.numpy as jnp
import optax

from helpers import SPECS, batches, make_params, make_step
from wus.analysis import compat
from wus.analysis.compat import ClosedJaxpr
from wus.analysis.compat import tracing
from wus.transforms import inline

N = 8


def _flat():
  """The step body with its calls inlined, as wus retraces it, and what that retraced."""
  mesh = jax.make_mesh((N,), ("data",))
  params = make_params()
  args = (params, optax.adam(1e-2).init(params), {"counter": jnp.arange(16, dtype=jnp.int32)},
          batches(mesh, 1)[0])
  outer = jax.make_jaxpr(jax.shard_map(make_step(optax.adam(1e-2)), mesh=mesh, **SPECS))(*args)
  eqn = compat.shard_map_eqn(outer)
  body, mesh, in_specs, out_specs, manual, check_vma = compat.shard_map_params(eqn)
  flat_args = jax.tree.leaves(args)

  def retrace(jaxpr):
    smap = jax.shard_map(lambda *a: tuple(inline.inlined(ClosedJaxpr(jaxpr, ()))(*a)), mesh=mesh,
                         in_specs=tuple(in_specs), out_specs=tuple(out_specs),
                         check_vma=check_vma, axis_names=manual)
    return compat.shard_map_params(compat.shard_map_eqn(jax.make_jaxpr(smap)(*flat_args)))[0]

  return body, retrace


def test_staging_equals_binding(monkeypatch):
  body, retrace = _flat()
  staged, stage = [], tracing._stage
  monkeypatch.setattr(tracing, "_stage", lambda eqn, args: staged.append(stage(eqn, args))
                      or staged[-1])
  fast = retrace(body)
  assert sum(out is not None for out in staged) > len(body.eqns) // 2
  monkeypatch.setattr(tracing, "_stage", lambda eqn, args: None)  # Every equation re-bound.
  assert str(retrace(body)) == str(fast)


def test_inlining_a_flat_jaxpr_is_the_identity():
  body, retrace = _flat()
  flat = retrace(body)
  assert str(retrace(flat)) == str(flat)
