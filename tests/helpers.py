"""Shared test helpers: tree comparison, small data-parallel steps, meshes, HLO parsing.

Test modules import from here, never from each other; nothing here imports
the harness (`wus.harness`), so the core's tests do not depend on it. The
readers of optimized HLO text live in `hlo.py` and are re-exported here.
"""

from __future__ import annotations

import functools
import socket

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

import wus
from wus.analysis import compat, redundancy
from wus.transforms import inline
from hlo import (Collectives, collective_arrays, collective_lines, collective_shapes,  # noqa: F401
                 collectives, data_moves, fused_kernels, hlo_computations, loop_bodies,
                 moved_bytes, parameter_copies, replica_groups, shape_bytes)


def assert_trees_equal(a, b, *, rtol: float = 0.0, atol: float = 0.0):
  """Same structure, then same values (bit for bit unless a tolerance is given).

  Typed PRNG keys compare by their key data."""
  sa, sb = jax.tree.structure(a), jax.tree.structure(b)
  assert sa == sb, (sa, sb)
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


def free_port() -> int:
  """A TCP port free on 127.0.0.1 now, for a multi-process run's coordinator."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


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
def mesh(n: int = 8, kind: str = "shard_map"):
  """A 1-D "data" mesh over the first n devices (n = 6: not a power of two); its axis Auto
  for kind "auto" (`jax.make_mesh`'s default, Explicit, otherwise)."""
  types = (jax.sharding.AxisType.Auto,) if kind == "auto" else None
  return jax.make_mesh((n,), ("data",), devices=jax.devices()[:n], axis_types=types)


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


def dense_step(tx, axis_name="data"):
  """A Dense layer with a bias: AD of the broadcast bias under check_vma emits
  reshape -> psum_invariant -> reduce_sum over a size-1 dim. The gradients
  are pmean-ed over `axis_name` (a mesh axis or a tuple of them)."""
  def loss(params, x):
    return jnp.mean(jnp.tanh(x @ params["w"] + params["b"]) ** 2)

  def step(params, opt_state, x):
    grads = jax.lax.pmean(jax.grad(loss)(params, x), axis_name)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state
  return step


def run_both(step, args, xs, *, wus_kw=None, **kw):
  """Runs `step` unmodified (`jax.jit(jax.shard_map(step, **kw))`) and under
  `wus.shard_map(step, **kw, **wus_kw)` from the same `args`, one call per
  batch of `xs`, feeding the state back. Returns (unmodified outputs, wus
  outputs, the wus step)."""
  ref, ws = jax.jit(jax.shard_map(step, **kw)), wus.shard_map(step, **kw, **(wus_kw or {}))
  a = b = args
  for x in xs:
    a, b = ref(*a, x), ws(*b, x)
  return a, b, ws


def two_axis_run(shape, check_vma, width, *, wus_kw=None):
  """Adam on `dense_step` over a ("replica", "data") mesh of `shape`, the batch split
  over both axes and the gradients all-reduced over both: three steps unmodified and
  under wus (`run_both`), from weights of [24, width] and [width].

  Returns:
    (the mesh, the unmodified outputs, the wus outputs, the wus step, the last batch).
  """
  axes = ("replica", "data")
  mesh, tx, batch = jax.make_mesh(shape, axes), optax.adam(1e-2), P(axes)
  k = jax.random.split(jax.random.key(0), 2)
  params = {"w": 0.1 * jax.random.normal(k[0], (24, width)),
            "b": 0.1 * jax.random.normal(k[1], (width,))}
  kw = dict(mesh=mesh, in_specs=(P(), P(), batch), out_specs=(P(), P()), check_vma=check_vma)
  xs = [jax.device_put(jax.random.normal(jax.random.key(i), (16, 24)), NamedSharding(mesh, batch))
        for i in range(3)]
  a, b, ws = run_both(dense_step(tx, axes), (params, tx.init(params)), xs, wus_kw=wus_kw, **kw)
  return mesh, a, b, ws, xs[-1]


def dense_inputs(m, steps=3):
  k = jax.random.split(jax.random.key(0), 2 + steps)
  params = {"w": 0.1 * jax.random.normal(k[0], (24, 40)), "b": 0.1 * jax.random.normal(k[1], (40,))}
  xs = [jax.device_put(jax.random.normal(kk, (2 * m.shape["data"], 24)),
                       NamedSharding(m, P("data"))) for kk in k[2:]]
  return params, xs


# --- A training loop inside the step (§4.2, Fig. 4). -------------------------------

LOOP_STEPS = 3  # Steps per call of `make_train`.


def _one_step(tx, params, opt_state, x):
  loss, grads = jax.value_and_grad(loss_fn)(params, x)
  grads = jax.lax.pmean(grads, "data")
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, "data")


def make_train(tx, form: str, wrap_state: bool = False):
  """LOOP_STEPS steps in one program, as a scan, a fori_loop or a while_loop."""
  k = LOOP_STEPS

  def train(params, opt_state, xs):  # xs: [k, b, 16] per replica.
    if form == "scan":
      def body(c, x):
        p, s, loss = _one_step(tx, *c, x)
        return (p, s), loss
      (params, opt_state), losses = jax.lax.scan(body, (params, opt_state), xs)
    elif form == "fori":
      def body(i, c):
        return _one_step(tx, c[0], c[1], xs[i])[:2]
      params, opt_state = jax.lax.fori_loop(0, k, body, (params, opt_state))
      losses = jnp.zeros((k,))
    else:
      def body(c):
        i, p, s = c
        return (i + 1, *_one_step(tx, p, s, xs[i])[:2])
      _, params, opt_state = jax.lax.while_loop(lambda c: c[0] < k, body, (0, params, opt_state))
      losses = jnp.zeros((k,))
    # wrap_state: the state returned in a form that is not the input's structure
    # (its leaves as a list), so it is no state pair: returned whole.
    return params, (jax.tree.leaves(opt_state) if wrap_state else opt_state), losses
  return train


def loop_xs(mesh):
  """LOOP_STEPS batches of 2 rows per replica, split over the replicas."""
  shape = (LOOP_STEPS, 2 * mesh.shape["data"], 16)
  return jax.device_put(jax.random.normal(jax.random.key(5), shape),
                        NamedSharding(mesh, P(None, "data")))


def loop_setup(mesh, tx, form, wrap_state=False):
  """(params, optimizer state, xs, unmodified step, wus step) for `make_train(tx, form)`."""
  params = make_params()
  xs = loop_xs(mesh)
  kw = dict(mesh=mesh, in_specs=(P(), P(), P(None, "data")), out_specs=(P(), P(), P()))
  fn = make_train(tx, form, wrap_state)
  return params, tx.init(params), xs, jax.jit(jax.shard_map(fn, **kw)), wus.shard_map(fn, **kw)


# --- A jax.pmap step: per-device copies stacked on a leading axis. ------------------

PMAP_TX = optax.adam(1e-2)


def stack(tree, n=8):
  """Each leaf broadcast to n per-device copies (what jax.pmap takes)."""
  return jax.tree.map(lambda x: jnp.broadcast_to(x, (n,) + jnp.shape(x)), tree)


def pmap_params():
  k = jax.random.split(jax.random.key(0), 2)
  return {"w": 0.1 * jax.random.normal(k[0], (24, 40)), "b": 0.1 * jax.random.normal(k[1], (40,))}


def _pmap_loss(params, x, rng=None):
  if rng is not None:
    x = jnp.where(jax.random.bernoulli(rng, 0.9, x.shape), x, 0.0)
  return jnp.mean(jnp.tanh(x @ params["w"] + params["b"]) ** 2)


def pmap_step(params, opt_state, x, dropout_rng=None):
  """A per-device step over axis "batch", Flax WMT style: the dropout key is a keyword argument."""
  rng = (None if dropout_rng is None
         else jax.random.fold_in(dropout_rng, jax.lax.axis_index("batch")))
  loss, grads = jax.value_and_grad(_pmap_loss)(params, x, rng)
  grads = jax.lax.pmean(grads, "batch")
  updates, opt_state = PMAP_TX.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, {"loss": jax.lax.pmean(loss, "batch")}


def pmap_xs(steps=3, n=8):
  return [jax.random.normal(jax.random.key(10 + i), (n, 2, 24)) for i in range(steps)]


# --- The analysed per-replica body of a shard_map'ed step (unit tests of analysis/). ----------

def analysed_body(f, in_specs, shapes, out_specs, *, mesh, check_vma=True):
  """The flat per-replica jaxpr of `jax.shard_map(f)` and its redundancy facts,
  as `wus.shard_map` analyses them: calls inlined, dead code dropped.

  Args:
    f: the per-replica step.
    in_specs: P() (replicated) or P(axis) (leading dim split) per argument.
    shapes: per-replica shape per argument (float32), or a `jax.ShapeDtypeStruct`.
    out_specs: as for `jax.shard_map`.
    mesh: the mesh; a split argument's global leading dim is its per-replica
      one times the size of its axes.
    check_vma: as for `jax.shard_map`.

  Returns:
    (jaxpr, facts).
  """
  def spec_axes(spec):
    return frozenset(a for entry in spec if entry is not None
                     for a in (entry if isinstance(entry, tuple) else (entry,)))

  args = []
  for spec, s in zip(in_specs, shapes, strict=True):
    s = s if isinstance(s, jax.ShapeDtypeStruct) else jax.ShapeDtypeStruct(tuple(s), jnp.float32)
    n = 1
    for a in spec_axes(spec):
      n *= mesh.shape[a]
    shape = (s.shape[0] * n, *s.shape[1:]) if s.shape else s.shape
    args.append(jax.ShapeDtypeStruct(shape, s.dtype, sharding=NamedSharding(mesh, spec)))

  def mapped(g):
    return jax.shard_map(g, mesh=mesh, in_specs=tuple(in_specs), out_specs=out_specs,
                         check_vma=check_vma)

  body = compat.shard_map_params(compat.shard_map_eqn(jax.make_jaxpr(mapped(f))(*args)))[0]
  flat_outer = jax.make_jaxpr(mapped(
      lambda *a: tuple(inline.inlined(compat.ClosedJaxpr(body, ()))(*a))))(*args)
  flat = compat.dce(compat.shard_map_params(compat.shard_map_eqn(flat_outer))[0])
  manual = frozenset(mesh.axis_names)
  return flat, redundancy.analyze(flat, [manual - spec_axes(s) for s in in_specs], manual)


def classifier_batches(mesh, n, batch=48, features=12):
  """`n` {"x": [batch, features] float32, "y": [batch] int32 labels < 10} batches split
  over the mesh's "data" axis (fixed seed)."""
  rng = np.random.default_rng(0)
  data = NamedSharding(mesh, P("data"))
  return [{"x": jax.device_put(rng.normal(size=(batch, features)).astype(np.float32), data),
           "y": jax.device_put(rng.integers(0, 10, size=(batch,)).astype(np.int32), data)}
          for _ in range(n)]


def classifier_step(model, tx):
  """The Flax examples' classifier step on global arrays: softmax cross-entropy of
  `model.apply(params, batch["x"])` against `batch["y"]`, an optax update; returns
  (params, opt_state, {"loss": loss})."""
  def train_step(params, opt_state, batch):
    def loss_fn(p):
      logits = model.apply(p, batch["x"])
      return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, {"loss": loss}
  return train_step
