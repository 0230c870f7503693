"""`RunConfig`: everything a `wus-train` run depends on, and each model's defaults."""

from __future__ import annotations

import dataclasses
import pathlib

# Per model: the data, optimizer and hyperparameters a flag left unset takes.
# resnet_small, transformer_small and transformer_wide train in a minute or two
# on two CPU cores. transformer_wide (the default of `wus-train`) reads one
# window of 32 bytes per replica: with its 6.5 M weights, Adam's update is a
# large part of the step, as in the paper's large-scale runs (small per-replica
# batches), so sharding it shows in the step time.
MODEL_DEFAULTS = {
    "resnet50": {"data": "synthetic", "optimizer": "lars", "learning_rate": 9.0,
                 "steps": 100, "batch_size": 32, "weight_decay": 5e-5},
    "resnet_small": {"data": "digits", "optimizer": "lars", "learning_rate": 2.0,
                     "steps": 150, "batch_size": 16, "weight_decay": 1e-4},
    "transformer_base": {"data": "stdlib", "optimizer": "adam", "learning_rate": 5e-4,
                         "steps": 100, "batch_size": 4, "seq_len": 128, "weight_decay": 0.0},
    "transformer_small": {"data": "stdlib", "optimizer": "adam", "learning_rate": 2e-3,
                          "steps": 100, "batch_size": 4, "seq_len": 128, "weight_decay": 0.0},
    "transformer_wide": {"data": "stdlib", "optimizer": "adam", "learning_rate": 2e-3,
                         "steps": 60, "batch_size": 1, "seq_len": 32, "weight_decay": 0.0},
    "transformer_mixed": {"data": "stdlib", "optimizer": "adam", "learning_rate": 2e-3,
                          "steps": 60, "batch_size": 1, "seq_len": 32, "weight_decay": 0.0},
    "mlp_deep": {"data": "synthetic", "optimizer": "adam", "learning_rate": 1e-4,
                 "steps": 20, "batch_size": 2, "weight_decay": 0.0},
    "mlp_large": {"data": "synthetic", "optimizer": "adam", "learning_rate": 1e-4,
                  "steps": 20, "batch_size": 2, "weight_decay": 0.0},
    "mlp_small": {"data": "digits", "optimizer": "adam", "learning_rate": 1e-3,
                  "steps": 100, "batch_size": 16, "weight_decay": 0.0},
}


# The learning rate of an optimizer that is not the model's default.
OPTIMIZER_LEARNING_RATES = {"lars": 1.0, "adam": 1e-3}
# Warmup: this fraction of the model's default --steps, unless --warmup_steps says otherwise.
# Not of --steps: a run resumed to more steps continues the same schedule as an
# uninterrupted run of that length.
WARMUP_FRACTION = 0.1
# What a checkpoint's schedule record holds, per optimizer: the hyperparameters of
# `optim.make`, which a resumed run continues (`RunConfig.schedule`).
SCHEDULE_FIELDS = {"lars": ("learning_rate", "warmup_steps", "decay_steps", "weight_decay",
                            "momentum"),
                   "adam": ("learning_rate", "warmup_steps", "b1", "b2", "eps")}


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """One training run. Steps count updates; batch sizes count examples.

  Attributes:
    model: a key of `tasks.MODELS`.
    data: "digits", "stdlib", "synthetic" or a path (`datasets.load`).
    optimizer: "lars" or "adam".
    learning_rate: peak learning rate.
    warmup_steps: updates of linear warmup.
    decay_steps: LARS: the update at which the rate reaches 0 (None: `steps`).
    weight_decay: LARS weight decay on weight matrices and kernels.
    steps: total updates of the run (a resumed run continues to it).
    batch_size: examples per replica per update; the global batch is
      `batch_size` times the number of devices.
    mode: "replicated" (jax.shard_map, or jax.jit) or "wus" (wus.shard_map, or
      wus.jit).
    step: how the step is written: "shard_map" (per replica, mapped by
      jax.shard_map / wus.shard_map) or "jit" (on global arrays, compiled by
      jax.jit / wus.jit).
    momentum: LARS momentum.
    b1, b2, eps: Adam's parameters.
    seq_len: bytes per text example fed to a Transformer (default per model).
    image_size: side in pixels of folder and synthetic images.
    seed: seed of the initialization and of the data order.
    eval_every: evaluate on the held-out split every this many updates (and
      after the last); 0: after the last only.
    eval_examples: evaluate at most this many held-out examples (the first
      ones; a text example is a window of `seq_len` bytes).
    checkpoint_every: save every this many updates (and after the last); 0:
      after the last only.
    keep_checkpoints: how many of the latest checkpoints to keep.
    output_dir: checkpoints, metrics and summary go here; None: none are
      written and nothing is resumed.
    model_parallel: devices of the mesh axis "model" a Transformer's heads and MLP
      hidden units are split over (Megatron-style tensor parallelism); 1: none, a
      1-D mesh. Replicas (the mesh axis "data"): devices / model_parallel.
    num_devices: simulated CPU devices of this process.
    coordinator_address: host:port of process 0, for several processes.
    num_processes: processes in the run.
    process_id: this process's index, 0 <= process_id < num_processes.
  """

  model: str
  data: str
  optimizer: str
  learning_rate: float
  warmup_steps: int
  weight_decay: float
  steps: int
  batch_size: int
  mode: str = "wus"
  step: str = "shard_map"
  decay_steps: int | None = None
  momentum: float = 0.9
  b1: float = 0.9
  b2: float = 0.98
  eps: float = 1e-9
  seq_len: int = 128
  image_size: int = 32
  seed: int = 0
  eval_every: int = 50
  eval_examples: int = 1024
  checkpoint_every: int = 50
  keep_checkpoints: int = 3
  output_dir: pathlib.Path | None = None
  model_parallel: int = 1
  num_devices: int = 8
  coordinator_address: str | None = None
  num_processes: int = 1
  process_id: int = 0

  @classmethod
  def for_model(cls, model: str, **overrides) -> RunConfig:
    """The config of `model` with its defaults (MODEL_DEFAULTS) where not overridden.

    A None override counts as not given. The learning rate defaults to the
    model's own if the optimizer is the model's, else to the optimizer's
    (OPTIMIZER_LEARNING_RATES); warmup to WARMUP_FRACTION of the model's default
    steps.
    """
    given = {k: v for k, v in overrides.items() if v is not None}
    fields = {**MODEL_DEFAULTS[model], **given}
    if "learning_rate" not in given and fields["optimizer"] != MODEL_DEFAULTS[model]["optimizer"]:
      fields["learning_rate"] = OPTIMIZER_LEARNING_RATES[fields["optimizer"]]
    fields.setdefault("warmup_steps", int(WARMUP_FRACTION * MODEL_DEFAULTS[model]["steps"]))
    return cls(model=model, **fields)

  def schedule(self) -> dict:
    """The optimizer's hyperparameters that a resumed run must continue (SCHEDULE_FIELDS),
    with `decay_steps` resolved: saved with every checkpoint."""
    out = {k: getattr(self, k) for k in SCHEDULE_FIELDS[self.optimizer]}
    if "decay_steps" in out and out["decay_steps"] is None:
      out["decay_steps"] = self.steps
    return out

  def optimizer_hyperparameters(self) -> dict:
    """Keyword arguments of `optim.make(self.optimizer, ...)`."""
    s = self.schedule()
    if self.optimizer == "lars":
      return {"learning_rate": s["learning_rate"], "warmup_steps": s["warmup_steps"],
              "total_steps": s["decay_steps"], "weight_decay": s["weight_decay"],
              "momentum": s["momentum"]}
    return s
