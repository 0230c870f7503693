"""The error a console command (`wus-train`, ...) reports as one line: a problem with the
user's input (`console.Command`)."""


class InputError(Exception):
  """Flags, data or a checkpoint that cannot be used as given.

  The message says what is wrong and names the flag or path; the command prints
  it as a single line and exits with status 1, without a traceback.
  """
