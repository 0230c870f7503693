"""Tests of wus.harness.train: the printed comparison, and the CLI's one-line errors."""

import pytest
from absl.testing import flagsaver

from wus.harness import cli, report, train


def summary(losses, start_step=0, **overrides):
  return {
      "start_step": start_step, "final_step": start_step + len(losses), "global_batch": 64,
      "losses": losses, "step_seconds": 0.02, "first_step_seconds": 5.0,
      "examples_per_second": 3200.0, "eval": {"loss": 0.5, "accuracy": 0.9},
      "state_bytes_per_device": {"params": 100, "model_state": 0, "opt_state": 200},
      "opt_state_bytes": 200, "memory": {"argument": 300, "output": 300, "alias": 0, "temp": 10,
                                              "total": 310},
      "collectives": {kind: {"count": 0, "bytes": 0, "wire_bytes": 0}
                      for kind in report.COLLECTIVE_KINDS},
      **overrides,
  }


def test_format_results_compares_two_modes():
  text = train.format_results({
      "replicated": summary([2.0, 1.5, 1.0]),
      "wus": summary([2.0, 1.5, 1.25], state_bytes_per_device={
          "params": 100, "model_state": 0, "opt_state": 25}),
  })
  assert "| 3    | 1.000           | 1.250    | 0.2500           |" in text
  assert "max |difference| of training loss over all steps: 0.25" in text
  assert "| opt_state per device (bytes)   | 200        | 25     | 0.1250         |" in text
  assert "| model_state per device (bytes) | 0          | 0      | -              |" in text


def test_format_results_of_one_resumed_mode_shows_its_updates():
  text = train.format_results({"wus": summary([1.0, 0.5], start_step=10)})
  assert "Training loss, updates 11-12" in text
  assert "| 12   | 0.5000   |" in text


def test_format_results_when_nothing_was_left_to_train():
  done = summary([], start_step=20, step_seconds=None, first_step_seconds=None,
                 examples_per_second=None)
  del done["memory"], done["collectives"]
  text = train.format_results({"wus": done})
  assert "Training loss" not in text and "| median step time (ms)          | -      |" in text


@pytest.mark.parametrize("args, message", [
    (["--data=/no/such/file.npz", "--model=resnet_small"],
     "wus-train: error: --data=/no/such/file.npz: no such file or directory"),
    (["positional"], "wus-train: error: unexpected arguments ['positional']"),
])
def test_main_reports_bad_input_in_one_line(args, message):
  with flagsaver.flagsaver():
    cli.FLAGS.unparse_flags()
    argv = cli.FLAGS(["wus-train", *args])
    with pytest.raises(SystemExit) as exit_info:
      train.main(argv)
  cli.FLAGS.unparse_flags()
  assert str(exit_info.value.code).startswith(message)
