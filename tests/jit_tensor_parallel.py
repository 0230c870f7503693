"""Shared by tests/api/test_jit_tensor_parallel*.py: `wus.jit` on ("data", "model") meshes
(issue 29 item 2). The meshes, batches and steps those tests run beside the unmodified
`jax.jit` step: a linen model placed by logical axis rules, a Megatron MLP placed by
NamedShardings; and the check that the state of the model-split weights is sharded over
data x model."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import wus
from helpers import assert_trees_equal, classifier_batches, classifier_step
from wus.sharded import is_sharded


def make_mesh(n_data, kind="auto", n_model=2):
  types = (AxisType.Auto if kind == "auto" else AxisType.Explicit,) * 2
  return jax.make_mesh((n_data, n_model), ("data", "model"), axis_types=types,
                       devices=jax.devices()[:n_data * n_model])


def batches(mesh, n, batch=24, features=12):
  return classifier_batches(mesh, n, batch, features)


def sharded(tree) -> list:
  return [x for x in jax.tree.leaves(tree, is_leaf=is_sharded) if is_sharded(x)]


def assert_split_state(state, n_data, n_model=2):
  """The state of the model-split weights is sharded over data x model, <= V/(n_data x
  n_model) per device + the shards' padding; the rest of the float state over data."""
  split = [x for x in sharded(state) if x.layout.split_axes == ("model",)]
  assert split, [type(x).__name__ for x in jax.tree.leaves(state, is_leaf=is_sharded)]
  whole = sum(x.nbytes for x in split)
  padding = sum(x.format.padding * x.dtype.itemsize for x in split) * n_model / n_data
  assert sum(x.nbytes_per_device for x in split) <= whole / (n_data * n_model) + padding
  for x in split:
    assert x.data.sharding.spec == P(("model", "data")), x.data.sharding
    assert x.format.num_shards == n_data


class LogicalMLP(nn.Module):
  """Flax's logical axis annotations (the "Scale up Flax modules on multiple devices"
  guide), shrunk: a column- then a row-parallel Dense, LayerNorm and biases between."""

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(32, kernel_init=nn.with_logical_partitioning(
        nn.initializers.lecun_normal(), ("embed", "mlp")),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(), ("mlp",)))(x)
    x = nn.LayerNorm()(nn.relu(x))
    x = nn.Dense(16, kernel_init=nn.with_logical_partitioning(
        nn.initializers.lecun_normal(), ("mlp", "heads")))(x)
    return nn.Dense(10, kernel_init=nn.with_logical_partitioning(
        nn.initializers.lecun_normal(), ("heads", "embed")))(nn.relu(x))


RULES = (("batch", "data"), ("embed", None), ("mlp", "model"), ("heads", "model"))


def linen_args(mesh, tx):
  model = LogicalMLP()
  with nn.logical_axis_rules(RULES):
    abstract = jax.eval_shape(model.init, jax.random.key(0), jnp.ones((1, 12)))
    shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, RULES)
  params = jax.jit(model.init, out_shardings=shardings)(jax.random.key(0), jnp.ones((1, 12)))
  return model, params


def run_both(step, ws, args, batches):
  ref = out = args
  for b in batches:
    *ref, ref_aux = jax.jit(step)(*ref, b)
    *out, out_aux = ws(*out, b)
    assert_trees_equal(ref_aux, out_aux)
  assert_trees_equal(ref, wus.unshard(out))
  return ref, out


def linen_step(n_data=4, tx=None, kind="auto"):
  """The linen model's step on (n_data, 2), one call made: (step, args, batch, tx)."""
  tx = tx or optax.adam(1e-2)
  mesh = make_mesh(n_data, kind)
  model, params = linen_args(mesh, tx)
  ws = wus.jit(classifier_step(model, tx))
  (batch,) = batches(mesh, 1)
  params, opt_state, _ = ws(params, tx.init(params), batch)
  return ws, (params, opt_state), batch, mesh


def mlp_step(tx):
  """A column- then row-parallel GELU MLP on global arrays (Megatron's split, placed by
  NamedShardings): the step as a jax.jit user writes it."""
  def step(params, opt_state, batch):
    x, y = batch

    def loss_fn(p):
      return jnp.mean((jax.nn.gelu(x @ p["w1"]) @ p["w2"] - y) ** 2)
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss
  return step


def mlp_inputs(mesh):
  """The Megatron MLP's weights (w1 column-, w2 row-parallel over "model") and three
  (x, y) batches split over "data"."""
  r = np.random.RandomState(0)
  spec = {"w1": P(None, "model"), "w2": P("model", None)}
  params = {k: jax.device_put(jnp.asarray(0.1 * r.randn(*shape), jnp.float32),
                              NamedSharding(mesh, spec[k]))
            for k, shape in (("w1", (16, 32)), ("w2", (32, 16)))}
  data = NamedSharding(mesh, P("data"))
  batches = [tuple(jax.device_put(jnp.asarray(r.randn(16, 16), jnp.float32), data)
                   for _ in range(2)) for _ in range(3)]
  return params, batches


def mlp_run(tx, make_step=mlp_step, **tol):
  """`make_step(tx)` under jax.jit and wus.jit from the same inputs: (wus step, its last
  state, the last batch); the results compared (within `tol`)."""
  params, batches = mlp_inputs(make_mesh(4))
  step, ws = make_step(tx), wus.jit(make_step(tx))
  ref = out = (params, tx.init(params))
  for b in batches:
    ref, out = jax.jit(step)(*ref, b)[:2], ws(*out, b)[:2]
  assert_trees_equal(ref, wus.unshard(out), **tol)
  return ws, out, b
