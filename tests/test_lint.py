"""The code passes the project's linter (`ruff check`, configured in pyproject.toml)."""

import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_ruff_check_passes():
  ruff = shutil.which("ruff") or [sys.executable, "-m", "ruff"]
  cmd = [ruff] if isinstance(ruff, str) else ruff
  result = subprocess.run([*cmd, "check", "--no-cache", "--output-format", "concise", str(ROOT)],
                          capture_output=True, text=True, cwd=ROOT)
  assert result.returncode == 0, result.stdout + result.stderr
