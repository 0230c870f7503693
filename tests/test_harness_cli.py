"""Tests of wus.harness.cli: flags to RunConfigs, model defaults, environment."""

import pathlib

import pytest
from absl.testing import flagsaver

from wus.harness import cli, config, errors


@pytest.fixture
def parse():
  """Parses `wus-train` flags, restoring them afterwards; returns the configs."""
  with flagsaver.flagsaver():
    def _parse(*args):
      cli.FLAGS.unparse_flags()
      cli.FLAGS(["wus-train", *args])
      return cli.configs_from_flags()
    yield _parse
  cli.FLAGS.unparse_flags()


def test_defaults_follow_the_model(parse):
  replicated, sharded = parse("--model=resnet_small", "--output_dir=/tmp/x")
  assert (replicated.mode, sharded.mode) == ("replicated", "wus")
  defaults = config.MODEL_DEFAULTS["resnet_small"]
  assert (sharded.data, sharded.optimizer, sharded.learning_rate, sharded.steps) == (
      defaults["data"], defaults["optimizer"], defaults["learning_rate"], defaults["steps"])
  assert sharded.warmup_steps == int(config.WARMUP_FRACTION * defaults["steps"])
  assert sharded.output_dir == pathlib.Path("/tmp/x/wus")
  assert (sharded.num_processes, sharded.process_id) == (1, 0)


def test_given_flags_win(parse):
  (run,) = parse("--model=resnet_small", "--modes=wus", "--optimizer=adam", "--steps=7",
                 "--warmup_steps=2", "--batch_size=3", "--data=synthetic")
  assert (run.optimizer, run.learning_rate, run.steps, run.warmup_steps, run.batch_size,
          run.data) == ("adam", config.OPTIMIZER_LEARNING_RATES["adam"], 7, 2, 3, "synthetic")
  assert run.optimizer_hyperparameters()["b2"] == 0.98
  assert run.output_dir is None


def test_processes_from_the_environment(parse, monkeypatch):
  monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "127.0.0.1:1234")
  monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
  monkeypatch.setenv("JAX_PROCESS_ID", "1")
  (run,) = parse("--modes=wus", "--num_devices=4")
  assert (run.coordinator_address, run.num_processes, run.process_id, run.num_devices) == (
      "127.0.0.1:1234", 2, 1, 4)
  (run,) = parse("--modes=wus", "--process_id=0")
  assert run.process_id == 0


@pytest.mark.parametrize("args, env, match", [
    (["--num_processes=2", "--process_id=2", "--coordinator_address=h:1"], {},
     "--process_id=2 must be below --num_processes=2"),
    (["--num_processes=2"], {}, "needs --coordinator_address"),
    ([], {"JAX_NUM_PROCESSES": "two"}, r"\$JAX_NUM_PROCESSES='two' is not valid"),
])
def test_inconsistent_processes(parse, monkeypatch, args, env, match):
  for k, v in env.items():
    monkeypatch.setenv(k, v)
  with pytest.raises(errors.InputError, match=match):
    parse(*args)
