"""Shared test helpers: tree comparison, a tiny data-parallel model, meshes."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

import wus


def assert_trees_equal(a, b, *, rtol: float = 0.0, atol: float = 0.0):
  """Same structure, then same values (bit for bit unless a tolerance is given).

  Typed PRNG keys compare by their key data."""
  assert jax.tree.structure(a) == jax.tree.structure(b), (jax.tree.structure(a), jax.tree.structure(b))
  for path, x, y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(a),
                        jax.tree.leaves(b), strict=True):
    x, y = _numpy(x), _numpy(y)
    assert x.shape == y.shape and x.dtype == y.dtype, (path[0], x.shape, y.shape, x.dtype, y.dtype)
    if rtol or atol:
      np.testing.assert_allclose(x.astype(np.float64), y.astype(np.float64), rtol=rtol,
                                 atol=atol, err_msg=str(path[0]))
    else:
      np.testing.assert_array_equal(x, y, err_msg=jax.tree_util.keystr(path[0]))


def _numpy(x) -> np.ndarray:
  if jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  return np.asarray(x)


def make_params(shapes=None):
  """Params with a scalar, [7], [3,3,5,7] (not divisible by 8), a big matrix, bf16."""
  shapes = shapes or {"scalar": (), "v7": (7,), "conv": (3, 3, 5, 7), "big": (1024, 1024),
                      "bias": (64,)}
  keys = jax.random.split(jax.random.key(0), len(shapes) + 1)
  params = {k: 0.1 * jax.random.normal(kk, s) for (k, s), kk in zip(shapes.items(), keys)}
  params["half"] = (0.1 * jax.random.normal(keys[-1], (96,))).astype(jnp.bfloat16)
  return params


def loss_fn(params, x):
  """Every leaf gets a gradient that depends on this replica's batch x: [b, 16]."""
  s = jnp.tanh(x).mean()
  total = jnp.mean(jnp.tanh(x @ params["big"][:16, :16]))
  for leaf in jax.tree.leaves(params):
    total = total + jnp.sum(jnp.sin(leaf.astype(jnp.float32) * s))
  return total


def make_step(tx, axis="data", loss=loss_fn):
  """The ordinary per-replica step; `extra` holds an integer leaf that is not trained."""
  def step(params, opt_state, extra, batch):
    loss_value, grads = jax.value_and_grad(loss)(params, batch)
    grads = jax.lax.pmean(grads, axis)
    updates, opt_state = tx.update(grads, opt_state, params)
    extra = {"counter": extra["counter"] + 1}
    return optax.apply_updates(params, updates), opt_state, extra, jax.lax.pmean(loss_value, axis)
  return step


@functools.cache
def mesh(n: int = 8):
  """A 1-D "data" mesh over the first n devices (n = 6: not a power of two)."""
  return jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])


def sharded_leaves(tree) -> list:
  """The `wus.ShardedArray` leaves of a tree."""
  return [x for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, wus.ShardedArray))
          if isinstance(x, wus.ShardedArray)]


def batches(mesh, n, per_replica=2, axis="data"):
  num = mesh.shape[axis]
  out = []
  for i in range(n):
    x = jax.random.normal(jax.random.key(100 + i), (num * per_replica, 16))
    out.append(jax.device_put(x, NamedSharding(mesh, P(axis))))
  return out


def run(step, params, opt_state, extra, data):
  for b in data:
    params, opt_state, extra, loss = step(params, opt_state, extra, b)
  return params, opt_state, extra, loss


SPECS = dict(in_specs=(P(), P(), P(), P("data")), out_specs=(P(), P(), P(), P()))


def inputs(tx, mesh, *, steps=3, params=None):
  """(params, optimizer state, extra, [batch per step]) for `make_step(tx)` on `mesh`."""
  params = make_params() if params is None else params
  return params, tx.init(params), {"counter": jnp.arange(16, dtype=jnp.int32)}, batches(mesh, steps)


def first_args(tx, mesh, **kw):
  """The arguments of the first step (whole state): what `step.plan` and `step.lower` take."""
  params, state, extra, data = inputs(tx, mesh, **kw)
  return params, state, extra, data[0]


def both(tx, mesh, *, check_vma=True, steps=3, params=None, **wus_kw):
  """Runs the unmodified and the wus step on the same inputs; returns both results and the step."""
  params, state, extra, data = inputs(tx, mesh, steps=steps, params=params)
  step = make_step(tx)
  ref = jax.jit(jax.shard_map(step, mesh=mesh, check_vma=check_vma, **SPECS))
  ws = wus.shard_map(step, mesh=mesh, check_vma=check_vma, **SPECS, **wus_kw)
  return run(ref, params, state, extra, data), run(ws, params, state, extra, data), ws


# Norms and trust ratios: updates with reductions (§4.1, Fig. 6).
REDUCING = [
    ("lars", lambda: optax.lars(0.1)),
    ("lamb", lambda: optax.lamb(1e-2)),
    ("clip_adam", lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))),
    ("adafactor", lambda: optax.adafactor(1e-2)),
    ("agc", lambda: optax.chain(optax.adaptive_grad_clip(0.1), optax.sgd(0.1))),
    ("trust_ratio", lambda: optax.chain(optax.scale_by_adam(), optax.scale_by_trust_ratio(),
                                        optax.scale(-1e-2))),
]


def dense_step(tx):
  """A Dense layer with a bias: AD of the broadcast bias under check_vma emits
  reshape -> psum_invariant -> reduce_sum over a size-1 dim."""
  def loss(params, x):
    return jnp.mean(jnp.tanh(x @ params["w"] + params["b"]) ** 2)

  def step(params, opt_state, x):
    grads = jax.lax.pmean(jax.grad(loss)(params, x), "data")
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state
  return step


def dense_inputs(m, steps=3):
  k = jax.random.split(jax.random.key(0), 2 + steps)
  params = {"w": 0.1 * jax.random.normal(k[0], (24, 40)), "b": 0.1 * jax.random.normal(k[1], (40,))}
  xs = [jax.device_put(jax.random.normal(kk, (2 * m.shape["data"], 24)), NamedSharding(m, P("data")))
        for kk in k[2:]]
  return params, xs


def hlo_computations(hlo: str) -> dict[str, list[str]]:
  """Optimized HLO text split into computations: name -> instruction lines."""
  from wus.harness.report import computations
  return computations(hlo)


def loop_bodies(hlo: str) -> set[str]:
  """Names of the computations that are while-loop bodies."""
  return set(re.findall(r"body=%?([\w.\-]+)", hlo))


def collective_shapes(lines, kind: str) -> list[str]:
  """Result shape of each `kind` instruction (e.g. "all-gather") among HLO lines:
  an array `f32[9]{0}` or, for collectives XLA combined, a tuple `(f32[9]{0}, f32[])`."""
  out = []
  for line in lines:
    m = re.match(r"\s*(?:ROOT )?%\S+ = (\(.*?\)|\S+) " + kind + r"(?:-start)?\(", line)
    if m:
      out.append(m.group(1))
  return out


def collective_bytes(lines, kind: str) -> list[int]:
  """Result bytes of each `kind` instruction (e.g. "all-gather") among HLO lines."""
  from wus.harness.report import shape_bytes
  return [shape_bytes(s) for s in collective_shapes(lines, kind)]


def collective_arrays(lines, kind: str) -> list[str]:
  """The arrays `kind` instructions reduce or move, tuples taken apart: ["f32[9]", "f32[]"]."""
  return [a for shape in collective_shapes(lines, kind)
          for a in re.findall(r"\b[a-z]+\d*\[[\d,]*\]", shape)]
