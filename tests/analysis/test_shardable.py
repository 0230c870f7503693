"""Unit tests of `wus.analysis.shardable`: the shard `Kind` of one equation (paper §4.1).

Each case is a one-operation function of replicated inputs `w` (and a
per-replica `x`), traced inside shard_map on 8 devices; the test asks
`shard_kind` about the equation that binds the case's primitive.
"""

from __future__ import annotations

import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from helpers import analysed_body, mesh
from wus.analysis import compat
from wus.analysis.shardable import Context, Kind, shard_kind

AXES = frozenset({"data"})
R, X = P(), P("data")
V64, M88 = (64,), (8, 8)

CASES = [  # (id, f, shapes of w (and x), primitive, expected kind)
    ("sin", jnp.sin, [V64], lax.sin_p, Kind.ELEMENTWISE),
    ("add_scalar", lambda w, s: w + s, [V64, ()], lax.add_p, Kind.ELEMENTWISE),
    ("reshape", lambda w: w.reshape(M88), [V64], lax.reshape_p, Kind.LAYOUT),
    ("unit_dim", lambda w: w[:, None], [V64], lax.broadcast_in_dim_p, Kind.LAYOUT),
    ("scalar_broadcast", lambda s: jnp.broadcast_to(s, V64), [()], lax.broadcast_in_dim_p,
     Kind.BROADCAST),
    ("new_dim", lambda w: jnp.broadcast_to(w, (4, 64)), [V64], lax.broadcast_in_dim_p,
     Kind.BROADCAST_DIMS),
    ("sum_all", jnp.sum, [M88], lax.reduce_sum_p, Kind.REDUCE_ALL),
    ("sum_rows", lambda w: jnp.sum(w, axis=1), [M88], lax.reduce_sum_p, Kind.REDUCE),
    ("max_rows", lambda w: jnp.max(w, axis=0), [M88], lax.reduce_max_p, Kind.REDUCE),
    ("sum_unit", lambda w: jnp.sum(w, axis=1), [(64, 1)], lax.reduce_sum_p, Kind.REDUCE_UNIT),
    ("prod_unit", lambda w: jnp.prod(w, axis=1), [(64, 1)], lax.reduce_prod_p, Kind.REDUCE_UNIT),
    # No exact combine of partial products:
    ("prod_rows", lambda w: jnp.prod(w, axis=1), [M88], lax.reduce_prod_p, None),
    ("vdot", lambda w: jnp.vdot(w, w), [M88], lax.dot_general_p, Kind.DOT_ALL),
    ("matmul", lambda w: w @ w, [M88], lax.dot_general_p, None),
    ("sort", jnp.sort, [V64], lax.sort_p, None),  # No rule: stays whole.
    ("psum_varying", lambda x: lax.psum(x, "data"), [X], compat.psum_p, Kind.REDUCE_SCATTER),
    ("psum_equal", lambda w: lax.psum(w, "data"), [V64], compat.psum_p, Kind.SUM_OF_COPIES),
    ("pmax_equal", lambda w: lax.pmax(w, "data"), [V64], compat.pmax_p, Kind.IDENTITY),
    ("pmax_varying", lambda x: lax.pmax(x, "data"), [X], compat.pmax_p, None),
    ("cond", lambda w: lax.cond(w[0] > 0, jnp.sin, jnp.cos, w), [V64], compat.cond_p, Kind.COND),
]


@pytest.mark.parametrize("f,shapes,prim,expected", [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_shard_kind(f, shapes, prim, expected):
  specs = [X if s is X else R for s in shapes]
  shapes = [V64 if s is X else s for s in shapes]
  jaxpr, facts = analysed_body(f, specs, shapes, R, mesh=mesh(8), check_vma=False)
  (eqn,) = [e for e in jaxpr.eqns if e.primitive is prim]
  assert shard_kind(eqn, Context(facts, AXES)) is expected
