"""The benchmark at a small size: every variant and regime produces its row, and agrees."""

import statistics

import jax
import pytest

from wus.analysis import network
from wus.harness.tools.bench import calibrate, compose, regimes, summary, variants
from wus.harness.training import config, steps

pytestmark = pytest.mark.slow  # Times every variant of wus-bench (minutes; docs/tests.md).

ROUNDS = 2
LEARNING_RATE = config.RunConfig.for_model("mlp_small").learning_rate


@pytest.fixture(scope="module")
def results():
  mesh = jax.make_mesh((8,), (steps.AXIS_NAME,))
  settings = [variants.Regime("weight-update-bound", 1, jit=True),
              variants.Regime("compute-bound", 4),
              variants.Regime("bf16-loop", 1, steps_per_call=2)]
  return [regimes.run_regime(r, model="mlp_small", rounds=ROUNDS, mesh=mesh) for r in settings]


def test_every_variant_is_timed_and_measured(results):
  for r in results:
    assert r["variants"] == list(variants.Regime(
        r["regime"], 1, r["steps_per_call"],
        (2, 4) if r["regime"] == "partial-sharding" else (),
        jit=r["regime"] == "weight-update-bound").variants)
    for v in r["variants"]:
      m = r[v]
      assert len(m["step_seconds"]) == ROUNDS and m["min"] <= m["median"] <= m["max"]
      assert m["memory"]["total"] > 0 and m["opt_state_per_device"] > 0
      assert m["wire_bytes"] > 0 and m["compile_seconds"] > 0


def test_variants_compute_the_same_update(results):
  """Same data, same number of updates: the weights agree with the replicated step's."""
  for r in results:
    assert r["wus"]["max_param_difference"] == 0  # wus is bit for bit (XLA flags of conftest)
    if "wus_undonated" in r:
      assert r["wus_undonated"]["max_param_difference"] == 0
    # The others round differently (the flat update, GSPMD's partitioning); Adam divides
    # by sqrt(v), so a rounding near a zero gradient can move a weight by up to one step
    # (the learning rate), never more than that.
    for v in ("gspmd_zero1", "handwritten", "handwritten_flat", "jit", "wus_jit"):
      if v in r:
        assert r[v]["max_param_difference"] < LEARNING_RATE, (r["regime"], v)
  # wus.jit is bit for bit with the jax.jit step it replaces.
  assert [r["wus_jit"]["max_jit_param_difference"] for r in results if "wus_jit" in r] == [0]


def test_sharded_variants_hold_a_share_of_the_optimizer_state(results):
  for r in results:
    assert r["replicated"]["opt_state_per_device"] == r["opt_state_bytes"]
    for v in ("wus", "wus_jit"):
      if v in r:
        share = r[v]["opt_state_per_device"] * r["num_devices"] / r["opt_state_bytes"]
        assert share == pytest.approx(1, abs=summary.STATE_TOLERANCE), v
    if "jit" in r:
      assert r["jit"]["opt_state_per_device"] == r["opt_state_bytes"]


@pytest.fixture(scope="module")
def partial():
  mesh = jax.make_mesh((8,), (steps.AXIS_NAME,))
  return regimes.run_regime(variants.Regime("partial-sharding", 1, group_sizes=(2, 4)),
                          model="mlp_small", rounds=ROUNDS, mesh=mesh)


def test_partial_sharding_rows_hold_v_over_g_and_move_no_more_bytes(partial):
  """The G = 2 and 4 variants (§5.2): state V/G per device, collective wire
  bytes no more than the replicated all-reduce's, the targets printed."""
  r = partial
  assert r["variants"] == ["replicated", "wus_g2", "wus_g4"]
  for g in (2, 4):
    m = r[f"wus_g{g}"]
    assert m["opt_state_per_device"] * g / r["opt_state_bytes"] == pytest.approx(1, abs=0.01)
    assert m["wire_bytes"] <= r["replicated"]["wire_bytes"]
    # Summed within groups, then across: rounding, at most one Adam step (as above).
    assert m["max_param_difference"] < LEARNING_RATE
  text = summary.markdown([r])
  assert "| wus_g2 " in text and "wus_g4 collective bytes <= replicated" in text
  # Issue 30: each G predicted beside measured, and the fastest of each way named.
  topology = network.default_topology(8)
  p = summary.predict(r, topology)
  assert list(p) == ["replicated", "wus_g2", "wus_g4"]
  assert p["wus_g2"].update == pytest.approx(p["replicated"].update / 2, rel=0.01)
  assert p["wus_g4"].update == pytest.approx(p["replicated"].update / 4, rel=0.01)
  line = summary.group_size_choice(r, topology)
  fastest = min((2, 4), key=lambda g: r[f"wus_g{g}"]["median"])
  assert f"measured fastest G={fastest};" in line, line
  text = summary.prediction_markdown([r], topology, {"all_reduce": [(1, 1e-3), (2, 2e-3)],
                                                     "chain": (9, 3e-3), "memory": (1, 1.0)})
  assert text.count("| wus_g") == 2 and "Sharding group size: partial-sharding" in text


def test_bf16_loop_gathers_weights_in_16_bits(results):
  loop = results[2]
  # Per update in the loop: reduce-scatter in f32 and all-gather in 16 bits,
  # three quarters of the replicated all-reduce (up to the metrics' all-reduce).
  ratio = loop["wus"]["loop_wire_bytes"] / loop["replicated"]["loop_wire_bytes"]
  assert ratio == pytest.approx(0.75, abs=0.01)


def test_parts_alone_give_the_limit_of_each_one_update_regime(results):
  """The forward and backward pass, the collectives and the update, timed in
  the same rounds; wus / limit, its copies and compile time are targets."""
  for r in results:
    bound = summary.limit_of(r)
    if r["steps_per_call"] > 1:
      assert bound is None
      continue
    assert all(len(r[f"{k}_seconds"]) == ROUNDS for k in ("rest", "collectives", "update"))
    assert bound["total"] == pytest.approx(bound["rest"] + bound["collectives"] + bound["update"])
    assert min(bound["rest"], bound["collectives"], bound["update"]) > 0
    assert "Limit: forward and backward" in summary.limit_markdown(r)
    parts = summary.breakdown(r)  # wus's step by its parts, the Plan's batching timed alone.
    assert parts is not None and "by its parts" in summary.limit_markdown(r)
    residuals = [t - a - c - u for t, a, c, u in zip(
        r["wus"]["step_seconds"], r["rest_seconds"], r["choices"]["plan"]["seconds"],
        r["update_per_tensor_seconds"], strict=True)]
    assert min(residuals) <= parts["unaccounted"] <= max(residuals)
    assert r["wus"]["moves"]["parameter copy"]["count"] == 0  # Donated, gathered in place.
    # The same parts back to back: all three run in each timed call (more than half their
    # sum alone, whatever the machine's load; one part alone would be far less).
    assert len(r["sequence_seconds"]) == ROUNDS
    assert statistics.median(r["sequence_seconds"]) > bound["total"] / 2
    assert "The same three parts back to back" in summary.limit_markdown(r)
    # The same parts composed in one program, whole and by pairs (`compose`).
    composed = compose.composition(r)
    assert all(len(r[key]) == ROUNDS for key in compose.KEYS.values())
    assert set(composed["pairs"]) == set(compose.PAIRS) and composed["step"] > 0
    assert "The limit in one program" in summary.limit_markdown(r)
  rows = [t for t, _, _ in summary.targets(results)]
  assert "weight-update-bound: wus / limit (the parts timed alone) <= 1.05" in rows
  assert "weight-update-bound: wus / the limit's parts run back to back <= 1.05" in rows
  assert "weight-update-bound: wus / the limit in one program <= 1.05" in rows
  assert "weight-update-bound: wus with the state donated no slower than without" in rows
  assert "weight-update-bound: XLA compile time (CPU seconds), wus / replicated <= 1.2" in rows
  assert summary.paired_ratio([2.0, 3.0, 10.0], [1.0, 3.0, 5.0]) == 2.0


def test_markdown_has_every_row_and_target(results):
  text = summary.markdown(results)
  for r in results:
    assert f"### {r['regime']}: mlp_small + Adam, N=8" in text
  for v in variants.VARIANTS + variants.JIT_VARIANTS:
    assert f"| {v} " in text
  rows = summary.targets(results)
  assert [t for t, _, _ in rows if "weight-update-bound: wus step time" in t] == [
      f"weight-update-bound: wus step time <= {a}'s (median of per-round ratios)"
      for a in variants.ALTERNATIVES]
  assert sum("optimizer state per device" in t for t, _, _ in rows) == 4
  assert [t for t, _, _ in rows if "wus_jit step time" in t] == [
      f"weight-update-bound: wus_jit step time <= {a}'s (median of per-round ratios)"
      for a in variants.JIT_ALTERNATIVES]
  assert "wus_jit / it (per-round ratio, median)" in text
  assert all(isinstance(ok, bool) for _, ok, _ in rows)


def test_fit_ring_recovers_alpha_and_bandwidth():
  n, alpha, bandwidth = 8, 20e-6, 2e9
  ring = lambda d: 2 * (n - 1) * (alpha + d / (n * bandwidth))
  got = calibrate.fit_ring((4096, 2 ** 22), (ring(4096), ring(2 ** 22)), n)
  assert got == pytest.approx((alpha, bandwidth), rel=1e-9)
  with pytest.raises(ValueError, match="not slower"):
    calibrate.fit_ring((4096, 2 ** 22), (1e-3, 1e-4), n)


def test_calibration_measures_this_machine():
  mesh = jax.make_mesh((8,), (steps.AXIS_NAME,))
  topology, raw = calibrate.measure(mesh, steps.AXIS_NAME, repeats=3,
                                    all_reduce_bytes=(2 ** 10, 2 ** 22), memory_bytes=2 ** 20)
  (axis,) = topology.axes
  assert axis.size == 8 and axis.alpha >= 0 and axis.bandwidth > 0
  chained, seconds = raw["chain"]  # alpha: one all-reduce inside a program of CHAIN.
  assert chained == calibrate.CHAIN and seconds > 0
  assert topology.memory_bandwidth == pytest.approx(3 * 2 ** 20 / raw["memory"][1])


def test_cost_model_predicts_each_one_update_regime(results):
  """Fed made-up machine costs: the prediction adds the model's collectives and
  update to the measured forward and backward pass, and wus's update is 1/N."""
  topology = network.Topology((network.Axis("measured", 8, 1e-5, 1e9),), 1e9)
  for r in results:
    p = summary.predict(r, topology)
    if r["steps_per_call"] > 1:
      assert p is None
      continue
    assert len(r["rest_seconds"]) == ROUNDS
    rep, ws = p["replicated"], p["wus"]
    assert rep.rest == ws.rest == pytest.approx(statistics.median(r["rest_seconds"]))
    assert ws.update == pytest.approx(rep.update / 8, rel=0.01)  # Shards pad a little.
    assert rep.collectives["all-reduce"] >= 1 and ws.collectives["reduce-scatter"] >= 1
  text = summary.prediction_markdown(results, topology,
                                   {"all_reduce": [(1, 1e-3), (2, 2e-3)], "chain": (9, 3e-3),
                                    "memory": (1, 1.0)})
  assert text.count("| wus ") == 2 and "/replicated measured" in text
