"""Tests of wus.harness.training.cli: flags to RunConfigs, model defaults, environment."""

import pathlib
from unittest import mock

import pytest
from absl.testing import flagsaver

from wus.harness.training import cli, config
from wus.harness import errors


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


@pytest.mark.parametrize("where", [".", "below"])
def test_output_dir_must_be_a_folder(parse, tmp_path, where):
  file = tmp_path / "a_file"
  file.write_text("")
  flag = str(file if where == "." else file / "run")
  with pytest.raises(errors.InputError, match=rf"--output_dir={flag}: {file} is a file, not a "
                     "folder"):
    parse(f"--output_dir={flag}")


def test_a_new_output_dir_is_fine(parse, tmp_path):
  (run,) = parse("--modes=wus", f"--output_dir={tmp_path / 'new' / 'run'}")
  assert run.output_dir == tmp_path / "new" / "run" / "wus"
  assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("args, ignored", [
    (["--model=transformer_small", "--momentum=0.5", "--beta1=0.8", "--image_size=16"],
     ["--momentum", "--image_size"]),
    (["--model=resnet_small", "--adam_eps=1e-6", "--seq_len=64", "--weight_decay=0.1",
      "--checkpoint_every=5"], ["--adam_eps", "--seq_len", "--checkpoint_every"]),
    (["--model=resnet_small", "--data=synthetic", "--image_size=16", "--optimizer=adam",
      "--beta2=0.99", "--output_dir=/tmp/x", "--keep_checkpoints=2"], []),
])
def test_flags_the_run_does_not_read_are_warned_about(parse, args, ignored):
  with mock.patch.object(cli.logging, "warning") as warning:
    parse(*args)
  if ignored:
    warning.assert_called_once()
    assert warning.call_args.args[1] == ", ".join(ignored)
  else:
    warning.assert_not_called()


def test_the_default_run_is_the_wide_transformer_with_a_small_batch(parse):
  """`wus-train` with no flags: the weight-update-bound configuration the README describes."""
  replicated, sharded = parse()
  assert (sharded.model, sharded.data, sharded.optimizer) == ("transformer_wide", "stdlib", "adam")
  assert (sharded.batch_size, sharded.seq_len, sharded.steps) == (1, 32, 60)
  assert replicated.seq_len == 32
  (other,) = parse("--model=transformer_small", "--modes=wus")
  assert (other.batch_size, other.seq_len) == (4, 128)
  (given,) = parse("--seq_len=64", "--modes=wus")
  assert given.seq_len == 64
