"""What a step saves, said without being asked (issue 39): a step that runs unchanged or keeps
most of its weight update whole warns once per compiled signature (`wus.NotShardedWarning`,
at the user's call, naming the fix); a served step does not; `wus.bytes_per_device` measures
a tree's bytes per device from its arrays' shards, against figures computed by hand."""

import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import wus
from helpers import assert_trees_equal, mesh
from wus.analysis import reasons, refusals
from wus.saving import not_sharded

TX = optax.adam(1e-2)


def loss_fn(params, batch):
  return jnp.mean((jnp.tanh(batch["x"] @ params["w"]) + params["b"] - batch["y"]) ** 2)


def train_step(params, opt_state, batch):
  """A global-view step, as `jax.jit` users write it."""
  loss, grads = jax.value_and_grad(loss_fn)(params, batch)
  updates, opt_state = TX.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss


def replica_step(params, opt_state, batch, axis="data"):
  """The same step per replica, as `jax.shard_map` users write it: the gradients pmean'd."""
  loss, grads = jax.value_and_grad(loss_fn)(params, batch)
  grads, loss = jax.lax.pmean((grads, loss), axis) if axis else (grads, loss)
  updates, opt_state = TX.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss


def _inputs(steps=2):
  rng = np.random.default_rng(0)
  params = {"w": jnp.asarray(0.1 * rng.normal(size=(16, 32)), jnp.float32),
            "b": jnp.zeros((32,), jnp.float32)}
  data = [{"x": rng.normal(size=(32, 16)).astype(np.float32),
           "y": rng.normal(size=(32, 32)).astype(np.float32)} for _ in range(steps)]
  return params, data


def _placed(data):
  return [jax.device_put(b, NamedSharding(mesh(8, "auto"), P("data"))) for b in data]


def _smap(axis):
  """`replica_step` under `wus.shard_map`; with `axis` None, without the pmean and without
  JAX's check_vma (whose AD would sum the gradients itself): no gradient all-reduce."""
  return wus.shard_map(functools.partial(replica_step, axis=axis), mesh=mesh(8, "auto"),
                       in_specs=(P(), P(), P("data")), out_specs=(P(), P(), P()),
                       check_vma=axis is not None)


class _Linear(nnx.Module):
  def __init__(self, rngs):
    self.w = nnx.Param(0.1 * jax.random.normal(rngs.params(), (16, 32)))
    self.b = nnx.Param(jnp.zeros((32,)))


def _nnx_step(model, optimizer, batch):
  loss, grads = nnx.value_and_grad(
      lambda m: loss_fn({"w": m.w[...], "b": m.b[...]}, batch))(model)
  optimizer.update(model, grads)
  return loss


def _nnx_call(step):
  model = _Linear(nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, TX, wrt=nnx.Param)
  return lambda batch: step(model, optimizer, batch)


@pytest.mark.parametrize("front_end,fix", [
    ("jit", r'runs unchanged: no argument is placed on a mesh of more than one device.*To fix: '
            r'place the batch over a mesh axis, e\.g\. batch = jax\.device_put\(batch, '
            r'NamedSharding\(mesh, P\("data"\)\)\)'),
    ("nnx_jit", r"wus\.nnx_jit\(_nnx_step\) runs unchanged: no argument is placed on a mesh"
                r".*place the batch over a mesh axis"),
    ("shard_map", r"shards nothing: the step has no gradient all-reduce over exactly "
                  r"\['data'\].*jax\.lax\.pmean\(grads, \"data\"\)"),
])
def test_a_step_that_shards_nothing_warns_once_at_the_users_call(front_end, fix):
  """The issue's first try: the batch left unplaced (or, per replica, the gradients not
  all-reduced). The warning names the cause and the fix, and how to silence it; the step
  runs as JAX runs it; the next call with the same signature says nothing more."""
  params, data = _inputs()
  if front_end == "jit":
    step = wus.jit(train_step)
    state = [params, TX.init(params)]
    call = lambda b: step(*state, b)  # noqa: E731
  elif front_end == "nnx_jit":
    call = _nnx_call(wus.nnx_jit(_nnx_step))
  else:
    step, state, data = _smap(None), [params, TX.init(params)], _placed(data)
    call = lambda b: step(*state, b)  # noqa: E731
  with pytest.warns(wus.NotShardedWarning, match=fix) as record:
    call(data[0])
  assert len(record) == 1 and record[0].filename == __file__, [str(w) for w in record]
  assert 'warnings.filterwarnings("ignore", category=wus.NotShardedWarning)' in str(
      record[0].message)
  with warnings.catch_warnings(record=True) as again:
    warnings.simplefilter("always")
    call(data[1])
  assert not [w for w in again if w.category is wus.NotShardedWarning], again


def test_the_documented_filter_silences_it():
  params, data = _inputs(1)
  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    warnings.filterwarnings("ignore", category=wus.NotShardedWarning)
    wus.jit(train_step)(params, TX.init(params), data[0])
  assert not [w for w in record if w.category is wus.NotShardedWarning]


@pytest.mark.parametrize("front_end", ["jit", "shard_map"])
def test_a_served_step_does_not_warn(front_end):
  """The batch placed over "data": sharded, no warning (warnings are errors here), the
  same losses as the unmodified step, and 1/8 of Adam's state per device, measured."""
  params, data = _inputs(3)
  data = _placed(data)
  if front_end == "jit":
    ref_step, step = jax.jit(train_step), wus.jit(train_step)
  else:
    ref_step = jax.jit(jax.shard_map(replica_step, mesh=mesh(8, "auto"),
                                     in_specs=(P(), P(), P("data")), out_specs=(P(), P(), P())))
    step = _smap("data")
  ref = out = (params, TX.init(params))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    for b in data:
      *ref, ref_loss = ref_step(*ref, b)
      *out, loss = step(*out, b)
      assert ref_loss == loss
  assert_trees_equal(ref, wus.unshard(out))
  measured = wus.bytes_per_device(out[1])
  assert measured.fraction <= 1.15 / 8 and wus.bytes_per_device(ref[1]).fraction == 1.0


def _plan():
  params, data = _inputs(1)
  return _smap("data").plan(params, TX.init(params), _placed(data)[0])


def test_what_saves_little_is_said_by_one_rule():
  """`not_sharded` on one Plan with its clusters' decisions changed: w's update (16 x 32)
  outweighs b's (32), so replicating w's cluster keeps most of the update whole, and
  replicating b's does not."""
  plan = _plan()
  assert not_sharded(plan) is None
  (w,) = [c for c in plan.clusters if any(t.name == "params['w']" for t in c.tensors)]
  (b,) = [c for c in plan.clusters if any(t.name == "params['b']" for t in c.tensors)]

  def replicated(*which):
    return dataclasses.replace(plan, clusters=tuple(
        dataclasses.replace(c, sharded=c not in which) for c in plan.clusters))
  assert not_sharded(replicated(b)) is None
  most = replicated(w)
  whole = most.replicated_bytes + most.sharded_bytes
  assert most.replicated_bytes == 3 * 16 * 32 * 4 and whole == most.replicated_bytes + 3 * 32 * 4
  assert not_sharded(most) == (
      f"keeps most of its weight update whole: 6 KiB of the {whole / 1024:.3g} KiB of weights "
      f"and optimizer state it updates are in replicated clusters (whole on every device); "
      f"the largest, cluster {w.index}: {reasons.render(w.why, cite=False)}")
  assert not_sharded(replicated(w, b)).startswith(
      f"shards none of its 2 weight-update cluster(s); cluster {w.index}: ")
  unchanged = dataclasses.replace(plan, unchanged=reasons.Reason(refusals.NoBatchSplit()))
  assert not_sharded(unchanged) == ("runs unchanged: no argument is split over a mesh axis as "
                                    "the batch (the state aside), nor laid out so by a sharding "
                                    "constraint in the step, so there is no data parallelism "
                                    "to shard the update over")


# --- wus.bytes_per_device. ---------------------------------------------------------------


def test_bytes_per_device_of_whole_and_split_arrays():
  m = mesh(8, "auto")
  x = jnp.zeros((16, 4), jnp.float32)  # 256 B.
  on_one = wus.bytes_per_device({"x": x})
  assert (on_one.per_device, on_one.whole, on_one.devices) == (256, 256, 1)
  replicated = wus.bytes_per_device([jax.device_put(x, NamedSharding(m, P()))])
  assert (replicated.per_device, replicated.whole, replicated.devices) == (256, 256, 8)
  split = wus.bytes_per_device(jax.device_put(x, NamedSharding(m, P("data"))))
  assert (split.per_device, split.whole, split.fraction) == (32, 256, 0.125)
  # A host value is copied whole to each device that reads it: counted on each.
  mixed = wus.bytes_per_device((jax.device_put(x, NamedSharding(m, P("data"))),
                                np.zeros(3, np.int32), 2.0))
  assert (mixed.per_device, mixed.whole) == (32 + 12 + 8, 256 + 12 + 8), mixed
  assert wus.bytes_per_device({}) == wus.DeviceBytes(0, 0, 0)
  assert repr(split) == "DeviceBytes(32 B per device of 256 B whole: 0.125 of a copy, on 8 " \
                        "device(s))"
  with pytest.raises(TypeError, match=r"tree\['a'\] is ShapeDtypeStruct"):
    wus.bytes_per_device({"a": jax.ShapeDtypeStruct((2,), jnp.float32)})


def test_bytes_per_device_of_sharded_state():
  """Adam's state after one wus step on 8 devices: mu and nu of w [16, 32] (512 elements:
  64 per device) and of b [32] (4 per device), float32, and the int32 count, whole on
  each device: (64 + 4) * 4 * 2 + 4 = 548 bytes against (512 + 32) * 4 * 2 + 4 = 4356."""
  params, data = _inputs(1)
  _, opt_state, _ = _smap("data")(params, TX.init(params), _placed(data)[0])
  assert len([x for x in jax.tree.leaves(opt_state, is_leaf=wus.is_sharded)
              if wus.is_sharded(x)]) == 4
  measured = wus.bytes_per_device(opt_state)
  assert (measured.per_device, measured.whole, measured.devices) == (548, 4356, 8), measured
  assert measured == wus.bytes_per_device(jax.tree.map(
      lambda x: x, opt_state, is_leaf=wus.is_sharded))
  # The Plan predicted the sharded part: 8 x 68 of the 4352 bytes.
  assert _plan().state_bytes == (4352, 544)
