"""End to end on 8 CPU devices: both modes train alike; the digits are learned.

Each run goes through `wus.harness.training.train.fit`, what `wus-train` runs per mode:
data, model, optimizer, the mapped step, evaluation, checkpoints.
"""

import json
import math

import jax
import numpy as np
import pytest

import wus
from wus.harness.training import config, train

pytestmark = pytest.mark.slow  # Minutes of training each (docs/tests.md).

# The two modes compute the same update, but LARS's norms (and the gradient
# all-reduce) are sums in another order: the losses agree to float32 rounding
# at first; training then amplifies the rounding differences about tenfold every
# ten updates at the digits' learning rate, as it does any perturbation.
EARLY_STEPS = 10
EARLY_TOLERANCE = dict(rtol=1e-5, atol=0)
CURVE_ATOL = 0.03  # nats; the losses fall from 2.4 to about 0.01


@pytest.fixture(scope="module")
def gathered():
  """Every tree passed to `wus.unshard` while the module's runs train."""
  trees, unshard = [], wus.unshard
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(wus, "unshard", lambda tree: trees.append(tree) or unshard(tree))
    yield trees


@pytest.fixture(scope="module")
def digits_dir(tmp_path_factory):
  return tmp_path_factory.mktemp("digits")


@pytest.fixture(scope="module")
def digits_runs(digits_dir, gathered):
  """The default ResNet + LARS run on the digits, in each mode, with checkpoints."""
  return {mode: train.fit(config.RunConfig.for_model("resnet_small", mode=mode,
                                                     output_dir=digits_dir / mode))
          for mode in ("replicated", "wus")}


def test_digits_loss_curves_match(digits_runs):
  replicated, sharded = (digits_runs[m].summary for m in ("replicated", "wus"))
  assert len(replicated["losses"]) == config.MODEL_DEFAULTS["resnet_small"]["steps"]
  np.testing.assert_allclose(sharded["losses"][:EARLY_STEPS], replicated["losses"][:EARLY_STEPS],
                             **EARLY_TOLERANCE)
  np.testing.assert_allclose(sharded["losses"], replicated["losses"], rtol=0, atol=CURVE_ATOL)
  assert sharded["eval"]["accuracy"] == pytest.approx(replicated["eval"]["accuracy"], abs=0.02)


def test_digits_accuracy_rises_well_above_chance(digits_runs):
  for run in digits_runs.values():
    assert run.summary["eval"]["accuracy"] > 0.9  # chance: 0.1
    assert run.summary["losses"][-1] < 0.2 * run.summary["losses"][0]


def test_wus_keeps_optimizer_state_sharded(digits_runs, gathered):
  replicated, sharded = (digits_runs[m] for m in ("replicated", "wus"))
  leaves = jax.tree.leaves(sharded.state.opt_state,
                                       is_leaf=lambda x: isinstance(x, wus.ShardedArray))
  assert any(isinstance(x, wus.ShardedArray) for x in leaves)
  per_device = {m: digits_runs[m].summary["state_bytes_per_device"]["opt_state"]
                for m in digits_runs}
  assert per_device["wus"] < per_device["replicated"] / 4
  assert sharded.summary["opt_state_bytes"] == replicated.summary["opt_state_bytes"]
  # Evaluation (every 50 updates) gathers what it reads, the weights and the batch
  # statistics (which wus may shard: their moving averages are elementwise updates
  # identical on every replica), never the optimizer state.
  is_sharded = lambda x: isinstance(x, wus.ShardedArray)
  evaluated = jax.tree.structure((sharded.state.params, sharded.state.model_state),
                                 is_leaf=is_sharded)
  assert gathered and all(jax.tree.structure(tree, is_leaf=is_sharded) == evaluated
                          for tree in gathered)


def test_metrics_and_checkpoints_are_written(digits_runs, digits_dir):
  steps = config.MODEL_DEFAULTS["resnet_small"]["steps"]
  for mode in digits_runs:
    run_dir = digits_dir / mode
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if r["kind"] == "train"] == list(range(1, steps + 1))
    assert [r["step"] for r in lines if r["kind"] == "eval"] == [50, 100, 150]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["100", "150", "50"]
    assert json.loads((run_dir / "summary.json").read_text())["final_step"] == steps


def test_digits_summary_is_measured(digits_runs):
  for run in digits_runs.values():
    s = run.summary
    assert s["start_step"] == 0 and s["final_step"] == len(s["losses"])
    assert s["global_batch"] == 8 * config.MODEL_DEFAULTS["resnet_small"]["batch_size"]
    assert s["examples_per_second"] == pytest.approx(s["global_batch"] / s["step_seconds"])
    assert s["memory"]["argument"] > 0 and s["collectives"]["all-reduce"]["count"] >= 1
  assert digits_runs["replicated"].summary["collectives"]["reduce-scatter"]["count"] == 0
  assert digits_runs["wus"].summary["collectives"]["reduce-scatter"]["count"] > 0
  text = train.format_results({m: r.summary for m, r in digits_runs.items()})
  assert "wus - replicated" in text and "held-out accuracy" in text


@pytest.mark.parametrize("model, batch_size", [("transformer_small", 2),
                                               ("transformer_wide", 1)])  # wus-train's default
def test_transformer_adam_on_text_matches_across_modes(model, batch_size):
  runs = {mode: train.fit(config.RunConfig.for_model(
              model, mode=mode, steps=12, batch_size=batch_size, seq_len=32,
              eval_every=0, eval_examples=256, warmup_steps=3)).summary
          for mode in ("replicated", "wus")}
  np.testing.assert_allclose(runs["wus"]["losses"], runs["replicated"]["losses"],
                             rtol=1e-5, atol=0)
  assert runs["wus"]["losses"][-1] < runs["wus"]["losses"][0] - 1  # nats per byte
  assert math.isclose(runs["wus"]["eval"]["loss"], runs["replicated"]["eval"]["loss"],
                      rel_tol=1e-4)
  per_device = {m: r["state_bytes_per_device"]["opt_state"] for m, r in runs.items()}
  assert per_device["wus"] < per_device["replicated"] / 7  # 1/8 and Adam's count


@pytest.mark.parametrize("model", ["transformer_small", "resnet_small"])
def test_jit_step_trains_alike_in_both_modes(model):
  """`wus-train --step=jit`: the step on global arrays under jax.jit and wus.jit (ResNet's
  batch norm over the global batch)."""
  runs = {mode: train.fit(config.RunConfig.for_model(
              model, mode=mode, step="jit", steps=6, batch_size=2, seq_len=32,
              eval_every=0, eval_examples=64, warmup_steps=2)).summary
          for mode in ("replicated", "wus")}
  np.testing.assert_allclose(runs["wus"]["losses"], runs["replicated"]["losses"],
                             rtol=1e-5, atol=0)
  per_device = {m: r["state_bytes_per_device"]["opt_state"] for m, r in runs.items()}
  assert per_device["wus"] < per_device["replicated"] / 6
  assert runs["wus"]["collectives"]["reduce-scatter"]["count"] > 0
  assert runs["replicated"]["collectives"]["reduce-scatter"]["count"] == 0
