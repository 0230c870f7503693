"""The flags of `wus-train` and the `RunConfig`s they make; JAX set-up from them.

Flags left unset take the model's defaults (`config.MODEL_DEFAULTS`). The
multi-process flags fall back to the environment variables
JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID.
"""

from __future__ import annotations

import os
import pathlib

import jax
from absl import flags, logging

from wus.harness.training import config as config_lib
from wus.harness import errors
from wus.harness.training import optim, steps
from wus.harness.models import tasks

FLAGS = flags.FLAGS


def _defaults(field: str) -> str:
  return ", ".join(f"{m}: {d[field]}" for m, d in config_lib.MODEL_DEFAULTS.items())


flags.DEFINE_enum("model", "transformer_wide", list(tasks.MODELS),
                  "Model: a byte-level Transformer LM (base: 6 layers, width 512, as in the "
                  "Flax WMT example; wide: 2 layers, width 512, weight-update bound at its "
                  "default batch; small: 2 layers, width 128), a ResNet with batch norm "
                  "averaged across replicas (resnet50; resnet_small: 2 stages of basic "
                  "blocks, 16 and 32 filters, for tiny images), or an MLP image classifier "
                  "(mlp_large: 3 hidden layers of 4096, weight-update bound; mlp_small: 2 "
                  "of 1024).")
flags.DEFINE_multi_enum("modes", list(steps.MODES), steps.MODES,
                        "Modes to run, one after the other on the same data from the same "
                        "seed: replicated (jax.shard_map, every replica updates every weight) "
                        "and/or wus (wus.shard_map, the weight update sharded). With both, the "
                        "two are compared at the end.")
flags.DEFINE_enum("step", "shard_map", list(steps.STEP_STYLES),
                  "How the training step is written: shard_map (per replica; the modes are "
                  "jax.shard_map and wus.shard_map) or jit (on global arrays with the batch on a "
                  "NamedSharding; the modes are jax.jit and wus.jit).")
flags.DEFINE_string("data", None, "Training data: digits (the 8x8 handwritten digits "
                    "bundled with scikit-learn), stdlib (the bytes of Python's standard "
                    "library), synthetic (random, for step times), or a path: a .npz with "
                    "arrays images [n,h,w(,c)] and labels [n] (optionally eval_images, "
                    "eval_labels), a folder with one sub-folder of images per class, or a text "
                    f"file or folder of text files. Default per model: {_defaults('data')}.")
flags.DEFINE_enum("optimizer", None, optim.OPTIMIZERS,
                  "lars (warmup, then polynomial decay of power 2; no weight decay or trust "
                  "ratio on biases and batch-norm parameters, as in MLPerf) or adam (warmup, "
                  "then inverse-square-root decay). Default per model: "
                  f"{_defaults('optimizer')}.")
flags.DEFINE_float("learning_rate", None, "Peak learning rate, reached at the end of warmup. "
                   f"Default per model: {_defaults('learning_rate')}; with another optimizer "
                   f"than the model's: {config_lib.OPTIMIZER_LEARNING_RATES}.", lower_bound=0)
flags.DEFINE_integer("warmup_steps", None, "Updates of linear learning-rate warmup. Default: "
                     f"{config_lib.WARMUP_FRACTION:.0%} of the model's default --steps, "
                     "whatever --steps is, so that a run resumed to more steps continues the "
                     "schedule of an uninterrupted one.", lower_bound=0)
flags.DEFINE_integer("decay_steps", None, "LARS: the update at which the polynomial decay "
                     "reaches 0. Default: --steps of the run that started the schedule (a "
                     "resumed run continues the saved one).", lower_bound=1)
flags.DEFINE_float("weight_decay", None, "LARS weight decay on kernels (not on biases or "
                   f"batch-norm parameters). Default per model: {_defaults('weight_decay')}.",
                   lower_bound=0)
flags.DEFINE_float("momentum", 0.9, "LARS momentum.", lower_bound=0)
flags.DEFINE_float("beta1", 0.9, "Adam's decay rate of the first moment.", lower_bound=0)
flags.DEFINE_float("beta2", 0.98, "Adam's decay rate of the second moment.", lower_bound=0)
flags.DEFINE_float("adam_eps", 1e-9, "Adam's epsilon in the denominator.", lower_bound=0)
flags.DEFINE_integer("steps", None, "Total updates; a resumed run continues up to it. "
                     f"Default per model: {_defaults('steps')}.", lower_bound=1)
flags.DEFINE_integer("batch_size", None, "Examples per replica per update; the global batch "
                     "is batch_size times the number of devices of all processes. The data "
                     "order depends on the global batch: to resume at another device count "
                     "exactly, keep the global batch. Default per model: "
                     f"{_defaults('batch_size')}.", lower_bound=1)
flags.DEFINE_integer("seq_len", None, "Bytes per example a Transformer reads. Default per "
                     "model: " + ", ".join(f"{m}: {d['seq_len']}" for m, d in
                                           config_lib.MODEL_DEFAULTS.items() if "seq_len" in d)
                     + ".", lower_bound=1)
flags.DEFINE_integer("image_size", 32, "Side in pixels to which folder images are resized, "
                     "and of synthetic images.", lower_bound=1)
flags.DEFINE_integer("seed", 0, "Seed of the parameter initialization and of the data order; "
                     "every mode uses it.", lower_bound=0)
flags.DEFINE_integer("eval_every", 50, "Evaluate on the held-out split every this many "
                     "updates, and after the last; 0: after the last only.", lower_bound=0)
flags.DEFINE_integer("eval_examples", 1024, "Evaluate at most this many held-out examples "
                     "(the first ones, always the same; for text, consecutive windows of "
                     "--seq_len bytes).", lower_bound=1)
flags.DEFINE_integer("checkpoint_every", 50, "Save a checkpoint every this many updates, and "
                     "after the last; 0: after the last only. Needs --output_dir.",
                     lower_bound=0)
flags.DEFINE_integer("keep_checkpoints", 3, "How many of the latest checkpoints to keep.",
                     lower_bound=1)
flags.DEFINE_string("output_dir", None, "If set: per mode, a folder <output_dir>/<mode> with "
                    "checkpoints/ (a run resumes from the latest), metrics.jsonl, tensorboard/ "
                    "and summary.json (of the latest run); and results.json comparing the "
                    "modes, a list with one record per run (a resumed run appends its own).")
flags.DEFINE_integer("num_devices", 8, "Simulated CPU devices of this process; the mesh has "
                     "one axis 'data' over the devices of all processes (with --model_parallel, "
                     "two: 'data' and 'model').", lower_bound=1)
flags.DEFINE_integer("model_parallel", 1, "Devices a Transformer is split over, Megatron-style "
                     "(heads and MLP hidden units over a mesh axis 'model', a psum after the "
                     "row-parallel matmuls): the mesh is (data: devices / model_parallel) x "
                     "(model: model_parallel), and --batch_size counts examples per data "
                     "replica. 1: data parallelism only. With --step=jit, the weights are placed "
                     "so and GSPMD partitions the step on global arrays.", lower_bound=1)
flags.DEFINE_string("coordinator_address", None, "host:port of process 0 when running "
                    "several processes (default: $JAX_COORDINATOR_ADDRESS).")
flags.DEFINE_integer("num_processes", None, "Number of processes (default: "
                     "$JAX_NUM_PROCESSES, else 1).", lower_bound=1)
flags.DEFINE_integer("process_id", None, "This process's index, from 0 (default: "
                     "$JAX_PROCESS_ID, else 0).", lower_bound=0)


def _from_env(value, name: str, default, convert=int):
  """`value` if the flag was given, else $`name` converted, else `default`."""
  if value is not None:
    return value
  raw = os.environ.get(name)
  if raw is None:
    return default
  try:
    return convert(raw)
  except ValueError:
    raise errors.InputError(f"${name}={raw!r} is not valid") from None


def configs_from_flags() -> list[config_lib.RunConfig]:
  """One RunConfig per mode in --modes (replicated first), from the parsed flags.

  Raises:
    errors.InputError: flags that are valid alone but not together.
  """
  num_processes = _from_env(FLAGS.num_processes, "JAX_NUM_PROCESSES", 1)
  process_id = _from_env(FLAGS.process_id, "JAX_PROCESS_ID", 0)
  address = _from_env(FLAGS.coordinator_address, "JAX_COORDINATOR_ADDRESS", None, str)
  if not 0 <= process_id < num_processes:
    raise errors.InputError(f"--process_id={process_id} must be below "
                            f"--num_processes={num_processes}")
  if num_processes > 1 and not address:
    raise errors.InputError("--num_processes > 1 needs --coordinator_address (host:port of "
                            "process 0)")
  _check_model_parallel(FLAGS.model_parallel, FLAGS.num_devices * num_processes)
  output_dir = _output_dir(FLAGS.output_dir)
  configs = [config_lib.RunConfig.for_model(
      FLAGS.model, mode=mode, step=FLAGS.step, data=FLAGS.data, optimizer=FLAGS.optimizer,
      learning_rate=FLAGS.learning_rate, warmup_steps=FLAGS.warmup_steps,
      decay_steps=FLAGS.decay_steps,
      weight_decay=FLAGS.weight_decay, steps=FLAGS.steps, batch_size=FLAGS.batch_size,
      momentum=FLAGS.momentum, b1=FLAGS.beta1, b2=FLAGS.beta2, eps=FLAGS.adam_eps,
      seq_len=FLAGS.seq_len, image_size=FLAGS.image_size, seed=FLAGS.seed,
      eval_every=FLAGS.eval_every, eval_examples=FLAGS.eval_examples,
      checkpoint_every=FLAGS.checkpoint_every,
      keep_checkpoints=FLAGS.keep_checkpoints,
      output_dir=output_dir / mode if output_dir else None, num_devices=FLAGS.num_devices,
      model_parallel=FLAGS.model_parallel,
      coordinator_address=address, num_processes=num_processes, process_id=process_id)
      for mode in steps.MODES if mode in FLAGS.modes]
  _warn_ignored_flags(configs[0])
  return configs


def _check_model_parallel(model_parallel: int, devices: int) -> None:
  """Raises errors.InputError if --model_parallel cannot be used with these flags."""
  if model_parallel == 1:
    return
  if devices % model_parallel:
    raise errors.InputError(f"--model_parallel={model_parallel} does not divide the "
                            f"{devices} devices")


def _output_dir(flag: str | None) -> pathlib.Path | None:
  """--output_dir as a path, or None if unset.

  Raises:
    errors.InputError: it, or the nearest of its parents that exists, is not a
      folder.
  """
  if not flag:
    return None
  path = pathlib.Path(flag)
  existing = next(p for p in (path, *path.parents) if p.exists())
  if not existing.is_dir():
    raise errors.InputError(f"--output_dir={flag}: {existing} is a file, not a folder; give a "
                            "folder (it is created if missing)")
  return path


# Flags that only some runs read: name -> whether `config` (of a model reading
# data of `kind`) reads it.
_READ_BY = {
    "momentum": lambda config, kind: config.optimizer == "lars",
    "decay_steps": lambda config, kind: config.optimizer == "lars",
    "weight_decay": lambda config, kind: config.optimizer == "lars",
    "beta1": lambda config, kind: config.optimizer == "adam",
    "beta2": lambda config, kind: config.optimizer == "adam",
    "adam_eps": lambda config, kind: config.optimizer == "adam",
    "seq_len": lambda config, kind: kind == tasks.TEXT,
    "image_size": lambda config, kind: kind == tasks.IMAGES and (
        config.data == "synthetic" or pathlib.Path(config.data).is_dir()),
    "checkpoint_every": lambda config, kind: config.output_dir is not None,
    "keep_checkpoints": lambda config, kind: config.output_dir is not None,
}


def _warn_ignored_flags(config: config_lib.RunConfig) -> None:
  """Logs one warning naming the flags given that `config` does not read."""
  kind = tasks.MODELS[config.model][0]
  ignored = [f"--{name}" for name, reads in _READ_BY.items()
             if FLAGS[name].present and not reads(config, kind)]
  if ignored:
    context = (f"--model={config.model}, --optimizer={config.optimizer}, --data={config.data}"
               + ("" if config.output_dir else ", no --output_dir"))
    logging.warning("ignoring %s: not read in this run (%s)", ", ".join(ignored), context)


# The flags of `RunConfig.schedule`'s fields: field -> flag.
SCHEDULE_FLAGS = {"learning_rate": "learning_rate", "warmup_steps": "warmup_steps",
                  "decay_steps": "decay_steps", "weight_decay": "weight_decay",
                  "momentum": "momentum", "b1": "beta1", "b2": "beta2", "eps": "adam_eps"}


def given_schedule() -> dict[str, tuple[str, object]]:
  """{schedule field: (flag, value)} of the schedule flags given on the command line."""
  return {field: (flag, FLAGS[flag].value) for field, flag in SCHEDULE_FLAGS.items()
          if FLAGS[flag].present}


def flag_values() -> dict:
  """{name: value} of the flags defined here, as parsed."""
  return {f.name: f.value for f in FLAGS.get_key_flags_for_module(__name__)}


def setup_jax(config: config_lib.RunConfig) -> None:
  """Simulated devices and, for several processes, `jax.distributed` with gloo.

  Must run before JAX initializes its backend.
  """
  jax.config.update("jax_num_cpu_devices", config.num_devices)
  if config.num_processes > 1:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=config.coordinator_address,
                               num_processes=config.num_processes,
                               process_id=config.process_id)
