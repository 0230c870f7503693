"""The variants `wus-bench` compares and the regimes it runs them in (`main`'s docstring
describes each): their names, `Regime`, and each variant's step."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import Mesh

from wus.harness.models import tasks
from wus.harness.tools.bench import zero
from wus.harness.training import steps

VARIANTS = ("replicated", "gspmd_zero1", "handwritten", "handwritten_flat", "wus",
            "wus_undonated")
ALTERNATIVES = VARIANTS[:4]
# The variants of a `jax.jit` user (issue 20), compared among themselves.
JIT_VARIANTS = ("jit", "wus_jit")
JIT_ALTERNATIVES = ("jit", "gspmd_zero1")


@dataclasses.dataclass(frozen=True)
class Regime:
  """One benchmark setting.

  Attributes:
    name: as printed.
    batch_size: examples per replica per update.
    steps_per_call: updates per call of the step, in a `lax.fori_loop`; more
      than 1 also reads the weights in bfloat16 in the forward pass.
    group_sizes: G of the partial-sharding variants `wus_gG` (§5.2); with
      them the regime compares replicated and those only (memory: every
      variant holds its own copy of the state).
    model: the model of this regime; None: `run_regime`'s.
    skip: variants left out (GSPMD ZeRO-1 cannot partition the Transformer's
      embedding lookup on a batch-split mesh in JAX 0.10: it asks for the
      gather's out_sharding).
    jit: also the `jax.jit` user's variants (JIT_VARIANTS).
  """

  name: str
  batch_size: int
  steps_per_call: int = 1
  group_sizes: tuple[int, ...] = ()
  model: str | None = None
  skip: tuple[str, ...] = ()
  jit: bool = False

  @property
  def rest(self) -> bool:
    """Whether the forward and backward pass is timed alone (the cost model's "rest", to
    predict each variant's step): one update per call."""
    return self.steps_per_call == 1

  @property
  def parts(self) -> bool:
    """Whether the parts of the sharded step are timed alone (`limit`): one update per call."""
    return self.steps_per_call == 1 and not self.group_sizes

  @property
  def variants(self) -> tuple[str, ...]:
    if self.steps_per_call > 1:
      return ("replicated", "wus")
    if self.group_sizes:  # wus (G = N) is in the weight-update-bound regime.
      return ("replicated",) + tuple(f"wus_g{g}" for g in self.group_sizes)
    return tuple(v for v in VARIANTS + JIT_VARIANTS * self.jit if v not in self.skip)


def group_size(variant: str) -> int | None:
  """G of a `wus_gG` variant, None for the others."""
  return int(variant[len("wus_g"):]) if variant.startswith("wus_g") else None


def make_loop_step(task: tasks.Task, tx, steps_per_call: int, compute_dtype=jnp.bfloat16):
  """The per-replica step running `steps_per_call` updates in a `lax.fori_loop`.

  Its batch holds `steps_per_call` batches of this replica, one after the
  other along the leading dim; each update reads the weights in
  `compute_dtype` for the forward and backward pass (mixed precision).
  Metrics are those of the last update.
  """
  def step(params, model_state, opt_state, batch):
    split = jax.tree.map(lambda x: x.reshape(steps_per_call, -1, *x.shape[1:]), batch)

    def update(i, carry):
      params, model_state, opt_state, _ = carry
      grads, model_state, metrics = steps.gradients(
          task, params, model_state, jax.tree.map(lambda x: x[i], split), compute_dtype)
      updates, opt_state = tx.update(grads, opt_state, params)
      return (optax.apply_updates(params, updates), model_state, opt_state,
              lax.pmean(metrics, steps.AXIS_NAME))

    metrics = {"loss": jnp.zeros(()), "accuracy": jnp.zeros(())}
    return lax.fori_loop(0, steps_per_call, update, (params, model_state, opt_state, metrics))

  return step


def _copy(tree):
  """A copy of every array of `tree` (each variant donates its own state)."""
  return jax.tree.map(lambda x: jax.device_put(x, x.sharding, may_alias=False), tree)


def variant_steps(regime: Regime, task: tasks.Task, tx, mesh: Mesh, state: steps.TrainState,
                   topology=None):
  """{variant: (step, its initial state)}: each step takes (*state, batch), donating
  state (but wus_undonated); the wus variants get `topology`."""
  if regime.steps_per_call > 1:
    train_step = make_loop_step(task, tx, regime.steps_per_call)
  else:
    train_step = steps.make_train_step(task, tx)
  out = {}
  for name in regime.variants:
    fresh = _copy(state)
    if name == "replicated":
      out[name] = steps.map_train_step(name, train_step, mesh), fresh
    elif name in JIT_VARIANTS:
      out[name] = steps.map_train_step("replicated" if name == "jit" else "wus",
                                       steps.make_train_step(task, tx, "jit"), mesh, step="jit",
                                       topology=topology), fresh
    elif name.startswith("wus"):
      out[name] = steps.map_train_step("wus", train_step, mesh, group_size(name),
                                       donate=name != "wus_undonated", topology=topology), fresh
    else:
      if name == "handwritten_flat":
        step, place = zero.flat_step(task, tx, mesh, fresh.opt_state, fresh.params)
      else:
        make = zero.gspmd_step if name == "gspmd_zero1" else zero.handwritten_step
        step, place = make(task, tx, mesh, fresh.opt_state)
      out[name] = step, fresh._replace(opt_state=place(fresh.opt_state))
  return out
