"""Cross-replica redundancy: which values are identical on every replica (§3.1).

The fact for a value is the set of mesh axes over which it is identical on all
replicas ("replicated over"). Top is every manual axis (constants, inputs whose
in_spec does not split them); bottom is the empty set (may differ across every
axis); the meet of two facts is their intersection.

Sources: literals and constants, inputs not split over an axis, outputs of
all-reduces (psum, psum_invariant, pmax, pmin) and all-gathers. Kills:
axis_index and what depends on it, effects (callbacks, I/O), collectives over
replica subgroups (axis_index_groups), and every primitive without a rule.
Control flow recurses: cond meets its predicate with all branches; while and
scan run a bounded fixed point over their carries.

Rules live in `redundancy_rules`, keyed by primitive, as JAX's own checkers
do, each registered at its definition (`@redundancy_rule(prims...)`,
`rules.registrar`); a family of pure primitives by `register_standard`. A
primitive without a rule is conservatively varying over every axis.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from wus.analysis import causes, compat, primitives, rules
from wus.analysis.compat import ClosedJaxpr, Jaxpr, JaxprEqn, Var
from wus.analysis.graph import Graph

Rep = frozenset  # The mesh axes a value is replicated over.


@dataclasses.dataclass
class Redundancy:
  """Facts for every variable of a jaxpr and the jaxprs nested in it.

  Attributes:
    all_axes: the manual mesh axes facts range over (the top element).
    facts: fact per variable. A sub-jaxpr analysed several times (a loop body
      during its fixed point, or a jaxpr shared by two equations) holds the
      facts of its last analysis.
  """

  all_axes: frozenset
  facts: dict[Var, Rep] = dataclasses.field(default_factory=dict)

  def of(self, atom) -> Rep:
    """The fact of a variable or literal (literals are identical everywhere)."""
    return self.all_axes if compat.is_literal(atom) else self.facts[atom]

  def is_redundant(self, atom, axes: frozenset) -> bool:
    """Whether `atom` is identical on every replica of the mesh axes `axes`."""
    return axes <= self.of(atom)

  def repeats(self, eqn: JaxprEqn, axes: frozenset) -> bool:
    """Whether every replica of `axes` runs `eqn` to the same end: all its
    outputs identical across them, and no side effects (§3.1)."""
    return (not compat.side_effects(eqn)
            and all(self.is_redundant(v, axes) for v in eqn.outvars))


def why_differs(jaxpr: Jaxpr, facts: Redundancy, v, axes: frozenset,
                names: Sequence[str] = ()) -> str:
  """Why `v` of `jaxpr` may differ across the replicas of `axes`, in words.

  Follows `v` back to where the difference enters: an input split by its
  in_spec (this replica's batch, named by `names`, one per input of `jaxpr`:
  its pytree path), `axis_index`, an effect, or a primitive without a
  redundancy rule (which the analysis conservatively calls differing). Names
  the first such equation and its place in user code.
  """
  graph = Graph(jaxpr)
  inputs = {u: k for k, u in enumerate(jaxpr.invars)}
  seen, todo = set(), [v]
  while todo:
    u = todo.pop(0)
    if u in seen or compat.is_literal(u) or facts.is_redundant(u, axes):
      continue
    seen.add(u)
    eqn = graph.producing(u)
    if eqn is None:
      if u in inputs:
        name = names[inputs[u]] if names else f"input {inputs[u]}"
        return causes.DependsOnInput(name)
      continue
    varying = [w for w in eqn.invars if not compat.is_literal(w)
               and not facts.is_redundant(w, axes)]
    if varying:
      todo += varying
      continue
    where = causes.Eqn.of(eqn, compat.source_line(eqn))
    if eqn.primitive not in redundancy_rules:
      return causes.NoRedundancyRule(where)
    return causes.DependsOn(where, effects=bool(compat.side_effects(eqn)))
  return causes.VariesAcross()


def differs_over(jaxpr: Jaxpr, cluster, facts: Redundancy, axes: frozenset,
                 names: Sequence[str] = ()) -> str | None:
  """Why the replicas of `axes` may not run a weight-update cluster to the same end, or
  None when they all do (§3.1, applied to the axes besides the replica axes: a
  tensor-parallel step's "model").

  None when every value the cluster's equations read or write (nested branches
  included) is identical across the replicas of `axes`, none has side effects, and its
  gradient all-reduces run over none of them, or every one over all of them
  (`sums_over`: HSDP's biases, summed over "replica" and "fsdp"; their operands
  differ). Each replica of `axes` then holds the same gradient sums, state and
  weights: the update can be sharded over them too, each keeping its part of the
  shard with no communication, or reduce-scattered over them with the replica axes.

  Args:
    jaxpr: the jaxpr the cluster belongs to.
    cluster: a `clusters.Cluster` (`eqns`, `seeds`, `nested`).
    facts: the redundancy analysis of `jaxpr`.
    axes: mesh axes, not the replica axes the cluster's all-reduces run over.
    names: a name per input of `jaxpr`, for the reason (`why_differs`).

  Returns:
    None, or the reason in words (`why_differs`).
  """
  summed = set(cluster.seeds) if sums_over(jaxpr, cluster, axes) else set()
  for i in (i for i in cluster.seeds if i not in summed):
    if set(compat.collective_axes(jaxpr.eqns[i])) & axes:
      return causes.AllReduceOverSome(compat.source_line(jaxpr.eqns[i]))
  for i in cluster.eqns:
    eqn = jaxpr.eqns[i]
    if compat.side_effects(eqn):
      return causes.HasEffects(causes.Eqn.of(eqn, compat.source_line(eqn)))
    if (v := next((v for v in (*(() if i in summed else eqn.invars), *eqn.outvars)
                   if not facts.is_redundant(v, axes)), None)) is not None:
      return why_differs(jaxpr, facts, v, axes, names)
  for i, subs in cluster.nested.items():
    cond = compat.cond(jaxpr.eqns[i])
    pos = {v: k for k, v in enumerate(jaxpr.invars)}
    inner = [names[pos[v]] if names and not compat.is_literal(v) and v in pos
             else f"operand {k} of the conditional at {compat.source_line(jaxpr.eqns[i])}"
             for k, v in enumerate(cond.operands)]
    for b, sub in zip(cond.branches, subs, strict=True):
      if (why := differs_over(b.jaxpr, sub, facts, axes, inner)) is not None:
        return why
  return None


def sums_over(jaxpr: Jaxpr, cluster, axes: frozenset) -> bool:
  """Whether every gradient all-reduce of the cluster runs over all of `axes` (besides
  the replica axes): its sums are then identical across them, and one reduce-scatter
  over the replica axes and `axes` gives each replica its part."""
  return bool(cluster.seeds) and all(
      axes <= set(compat.collective_axes(jaxpr.eqns[i])) for i in cluster.seeds)


RedundancyRule = Callable[[JaxprEqn, list[Rep], Redundancy], list[Rep]]
redundancy_rules: dict[compat.Primitive, RedundancyRule] = {}
redundancy_rule = rules.registrar(redundancy_rules, "redundancy rule")


def analyze(jaxpr: Jaxpr | ClosedJaxpr, in_rep: Sequence[Rep],
            all_axes: frozenset, result: Redundancy | None = None) -> Redundancy:
  """Runs the redundancy analysis on a shard_map body.

  Args:
    jaxpr: the per-replica jaxpr. Constants of a ClosedJaxpr are identical on
      every replica.
    in_rep: one fact per input variable, for example every manual axis not
      named in the input's in_spec.
    all_axes: the manual mesh axes of the shard_map.
    result: facts to add to (used by the recursive rules).

  Returns:
    The facts of every variable, nested jaxprs included; `out_rep(...)` gives
    the outputs'.
  """
  result = Redundancy(frozenset(all_axes)) if result is None else result
  _eval(jaxpr, in_rep, result)
  return result


def out_rep(jaxpr: Jaxpr | ClosedJaxpr, facts: Redundancy) -> list[Rep]:
  """The facts of a jaxpr's outputs after `analyze`."""
  inner = jaxpr.jaxpr if isinstance(jaxpr, ClosedJaxpr) else jaxpr
  return [facts.of(v) for v in inner.outvars]


def _eval(jaxpr: Jaxpr | ClosedJaxpr, in_rep: Sequence[Rep], facts: Redundancy) -> list[Rep]:
  """One pass over `jaxpr`: the interpreter loop of `jax.core.eval_jaxpr`."""
  inner = jaxpr.jaxpr if isinstance(jaxpr, ClosedJaxpr) else jaxpr
  for v in inner.constvars:
    facts.facts[v] = facts.all_axes
  for v, r in zip(inner.invars, in_rep, strict=True):
    facts.facts[v] = frozenset(r)
  for eqn in inner.eqns:
    ins = [facts.of(v) for v in eqn.invars]
    rule = (varying if compat.side_effects(eqn) and eqn.primitive not in _RECURSIVE
            else redundancy_rules.get(eqn.primitive, varying))
    outs = rule(eqn, ins, facts)
    for v, r in zip(eqn.outvars, outs, strict=True):
      facts.facts[v] = r
  return out_rep(inner, facts)


def varying(eqn: JaxprEqn, ins: Sequence[Rep], facts: Redundancy) -> list[Rep]:
  """The default rule, and every effectful equation's but a call's or control flow's:
  its results may differ on every replica."""
  del ins, facts
  return [frozenset()] * len(eqn.outvars)


def _meet(reps: Sequence[Rep], top: frozenset) -> Rep:
  out = top
  for r in reps:
    out = out & r
  return out


# --- Pure primitives: the meet of the inputs. -------------------------------

def _standard_rule(eqn: JaxprEqn, ins: list[Rep], facts: Redundancy) -> list[Rep]:
  return [_meet(ins, facts.all_axes)] * len(eqn.outvars)


def register_standard(*prims: compat.Primitive) -> None:
  """Declares primitives pure and deterministic: output fact = meet of inputs."""
  redundancy_rule(*rules.distinct(*prims))(_standard_rule)


register_standard(*primitives.ELEMENTWISE, *primitives.PURE)


# --- Collectives. ------------------------------------------------------------

# Sets of primitives (`rules.distinct`): compat may name one primitive twice.
@redundancy_rule(*rules.distinct(compat.psum_p, compat.psum_invariant_p, compat.pmax_p,
                                 compat.pmin_p, compat.all_gather_p,
                                 compat.all_gather_invariant_p, compat.pbroadcast_p))
def _all_reduce_rule(eqn: JaxprEqn, ins: list[Rep], facts: Redundancy) -> list[Rep]:
  axes = frozenset(compat.collective_axes(eqn))
  if compat.has_axis_index_groups(eqn):
    return [r - axes for r in ins]  # Subgroups differ from each other.
  return [(r | axes) & facts.all_axes for r in ins]


@redundancy_rule(*rules.distinct(compat.reduce_scatter_p, compat.ppermute_p,
                                 compat.all_to_all_p))
def _scatter_rule(eqn: JaxprEqn, ins: list[Rep], facts: Redundancy) -> list[Rep]:
  axes = frozenset(compat.collective_axes(eqn))
  return [ins[0] - axes] * len(eqn.outvars)


@redundancy_rule(compat.ragged_all_to_all_p)
def _ragged_rule(eqn: JaxprEqn, ins: list[Rep], facts: Redundancy) -> list[Rep]:
  # The result is the `output` operand with received rows written where the
  # offsets and sizes say: it depends on every operand.
  return [_meet(ins, facts.all_axes) - frozenset(compat.collective_axes(eqn))]


@redundancy_rule(compat.pvary_p)
def _identity_rule(eqn: JaxprEqn, ins: list[Rep], facts: Redundancy) -> list[Rep]:
  return list(ins)  # pvary changes a type, not a value.


@redundancy_rule(compat.axis_index_p)
def _axis_index_rule(eqn: JaxprEqn, ins: list[Rep], facts: Redundancy) -> list[Rep]:
  return [facts.all_axes - frozenset(compat.collective_axes(eqn))]


# --- Calls and control flow: recurse. --------------------------------------

@redundancy_rule(*rules.distinct(*compat.CALL_JAXPR_PARAM))
def _call_rule(eqn: JaxprEqn, ins: list[Rep], facts: Redundancy) -> list[Rep]:
  return _eval(compat.call_jaxpr(eqn), ins, facts)


@redundancy_rule(compat.cond_p)
def _cond_rule(eqn: JaxprEqn, ins: list[Rep], facts: Redundancy) -> list[Rep]:
  cond = compat.cond(eqn)
  pred, ops = cond.split(ins)
  outs = [_eval(b, ops, facts) for b in cond.branches]
  return [_meet(rs, facts.all_axes) & pred for rs in zip(*outs, strict=True)]


def _fixed_point(step: Callable[[list[Rep]], list[Rep]], init: list[Rep],
                 num_axes: int, what: str) -> list[Rep]:
  """Iterates carry <- carry ∩ step(carry) until it stops changing.

  Each round that changes removes at least one axis from one carry, so
  1 + len(init) * num_axes rounds always suffice.
  """
  carry = list(init)
  for _ in range(1 + len(carry) * num_axes):
    new = [c & o for c, o in zip(carry, step(carry), strict=True)]
    if new == carry:
      return carry
    carry = new
  raise RuntimeError(f"redundancy of the {what} carry did not reach a fixed point")


@redundancy_rule(compat.while_p)
def _while_rule(eqn: JaxprEqn, ins: list[Rep], facts: Redundancy) -> list[Rep]:
  loop = compat.loop(eqn)
  cond_consts, body_consts, init, _ = loop.split(ins)

  def step(carry: list[Rep]) -> list[Rep]:
    # A predicate that differs across replicas runs a different number of
    # iterations on each: every carry then varies too.
    (pred,) = _eval(loop.cond, cond_consts + carry, facts)
    return [r & pred for r in _eval(loop.body, body_consts + carry, facts)]

  return _fixed_point(step, init, len(facts.all_axes), "while")


@redundancy_rule(compat.scan_p)
def _scan_rule(eqn: JaxprEqn, ins: list[Rep], facts: Redundancy) -> list[Rep]:
  loop = compat.loop(eqn)
  _, consts, init, xs = loop.split(ins)
  carry = _fixed_point(lambda c: _eval(loop.body, consts + c + xs, facts)[:loop.num_carry],
                       init, len(facts.all_axes), "scan")
  ys = _eval(loop.body, consts + carry + xs, facts)[loop.num_carry:]
  return carry + ys


# Rules that look inside and see the effects themselves.
_RECURSIVE = frozenset(p for p, rule in redundancy_rules.items()
                       if rule in (_call_rule, _cond_rule, _while_rule, _scan_rule))
