"""Inlining of calls, so the analysis sees flat jaxprs.

`jit`, `closed_call`, `custom_jvp_call` and `custom_vjp_call` equations are
replaced by the equations of their inner jaxpr, also inside the branches and
bodies of `cond`, `while` and `scan` (which are retraced with the public lax
functions). XLA inlines calls anyway, and after AD the custom derivative rules
are dead, so the program computes exactly what it computed before.
`checkpoint` (remat) is kept: it tells XLA what to recompute in the backward
pass.

Gradient all-reduces that AD leaves inside a sub-jaxpr (with check_vma, the
transpose of a weight's pvary inside `jax.checkpoint` or a `lax.scan` over
stacked layers) are hoisted out of it: a remat output, or a scan's stacked
output, that is `psum(z)` of a value read by nothing else returns `z`, and the
psum runs on the result after the equation (on the stacked result: one
all-reduce for every layer). Each element sums the same values in the same
order, so the program computes exactly what it did; the analysis then sees
the all-reduce beside the update that reads it (§3.2).

With `rename`, mesh axes are renamed on the way (`shard_group_size`, §5.2):
each collective over a renamed axis runs over its tuple of axes instead and
`axis_index` of it is the row-major index over the tuple, so the step runs
unchanged on a mesh that splits the axis in two (`transforms.groups`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jax import lax

from wus.analysis import compat, precision
from wus.analysis.compat import ClosedJaxpr, Jaxpr
from wus.analysis.graph import Graph
from wus.transforms import interpret

INLINED = frozenset({compat.jit_p, compat.closed_call_p, compat.custom_jvp_call_p,
                     compat.custom_vjp_call_p})


def inlined(jaxpr: ClosedJaxpr, rename: Mapping[Any, tuple] | None = None
            ) -> Callable[..., list[Any]]:
  """A function evaluating `jaxpr` with its calls inlined; trace it to get the flat jaxpr.

  Args:
    jaxpr: a shard_map body.
    rename: optionally, mesh axis -> the tuple of axes that replaces it (trace
      the function inside a shard_map over a mesh with those axes).

  Example (inside shard_map, as `wus` retraces the step body):

    { lambda ; a:f32[3]. let b:f32[3] = jit[name=f jaxpr={... c = sin a ...}] a in (b,) }
    becomes
    { lambda ; a:f32[3]. let b:f32[3] = sin a in (b,) }

    and with rename={"data": ("data.groups", "data.in_group")}

    { lambda ; a:f32[3]. let b:f32[3] = psum[axes=(data,)] a in (b,) }
    becomes
    { lambda ; a:f32[3]. let b:f32[3] = psum[axes=(data.groups, data.in_group)] a in (b,) }
  """
  return lambda *args: _eval(jaxpr.jaxpr, jaxpr.consts, args, rename=rename or None)


def spliced(closed: ClosedJaxpr) -> ClosedJaxpr | None:
  """`inlined`'s flat jaxpr, built on the jaxpr's structure: each call's equations take
  the call's place, also in the jaxprs of `cond`, `while` and `scan`; nothing is traced
  (a tenth of a trace's time on a Transformer's step).

  Args:
    closed: a `jax.jit` step's jaxpr (global values), or a shard_map body closed with
      no constants (the pipeline's `flatten` stage).

  Returns:
    The flat jaxpr, with the same inputs and outputs; or None where only `inlined` applies
    (trace it then): an all-reduce inside a call or control flow (`inlined` hoists it), a
    remat, an operand whose type differs from the called jaxpr's (a trace would type the
    equations anew), a ref made inside a call, or constants of a call inside a jaxpr that
    holds none.
  """
  try:
    jaxpr, consts = _Splice().closed(closed.jaxpr, closed.consts)
  except _Unspliced:
    return None
  return ClosedJaxpr(jaxpr, consts)


class _Unspliced(Exception):
  """`spliced` does not apply; `inlined` does."""


class _Splice:
  """One scope of `spliced`: a jaxpr rebuilt with its calls' equations in their place."""

  def closed(self, jaxpr: Jaxpr, consts) -> tuple[Jaxpr, list]:
    """`jaxpr` (whose constants are `consts`) with every call spliced in, and the
    constants of the result."""
    self.env: dict = {}  # A variable of a spliced call's jaxpr -> its atom here.
    self.eqns: list = []
    self.constvars, self.consts = list(jaxpr.constvars), list(consts)
    for eqn in jaxpr.eqns:
      self.eqn(eqn, None, fresh=False)
    return jaxpr.replace(constvars=self.constvars, eqns=self.eqns,
                         outvars=[self.read(v) for v in jaxpr.outvars]), self.consts

  def read(self, atom):
    return atom if compat.is_literal(atom) else self.env.get(atom, atom)

  def eqn(self, eqn, caller, fresh: bool) -> None:
    """Appends `eqn` (of a call's jaxpr if `fresh`: its results get new variables), a
    call's equations in its place."""
    if caller is not None and not compat.has_user_frame(eqn):
      eqn = compat.attributed(eqn, caller)
    ins = [self.read(v) for v in eqn.invars]
    if eqn.primitive in INLINED:
      inner = compat.call_jaxpr(eqn)
      if any(a.aval != v.aval for a, v in zip(ins, inner.jaxpr.invars, strict=True)):
        raise _Unspliced
      for v, c in zip(inner.jaxpr.constvars, inner.consts, strict=True):
        self.constvars.append(w := compat.fresh_var(v))
        self.consts.append(c)
        self.env[v] = w
      self.env.update(zip(inner.jaxpr.invars, ins, strict=True))
      for e in inner.jaxpr.eqns:
        self.eqn(e, eqn if compat.has_user_frame(eqn) else caller, fresh=True)
      outs = [self.read(v) for v in inner.jaxpr.outvars]
      self.env.update((v, x) for v, x in zip(eqn.outvars, outs, strict=True)
                      if not isinstance(v, compat.DropVar))
      return
    params = eqn.params
    if next(compat.sub_jaxprs(eqn), None) is not None:
      params = _spliced_params(eqn)
    outvars = eqn.outvars
    if fresh:
      if any(compat.is_ref_type(v.aval) for v in outvars):
        raise _Unspliced
      outvars = [compat.fresh_var(v) for v in outvars]
      self.env.update(zip(eqn.outvars, outvars, strict=True))
    self.eqns.append(eqn.replace(invars=ins, outvars=outvars, params=params))


def _spliced_params(eqn) -> dict:
  """The params of `eqn` with calls spliced into its jaxprs: those of `cond`, `while` and
  `scan`, as `inlined` re-binds them; any other holder of jaxprs is kept as it is, as
  `inlined` binds it."""
  if eqn.primitive not in _CONTROL:
    if eqn.primitive is compat.remat_p:
      raise _Unspliced
    return eqn.params
  if compat.has_manual_code(eqn):
    raise _Unspliced

  def one(closed):
    jaxpr, consts = _Splice().closed(closed.jaxpr, closed.consts)
    if len(consts) != len(closed.consts):
      raise _Unspliced
    return ClosedJaxpr(jaxpr, consts)
  return {k: one(p) if isinstance(p, ClosedJaxpr)
          else tuple(one(b) for b in p) if k == "branches" else p
          for k, p in eqn.params.items()}


def _eval(jaxpr: Jaxpr, consts: Sequence[Any], args: Sequence[Any],
          caller=None, rename: Mapping[Any, tuple] | None = None,
          skip: frozenset = frozenset()) -> list[Any]:
  """Evaluates `jaxpr` with calls inlined (and axes renamed). Equations of an
  inlined call that keep no user frame are attributed to `caller`, the call's
  equation. The all-reduces whose ids are in `skip` (`hoistable`, here or in a
  remat inside) return their operand."""
  def hook(i, eqn, ins):
    if id(eqn) in skip:
      return ins[:1]  # An all-reduce hoisted out of this jaxpr.
    return eval_eqn(eqn, ins, caller, rename, skip)
  return interpret.eval_jaxpr(jaxpr, consts, args, hook,
                              interpret.value if rename is None else interpret.retyped)


def eval_eqn(eqn, ins: Sequence[Any], caller=None, rename: Mapping[Any, tuple] | None = None,
             skip: frozenset = frozenset()) -> list[Any]:
  """One equation of `_eval` on `ins` (its calls inlined), as a list of results."""
  if caller is not None and not compat.has_user_frame(eqn):
    eqn = compat.attributed(eqn, caller)
  if rename is not None:
    eqn = compat.in_current_mesh(eqn)
  if eqn.primitive in INLINED:
    inner = compat.call_jaxpr(eqn)
    return _eval(inner.jaxpr, inner.consts, ins,
                 eqn if compat.has_user_frame(eqn) else caller, rename)
  if eqn.primitive in _CONTROL:
    with compat.source_of(eqn):
      return _CONTROL[eqn.primitive](eqn, ins, rename)
  if eqn.primitive is compat.remat_p:
    return _remat(eqn, ins, rename, skip)
  if rename is not None:
    return _renamed(eqn, ins, rename)
  return compat.bind(eqn, *ins)


def hoistable(jaxpr: Jaxpr, outputs: Sequence[int]) -> dict[int, Any]:
  """The gradient all-reduces that can move out of a sub-jaxpr through its outputs.

  Args:
    jaxpr: a remat's jaxpr, a scan's body or a conditional's branch.
    outputs: positions among `jaxpr.outvars` to consider (a scan's stacked
      outputs; for a carry, moving the psum would change the summation order).

  Returns:
    Output position -> the psum equation (of one operand, over whole mesh
    axes) whose result the output is, directly or through layout-only copies
    (`precision.copy_chain`'s equations; a psum commutes with them) or through
    a remat inside, each read by nothing else. Skipping the psum inside and
    binding it on the output after the equation changes no value.
  """
  graph = Graph(jaxpr)
  producer = graph.producing
  found = {}
  for k in outputs:
    v = jaxpr.outvars[k]
    eqn = producer(v)
    while (eqn is not None and graph.uses(v) == 1 and eqn.primitive is not compat.pvary_p
           and precision.is_copy(eqn)):
      v = eqn.invars[0]
      eqn = producer(v)
    if eqn is not None and eqn.primitive is compat.remat_p and graph.uses(v) == 1:
      j = list(eqn.outvars).index(v)  # A psum inside a remat (nn.scan over nn.remat).
      if (inner := hoistable(compat.call_jaxpr(eqn).jaxpr, [j])):
        found[k] = inner[j]
      continue
    if (eqn is not None and eqn.primitive in (compat.psum_p, compat.psum_invariant_p)
        and len(eqn.invars) == 1 and not compat.has_axis_index_groups(eqn)
        and not compat.is_literal(eqn.invars[0]) and graph.uses(v) == 1):
      found[k] = eqn
  return found


def _all_reduce(eqn, x, rename):
  """The hoisted all-reduce `eqn` bound on `x` (axes renamed with `rename`)."""
  if rename is None:
    with compat.source_of(eqn):
      return compat.bind(eqn, x)[0]
  return _renamed(compat.in_current_mesh(eqn), [x], rename)[0]  # In the derived mesh.


def _renamed(eqn, ins, rename):
  """Re-binds `eqn` with the renamed axes (`inlined`'s `rename`)."""
  params = compat.renamed_axes(eqn, rename)
  if eqn.primitive is compat.axis_index_p and params:
    with compat.source_of(eqn):  # Row-major over the tuple: group * G + index in group.
      return [lax.axis_index(params["axis_name"])]
  if any(compat.names_axes(sub, rename) for sub in compat.sub_jaxprs(eqn)):
    raise NotImplementedError(f"{eqn.primitive} at {compat.source_line(eqn)} holds a jaxpr "
                              "that names the data-parallel axis; shard_group_size cannot "
                              "rename the mesh axes inside it")
  return compat.rebind(eqn, *ins, **params)


def _closed(jaxpr: ClosedJaxpr, rename=None, hoisted=()) -> Callable[[list[Any]], list[Any]]:
  skip = frozenset(id(e) for e in hoisted)
  return lambda args: _eval(jaxpr.jaxpr, jaxpr.consts, args, rename=rename, skip=skip)


def _remat(eqn, ins, rename, skip: frozenset):
  """A remat re-bound with its inner calls inlined and its output all-reduces
  hoisted: run after it, or further out where `skip` says an enclosing loop or
  conditional hoists them."""
  inner = compat.call_jaxpr(eqn)
  hoisted = hoistable(inner.jaxpr, range(len(inner.jaxpr.outvars)))
  elide = skip | {id(e) for e in hoisted.values()}
  outs = compat.rebind_call(
      eqn, lambda *a: _eval(inner.jaxpr, inner.consts, a, eqn, rename, elide), ins)
  return [_all_reduce(hoisted[k], x, rename) if k in hoisted and id(hoisted[k]) not in skip
          else x for k, x in enumerate(outs)]


def _cond(eqn, ins, rename):
  """A conditional re-bound with inlined branches; an output that every branch
  all-reduces (or where a branch gives zeros, e.g. a layer LayerDrop skips) is
  all-reduced after it, the zeros cast to varying (psum of zeros is zeros)."""
  cond = compat.cond(eqn)
  branches = [b.jaxpr for b in cond.branches]
  every = range(len(branches[0].outvars))
  psums = [hoistable(b, every) for b in branches]
  hoisted = {}
  for k in every:
    found = [p[k] for p in psums if k in p]
    if (found and all(k in p or Graph(b).is_zero(b.outvars[k]) for b, p in zip(branches, psums))
        and all(e.primitive is found[0].primitive and e.params == found[0].params
                for e in found)):
      hoisted[k] = found[0]

  def branch(closed, psum):
    run = _closed(closed, rename, [psum[k] for k in hoisted if k in psum])

    def body(args):
      return [compat.to_varying(x, [b for a in compat.collective_axes(hoisted[k])
                                    for b in (rename or {}).get(a, (a,))])
              if k in hoisted and k not in psum else x for k, x in enumerate(run(args))]
    return body
  outs = cond.bind(ins, [branch(b, p) for b, p in zip(cond.branches, psums)])
  return [_all_reduce(hoisted[k], x, rename) if k in hoisted else x for k, x in enumerate(outs)]


def _loop(eqn, ins, rename):
  loop = compat.loop(eqn)
  cond = None if loop.cond is None else _closed(loop.cond, rename)
  body = loop.body.jaxpr
  hoisted = ({} if loop.kind != "scan" else
             hoistable(body, range(loop.num_carry, len(body.outvars))))
  outs = loop.bind(ins, _closed(loop.body, rename, list(hoisted.values())), cond)
  return [_all_reduce(hoisted[k], x, rename) if k in hoisted else x for k, x in enumerate(outs)]


_CONTROL = {compat.cond_p: _cond, compat.while_p: _loop, compat.scan_p: _loop}
