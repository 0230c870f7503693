"""The benchmark at a small size: every variant and regime produces its row, and agrees."""

import jax
import pytest

from wus.harness import bench, steps

ROUNDS = 2


@pytest.fixture(scope="module")
def results():
  mesh = jax.make_mesh((8,), (steps.AXIS_NAME,))
  regimes = [bench.Regime("weight-update-bound", 1), bench.Regime("compute-bound", 4),
             bench.Regime("bf16-loop", 1, steps_per_call=2)]
  return [bench.run_regime(r, model="mlp_small", rounds=ROUNDS, mesh=mesh) for r in regimes]


def test_every_variant_is_timed_and_measured(results):
  for r in results:
    assert [v for v in bench.VARIANTS if v in r] == list(bench.Regime(
        r["regime"], 1, r["steps_per_call"]).variants)
    for v in bench.Regime(r["regime"], 1, r["steps_per_call"]).variants:
      m = r[v]
      assert len(m["step_seconds"]) == ROUNDS and m["min"] <= m["median"] <= m["max"]
      assert m["memory"]["total"] > 0 and m["opt_state_per_device"] > 0
      assert m["wire_bytes"] > 0 and m["compile_seconds"] > 0


def test_variants_compute_the_same_update(results):
  """Same data, same number of updates: the weights agree with the replicated step's."""
  for r in results:
    assert r["wus"]["max_param_difference"] == 0  # wus is bit for bit (XLA flags of conftest)
    for v in ("gspmd_zero1", "handwritten"):
      if v in r:
        assert r[v]["max_param_difference"] < 1e-5, (r["regime"], v)


def test_sharded_variants_hold_a_share_of_the_optimizer_state(results):
  for r in results:
    assert r["replicated"]["opt_state_per_device"] == r["opt_state_bytes"]
    share = r["wus"]["opt_state_per_device"] * r["num_devices"] / r["opt_state_bytes"]
    assert share == pytest.approx(1, abs=bench.STATE_TOLERANCE)


def test_bf16_loop_gathers_weights_in_16_bits(results):
  loop = results[2]
  # Per update in the loop: reduce-scatter in f32 and all-gather in 16 bits,
  # three quarters of the replicated all-reduce (up to the metrics' all-reduce).
  ratio = loop["wus"]["loop_wire_bytes"] / loop["replicated"]["loop_wire_bytes"]
  assert ratio == pytest.approx(0.75, abs=0.01)


def test_markdown_has_every_row_and_target(results):
  text = bench.markdown(results)
  for r in results:
    assert f"### {r['regime']}: mlp_small + Adam, N=8" in text
  for v in bench.VARIANTS:
    assert f"| {v} " in text
  rows = bench.targets(results)
  assert [t for t, _, _ in rows if "median step time" in t] == [
      f"weight-update-bound: wus median step time <= {a}'s" for a in bench.ALTERNATIVES]
  assert sum("optimizer state per device" in t for t, _, _ in rows) == 3
  assert all(isinstance(ok, bool) for _, ok, _ in rows)
