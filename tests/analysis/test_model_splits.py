"""`analysis.model_splits`: which dims of an update's values a model axis splits, from the
placements of its inputs (wus.jit on a data x model mesh, issue 29 item 2)."""

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from wus.analysis import model_splits, refusals
from wus.analysis.reasons import Reason

SIZES = {"data": 4, "model": 2}


def _solve(f, *shapes, seeds):
  """The splits of `f`'s jaxpr on float32 inputs of `shapes`, its k-th input seeded with
  `seeds[k]` (a per-dim tuple of axis tuples, or None)."""
  jaxpr = jax.make_jaxpr(f)(*[jnp.zeros(s, jnp.float32) for s in shapes]).jaxpr
  eqns = list(enumerate(jaxpr.eqns))
  values = [*jaxpr.invars, *(v for e in jaxpr.eqns for v in e.outvars)]
  given = {v: s for v, s in zip(jaxpr.invars, seeds, strict=True) if s}
  return jaxpr, model_splits.solve(eqns, values, given, SIZES)


M = ("model",)


def test_an_adam_like_update_keeps_the_weights_split_and_sums_nothing():
  def update(w, g, mu):
    mu = 0.9 * mu + 0.1 * g
    return w - 0.01 * mu / (jnp.sqrt(mu * mu) + 1e-8), mu
  jaxpr, out = _solve(update, (8, 6), (8, 6), (8, 6), seeds=[(None, M), None, None])
  assert all(out.split(v) == (None, M) for v in jaxpr.outvars)
  assert out.split(jaxpr.invars[1]) == (None, M)  # The gradient: from the weight's class.
  assert not out.reduced


def test_a_global_norm_over_a_split_dim_is_a_partial_sum_over_model():
  def clip(g):
    return g / jnp.sqrt(jnp.sum(g * g))
  jaxpr, out = _solve(clip, (8, 6), seeds=[(M, None)])
  (reduce_at,) = [i for i, e in enumerate(jaxpr.eqns) if e.primitive is lax.reduce_sum_p]
  assert out.reduced == {reduce_at: M}
  assert out.split(jaxpr.outvars[0]) == (M, None)


def test_a_reshape_keeps_a_split_on_the_major_factor_and_needs_minor_dims_whole():
  """GSPMD's rule: a split of the dims a reshape merges or splits is on their major
  factor, the same run of whole rows on both sides."""
  jaxpr, out = _solve(lambda w: w.reshape(8, 3, 2) * 2.0, (8, 6), seeds=[(M, None)])
  assert out.split(jaxpr.outvars[0]) == (M, None, None)
  jaxpr, out = _solve(lambda w: w.reshape(48) * 2.0, (8, 6), seeds=[(M, None)])
  assert out.split(jaxpr.outvars[0]) == (M,)
  # Attention's projection to heads: [B, heads * head_dim] split over model -> heads.
  jaxpr, out = _solve(lambda w: w.reshape(16, 4, 16) * 2.0, (16, 64), seeds=[(None, M)])
  assert out.split(jaxpr.outvars[0]) == (None, M, None)
  _, why = _solve(lambda w: w.reshape(48) * 2.0, (8, 6), seeds=[(None, M)])
  _assert_refused(why, refusals.NeedsWhole("reshape", "", 1, "float32[8,6]", M, 0))
  assert str(why) == (f"reshape at {why.verdict.line} needs dim 1 of float32[8,6] whole, "
                      "which is split over ['model']")


def _assert_refused(why, verdict) -> None:
  """`why` is a Reason with `verdict` (its source line, if any, in this file)."""
  assert isinstance(why, Reason) and not why.notes, why
  line = getattr(why.verdict, "line", None)
  if line is not None:
    assert "test_model_splits.py:" in line, why
    verdict = dataclasses.replace(verdict, line=line)
  assert why.verdict == verdict, why


def test_conflicts_say_why():
  _, why = _solve(lambda a, b: a + b, (8, 8), (8, 8), seeds=[(M, None), (None, M)])
  _assert_refused(why, refusals.SplitTwice("float32[8,8]", (M, M)))
  assert str(why) == "a value float32[8,8] would be split twice over one axis ((('model',), " \
      "('model',)))"
  _, why = _solve(lambda a: a + jnp.arange(8.0)[:, None], (8, 8), seeds=[(M, None)])
  _assert_refused(why, refusals.NeedsWhole("iota", "", 0, "float32[8]", M, 0))
  _, why = _solve(lambda a: a * 2.0, (7, 8), seeds=[(M, None)])
  _assert_refused(why, refusals.Indivisible(7, "float32[7,8]", M))
  assert str(why) == ("a dim of 7 of float32[7,8] does not divide over ['model'], which its "
                      "placement splits it over")
