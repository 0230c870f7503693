"""The table of primitive facts (analysis/primitives.py), tested from the table itself.

As jax/experimental/key_reuse generates its tests from its signature table:
every primitive JAX exposes is either in the table, has a rule of its own in
each pass, or is deliberately left to the passes' conservative default; and
every elementwise entry runs on shards, bit for bit.
"""

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding, PartitionSpec as P

import wus
from helpers import assert_trees_equal, mesh, sharded_leaves
from wus.analysis import compat, primitives, redundancy, shardable

# Primitives JAX defines that no rule covers, each with why the conservative
# default (different on every replica, never on shards) is right.
DEFAULTED = {
    "rng_uniform": "stateful",
    "io_callback": "host effect", "pure_callback": "the host may answer per device",
    "debug_callback": "host effect", "debug_print": "host effect",
    "shard_map": "a nested shard_map", "ffi_call": "foreign code",
    "custom_linear_solve": "sub-jaxprs the passes do not look into",
    "composite": "sub-jaxpr the passes do not look into",
    "custom_partitioning": "user lowering", "custom_vmap_call": "sub-jaxpr",
    "custom_lin": "AD internal", "linear_call": "AD internal", "call": "sub-jaxpr",
    "core_map": "Pallas", "run_state": "stateful", "remat_opt": "sub-jaxpr",
    "cudnn_fusion": "GPU kernel", "call_exported": "serialized foreign program",
    "call_hi_primitive": "hijax", "call_hi_primitive_linearized": "hijax",
    "custom_jvp_call_jaxpr": "pre-AD form, gone after tracing",
    "eval_jaxpr": "sub-jaxpr", "stage": "staging internal", "check": "checkify effect",
    "after_all": "token", "create_token": "token", "psend": "point-to-point send",
    "precv": "point-to-point receive",
    "pbroadcast_dynamic": "GPU-only collective (no CPU lowering to test a rule with)",
    "preduced": "reduced-axes typing",
    "all_gather_reduced": "reduced-axes typing", "inspect_sharding": "host callback",
    "shape_assertion": "export effect", "dim_as_value": "dynamic shapes",
    "dimension_size": "dynamic shapes", "unreachable": "effect",
    "create_linear": "AD internal", "dce_sink": "DCE internal", "tie": "internal",
    "name": "internal", "freeze": "mutable arrays", "get": "state refs", "swap": "state refs",
    "addupdate": "state refs", "broadcast_to": "state refs", "pin": "memory placement",
    "unpin": "memory placement", "with_memory_space_constraint": "memory placement",
    "eq_to": "internal", "le_to": "internal", "lt_to": "internal",
    "to_edtype": "extended dtypes", "from_edtype": "extended dtypes",
    "global_array_to_host_local_array": "multi-host conversion outside jit",
    "host_local_array_to_global_array": "multi-host conversion outside jit",
}


_JAX_MODULES = """
import sys
import jax, jax._src.lax.ann, jax._src.lax.linalg, jax.experimental.multihost_utils
print("\\n".join(n for n in sys.modules if n == "jax" or n.startswith(("jax.", "jaxlib."))))
"""


def _all_primitives():
  """Every primitive object the modules of JAX itself define that `import jax` (with lax's
  ANN and linalg modules and multihost_utils) loads, listed by a fresh interpreter: not the
  Pallas or sparse modules another library imports into this process (Keras does), which
  would make the set depend on which tests ran before."""
  import subprocess
  import sys
  import jax._src.lax.ann  # noqa: F401  Registers every lax primitive.
  import jax._src.lax.linalg  # noqa: F401
  import jax.experimental.multihost_utils  # noqa: F401
  names = subprocess.run([sys.executable, "-c", _JAX_MODULES], capture_output=True,
                         text=True, check=True).stdout.split()
  return {v for name in names if (module := sys.modules.get(name)) is not None
          for v in list(vars(module).values()) if isinstance(v, compat.Primitive)}


def test_every_primitive_is_in_the_table_has_rules_or_is_defaulted_on_purpose():
  table = primitives.ELEMENTWISE | primitives.PURE
  assert not primitives.ELEMENTWISE & primitives.PURE
  assert len(_all_primitives()) > 250  # The enumeration itself works.
  ruled = set(redundancy.redundancy_rules)
  missing = sorted(p.name for p in _all_primitives()
                   if p not in table and p not in ruled and p.name not in DEFAULTED
                   and not p.name.endswith(("_start", "_done")) and "ref" not in p.name
                   and not p.name.startswith(("dot_product_attention", "scaled_", "box_", "new_",
                                              "log_", "empty", "unreduced", "reduced", "vary")))
  # Left out above: async collective halves, mutable refs and boxes, GPU
  # attention kernels: none reach a shard_map body traced from user code.
  assert not missing, f"add these to analysis/primitives.py or DEFAULTED: {missing}"


def test_table_drives_every_pass():
  for p in primitives.ELEMENTWISE | primitives.PURE:
    assert redundancy.redundancy_rules[p] is redundancy.redundancy_rules[lax.add_p]
  for p in primitives.ELEMENTWISE:
    assert shardable.shardable_rules[p] is shardable.shardable_rules[lax.add_p]
  for p in primitives.REDUCTIONS:
    assert p in shardable.shardable_rules


def _unary(prim):
  """An elementwise use of `prim` in an update: g the gradient, m the momentum."""
  def ints(op):  # Through int32 and back, all elementwise.
    return lambda g, m: op((g * 1e4).astype(jnp.int32), (m * 1e4).astype(jnp.int32)).astype(
        jnp.float32) * 1e-4
  integer = {
      lax.clz_p: ints(lambda a, b: lax.clz(a)),
      lax.population_count_p: ints(lambda a, b: lax.population_count(a)),
      lax.shift_left_p: ints(lambda a, b: lax.shift_left(a, 2)),
      lax.shift_right_arithmetic_p: ints(lambda a, b: lax.shift_right_arithmetic(a, 2)),
      lax.shift_right_logical_p: ints(lambda a, b: lax.shift_right_logical(a, 2)),
      lax.and_p: ints(lax.bitwise_and), lax.or_p: ints(lax.bitwise_or),
      lax.xor_p: ints(lax.bitwise_xor), lax.not_p: ints(lambda a, b: lax.bitwise_not(a)),
      compat.mulhi_p: ints(lambda a, b: compat.mulhi_p.bind(a, b)),
  }
  if prim in integer:
    return integer[prim]
  complex_ = {lax.complex_p: lambda z: jnp.real(z) + jnp.imag(z), lax.real_p: jnp.real,
              lax.imag_p: jnp.imag, lax.conj_p: lambda z: jnp.imag(jnp.conj(z))}
  if prim in complex_:
    return lambda g, m: complex_[prim](lax.complex(g, m))
  two = {lax.add_p, compat.add_any_p, lax.atan2_p, lax.div_p, lax.max_p, lax.min_p, lax.mul_p,
         lax.nextafter_p, lax.pow_p, lax.rem_p, lax.sub_p, lax.igamma_p, lax.igammac_p,
         lax.igamma_grad_a_p, lax.polygamma_p, lax.zeta_p}
  compare = {lax.eq_p, lax.ne_p, lax.ge_p, lax.gt_p, lax.le_p, lax.lt_p}
  if prim is compat.add_any_p:
    return lambda g, m: compat.add_any_p.bind(g, m)
  if prim is lax.polygamma_p:
    return lambda g, m: lax.polygamma(jnp.ones_like(g), jnp.abs(g) + jnp.abs(m) + 1.25)
  if prim in two:
    return lambda g, m: getattr(lax, prim.name)(jnp.abs(g) + 1.5, jnp.abs(g) + jnp.abs(m) + 1.25)
  if prim in compare:
    return lambda g, m: jnp.where(getattr(lax, prim.name)(g, m), g, m)
  special = {
      lax.clamp_p: lambda g, m: lax.clamp(-0.5, g, 0.5),
      lax.select_n_p: lambda g, m: lax.select_n(g > 0, g, m),
      lax.convert_element_type_p: lambda g, m: g.astype(jnp.bfloat16).astype(jnp.float32),
      lax.integer_pow_p: lambda g, m: lax.integer_pow(g, 3),
      lax.reduce_precision_p: lambda g, m: lax.reduce_precision(g, 5, 10),
      lax.round_p: lambda g, m: lax.round(g * 10),
      lax.is_finite_p: lambda g, m: jnp.where(lax.is_finite(g), g, 0.0),
      lax.copy_p: lambda g, m: lax.copy_p.bind(g),
      compat.name_p: lambda g, m: checkpoint_name(g * m, "update"),
      lax.square_p: lambda g, m: lax.square(g),
      lax.erf_inv_p: lambda g, m: lax.erf_inv(jnp.tanh(g) * 0.5),
      lax.acosh_p: lambda g, m: lax.acosh(jnp.abs(g) + 1.5),
      lax.acos_p: lambda g, m: lax.acos(jnp.tanh(g) * 0.5),
      lax.asin_p: lambda g, m: lax.asin(jnp.tanh(g) * 0.5),
      lax.atanh_p: lambda g, m: lax.atanh(jnp.tanh(g) * 0.5),
      # Newer JAX only (compat's None otherwise). Coefficients: a replicated scalar, the
      # momentum (sharded with g), a constant; polyval's order is highest degree first.
      compat.polynomial_p: lambda g, m: (
          jnp.polyval(jnp.stack([jnp.float32(0.5), 0.25]), g)
          + compat.polynomial_p.bind(g, jnp.float32(0.5), m, 0.25 * g)),
  }
  if prim in special:
    return special[prim]
  positive = {lax.log_p, lax.log1p_p, lax.sqrt_p, lax.rsqrt_p, lax.lgamma_p, lax.digamma_p,
              lax.cbrt_p, compat.log2_p}
  if prim in positive:
    return lambda g, m: getattr(lax, prim.name)(jnp.abs(g) + 1.0)
  return lambda g, m: getattr(lax, prim.name)(g)


@pytest.mark.slow
def test_betainc_in_an_update_runs_whole_under_check_vma():
  """JAX 0.10 cannot lower betainc on varying operands under check_vma; it stays
  PURE (no shard rule), so the equation runs whole and the rest still shards."""
  _check(lambda g, m: lax.betainc(jnp.abs(g) + 1.0, jnp.abs(m) + 1.0, jnp.full_like(g, 0.5)),
         sharded=False)


# XLA expands the incomplete gamma functions into long series: 13-16 s each to compile,
# opt-in (--slow); every other entry runs by default.
_EXPENSIVE = {"igamma", "igammac", "igamma_grad_a"}
CASES = [pytest.param(p, id=p.name, marks=pytest.mark.slow if p.name in _EXPENSIVE else ())
         for p in sorted(primitives.ELEMENTWISE, key=lambda p: p.name)]


@pytest.mark.parametrize("prim", CASES)
def test_every_elementwise_entry_runs_on_shards_bit_for_bit(prim):
  """A stateful update through `prim`: it shards (the momentum stays sharded) and
  matches the unmodified step exactly."""
  _check(_unary(prim), sharded=True)


def _check(f, sharded: bool):
  def step(params, mom, x):
    g = jax.lax.pmean(jax.grad(lambda p: jnp.mean(jnp.tanh(x @ p)))(params), "data")
    mom = 0.9 * mom + f(g, mom)
    return params - 1e-2 * mom, mom

  m = mesh()
  params = 0.1 * jax.random.normal(jax.random.key(0), (16, 20))
  mom = 0.1 * jax.random.normal(jax.random.key(1), (16, 20))
  kw = dict(mesh=m, in_specs=(P(), P(), P("data")), out_specs=(P(), P()))
  ref, ws = jax.jit(jax.shard_map(step, **kw)), wus.shard_map(step, **kw)
  a = b = (params, mom)
  for i in range(2):
    x = jax.device_put(jax.random.normal(jax.random.key(2 + i), (16, 16)),
                       NamedSharding(m, P("data")))
    try:
      a = ref(*a, x)
    except jax.errors.JaxRuntimeError as e:  # mulhi: XLA cannot lower it under shard_map.
      pytest.skip(f"the unmodified step fails in JAX itself: {str(e).splitlines()[0]}")
    b = ws(*b, x)
  assert_trees_equal(a[0], b[0])
  assert_trees_equal(a[1], wus.unshard(b[1]))
  assert bool(sharded_leaves(b[1])) == sharded, str(ws.plan(*a, x))
