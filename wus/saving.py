"""What a step saves: the warning when it saves little, and a state tree's bytes per device.

`warn_if_not_sharded` is called where a front end compiles a new signature
(`runtime.compiled_once`): it reads the Plan and says, once, when the
step runs unchanged or keeps most of its weight update whole (`not_sharded` is the rule).
`bytes_per_device` measures what a device holds of a tree, from its arrays' shards: the
check after switching to wus.
"""

from __future__ import annotations

import collections
import dataclasses
import sys
import warnings
from typing import Any

import jax
import numpy as np

from wus.analysis import reasons, refusals
from wus.analysis.network import format_bytes
from wus.analysis.plan import Plan
from wus.errors import NotShardedWarning
from wus.sharded import check_alive, is_sharded

SILENCE = 'warnings.filterwarnings("ignore", category=wus.NotShardedWarning)'


def not_sharded(plan: Plan) -> str | None:
  """Why a planned step saves little, in the Plan's words; None when it saves.

  A step saves little when
  * it runs unchanged (`Plan.unchanged`: `wus.jit` found no batch split, ...);
  * no weight-update cluster is sharded or owned (none found: no gradient all-reduce
    over the data axes; or each stays replicated);
  * or it keeps most of its weight update whole: of the bytes of weights and optimizer
    state its weight-update clusters read (`Plan.sharded_bytes + Plan.owned_bytes +
    Plan.replicated_bytes`, whole tensors), more than half are in clusters that stay
    replicated (`Plan.replicated_bytes`), whose optimizer state every device keeps whole.

  Returns:
    The first reason the Plan gives (the step's; the largest replicated cluster's; the
    first input's), with what it costs, or None.
  """
  if plan.unchanged:
    return f"runs unchanged: {plan.unchanged}"
  if not plan.clusters:
    why = next((reasons.render(i.why, cite=False) for i in plan.inputs if i.state), "")
    return "shards nothing" + (f": {why}" if why else ": it has no weight update")
  replicated = [c for c in plan.clusters if not c.sharded and c.owner is None]
  largest = max(replicated, key=lambda c: sum(t.nbytes for t in c.tensors), default=None)
  why = reasons.render(largest.why, cite=False) if largest else ""  # As `str(plan)` words it.
  if len(replicated) == len(plan.clusters):
    return (f"shards none of its {len(plan.clusters)} weight-update cluster(s); cluster "
            f"{largest.index}: {why}")
  if plan.replicated_bytes > plan.sharded_bytes + plan.owned_bytes:
    total = plan.replicated_bytes + plan.sharded_bytes + plan.owned_bytes
    return (f"keeps most of its weight update whole: {format_bytes(plan.replicated_bytes)} "
            f"of the {format_bytes(total)} of weights and optimizer state it updates are in "
            f"replicated clusters (whole on every device); the largest, cluster "
            f"{largest.index}: {why}")
  return None


def _fix(plan: Plan, front_end: str) -> str:
  """What to do about it, for the usual first cause: no batch split over a mesh axis."""
  if plan.unchanged is not None and isinstance(plan.unchanged.verdict, refusals.OwnError):
    return ("nothing in your program: the error is wus's own, a bug; please report it with "
            "this message")
  if plan.unchanged and not plan.axes:
    return ('place the batch over a mesh axis, e.g. batch = jax.device_put(batch, '
            'NamedSharding(mesh, P("data"))), or pass in_shardings=')
  if not plan.clusters and front_end.startswith(("wus.shard_map", "wus.pmap")):
    return ("split the batch over the data axis (in_specs=P(\"data\"); pmap's in_axes) and "
            "all-reduce the gradients over it (jax.lax.pmean(grads, \"data\"))")
  return "step.plan(*args) says why for each cluster, plan.details() for each tensor"


def warn_if_not_sharded(plan: Plan, step: Any) -> None:
  """Warns (`wus.NotShardedWarning`) when `step`'s Plan for a new signature saves little
  (`not_sharded`), with the Plan's first reason and the fix. Called once per compiled
  signature by each front end. The warning points at the user's call of the step."""
  why = not_sharded(plan)
  if why is None:
    return
  front_end = getattr(step, "front_end", None) or (
      f"wus.jit({getattr(step, '__name__', 'step')})")
  frame, level = sys._getframe(0), 1  # The first frame outside wus is the user's call.
  while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] == "wus":
    frame, level = frame.f_back, level + 1
  warnings.warn(f"{front_end} {why}. To fix: {_fix(plan, front_end)}. To silence: {SILENCE}",
                NotShardedWarning, stacklevel=level)


@dataclasses.dataclass(frozen=True)
class DeviceBytes:
  """Bytes of a tree on a device against one whole copy of it (`wus.bytes_per_device`).

  Attributes:
    per_device: bytes the device holding the most of the tree holds (int, bytes): its
      arrays' addressable shards on it, a `wus.ShardedArray`'s padding included, plus
      host values (NumPy arrays, Python numbers), counted whole on every device.
    whole: bytes of one whole copy of the tree (int, bytes): every leaf at its logical
      shape (a `wus.ShardedArray`'s `shape`, without padding) and dtype.
    devices: the devices holding part of the tree (0 for host values alone).
  """

  per_device: int
  whole: int
  devices: int

  @property
  def fraction(self) -> float:
    """`per_device / whole`: 1.0 for a tree every device holds whole, about 1/N for state
    sharded over N devices (0.0 for an empty tree)."""
    return self.per_device / self.whole if self.whole else 0.0

  def __repr__(self) -> str:
    return (f"DeviceBytes({format_bytes(self.per_device)} per device of "
            f"{format_bytes(self.whole)} whole: {self.fraction:.3g} of a copy, on "
            f"{self.devices} device(s))")


def bytes_per_device(tree: Any) -> DeviceBytes:
  """Bytes of `tree` per device against one whole copy: what switching to wus saved.

  Measured, not predicted: each `jax.Array` leaf counts the bytes of its addressable
  shards on each device (an array replicated over the mesh counts whole on every
  device, one split over it a part); a `wus.ShardedArray` counts its padded shards
  (`.data`). The step's Plan predicts the same figure for the state it keeps sharded
  ("state kept sharded between steps: ... per device").

  Args:
    tree: a pytree of arrays: optimizer state (`opt_state`, `nnx.state(optimizer,
      nnx.optimizer.OptState)`), whole or holding `wus.ShardedArray`s, on one mesh or
      several devices. In several processes, each measures its own devices.

  Returns:
    A `DeviceBytes`: `per_device` (bytes on the device holding the most), `whole`
    (bytes of one whole copy), `fraction` (their ratio), `devices`.

  Raises:
    TypeError: a leaf is not an array (a `jax.ShapeDtypeStruct`, a tracer inside a
      transformation).
    ValueError: a leaf's buffer was donated to an earlier call.

  Example:
    >>> wus.bytes_per_device(opt_state)  # Adam's state after a wus step on 8 devices.
    DeviceBytes(18.8 KiB per device of 150 KiB whole: 0.125 of a copy, on 8 device(s))
  """
  on, host, whole = collections.Counter(), 0, 0
  for path, x in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_sharded)[0]:
    name = "tree" + jax.tree_util.keystr(path)
    data = x.data if is_sharded(x) else x
    if isinstance(data, jax.core.Tracer) or not isinstance(
        data, (jax.Array, np.ndarray, np.generic, int, float, complex, bool)):
      raise TypeError(f"wus.bytes_per_device measures concrete arrays; {name} is "
                      f"{type(data).__name__}")
    if not isinstance(data, jax.Array):
      host += np.asarray(data).nbytes
      whole += np.asarray(data).nbytes
      continue
    check_alive(x, name, "wus.bytes_per_device")
    whole += x.nbytes
    for shard in data.addressable_shards:
      on[shard.device] += shard.data.nbytes
  return DeviceBytes(max(on.values(), default=0) + host, whole, len(on))
