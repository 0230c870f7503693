"""What a person sees during training: a progress bar, a metrics file, TensorBoard.

Records are JSON lines, one object per event, each with the `step` (number of
updates done) and `kind`:

  {"kind": "train", "step": 10, "loss": 1.93, "accuracy": 0.41,
   "learning_rate": 0.2, "step_seconds": 0.031}
  {"kind": "eval", "step": 10, "eval_loss": 1.71, "eval_accuracy": 0.55}

`pandas.read_json(path, lines=True)` reads them. The same scalars go to
TensorBoard event files (tensorboardX) under `tensorboard/`. Only the first
process writes anything.
"""

from __future__ import annotations

import json
import pathlib

import tensorboardX
import tqdm


class Log:
  """Progress bar and metrics of one run.

  Args:
    directory: where `metrics.jsonl` and `tensorboard/` go; None for the
      progress bar only.
    total_steps: the run's last step.
    start_step: updates already done (a resumed run); records of later steps in
      an existing `metrics.jsonl` (written after the checkpoint that is resumed
      from) are dropped, so the file reads as one uninterrupted run.
    enabled: False on every process but the first.
    label: names the run (e.g. its mode) on the progress bar and on each
      printed evaluation line.
  """

  def __init__(self, directory: pathlib.Path | None, *, total_steps: int, start_step: int,
               enabled: bool, label: str = ""):
    self._enabled = enabled
    self._prefix = f"{label} " if label else ""
    self._file = self._tensorboard = None
    if enabled and directory is not None:
      path = directory / "metrics.jsonl"
      kept = [line for line in (path.read_text().splitlines() if path.exists() else [])
              if json.loads(line)["step"] <= start_step]
      path.write_text("".join(line + "\n" for line in kept))
      self._file = path.open("a")
      self._tensorboard = tensorboardX.SummaryWriter(str(directory / "tensorboard"),
                                                     purge_step=start_step + 1)
    self._bar = tqdm.tqdm(total=total_steps, initial=start_step, unit="step", desc=label or None,
                          disable=not enabled, dynamic_ncols=True)

  def _write(self, record: dict) -> None:
    if self._file:
      self._file.write(json.dumps(record) + "\n")
      self._file.flush()
      for name, value in record.items():
        if name not in ("kind", "step"):
          self._tensorboard.add_scalar(f"{record['kind']}/{name}", value, record["step"])

  def train(self, step: int, metrics: dict[str, float], *, learning_rate: float,
            seconds: float) -> None:
    """One update: its metrics, the learning rate it used, its wall time in seconds."""
    self._write({"kind": "train", "step": step, **metrics, "learning_rate": learning_rate,
                 "step_seconds": seconds})
    self._bar.update(1)
    self._bar.set_postfix(loss=f"{metrics['loss']:.4f}", step_ms=f"{1e3 * seconds:.1f}")

  def eval(self, step: int, metrics: dict[str, float]) -> None:
    """Held-out metrics after `step` updates."""
    self._write({"kind": "eval", "step": step, **{f"eval_{k}": v for k, v in metrics.items()}})
    if self._enabled:
      self._bar.write(f"{self._prefix}step {step}: " +
                      ", ".join(f"held-out {k} {v:.4f}" for k, v in metrics.items()))

  def close(self) -> None:
    self._bar.close()
    if self._file:
      self._file.close()
      self._tensorboard.close()
