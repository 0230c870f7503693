"""Tests of wus.harness.training.logs: the metrics file, TensorBoard events, resuming."""

import json
import struct

from tensorboardX.proto import event_pb2

from wus.harness.training import logs


def read(path):
  return [json.loads(line) for line in path.read_text().splitlines()]


def read_scalars(directory):
  """(tag, step, value) of every scalar in TensorBoard event files (TFRecord framing:
  8-byte length, 4-byte CRC, the Event proto, 4-byte CRC)."""
  out = []
  for path in sorted(directory.glob("events.out.tfevents.*")):
    data, pos = path.read_bytes(), 0
    while pos < len(data):
      (n,) = struct.unpack("<Q", data[pos:pos + 8])
      event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + n])
      pos += 16 + n
      out += [(v.tag, event.step, v.simple_value) for v in event.summary.value]
  return out


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
  scalars = read_scalars(tmp_path / "tensorboard")
  assert ("train/loss", 1, 2.5) in scalars and ("eval/eval_accuracy", 1, 0.5) in scalars
  assert ("train/learning_rate", 2, 0.20000000298023224) in scalars
  assert {t for t, _, _ in scalars} == {
      "train/loss", "train/accuracy", "train/learning_rate", "train/step_seconds",
      "eval/eval_loss", "eval/eval_accuracy"}


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
