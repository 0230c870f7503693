"""Attention with its heads split over "model" under `wus.nnx_jit` (issue 37): a
[..., heads * head_dim] projection placed over "model" and reshaped to [..., heads,
head_dim] (GSPMD keeps the split on the major factor, the heads), on (4, 2) meshes:
data x model (tensor parallelism) and fsdp x model (FSDP + TP), Auto and Explicit axes.

The model is the causal self-attention block of a GPT written with Flax NNX (nanoGPT's
shape: one fused qkv projection, heads by reshape, an output projection), shrunk. Each
step runs beside `nnx.jit`'s from the same state, bit for bit under the suite's flags
(AdamW's update is elementwise); the optimizer state must end up at most 1.15 x 1/8 of
a copy per device.
"""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, PartitionSpec as P

import wus
from helpers import assert_trees_equal
from wus.sharded import is_sharded

EMBED, HEADS, SEQ, VOCAB = 32, 4, 8, 64


class CausalSelfAttention(nnx.Module):
  def __init__(self, rngs: nnx.Rngs, explicit: bool, layout=None):
    init = nnx.initializers.lecun_normal()
    self.layout = layout  # Explicit axes: the row-parallel projection's result layout.

    def over(spec):  # The placement of a kernel: by metadata, or in the type.
      return (partial(init, out_sharding=P(*spec)) if explicit
              else nnx.with_partitioning(init, spec))
    self.c_attn = nnx.Linear(EMBED, 3 * EMBED, kernel_init=over((None, "model")), rngs=rngs)
    self.c_proj = nnx.Linear(EMBED, EMBED, kernel_init=over(("model", None)), rngs=rngs)

  def __call__(self, x):
    b, t, c = x.shape
    q, k, v = jnp.split(self.c_attn(x), 3, axis=-1)
    q, k, v = (y.reshape(b, t, HEADS, c // HEADS) for y in (q, k, v))  # Heads by reshape.
    att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(c // HEADS)
    att = jnp.where(jnp.tril(jnp.ones((t, t), bool)), att, -1e9)
    y = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(att, axis=-1), v).reshape(b, t, c)
    return self.c_proj(y, out_sharding=self.layout)


class GPT(nnx.Module):
  """Token embedding tied to the output head; on Explicit axes the lookup and the head
  name their result's layout, as JAX asks (`out_sharding`), the batch over `batch`."""

  def __init__(self, rngs: nnx.Rngs, explicit: bool = False, batch: str = "data"):
    self.wte = nnx.Embed(VOCAB, EMBED, rngs=rngs)
    self.ln = nnx.LayerNorm(EMBED, rngs=rngs)
    self.layout = P(batch, None, None) if explicit else None
    self.attn = CausalSelfAttention(rngs, explicit, self.layout)

  def __call__(self, idx):
    table = self.wte.embedding[...]
    x = self.wte(idx) if self.layout is None else table.at[idx].get(out_sharding=self.layout)
    x = x + self.attn(self.ln(x))
    return jnp.einsum("bte,ve->btv", x, table, out_sharding=self.layout)


def train_step(model, optimizer, idx, targets):
  def loss_fn(model):
    logits = model(idx)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
  loss, grads = nnx.value_and_grad(loss_fn)(model)
  optimizer.update(model, grads)
  return loss


# FSDP + TP ("fsdp", "model"): the embedding's block over "fsdp" is whole over "model",
# where its update is repeated: each model replica keeps half of the block's state.
# Data x model on Auto axes and FSDP + TP on Explicit ones by default (about 30 s each);
# the other two with --slow.
@pytest.mark.parametrize("kind,axes", [
    pytest.param(kind, axes, id=f"{kind}-{'x'.join(axes)}",
                 marks=() if (kind == "explicit") == ("fsdp" in axes) else pytest.mark.slow)
    for kind in ("auto", "explicit") for axes in (("data", "model"), ("fsdp", "model"))])
def test_heads_split_over_model_by_a_reshape_are_served(axes, kind):
  explicit = kind == "explicit"
  mesh = jax.make_mesh((4, 2), axes, axis_types=(
      AxisType.Explicit if explicit else AxisType.Auto,) * 2)
  batch = axes[0]

  def make():
    with jax.set_mesh(mesh):
      model = GPT(nnx.Rngs(0), explicit, batch)
      if batch == "fsdp":  # FSDP: the embedding table's rows over "fsdp" too.
        state = nnx.state(model)
        nnx.update(model, jax.tree.map(
            lambda x: jax.device_put(x, P("fsdp", None)) if x.shape == (VOCAB, EMBED) else x,
            state))
      return model, nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
  ref, out = make(), make()
  ws, rng = wus.nnx_jit(train_step), np.random.default_rng(1)
  with jax.set_mesh(mesh):
    for _ in range(2):
      idx, targets = (jax.device_put(rng.integers(0, VOCAB, (8, SEQ)).astype(np.int32),
                                     P(batch, None)) for _ in range(2))
      assert_trees_equal(nnx.jit(train_step)(*ref, idx, targets), ws(*out, idx, targets))
    plan = ws.plan(*out, idx, targets)
  assert not plan.unchanged, plan.unchanged
  # Every cluster is named by a weight or its state, not by an equation it reads.
  assert all(line.split()[3].startswith(("model[", "optimizer["))
             for line in str(plan).splitlines() if line.startswith("cluster")), str(plan)
  assert_trees_equal(nnx.state(ref), wus.unshard(nnx.state(out)))  # AdamW: bit for bit.
  state = nnx.state(out[1], nnx.optimizer.OptState)
  leaves = [x for x in jax.tree.leaves(state, is_leaf=is_sharded) if np.size(x) > 8]
  whole = sum(np.size(x) * 4 for x in leaves)
  per_device = sum(x.nbytes_per_device if is_sharded(x) else
                   x.addressable_shards[0].data.nbytes for x in leaves)
  assert per_device <= 1.15 * whole / 8, (per_device, whole, plan)
