"""Every console command explains itself (issue 23 item 8): `--help` shows the command's
own flags, and JAX's and matplotlib's info logs stay off stderr unless --verbosity asks."""

import os
import shutil
import subprocess
import sysconfig

import pytest


def script(command: str) -> str:
  """The console script `pip install -e .` made for this interpreter."""
  path = os.path.join(sysconfig.get_path("scripts"), command)
  return path if os.path.exists(path) else shutil.which(command)


@pytest.mark.parametrize("command, doc, own_flags", [
    ("wus-train", "trains a model with and without wus", ["--model", "--optimizer", "--steps",
                                                          "--warmup_steps", "--output_dir"]),
    ("wus-memory", "`wus-memory`: per-device memory", ["--models", "--num_devices",
                                                        "--output_dir"]),
    ("wus-bench", "`wus-bench`: wus beside", ["--model", "--regimes", "--rounds",
                                              "--group_sizes", "--output"]),
    ("wus-scale", "`wus-scale`: the cost model", ["--alpha_us", "--group_size", "--output"]),
])
def test_help_shows_the_commands_own_flags(command, doc, own_flags):
  out = subprocess.run([script(command), "--help"], capture_output=True, text=True,
                       timeout=300)
  text = out.stdout + out.stderr  # absl's --help exits with status 1
  for flag in own_flags:
    assert f"  {flag}:" in text, (flag, text[:3000])
  assert doc in text


def test_no_info_logs_on_stderr(tmp_path):
  """wus-memory on the smallest case: stderr has its progress lines only (before: JAX's
  'Unable to initialize backend' and matplotlib's 'generated new fontManager')."""
  out = subprocess.run([script("wus-memory"), "--models=mlp_large",
                        "--num_devices=2", f"--output_dir={tmp_path}"],
                       capture_output=True, text=True, timeout=900, env={
                           **os.environ, "XLA_FLAGS": "", "MPLCONFIGDIR": str(tmp_path / "mpl")})
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stderr.splitlines() == ["compiling mlp_large + adam, N=2 ..."], out.stderr[-2000:]
