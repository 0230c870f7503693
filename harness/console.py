"""What every console script of the harness shares: `--help` and quiet logs."""

from __future__ import annotations

import sys
from collections.abc import Callable

from absl import app, flags, logging


def quiet_logs() -> None:
  """Logs warnings and errors only, unless --verbosity was given.

  absl's `app.run` turns on info logs, which JAX ("Unable to initialize backend"),
  Orbax and matplotlib ("generated new fontManager") write a lot of; `--verbosity=0`
  shows them.
  """
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)


def run_console(main: Callable, doc: str, module: str) -> None:
  """Runs a console script's `main` with absl, logs at warnings (`quiet_logs`).

  `--help` shows `doc` and the flags `module` defines: absl shows those of the
  module named sys.argv[0], which for a console script is a generated wrapper.
  """
  main_module = sys.modules["__main__"]
  main_module.__doc__ = main_module.__doc__ or doc
  for flag in flags.FLAGS.get_key_flags_for_module(module):
    flags.FLAGS.register_key_flag_for_module(sys.argv[0], flag)

  def quiet_main(argv):
    quiet_logs()
    return main(argv)

  app.run(quiet_main)
