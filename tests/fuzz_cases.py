"""Hypothesis strategies and builders for the differential fuzzer (test_fuzz.py).

A case is a complete data-parallel training program written as users write it:
a random parameter tree, a loss that uses each parameter the way a real layer
does (a matmul with a broadcast bias, a convolution, a LayerNorm-style scale
and shift, an embedding lookup, a scalar, an elementwise tensor), a random
optax chain over the transform catalogue, a replica count N and check_vma;
sometimes a second mesh axis "model" of 2 devices (issue 29) with dense layers
column-parallel over it (Megatron: the kernel's output dim and the bias split by the
in_specs, the layer's loss term summed over "model", under shard_map; placed so on the
global arrays of a jax.jit step), every other weight whole.

The global-view steps (`wus.jit` against `jax.jit`, on Auto axes or on Explicit
axes as `jax.make_mesh` makes them) also run on the meshes of issue 37
(`global_meshes`): tensor parallelism over a "model" axis of 1 or 2 devices
(with a size-1 "tensor" axis after it sometimes; a size-1 axis the weights'
specs, and so their types, name), with vocabulary-split embeddings looked up with
`table.at[ids].get(out_sharding=...)` and tied heads given their `out_sharding`;
FSDP over the batch axis, HSDP over ("replica", "fsdp"), data x fsdp x tensor
on up to 8 devices, each matrix whose first dim divides the FSDP axis placed over
it and, on Explicit axes, resharded whole before use
(`jax.sharding.reshard(w, P())`, as JAX's sharding guide writes FSDP). The batch
is placed over the batch axes by the caller, or passed replicated and split
inside the step by `with_sharding_constraint` (pjit-era code; `reshard` on
Explicit axes, where a constraint only asserts the type).

Every case is *generated as Python source*: `Case.script()` is a standalone
program (runnable with `XLA_FLAGS=--xla_force_host_platform_device_count=8
python repro.py`) that runs the unmodified `jax.jit(jax.shard_map(step))` and
`wus.shard_map(step)` from the same inputs and compares them. The test
executes that same source (`Case.build()`), so a falsifying example printed by
hypothesis is its own reproduction script, with nothing to transcribe.

The helpers below marked "(emitted)" are copied verbatim into every script
with `inspect.getsource`, so the test and the script share one definition.
"""

from __future__ import annotations

import dataclasses
import inspect
import linecache
import textwrap
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import assume, strategies as st

import wus

REPLICAS = (2, 3, 4, 6, 8)
FEATURES = 16      # Width of the batch's float features x: [N * PER_REPLICA, FEATURES].
NUM_IDS = 4        # Integer ids per example (embedding lookups): [N * PER_REPLICA, NUM_IDS].
PER_REPLICA = 2    # Examples per replica per step.
BIG = 64           # A Plan cluster holding a tensor this large (and >= N) counts as "big".


# --- Helpers copied into every script (emitted). -----------------------------

def init(seed, shape, dtype="float32", scale=0.1, offset=0.0):
  """A parameter leaf: offset + scale * normal, in `dtype` (numpy: nothing to compile)."""
  x = offset + scale * np.random.default_rng(seed).standard_normal(shape, np.float32)
  return jnp.asarray(x, dtype)


def top_keys(*names):
  """Mask for optax.masked / add_decayed_weights: True under the named top-level keys."""
  return lambda tree: {k: jax.tree.map(lambda _: k in names, v) for k, v in tree.items()}


def ndim_at_least(k):
  """Mask: True for leaves with at least k dims (the usual "decay kernels, not biases")."""
  return lambda tree: jax.tree.map(lambda x: jnp.ndim(x) >= k, tree)


def labels_by_top_key(names, inside, outside):
  """Labels for optax.multi_transform: `inside` under the named top-level keys."""
  return lambda tree: {k: jax.tree.map(lambda _: inside if k in names else outside, v)
                       for k, v in tree.items()}


def labels_by_ndim(k, high, low):
  """Labels for optax.multi_transform: `high` for leaves with at least k dims."""
  return lambda tree: jax.tree.map(lambda x: high if jnp.ndim(x) >= k else low, tree)


def run(f, args, batches):
  """Calls the step once per batch, feeding its state outputs back; returns the last outputs."""
  out = None
  for b in batches:
    out = f(*args, b)
    args = out[:-1]
  return out


def reorders_sums(tx, params):
  """Whether `tx.update` sums floats over more than one element (norms, means, dot products).

  Read off the update's jaxpr for this parameter tree, nested jaxprs
  included: wus computes such a sum as per-shard partial sums plus an
  all-reduce, a different summation order; max, min, all and any are exact."""
  def visit(jaxpr) -> bool:
    for eqn in jaxpr.eqns:
      name = eqn.primitive.name
      floats = any(jnp.issubdtype(v.aval.dtype, jnp.inexact) for v in eqn.invars
                   if hasattr(v.aval, "dtype"))
      if floats and name in ("reduce_sum", "reduce_prod"):
        shape = eqn.invars[0].aval.shape
        if np.prod([shape[a] for a in eqn.params["axes"]]) > 1:
          return True
      if floats and name in ("dot_general", "conv_general_dilated", "cumsum", "cumprod",
                             "cumlogsumexp", "reduce_window_sum"):
        return True
      for param in eqn.params.values():
        for sub in param if isinstance(param, (tuple, list)) else (param,):
          sub = getattr(sub, "jaxpr", sub)
          if hasattr(sub, "eqns") and visit(sub):
            return True
    return False

  update = lambda g, s, p: tx.update(g, s, p)
  return visit(jax.make_jaxpr(update)(params, tx.init(params), params).jaxpr)


def tolerance(dtype, reduces, bf16, phased=False):
  """(rtol, atol) for one leaf, or (0, 0) for bit-for-bit.

  * The chain is elementwise (no reduction anywhere): every leaf bit for bit.
    Under the tests' XLA flags (no FMA contraction, bfloat16 rounded after
    every op: tests/conftest.py) the same elementwise formula rounds the same
    way on a shard as on the whole tensor, so nothing less is acceptable.
  * The chain reduces (`reorders_sums`: global norm, trust ratio, LARS/LAMB,
    Adafactor, clip_by_block_rms, NovoGrad, Fromage, ...): wus sums each shard and
    all-reduces the partial sums, a different summation order. So does a
    batch split over two mesh axes of more than one device (HSDP, data x
    fsdp; `sums_reordered`) for every chain: the unmodified step all-reduces
    each gradient over both axes at once, wus reduce-scatters over one and then
    the other (§5.1, multi-phase), the same sum of the same terms in another order. A float32 sum
    of K terms then differs by a few ulps (eps = 1.2e-7, error ~ sqrt(K) eps),
    and 2-3 steps of an update that divides by such sums (Adam's sqrt(nu),
    a trust ratio) amplify that, most by a few hundred ulps; a chain that
    then divides by a difference of close values (AdaBelief's and ACProp's
    (g - m)^2) by more (seen: 480 ulps in RMSProp's nu after 3 steps of LAMB,
    RMSProp, ACProp and Nesterov momentum on 6 replicas): rtol 1e-4.
    The error of a reordered sum is relative to the sum, i.e. to the scale
    of the whole tensor, not of each element: an element that is small
    because the update cancelled most of the weight (a trust ratio with no
    learning rate moves a weight by its own norm) carries the absolute error
    of the big terms. So `compare` allows |diff| <= atol + rtol * max(|x|,
    max |leaf|), atol 1e-6. (Seen: a [3, 11] table with max 4.5 differs by
    1.4e-6 in an element of 0.037; both programs are 2e-6 from float64.)
  * The chain reduces and some weights are bfloat16 (stored, or cast to
    bfloat16 by the forward pass): a few-ulp change of a float32 update can
    round a bfloat16 weight (or bfloat16 state) the other way, one bfloat16
    ulp (<= 2^-7 relative). The next forward pass
    then sees that weight, so every later gradient, state and weight, float32
    ones included, may move by an amount of that order times the loss's
    sensitivity: rtol 2^-6 (two bfloat16 ulps), atol 1e-3 (weights and
    gradients here are O(0.1-1)). Integer leaves stay exact in every case.
  * Bfloat16 gradients summed over two batch axes (`phased`): XLA:CPU's one
    all-reduce of bfloat16 values sums them in float32 and rounds once; wus's
    reduce-scatter over one axis, then the other, rounds the partial sums to
    bfloat16 in between: one bfloat16 rounding more (2^-9 of a partial sum),
    which an update that divides an element by an earlier step's moment of
    it (adopt: g_t / sqrt(nu_{t-1})) magnifies by |g| / sqrt(nu) (seen: an
    element of adopt's mu 0.0011 against 0.0048, clipped updates of 0.1;
    tests/equivalence/test_regressions.py, the phased bfloat16 sum): atol 1e-2.
  """
  if not np.issubdtype(dtype, np.inexact) and dtype != jnp.bfloat16:
    return 0.0, 0.0
  if not reduces:
    return 0.0, 0.0
  if bf16:
    return 2.0 ** -6, 1e-2 if phased else 1e-3
  return 1e-4, 1e-6


def compare(want, got, *, reduces, bf16, phased=False):
  """Mismatches between the unmodified step's outputs and wus's (after wus.unshard).

  `reduces`, `bf16`, `phased`: as `tolerance` reads them. Returns a list of messages (empty
  when they agree) and the largest |difference| / bound seen on a toleranced leaf (0 if
  none)."""
  got = wus.unshard(got)
  if jax.tree.structure(want) != jax.tree.structure(got):
    return [f"tree structure differs: {jax.tree.structure(want)} vs {jax.tree.structure(got)}"], 0.0
  msgs, worst = [], 0.0
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(want)[0], jax.tree.leaves(got)):
    name = jax.tree_util.keystr(path)
    if jax.dtypes.issubdtype(getattr(a, "dtype", None), jax.dtypes.prng_key):
      a, b = jax.random.key_data(a), jax.random.key_data(b)
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or a.dtype != b.dtype:
      msgs.append(f"{name}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}")
      continue
    rtol, atol = tolerance(a.dtype, reduces, bf16, phased)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
      eq = (a64 == b64) | (np.isnan(a64) & np.isnan(b64))
      diff = np.where(eq, 0.0, np.abs(a64 - b64))  # inf or nan where only one side is finite.
      scale = np.max(np.abs(a64[np.isfinite(a64)]), initial=0.0)  # The leaf's scale (`tolerance`).
      bound = atol + rtol * np.maximum(np.abs(a64), scale)
      bad = ~eq & (~(diff <= bound) | ~np.isfinite(a64) | ~np.isfinite(b64))  # inf, nan: exact.
      if rtol or atol:
        ratio = np.where(np.isfinite(diff), diff / bound, 0.0)
        worst = max(worst, float(np.max(ratio, initial=0.0)))
    if bad.any():
      i = np.unravel_index(np.argmax(bad), bad.shape) if bad.ndim else ()
      kind = "bit for bit" if not (rtol or atol) else f"rtol={rtol:g} atol={atol:g}"
      msgs.append(f"{name} {a.dtype}{list(a.shape)}: {int(bad.sum())}/{bad.size} elements differ "
                  f"({kind}); first at {tuple(int(j) for j in i)}: want {a[i]!r}, got {b[i]!r}, "
                  f"max |diff| {float(np.nanmax(diff, initial=0.0)):.3g}")
  return msgs, worst


# --- Parameter trees and the loss. -------------------------------------------

@dataclasses.dataclass(frozen=True)
class Layer:
  """One parameter group and how the loss uses it.

  kind: "tensor" (a bare 1-D..4-D leaf used elementwise), "scalar" (a bare
  () leaf), "dense" (w [din, dout], optional bias b [dout]: x @ w + b), "conv"
  (kernel [kh, kw, cin, cout] HWIO, optional bias: lax.conv_general_dilated),
  "norm" (gamma, optional beta, 1-D or 2-D, broadcast over the batch like
  LayerNorm's), "embed" (table [vocab, d], rows taken with integer ids,
  optionally tied: also the output projection x @ table.T).
  """

  kind: str
  name: str
  where: str              # "top", "blocks" (a list) or "enc" (a nested dict).
  dims: tuple[int, ...]   # kind-specific sizes (see `params`).
  dtype: str
  flag: bool              # dense/conv/norm: has a bias/beta; embed: tied.
  seed: int
  mixed: bool = False     # dense/conv/embed with float32 weights: computed in bfloat16.
  split: bool = False     # dense: column-parallel over the model axes; embed: vocabulary-split.

  def shapes(self) -> dict[str, tuple[int, ...]] | tuple[int, ...]:
    """Leaf key -> shape (or one shape for a bare leaf)."""
    d = self.dims
    if self.kind in ("tensor", "scalar"):
      return d
    main = {"dense": "w", "conv": "kernel", "norm": "scale", "embed": "table"}[self.kind]
    bias = {"dense": ("b", d[1:]), "conv": ("bias", d[3:]), "norm": ("shift", d)}.get(self.kind)
    return {main: d, **(dict([bias]) if self.flag and bias else {})}

  def params(self) -> dict[str, str] | str:
    """Leaf key -> init expression (or one expression for a bare leaf)."""
    scales = {"scalar": dict(scale=0.5), "w": dict(scale=0.3), "kernel": dict(scale=0.3),
              "scale": dict(offset=1.0), "table": dict(scale=0.5)}
    leaf = lambda k, shape, key: (f"init({self.seed + k}, {tuple(shape)!r}, {self.dtype!r}"
                                  + "".join(f", {a}={v!r}" for a, v in scales.get(key, {}).items())
                                  + ")")
    shapes = self.shapes()
    if not isinstance(shapes, dict):
      return leaf(0, shapes, self.kind)
    return {key: leaf(k, shape, key) for k, (key, shape) in enumerate(shapes.items())}

  def specs(self, mesh: Mesh) -> dict[str, str] | str:
    """Leaf key -> its spec as source (as `params`): its in_spec under shard_map, its
    placement under jax.jit. A column-parallel dense layer splits its kernel's columns and
    its bias over the model axes (Megatron), a vocabulary-split table its rows (Megatron's
    VocabParallelEmbedding); with an FSDP axis, the first dim of every other matrix that
    divides its size is placed over it (MaxText's FSDP); the rest is whole, P()."""
    def spec(key, shape):
      dims = [None] * len(shape)
      if self.split and key in ("w", "b"):
        dims[-1] = mesh.model_spec
      elif self.split and key == "table":
        dims[0] = mesh.model_spec
      if (mesh.fsdp and len(shape) >= 2 and dims[0] is None
          and shape[0] % mesh.size(mesh.fsdp) == 0):
        dims[0] = mesh.fsdp
      return f"P({', '.join(map(repr, dims))})" if any(dims) else "P()"
    shapes = self.shapes()
    if not isinstance(shapes, dict):
      return spec(self.kind, shapes)
    return {key: spec(key, shape) for key, shape in shapes.items()}

  def loss_lines(self, p: str) -> list[str]:
    """Source lines adding this layer's term to `total`; `p` is its accessor."""
    d = self.dims
    if self.kind == "tensor":
      return [f"total = total + jnp.sum(jnp.sin({p} * s))"]
    if self.kind == "scalar":
      return [f"total = total + jnp.mean(jnp.tanh(x * {p}) ** 2)"]
    cast = ".astype(jnp.bfloat16)" if self.mixed else ""  # Mixed precision: bf16 compute.
    if self.kind == "dense":
      bias = f" + {p}['b']" if self.flag else ""
      w = f"{p}['w']{cast}"
      if self.split:  # This replica's columns: the mean over all of them sums over "model".
        return [f"h = x[:, :{d[0]}].astype({w}.dtype) @ {w}{bias}  # Columns of this rank.",
                "total = total + over_model(jnp.mean(jnp.tanh(h) ** 2))"]
      return [f"h = x[:, :{d[0]}].astype({w}.dtype) @ {w}{bias}",
              "total = total + jnp.mean(jnp.tanh(h) ** 2)"]
    if self.kind == "conv":
      kh, kw, cin, cout = d
      bias = f" + {p}['bias']" if self.flag else ""
      k = f"{p}['kernel']{cast}"
      return [f"img = x.reshape(-1, 4, 4, 1) * jnp.linspace(0.5, 1.5, {cin})  # NHWC",
              f"h = conv(img.astype({k}.dtype), {k}){bias}",
              "total = total + jnp.mean(jnp.tanh(h) ** 2)"]
    if self.kind == "norm":
      size = int(np.prod(d))
      shift = f" + {p}['shift']" if self.flag else ""
      return [f"a = jnp.tanh(x[:, :1] * jnp.linspace(-1.0, 1.0, {size}) + x[:, 1:2])"
              f".reshape(-1, *{tuple(d)!r})",
              "a = (a - a.mean(-1, keepdims=True)) / jnp.sqrt(a.var(-1, keepdims=True) + 1e-5)",
              f"total = total + jnp.mean(jnp.tanh(a * {p}['scale']{shift}) ** 2)"]
    if self.kind == "embed":
      vocab, width = d
      lines = [f"e = lookup({p}['table']{cast}, ids % {vocab})  # [batch, {NUM_IDS}, {width}]",
               "total = total + jnp.mean(jnp.tanh(e.sum(1) * x[:, :1]) ** 2)"]
      if self.flag:  # The tied output projection: logits [batch, vocab].
        vocab_axes = "MODEL_AXES" if self.split else "None"
        lines.append(f"total = total + jnp.mean(jnp.tanh(head(x[:, :{width}], {p}['table'], "
                     f"{vocab_axes})) ** 2)")
      return lines
    raise ValueError(self.kind)


KINDS = ("tensor", "scalar", "dense", "norm", "embed", "conv")   # Simplest first (shrinking).
PLACES = ("top", "blocks", "enc")


@st.composite
def layers(draw) -> tuple[Layer, ...]:
  """1-5 parameter groups with random shapes (mostly not divisible by N), dtypes, nesting."""
  count = draw(st.integers(1, 5))
  out = []
  for i in range(count):
    kind = draw(st.sampled_from(KINDS))
    if kind == "tensor" and draw(st.integers(0, 15)) == 15:
      dims = (512, 2049)  # Over 4 MiB in float32: its own collective, not a shared bucket.
    elif kind == "tensor":
      rank = draw(st.integers(1, 4))
      dims = tuple(draw(st.lists(st.integers(1, 12 if rank <= 2 else 5), min_size=rank,
                                 max_size=rank)))
    elif kind == "scalar":
      dims = ()
    elif kind == "dense":
      # At least 2 inputs: with w [1, dout] and b [dout], both shard to one shape and XLA may
      # rewrite one update's divisions (an ulp; see test_regressions.py
      # test_equal_shard_shapes_of_differently_shaped_tensors_within_an_ulp).
      dims = (draw(st.integers(2, FEATURES)), draw(st.integers(1, 48)))
    elif kind == "conv":
      dims = (draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(1, 3)),
              draw(st.integers(1, 8)))
    elif kind == "norm":
      dims = tuple(draw(st.lists(st.integers(1, 24), min_size=1, max_size=2)))
    else:  # embed
      dims = (draw(st.integers(1, 40)), draw(st.integers(1, FEATURES)))
    dtype = "bfloat16" if draw(st.integers(0, 4)) == 4 else "float32"
    where = draw(st.sampled_from(PLACES))
    mixed = (kind in ("dense", "conv", "embed") and dtype == "float32"
             and draw(st.integers(0, 3)) == 3)
    out.append(Layer(kind, f"{kind}{i}", where, dims, dtype, draw(st.booleans()), 10 * i + 1,
                     mixed))
  return tuple(out)


def _top_level_keys(ls: Sequence[Layer]) -> tuple[str, ...]:
  keys = []
  for layer in ls:
    k = layer.name if layer.where == "top" else layer.where
    if k not in keys:
      keys.append(k)
  return tuple(keys)


def _params_source(ls: Sequence[Layer],
                   leaves=Layer.params) -> tuple[str, dict[str, str]]:
  """Source of `make_params()`'s returned tree (or, with `leaves=Layer.specs`, of the
  parameters' in_specs) and each layer's accessor."""
  tree: dict = {}
  access = {}
  for layer in ls:
    if layer.where == "top":
      tree[layer.name] = leaves(layer)
      access[layer.name] = f"params[{layer.name!r}]"
    elif layer.where == "blocks":
      tree.setdefault("blocks", [])
      access[layer.name] = f"params['blocks'][{len(tree['blocks'])}]"
      tree["blocks"].append(leaves(layer))
    else:
      tree.setdefault("enc", {})[layer.name] = leaves(layer)
      access[layer.name] = f"params['enc'][{layer.name!r}]"
  return _render(tree, 1), access


def _render(tree, indent: int) -> str:
  pad, inner = "  " * indent, "  " * (indent + 1)
  if isinstance(tree, str):
    return tree
  if isinstance(tree, dict):
    items = [f"{inner}{k!r}: {_render(v, indent + 1)}," for k, v in tree.items()]
    return "{\n" + "\n".join(items) + f"\n{pad}}}"
  items = [f"{inner}{_render(v, indent + 1)}," for v in tree]
  return "[\n" + "\n".join(items) + f"\n{pad}]"


# --- Optax chains. -----------------------------------------------------------
#
# A transformation is drawn as source code. Whether its update reorders a
# floating-point sum (and so is compared within a tolerance, not bit for bit)
# is decided by inspecting the update's jaxpr for the case's parameter tree
# (`reorders_sums`), not by a hand-kept list.

@dataclasses.dataclass(frozen=True)
class Tx:
  """An optax transformation as source code."""

  code: str

  def __repr__(self) -> str:
    return self.code


LRS = ("1e-2", "1e-3", "0.1")
SCHEDULES = (
    "optax.constant_schedule({v})",
    "optax.linear_schedule({v}, 0.0, 4)",
    "optax.cosine_decay_schedule({v}, 4)",
    "optax.warmup_cosine_decay_schedule(0.0, {v}, 2, 10)",
    "optax.exponential_decay({v}, 1, 0.5)",
    "optax.piecewise_constant_schedule({v}, {{2: 0.5}})",
    "optax.polynomial_schedule({v}, 0.0, 2, 4)",
    "optax.join_schedules([optax.constant_schedule(0.0), optax.constant_schedule({v})], [1])",
)

# Named optimizers: source with {lr} (a float or a schedule), {flr} (a float),
# {mask} or {seed}.
OPTIMIZERS = (
    "optax.sgd({lr})",
    "optax.sgd({lr}, momentum=0.9)",
    "optax.sgd({lr}, momentum=0.9, nesterov=True)",
    "optax.adam({lr})",
    "optax.adam({lr}, mu_dtype=jnp.float32)",
    "optax.adam({lr}, nesterov=True)",
    "optax.adamw({lr}, weight_decay=0.1)",
    "optax.adamw({lr}, weight_decay=0.1, mask={mask})",
    "optax.adagrad({lr})",
    "optax.rmsprop({lr})",
    "optax.rmsprop({lr}, centered=True)",
    "optax.rmsprop({lr}, momentum=0.9, nesterov=True)",
    "optax.lion({lr})",
    "optax.adabelief({lr})",
    "optax.radam({lr})",
    "optax.yogi({lr})",
    "optax.noisy_sgd({lr}, key=jax.random.key({seed}))",
    "optax.adamax({lr})",
    "optax.adamaxw({lr})",
    "optax.amsgrad({lr})",
    "optax.nadam({lr})",
    "optax.nadamw({lr})",
    "optax.adadelta({lr})",
    "optax.adan({lr})",
    "optax.sign_sgd({lr})",
    "optax.optimistic_gradient_descent({lr})",
    "optax.rprop({flr})",
    "optax.lars({lr})",
    "optax.lamb({lr})",
    "optax.adafactor({lr})",
    "optax.adafactor({lr}, min_dim_size_to_factor=4)",
    ("optax.adafactor({lr}, min_dim_size_to_factor=2, momentum=0.9, "
     "multiply_by_parameter_scale=False)"),
    "optax.sm3({flr})",
    "optax.novograd({lr})",
    "optax.fromage({lr})",
    "optax.contrib.muon({lr})",
    "optax.contrib.adopt({lr})",
    "optax.contrib.ademamix({lr})",
    "optax.contrib.simplified_ademamix({lr})",
    "optax.contrib.madgrad({lr})",
    "optax.contrib.acprop({lr})",
    "optax.contrib.schedule_free_adamw({lr})",
    "optax.contrib.prodigy({lr})",
    "optax.contrib.dadapt_adamw({lr})",
    "optax.contrib.mechanize(optax.adam({lr}))",
    "optax.contrib.dog({lr})",
    "optax.contrib.cocob({lr})",
)

# Gradient transformations that are not whole optimizers.
TRANSFORMS = (
    "optax.scale({s})",
    "optax.clip({c})",
    "optax.scale_by_schedule({sched})",
    "optax.add_decayed_weights(1e-2)",
    "optax.add_decayed_weights(1e-2, mask={mask})",
    "optax.zero_nans()",
    "optax.ema(0.9)",
    "optax.trace(0.9)",
    "optax.trace(0.9, nesterov=True)",
    "optax.scale_by_adam()",
    "optax.scale_by_amsgrad()",
    "optax.scale_by_rms()",
    "optax.scale_by_stddev()",
    "optax.scale_by_rss()",
    "optax.scale_by_sign()",
    "optax.scale_by_learning_rate({lr})",
    "optax.scale_by_factored_rms()",
    "optax.keep_params_nonnegative()",
    "optax.clip_by_global_norm({c})",
    "optax.clip_by_block_rms({c})",
    "optax.scale_by_trust_ratio()",
    "optax.adaptive_grad_clip({c})",
    "optax.centralize()",
    "optax.normalize_by_update_norm()",
    "optax.scale_by_param_block_norm()",
    "optax.scale_by_param_block_rms()",
    "optax.scale_by_distance_over_gradients()",
)


@st.composite
def learning_rates(draw, schedules: tuple[str, ...] = SCHEDULES) -> str:
  lr = draw(st.sampled_from(LRS))
  if draw(st.booleans()):
    return draw(st.sampled_from(schedules)).format(v=lr)
  return lr


def _ndim_or_keys(draw, keys: tuple[str, ...], by_ndim: str, by_keys) -> str:
  """`by_ndim`, or `by_keys(chosen)` for a random non-empty subset of the top-level keys."""
  if draw(st.booleans()):
    return by_ndim
  return by_keys(draw(st.lists(st.sampled_from(keys), min_size=1, max_size=len(keys),
                               unique=True)))


@st.composite
def masks(draw, keys: tuple[str, ...]) -> str:
  return _ndim_or_keys(draw, keys, "ndim_at_least(2)",
                       lambda chosen: f"top_keys({', '.join(repr(k) for k in chosen)})")


@st.composite
def labels(draw, keys: tuple[str, ...]) -> str:
  return _ndim_or_keys(draw, keys, "labels_by_ndim(2, 'a', 'b')",
                       lambda chosen: f"labels_by_top_key({tuple(chosen)!r}, 'a', 'b')")


def _fill(draw, template: str, keys) -> str:
  fields = {}
  if "{lr}" in template:
    fields["lr"] = draw(learning_rates())
  if "{flr}" in template:
    fields["flr"] = draw(st.sampled_from(LRS))
  if "{mask}" in template:
    fields["mask"] = draw(masks(keys))
  if "{seed}" in template:
    fields["seed"] = draw(st.integers(0, 9))
  if "{s}" in template:
    fields["s"] = draw(st.sampled_from(("-0.1", "-1.0", "0.5")))
  if "{c}" in template:
    fields["c"] = draw(st.sampled_from(("1.0", "0.1", "0.01")))
  if "{sched}" in template:
    schedule = draw(st.sampled_from(SCHEDULES))
    fields["sched"] = schedule.format(v=draw(st.sampled_from(("-0.1", "-1e-2"))))
  return template.format(**fields)


@st.composite
def optimizers(draw, keys: tuple[str, ...]) -> Tx:
  template = draw(st.sampled_from(OPTIMIZERS))
  # inject_hyperparams: the learning rate (a schedule or a float) becomes state.
  # Only numeric keyword arguments: inject_hyperparams would take a dtype (a
  # callable) for a schedule and a bool for a traced hyperparameter.
  injectable = "{lr}" in template and not any(
      s in template for s in ("{mask}", "{seed}", "contrib", "dtype", "=True"))
  if injectable and draw(st.integers(0, 3)) == 0:
    name, rest = template[len("optax."):].split("(", 1)
    rest = rest[len("{lr}"):].lstrip(", ")
    lr = draw(learning_rates())
    extra = ", " + rest[:-1] if rest[:-1] else ""
    return Tx(f"optax.inject_hyperparams(optax.{name})(learning_rate={lr}{extra})")
  return Tx(_fill(draw, template, keys))


@st.composite
def gradient_transforms(draw, keys: tuple[str, ...]) -> Tx:
  return Tx(_fill(draw, draw(st.sampled_from(TRANSFORMS)), keys))


@st.composite
def transforms(draw, keys: tuple[str, ...], depth: int = 2) -> Tx:
  """A random transformation: a leaf, a chain, a mask, a multi_transform, apply_if_finite."""
  choice = draw(st.integers(0, 6 if depth > 0 else 1))
  if choice == 0:
    return draw(optimizers(keys))
  if choice == 1:
    return draw(gradient_transforms(keys))
  sub = transforms(keys, depth - 1)
  if choice in (2, 3):  # A chain: gradient processing, then an optimizer, then more.
    parts = draw(st.lists(st.one_of(sub, gradient_transforms(keys)), min_size=1, max_size=3))
    parts.insert(draw(st.integers(0, len(parts))), draw(optimizers(keys)))
    return Tx("optax.chain(" + ", ".join(p.code for p in parts) + ")")
  if choice == 4:
    inner = draw(sub)
    return Tx(f"optax.masked({inner.code}, {draw(masks(keys))})")
  if choice == 5:
    a = draw(sub)
    b = Tx("optax.set_to_zero()") if draw(st.integers(0, 3)) == 0 else draw(sub)
    return Tx(f"optax.multi_transform({{'a': {a.code}, 'b': {b.code}}}, {draw(labels(keys))})")
  inner = draw(sub)
  return Tx(f"optax.apply_if_finite({inner.code}, max_consecutive_errors=2)")


@st.composite
def top_transforms(draw, keys: tuple[str, ...]) -> Tx:
  tx = draw(transforms(keys))
  if draw(st.integers(0, 4)) == 0:  # Gradient accumulation: the update runs inside a cond.
    return Tx(f"optax.MultiSteps({tx.code}, every_k_schedule=2)")
  return tx


# --- Cases. ------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Mesh:
  """The mesh a case runs on, as `jax.make_mesh(shape, names)` builds it, and the roles of
  its axes in the program: the axes the batch is split over, the axis FSDP places the first
  dim of matrices over ("": none), the axes column-parallel layers and vocabulary-split
  tables are split over (tensor parallelism; an axis of size 1 splits nothing, but the
  weights' specs, and on Explicit axes their types, name it)."""

  names: tuple[str, ...]
  shape: tuple[int, ...]
  batch: tuple[str, ...] = ("data",)
  fsdp: str = ""
  model: tuple[str, ...] = ()

  def size(self, *axes: str | tuple[str, ...]) -> int:
    """Devices of the named axes (of a tuple of them)."""
    flat = [a for x in axes for a in ((x,) if isinstance(x, str) else x)]
    return int(np.prod([self.shape[self.names.index(a)] for a in flat]))

  @property
  def n(self) -> int:
    """Batch replicas: the batch is split this many ways."""
    return self.size(self.batch)

  @property
  def batch_spec(self) -> str | tuple[str, ...]:
    """The batch's axes as a PartitionSpec entry."""
    return self.batch[0] if len(self.batch) == 1 else self.batch

  @property
  def model_spec(self) -> str | tuple[str, ...] | None:
    """The model axes as a PartitionSpec entry (None: no model axis)."""
    return None if not self.model else self.model[0] if len(self.model) == 1 else self.model

  @property
  def phased(self) -> bool:
    """Whether the batch is split over two axes of more than one device (HSDP, data x fsdp):
    gradients are summed over both (see `tolerance`)."""
    return sum(self.size(a) > 1 for a in self.batch) > 1

  @property
  def kind(self) -> str:
    """The axes' names, "fsdp" when weights are placed over a batch axis, "tp" when some
    are split over model axes (of any size)."""
    return "x".join(self.names) + (" fsdp" if self.fsdp else "") + (" tp" if self.model else "")

  def __repr__(self) -> str:
    roles = [f"batch={'x'.join(self.batch)}"] + ([f"fsdp={self.fsdp}"] if self.fsdp else []) + (
        [f"model={'x'.join(self.model)}"] if self.model else [])
    return "x".join(f"{a}{s}" for a, s in zip(self.names, self.shape)) + f"({', '.join(roles)})"


@dataclasses.dataclass(frozen=True)
class Case:
  """One generated training program."""

  mesh: Mesh
  check_vma: bool
  steps: int
  layers: tuple[Layer, ...]
  tx: Tx
  extra: bool   # A third argument {"count": int32, "key": typed PRNG key}, used for dropout.
  seed: int
  # "shard_map": the per-replica step under jax.shard_map / wus.shard_map; "auto" or
  # "explicit": the global-view step under jax.jit / wus.jit, on a mesh with axes of that type.
  front: str = "shard_map"
  # Global-view fronts only (issue 28): size-1 mesh axes beside "data" on Auto axes (Flax's
  # ("data", "model") meshes of shape (N, 1)), every matrix placed over "model"; a sharding
  # constraint on params and optimizer state at the "start" or "end" of the step
  # (Equinox's filter_shard replicating them, or MaxText's laying them out as the arguments
  # are placed), or "none"; and evaluation code reading the optimizer state under the
  # user's own jax.jit after the last step.
  size1_axes: int = 0
  constraint: str = "none"
  evaluate: bool = False
  # How the batch reaches the global-view step: "placed" over the batch axes by the caller
  # (`jax.device_put`), or "constrained": passed replicated and split inside the step by a
  # sharding constraint (pjit-era code; `reshard` on Explicit axes, whose constraints assert).
  batch_in: str = "placed"

  @property
  def n(self) -> int:
    """Batch replicas."""
    return self.mesh.n

  @property
  def model(self) -> int:
    """Devices of the model axes (issue 29): the layers marked `split` are split over them,
    by the in_specs under shard_map, by the arguments' placement under jax.jit (1: none)."""
    return self.mesh.size(self.mesh.model)

  @property
  def bf16(self) -> bool:
    """Whether any weight is stored or computed in bfloat16 (see `tolerance`)."""
    return any(layer.dtype == "bfloat16" or layer.mixed for layer in self.layers)

  def __repr__(self) -> str:
    shapes = ", ".join(f"{l.name}@{l.where}{list(l.dims)}{'/bf16' if l.dtype == 'bfloat16' else ''}"
                       f"{'/mixed' if l.mixed else ''}{'/split' if l.split else ''}"
                       f"{'+' if l.flag else ''}" for l in self.layers)
    return (f"Case(N={self.n}, front={self.front}, mesh={self.mesh!r}, check_vma={self.check_vma}, "
            + f"steps={self.steps}, extra={self.extra}, "
            + (f"size1_axes={self.size1_axes}, constraint={self.constraint}, "
               f"evaluate={self.evaluate}, batch_in={self.batch_in}, "
               if self.front != "shard_map" else "")
            + f"layers=[{shapes}], tx={self.tx.code})")

  def script(self) -> str:
    """A standalone program that builds this case and compares wus with the unmodified step."""
    params_src, access = _params_source(self.layers)
    specs_src, _ = _params_source(self.layers, lambda layer: layer.specs(self.mesh))
    placed = any(spec != "P()" for layer in self.layers
                 for spec in jax.tree.leaves(layer.specs(self.mesh)))
    loss_lines = []
    for layer in self.layers:
      loss_lines += layer.loss_lines(access[layer.name])
    loss_body = textwrap.indent("\n".join(loss_lines), "  ")
    extra_arg = "extra, " if self.extra else ""
    dropout = textwrap.indent(textwrap.dedent("""\
        # Dropout with the key the caller passes, different on every replica.
        key = jax.random.fold_in(extra["key"], lax.axis_index("data"))
        keep = jax.random.bernoulli(key, 0.9, batch["x"].shape)
        batch = dict(batch, x=jnp.where(keep, batch["x"], 0.0))
        """), "  ") if self.extra else ""
    global_dropout = textwrap.indent(textwrap.dedent("""\
        # Dropout with the key the caller passes, over the whole batch.
        keep = jax.random.bernoulli(extra["key"], 0.9, batch["x"].shape)
        batch = dict(batch, x=jnp.where(keep, batch["x"], 0.0))
        """), "  ") if self.extra else ""
    new_extra = ('  extra = {"count": extra["count"] + 1,\n'
                 '           "key": jax.random.fold_in(extra["key"], 1)}\n' if self.extra else "")
    ret_extra = "extra, " if self.extra else ""
    extra_value = (', {"count": jnp.arange(5, dtype=jnp.int32), '
                   f'"key": jax.random.key({self.seed})}}' if self.extra else "")
    spec_extra = "P(), " if self.extra else ""
    helpers = "\n\n".join(inspect.getsource(f).rstrip() for f in
                          (init, top_keys, ndim_at_least, labels_by_top_key, labels_by_ndim, run,
                           reorders_sums, tolerance, compare))
    return f'''"""wus differential fuzz case (generated by tests/fuzz_cases.py).

{textwrap.fill(repr(self), 96)}

Run: XLA_FLAGS=--xla_force_host_platform_device_count=8 python repro.py
"""
import os
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_max_isa=AVX "
                           "--xla_allow_excess_precision=false "
                           "--xla_cpu_experimental_ynn_fusion_type=").strip()

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P, reshard

import wus

N, CHECK_VMA, STEPS, BF16 = {self.n}, {self.check_vma}, {self.steps}, {self.bf16}
MESH_SHAPE, MESH_AXES = {self.mesh.shape!r}, {self.mesh.names!r}
BATCH = {self.mesh.batch_spec!r}  # The axes the batch is split over (N ways).
FSDP_AXIS = {self.mesh.fsdp!r}  # The axis matrices' first dims are placed over ("": none).
MODEL_AXES = {self.mesh.model_spec!r}  # Split layers' axes (tensor parallelism).
MODEL = {self.model}  # Devices of the model axes (1: none, or axes of size 1).
EXTRA_AXES, CONSTRAINT, EVALUATE = {self.size1_axes}, {self.constraint!r}, {self.evaluate}
EXPLICIT = {self.front == "explicit"}  # The global-view step on Explicit axes.
BATCH_IN = {self.batch_in!r}  # "placed" by the caller or "constrained" inside the step.
PLACED = {placed}  # Whether param_specs() places a weight over a mesh axis.
# Matrices placed over the size-1 "model" axis: on Auto axes only (on Explicit axes the types
# would carry it, and JAX asks the step for output shardings).
OVER_MODEL = EXTRA_AXES > 0 and {self.front == "auto"}  # (EXTRA_AXES > 0: Auto only, `cases`)
# The batch split over two axes of more than one device: gradients summed over both (`tolerance`).
PHASED_SUMS = {self.mesh.phased}


{helpers}


def make_params():
  return {params_src}


def param_specs():
  """Each parameter's in_spec (shard_map) or placement (jax.jit): column-parallel dense
  layers and vocabulary-split tables over MODEL_AXES, matrices' first dims over FSDP_AXIS."""
  return {specs_src}


def gather(params):
  """FSDP on Explicit axes as JAX's sharding guide writes it: each weight placed over
  FSDP_AXIS resharded whole over it before use (its all-gather), its other splits kept.
  The identity elsewhere (on Auto axes GSPMD gathers what the forward pass needs)."""
  if not (EXPLICIT and FSDP_AXIS):
    return params
  def before_use(spec, w):
    return reshard(w, P(*[None if a == FSDP_AXIS else a for a in spec])) if FSDP_AXIS in spec else w
  return jax.tree.map(before_use, param_specs(), params, is_leaf=lambda x: isinstance(x, P))


def lookup(table, rows):
  """An embedding lookup as users write it: on an Explicit mesh JAX asks for the result's
  sharding (`.at[...].get(out_sharding=...)`, a gather in Auto axes); else indexing."""
  if EXPLICIT:
    return table.at[rows].get(out_sharding=P(BATCH, *[None] * (rows.ndim)))
  return table[rows]


def conv(img, kernel):
  """A 2-D convolution of NHWC images with an HWIO kernel: on an Explicit mesh with the
  result's sharding, as JAX asks for it (the batch over BATCH)."""
  kw = dict(out_sharding=P(BATCH)) if EXPLICIT else {{}}
  return lax.conv_general_dilated(img, kernel, (1, 1), "SAME",
                                  dimension_numbers=("NHWC", "HWIO", "NHWC"), **kw)


def split_batch(batch):
  """pjit-era code: the batch enters the step replicated and a sharding constraint splits it
  over BATCH (on Explicit axes, where a constraint only asserts the type, `reshard`)."""
  if EXPLICIT:
    return jax.tree.map(lambda x: reshard(x, P(BATCH)), batch)
  return jax.tree.map(lambda x: lax.with_sharding_constraint(x, P(BATCH)), batch)


def head(x, table, vocab_axes):
  """A tied output projection, logits [batch, vocab] = x @ table.T: on an Explicit mesh with
  the logits' sharding, the vocabulary over the axes the table's rows are split over."""
  if EXPLICIT:
    return jnp.einsum("bd,vd->bv", x, table, out_sharding=P(BATCH, vocab_axes))
  return x @ table.T


def over_model(term):
  """A column-parallel layer's loss term: under shard_map the mean over this rank's
  columns, averaged over "model"; on global arrays the mean over all columns already."""
  local = MODEL > 1 and {self.front == "shard_map"}
  return lax.psum(term, "model") / MODEL if local else term


def loss(params, batch):
  # Per replica: x [{PER_REPLICA}, {FEATURES}] float32, ids [{PER_REPLICA}, {NUM_IDS}] int32.
  x, ids = batch["x"], batch["ids"]
  params = gather(params)
  s = jnp.mean(jnp.tanh(x))
  total = jnp.float32(0.0)
{loss_body}
  return total


tx = {self.tx.code}


def step(params, opt_state, {extra_arg}batch):
{dropout}  loss_value, grads = jax.value_and_grad(loss)(params, batch)
  grads = lax.pmean(grads, "data")
  updates, opt_state = tx.update(grads, opt_state, params)
  params = optax.apply_updates(params, updates)
{new_extra}  return params, opt_state, {ret_extra}lax.pmean(loss_value, "data")


def place(tree):
  """A sharding constraint on (params, optimizer state). When weights are placed over mesh
  axes, each leaf laid out as the step's arguments are, as MaxText constrains its state to
  its `state_mesh_shardings` (on Explicit axes an assertion of the types); else each leaf
  replicated (matrices over the size-1 "model" axis when the mesh has one), as
  eqx.filter_shard(tree, replicated) does."""
  if PLACED:
    return jax.tree.map(lambda spec, x: lax.with_sharding_constraint(x, spec),
                        (param_specs(), STATE_SPECS), tree, is_leaf=lambda x: isinstance(x, P))
  def one(x):
    spec = P(None, "model") if OVER_MODEL and jnp.ndim(x) >= 2 else P()
    return lax.with_sharding_constraint(x, spec) if hasattr(x, "dtype") else x
  return jax.tree.map(one, tree)


def global_step(params, opt_state, {extra_arg}batch):
  # The same program on global arrays, as a jax.jit step: the mean loss over the whole batch.
  if BATCH_IN == "constrained":
    batch = split_batch(batch)
{global_dropout}  if CONSTRAINT == "start":
    params, opt_state = place((params, opt_state))
  loss_value, grads = jax.value_and_grad(loss)(params, batch)
  updates, opt_state = tx.update(grads, opt_state, params)
  params = optax.apply_updates(params, updates)
  if CONSTRAINT == "end":
    params, opt_state = place((params, opt_state))
{new_extra}  return params, opt_state, {ret_extra}loss_value


@jax.jit
def evaluate(params, opt_state):
  """Evaluation code reading the optimizer state (lookahead's slow weights, schedule-free's
  z) under the user's own jax.jit: an elementwise function of its float leaves."""
  floats = [x for x in jax.tree.leaves(opt_state) if jnp.issubdtype(x.dtype, jnp.floating)]
  return [jnp.tanh(x.astype(jnp.float32)) * 2 for x in floats], jax.tree.map(jnp.sin, params)


def make_mesh(front):
  """The mesh MESH_SHAPE over MESH_AXES: Explicit axes as jax.make_mesh makes them, or Auto."""
  types = None if front != "auto" else (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
  return jax.make_mesh(MESH_SHAPE, MESH_AXES, devices=jax.devices()[:int(np.prod(MESH_SHAPE))],
                       axis_types=types)


def state_specs():
  """The optimizer state's in_specs, as a user on an Explicit mesh finds them: the
  shardings `tx.init` gives its outputs from the parameters' (P() for the rest)."""
  mesh = make_mesh({self.front!r})
  placed = jax.tree.map(lambda spec, x: jax.device_put(x, NamedSharding(mesh, spec)),
                        param_specs(), make_params(), is_leaf=lambda x: isinstance(x, P))
  try:
    with jax.set_mesh(mesh):
      state = tx.init(placed)
  except Exception:  # noqa: BLE001 -- make_inputs' tx.init raises it again: not a program.
    return P()
  return jax.tree.map(lambda x: getattr(getattr(x, "sharding", None), "spec", P()), state)


if MODEL > 1 and {self.front == "shard_map"}:
  IN_SPECS = (param_specs(), state_specs(), {spec_extra}P("data"))
  OUT_SPECS = (param_specs(), state_specs(), {spec_extra}P())
else:
  IN_SPECS = (P(), P(), {spec_extra}P("data"))
  OUT_SPECS = (P(), P(), {spec_extra}P())
STATE_SPECS = state_specs() if PLACED and CONSTRAINT != "none" else None  # For `place`.


def sums_reordered(params):
  """Whether wus's results may differ from the unmodified step's by summation order
  (`tolerance`): the update sums floats (`reorders_sums`), or each gradient is summed over
  two batch axes, at once by the unmodified step, one axis after the other by wus (§5.1).
  Or by XLA's rewrites: a global-view FSDP step has apply_if_finite's `cond` split into
  its parts (`transforms.cond_parts`), and XLA's algebraic simplifier rewrites Adam's
  divisions by what each part shows it (a few ulps)."""
  split = FSDP_AXIS and {self.front != "shard_map"} and "apply_if_finite" in {self.tx.code!r}
  return PHASED_SUMS or split or reorders_sums(tx, params)


def make_inputs(mesh):
  """The first step's arguments (batch excluded) and one batch per step."""
  params = make_params()
  if OVER_MODEL:  # Weights annotated for the unused axis, as Flax's guides place them.
    params = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(
        mesh, P(None, "model") if x.ndim >= 2 else P())), params)
  args = (params, tx.init(params){extra_value})
  if PLACED:  # Placed as the specs split them (an Explicit mesh reshards nothing).
    specs = (param_specs(), state_specs(), *(P(),) * (len(args) - 2))
    args = jax.tree.map(lambda spec, x: jax.device_put(x, NamedSharding(mesh, spec)),
                        specs, args, is_leaf=lambda x: isinstance(x, P))
  data = NamedSharding(mesh, P(BATCH) if BATCH_IN == "placed" else P())
  rngs = [np.random.default_rng({self.seed} + 1000 * i) for i in range(STEPS)]
  batches = [jax.device_put({{
      "x": rng.standard_normal((N * {PER_REPLICA}, {FEATURES}), np.float32),
      "ids": rng.integers(0, 64, (N * {PER_REPLICA}, {NUM_IDS}), np.int32),
  }}, data) for rng in rngs]
  return args, batches


if __name__ == "__main__":
  FRONT = {self.front!r}
  mesh = make_mesh(FRONT)
  jax.set_mesh(mesh).__enter__()
  args, batches = make_inputs(mesh)
  kw = dict(mesh=mesh, in_specs=IN_SPECS, out_specs=OUT_SPECS, check_vma=CHECK_VMA)
  if FRONT == "shard_map":
    want = run(jax.jit(jax.shard_map(step, **kw)), args, batches)
    ws = wus.shard_map(step, **kw)
  else:
    want = run(jax.jit(global_step), args, batches)
    ws = wus.jit(global_step)
  print("unmodified step ran")
  got = run(ws, args, batches)
  msgs, _ = compare(want, got, reduces=sums_reordered(args[0]), bf16=BF16, phased=PHASED_SUMS)
  if EVALUATE:
    msgs += compare(evaluate(*want[:2]), evaluate(*got[:2]),
                    reduces=sums_reordered(args[0]), bf16=BF16, phased=PHASED_SUMS)[0]
  print("\\n".join(msgs) or "wus matches the unmodified step")
  print(ws.plan(*args, batches[0]))
  raise SystemExit(1 if msgs else 0)
'''

  def build(self) -> dict:
    """Executes `script()` (its `__main__` block excluded): the case's namespace."""
    src = self.script()
    name = f"<wus fuzz case {abs(hash(src)):x}>"
    linecache.cache[name] = (len(src), None, src.splitlines(True), name)  # Tracebacks show lines.
    ns = {"__name__": "wus_fuzz_case"}
    exec(compile(src, name, "exec"), ns)  # noqa: S102 -- the case is generated source.
    return ns


# The global-view fronts' meshes (issue 37), simplest first (shrinking): data parallelism
# (size-1 axes beside "data" on Auto axes), tensor parallelism on ("data", "model") with
# "model" of 1 or 2 devices (a size-1 "tensor" axis after it sometimes, as (4, 2, 1)
# meshes have), FSDP over "data", HSDP over ("replica", "fsdp"), data x fsdp x tensor.
GLOBAL_MESHES = ("data", "tp", "fsdp", "hsdp", "3d")
HSDP = ((2, 2), (2, 3), (3, 2), (2, 4), (4, 2))           # (replica, fsdp) devices
DATA_FSDP_TENSOR = ((2, 2, 2), (2, 2, 1), (2, 3, 1), (4, 2, 1))


@st.composite
def global_meshes(draw, n: int, front: str) -> tuple[Mesh, int]:
  """A global-view step's mesh and its size-1 axes beside "data" (Auto axes only: on
  Explicit ones JAX itself rejects most such steps, asking for out_sharding= on gathers and
  convolutions over a multi-axis mesh; there the weights' specs name size-1 axes)."""
  kind = draw(st.sampled_from(GLOBAL_MESHES))
  if kind == "data":
    extra = draw(st.sampled_from((0, 0, 1, 2))) if front == "auto" else 0
    return Mesh(("data", "model", "fsdp")[:1 + extra], (n,) + (1,) * extra), extra
  if kind == "tp":
    model = draw(st.sampled_from((1, 2)))
    names = ("data", "model") + (("tensor",) if draw(st.booleans()) else ())
    n = draw(st.sampled_from((2, 3, 4))) if model > 1 else n
    return Mesh(names, (n, model, 1)[:len(names)], model=names[1:]), 0
  if kind == "fsdp":  # MaxText's FSDP over the batch axis (issue 29 item 3).
    return Mesh(("data",), (n,), fsdp="data"), 0
  if kind == "hsdp":
    return Mesh(("replica", "fsdp"), draw(st.sampled_from(HSDP)), batch=("replica", "fsdp"),
                fsdp="fsdp"), 0
  return Mesh(("data", "fsdp", "tensor"), draw(st.sampled_from(DATA_FSDP_TENSOR)),
              batch=("data", "fsdp"), fsdp="fsdp", model=("tensor",)), 0


def _split(draw, ls: Sequence[Layer], model: int, embed: bool) -> tuple[Layer, ...]:
  """Some dense layers whose output dim divides `model` made column-parallel, and (`embed`)
  some tables whose vocabulary divides it vocabulary-split."""
  def splits(layer):
    return ((layer.kind == "dense" and layer.dims[1] % model == 0)
            or (embed and layer.kind == "embed" and layer.dims[0] % model == 0))
  return tuple(dataclasses.replace(layer, split=draw(st.booleans())) if splits(layer) else layer
               for layer in ls)


# Transformations whose update is the sign of a function of the gradient (rprop: of the
# product of two steps' gradients).
SIGN_OF_GRADIENT = ("lion", "sign_sgd", "scale_by_sign", "rprop")

FRONTS = ("shard_map", "shard_map", "auto", "explicit")  # Half per-replica, half global view.


@st.composite
def cases(draw, fronts: Sequence[str] = FRONTS) -> Case:
  """A case whose front end is drawn from `fronts`."""
  ls = draw(layers())
  tx = draw(top_transforms(_top_level_keys(ls)))
  n = draw(st.sampled_from(REPLICAS))
  case = Case(mesh=Mesh(("data",), (n,)), check_vma=draw(st.booleans()),
              steps=draw(st.sampled_from((2, 3))), layers=ls, tx=tx, extra=draw(st.booleans()),
              seed=draw(st.integers(0, 999)),
              front=draw(st.sampled_from(tuple(fronts))))
  if case.front == "shard_map":
    if draw(st.integers(0, 2)) < 2:
      return case
    # Tensor parallelism (issue 29): N x 2 devices, some dense layers column-parallel.
    return dataclasses.replace(case, layers=_split(draw, ls, 2, embed=False), mesh=Mesh(
        ("data", "model"), (draw(st.sampled_from((2, 3, 4))), 2), model=("model",)))
  mesh, extra = draw(global_meshes(n, case.front))
  # A sign of a gradient summed in another order (`tolerance`, phased sums) is no number
  # within a tolerance of the unmodified step's: an element whose sum cancels to near
  # zero takes either sign, and the weight moves by a whole step either way (seen: Lion
  # then scale_by_sign on replica 2 x fsdp 2, 6 of 598 elements 2 apart).
  assume(not (mesh.phased and any(s in tx.code for s in SIGN_OF_GRADIENT)))
  if mesh.model:
    ls = _split(draw, ls, mesh.size(mesh.model), embed=True)
  return dataclasses.replace(case, mesh=mesh, layers=ls, size1_axes=extra,
                             constraint=draw(st.sampled_from(("none", "start", "end"))),
                             evaluate=draw(st.booleans()),
                             batch_in=draw(st.sampled_from(("placed", "constrained"))))


# --- The Plan: what stayed replicated. ----------------------------------------


def replicated(plan, n: int) -> tuple[list[str], list[str]]:
  """(reasons of clusters holding a big tensor that stay replicated, problems).

  Problems: a cluster or an input kept whole whose reason is empty."""
  kept, problems = [], []
  for c in plan.clusters:
    if c.sharded:
      continue
    if not c.reason.strip():
      problems.append(f"cluster {c.index} is replicated without a reason: "
                      f"{[t.name for t in c.tensors]}")
    if any(int(np.prod(t.shape)) >= max(BIG, n) for t in c.tensors):
      kept.append(c.reason.strip())
  for i in plan.inputs:
    if not i.sharded and not i.reason.strip():
      problems.append(f"input {i.name} is kept whole without a reason")
  return kept, problems


# Optimizer state per device above this multiple of the ideal (below) is under-sharded: the
# bound issue 37 sets (1.15 x 1/(mesh devices) of a copy wherever sharding is possible).
UNDER = 1.15


def state_bytes(opt_state, devices: int) -> tuple[int, int]:
  """(bytes per device, ideal bytes per device) of the optimizer state a step returned.

  Measured with `wus.bytes_per_device` (the device holding the most). Ideal: every leaf of
  at least max(BIG, devices) elements split over all the mesh's devices, each smaller one
  whole, as the Plan keeps tiny tensors."""
  measured = wus.bytes_per_device(opt_state).per_device
  ideal = 0
  for x in jax.tree.leaves(wus.unshard(opt_state)):
    x = x if hasattr(x, "nbytes") else np.asarray(x)  # A typed key has no NumPy form.
    size, nbytes = int(x.size), int(x.nbytes)
    ideal += -(-size // devices) * (nbytes // max(size, 1)) if size >= max(BIG, devices) \
        else nbytes
  return measured, ideal
