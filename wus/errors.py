"""Errors `wus` raises."""


class StateMismatchError(ValueError):
  """Sharded state does not fit the step it was passed to.

  Raised when a `wus.ShardedArray` was made on another mesh (other devices or
  replica count). Recover with `wus.unshard(state)`, placed on the new mesh:
  whole state is always accepted and re-sharded for the step that receives
  it. Sharded state on the same mesh that the step holds another way is
  converted without asking.
  """
