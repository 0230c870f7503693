"""`jax.shard_map`'s equation: its parameters and its body; manual code in a
global-view step (`wus.jit`)."""

from __future__ import annotations

from typing import Any

from jax._src import config as _config
from jax._src import mesh as _mesh_lib
from jax._src import shard_map as _shard_map
from jax._src.shard_map import Infer as INFER  # noqa: F401  (jax.shard_map's in_specs default)

from wus.analysis.compat.handles import (ClosedJaxpr, Jaxpr, JaxprEqn, all_gather_invariant_p,
                                         all_gather_p, all_to_all_p, axis_index_p, pbroadcast_p,
                                         pmax_p, pmin_p, ppermute_p, psum_invariant_p, psum_p,
                                         pvary_p, ragged_all_to_all_p, reduce_scatter_p,
                                         shard_map_p, sub_jaxprs)
from wus.analysis.compat.tracing import dce


def shard_map_eqn(jaxpr: ClosedJaxpr) -> JaxprEqn:
  """The single shard_map equation of a traced `jax.shard_map(f)` call.

  Raises:
    ValueError: if `jaxpr` is not exactly one shard_map equation.
  """
  eqns = [e for e in jaxpr.eqns if e.primitive is shard_map_p]
  if len(eqns) != 1:
    raise ValueError(f"expected one shard_map equation, found {len(eqns)}")
  return eqns[0]


def shard_map_params(eqn: JaxprEqn) -> tuple[Jaxpr, Any, tuple, tuple, frozenset, bool]:
  """(body jaxpr, mesh, in_specs, out_specs, manual axes, check_vma)."""
  p = eqn.params
  return (p["jaxpr"], p["mesh"], p["in_specs"], p["out_specs"],
          frozenset(p["newly_manual_axes"]), p["check_vma"])


def body_without_dead_code(eqn: JaxprEqn) -> Jaxpr:
  """The body of shard_map equation `eqn` without dead code (`dce`)."""
  body, mesh, _, _, manual, check_vma = shard_map_params(eqn)
  return without_dead_code(body, mesh, manual, check_vma)


def without_dead_code(body: Jaxpr, mesh, manual, check_vma: bool) -> Jaxpr:
  """A shard_map body (over `manual` axes of `mesh`, with `check_vma`) without dead code.

  Runs where the body's types hold (its manual axes, its check_vma), as
  shard_map's own DCE rule does: with `jax_enable_checks` JAX type-checks the
  result, and a body's varying types only check inside that context.
  """
  with (_shard_map._extend_axis_env(mesh, manual), _config._check_vma(check_vma),
        _mesh_lib.use_abstract_mesh(_shard_map._as_manual_mesh(mesh, manual))):
    return dce(body)


# Equations that communicate between devices or enter manual (per-device) code:
# an update region run inside a shard_map must not hold one.
_MANUAL = frozenset({shard_map_p, psum_p, psum_invariant_p, pmax_p, pmin_p, pvary_p,
                     all_gather_p, all_gather_invariant_p, reduce_scatter_p, all_to_all_p,
                     ragged_all_to_all_p, ppermute_p, pbroadcast_p, axis_index_p})


def has_manual_code(eqn: JaxprEqn) -> bool:
  """Whether `eqn` is, or holds in a nested jaxpr, a collective or a shard_map."""
  return eqn.primitive in _MANUAL or any(
      has_manual_code(e) for sub in sub_jaxprs(eqn) for e in sub.eqns)
