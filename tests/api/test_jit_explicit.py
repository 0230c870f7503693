"""`wus.jit` on meshes with Explicit axes (`jax.make_mesh`'s default), as the JAX sharding
guide writes steps for them (issue 37 item 2): a size-1 axis the weights' types name,
weights placed over a batch axis and resharded before use (FSDP, HSDP, data x fsdp x
tensor), a vocabulary split over "model" looked up with `.at[ids].get(out_sharding=...)`.

Each step runs unmodified under `jax.jit` and under `wus.jit` from the same inputs; the
updates are elementwise (Adam), so every result must be bit for bit, and no call may
raise where `jax.jit` does not.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P, reshard

import wus
from helpers import assert_trees_equal
from wus.sharded import is_sharded


def _mlp(batch, before_use=None):
  """A two-layer MLP's loss on a mesh whose batch axes are `batch`; `before_use` maps each
  weight to the spec it is resharded to before use (FSDP's all-gather), if any."""
  def loss(p, b):
    if before_use:
      p = {k: reshard(v, before_use[k]) if k in before_use else v for k, v in p.items()}
    h = jnp.tanh(b["x"] @ p["w1"] + p["b1"])
    out = jnp.einsum("bh,ho->bo", h, p["w2"], out_sharding=P(batch, None))
    return jnp.mean(out ** 2)
  return loss


def _embed_over_tensor(batch, features=None):
  """MaxText's layers with `shard_mode=explicit`, shrunk: activations with their embedding
  over "tensor", kernels over ("fsdp", "tensor"), each product laid out by its
  `out_sharding` (maxtext/layers/linears.py). Each kernel's gradient is a dot laid out as
  the kernel: it reshards the activations' embedding from "tensor" to "fsdp". With
  `features`, the batch's features are laid out over that axis first: the batch is split
  over it too, where the gradients' operands are not."""
  def loss(p, b):
    x = reshard(b["x"], P(batch, features)) if features else b["x"]
    h = jnp.tanh(jnp.einsum("be,eh->bh", x, p["w1"], out_sharding=P(batch, "tensor")))
    out = jnp.einsum("bh,ho->bo", h, p["w2"], out_sharding=P(batch, "tensor"))
    return jnp.mean(out ** 2)
  return loss


def _vocab_split(p, b):
  """Tensor parallelism over the vocabulary: embedding and tied head split over "model"."""
  h = p["emb"].at[b["ids"]].get(out_sharding=P("data", None))
  logits = jnp.einsum("bd,vd->bv", h, p["head"], out_sharding=P("data", "model"))
  return jnp.mean(logits ** 2)


W = {"w1": (32, 32), "b1": (32,), "w2": (32, 8)}
CASES = {
    # A ("data", "tensor") mesh of (8, 1): weights annotated for the unused axis.
    "size1_8x1": ((8, 1), ("data", "tensor"), "data",
                  {"w1": P(None, "tensor"), "b1": P("tensor"), "w2": P("tensor", None)},
                  _mlp("data")),
    "size1_4x2x1": ((4, 2, 1), ("data", "model", "tensor"), "data",
                    {"w1": P(None, ("model", "tensor")), "b1": P(("model", "tensor")),
                     "w2": P(None, "tensor")}, _mlp("data")),
    "fsdp": ((8,), ("fsdp",), "fsdp", {"w1": P("fsdp", None), "b1": P(), "w2": P("fsdp", None)},
             _mlp("fsdp", {"w1": P(), "w2": P()})),
    "hsdp": ((2, 4), ("replica", "fsdp"), ("replica", "fsdp"),
             {"w1": P("fsdp", None), "b1": P(), "w2": P("fsdp", None)},
             _mlp(("replica", "fsdp"), {"w1": P(), "w2": P()})),
    "data_fsdp_tensor": ((2, 2, 2), ("data", "fsdp", "tensor"), ("data", "fsdp"),
                         {"w1": P("fsdp", "tensor"), "b1": P("tensor"),
                          "w2": P("tensor", "fsdp")},
                         _mlp(("data", "fsdp"), {"w1": P(None, "tensor"),
                                                 "w2": P("tensor", None)})),
    "embed_over_tensor": ((2, 2, 2), ("data", "fsdp", "tensor"), ("data", "fsdp"),
                          {"w1": P("fsdp", "tensor"), "w2": P("fsdp", "tensor")},
                          _embed_over_tensor(("data", "fsdp"))),
    "batch_features_over_tensor": ((2, 2, 2), ("data", "fsdp", "tensor"), ("data", "fsdp"),
                                   {"w1": P("fsdp", "tensor"), "w2": P("fsdp", "tensor")},
                                   _embed_over_tensor(("data", "fsdp"), "tensor")),
    "vocab_split": ((4, 2), ("data", "model"), "data",
                    {"emb": P("model", None), "head": P("model", None)}, _vocab_split),
}
# Gradients summed over two batch axes: one all-reduce over both in the unmodified step
# (JAX's Explicit rule for a dot contracting the batch), in phases under wus (§5.1, as GSPMD
# sums on Auto axes): within summation order. Adam's eps is raised there so that its
# division by the root of a gradient's square does not turn an ulp of a tiny gradient
# into a large difference (with SGD the weights differ by at most two ulps).
SUMMATION_ORDER = {"hsdp", "data_fsdp_tensor", "batch_features_over_tensor"}


@pytest.mark.parametrize("name", CASES)
def test_explicit_mesh_step_matches_jax_jit_and_shards_the_state(name):
  shape, names, batch, specs, loss = CASES[name]
  mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Explicit,) * len(shape))
  shapes = {"emb": (64, 32), "head": (64, 32)} if "emb" in specs else W
  tx = optax.adam(1e-2, eps=1e-3 if name in SUMMATION_ORDER else 1e-8)
  rng = np.random.default_rng(0)
  with jax.set_mesh(mesh):
    params = {k: jax.device_put(rng.normal(size=shapes[k]).astype(np.float32) * 0.1,
                                NamedSharding(mesh, s)) for k, s in specs.items()}
    data = NamedSharding(mesh, P(batch))
    batches = [{"x": jax.device_put(rng.normal(size=(16, 32)).astype(np.float32), data),
                "ids": jax.device_put(rng.integers(0, 64, size=(16,)).astype(np.int32), data)}
               for _ in range(2)]

    def step(params, opt_state, b):
      value, grads = jax.value_and_grad(loss)(params, b)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, value

    def run(f):
      out = (params, tx.init(params))
      for b in batches:
        out = f(*out[:2], b)
      return out
    ref, ws = run(jax.jit(step)), wus.jit(step)
    got = run(ws)
    plan = ws.plan(params, tx.init(params), batches[0])
  tolerance = dict(rtol=1e-6, atol=1e-8) if name in SUMMATION_ORDER else {}
  assert_trees_equal(ref, wus.unshard(got), **tolerance)
  assert not plan.unchanged, plan.unchanged
  state = [x for x in jax.tree.leaves(got[1], is_leaf=is_sharded) if np.size(x) > 8]
  assert any(is_sharded(x) for x in state), plan
