"""`wus.named_jit` in haliax's `named_jit`'s place (Levanter's train step, issue 40 item 2):
a haliax model of named arrays, an Equinox-style step, `named_jit` with an axis mapping and
the state donated, as Levanter's Trainer writes it, shrunk. Runs where haliax is
installed (Levanter's environment, which `.ci/trainers` makes); skipped elsewhere."""

import pytest

hax = pytest.importorskip("haliax")

import equinox as eqx  # noqa: E402 -- haliax's dependency
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from haliax.partitioning import named_jit as haliax_named_jit  # noqa: E402
from jax.sharding import AxisType  # noqa: E402

import wus  # noqa: E402
from helpers import assert_trees_equal  # noqa: E402
from wus.sharded import is_sharded  # noqa: E402

Batch, Embed, Mlp = hax.Axis("batch", 32), hax.Axis("embed", 16), hax.Axis("mlp", 64)


class MLP(eqx.Module):
  up: hax.nn.Linear
  down: hax.nn.Linear

  @staticmethod
  def init(key):
    k1, k2 = jax.random.split(key)
    return MLP(hax.nn.Linear.init(Embed, Mlp, key=k1), hax.nn.Linear.init(Mlp, Embed, key=k2))

  def __call__(self, x):
    return self.down(hax.nn.relu(self.up(x)))


def _train_step(tx):
  """Levanter's step, shrunk: the loss of the model, its gradient, the optimizer's update."""
  def train_step(model, opt_state, x, y):
    def loss_fn(m):
      return hax.mean((m(x) - y) ** 2).scalar()
    loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
    updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state, loss
  return train_step


@pytest.mark.parametrize("shape,mapping,layouts", [
    ((8,), {"batch": "data"}, False),
    ((4, 2), {"batch": "data", "mlp": "model"}, False),
    ((4, 2), {"batch": "data", "mlp": "model"}, True),
], ids=["data", "data_model", "data_model_in_out"])
def test_named_jit_as_levanter_calls_it_bit_for_bit_state_sharded(shape, mapping, layouts):
  """The step under haliax's `named_jit` and under `wus.named_jit`, the same arguments
  (the state donated, as Levanter's `donate_args=(True, True)`; with `layouts`, the
  arguments and outputs laid out by `in_axis_resources` and `out_axis_resources`, as
  `haliax.fsdp` does) over three steps: bit for bit, and Adam's moments kept sharded over
  "data" (1/8 of each per device on data 8, of each "model" block on data 4 x model 2)."""
  names = ("data", "model")[:len(shape)]
  mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))
  tx = optax.adam(1e-2)
  rng = np.random.default_rng(0)
  with hax.partitioning.set_mesh(mesh), hax.axis_mapping(mapping):
    batches = [tuple(hax.shard(hax.named(rng.normal(size=(32, 16)).astype(np.float32),
                                         (Batch, Embed))) for _ in range(2)) for _ in range(3)]
    runs = {}
    for name, named_jit in (("haliax", haliax_named_jit), ("wus", wus.named_jit)):
      given = dict(in_axis_resources=mapping, out_axis_resources=mapping) if layouts else {}
      step = named_jit(_train_step(tx), axis_resources=mapping, donate_args=(True, True),
                       **given)
      model = hax.shard(MLP.init(jax.random.key(0)))  # Each run's own: the first donates it.
      state = (model, tx.init(eqx.filter(model, eqx.is_array)))
      losses = []
      for x, y in batches:
        *state, loss = step(*state, x, y)
        losses.append(loss)
      runs[name] = (state, losses, step)
  (ref, ref_losses, _), (got, got_losses, step) = runs["haliax"], runs["wus"]
  assert_trees_equal(ref_losses, got_losses)
  assert_trees_equal(ref, wus.unshard(got))
  with hax.partitioning.set_mesh(mesh), hax.axis_mapping(mapping):
    plan = step.plan(*got, *batches[0])
  assert not plan.unchanged, plan.unchanged
  mu = got[1][0].mu
  for leaf in (mu.up.weight.array, mu.down.weight.array):
    assert is_sharded(leaf) and leaf.nbytes_per_device * 8 == leaf.size * 4, leaf
