"""Tests of wus.harness.logs: the metrics file, TensorBoard events, resuming."""

import json

from wus.harness import logs


def read(path):
  return [json.loads(line) for line in path.read_text().splitlines()]


def test_metrics_file_and_tensorboard(tmp_path):
  log = logs.Log(tmp_path, total_steps=2, start_step=0, enabled=True)
  log.train(1, {"loss": 2.5, "accuracy": 0.25}, learning_rate=0.1, seconds=0.02)
  log.eval(1, {"loss": 2.0, "accuracy": 0.5})
  log.train(2, {"loss": 1.5, "accuracy": 0.5}, learning_rate=0.2, seconds=0.01)
  log.close()
  assert read(tmp_path / "metrics.jsonl") == [
      {"kind": "train", "step": 1, "loss": 2.5, "accuracy": 0.25, "learning_rate": 0.1,
       "step_seconds": 0.02},
      {"kind": "eval", "step": 1, "eval_loss": 2.0, "eval_accuracy": 0.5},
      {"kind": "train", "step": 2, "loss": 1.5, "accuracy": 0.5, "learning_rate": 0.2,
       "step_seconds": 0.01},
  ]
  assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_resuming_drops_records_after_the_checkpoint(tmp_path):
  log = logs.Log(tmp_path, total_steps=3, start_step=0, enabled=True)
  for step in (1, 2, 3):
    log.train(step, {"loss": float(step)}, learning_rate=0.1, seconds=0.01)
  log.close()
  log = logs.Log(tmp_path, total_steps=3, start_step=1, enabled=True)  # resumed from step 1
  log.train(2, {"loss": 20.0}, learning_rate=0.1, seconds=0.01)
  log.close()
  assert [(r["step"], r["loss"]) for r in read(tmp_path / "metrics.jsonl")] == [(1, 1.0),
                                                                               (2, 20.0)]


def test_other_processes_write_nothing(tmp_path):
  log = logs.Log(None, total_steps=1, start_step=0, enabled=False)
  log.train(1, {"loss": 1.0}, learning_rate=0.1, seconds=0.01)
  log.close()
  assert not list(tmp_path.iterdir())


def test_printed_evaluations_name_the_run(capsys):
  log = logs.Log(None, total_steps=2, start_step=0, enabled=True, label="wus")
  log.eval(2, {"loss": 2.0, "accuracy": 0.5})
  log.close()
  assert "wus step 2: held-out loss 2.0000, held-out accuracy 0.5000\n" in capsys.readouterr().out
