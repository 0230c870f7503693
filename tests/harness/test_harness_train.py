"""Tests of wus.harness.training.train: the printed comparison, the CLI's one-line errors,
results."""

import json

import numpy as np
import pytest
from absl.testing import flagsaver

from wus.harness.training import checkpoint, cli, config, figure, train
from wus.harness.tools import report


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


@pytest.mark.parametrize("wus_update_ms, why", [
    (14.0, "the extra collective round (3 all-gather(s) of the new weights, 4,096 bytes per "
           "device, after the reduce-scatter, where the replicated step has one all-reduce) "
           "costs more than updating 1/8 of every tensor saves (4.0 ms more)."),
    (6.0, "sharding saves 4.0 ms of it timed alone, so the difference of the steps lies "
          "outside the update"),
], ids=["update_slower", "update_faster"])
def test_format_results_says_why_wus_is_slower(wus_update_ms, why):
  gather = {"count": 3, "bytes": 4096, "wire_bytes": 3584}
  text = train.format_results({
      "replicated": summary([2.0, 1.0], step_seconds=0.020, update_seconds=0.010,
                            num_devices=8),
      "wus": summary([2.0, 1.0], step_seconds=0.024, update_seconds=wus_update_ms / 1e3,
                     num_devices=8, collectives={
                         **summary([])["collectives"], "all-gather": gather}),
  })
  assert "|   collectives + update alone (ms) | 10.00      |" in text
  assert ("wus is not faster in this run (step time wus/replicated 1.200, +4.0 ms). The "
          "gradient collectives and weight update, timed alone after training, take 10.0 ms "
          "replicated (50% of its 20.0 ms step: an all-reduce, then every replica updates every "
          f"weight) and {wus_update_ms:.1f} ms with wus (a reduce-scatter, the update of 1/8 of "
          "every tensor, then all-gathers): " + why) in text


def test_format_results_without_update_times_has_no_note():
  text = train.format_results({"replicated": summary([2.0, 1.0]),
                               "wus": summary([2.0, 1.0], step_seconds=0.03)})
  assert "collectives + update alone" not in text and "not faster" not in text


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


def main_error(*args) -> str:
  """What `wus-train` with `args` exits with (it must exit)."""
  with flagsaver.flagsaver():
    cli.FLAGS.unparse_flags()
    argv = cli.FLAGS(["wus-train", *args])
    try:
      with pytest.raises(SystemExit) as exit_info:
        train.main(argv)
    finally:
      cli.FLAGS.unparse_flags()
  return str(exit_info.value.code)


@pytest.mark.parametrize("args, message", [
    (["--data=/no/such/file.npz", "--model=resnet_small"],
     "wus-train: error: --data=/no/such/file.npz: no such file or directory"),
    (["positional"], "wus-train: error: unexpected arguments ['positional']"),
    (["--model_parallel=3"], "wus-train: error: --model_parallel=3 does not divide the 8 "
     "devices"),
    (["--model_parallel=2", "--model=mlp_small"], "wus-train: error: --model_parallel=2: "
     "mlp_small cannot be split over 2 devices: it is not a Transformer"),
])
def test_main_reports_bad_input_in_one_line(args, message):
  assert main_error(*args).startswith(message)


def test_main_reports_a_file_as_output_dir(tmp_path):
  (tmp_path / "out").write_text("not a folder")
  assert main_error(f"--output_dir={tmp_path / 'out'}").startswith(
      f"wus-train: error: --output_dir={tmp_path / 'out'}: {tmp_path / 'out'} is a file, not "
      "a folder; give a folder")


@pytest.mark.parametrize("damage", [
    lambda data: data[:len(data) // 2],  # truncated
    lambda data: data[:-200] + bytes(200),  # end overwritten: zip directory lost
    lambda data: b"images,labels\n1,2\n",  # not a .npz at all
], ids=["truncated", "overwritten", "not_npz"])
def test_main_reports_an_unreadable_npz_in_one_line(tmp_path, damage):
  path = tmp_path / "data.npz"
  np.savez(path, images=np.zeros((50, 8, 8), np.uint8), labels=np.zeros(50, np.int64))
  path.write_bytes(damage(path.read_bytes()))
  message = main_error("--model=resnet_small", f"--data={path}")
  assert message.startswith(f"wus-train: error: --data={path}: cannot read it as a .npz "
                            "file of arrays ("), message
  assert "\n" not in message


def test_a_bad_checkpoint_of_the_second_mode_stops_the_run_before_training(tmp_path,
                                                                           monkeypatch):
  saver = checkpoint.Checkpointer(tmp_path / "wus" / "checkpoints", {"model": "other"},
                                  max_to_keep=1)
  saver.save(3, {"w": np.ones(2, np.float32)})
  saver.close()
  trained = []
  monkeypatch.setattr(train.loop, "train", lambda *args, **kwargs: trained.append(args))
  message = main_error("--model=resnet_small", f"--output_dir={tmp_path}",
                       "--modes=replicated", "--modes=wus")
  assert message.startswith("wus-train: error: the checkpoint at step 3 in "
                            f"{tmp_path / 'wus' / 'checkpoints'} is of another model"), message
  assert not trained and not (tmp_path / "replicated").exists()


def test_results_are_appended_to_earlier_records(tmp_path):
  path = tmp_path / "results.json"
  train.append_record(path, {"run": 1})
  train.append_record(path, {"run": 2})
  assert json.loads(path.read_text()) == [{"run": 1}, {"run": 2}]
  path.write_text(json.dumps({"run": 0}))  # a single record, as older versions wrote
  train.append_record(path, {"run": 1})
  assert json.loads(path.read_text()) == [{"run": 0}, {"run": 1}]
  path.write_text("{unreadable")
  train.append_record(path, {"run": 1})
  assert json.loads(path.read_text()) == [{"run": 1}]
  assert (tmp_path / "results.json.unreadable").read_text() == "{unreadable"


def test_a_slower_wus_step_gets_its_update_timed_alone(monkeypatch):
  """fit_modes times the collectives and update of both modes when wus is not faster."""
  fit = train.fit

  def slow_wus(config, built=None):
    result = fit(config, built)
    if config.mode == "wus":  # as a run where wus came out slower
      result.summary["step_seconds"] = 1.0 + result.summary["step_seconds"]
    return result

  monkeypatch.setattr(train, "fit", slow_wus)
  configs = [config.RunConfig.for_model("mlp_small", mode=mode, steps=3, batch_size=2,
                                        eval_examples=16) for mode in ("replicated", "wus")]
  results = train.fit_modes(configs)
  assert all(r["update_seconds"] > 0 for r in results.values())
  assert "wus is not faster in this run" in train.format_results(results)


def test_format_results_says_when_wus_needs_more_temporary_memory():
  """The issue's small CNN: temporary memory 0.80 -> 3.30 MB while arguments fell."""
  before = {"argument": 2_000_000, "output": 2_000_000, "alias": 0, "temp": 800_000,
            "total": 4_800_000}
  after = {"argument": 840_000, "output": 840_000, "alias": 0, "temp": 3_300_000,
           "total": 4_980_000}
  text = train.format_results({"replicated": summary([1.0], memory=before),
                               "wus": summary([1.0], memory=after)})
  assert ("wus's compiled step needs more temporary memory per device: 3,300,000 bytes "
          "against 800,000 replicated (4.12x, +2,500,000), while its arguments fall from "
          "2,000,000 to 840,000 bytes") in text
  assert "temporary memory" not in train.format_results(
      {"replicated": summary([1.0], memory=after), "wus": summary([1.0], memory=before)})


def test_the_picture_draws_what_the_run_measured(tmp_path):
  """wus-train's picture (figure.py) from a short real run of both modes: one loss curve
  per mode with every update's measured loss, and bars of the measured MiB per device."""
  configs = [config.RunConfig.for_model("mlp_small", mode=mode, steps=3, batch_size=2,
                                        eval_examples=16) for mode in ("replicated", "wus")]
  results = train.fit_modes(configs)
  fig = figure.draw(results, "mlp_small")
  loss_ax, mem_ax = fig.axes
  for line, (mode, r) in zip(loss_ax.get_lines(), results.items(), strict=True):
    assert line.get_label() == mode
    np.testing.assert_array_equal(line.get_xdata(), [1, 2, 3])
    np.testing.assert_array_equal(line.get_ydata(), r["losses"])
  for bars, r in zip(mem_ax.containers, results.values(), strict=True):
    heights = [b.get_height() * 2 ** 20 for b in bars]
    np.testing.assert_allclose(heights, [r["state_bytes_per_device"]["opt_state"],
                                         r["memory"]["total"]])
  wus_state, replicated_state = (results[m]["state_bytes_per_device"]["opt_state"]
                                 for m in ("wus", "replicated"))
  assert wus_state * 8 <= replicated_state * 1.15  # what the picture shows: 1/8 per device
  path = figure.plot(results, tmp_path / "comparison.png")
  assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
