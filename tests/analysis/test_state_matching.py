"""Which outputs are the next value of which inputs (the step's state), for the
shapes steps really return. A missed pair leaves the optimizer state whole; a
user-program sweep found these returned shapes and calling conventions missed."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.example_libraries import optimizers
from jax.sharding import NamedSharding, PartitionSpec as P

import wus
from helpers import assert_trees_equal, mesh, sharded_leaves

N = 8
TX = optax.adam(1e-2)


def _params():
  r = np.random.RandomState(0)
  return {"w1": jnp.asarray(0.1 * r.randn(16, 64), jnp.float32),
          "w2": jnp.asarray(0.1 * r.randn(64, 4), jnp.float32)}


def _loss(p, x, y):
  return jnp.mean((jax.nn.relu(x @ p["w1"]) @ p["w2"] - y) ** 2)


def _batches(per_device_axis=False, steps=2):
  r = np.random.RandomState(1)
  shape = (N, 2) if per_device_axis else (2 * N,)
  return [(r.randn(*shape, 16).astype(np.float32), r.randn(*shape, 4).astype(np.float32))
          for _ in range(steps)]


def _adam_state_sharded(opt_state) -> bool:
  return len(sharded_leaves(opt_state)) == 4  # mu and nu of w1 and w2.


def test_pmap_step_called_with_keyword_arguments():
  """`step(params=p, opt_state=o, x=x, y=y)`: jax.pmap's keywords, the state
  found among them (wus.pmap passes them as one dict)."""
  def train_step(params, opt_state, x, y):
    loss, grads = jax.value_and_grad(_loss)(params, x, y)
    grads = lax.pmean(grads, "batch")
    updates, opt_state = TX.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, lax.pmean(loss, "batch")

  params = _params()
  state = jax.tree.map(lambda x: jnp.broadcast_to(x, (N, *x.shape)), (params, TX.init(params)))
  ref, ws = jax.pmap(train_step, axis_name="batch"), wus.pmap(train_step, axis_name="batch")
  a = b = state
  for x, y in _batches(per_device_axis=True):
    a = ref(params=a[0], opt_state=a[1], x=x, y=y)[:2]
    b = ws(params=b[0], opt_state=b[1], x=x, y=y)[:2]
  assert _adam_state_sharded(b[1])
  assert_trees_equal(a, wus.unshard(b))


def test_example_libraries_step_returns_the_optimizer_state_alone():
  """JAX's examples/mnist_classifier.py: `return opt_update(i, g, opt_state)`."""
  opt_init, opt_update, get_params = optimizers.adam(1e-2)

  def update(i, opt_state, batch):
    params = get_params(opt_state)
    grads = lax.pmean(jax.grad(_loss)(params, *batch), "data")
    return opt_update(i, grads, opt_state)

  kw = dict(mesh=mesh(N), in_specs=(P(), P(), P("data")), out_specs=P())
  ref, ws = jax.jit(jax.shard_map(update, **kw)), wus.shard_map(update, **kw)
  a = b = opt_init(_params())
  data = NamedSharding(mesh(N), P("data"))
  for i, batch in enumerate(_batches()):
    batch = jax.device_put(batch, data)
    a, b = ref(i, a, batch), ws(i, b, batch)
  assert len(sharded_leaves(b)) == 4  # m and v of w1 and w2; the weights are read whole.
  assert_trees_equal(a, wus.unshard(b))


def test_state_tuple_in_state_tuple_out():
  """`step(state, batch) -> (new_params, new_opt_state)` with state = (params, opt_state)."""
  def step(state, batch):
    params, opt_state = state
    grads = lax.pmean(jax.grad(_loss)(params, *batch), "data")
    updates, opt_state = TX.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  kw = dict(mesh=mesh(N), in_specs=(P(), P("data")), out_specs=P())
  ref, ws = jax.jit(jax.shard_map(step, **kw)), wus.shard_map(step, **kw)
  params = _params()
  a = b = (params, TX.init(params))
  data = NamedSharding(mesh(N), P("data"))
  for batch in _batches():
    batch = jax.device_put(batch, data)
    a, b = ref(a, batch), ws(b, batch)
  assert _adam_state_sharded(b[1])
  assert_trees_equal(a, wus.unshard(b))


def test_dict_of_state_and_metrics_from_separate_arguments():
  """`step(params, opt_state, batch) -> {"params": ..., "opt_state": ..., "loss": ...}`."""
  def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(_loss)(params, *batch)
    grads = lax.pmean(grads, "data")
    updates, opt_state = TX.update(grads, opt_state, params)
    return {"params": optax.apply_updates(params, updates), "opt_state": opt_state,
            "loss": lax.pmean(loss, "data")}

  kw = dict(mesh=mesh(N), in_specs=(P(), P(), P("data")), out_specs=P())
  ref, ws = jax.jit(jax.shard_map(step, **kw)), wus.shard_map(step, **kw)
  params = _params()
  a = b = {"params": params, "opt_state": TX.init(params)}
  data = NamedSharding(mesh(N), P("data"))
  for batch in _batches():
    batch = jax.device_put(batch, data)
    a, b = ref(a["params"], a["opt_state"], batch), ws(b["params"], b["opt_state"], batch)
  assert _adam_state_sharded(b["opt_state"])
  assert_trees_equal(a, wus.unshard(b))


def test_state_the_update_reads_and_returns_unchanged_stays_sharded():
  """optax.contrib.prodigy keeps `params0`, the initial weights, for its distance
  estimate: only the update reads it and it is returned as it came."""
  from optax import contrib  # noqa: PLC0415
  tx = contrib.prodigy(1.0)

  def step(params, opt_state, batch):
    grads = lax.pmean(jax.grad(_loss)(params, *batch), "data")
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  kw = dict(mesh=mesh(N), in_specs=(P(), P(), P("data")), out_specs=P())
  ref, ws = jax.jit(jax.shard_map(step, **kw)), wus.shard_map(step, **kw)
  params = _params()
  a = b = (params, tx.init(params))
  data = NamedSharding(mesh(N), P("data"))
  for batch in _batches(steps=3):
    batch = jax.device_put(batch, data)
    a, b = ref(*a, batch), ws(*b, batch)
  assert all(isinstance(x, wus.ShardedArray) for x in b[1].params0.values())
  assert_trees_equal(a, wus.unshard(b), rtol=1e-5, atol=1e-6)  # Its sums, in another order.


def test_state_read_by_two_sharded_updates_stays_sharded():
  """Sophia-style: the step reads the Hessian EMA `nu` (with the gradient's
  momentum) and refreshes it from a Hutchinson estimate z * Hz whose
  all-reduce is a second cluster's; both run on shards, so `nu` stays sharded."""
  z = {"w1": jnp.sign(jnp.sin(jnp.arange(16 * 64.0))).reshape(16, 64),
       "w2": jnp.sign(jnp.cos(jnp.arange(64 * 4.0))).reshape(64, 4)}

  def step(params, state, batch):
    def objective(p):
      return lax.pmean(_loss(p, *batch), "data")
    grads = jax.grad(objective)(params)
    hz = jax.tree.map(jnp.multiply, z, jax.jvp(jax.grad(objective), (params,), (z,))[1])
    mu = jax.tree.map(lambda m, g: 0.9 * m + 0.1 * g, state["mu"], grads)
    nu = jax.tree.map(lambda n, h: 0.99 * n + 0.01 * h, state["nu"], hz)
    updates = jax.tree.map(lambda m, n: -1e-2 * m / jnp.maximum(n, 1e-8), mu, state["nu"])
    return jax.tree.map(jnp.add, params, updates), {"mu": mu, "nu": nu}

  kw = dict(mesh=mesh(N), in_specs=(P(), P(), P("data")), out_specs=P())
  ref, ws = jax.jit(jax.shard_map(step, **kw)), wus.shard_map(step, **kw)
  params = _params()
  a = b = (params, {"mu": jax.tree.map(jnp.zeros_like, params),
                    "nu": jax.tree.map(jnp.ones_like, params)})
  data = NamedSharding(mesh(N), P("data"))
  for batch in _batches(steps=3):
    batch = jax.device_put(batch, data)
    a, b = ref(*a, batch), ws(*b, batch)
  assert len(sharded_leaves(b[1])) == 4, str(ws.plan(*a, batch))
  assert_trees_equal(a, wus.unshard(b))


# --- Position and name decide, not tree structure alone (issue 19, bugs 1 and 2). -------------
# Params, momentum and an EMA of the params share one tree structure: a match by
# structure alone paired the momentum's input with the params' output, so the
# step returned the new params as shards and the momentum whole, while the Plan
# said the momentum was kept sharded.

def _nf_loss(params, x, y):
  """An nfnets-style forward pass: bfloat16 compute on float32 weights."""
  p = jax.tree.map(lambda w: w.astype(jnp.bfloat16), params)
  h = jax.nn.relu(x.astype(jnp.bfloat16) @ p["w1"] + p["b1"])
  return jnp.mean(((h @ p["w2"]).astype(jnp.float32) - y) ** 2)


def _nf_params():
  r = np.random.RandomState(0)
  return {"w1": jnp.asarray(0.1 * r.randn(16, 64), jnp.float32), "b1": jnp.zeros((64,)),
          "w2": jnp.asarray(0.1 * r.randn(64, 4), jnp.float32)}


def _momentum_sgd(params, mom, x, y):
  loss, grads = jax.value_and_grad(_nf_loss)(params, x, y)
  grads = lax.psum(grads, "i")
  mom = jax.tree.map(lambda m, g: 0.9 * m + g, mom, grads)
  return jax.tree.map(lambda p, m: p - 1e-2 * m, params, mom), mom, lax.pmean(loss, "i")


def nfnets_step(params, mom, ema_params, x, y):
  params, mom, loss = _momentum_sgd(params, mom, x, y)
  ema_params = jax.tree.map(lambda e, p: 0.99 * e + 0.01 * p, ema_params, params)
  return params, mom, ema_params, loss


def _sharded_outputs(out) -> set[str]:
  flat = jax.tree_util.tree_flatten_with_path(out, is_leaf=wus.sharded.is_sharded)[0]
  return {jax.tree_util.keystr(p) for p, x in flat if isinstance(x, wus.ShardedArray)}


def _run_as_planned(step, state: dict, sharded: set[str], keywords: bool = True) -> list:
  """Runs `jax.pmap(step)` and `wus.pmap(step)` for 3 steps from `state` (the
  names of the step's first parameters -> per-device copies), each output fed
  back as the next value of its input; asserts that on every call the wus step
  returns sharded the outputs `sharded` (paths), exactly what its Plan for that
  call's arguments says, and jax.pmap's results bit for bit. Returns the Plans."""
  ref, ws = jax.pmap(step, axis_name="i"), wus.pmap(step, axis_name="i")
  plans, a, b = [], state, state
  for x, y in _batches(per_device_axis=True, steps=3):
    call = ((lambda f, s: f(**s, x=x, y=y)) if keywords else
            (lambda f, s: f(*s.values(), x, y)))
    plan = call(ws.plan, b)
    out_a, out_b = call(ref, a), call(ws, b)
    names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(
        out_b, is_leaf=wus.sharded.is_sharded)[0]]
    returned = {names[k] for k in plan.rewrite.sharded_out}
    assert _sharded_outputs(out_b) == returned == sharded, str(plan)
    assert_trees_equal(out_a, wus.unshard(out_b))
    plans.append(plan)
    a, b = ({k: o[k] if isinstance(o, dict) else o[j] for j, k in enumerate(state)}
            for o in (out_a, out_b))
  return plans


def _state(ema: bool = False) -> dict:
  params = jax.tree.map(lambda x: jnp.broadcast_to(x, (N, *x.shape)), _nf_params())
  return {"params": params, "mom": jax.tree.map(jnp.zeros_like, params),
          **({"ema_params": params} if ema else {})}


def _names(arg: str, keys=("b1", "w1", "w2")) -> set[str]:
  return {f"{arg}['{k}']" for k in keys}


def test_nfnets_step_with_ema_called_with_keywords_returns_what_its_plan_says():
  """Bug 1: `step(params=..., mom=..., ema_params=..., x=..., y=...)`: the keywords
  stand for the parameters at their positions, so output 1 is the momentum's
  next value and output 2 the EMA's. Both stay sharded on every call, the Plan
  says so on every call, and the results are jax.pmap's bit for bit."""
  plans = _run_as_planned(nfnets_step, _state(ema=True), _names("[1]") | _names("[2]"))
  for plan in plans:
    assert all(c.sharded for c in plan.clusters), str(plan)
    assert {i.name for i in plan.inputs if i.sharded} == (
        _names("mom") | _names("ema_params")), str(plan)
  mom = next(i for i in plans[0].inputs if i.name == "mom['w1']")
  assert mom.matched == "next value [1]['w1'] (by position)"
  assert str(plans[1]) == str(plans[2])  # One steady-state Plan.


def test_momentum_of_the_params_structure_comes_back_sharded_called_with_keywords():
  """Bug 2: `(params, mom) -> (params, mom)` called with keywords (sorted, the
  momentum comes first): the momentum, not the params, is returned sharded."""
  def step(params, mom, x, y):
    return _momentum_sgd(params, mom, x, y)[:2]

  for plan in _run_as_planned(step, _state(), _names("[1]")):
    assert {i.name for i in plan.inputs if i.sharded} == _names("mom"), str(plan)


def test_jaxline_style_dict_output_matched_by_name():
  """`step(params, mom, x, y) -> {"params": ..., "mom": ...}`: the dict keys name
  the parameters whose next values they are, and the Plan says so."""
  def step(params, mom, x, y):
    params, mom, _ = _momentum_sgd(params, mom, x, y)
    return {"params": params, "mom": mom}

  plans = _run_as_planned(step, _state(), _names("['mom']"), keywords=False)
  for plan in plans:
    assert {i.name for i in plan.inputs if i.sharded} == _names("mom"), str(plan)
  inputs = {i.name: i.matched for i in plans[0].inputs}
  assert inputs["mom['w1']"] == "next value ['mom']['w1'] (by name 'mom')"
  assert inputs["params['w1']"] == "next value ['params']['w1'] (by name 'params')"


def test_state_no_rule_can_match_stays_whole_and_the_plan_says_why():
  """`step((params, mom), batch) -> {"a": ..., "b": ...}`: neither position nor name
  says which of two outputs of the params' structure is the momentum's next
  value. Nothing is paired by a guess: the momentum stays whole, and the Plan
  names the outputs that made it ambiguous."""
  def step(state, batch):
    params, mom = state
    grads = lax.pmean(jax.grad(_loss)(params, *batch), "data")
    mom = jax.tree.map(lambda m, g: 0.9 * m + g, mom, grads)
    return {"a": jax.tree.map(lambda p, m: p - 1e-2 * m, params, mom), "b": mom}

  kw = dict(mesh=mesh(N), in_specs=(P(), P("data")), out_specs=P())
  ref, ws = jax.jit(jax.shard_map(step, **kw)), wus.shard_map(step, **kw)
  params = _params()
  a = b = (params, jax.tree.map(jnp.zeros_like, params))
  for batch in _batches():
    batch = jax.device_put(batch, NamedSharding(mesh(N), P("data")))
    out_a, out_b = ref(a, batch), ws(b, batch)
    a, b = (out_a["a"], out_a["b"]), (out_b["a"], out_b["b"])
  assert_trees_equal(a, wus.unshard(b))
  assert not sharded_leaves(b)
  plan = ws.plan(b, batch)
  mom = next(i for i in plan.inputs if i.name == "state[1]['w1']")
  assert not mom.sharded and not mom.state
  assert mom.matched.startswith("no next value") and "['a'], ['b']" in mom.matched, str(plan)
