"""A step written the way MaxText writes it: layers stacked by `nn.scan` (their weights
`[features, layers, ...]`, the layer axis at 1 as MaxText's `param_scan_axis`), `jax.jit`
with in and out shardings and the state donated, the gradients clipped by their global
norm before AdamW, and the gradient norms returned as metrics.

GSPMD all-reduces each layer's gradient inside the backward loop. The stacked gradient
is transposed to the weight's layout where GSPMD partitions the step, and the update
region reads the transpose as its shards (`analysis.presliced`): GSPMD then splits the stacked
gradient inside the loop, each device keeping its slice of every layer's all-reduced
gradient, as it does for an update sharded by hand (MaxText's
`shard_optimizer_over_data`). Read whole by the region (until 2026-11-30), it was built
whole on every device in the loop (MaxText, data 8: 6 MiB per device). The logged norms,
which read the gradients whole, run on shards too, their partial sums all-reduced
(`analysis.reduction_joins`); before, every replica transposed (and clipped) every
stacked gradient whole (16 MiB of copies per device).
"""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import wus
from helpers import assert_trees_equal, mesh
from wus.analysis import verdicts

LAYERS, EMBED, MLP, VOCAB = 4, 64, 256, 512


class _Layer(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    h = nn.Dense(MLP, use_bias=False)(nn.LayerNorm(use_bias=False)(x))
    return x + nn.Dense(EMBED, use_bias=False)(nn.relu(h)), None


class _Decoder(nn.Module):
  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(VOCAB, EMBED)(tokens)
    x, _ = nn.scan(nn.remat(_Layer), variable_axes={"params": 1}, split_rngs={"params": True},
                   length=LAYERS)()(x, None)
    return nn.Dense(VOCAB, use_bias=False)(x)


MODEL, CLIP, TX = _Decoder(), optax.clip_by_global_norm(1.0), optax.adamw(1e-3,
                                                                           weight_decay=0.1)


def _train_step(state, batch):
  """MaxText's order: the raw gradients, clipped, then the optimizer; norms as metrics."""
  params, opt_state = state

  def loss(p):
    logits = MODEL.apply(p, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
  value, raw = jax.value_and_grad(loss)(params)
  grads, _ = CLIP.update(raw, CLIP.init(params))
  updates, opt_state = TX.update(grads, opt_state, params)
  metrics = {"loss": value, "raw_grad_norm": optax.global_norm(raw),
             "grad_norm": optax.global_norm(grads), "param_norm": optax.global_norm(params)}
  return (optax.apply_updates(params, updates), opt_state), metrics


def _layers(params):
  """The stacked layers' part of a tree shaped like the parameters."""
  (name,) = [k for k in params["params"] if k.startswith("Scan")]
  return params["params"][name]


def _maxtext_mesh():
  """As MaxText builds it for `ici_data_parallelism=8`: every logical axis in the mesh,
  the unused ones of size 1, Auto axes (`shard_mode=auto`); the batch over data and fsdp."""
  names = ("data", "stage", "fsdp", "fsdp_transpose", "sequence", "tensor", "expert")
  m = jax.make_mesh((8, 1, 1, 1, 1, 1, 1), names, axis_types=(AxisType.Auto,) * len(names))
  return m, P(("data", "fsdp"))


def _setup(maxtext_mesh):
  m, batch = _maxtext_mesh() if maxtext_mesh else (mesh(8, "auto"), P("data"))
  whole, data = NamedSharding(m, P()), NamedSharding(m, batch)
  params = MODEL.init(jax.random.key(0), jnp.ones((1, 8), jnp.int32))
  state = jax.device_put((params, TX.init(params)), whole)
  shardings = (jax.tree.map(lambda _: whole, state), data)
  rng = np.random.default_rng(0)
  batches = [{k: jax.device_put(rng.integers(0, VOCAB, (16, 8)).astype(np.int32), data)
              for k in ("x", "y")} for _ in range(3)]
  stacked = {tuple(x.shape) for x in jax.tree.leaves(_layers(params))}
  kw = dict(in_shardings=shardings, out_shardings=(shardings[0], None))
  return state, batches, stacked, kw


@pytest.mark.parametrize("maxtext_mesh", [False, True], ids=["data", "maxtext_axes"])
def test_stacked_gradients_clip_on_shards_and_the_step_is_jax_jits(maxtext_mesh):
  """Each stacked weight's cluster grows from the stacked gradient's transpose, sliced
  locally: the clip and the logged norms run on its shards (their sums all-reduced), not
  whole on every replica, so nothing reads the transpose whole and XLA transposes only
  each replica's slice. Losses equal, the rest within the rounding of the norms' sums on
  shards; the stacked weights' optimizer state sharded."""
  state, batches, stacked, kw = _setup(maxtext_mesh)
  ref_step = jax.jit(_train_step, donate_argnums=0, **kw)
  ws = wus.jit(_train_step, donate_argnums=0, **kw)
  plan = ws.plan(state, batches[0])
  layers = [c for c in plan.clusters if any(t.shape in stacked and t.name.startswith("state")
                                            for t in c.tensors)]
  assert len(layers) == len(stacked)
  for c in layers:
    assert c.sharded and isinstance(c.why.verdict, verdicts.RootsSliced), c.why
    # The transpose, an input of the region, not the clip's select_n.
    assert c.why.verdict.what.startswith("<transpose at "), c.why
  ref, out = jax.tree.map(jnp.copy, state), jax.tree.map(jnp.copy, state)
  for b in batches:
    (ref, ref_metrics), (out, metrics) = ref_step(ref, b), ws(out, b)
    assert float(metrics["loss"]) == float(ref_metrics["loss"])
    assert_trees_equal(ref_metrics, metrics, rtol=1e-6)
  assert_trees_equal(ref, wus.unshard(out), rtol=1e-6, atol=1e-7)
  layers = _layers(out[1][0].mu)
  assert all(isinstance(layers[k]["kernel"], wus.ShardedArray) for k in ("Dense_0", "Dense_1"))


def _loop_carries(hlo: str) -> list[list[tuple[int, ...]]]:
  """The f32 shapes each while loop of an optimized HLO program carries."""
  return [[tuple(int(n) for n in d.split(",")) for d in re.findall(r"f32\[([\d,]+)\]", m)]
          for m in re.findall(r"= (\([^)]*\)) while\(", hlo)]


@pytest.mark.parametrize("maxtext_mesh", [False, True], ids=["data", "maxtext_axes"])
def test_the_backward_loop_keeps_each_devices_slice_of_the_stacked_gradients(maxtext_mesh):
  """The stacked gradients the update reads as shards are split inside the backward loop:
  each loop carries a stacked layer weight's shape once at most (the weight the loop
  reads), its gradient as each device's eighth; `jax.jit`'s backward loop carries both
  whole. Until 2026-11-30 `wus.jit`'s did too: the region read the gradients whole."""
  state, batches, stacked, kw = _setup(maxtext_mesh)
  # The loop's layout: the layer axis (1 in the weights, MaxText's param_scan_axis) first.
  looped = {(s[1], s[0], *s[2:]) for s in stacked}
  sliced = {(s[0], s[1] // 8, *s[2:]) for s in looped}

  def carries(step) -> list[list[tuple[int, ...]]]:
    return _loop_carries(step.lower(state, batches[0]).compile().as_text())
  ref = carries(jax.jit(_train_step, donate_argnums=0, **kw))
  assert max(c.count(s) for c in ref for s in looped) == 2  # The weight and its gradient.
  step = wus.jit(_train_step, donate_argnums=0, **kw)
  out = carries(step)
  assert max(c.count(s) for c in out for s in looped) == 1, out
  assert sliced <= {s for c in out for s in c}, out
  # The Plan says it: the region takes each stacked gradient as its shards, no state.
  rewrite = step.plan(state, batches[0]).rewrite
  assert len(rewrite.presliced) == len(stacked) and rewrite.presliced <= set(rewrite.sharded_in)
