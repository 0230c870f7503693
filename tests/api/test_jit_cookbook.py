"""The JAX Training Cookbook's FSDP step (docs/the-training-cookbook.py), shrunk: a
Transformer decoder with its kernels placed over "fsdp" on an Explicit mesh, the train
state held in `jax.Ref`s and Adam written by hand, updating them in place. Under `wus.jit`
it runs as `jax.jit` runs it (wus shards updates of values a step takes and returns;
refs passed in run unchanged, with the reason in the Plan), bit for bit. The same step
taking and returning values, its refs made inside it, is served: its refs are discharged
into values (`compat.without_refs`), and the embeddings' Adam state is sharded, bit for
bit. (It also needed the gather of `x.at[i].get(out_sharding=...)`, an `auto_axes`
region inside the Explicit mesh, to be left typed as JAX types it.)"""

import functools as ft
import itertools as it
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

import wus
from wus.analysis import refusals
from helpers import assert_trees_equal


# --- Copied from the cookbook; only the sizes shrunk (and the mesh set by the test). ---
@jax.tree_util.register_static
@dataclass(kw_only=True, frozen=True)
class Config:
  mesh_axis_names: tuple[str, ...] = ("fsdp",)
  mesh_shape: tuple[int, ...] = (8,)
  seq_length: int = 8

  learning_rate: float = 1e-4
  beta_1: float = 0.9
  beta_2: float = 0.999
  eps: float = 1e-8
  eps_root: float = 0.0

  param_seed: int = 12738
  num_layers: int = 1
  embed_dim: int = 16
  mlp_dim: int = 16 * 4
  vocab_size: int = 2**5
  num_heads: int = 8
  head_dim: int = 4
  dtype: str = "float32"

  embed: jax.P = jax.P(None, None)
  pos_embed: jax.P = jax.P(None, None)
  att_qkv: jax.P = jax.P(None, "fsdp", None, None)
  att_out: jax.P = jax.P("fsdp", None, None)
  mlp_in: jax.P = jax.P("fsdp", None)
  mlp_out: jax.P = jax.P(None, "fsdp")
  out_kernel: jax.P = jax.P("fsdp", None)

  act_seq: jax.P = jax.P("fsdp", None, None)
  act_att: jax.P = jax.P("fsdp", None, None, None)
  act_hidden: jax.P = jax.P("fsdp", None, None)


@jax.tree_util.register_pytree_with_keys_class
class dot_dict(dict):  # noqa: N801 -- the cookbook's name.
  __setattr__ = dict.__setitem__
  __getattr__ = dict.__getitem__

  def tree_flatten_with_keys(self):
    keys = tuple(sorted(self))
    return tuple((jax.tree_util.DictKey(k), self[k]) for k in keys), keys

  @classmethod
  def tree_unflatten(cls, keys, values):
    return cls(zip(keys, values, strict=True))


def init_param_state(config: Config) -> dot_dict:
  root_key = jax.random.key(config.param_seed)
  key = map(ft.partial(jax.random.fold_in, root_key), it.count())
  zero_init = jax.nn.initializers.constant(0.0)
  he_init = jax.nn.initializers.he_normal(1, 1)
  dtype = config.dtype

  params = dot_dict(
    pos_embed=zero_init(next(key), (config.seq_length, config.embed_dim), dtype, config.pos_embed),
    layers=dot_dict(),
  )
  params.embedding = he_init(next(key), (config.vocab_size, config.embed_dim), dtype, config.embed)
  params.linear_out = dot_dict(
    kernel=he_init(next(key), (config.embed_dim, config.vocab_size), dtype, config.out_kernel),
  )
  for layer in range(config.num_layers):
    qkv_shape = (3, config.embed_dim, config.num_heads, config.head_dim)
    out_shape = (config.num_heads, config.head_dim, config.embed_dim)
    params.layers[layer] = dot_dict(
      attention=dot_dict(
        qkv=he_init(next(key), qkv_shape, dtype, config.att_qkv),
        out=he_init(next(key), out_shape, dtype, config.att_out),
      ),
      mlp=dot_dict(
        in_kernel=he_init(next(key), (config.embed_dim, config.mlp_dim), dtype, config.mlp_in),
        out_kernel=he_init(next(key), (config.mlp_dim, config.embed_dim), dtype, config.mlp_out),
      ),
    )
  return params


def model_apply(config: Config, params: dot_dict, tokens: jax.Array) -> jax.Array:
  out = params.embedding.at[tokens].get(out_sharding=config.act_seq)
  out += params.pos_embed
  del tokens

  for layer in range(config.num_layers):
    block = params.layers[layer]
    att_skip = out
    qkv = jnp.einsum("bsd,3dkh->bs3kh", out, block.attention.qkv, out_sharding=config.act_att)
    out = jax.nn.dot_product_attention(qkv[:, :, 0, :], qkv[:, :, 1, :], qkv[:, :, 2, :],
                                       is_causal=True)
    out = jnp.einsum("bskh,khd->bsd", out, block.attention.out, out_sharding=config.act_seq)
    out += att_skip
    out *= jax.lax.rsqrt(jnp.mean(out**2, axis=-1, keepdims=True) + 1e-6)

    mlp_skip = out
    out = jnp.einsum("bsd,dh->bsh", out, block.mlp.in_kernel, out_sharding=config.act_hidden)
    out = jax.nn.gelu(out)
    out = jnp.einsum("bsh,hd->bsd", out, block.mlp.out_kernel, out_sharding=config.act_seq)
    out += mlp_skip
    out *= jax.lax.rsqrt(jnp.mean(out**2, axis=-1, keepdims=True) + 1e-6)

  logits = jnp.einsum("bsd,dl->bsl", out, params.linear_out.kernel, out_sharding=config.act_seq)
  return logits


def init_adam_state(param: jax.Array) -> dot_dict:
  adam_state = dot_dict(mu=jnp.zeros_like(param), nu=jnp.zeros_like(param), count=jnp.array(0))
  return adam_state


def adam_update(config: Config, param: jax.Ref, grad: jax.Array, adam_state: dot_dict):
  adam_state.mu[...] = config.beta_1 * adam_state.mu[...] + (1 - config.beta_1) * grad
  adam_state.nu[...] = config.beta_2 * adam_state.nu[...] + (1 - config.beta_2) * grad**2
  adam_state.count[...] += 1

  mu_hat = adam_state.mu[...] / (1 - config.beta_1 ** adam_state.count[...])
  nu_hat = adam_state.nu[...] / (1 - config.beta_2 ** adam_state.count[...])
  param[...] -= config.learning_rate * mu_hat / (jnp.sqrt(nu_hat + config.eps_root) + config.eps)


@jax.jit
def init_train_state(config: Config) -> dot_dict:
  train_state = dot_dict()
  train_state.params = init_param_state(config)
  train_state.opt = jax.tree.map(init_adam_state, train_state.params)
  return train_state


def train_step(config: Config, train_state: dot_dict, batch: dict) -> dict:
  def loss_fn(params):
    logits = model_apply(config, params, batch["observed_ids"])
    labels = jax.nn.one_hot(batch["target_ids"], config.vocab_size)
    return -(labels * jax.nn.log_softmax(logits)).sum(axis=-1).mean()

  params = jax.tree.map(jax.ref.get, train_state.params)
  loss, grad = jax.value_and_grad(loss_fn)(params)
  jax.tree.map(ft.partial(adam_update, config), train_state.params, grad, train_state.opt)
  metrics = {"train_loss": loss}
  return metrics
# --- End of the cookbook's code. ---


def _batches(config: Config, n: int) -> list[dict]:
  rng = np.random.default_rng(0)
  sharding = jax.P(config.mesh_axis_names)
  out = []
  for _ in range(n):
    ids = rng.integers(0, config.vocab_size, (8, config.seq_length + 1), dtype=np.int32)
    out.append(jax.device_put({"observed_ids": ids[:, :-1], "target_ids": ids[:, 1:]},
                              sharding))
  return out


@pytest.fixture
def config():
  mesh = jax.make_mesh((8,), ("fsdp",), (AxisType.Explicit,))
  with jax.set_mesh(mesh):
    yield Config()


def test_cookbook_step_with_refs_runs_as_jax_jit_with_the_reason(config):
  """The cookbook's step verbatim (refs updated in place): bit for bit with jax.jit,
  nothing sharded, and the Plan says it is the refs."""
  batches = _batches(config, 2)
  ref_state = jax.tree.map(jax.new_ref, init_train_state(config))
  state = jax.tree.map(jax.new_ref, init_train_state(config))
  step, ws = jax.jit(train_step, static_argnums=0), wus.jit(train_step, static_argnums=0)
  for b in batches:
    assert_trees_equal(step(config, ref_state, b), ws(config, state, b))
  assert_trees_equal(jax.tree.map(jax.ref.get, ref_state), jax.tree.map(jax.ref.get, state))
  unchanged = ws.plan(config, state, batches[0]).unchanged
  assert isinstance(unchanged.verdict, refusals.ReadsRefs), unchanged
  assert unchanged.verdict.name.startswith("train_state"), unchanged
  assert "JAX refs it does not create (train_state" in str(unchanged), unchanged


def value_train_step(config: Config, train_state: dot_dict, batch: dict):
  """The cookbook's step taking and returning values: the refs are made inside it, so the
  cookbook's `train_step` and `adam_update` run as written."""
  refs = jax.tree.map(jax.new_ref, train_state)
  metrics = train_step(config, refs, batch)
  return jax.tree.map(jax.ref.get, refs), metrics


def test_cookbook_step_making_its_refs_inside_is_served(config):
  """Refs the step makes itself are discharged into values (`compat.without_refs`): the
  update region is found, the Adam state of the weights left whole by the cookbook (the
  embeddings) is sharded over "fsdp", the kernels' stays as placed, and every step
  matches jax.jit's bit for bit."""
  batches = _batches(config, 3)
  step = jax.jit(value_train_step, static_argnums=0)
  ws = wus.jit(value_train_step, static_argnums=0)
  ref, out = init_train_state(config), init_train_state(config)
  for b in batches:
    ref, ref_m = step(config, ref, b)
    out, out_m = ws(config, out, b)
  assert_trees_equal((ref, ref_m), (wus.unshard(out), out_m))
  plan = ws.plan(config, out, batches[0])
  assert not plan.unchanged
  sharded = {i.name for i in plan.inputs if i.sharded}
  assert {"train_state['opt']['embedding']['mu']", "train_state['opt']['embedding']['nu']",
          "train_state['opt']['pos_embed']['mu']"} <= sharded, sharded
  assert all(".kernel" not in n and "qkv" not in n for n in sharded), sharded
  assert wus.sharded.is_sharded(out["opt"]["embedding"]["mu"])
