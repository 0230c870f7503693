"""The Plan: every weight-update cluster, its tensors, format and decision (§3, §4).

`make_plan` runs the passes (clusters, formats, cost) on an analysed jaxpr and
freezes the result. The Plan is what the rewrite follows and what a user reads
to learn which tensors are sharded and why the others are not.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np
import jax.numpy as jnp
from jax import lax

from wus.analysis import clusters as clusters_lib
from wus.analysis import compat
from wus.analysis import cost, costmodel
from wus.analysis import formats
from wus.analysis import layouts
from wus.analysis.compat import Jaxpr, source_line
from wus.analysis.formats import ShardFormat
from wus.analysis.redundancy import Redundancy
from wus.analysis.shardable import Kind


@dataclasses.dataclass(frozen=True)
class TensorPlan:
  """One tensor a cluster reads or writes.

  Attributes:
    name: the pytree path of the input or output (`params['w']`), or what
      produced it.
    shape: logical shape.
    dtype: numpy dtype name.
    role: "gradient" (an all-reduce it replaces), "state" (an input kept
      sharded between steps), "weight" (an input the step also reads whole,
      sliced locally), or "output" (a result returned whole).
    format: its sharding format (None when the cluster stays replicated).
    itemsize: bytes per element (typed PRNG keys have no numpy dtype).
  """

  name: str
  shape: tuple[int, ...]
  dtype: str
  role: str
  format: ShardFormat | None
  itemsize: int = 4

  @property
  def nbytes(self) -> int:
    return int(np.prod(self.shape)) * self.itemsize


@dataclasses.dataclass(frozen=True)
class ClusterPlan:
  """The decision for one weight-update cluster (§3.2).

  Attributes:
    index: position in `Plan.clusters`.
    tensors: the tensors it reads and writes.
    sharded: whether it runs on shards.
    reason: why.
    all_reduce_bytes: whole bytes of its gradient all-reduces.
    all_gather_bytes: whole bytes it all-gathers per step when sharded.
    saved_bytes: predicted bytes of weights, state and outputs each replica no
      longer reads or writes per step when sharded.
    replicated_seconds, sharded_seconds: the cost model's prediction of the
      cluster's collectives and update, replicated and sharded (seconds;
      `cost.predict`), 0 where not predicted.
  """

  index: int
  tensors: tuple[TensorPlan, ...]
  sharded: bool
  reason: str
  all_reduce_bytes: int
  all_gather_bytes: int
  saved_bytes: int
  replicated_seconds: float = 0.0
  sharded_seconds: float = 0.0


@dataclasses.dataclass(frozen=True)
class InputPlan:
  """How one flat input of the step is passed.

  Attributes:
    name: pytree path of the argument leaf.
    shape, dtype: logical shape and numpy dtype name.
    sharded: whether it is kept sharded between steps (optimizer state).
    reason: why it is, or why it stays whole.
    state: whether an output is its next value (the step's state: weights,
      optimizer state), whether or not it is sharded.
    itemsize: bytes per element (typed PRNG keys have no numpy dtype).
  """

  name: str
  shape: tuple[int, ...]
  dtype: str
  sharded: bool
  reason: str
  state: bool = False
  itemsize: int = 4

  @property
  def nbytes(self) -> int:
    return int(np.prod(self.shape)) * self.itemsize


@dataclasses.dataclass(frozen=True)
class Program:
  """How the rewrite runs one jaxpr: the step, a conditional's branch, a loop body.

  Attributes:
    shard_eqns: equation index -> shard kind, for every equation that runs on
      shards (valid for the jaxpr the plan was made from).
    sharded_in: input position -> format, for inputs that arrive as shards.
    sharded_out: output position -> format, for outputs returned as shards.
    bodies: for each conditional in `shard_eqns`, one Program per branch; for
      each loop, its body's Program.
  """

  shard_eqns: Mapping[int, Kind]
  sharded_in: Mapping[int, ShardFormat]
  sharded_out: Mapping[int, ShardFormat]
  bodies: Mapping[int, tuple[Program, ...]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Plan:
  """The weight-update sharding plan of one step function.

  Attributes:
    axes: the replica mesh axes the update is sharded over.
    num_shards: replicas along `axes` (N).
    inputs: one entry per flat input.
    clusters: one entry per weight-update cluster.
    min_size: tensors with fewer elements (or fewer than N) stay whole.
    program: the rewrite's instructions for the step; its `sharded_in` are
      the inputs kept sharded between steps (optimizer state), its
      `sharded_out` the outputs returned sharded.
    formats: the format of every tensor a sharded cluster holds or reads as
      shards (keyed by the jaxpr's variables, nested jaxprs included).
    gather_dtypes: sharded tensors whose whole value is only ever read in a
      narrower float: their all-gather moves that dtype (Fig. 7).
    group_size: with `shard_group_size=G`, G (the update is sharded within
      groups of G replicas of one axis, §5.2); None otherwise.
    groups: how the replicas are grouped, in words ("" without groups).
    objective: "memory" or "time", what the cluster decisions favour (`cost.decide`).
    across_groups: with groups, the batched all-reduces of gradient shards
      across them per step (Fig. 10, right), predicted.
  """

  axes: tuple
  num_shards: int
  min_size: int
  inputs: tuple[InputPlan, ...]
  clusters: tuple[ClusterPlan, ...]
  program: Program
  formats: Mapping = dataclasses.field(default_factory=dict, repr=False)
  gather_dtypes: Mapping = dataclasses.field(default_factory=dict, repr=False)
  group_size: int | None = None
  groups: str = ""
  across_groups: int = 0
  objective: str = "memory"

  @property
  def shard_eqns(self) -> Mapping[int, Kind]:
    return self.program.shard_eqns

  @property
  def state_inputs(self) -> Mapping[int, ShardFormat]:
    """Flat input position -> format, for inputs passed sharded."""
    return self.program.sharded_in

  @property
  def state_outputs(self) -> Mapping[int, ShardFormat]:
    """Flat output position -> format, for outputs returned sharded."""
    return self.program.sharded_out

  @property
  def sharded_bytes(self) -> int:
    """Whole bytes of the tensors updated on shards."""
    return sum(t.nbytes for c in self.clusters if c.sharded for t in c.tensors
               if t.role in ("state", "weight"))

  @property
  def replicated_bytes(self) -> int:
    """Whole bytes of the weight-update tensors kept replicated."""
    return sum(t.nbytes for c in self.clusters if not c.sharded for t in c.tensors
               if t.role in ("state", "weight"))

  @property
  def state_bytes(self) -> tuple[int, int]:
    """(whole bytes, per-replica bytes) of the inputs kept sharded between steps."""
    whole = sum(self.inputs[k].nbytes for k in self.state_inputs)
    shard = sum(f.shard_size * self.inputs[k].itemsize for k, f in self.state_inputs.items())
    return whole, shard

  @property
  def whole_state_bytes(self) -> int:
    """Bytes of the step's state (inputs with a next value) each replica keeps whole."""
    return sum(i.nbytes for i in self.inputs if i.state and not i.sharded)

  def __str__(self) -> str:
    lines = [f"wus plan: weight update sharded over {self.axes} (N={self.num_shards})"]
    if self.groups:
      lines.append(self.groups)
    for c in self.clusters:
      verdict = "SHARDED" if c.sharded else "replicated"
      lines.append(f"cluster {c.index}: {verdict}: {c.reason}")
      if c.replicated_seconds:
        lines.append(f"    predicted: {c.sharded_seconds * 1e6:.3g} us sharded, "
                     f"{c.replicated_seconds * 1e6:.3g} us replicated (collectives and update, "
                     f"{self.objective} objective)")
      for t in c.tensors:
        fmt = str(t.format) if t.format is not None else "whole"
        lines.append(f"    {t.role:9s} {t.name:40s} {t.dtype:9s} {fmt}")
    lines.append("inputs:")
    for i in self.inputs:
      layout = "sharded" if i.sharded else "whole"
      lines.append(f"    {i.name:40s} {str(list(i.shape)):16s} {i.dtype:9s} {layout}: {i.reason}")
    whole, shard = self.state_bytes
    lines.append(f"totals: weight update {self.sharded_bytes} B on shards, "
                 f"{self.replicated_bytes} B in replicated clusters; state sharded "
                 f"{whole} B -> {shard} B per replica (predicted), state kept whole "
                 f"{self.whole_state_bytes} B (weights, tiny tensors: see inputs)")
    return "\n".join(lines)


def make_plan(jaxpr: Jaxpr, facts: Redundancy, *, axes: Sequence, num_shards: int,
              in_names: Sequence[str], out_names: Sequence[str],
              state_pairs: Mapping[int, int], min_size: int = 0,
              split_reason: str = "its in_spec splits it", objective: str = "memory",
              topology: costmodel.Topology | None = None) -> Plan:
  """Plans the weight-update sharding of a flat shard_map body.

  Args:
    jaxpr: the per-replica jaxpr, calls inlined.
    facts: its redundancy analysis.
    axes: the replica mesh axes (a gradient all-reduce runs over exactly these).
    num_shards: N, the number of replicas along `axes`.
    in_names, out_names: a name (pytree path) per flat input / output.
    state_pairs: output position -> input position for outputs that are the
      next value of an input (the step's state, matched by pytree structure).
      Such a pair stays sharded between steps when only the update reads the
      input.
    min_size: tensors with fewer elements stay replicated (never below N).
    split_reason: why an input that differs across replicas does (shown in
      the Plan; `wus.pmap` points at replicated_argnums).
    objective, topology: as for `cost.decide` (the topology has N devices).

  Returns:
    The frozen Plan.
  """
  def big(v) -> bool:
    return (not compat.is_literal(v)
            and formats.is_shardable_shape(tuple(v.aval.shape), num_shards, min_size))

  ctx = _Ctx(facts, frozenset(axes), num_shards, min_size, big, objective,
             topology or costmodel.default_topology(num_shards))
  planned = _plan(jaxpr, ctx, state_pairs, in_names, out_names)
  inputs = []
  state = set(state_pairs.values())
  for k, v in enumerate(jaxpr.invars):
    sharded, reason = planned.input_reason.get(
        k, (False, _why_whole(v, facts, ctx, bool(planned.clusters), split_reason)))
    inputs.append(InputPlan(in_names[k], tuple(v.aval.shape), v.aval.dtype.name, sharded, reason,
                            k in state, v.aval.dtype.itemsize))
  return Plan(tuple(axes), num_shards, min_size, tuple(inputs), tuple(planned.clusters),
              planned.program, planned.formats, planned.gather_dtypes, objective=objective)


def replicated(plan: Plan, reason: str) -> Plan:
  """`plan` with every cluster kept replicated and every input whole, for `reason`.

  The rewrite then replays the step unchanged.
  """
  clusters = tuple(dataclasses.replace(
      c, sharded=False, reason=reason,
      tensors=tuple(dataclasses.replace(t, format=None) for t in c.tensors)) for c in plan.clusters)
  inputs = tuple(dataclasses.replace(i, sharded=False, reason=reason) if i.sharded else i
                 for i in plan.inputs)
  return dataclasses.replace(plan, inputs=inputs, clusters=clusters, program=Program({}, {}, {}),
                             formats={}, gather_dtypes={})


@dataclasses.dataclass(frozen=True)
class _Ctx:
  facts: Redundancy
  axes: frozenset
  num_shards: int
  min_size: int
  big: object
  objective: str
  topology: costmodel.Topology


@dataclasses.dataclass
class _Planned:
  """The plan of one jaxpr (the step, or a loop body)."""

  program: Program
  clusters: list
  input_reason: dict
  formats: dict
  gather_dtypes: dict


def _plan(jaxpr: Jaxpr, ctx: _Ctx, state_pairs: Mapping[int, int], in_names, out_names,
          label: str = "", in_loop: bool = False, counters: frozenset = frozenset()) -> _Planned:
  """Clusters, formats and decisions of one jaxpr; loops inside are planned first.

  `counters` are a loop body's inputs that count iterations: a conditional
  whose predicate depends on one is taken every k steps (§3.2).
  """
  found = clusters_lib.find_clusters(jaxpr, ctx.facts, ctx.axes, ctx.num_shards, ctx.min_size)
  invar_pos = {v: k for k, v in enumerate(jaxpr.invars)}
  rare = _rare_conds(jaxpr, counters)
  cluster_plans, shard_eqns, state_in, state_out, all_formats, bodies = [], {}, {}, {}, {}, {}
  gather_dtypes: dict = {}
  input_reason: dict[int, tuple[bool, str]] = {}

  for i, loop in _plan_loops(jaxpr, ctx, in_names, label).items():
    shard_eqns[i], bodies[i] = Kind.LOOP, (loop.program,)
    cluster_plans += loop.clusters
    all_formats.update(loop.formats)
    gather_dtypes.update(loop.gather_dtypes)
    all_formats.update({jaxpr.eqns[i].outvars[k]: f for k, f in loop.carries.items()})
    for out_pos, in_pos in state_pairs.items():
      fmt = _loop_state(jaxpr, i, loop, jaxpr.outvars[out_pos], jaxpr.invars[in_pos])
      if fmt is not None:
        state_in[in_pos] = state_out[out_pos] = all_formats[jaxpr.invars[in_pos]] = fmt
        input_reason[in_pos] = (True, f"state of the loop at {source_line(jaxpr.eqns[i])}, "
                                      "sharded between steps")

  readers = _readers(jaxpr)
  clustered = {i for c in found for i in c.eqns}
  for c in found:
    idx = len(cluster_plans)
    members = set(c.eqns)
    layout = layouts.assign(jaxpr, c, ctx.num_shards, ctx.big)
    if not c.eqns:
      layout = _kept_whole_reason(jaxpr, c)
    if isinstance(layout, str):
      decision = cost.Decision(False, layout, 0, 0, 0)
      layout = layouts.Layout({}, frozenset(), frozenset())
      pairs = {}
    else:
      narrow = {} if in_loop else None
      pairs = _state_pairs(c, layout, jaxpr, members, state_pairs, invar_pos, readers, narrow)
      decision = cost.decide(c, layout, jaxpr, ctx.facts, ctx.axes, set(pairs), ctx.num_shards,
                             rare, objective=ctx.objective, topology=ctx.topology)
      if rare & set(c.nested) and decision.shard:
        decision = dataclasses.replace(decision, reason=decision.reason + "; " + ", ".join(
            f"the conditional at {source_line(jaxpr.eqns[i])} follows the loop counter: it "
            "gathers what it reads whole inside its branch, off the frequent path (§3.2)"
            for i in sorted(rare & set(c.nested))))
      if in_loop and decision.shard:
        gather_dtypes.update(narrow)
        decision = dataclasses.replace(decision, reason=decision.reason + "; " + _placements(
            c, jaxpr, members, state_pairs, pairs, narrow, invar_pos, in_names, readers))
    across = sorted({a for i in c.seeds for a in compat.collective_axes(jaxpr.eqns[i])}
                    - ctx.axes)
    if across and decision.shard:
      decision = dataclasses.replace(decision, reason=decision.reason + (
          f"; partial sharding (§5.2): reduce-scatter over {sorted(ctx.axes)}, the shards "
          f"all-reduced across {across}"))
    if c.kept_whole and c.eqns:
      decision = dataclasses.replace(decision, reason=decision.reason + "; "
                                     + _kept_whole_reason(jaxpr, c))
    fmt = layout.formats.get if decision.shard else (lambda v: None)
    tensors = _tensors(c, jaxpr, pairs, in_names, out_names, invar_pos, fmt)
    if not decision.shard:
      # The update goes on past the equation that stopped the cluster: name
      # what it reads and returns there as kept whole with this cluster.
      rest, rest_pairs = _continued(jaxpr, c, clustered, readers, state_pairs, ctx)
      tensors += _tensors(rest, jaxpr, rest_pairs, in_names, out_names, invar_pos, fmt)
      for v in rest.reads:
        input_reason.setdefault(invar_pos[v], (False, f"cluster {idx} stays replicated"))
    cluster_plans.append(ClusterPlan(idx, tensors, decision.shard, label + decision.reason,
                                     decision.all_reduce_bytes, decision.all_gather_bytes,
                                     decision.saved_bytes, decision.replicated_seconds,
                                     decision.sharded_seconds))
    for v in c.reads:
      if v in invar_pos:
        k = invar_pos[v]
        if decision.shard and k in pairs.values():
          input_reason[k] = (True, f"optimizer state: only cluster {idx} reads it")
        elif decision.shard:
          input_reason.setdefault(
              k, (False, f"read whole elsewhere; cluster {idx} slices it locally"))
        else:
          input_reason.setdefault(k, (False, f"cluster {idx} stays replicated"))
    if decision.shard:
      shard_eqns.update(c.kinds)
      all_formats.update(layout.formats)
      bodies.update(_bodies(jaxpr, c, layout, ctx.big))
      for out_pos, in_pos in pairs.items():
        state_in[in_pos] = state_out[out_pos] = layout.formats[jaxpr.invars[in_pos]]
  return _Planned(Program(shard_eqns, state_in, state_out, bodies), cluster_plans,
                  input_reason, all_formats, gather_dtypes)


def _kept_whole_reason(jaxpr: Jaxpr, c: clusters_lib.Cluster) -> str:
  """Which equations of the update run whole, and the readers that make them."""
  parts = []
  for r in sorted(set(c.kept_whole.values())):
    whole = [i for i, reader in c.kept_whole.items() if reader == r]
    collectives = [i for i in whole if jaxpr.eqns[i].primitive in (compat.psum_p,
                                                                    compat.psum_invariant_p)]
    what = (f"the all-reduce at {source_line(jaxpr.eqns[collectives[0]])}" if collectives
            else f"{jaxpr.eqns[max(whole)].primitive} at {source_line(jaxpr.eqns[max(whole)])}")
    parts.append(f"{what} and {len(whole) - 1} more equation(s) run whole: "
                 f"{jaxpr.eqns[r].primitive} at {source_line(jaxpr.eqns[r])} reads the result "
                 "whole and has no shard rule")
  return "; ".join(parts)


@dataclasses.dataclass
class _Loop:
  """A loop whose body runs the weight update on shards (§4.2)."""

  program: Program
  carries: dict           # Carry position -> format, for carries held as shards.
  read_whole: set         # Carries also read whole in the body (weights, Fig. 4 right).
  first_carry: int        # Operand position of carry 0 in the loop equation.
  clusters: list
  formats: dict
  gather_dtypes: dict


def _plan_loops(jaxpr: Jaxpr, ctx: _Ctx, in_names, label: str) -> dict[int, _Loop]:
  """Plans the body of every while / scan of `jaxpr` whose body shards something.

  Carried state (optimizer state) stays sharded across iterations: it is
  sharded before the loop and gathered after it only where read whole (Fig. 4
  left). Carries the loop condition reads stay whole.
  """
  invar_pos = {v: k for k, v in enumerate(jaxpr.invars)}
  loops = {}
  for i, eqn in enumerate(jaxpr.eqns):
    if eqn.primitive is compat.scan_p:
      body, num_consts, num_carry = compat.scan_parts(eqn)
      first, cond_reads = num_consts, set()
    elif eqn.primitive is compat.while_p:
      cond, cond_nconsts, body, num_consts = compat.while_parts(eqn)
      num_carry = len(body.jaxpr.outvars)
      first = cond_nconsts + num_consts
      read = {v for e in cond.jaxpr.eqns for v in e.invars if not compat.is_literal(v)}
      cond_reads = {k for k, v in enumerate(cond.jaxpr.invars[cond_nconsts:]) if v in read}
    else:
      continue
    inner = body.jaxpr
    names = [_outer_name(op, invar_pos, in_names, f"loop input {k}")
             for k, op in enumerate(eqn.invars[first - num_consts:])]
    pairs = {k: num_consts + k for k in range(num_carry) if k not in cond_reads}
    where = f"loop at {source_line(eqn)}: "
    counters = frozenset(inner.invars[num_consts + k] for k in range(num_carry)
                         if _counts(inner, num_consts + k, k))
    planned = _plan(inner, ctx, pairs, names, names[num_consts:num_consts + num_carry]
                    + [f"loop output {k}" for k in range(len(inner.outvars) - num_carry)],
                    label + where, in_loop=True, counters=counters)
    if planned.program.shard_eqns:
      carries = {k - num_consts: f for k, f in planned.program.sharded_in.items()}
      read_whole = {k for k in carries if inner.invars[num_consts + k] in planned.gather_dtypes}
      loops[i] = _Loop(planned.program, carries, read_whole, first, planned.clusters,
                       planned.formats, planned.gather_dtypes)
  return loops


def _counts(body: Jaxpr, in_pos: int, out_pos: int) -> bool:
  """Whether carry `in_pos` -> `out_pos` of a loop body is `i + 1` (an iteration counter)."""
  x, y = body.invars[in_pos], body.outvars[out_pos]
  for eqn in body.eqns:
    if y in eqn.outvars and eqn.primitive is lax.add_p:
      a, b = eqn.invars
      return ((a is x and compat.is_literal(b) and b.val == 1)
              or (b is x and compat.is_literal(a) and a.val == 1))
  return False


def _rare_conds(jaxpr: Jaxpr, counters: frozenset) -> set[int]:
  """Conditionals whose predicate depends on an iteration counter (§3.2)."""
  if not counters:
    return set()
  depends = set(counters)
  rare = set()
  for i, eqn in enumerate(jaxpr.eqns):
    if any(v in depends for v in eqn.invars if not compat.is_literal(v)):
      depends.update(eqn.outvars)
      if eqn.primitive is compat.cond_p and eqn.invars[0] in depends:
        rare.add(i)
  return rare


def _outer_name(v, invar_pos, in_names, default: str) -> str:
  return in_names[invar_pos[v]] if not compat.is_literal(v) and v in invar_pos else default


def _loop_state(jaxpr: Jaxpr, i: int, loop: _Loop, y, x):
  """The format of (x in, y out) if they are a loop carry kept sharded between steps.

  Weights the body reads whole (Fig. 4 right) leave the step whole: the user
  reads them too.
  """
  eqn = jaxpr.eqns[i]
  for k, fmt in loop.carries.items():
    if (k not in loop.read_whole and eqn.outvars[k] is y and eqn.invars[loop.first_carry + k] is x
        and all(x not in e.invars for j, e in enumerate(jaxpr.eqns) if j != i)
        and x not in jaxpr.outvars):
      return fmt
  return None


def _bodies(jaxpr: Jaxpr, c: clusters_lib.Cluster, layout: layouts.Layout,
            big) -> dict[int, tuple[Program, ...]]:
  """The branch Programs of the conditionals of a sharded cluster."""
  out = {}
  for i, subs in c.nested.items():
    progs = []
    for branch, sub in zip(compat.cond_branches(jaxpr.eqns[i]), subs, strict=True):
      inner = branch.jaxpr
      progs.append(Program(
          dict(sub.kinds),
          {k: layout.formats[v] for k, v in enumerate(inner.invars) if big(v)},
          {k: layout.formats[v] for k, v in enumerate(inner.outvars) if big(v)},
          _bodies(inner, sub, layout, big)))
    out[i] = tuple(progs)
  return out


def _readers(jaxpr: Jaxpr) -> dict:
  """Variable -> the indices of the equations of `jaxpr` that read it."""
  readers: dict = {}
  for i, eqn in enumerate(jaxpr.eqns):
    for v in eqn.invars:
      if not compat.is_literal(v):
        readers.setdefault(v, set()).add(i)
  return readers


def _state_pairs(c: clusters_lib.Cluster, layout: layouts.Layout, jaxpr: Jaxpr,
                 members: set[int], candidates: Mapping[int, int], invar_pos, readers: dict,
                 narrow: dict | None = None) -> dict[int, int]:
  """The (output, input) state pairs this cluster can keep sharded between steps.

  A pair qualifies when only the cluster reads the input. With `narrow` (a
  loop body), an input that is also read whole, but only ever converted to a
  narrower float first (the forward pass of mixed-precision training),
  qualifies too: it is all-gathered in that dtype where read (Fig. 4 right,
  Fig. 7), and `narrow` records input -> dtype. `readers` is `_readers(jaxpr)`.
  """
  outvars = {v for v in jaxpr.outvars if not compat.is_literal(v)}
  pairs = {}
  for out_pos, in_pos in candidates.items():
    x, y = jaxpr.invars[in_pos], jaxpr.outvars[out_pos]
    if compat.is_literal(y) or not (y in c.program_outputs and x in c.reads and x not in outvars
            and y not in layout.partial and x not in layout.whole_reads
            and x.aval.dtype == y.aval.dtype
            and layout.formats.get(x) == layout.formats.get(y) is not None):
      continue
    if readers.get(x, set()) <= members:
      pairs[out_pos] = in_pos
    elif narrow is not None and (dtype := _narrowed(jaxpr, x, members, readers)) is not None:
      pairs[out_pos] = in_pos
      narrow[x] = dtype
  return pairs


def _placements(c, jaxpr: Jaxpr, members: set[int], carries: Mapping[int, int],
                pairs: Mapping[int, int], narrow: dict, invar_pos, in_names,
                readers: dict) -> str:
  """Where each carried weight of a loop body's cluster is all-gathered, and why (Fig. 4).

  The choice is by bytes per iteration: gathering right before the forward
  pass (Fig. 4 right) moves the dtype the forward pass reads, gathering at the
  end of the iteration (Fig. 4 left) moves the weight's own dtype. Right wins
  only when the forward pass reads a narrower float (Fig. 7); at equal bytes,
  left keeps the carried weight whole, as the user's loop has it.
  """
  out = []
  for in_pos in sorted(set(carries.values())):
    x = jaxpr.invars[in_pos]
    if x not in c.reads or readers.get(x, set()) <= members:
      continue  # Not this cluster's, or optimizer state only the update reads.
    whole = x.aval.size * x.aval.dtype.itemsize
    if x in narrow:
      out.append(f"{in_names[in_pos]} kept sharded across iterations and all-gathered in "
                 f"{narrow[x].name} right before the forward pass reads it: "
                 f"{x.aval.size * narrow[x].itemsize} B per iteration instead of {whole} B "
                 "(Fig. 4 right, Fig. 7)")
    elif in_pos not in pairs.values():
      out.append(f"{in_names[in_pos]} all-gathered at the end of each iteration ({whole} B, "
                 f"{x.aval.dtype.name}): the forward pass reads it whole in that dtype, so "
                 "gathering before it would move as many bytes (Fig. 4 left)")
  return ", ".join(out) or "no carried weight is read whole: nothing gathered in the loop"


def _narrowed(jaxpr: Jaxpr, x, members: set[int], readers: dict):
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


def _tensors(c, jaxpr, pairs, in_names, out_names, invar_pos, fmt) -> tuple[TensorPlan, ...]:
  def entry(name, v, role):
    return TensorPlan(name, tuple(v.aval.shape), v.aval.dtype.name, role, fmt(v),
                      v.aval.dtype.itemsize)

  state_in = set(pairs.values())
  out = [entry(f"all-reduce at {source_line(jaxpr.eqns[i])}", jaxpr.eqns[i].outvars[0], "gradient")
         for i in c.seeds]
  for v in c.reads:
    if v in invar_pos:
      k = invar_pos[v]
      out.append(entry(in_names[k], v, "state" if k in state_in else "weight"))
  for v, positions in c.program_outputs.items():
    for p in positions:
      if p not in pairs:
        out.append(entry(out_names[p], v, "output"))
  return tuple(out)


def _continued(jaxpr: Jaxpr, c: clusters_lib.Cluster, clustered: set[int], readers: dict,
               state_pairs: Mapping[int, int], ctx: _Ctx) -> tuple[clusters_lib.Cluster, dict]:
  """The rest of a replicated cluster's weight update, which no cluster holds.

  Growth stops at an equation with no shard rule (a matmul with the weight, a
  product); the equations after it that every replica still repeats (all
  outputs identical across `ctx.axes`, no side effects), with the ones of that
  kind that feed them (the momentum of the same tensor), continue the same
  update. Returned as a cluster with no seeds or equations, only the big
  inputs they read (`reads`) and the outputs they return (`program_outputs`),
  so that the Plan lists them with the cluster that keeps them whole; and the
  pairs of `state_pairs` whose input only this update reads (state, not weight).
  """
  producer = {v: i for i, eqn in enumerate(jaxpr.eqns) for v in eqn.outvars}
  seen: set[int] = set()
  todo = [r for v in c.sharded for r in readers.get(v, ())] + list(c.kept_whole)
  while todo:
    i = todo.pop()
    if i in seen or i in clustered or not ctx.facts.repeats(jaxpr.eqns[i], ctx.axes):
      continue
    seen.add(i)
    eqn = jaxpr.eqns[i]
    todo += [r for v in eqn.outvars for r in readers.get(v, ())]
    todo += [producer[v] for v in eqn.invars if not compat.is_literal(v) and v in producer]
  inputs = set(jaxpr.invars) - set(c.reads)
  reads = {v: None for r in sorted(seen) for v in jaxpr.eqns[r].invars
           if not compat.is_literal(v) and v in inputs and ctx.big(v)}
  made = {v for r in seen for v in jaxpr.eqns[r].outvars}
  outputs: dict = {}
  for p, v in enumerate(jaxpr.outvars):
    if not compat.is_literal(v) and v in made and ctx.big(v) and v not in c.program_outputs:
      outputs.setdefault(v, []).append(p)
  update = seen | set(c.eqns)
  pairs = {o: k for o, k in state_pairs.items()
           if jaxpr.invars[k] in reads and readers.get(jaxpr.invars[k], set()) <= update}
  return (clusters_lib.Cluster((), {}, (), (), tuple(reads), {},
                               {v: tuple(p) for v, p in outputs.items()}), pairs)


def _why_whole(v, facts: Redundancy, ctx: _Ctx, any_cluster: bool, split_reason: str) -> str:
  """Why an input no cluster decided on stays whole."""
  if not facts.is_redundant(v, ctx.axes):
    return f"not identical across {sorted(ctx.axes)} ({split_reason})"
  if not ctx.big(v):
    return (f"scalar or tiny (at most {ctx.num_shards} elements, or fewer than "
            f"min_shard_size={ctx.min_size}): kept replicated")
  if not any_cluster:
    return (f"the step has no gradient all-reduce over exactly {sorted(ctx.axes)}, so no "
            "weight update to shard (pass axis_name= the data-parallel axes)")
  return "no weight-update cluster reads it (read whole only, e.g. by the forward pass)"
