"""The precision pass (Fig. 7): in which dtype a sharded weight is read whole.

A weight the forward pass only ever reads converted to a narrower float
(mixed precision) can be all-gathered in that dtype.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from wus.analysis import compat
from wus.analysis.compat import Jaxpr


def narrowed(jaxpr: Jaxpr, x, members: set[int], readers: dict):
  """The one narrower float dtype every whole reader of `x` converts it to, if any.

  A small dataflow precision pass: follows `x` through pvary (a type change)
  from each reader outside the cluster until a convert_element_type.
  """
  found, stack = set(), [x]
  while stack:
    v = stack.pop()
    for i in readers.get(v, ()):
      eqn = jaxpr.eqns[i]
      if v is x and i in members:
        continue  # The update reads the shard.
      if eqn.primitive is lax.convert_element_type_p:
        new = np.dtype(eqn.params["new_dtype"])
        if not (jnp.issubdtype(new, jnp.floating) and new.itemsize < x.aval.dtype.itemsize):
          return None
        found.add(new)
      elif eqn.primitive is compat.pvary_p:
        stack.extend(eqn.outvars)
      else:
        return None
  return found.pop() if len(found) == 1 else None
