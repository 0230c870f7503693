"""Ownership: updates that need whole tensors (Muon, Shampoo-like) run on one replica each.

Every test compares the wus step with the unmodified step on the same inputs
over several steps, bit for bit (the suite's strict XLA flags), and checks
what ownership promises: the owned optimizer state lives only on its owner
(about 1/N of it per device), and the Plan says who owns what.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import wus
from helpers import assert_trees_equal, mesh, sharded_leaves, stack
from wus.analysis import reasons
from wus.analysis.owned import OwnedFormat


class MLP(nn.Module):
  """Dense layers with biases: `depth` hidden [width, width] kernels of one shape."""

  depth: int = 4
  width: int = 32
  wide: int = 0  # A last hidden layer `wide` x `wide` (0: none): a larger matrix.

  @nn.compact
  def __call__(self, x):
    x = nn.tanh(nn.Dense(self.width)(x))
    for _ in range(self.depth):
      x = nn.tanh(nn.Dense(self.width)(x))
    if self.wide:
      x = nn.tanh(nn.Dense(self.wide)(nn.Dense(self.wide)(x)))
    return nn.Dense(16)(x)


def _step(model, tx, axis="data"):
  def loss(params, x):
    return jnp.mean(model.apply({"params": params}, x) ** 2)

  def step(params, opt_state, x):
    grads = jax.lax.pmean(jax.grad(loss)(params, x), axis)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state
  return step


def _run(model, tx, n, *, check_vma=True, steps=3):
  """The unmodified and the wus shard_map step from the same inputs; (ref, wus, step, x)."""
  m = mesh(n)
  params = model.init(jax.random.key(0), jnp.ones((1, 16)))["params"]
  kw = dict(mesh=m, in_specs=(P(), P(), P("data")), out_specs=(P(), P()), check_vma=check_vma)
  ref, ws = jax.jit(jax.shard_map(_step(model, tx), **kw)), wus.shard_map(_step(model, tx), **kw)
  a = b = (params, tx.init(params))
  for i in range(steps):
    x = jax.device_put(jax.random.normal(jax.random.key(10 + i), (2 * n, 16)),
                       NamedSharding(m, P("data")))
    a, b = ref(*a, x), ws(*b, x)
  return a, b, ws, x


def shampoo_like(learning_rate: float, beta: float = 0.9, eps: float = 1e-3):
  """A Shampoo-style preconditioned update in optax style: per matrix, EMAs of
  g g^T and g^T g, and the update L^(-1/4) g R^(-1/4) (matrix roots by eigh);
  SGD for the other leaves. Every path of a matrix's update meets a whole-tensor
  operation."""
  def root(a):
    w, v = jnp.linalg.eigh(a)
    return (v * (w + eps) ** -0.25) @ v.T

  def init(params):
    def stats(p):
      return ((eps * jnp.eye(p.shape[0]), eps * jnp.eye(p.shape[1])) if p.ndim == 2
              else (jnp.zeros(()), jnp.zeros(())))
    return jax.tree.map(stats, params)

  def update(grads, state, params=None):
    def one(g, s):
      if g.ndim != 2:
        return -learning_rate * g, s
      left = beta * s[0] + (1 - beta) * g @ g.T
      right = beta * s[1] + (1 - beta) * g.T @ g
      return -learning_rate * root(left) @ g @ root(right), (left, right)
    out = jax.tree.map(one, grads, state, is_leaf=lambda x: isinstance(x, tuple))
    is_pair = lambda x: isinstance(x, tuple) and len(x) == 2 and not isinstance(x[0], tuple)  # noqa: E731
    updates = jax.tree.map(lambda o: o[0], out, is_leaf=is_pair)
    return updates, jax.tree.map(lambda o: o[1], out, is_leaf=is_pair)
  return optax.GradientTransformation(init, update)


OPTIMIZERS = [
    ("muon", lambda: optax.contrib.muon(1e-2)),  # Its own Adam fallback for the biases.
    ("muon_adamw", lambda: optax.multi_transform(
        {"muon": optax.contrib.muon(1e-2), "adamw": optax.adamw(1e-2, weight_decay=1e-2)},
        lambda p: jax.tree.map(lambda x: "muon" if x.ndim == 2 else "adamw", p))),
    ("shampoo_like", lambda: shampoo_like(1e-2)),
]


def _owned(tree):
  return [x for x in sharded_leaves(tree) if isinstance(x.format, OwnedFormat)]


# The default profile runs one optimizer (Muon runs owned in the default profile under
# wus.pmap, test_pmap_muon_bit_for_bit, and wus.jit, test_ownership_jit.py); --slow runs
# every combination (docs/tests.md).
_DEFAULT = {("shampoo_like", True, 6)}
_CASES = [pytest.param(name, make_tx, vma, n, id=f"{name}-{'vma' if vma else 'novma'}-{n}",
                       marks=() if (name, vma, n) in _DEFAULT else pytest.mark.slow)
          for name, make_tx in OPTIMIZERS for vma in (True, False) for n in (8, 6)]


@pytest.mark.parametrize("name,make_tx,check_vma,n", _CASES)
def test_owned_updates_are_bit_for_bit(name, make_tx, check_vma, n):
  """On Flax Dense layers, the [32,32] kernels' matrix-wise updates (Muon's
  Newton-Schulz, Shampoo-like roots) run on their owners; the biases' Adam,
  AdamW or SGD on shards, in the same step."""
  tx = make_tx()
  ref, got, step, x = _run(MLP(depth=2 * n), tx, n, check_vma=check_vma)
  assert_trees_equal(ref[0], got[0])
  assert_trees_equal(ref[1], wus.unshard(got[1]))
  owned = _owned(got[1])
  assert len(owned) >= 2 * n * (2 if name == "shampoo_like" else 1)
  assert {x.format.shape for x in owned} >= {(32, 32)}
  # Every replica owns whole tensors; each owned tensor on exactly one.
  assert {x.format.slot.owner for x in owned} == set(range(n))
  plan = step.plan(*got, x)
  assert sum(c.owner is not None for c in plan.clusters) >= 2 * n
  if name != "shampoo_like":  # The biases' Adam(W): elementwise shards; SGD is too cheap.
    assert any(c.sharded for c in plan.clusters)


def test_owned_state_lives_on_its_owner():
  """Per device, the owned state is the row of its bank: about 1/N of the
  whole (within 1.25/N), and each tensor's elements are on its owner alone."""
  n = 8
  _, got, _, _ = _run(MLP(depth=16), optax.contrib.muon(1e-2), n, steps=1)
  owned = _owned(got[1])
  whole = sum(np.prod(x.format.shape) * x.dtype.itemsize for x in owned)
  per_device = sum(x.data.addressable_shards[0].data.nbytes for x in owned)
  assert per_device <= 1.25 * whole / n
  bank = owned[0].format.bank
  shards = [x.data.addressable_shards for x in owned]
  rows = np.stack([np.concatenate([np.asarray(s[d].data) for s in shards]) for d in range(n)])
  for x, whole_x in zip(owned, wus.unshard(owned), strict=True):  # Its owner's row holds it.
    slot = x.format.slot
    np.testing.assert_array_equal(
        rows[slot.owner, slot.offset:slot.offset + slot.size].reshape(x.format.shape), whole_x)
  assert bank.padding * np.dtype(bank.dtype).itemsize < 0.25 * whole
  with pytest.raises(ValueError, match="Pass the whole optimizer state together"):
    wus.unshard(owned[0])  # Alone, its elements span the arrays of its whole bank.


def test_plan_says_each_owner_its_slot_and_the_state_it_keeps():
  """Twelve kernels owned (eight in a full round of slots, the rest balanced by predicted
  cost), each cluster's `Owned` naming its owner; each kernel's momentum kept on that
  owner and the kernel read whole there (`OnOwner`). (The words: test_plan_format.)"""
  _, got, step, x = _run(MLP(depth=10), optax.contrib.muon(1e-2), 8, steps=1)
  plan = step.plan(*got, x)
  owned = [c for c in plan.clusters if c.owner is not None]
  assert len(owned) == len(plan.owned.units) == 12
  assert all(isinstance(c.why.verdict, reasons.Owned) and c.why.verdict.owner == c.owner
             for c in owned), [c.why for c in owned]
  wheres = [c.why.verdict.where for c in owned]
  slots = [w for w in wheres if w.startswith("slot ")]
  assert slots == [f"slot {k} of stack 1 (1 contiguous per replica)" for k in range(8)], wheres
  assert all(w.endswith(" remainder, balanced by predicted cost") for w in wheres
             if w not in slots)
  on_owner = [i for i in plan.inputs if isinstance(i.why.verdict, reasons.OnOwner)]
  kernels = {i.name for i in plan.inputs if i.name.endswith("['kernel']")}
  assert {i.name for i in on_owner} == kernels  # Each kernel and its momentum.
  for i in on_owner:
    where = i.why.verdict
    assert plan.clusters[where.index].owner == where.owner and i.sharded == where.state
    assert where.state == i.name.startswith("opt_state"), i


def test_pmap_muon_bit_for_bit():
  """jax.pmap with replicated state and `lax.pmean(grads)`, as Flax examples write it."""
  model, tx, n = MLP(depth=8), optax.contrib.muon(1e-2), 8
  params = model.init(jax.random.key(0), jnp.ones((1, 16)))["params"]
  step = _step(model, tx, axis="batch")
  ref, ws = jax.pmap(step, axis_name="batch"), wus.pmap(step, axis_name="batch")
  a = b = (stack(params), stack(tx.init(params)))
  for i in range(3):
    x = jax.random.normal(jax.random.key(20 + i), (n, 2, 16))
    a, b = ref(*a, x), ws(*b, x)
  assert_trees_equal(a[0], b[0])
  assert_trees_equal(a[1], wus.unshard(b[1]))
  assert len(_owned(b[1])) >= n


def _update_flops(model, tx, n, step=None, args=None):
  """Per-device flops of the step's weight update: the compiled step's minus those of
  the same step without the update (its forward and backward pass and all-reduce)."""
  m = mesh(n)
  params = model.init(jax.random.key(0), jnp.ones((1, 16)))["params"]
  state = tx.init(params)
  x = jax.device_put(jnp.ones((2 * n, 16)), NamedSharding(m, P("data")))
  kw = dict(mesh=m, in_specs=(P(), P(), P("data")), out_specs=(P(), P()))
  full = _step(model, tx)

  def grads_only(p, s, x):
    g = jax.lax.pmean(jax.grad(lambda p: jnp.mean(model.apply({"params": p}, x) ** 2))(p), "data")
    return g, s

  def flops(lowered):
    return lowered.compile().cost_analysis()["flops"]
  base = flops(jax.jit(jax.shard_map(grads_only, **kw)).lower(params, state, x))
  ws = wus.shard_map(full, **kw)
  return (flops(jax.jit(jax.shard_map(full, **kw)).lower(params, state, x)) - base,
          flops(ws.lower(params, state, x)) - base, ws.plan(params, state, x))


@pytest.mark.slow
def test_update_flops_per_device_are_about_one_nth():
  """XLA's cost analysis of the compiled steps (a conditional counts its costliest
  branch): each device runs the Newton-Schulz iterations of its own matrices."""
  n = 8
  replicated, owned, _ = _update_flops(MLP(depth=16), optax.contrib.muon(1e-2), n)
  assert owned <= 1.25 * replicated / n, (owned, replicated)


@pytest.mark.slow
def test_imbalanced_model_is_balanced_by_predicted_cost():
  """14 [32,32] kernels, one [64,64] (4x the elements, 8x the Newton-Schulz flops) and a
  few others at N = 8: each replica owns one [32,32] of the full round; the remainders
  go largest first to the least loaded replica, so the [64,64] gets a replica with no
  remainder beside it, and the busiest replica's predicted work is what it measures."""
  n = 8
  replicated, owned, plan = _update_flops(MLP(depth=14, wide=64), optax.contrib.muon(1e-2), n)
  own = plan.owned
  units = {c.index: c for c in plan.clusters if c.owner is not None}
  by_shape = {}
  for c in units.values():
    grad = next(t for t in c.tensors if t.role == "gradient")
    by_shape.setdefault(grad.shape, []).append(c.owner)
  assert set(by_shape[(32, 32)]) == set(range(n))  # One each (a full round), then the rest.
  big = by_shape[(64, 64)][0]
  assert by_shape[(32, 32)].count(big) == 1  # Only its full-round slot beside the big one.
  busiest = max(range(n), key=own.loads.__getitem__)
  assert busiest == big and own.imbalance > 1
  # Measured: the costliest branch is the busiest replica's, well under replicated.
  assert owned < 0.5 * replicated
  assert owned >= own.loads[busiest] / sum(own.loads) * replicated * 0.8
