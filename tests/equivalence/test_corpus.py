"""The model corpus (tests/corpus.py) through wus, against plain JAX.

Every case runs the same published-style Flax step twice from the same
inputs, once as JAX runs it and once through wus (the one-line change), for
3 steps, and compares params, model state (batch_stats, dynamic scale, step)
and optimizer state (after `wus.unshard`) bit for bit, and the metrics; then
checks that the optimizer state came back sharded: every float tensor of it
with more than N elements (Adam's mu/nu, momentum traces) must be a
`wus.ShardedArray`. On a miss the assertion message carries the Plan, which
says why a cluster stayed whole.

Cross product (bounded compile count):
  * shard_map style, N = 8, check_vma True and False: every model with the
    examples' `pmean(grads)` (MLP with Adam, MLP with clip_by_global_norm +
    masked AdamW, NNX, ImageNet, ImageNet float16 + DynamicScale, WMT,
    LM1B); ImageNet with an explicit `pmean` of batch_stats (vma only);
  * the `pmean`-ed-loss form: MLP, NNX, ImageNet, LM1B under check_vma=True,
    the MLP also under check_vma=False (where it has no gradient all-reduce);
  * shard_map style, N = 6 (not a power of two), check_vma=True: MLP, NNX,
    ImageNet;
  * pmap style (`jax.pmap` -> `wus.pmap`, state from
    `flax.jax_utils.replicate`): every published-example step as published
    (WMT / LM1B with `donate_argnums=(0,)` and `dropout_rng=` by keyword),
    at N = 8, ImageNet also at N = 6; and ImageNet with `replicated_argnums`.
"""

from __future__ import annotations

import functools

import jax
import pytest
from flax import jax_utils
from jax.sharding import NamedSharding, PartitionSpec as P

import wus
from corpus import case, per_device, place, sharded_expectation
from helpers import assert_trees_equal, mesh

STEPS = 3


def _sharded_paths(tree) -> set[str]:
  flat = jax.tree_util.tree_flatten_with_path(
      tree, is_leaf=lambda x: isinstance(x, wus.ShardedArray))[0]
  return {jax.tree_util.keystr(p) for p, x in flat if isinstance(x, wus.ShardedArray)}


def _tolerance(c) -> dict:
  # Only the optimizer's own cross-tensor reduction (clip_by_global_norm's
  # global norm, summed over shards then across replicas) may change the
  # summation order; everything else must match bit for bit.
  return dict(rtol=c.rtol, atol=1e-7) if c.rtol else {}


def _check_sharded(c, ref_opt, got_opt, n, plan, *, stacked=False):
  want = sharded_expectation(ref_opt, n, stacked=stacked)
  assert want, "the case has no optimizer state to shard"
  missing = sorted(set(want) - _sharded_paths(got_opt))
  assert not missing, (f"{c.name}: optimizer state left whole: {missing}\n{plan()}")


# ---------------------------------------------------------------------------
# shard_map style
# ---------------------------------------------------------------------------

def _cases(names, forms, ns, vmas):
  return [(name, form, n, vma) for name in names for form in forms for n in ns for vma in vmas]


SHARD_MAP_CASES = (
    # Every model as the examples write it (pmean of the gradients), both vma modes.
    _cases(["mlp_adam", "mlp_clip_adamw", "nnx", "imagenet", "imagenet_fp16_dynscale", "wmt",
            "lm1b"], ["pmean_grads"], [8], [True, False])
    + _cases(["imagenet_bnpmean"], ["pmean_grads"], [8], [True])
    # The loss pmean-ed instead; under check_vma=False only the cheap MLP (see below).
    + _cases(["mlp_adam", "nnx", "imagenet", "lm1b"], ["pmean_loss"], [8], [True])
    + _cases(["mlp_adam"], ["pmean_loss"], [8], [False])
    # Six replicas: every shape pads differently.
    + _cases(["mlp_adam", "nnx", "imagenet"], ["pmean_grads"], [6], [True]))


def _id(p):
  name, form, n, vma = p
  return f"{name}-{form}-n{n}-{'vma' if vma else 'novma'}"


# The default profile runs these; the others are opt-in (--slow; about a minute each).
DEFAULT_SHARD_MAP = {("nnx", "pmean_loss", 8, True), ("mlp_adam", "pmean_grads", 6, True)}


@pytest.mark.parametrize("name,grad_form,n,check_vma", [
    pytest.param(*p, id=_id(p), marks=() if p in DEFAULT_SHARD_MAP else pytest.mark.slow)
    for p in SHARD_MAP_CASES])
def test_shard_map(name, grad_form, n, check_vma):
  c = case(name)
  m = mesh(n)
  train_step = c.make_step("data", grad_form, True)
  # State placed on the mesh up front (replicated), so that the first and
  # later steps hit one compiled program in both jax.jit and wus.
  init = lambda: jax.device_put(c.init("data"), NamedSharding(m, P()))
  state = init()
  k = len(state)
  kw = dict(mesh=m, in_specs=(P(),) * k + c.input_specs, out_specs=(P(),) * (k + 1),
            check_vma=check_vma)
  ref = jax.jit(jax.shard_map(train_step, **kw))
  step = wus.shard_map(train_step, **kw)

  a, b = state, init()
  for i in range(STEPS):
    inputs = place(m, c.inputs(n, i), c.input_specs)
    *a, ref_metrics = ref(*a, *inputs)
    *b, metrics = step(*b, *inputs)
  tol = _tolerance(c)
  assert_trees_equal(tuple(a), wus.unshard(tuple(b)), **tol)
  assert_trees_equal(ref_metrics, metrics, **tol)
  if name == "imagenet_fp16_dynscale":
    assert float(a[0].dynamic_scale.scale) < 2.0 ** 17  # Step 1 overflowed and was skipped.

  plan = lambda: step.plan(*init(), *place(m, c.inputs(n, 0), c.input_specs))
  if grad_form == "pmean_loss" and not check_vma:
    # Without vma typing, AD transposes the loss's pmean to nothing: each
    # replica keeps its own gradient (pmap's old pitfall) and there is no
    # gradient all-reduce, so nothing to shard; wus must leave the step as is.
    assert not _sharded_paths(b), plan()
    return
  _check_sharded(c, c.opt_state(a), c.opt_state(b), n, plan)


# ---------------------------------------------------------------------------
# pmap style: the examples' own loops, jax.pmap -> wus.pmap
# ---------------------------------------------------------------------------


def _pmap_kw(n):
  return {} if n == jax.device_count() else {"devices": jax.devices()[:n]}


def _replicate(state, n):
  return jax_utils.replicate(state, devices=jax.local_devices()[:n])


def _run_pmap(c, pmap, n, **pmap_kw):
  """The examples' training loop: replicate the state, shard the batch; the
  dropout keys (one per device, split once) passed by keyword as
  `p_train_step(state, batch, dropout_rng=dropout_rngs)`."""
  train_step = c.make_step("batch", "pmean_grads", False)
  p_train_step = pmap(train_step, axis_name="batch", **_pmap_kw(n), **pmap_kw)
  state = _replicate(c.init("batch")[0], n)
  for i in range(STEPS):
    args, kwargs = _pmap_args(c, n, i)
    state, metrics = p_train_step(state, *args, **kwargs)
  return state, metrics, p_train_step


def _pmap_args(c, n, i):
  batch, *rng = c.inputs(n, i)
  batch = jax.tree.map(lambda x: per_device(x, n), batch)  # common_utils.shard
  return (batch,), ({"dropout_rng": jax.random.split(rng[0], n)} if rng else {})


def _pmap_plan(c, n, p_train_step):
  args, kwargs = _pmap_args(c, n, 0)
  return lambda: p_train_step.plan(_replicate(c.init("batch")[0], n), *args, **kwargs)


PMAP_CASES = [
    # (case, n, the pmap keyword arguments the example passes)
    ("imagenet", 8, {}),
    ("imagenet", 6, {}),
    ("imagenet_fp16_dynscale", 8, {}),
    ("wmt", 8, {"donate_argnums": (0,)}),
    ("lm1b", 8, {"donate_argnums": (0,)}),
]


@pytest.mark.parametrize("name,n,pmap_kw", [
    pytest.param(*p, id=f"{p[0]}-n{p[1]}", marks=pytest.mark.slow) for p in PMAP_CASES])
def test_pmap_as_published(name, n, pmap_kw):
  """`jax.pmap(train_step, axis_name="batch")` -> `wus.pmap(...)`, nothing else."""
  c = case(name)
  want, want_metrics, _ = _run_pmap(c, jax.pmap, n, **pmap_kw)
  got, metrics, p_train_step = _run_pmap(c, wus.pmap, n, **pmap_kw)
  assert_trees_equal(want, wus.unshard(got))
  assert_trees_equal(want_metrics, metrics)
  _check_sharded(c, want.opt_state, got.opt_state, n, _pmap_plan(c, n, p_train_step), stacked=True)


@pytest.mark.slow
def test_pmap_with_replicated_argnums():
  """The same, declaring the replicated state with `replicated_argnums=(0,)`
  (wus.pmap then checks that the per-device copies are equal)."""
  c, n = case("imagenet"), 8
  want, want_metrics, _ = _run_pmap(c, jax.pmap, n)
  got, metrics, p_train_step = _run_pmap(c, functools.partial(wus.pmap, replicated_argnums=(0,)), n)
  assert_trees_equal(want, wus.unshard(got))
  assert_trees_equal(want_metrics, metrics)
  _check_sharded(c, want.opt_state, got.opt_state, n, _pmap_plan(c, n, p_train_step), stacked=True)
