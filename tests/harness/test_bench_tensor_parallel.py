"""Tests of `wus-bench`'s tensor-parallel regime (harness/tools/bench/tensor_parallel.py)."""

import re

import jax
import pytest
from jax.sharding import PartitionSpec as P

from wus.harness.tools.bench import tensor_parallel


@pytest.mark.parametrize("spec, shape, want", [
    (P(None, "model"), (128, 512), P("data", "model")),  # column-parallel kernel
    (P("model", None), (512, 128), P("model", "data")),  # row-parallel kernel
    (P(), (6, 8), P(None, "data")),  # the first dim 4 does not divide: the next one
    (P("model"), (512,), P("model")),  # no dim left: as its weight
    (P(), (), P()),  # Adam's count
])
def test_add_data_to_spec_as_maxtext(spec, shape, want):
  assert tensor_parallel.add_data_to_spec(spec, shape, 4) == want


@pytest.mark.slow  # A wus-bench regime (docs/tests.md: wus-bench's runs are opt-in).
def test_the_regime_runs_and_wus_keeps_no_more_state_than_gspmd_zero1():
  """One timed round on transformer_small, 4 x 2: every variant ran the same updates
  (wus's weights are tp's bit for bit; GSPMD's near them: Adam turns the rounding of a
  zero gradient, the attention key bias's, into a step of the learning rate's size);
  wus's state per device is at most GSPMD ZeRO-1's and below tp's, and its collectives
  reduce-scatter and all-gather."""
  r = tensor_parallel.run(jax.make_mesh((8,), ("data",)), rounds=1, model="transformer_small",
                          seq_len=16)
  assert r["mesh"] == {"data": 4, "model": 2}
  assert r["wus"]["max_param_difference"] == 0  # the same program's update, under the suite's flags
  assert r["gspmd_zero1"]["max_param_difference"] < 1e-2
  ws, z1, tp = r["wus"], r["gspmd_zero1"], r["tp"]
  assert ws["opt_state_per_device"] <= z1["opt_state_per_device"] < tp["opt_state_per_device"]
  assert ws["collectives"]["reduce-scatter"]["count"] > 0
  assert tp["collectives"]["reduce-scatter"]["count"] == 0
  assert re.search(r"wus optimizer state per device <= GSPMD ZeRO-1's +\| met ",
                   tensor_parallel.markdown(r))


def test_a_model_it_cannot_split_says_why():
  assert "does not divide --num_devices=8" in tensor_parallel.unusable("transformer_wide", 3, 8)
  assert "num_heads=5" in tensor_parallel.unusable("transformer_mixed", 2, 8)
  assert "not a Transformer" in tensor_parallel.unusable("mlp_small", 2, 8)
  assert tensor_parallel.unusable("transformer_wide", 2, 8) is None
