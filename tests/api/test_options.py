"""Options are validated once, when a front end makes the step (issue 31 item 1): a bad
option raises ValueError at `wus.shard_map(...)`, `wus.pmap(...)`, `wus.jit(...)` and
their adapters, before any call, also for a step that would run unchanged."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import wus
from helpers import mesh


def _step(w, x):
  return w - 0.1 * lax.pmean(x.mean() * w, "data")


def _global_step(w, x):
  return w - 0.1 * jax.grad(lambda w: (x @ w).sum())(w)


FRONT_ENDS = {
    "shard_map": lambda **o: wus.shard_map(_step, mesh=mesh(8), in_specs=(P(), P("data")),
                                           out_specs=P(), **o),
    "shard_map decorator": lambda **o: wus.shard_map(out_specs=P(), in_specs=(P(), P("data")),
                                                     **o),
    "pmap": lambda **o: wus.pmap(_step, axis_name="data", in_axes=(None, 0), **o),
    "jit": lambda **o: wus.jit(_global_step, **o),
    "jit decorator": lambda **o: wus.jit(**o)(_global_step),
    "filter_jit": lambda **o: wus.filter_jit(_global_step, **o),
    "nnx_jit": lambda **o: wus.nnx_jit(_global_step, **o),
}


@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_unknown_objective_raises_when_the_step_is_made(front_end):
  with pytest.raises(ValueError, match=r"objective='fast': pass one of \['memory', 'time'\]"):
    FRONT_ENDS[front_end](objective="fast")


@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_negative_min_shard_size_raises_when_the_step_is_made(front_end):
  with pytest.raises(ValueError, match="min_shard_size=-1 must be at least 0"):
    FRONT_ENDS[front_end](min_shard_size=-1)


@pytest.mark.parametrize("front_end", ["shard_map", "shard_map decorator", "pmap"])
def test_bad_group_size_raises_when_the_step_is_made(front_end):
  with pytest.raises(ValueError, match="shard_group_size"):
    FRONT_ENDS[front_end](shard_group_size=0)


@pytest.mark.parametrize("front_end", ["jit", "jit decorator", "filter_jit", "nnx_jit"])
def test_valid_options_make_a_step_that_runs_like_the_unmodified_one(front_end):
  """The same options, valid, make a step (the check refuses only what it should) that
  gives the unmodified step's result (run unchanged: no batch split)."""
  step = FRONT_ENDS[front_end](objective="time", min_shard_size=0)
  w, x = jnp.arange(8.0), jnp.ones((8, 8))
  assert jnp.array_equal(step(w, x), jax.jit(_global_step)(w, x))
