"""wus-bench's Muon regime at a small size: every variant measured, and they agree."""

import jax
import pytest

from wus.harness.tools.bench import muon as muon_bench

pytestmark = pytest.mark.slow  # A wus-bench run (minutes); docs/tests.md.

ROUNDS = 2


@pytest.fixture(scope="module")
def results():
  mesh = jax.make_mesh((8,), (muon_bench.AXIS,))
  return [muon_bench.run(muon_bench.Transformer(width=32, depth=4), mesh, rounds=ROUNDS),
          muon_bench.run(muon_bench.Imbalanced(width=32), mesh, rounds=ROUNDS)]


def test_every_variant_is_timed_and_measured(results):
  for r in results:
    for v in muon_bench.VARIANTS:
      m = r[v]
      assert len(m["step_seconds"]) == ROUNDS and m["min"] <= m["median"] <= m["max"]
      assert m["update_flops"] > 0 and m["wire_bytes"] > 0 and m["opt_state_per_device"] > 0


def test_variants_compute_the_same_update(results):
  """wus bit for bit with replicated Muon (the suite's XLA flags). The hand-written Muon
  computes the same update in another program: its matrices agree to a few ulps, but
  its gradients sum in another order, and Adam turns a vector's gradient near its eps
  (1e-8) into a step of up to the learning rate either way."""
  for r in results:
    assert r["wus"]["max_param_difference"] == 0
    assert r["handwritten"]["max_param_difference"] < 2 * muon_bench.LEARNING_RATE


def test_owned_update_and_state_are_about_one_nth(results):
  transformer = results[0]
  for target, ok, measured in muon_bench.targets(transformer):
    if "time" not in target:  # Times are not asserted on a shared 2-core machine.
      assert ok, (target, measured)


def test_imbalanced_model_is_balanced_beyond_padded_stacks(results):
  """Seven [32,32] matrices and one [64,64] (8x the Newton-Schulz flops): wus's busiest
  replica is the [64,64]'s owner alone, predicted and measured (the update's per-device
  flops are its costliest branch, above 1/N of replicated's); the hand-written stacks
  pad the lone [64,64] to N slots, so every replica runs one beside a [32,32]."""
  r = results[1]
  loads = r["loads"]
  assert r["imbalance"] > 1.5 and sorted(loads)[-2] < max(loads) / 2
  share = r["wus"]["update_flops"] / r["replicated"]["update_flops"]
  assert 1 / 8 < share < 0.6
  assert r["wus"]["update_flops"] < r["handwritten"]["update_flops"]


def test_ownership_is_printed_predicted_beside_measured(results):
  """Issue 30: the Plan's ownership choice (owned against replicated, predicted) beside the
  same comparison measured (each step minus the step without its update, timed in the same
  rounds); owning was chosen, so it was predicted no slower."""
  for r in results:
    rep, own = r["predicted"]
    assert 0 < own <= rep
    assert len(r["rest_seconds"]) == ROUNDS and min(r["rest_seconds"]) > 0
  text = muon_bench.markdown(results)
  assert text.count("Ownership, predicted beside measured") == 2, text
