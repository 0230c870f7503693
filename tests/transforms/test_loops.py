"""A training loop inside the step (§4.2, Fig. 4): state sharded across iterations."""

import math
import re

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import PartitionSpec as P

import wus
from helpers import (LOOP_STEPS as K, assert_trees_equal, collective_shapes, hlo_computations,
                     loop_bodies, loop_setup, loop_xs, loss_fn, make_params, mesh, sharded_leaves,
                     shape_bytes)
from wus.analysis import reasons


def collective_bytes(lines, kind: str) -> list[int]:
  """Result bytes of each `kind` instruction (e.g. "all-gather") among HLO lines."""
  return [shape_bytes(s) for s in collective_shapes(lines, kind)]


FORMS = ["scan", "fori", "while"]
# N = 8, and N = 6: not a power of two; the [3,3,5,7], [1024,1024] and
# [16,1024] weights all need padding at N = 6 ([3,3,5,7] at N = 8 too).
REPLICAS = pytest.mark.parametrize("n", [8, 6])


_LOOP_TX = {"adam": (lambda: optax.adam(1e-2), {}),
            "lars": (lambda: optax.lars(0.1), dict(rtol=2e-6, atol=1e-7))}
# By default N = 6 (every weight padded): Adam in a while_loop, LARS (a norm) in a
# fori_loop. Every other form, optimizer and N is opt-in (--slow; up to 70 s each loaded).
_LOOP_DEFAULT = {("while", "adam", 6), ("fori", "lars", 6)}


@pytest.mark.parametrize("form,name,n", [
    pytest.param(form, name, n, id=f"{name}-{form}-{n}",
                 marks=() if (form, name, n) in _LOOP_DEFAULT else pytest.mark.slow)
    for n in (8, 6) for form in FORMS for name in _LOOP_TX])
def test_loop_matches_unmodified_and_keeps_state_sharded(form, name, n):
  make_tx, tol = _LOOP_TX[name]
  params, state, xs, ref, ws = loop_setup(mesh(n), make_tx(), form)
  a, b = (params, state), (params, state)
  for _ in range(2):  # Two calls: state stays sharded between them too.
    a, b = ref(*a, xs)[:2], ws(*b, xs)[:2]
  assert_trees_equal(a[0], b[0], **tol)
  assert_trees_equal(a[1], wus.unshard(b[1]), **tol)
  leaves = sharded_leaves(b[1])
  assert len(leaves) >= 4 and all(x.format.num_shards == n for x in leaves)  # Per big weight.


def test_optimizer_state_gathered_after_the_loop_only():
  """Fig. 4 left: in the loop, only the weights are all-gathered; state after it."""
  params, state, xs, ref, ws = loop_setup(mesh(8), optax.adam(1e-2), "scan", wrap_state=True)
  out_ref, out = ref(params, state, xs), ws(params, state, xs)
  assert_trees_equal(out_ref[1], out[1])  # Returned whole: gathered after the loop.
  hlo = ws.lower(params, state, xs).compile().as_text()
  comps, bodies = hlo_computations(hlo), loop_bodies(hlo)
  inside = [n for name in bodies for n in collective_bytes(comps.get(name, []), "all-gather")]
  outside = [n for name in comps if name not in bodies
             for n in collective_bytes(comps[name], "all-gather")]
  big = 1024 * 1024 * 4
  assert sorted(inside)[-1] == big and inside.count(big) == 1  # The weight, once per step.
  assert outside.count(big) == 2  # mu and nu of `big`, once per call.


def _mixed_precision_loss(params, x):
  """The forward pass reads every weight converted to bfloat16 (Fig. 7)."""
  p = jax.tree.map(lambda w: w.astype(jnp.bfloat16), params)
  h = jnp.tanh(x.astype(jnp.bfloat16) @ p["w"]).astype(jnp.float32)
  return jnp.mean(h) + jnp.sum(jnp.sin(p["conv"].astype(jnp.float32) * jnp.tanh(x).mean()))


@REPLICAS
@pytest.mark.parametrize("make_tx,tol", [
    pytest.param(lambda: optax.adam(1e-2), {}, id="adam"),
    # LARS reads ‖w‖: its reduction runs on the shard of w (§4.1), so the
    # forward pass's bf16 convert stays the only whole reader of w.
    pytest.param(lambda: optax.lars(0.1), dict(rtol=2e-6, atol=1e-7), id="lars"),
])
def test_weights_sharded_across_iterations_and_gathered_in_bfloat16(n, make_tx, tol):
  """Fig. 4 right + Fig. 7: the weight stays sharded in the loop; its gather moves bf16."""
  tx = make_tx()

  def train(params, opt_state, xs):
    def body(c, x):
      p, s = c
      g = jax.lax.pmean(jax.grad(_mixed_precision_loss)(p, x), "data")
      u, s = tx.update(g, s, p)
      return (optax.apply_updates(p, u), s), None
    return jax.lax.scan(body, (params, opt_state), xs)[0]

  params = {"w": 0.1 * jax.random.normal(jax.random.key(1), (16, 1024)),
            "conv": 0.1 * jax.random.normal(jax.random.key(2), (3, 3, 5, 7))}
  state, xs = tx.init(params), loop_xs(mesh(n))
  kw = dict(mesh=mesh(n), in_specs=(P(), P(), P(None, "data")), out_specs=(P(), P()))
  ref, ws = jax.jit(jax.shard_map(train, **kw)), wus.shard_map(train, **kw)
  a, b = ref(params, state, xs), ws(params, state, xs)
  assert_trees_equal(a[0], b[0], **tol)  # Weights come back whole ...
  assert_trees_equal(a[1], wus.unshard(b[1]), **tol)  # ... optimizer state sharded.
  plan = ws.plan(params, state, xs)
  # Fig. 4 right: each weight gathered narrow, half its float32 bytes, before the forward pass.
  gathers = [g for c in plan.clusters if c.sharded for note in c.why.notes
             if isinstance(note, reasons.LoopGathers) for g in note.gathers]
  assert sorted(g.name for g in gathers) == ["params['conv']", "params['w']"], plan
  assert all(g.narrow and g.dtype == "bfloat16" and 2 * g.nbytes == g.whole_bytes
             for g in gathers), gathers
  # The compiled program gathers w in 16 bits inside the loop (its bf16 bits,
  # which XLA cannot widen back to f32), and once in f32 after it, batched
  # with conv (§5.2): [16384] at N = 8, padded to a multiple of N at N = 6.
  fmt, = {x.format for x in sharded_leaves(b[1]) if x.format.shape == (16, 1024)}
  padded = ",".join(map(str, fmt.padded_shape))
  hlo = ws.lower(params, state, xs).compile().as_text()
  comps, bodies = hlo_computations(hlo), loop_bodies(hlo)
  gathers = {where: [re.match(r"\s*%\S+ = (\S+) all-gather", line).group(1)
                     for name in comps if (name in bodies) == (where == "loop")
                     for line in comps[name] if " all-gather(" in line]
             for where in ("loop", "after")}
  size = math.prod(fmt.padded_shape)

  def elements(where, dtype):
    return [math.prod(map(int, re.match(rf"{dtype}\[([\d,]+)\]", g).group(1).split(",")))
            for g in gathers[where] if g.startswith(f"{dtype}[")]
  # In the loop, one 16-bit gather holds w and conv (§5.2).
  assert len(gathers["loop"]) == 1 and elements("loop", "u16")[0] >= size, gathers
  assert any(n >= size for n in elements("after", "f32")), gathers


@REPLICAS
def test_conditional_on_the_loop_counter_gathers_inside_its_branch(n):
  """§3.2: a summary of the full state every 2 steps pays its gather in its branch."""
  tx = optax.adam(1e-2)

  def train(params, opt_state, xs):
    def body(i, c):
      p, s, summary = c
      g = jax.lax.pmean(jax.grad(loss_fn)(p, xs[i]), "data")
      u, s = tx.update(g, s, p)
      summary = jax.lax.cond(i % 2 == 1, lambda s: jnp.sort(s[0].mu["big"].ravel())[-4:],
                             lambda s: summary, s)  # sort: no shard rule, reads mu whole.
      return optax.apply_updates(p, u), s, summary
    return jax.lax.fori_loop(0, K, body, (params, opt_state, jnp.zeros(4)))

  params = make_params()
  state, xs = tx.init(params), loop_xs(mesh(n))
  kw = dict(mesh=mesh(n), in_specs=(P(), P(), P(None, "data")), out_specs=(P(), P(), P()))
  ref, ws = jax.jit(jax.shard_map(train, **kw)), wus.shard_map(train, **kw)
  a, b = ref(params, state, xs), ws(params, state, xs)
  assert_trees_equal(a[0], b[0])
  assert_trees_equal(a[1], wus.unshard(b[1]))
  assert_trees_equal(a[2], b[2])
  plan = ws.plan(params, state, xs)
  # The one conditional on the counter, at its own line, noted on the cluster of `big` (whose
  # mu it reads); that cluster still runs on shards.
  rare = [(c, note) for c in plan.clusters for note in c.why.notes
          if isinstance(note, reasons.RareConditionals)]
  ((c, note),) = rare
  cond_line = train.__code__.co_firstlineno + 5  # Its jax.lax.cond.
  assert c.sharded and "opt_state[0].mu['big']" in {t.name for t in c.tensors}, c.why
  (line,) = note.lines
  assert f"test_loops.py:{cond_line}:" in line and line.endswith(".<locals>.body)"), line
  hlo = ws.lower(params, state, xs).compile().as_text()
  comps, bodies = hlo_computations(hlo), loop_bodies(hlo)
  big = 4 * math.prod(b[1][0].mu["big"].format.padded_shape)  # 4 MiB at N = 8, padded at 6.
  in_body = [n for name in bodies for n in collective_bytes(comps[name], "all-gather")]
  elsewhere = [n for name in comps if name not in bodies
               for n in collective_bytes(comps[name], "all-gather")]
  assert in_body.count(big) == 1  # The weight, every step.
  assert elsewhere.count(big) == 1  # mu, in the branch taken every other step.
