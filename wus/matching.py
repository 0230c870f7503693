"""State matching: which output of a step is the next value of which input (its state).

The front ends pair the step's flat input and output leaves by position, name
and tree structure (`match_state`), and name every leaf under the parameter it
is passed to (`argument_paths`), for the Plan.
"""

from __future__ import annotations

import collections
import dataclasses
import inspect
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from wus.sharded import is_sharded


def aval(x) -> tuple:
  """(shape, dtype) of an argument or output leaf, without touching its data."""
  dtype = getattr(x, "dtype", None)
  return tuple(np.shape(x)), dtype if dtype is not None else np.result_type(type(x))


def argument_paths(f: Callable, args: tuple, keywords: bool = False,
                   positions: Sequence[int] | None = None) -> list[str]:
  """Each flat leaf of `args` as `jax.tree_util.keystr` prints its path under the name of
  `f`'s parameter it is passed to: `opt_state[0].mu['Dense_0']['kernel']` (`[1]` where
  the parameter has no name). With `keywords`, the last argument is a dict of keyword
  arguments (`wus.pmap`, `wus.jit`), each leaf named under its keyword: `mom['w1']`.
  `positions` gives each positional argument's parameter position (static arguments
  left out); None: 0, 1, 2, ..."""
  try:
    params = list(inspect.signature(f).parameters.values())
  except (TypeError, ValueError):  # No signature (a builtin): positions.
    params = []
  named = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
  rest = next((p.name for p in params if p.kind == p.VAR_POSITIONAL), None)
  out = []
  for i, arg in enumerate(args):
    flat = jax.tree_util.tree_flatten_with_path(arg, is_leaf=is_sharded)[0]
    if keywords and i == len(args) - 1:
      out += [f"{p[0].key}{jax.tree_util.keystr(p[1:])}" for p, _ in flat]
      continue
    i = i if positions is None else positions[i]
    name = (named[i] if i < len(named) else f"{rest}[{i - len(named)}]" if rest else f"[{i}]")
    out += [name + jax.tree_util.keystr(p) for p, _ in flat]
  return out


def renamed_paths(paths: list[str], prefix: str, names: dict[int, str]) -> list[str]:
  """`paths` with each leading `prefix[k]` replaced by `names[k]` (where given): an
  adapter's own parameter (`args[1]` of `filter_jit`'s wrapper) as the user's
  (`opt_state`)."""
  pattern = re.compile(re.escape(prefix) + r"\[(\d+)\]")

  def one(path: str) -> str:
    m = pattern.match(path)
    if m is None or int(m.group(1)) not in names:
      return path
    return names[int(m.group(1))] + path[m.end():]
  return [one(p) for p in paths]


def parameter_names(f: Callable) -> list[str]:
  """`f`'s positional parameter names (none if its signature cannot be read)."""
  try:
    params = inspect.signature(f).parameters.values()
  except (TypeError, ValueError):
    return []
  return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


@dataclasses.dataclass(frozen=True)
class Signature:
  """How a front end's positional arguments map to the user's parameters.

  Attributes:
    names: the user function's positional parameter names, in order (empty
      when its signature cannot be read: `*args`, builtins).
    positions: per positional argument the step receives, its parameter
      position (`wus.pmap` drops static arguments); None: 0, 1, 2, ...
    keywords: the last argument is a dict of keyword arguments (`wus.pmap`),
      each standing for the parameter of its name.
  """

  names: tuple[str, ...] = ()
  positions: tuple[int, ...] | None = None
  keywords: bool = False

  @classmethod
  def of(cls, f: Callable, **kw) -> Signature:
    """`f`'s positional parameter names (none if they cannot be read)."""
    try:
      params = inspect.signature(f).parameters.values()
    except (TypeError, ValueError):
      return cls((), **kw)
    return cls(tuple(p.name for p in params
                     if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)), **kw)


@dataclasses.dataclass(frozen=True)
class StateMatch:
  """Which outputs are the next values of which inputs (the step's state).

  Attributes:
    pairs: flat output leaf position -> flat input leaf position.
    how: flat input leaf position -> the rule that paired it ("position",
      "name 'mom'", "structure"), or why it has no next value although
      outputs share its tree structure; for the Plan.
  """

  pairs: dict[int, int]
  how: dict[int, str]


@dataclasses.dataclass(frozen=True)
class _Part:
  """A subtree of the arguments or of the outputs, as `match_state` compares them."""

  position: int | None  # Parameter position (inputs) or tuple position (outputs), top level.
  name: str | None      # Parameter name, keyword, dict key or attribute name.
  label: str            # Its path, for the Plan.
  level: int            # 0: an argument or output element (-1: the whole output); 1: one down.
  treedef: Any
  avals: tuple
  start: int            # Its first flat leaf.

  @property
  def leaves(self) -> range:
    return range(self.start, self.start + len(self.avals))


def _parts(entries, start: int, level: int) -> list[tuple[_Part, Any]]:
  """(part, subtree) per (position, name, label, subtree) entry, from flat leaf `start` on."""
  out = []
  for position, name, label, tree in entries:
    leaves, treedef = jax.tree.flatten(tree, is_leaf=is_sharded)
    out.append((_Part(position, name, label, level, treedef, tuple(map(aval, leaves)), start),
                tree))
    start += len(leaves)
  return out


def _kids(part: _Part, tree, positions: bool = False) -> list[tuple[_Part, Any]]:
  """The parts one level below `tree` (none for a leaf), named by dict key or attribute."""
  if is_sharded(tree):
    return []
  flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is not tree)[0]
  if len(flat) == 1 and not flat[0][0]:
    return []
  entries = []
  for k, ((key,), kid) in enumerate(flat):
    name = getattr(key, "name", getattr(key, "key", None))
    entries.append((k if positions else None, name if isinstance(name, str) else None,
                    part.label + jax.tree_util.keystr((key,)), kid))
  return _parts(entries, part.start, part.level + 1)


def match_state(args: tuple, out: Any, signature: Signature = Signature()) -> StateMatch:
  """Pairs output leaves with the input leaves they are the next value of.

  Parts of the arguments (each argument or keyword argument, and its entries
  one level down) are paired with parts of the output (the whole output, its
  elements, and their entries one level down) by these rules, in order, each
  for the parts still unpaired:

    1. position: element i of a tuple output is the next value of the argument
       at parameter position i (a keyword argument at its parameter's
       position): `(params, opt_state, batch) -> (params, opt_state, metrics)`,
       also when `wus.pmap` passes them as keywords;
    2. name: an output under dict key or attribute k is the next value of the
       parameter, keyword argument or argument entry named k (jaxline's
       `{"params": ..., "mom": ...}` from `(params, mom, batch)`); a name that
       several unpaired parts of one side carry decides nothing;
    3. structure: an input part and an output part pair when their tree
       structures, shapes and dtypes agree and no other unpaired part of
       either side has them (`return opt_update(...)`; `(params, opt)` from
       one tuple argument); then the same with tree structures alone. One
       level down, only subtrees (not bare arrays) pair by structure. Parts
       that several others match stay unpaired, and the Plan says why;
    4. nested structure: subtrees of more than one leaf at any depth pair when
       their tree structures, shapes and dtypes agree and no other unpaired
       subtree of either side has them, largest first: a wrapper that nests
       the state (haliax's `named_jit` jits `fun(dynamic_donated,
       dynamic_reserved, static)`, the state inside the first, and returns
       `(out_dynamic, Static)`, the new state inside the first).

  Rules 1 and 2 need equal tree structures; within paired parts, leaves pair
  where shape and dtype agree (a hyperparameter whose dtype the update
  changes stays unpaired).

  Args:
    args: the step's positional arguments (`wus.pmap`: and a dict of keywords).
    out: its output tree (leaves with `shape` and `dtype`).
    signature: how the arguments map to the user function's parameters.

  Returns:
    The StateMatch, in flat leaf positions (`jax.tree.leaves(args,
    is_leaf=wus.sharded.is_sharded)`, `jax.tree.leaves(out)`).
  """
  ins, tops, outs, nested = _sides(args, out, signature)
  m = _Pairing()
  m.by_position(ins, tops)
  m.by_name(ins, outs)
  # One level down only subtrees pair by structure (a bare array there matches too much).
  ins, outs = ([p for p in parts if p.level < 1 or p.treedef.num_nodes > 1]
               for parts in (ins, outs))
  m.by_structure(ins, outs)
  m.by_nested_structure(*nested)
  m.say_ambiguous(ins, outs)
  return StateMatch(m.pairs, m.how)


def _sides(args: tuple, out: Any, signature: Signature):
  """(input parts, output elements, output parts, (input subtrees, output subtrees)) as
  `match_state` compares them: each argument or keyword argument and its entries one level
  down; the whole output, its elements, and their entries one level down; every subtree of
  more than one leaf of either side, largest first (rule 4)."""
  names = signature.names
  positional = args[:-1] if signature.keywords else args
  positions = signature.positions or tuple(range(len(positional)))
  entries = [(p, names[p] if p < len(names) else None, f"[{p}]", a)
             for p, a in zip(positions, positional, strict=True)]
  if signature.keywords:
    entries += [(names.index(k) if k in names else None, k, k, a)
                for k, a in sorted(args[-1].items())]
  top_in = _parts(entries, 0, 0)
  ins = [p for p, _ in top_in] + [k for p, a in top_in for k, _ in _kids(p, a)]
  (whole, _), = _parts([(None, None, "", out)], 0, -1)
  top_out = _kids(whole, out, positions=isinstance(out, (tuple, list)))
  tops = [p for p, _ in top_out]
  return ins, tops, [whole, *tops, *(k for p, o in top_out for k, _ in _kids(p, o))], (
      _subtrees(top_in), _subtrees([(whole, out)]))


def _subtrees(parts: list[tuple[_Part, Any]]) -> list[_Part]:
  """These parts and every subtree below them, of more than one leaf, largest first."""
  out, todo = [], list(parts)
  while todo:
    part, tree = todo.pop()
    if part.treedef.num_leaves > 1:
      out.append(part)
      todo += _kids(part, tree)
  return sorted(out, key=lambda p: -len(p.avals))


class _Pairing:
  """The pairs `match_state` has found so far (flat leaf positions), and which leaves of
  each side they took; each rule pairs only parts with no leaf taken."""

  def __init__(self):
    self.pairs: dict[int, int] = {}
    self.how: dict[int, str] = {}
    self.paired_in: set[int] = set()
    self.paired_out: set[int] = set()

  @staticmethod
  def free(part: _Part, taken) -> bool:
    return bool(part.avals) and not any(j in taken for j in part.leaves)

  def pair(self, i: _Part, o: _Part, rule: str) -> None:
    for j, (x, y) in enumerate(zip(i.avals, o.avals, strict=True)):
      if x == y:
        self.pairs[o.start + j] = i.start + j
        self.how[i.start + j] = rule
    self.paired_out.update(o.leaves)
    self.paired_in.update(i.leaves)

  def by_position(self, ins: list[_Part], tops: list[_Part]) -> None:
    """Rule 1: element i of a tuple output, argument at parameter position i, where some
    leaf of theirs agrees in shape and dtype (a step returning only its new weights, a list
    of (kernel, bias) pairs, does not pair its second layer with the (inputs, targets)
    batch at position 1)."""
    for i in ins:
      o = next((o for o in tops if o.position is not None and o.position == i.position), None)
      if (i.level == 0 and o is not None and o.treedef == i.treedef
          and any(x == y for x, y in zip(i.avals, o.avals, strict=True))
          and self.free(i, self.paired_in) and self.free(o, self.paired_out)):
        self.pair(i, o, "position")

  def by_name(self, ins: list[_Part], outs: list[_Part]) -> None:
    """Rule 2: an output under key or attribute k, the input part named k; arguments
    before their entries."""
    for level in (0, 1):
      by_name = collections.defaultdict(list)
      for i in ins:
        if i.level == level and i.name is not None and self.free(i, self.paired_in):
          by_name[i.name].append(i)
      for name, found in by_name.items():
        cands = [o for o in outs if o.name == name and self.free(o, self.paired_out)]
        if len(found) == 1 and len(cands) == 1 and cands[0].treedef == found[0].treedef:
          self.pair(found[0], cands[0], f"name {name!r}")

  def by_structure(self, ins: list[_Part], outs: list[_Part]) -> None:
    """Rule 3: where one part of each side matches, by structure, shapes and dtypes, then
    by structure alone, until nothing more pairs."""
    for exact in (True, False):
      def same(i: _Part, o: _Part) -> bool:
        return i.treedef == o.treedef and (not exact or i.avals == o.avals)
      changed = True
      while changed:
        changed = False
        for i in ins:
          if not self.free(i, self.paired_in):
            continue
          cands = [o for o in outs if self.free(o, self.paired_out) and same(i, o)]
          if (len(cands) == 1 and
              [j for j in ins if self.free(j, self.paired_in) and same(j, cands[0])] == [i]):
            self.pair(i, cands[0], "structure")
            changed = True

  def by_nested_structure(self, ins: list[_Part], outs: list[_Part]) -> None:
    """Rule 4: subtrees at any depth, largest first, where exactly one unpaired subtree of
    each side has this tree structure, these shapes and dtypes."""
    def key(part: _Part) -> tuple:
      return part.treedef, part.avals
    groups_in, groups_out = collections.defaultdict(list), collections.defaultdict(list)
    for part in ins:
      groups_in[key(part)].append(part)
    for part in outs:
      groups_out[key(part)].append(part)
    for i in ins:
      if not self.free(i, self.paired_in):
        continue
      cands = [o for o in groups_out[key(i)] if self.free(o, self.paired_out)]
      twins = [j for j in groups_in[key(i)] if self.free(j, self.paired_in)]
      if len(cands) == 1 and twins == [i]:
        self.pair(i, cands[0], "nested structure")

  def say_ambiguous(self, ins: list[_Part], outs: list[_Part]) -> None:
    """Says, for each unpaired input part that unpaired outputs match, why it has none."""
    free_in = [j for j in ins if self.free(j, self.paired_in)]
    for i in ins:
      cands = [o.label or "the whole output" for o in outs if self.free(o, self.paired_out)
               and o.treedef == i.treedef and o.avals == i.avals]
      if self.free(i, self.paired_in) and cands:
        others = [j.label for j in free_in if j is not i
                  and j.treedef == i.treedef and j.avals == i.avals]
        why = (f"no next value: its tree structure, shapes and dtypes match output(s) "
               f"{', '.join(cands)}" + (f" and input(s) {', '.join(others)}" if others else "")
               + ", so neither position nor name decides; return it at its argument's "
               "position or under its parameter's name")
        self.how.update(dict.fromkeys(i.leaves, why))
