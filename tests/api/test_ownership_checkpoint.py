"""Owned optimizer state in checkpoints: saved with stock Orbax, restored at any replica count.

Owned state (Muon's momentum of matrices each updated by one replica) is held
in the rows of its bank, each tensor whole only on its owner. `wus.checkpointable`
writes each tensor whole from its owner's process; code without wus reads
ordinary arrays; `ShardedStep.state_target` restores it owned for the step's
replica count, each process reading only the tensors its devices own.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import wus
from helpers import assert_trees_equal, mesh
from test_ownership import MLP, _owned, _step

MODEL, TX = MLP(depth=10), optax.contrib.muon(1e-2)
KW = dict(in_specs=(P(), P(), P("data")), out_specs=(P(), P()))


def _batch(i, m):
  x = jax.random.normal(jax.random.key(30 + i), (24, 16))  # One global batch at every N.
  return jax.device_put(x, NamedSharding(m, P("data")))


def _train(state, m, start, steps):
  step = wus.shard_map(_step(MODEL, TX), mesh=m, **KW)
  for i in range(start, start + steps):
    state = step(*state, _batch(i, m))
  return state, step


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """Two owned-Muon updates at N = 8, saved with Orbax; (folder, state)."""
  params = MODEL.init(jax.random.key(0), jnp.ones((1, 16)))["params"]
  state, _ = _train((params, TX.init(params)), mesh(8), 0, 2)
  assert _owned(state[1])
  path = tmp_path_factory.mktemp("owned") / "ckpt"
  ckptr = ocp.StandardCheckpointer()
  ckptr.save(path, wus.checkpointable({"params": state[0], "opt_state": state[1]}))
  ckptr.wait_until_finished()
  return path, state


def test_saved_as_ordinary_arrays(saved):
  """Code without wus restores whole arrays, equal to the owned state."""
  path, state = saved
  plain = ocp.StandardCheckpointer().restore(path)
  whole = wus.unshard(state[1])
  for x, y in zip(jax.tree.leaves(plain["opt_state"]), jax.tree.leaves(whole), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("n", [pytest.param(8, marks=pytest.mark.slow), 6])
def test_restores_owned_for_the_step_and_continues(saved, n):
  """state_target gives owned targets for this N; training on from the restored
  state equals training on from the saved state handed over whole."""
  path, state = saved
  m = mesh(n)
  _, step = _train(state, m, 2, 0)
  params_t, opt_t, _ = step.state_target(*jax.tree.map(np.asarray, wus.unshard(state)),
                                         _batch(2, m))
  restored = ocp.StandardCheckpointer().restore(path, {"params": params_t, "opt_state": opt_t})
  got = (restored["params"], restored["opt_state"])
  owned = _owned(got[1])
  assert owned and all(x.format.num_shards == n and x.mesh == m for x in owned)
  assert_trees_equal(wus.unshard(got[1]), wus.unshard(state[1]))
  on_m = jax.device_put(jax.tree.map(np.asarray, wus.unshard(state)), NamedSharding(m, P()))
  assert_trees_equal(wus.unshard(_train(got, m, 2, 2)[0]), wus.unshard(_train(on_m, m, 2, 2)[0]))


def test_part_of_a_bank_is_refused(saved, tmp_path):
  """A bank's members are whole only together: saving one alone says so."""
  _, state = saved
  with pytest.raises(ValueError, match="Pass the whole optimizer state together"):
    wus.checkpointable({"one": _owned(state[1])[0]})
