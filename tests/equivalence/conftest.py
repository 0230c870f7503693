"""The equivalence tests run with `jax_enable_checks` (issue 19 item 7).

JAX then type-checks every jaxpr it builds (the rewritten step's included)
and checks its internal invariants as it traces; a rewrite that emits an
ill-typed equation fails here even where its numbers would come out right.
"""

import jax
import pytest


@pytest.fixture(autouse=True)
def _jax_checks():
  with jax.enable_checks(True):
    yield
