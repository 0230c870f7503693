"""A resumed `wus-train` run continues the saved schedule (issue 23 item 2): 40 updates,
then resumed to 60, equals an uninterrupted run of 60; a flag that contradicts the saved
schedule is refused in one line; the run says that it resumed, and from where."""

import jax
import numpy as np
import pytest

import wus
from helpers import assert_trees_equal
from wus.harness.training import config, train
from wus.harness import errors

pytestmark = pytest.mark.slow  # Three wus-train runs; docs/tests.md.

FLAGS = dict(model="mlp_small", batch_size=2, eval_every=0, checkpoint_every=0,
             eval_examples=64)


def run_config(output_dir, steps, **overrides) -> config.RunConfig:
  return config.RunConfig.for_model(**FLAGS, steps=steps, mode="wus", output_dir=output_dir,
                                    **overrides)


def whole(state):
  return jax.tree.map(np.asarray, wus.unshard(state))


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
  """(uninterrupted 60, resumed 40 -> 60, its folder, what the resumed run printed)."""
  out = tmp_path_factory.mktemp("resume")
  uninterrupted = train.fit(run_config(out / "whole" / "wus", 60))
  part = out / "parts" / "wus"
  train.fit(train.continue_schedule(run_config(part, 40), {}))
  return uninterrupted, part


def test_resumed_to_more_steps_equals_uninterrupted(resumed, capsys):
  uninterrupted, part = resumed
  more = train.fit(train.continue_schedule(run_config(part, 60), {}))
  assert f"wus: resumed from step 40 of {part / 'checkpoints'}" in capsys.readouterr().out
  assert more.summary["losses"] == uninterrupted.summary["losses"][40:]
  assert_trees_equal(whole(uninterrupted.state), whole(more.state))


@pytest.mark.parametrize("given, message", [
    ({"warmup_steps": ("warmup_steps", 3)},
     r"^--warmup_steps=3 differs from the schedule saved with the checkpoint at step (40|60) in "
     r".*\(warmup_steps=10\): a resumed run continues the saved schedule"),
    ({"learning_rate": ("learning_rate", 0.5)}, r"^--learning_rate=0.5 differs"),
])
def test_a_flag_against_the_saved_schedule_is_refused(resumed, given, message):
  _, part = resumed
  with pytest.raises(errors.InputError, match=message) as e:
    train.continue_schedule(run_config(part, 60, **{k: v for k, (_, v) in given.items()}),
                            given)
  assert "\n" not in str(e.value)


def test_lars_past_the_saved_decay_is_refused(tmp_path):
  short = run_config(tmp_path / "wus", 3, optimizer="lars", warmup_steps=1)
  train.fit(train.continue_schedule(short, {}))
  with pytest.raises(errors.InputError, match=r"--steps=5 goes past the LARS schedule saved .* "
                     r"reaches 0 at update 3 \(decay_steps\): start a run with "
                     r"--decay_steps=5"):
    train.continue_schedule(run_config(tmp_path / "wus", 5, optimizer="lars", warmup_steps=1),
                            {})
  kept = train.continue_schedule(run_config(tmp_path / "wus", 3, optimizer="lars"), {})
  assert (kept.warmup_steps, kept.decay_steps) == (1, 3)  # the saved schedule, not defaults
