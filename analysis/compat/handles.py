"""JAX's jaxpr types and primitive objects, and reading an equation's parts.

Everything else in wus names a primitive through an object exported here,
never by string (DESIGN.md §4, invariant 4)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as _np
from jax._src import ad_checkpoint as _ad_checkpoint
from jax._src import ad_util as _ad_util
from jax._src import core as _core
from jax._src import dispatch as _dispatch
from jax._src import pjit as _pjit
from jax._src.lax import ann as _ann
from jax._src.lax import lax as _lax
from jax._src.lax import linalg as _linalg
from jax._src.lax import parallel as _parallel
from jax._src.lax.control_flow import conditionals as _conditionals
from jax._src.random import core as _random_core
from jax._src.random import philox2x32 as _philox2x32
from jax._src.random import philox4x32 as _philox4x32
from jax._src.random import prng as _prng
from jax._src.random import threefry4x32 as _threefry4x32
from jax._src.shard_map import shard_map_p  # noqa: F401  (re-exported)
from jax.extend import core as _ecore
from jax.extend.core import primitives as _p

# Types.
ClosedJaxpr = _ecore.ClosedJaxpr
Jaxpr = _ecore.Jaxpr
JaxprEqn = _ecore.JaxprEqn
Literal = _ecore.Literal
Var = _ecore.Var
DropVar = _ecore.DropVar
Primitive = _ecore.Primitive

# Collectives. With check_vma=True `lax.psum` binds psum_invariant and AD
# inserts it as the transpose of pvary (DESIGN.md §5).
psum_p = _p.psum_p
psum_invariant_p = _parallel.psum_invariant_p
pmax_p = _p.pmax_p
pmin_p = _p.pmin_p
pvary_p = _core.pvary_p
all_gather_p = _p.all_gather_p
all_gather_invariant_p = _parallel.all_gather_invariant_p
reduce_scatter_p = _parallel.reduce_scatter_p
all_to_all_p = _p.all_to_all_p
ragged_all_to_all_p = _p.ragged_all_to_all_p
ppermute_p = _p.ppermute_p
pbroadcast_p = _parallel.pbroadcast_p
axis_index_p = _p.axis_index_p

# Control flow and calls.
cond_p = _p.cond_p
while_p = _p.while_p
scan_p = _p.scan_p
jit_p = _p.jit_p
closed_call_p = _p.closed_call_p
remat_p = _p.remat_p
custom_jvp_call_p = _p.custom_jvp_call_p
custom_vjp_call_p = _p.custom_vjp_call_p

# Not exported by jax.lax.
add_any_p = _p.add_jaxvals_p
random_bits_p = _p.random_bits_p
random_split_p = _p.random_split_p
random_fold_in_p = _p.random_fold_in_p
random_seed_p = _p.random_seed_p
random_wrap_p = _prng.random_wrap_p
random_unwrap_p = _prng.random_unwrap_p
threefry2x32_p = _p.threefry2x32_p
threefry4x32_p = _threefry4x32.threefry4x32_p
philox2x32_p = _philox2x32.philox2x32_p
philox4x32_p = _philox4x32.philox4x32_p
iota_2x32_shape_p = _prng.iota_2x32_shape_p
random_gamma_p = _random_core.random_gamma_p
random_clone_p = _random_core.random_clone_p
# jax.numpy's stack / unstack / tile bind primitives of their own (jax 0.10).
stack_p = _lax.stack_p
unstack_p = _lax.unstack_p
tile_p = _lax.tile_p
mulhi_p = _lax.mulhi_p
ragged_dot_general_p = _lax.ragged_dot_general_p
approx_top_k_p = _ann.approx_top_k_p
platform_index_p = _conditionals.platform_index_p
reshard_p = _pjit.reshard_p
layout_constraint_p = _pjit.layout_constraint_p
device_put_p = _dispatch.device_put_p
zeros_like_p = _ad_util.zeros_like_p
# `jax.ad_checkpoint.checkpoint_name(x, name)`: x, named for remat policies.
name_p = _ad_checkpoint.name_p
geqrf_p = _linalg.geqrf_p
geqp3_p = _linalg.geqp3_p

# Primitives of later JAX releases, None where the installed JAX has none (jax
# 0.10 computes jnp.log2 as log / log(2) and has no relayout or polynomial).
log2_p = getattr(_lax, "log2_p", None)
one_minus_square_p = getattr(_lax, "one_minus_square_p", None)
polynomial_p = getattr(_lax, "polynomial_p", None)
relayout_p = getattr(_pjit, "relayout_p", None)


# Calls whose inner jaxpr is evaluated as is: (primitive, param holding it).
# After AD the custom_jvp/custom_vjp rules are dead; evaluating call_jaxpr is
# exactly what XLA runs.
CALL_JAXPR_PARAM: dict[Primitive, str] = {
    jit_p: "jaxpr",
    closed_call_p: "call_jaxpr",
    custom_jvp_call_p: "call_jaxpr",
    custom_vjp_call_p: "call_jaxpr",
    remat_p: "jaxpr",
}


def fresh_var(v: Var) -> Var:
  """A new variable of `v`'s type (a dropped result stays dropped)."""
  return DropVar(v.aval) if isinstance(v, DropVar) else Var(v.aval)


def call_jaxpr(eqn: JaxprEqn) -> ClosedJaxpr:
  """The inner jaxpr of a call-like equation, closed (remat holds an open one)."""
  inner = eqn.params[CALL_JAXPR_PARAM[eqn.primitive]]
  return inner if isinstance(inner, ClosedJaxpr) else ClosedJaxpr(inner, ())


def sub_jaxprs(eqn: JaxprEqn) -> Iterator[Jaxpr]:
  """Every jaxpr held in an equation's params, found generically."""
  yield from _core.jaxprs_in_params(eqn.params)


def is_literal(atom: Any) -> bool:
  return isinstance(atom, Literal)


def is_ref_type(aval: Any) -> bool:
  """Whether `aval` is the type of a JAX ref (`jax.new_ref`; Flax NNX's ref Variables)."""
  from jax._src.state.types import AbstractRef  # noqa: PLC0415
  return isinstance(aval, AbstractRef)


def is_zero_literal(atom: Any) -> bool:
  """Whether a literal is zero (every element)."""
  return is_literal(atom) and not _np.any(_np.asarray(atom.val))


def side_effects(eqn: JaxprEqn) -> set:
  """An equation's effects, without the axis-name bookkeeping of collectives.

  Collectives carry a `NamedAxisEffect` that only records which axis names
  they use; it is not I/O, state or randomness.
  """
  return {e for e in eqn.effects if not isinstance(e, _core.NamedAxisEffect)}
