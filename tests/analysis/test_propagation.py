"""`analysis.propagation`: the batch's splits carried from the placements through a step's
jaxpr, one trace, GSPMD's semantics (issue 37 item 1)."""

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from wus.analysis import propagation
from wus.transforms.inline import inlined

SIZES = {"data": 4, "fsdp": 2, "one": 1}
D = ("data",)
MESH = jax.make_mesh(tuple(SIZES.values()), tuple(SIZES),
                     axis_types=(jax.sharding.AxisType.Auto,) * len(SIZES))


def _splits(f, *args, seeds=(), state=()):
  """The splits of `f`'s jaxpr; its k-th input seeded with `seeds[k]` (a per-dim tuple),
  the inputs at positions `state` the step's state."""
  with jax.set_mesh(MESH):
    jaxpr = jax.make_jaxpr(f)(*args).jaxpr
  given = {jaxpr.invars[k]: s for k, s in enumerate(seeds) if s}
  out = propagation.batch_splits(jaxpr, given, frozenset(jaxpr.invars[k] for k in state), SIZES)
  return jaxpr, out


def _loss(w, x):
  return jnp.mean(jnp.tanh(x @ w) ** 2)


def test_the_gradient_of_a_batch_split_loss_is_summed_whole():
  w, x = jnp.ones((6, 3)), jnp.ones((8, 6))
  jaxpr, out = _splits(jax.grad(_loss), w, x, seeds=[None, (D, None)], state=[0])
  assert out.get(jaxpr.outvars[0]) is None  # The gradient: whole.
  dots = [e for e in jaxpr.eqns if e.primitive is lax.dot_general_p]
  assert out[dots[0].outvars[0]] == (D, None)  # The activations keep the batch's split.
  last = dots[-1]  # x^T @ dh: contracts the batch, a gradient sum.
  assert propagation.is_sum(last, [out.get(v) for v in last.invars], lambda v: False)


def test_a_slice_to_a_configured_micro_batch_keeps_the_split_only_where_it_is_whole():
  w, x = jnp.ones((6, 3)), jnp.ones((8, 6))
  for n, split in ((8, (D, None)), (4, (None, None))):
    jaxpr, out = _splits(lambda w, x, n=n: jnp.tanh(lax.slice_in_dim(x, 0, n) @ w), w, x,
                         seeds=[None, (D, None)], state=[0])
    assert out.get(jaxpr.outvars[0]) == split, n  # A real slice of the batch: not known.


def test_a_constraint_splits_a_replicated_batch_and_lays_out_no_weight():
  """pjit-era code: the batch enters whole and a constraint splits it; a constraint on a
  weight (FSDP), on its gradient (AD's transpose of it) or on zeros lays out a block."""
  def step(w, x):
    x = lax.with_sharding_constraint(x, P(("data", "one"), None))
    w = lax.with_sharding_constraint(w, P("fsdp", None))
    acc = lax.with_sharding_constraint(jnp.zeros_like(w), P("fsdp", None))
    return acc + jax.grad(_loss)(w, x)
  jaxpr, out = _splits(step, jnp.ones((6, 3)), jnp.ones((8, 6)), state=[0])
  constraints = [e for e in jaxpr.eqns if e.primitive is lax.sharding_constraint_p]
  assert out[constraints[0].outvars[0]] == (D, None)
  assert all(out.get(e.outvars[0]) is None for e in constraints[1:])
  assert out.get(jaxpr.outvars[0]) is None
  assert propagation.batch_axes(out, SIZES) == {"data"}


def test_a_reshape_keeps_the_batch_split_on_the_major_factor():
  def f(tokens, emb):
    flat = tokens.reshape(-1)  # [B * T]
    h = emb[flat]              # [B * T, E]
    return h.reshape(tokens.shape + (emb.shape[1],))
  jaxpr, out = _splits(f, jnp.ones((8, 5), jnp.int32), jnp.ones((16, 3)),
                       seeds=[(D, None)], state=[1])
  assert out[jaxpr.outvars[0]] == (D, None, None)


def test_gradient_accumulation_in_a_scan_sums_each_micro_batch():
  """The micro-batches' gradients are summed in the loop: its carry stays whole."""
  def step(w, x):
    micro = x.reshape(2, 4, 6)
    micro = lax.with_sharding_constraint(micro, P(None, "data", None))

    def body(acc, xb):
      return acc + jax.grad(_loss)(w, xb), None
    return lax.scan(body, jnp.zeros_like(w), micro)[0]
  jaxpr, out = _splits(step, jnp.ones((6, 3)), jnp.ones((8, 6)), seeds=[None, (D, None)],
                       state=[0])
  assert out.get(jaxpr.outvars[0]) is None


def test_a_split_no_rule_follows_leaves_the_result_not_whole():
  jaxpr, out = _splits(lambda x: jnp.cumsum(x, axis=0) + jnp.linalg.qr(x)[0], jnp.ones((8, 8)),
                       seeds=[(D, None)])
  assert out[jaxpr.outvars[0]] == (None, None)  # Present: not whole.
  jaxpr, out = _splits(lambda x: jnp.cumsum(x, axis=1), jnp.ones((8, 8)), seeds=[(D, None)])
  assert out[jaxpr.outvars[0]] == (D, None)  # Along another dim: the split passes.


def test_a_reshape_moves_the_batch_to_the_first_dim_its_axes_divide():
  """Micro-batches as a leading dim (`x.reshape(2, -1)`) of a batch over 4: the split
  moves to the rows; where no dim of the group divides, the split is not known."""
  jaxpr, out = _splits(lambda x: x.reshape(2, -1, 3) * 2.0, jnp.ones((8, 3)),
                       seeds=[(D, None)])
  assert out[jaxpr.outvars[0]] == (None, D, None)
  jaxpr, out = _splits(lambda x: x.reshape(2, 2, 6) * 2.0, jnp.ones((8, 3)), seeds=[(D, None)])
  assert out[jaxpr.outvars[0]] == (None, None, None)


def test_where_the_split_ends_names_the_first_equation_without_a_rule():
  """An FFT has no dims rule: the split ends there (its result unknown), and everything
  after it follows. Before it, an equation with a rule carries the split."""
  def f(w, x):
    spectrum = lax.fft(jnp.tanh(x).astype(jnp.complex64), lax.FftType.FFT, (6,))
    return jnp.mean((spectrum.real @ w) ** 2)
  w, x = jnp.ones((6, 3)), jnp.ones((8, 6))
  jaxpr, out = _splits(inlined(jax.make_jaxpr(jax.grad(f))(w, x)), w, x, seeds=[None, (D, None)],
                       state=[0])
  lost = propagation.where_lost(jaxpr, out)
  assert lost is not None and lost.primitive.name == "fft", lost
  assert out[lost.invars[0]] == (D, None)  # tanh carried it.
  jaxpr, fine = _splits(jax.grad(_loss), w, x, seeds=[None, (D, None)], state=[0])
  assert propagation.where_lost(jaxpr, fine) is None
