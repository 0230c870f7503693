"""Errors `wus` raises."""


class StateMismatchError(ValueError):
  """Sharded state does not fit the step it was passed to.

  Raised when a `wus.ShardedArray` was made for another mesh, replica count
  or plan. Recover with `wus.unshard(state)`: whole state is always accepted
  and re-sharded for the step that receives it.
  """
