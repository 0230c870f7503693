"""The one place wus touches JAX internals (DESIGN.md §4, invariant 4).

Everything else in wus names primitives through the objects exported here and
reads control-flow equations through the records below, never by string; it
imports this package (`from wus.analysis import compat`, then `compat.X`), not
its modules. Supports jax 0.10.2 through 0.12 (the range pinned in
pyproject.toml, both ends tested by .ci/run) by feature detection, never by
version string: a primitive a release lacks is None here, a moved parameter or
configuration is looked for where each release keeps it. When a later JAX moves
a name, only these modules change (`tests/test_lint.py` fails for a `jax._src`
or `jax.extend` import anywhere else).

Modules, one concern each:
  handles       jaxpr types, primitive objects, an equation's inner jaxprs, literals, effects
  control_flow  `cond`, `while` and `scan` as records (`Cond`, `Loop`), re-bound through lax
  axes          mesh axes in equations and types: collectives' axes, renaming, varying types
  source        where an equation came from in the user's code
  tracing       equations re-bound under a new trace, dead-code elimination, static arguments
  shard_map     the shard_map equation's parameters and body; manual code in a global view
"""

from __future__ import annotations

from wus.analysis.compat.handles import (add_any_p, all_gather_invariant_p, all_gather_p,
                                         all_to_all_p, approx_top_k_p, axis_index_p, call_jaxpr,
                                         CALL_JAXPR_PARAM, closed_call_p, ClosedJaxpr, cond_p,
                                         custom_jvp_call_p, custom_vjp_call_p, device_put_p,
                                         DropVar, fresh_var, geqp3_p, geqrf_p, iota_2x32_shape_p,
                                         is_literal, is_ref_type,
                                         is_zero_literal, Jaxpr, JaxprEqn, jit_p,
                                         layout_constraint_p, Literal, log2_p, mulhi_p, name_p,
                                         one_minus_square_p, pbroadcast_p, polynomial_p,
                                         philox2x32_p, philox4x32_p, platform_index_p, pmax_p,
                                         pmin_p, ppermute_p, Primitive, psum_invariant_p, psum_p,
                                         pvary_p, ragged_all_to_all_p, ragged_dot_general_p,
                                         random_bits_p, random_clone_p, random_fold_in_p,
                                         random_gamma_p, random_seed_p, random_split_p,
                                         random_unwrap_p, random_wrap_p, reduce_scatter_p,
                                         relayout_p, remat_p, reshard_p, scan_p, shard_map_p,
                                         side_effects, stack_p, sub_jaxprs, threefry2x32_p,
                                         threefry4x32_p, tile_p, unstack_p, Var, while_p,
                                         zeros_like_p)
from wus.analysis.compat.control_flow import (Atom, Cond, cond, loop, Loop, with_branches)
from wus.analysis.compat.source import (has_user_frame, source_line)
from wus.analysis.compat.axes import (collective_axes, constraint_spec, explicit_axes, lays_out,
                                      has_axis_index_groups, has_result_layout, laid_out,
                                      legacy_mesh,
                                      is_sharding_constraint, match_varying,
                                      names_axes, placement_axes, renamed_axes, sharding_spec,
                                      to_varying, type_axes, varying_axes,
                                      without_result_layout)
from wus.analysis.compat.tracing import (attributed, bind, bind_elementwise, dce, dce_eqn,
                                         in_current_mesh, is_staging_tracer, rebind,
                                         rebind_call, retyped, source_of, static_args,
                                         without_refs)
from wus.analysis.compat.shard_map import (body_without_dead_code, has_manual_code, INFER,
                                           shard_map_eqn, shard_map_params, without_dead_code)
