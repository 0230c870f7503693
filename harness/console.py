"""What every console script of the harness shares: one entry point (`Command`).

`wus-train`, `wus-memory`, `wus-bench` and `wus-scale` are each a `Command`:
a name, a body that reads absl flags, the module whose flags `--help` shows.
The command defines its flags, runs the body under absl with quiet logs,
refuses positional arguments, and prints an `errors.InputError` (a bad flag,
data or checkpoint) as one line, `<name>: error: <message>`, exiting with
status 1 and no traceback.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable

from absl import app, flags, logging

from wus.harness import errors


def quiet_logs() -> None:
  """Logs warnings and errors only, unless --verbosity was given.

  absl's `app.run` turns on info logs, which JAX ("Unable to initialize backend"),
  Orbax and matplotlib ("generated new fontManager") write a lot of; `--verbosity=0`
  shows them.
  """
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)


@dataclasses.dataclass(frozen=True)
class Command:
  """A console script of the harness.

  Attributes:
    name: as typed (`wus-train`); it starts each one-line error.
    body: runs the command on the parsed flags (`flags.FLAGS`); raises
      `errors.InputError` for input it cannot use.
    doc: what `--help` prints above the flags (the module's docstring).
    flags_module: the module defining the flags `--help` lists.
    define_flags: defines them, if importing `flags_module` does not; it may be
      called more than once.
  """

  name: str
  body: Callable[[], None]
  doc: str
  flags_module: str
  define_flags: Callable[[], None] | None = None

  def main(self, argv: list[str]) -> None:
    """absl's main: `argv` is what is left of the command line after the flags.

    Raises:
      SystemExit: a positional argument, or an `errors.InputError` from the body,
        with the one-line message.
    """
    if len(argv) > 1:
      sys.exit(f"{self.name}: error: unexpected arguments {argv[1:]}; flags are --name=value")
    try:
      self.body()
    except errors.InputError as e:
      sys.exit(f"{self.name}: error: {e}")

  def run(self) -> None:
    """The console script's entry point: flags defined and parsed, `main` run by absl.

    `--help` shows `doc` and the flags of `flags_module`: absl shows those of
    the module named sys.argv[0], which for a console script is a generated
    wrapper.
    """
    if self.define_flags is not None:
      self.define_flags()
    main_module = sys.modules["__main__"]
    main_module.__doc__ = main_module.__doc__ or self.doc
    for flag in flags.FLAGS.get_key_flags_for_module(self.flags_module):
      flags.FLAGS.register_key_flag_for_module(sys.argv[0], flag)

    def quiet_main(argv):
      quiet_logs()
      return self.main(argv)

    app.run(quiet_main)
