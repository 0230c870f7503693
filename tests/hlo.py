"""Readers of optimized HLO text (`Compiled.as_text()`) for tests: collectives, their
result bytes and groups, loop bodies, data movement and copies of entry parameters,
fused kernels.

The tests' own, so that the core's tests read compiled programs without the harness
(`wus.harness.tools.report` measures the same things for the reports; these count only
what a test asserts on). Async pairs (`<kind>-start` / `<kind>-done`) are one
collective: `collectives` counts it at its `-done` (whose shape is the result), the
line readers below at its `-start`.
"""

from __future__ import annotations

import math
import re
from typing import NamedTuple

import numpy as np

COLLECTIVE_KINDS = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all",
                    "collective-permute")

# `[ROOT ]%name = <shape> <opcode>(<operands>), attributes`: <shape> an array `f32[8,125]{1,0}`
# or a tuple of them, nested at most once.
_INSTRUCTION = re.compile(r"\s*(?:ROOT )?%(?P<name>[\w.\-]+) = "
                          r"(?P<shape>\((?:[^()]|\([^()]*\))*\)|\S+) "
                          r"(?P<op>[\w\-]+)\((?P<operands>[^)]*)\)")
# The first line of a computation: `[ENTRY ]%name (params) -> shape {`.
_COMPUTATION = re.compile(r"^(?P<entry>ENTRY )?%?(?P<name>[\w.\-]+) .*\{$")
# Ops that only move data, in the order `data_moves` names a fusion of several by; with
# the layout ops, what such a fusion may hold.
MOVES = ("concatenate", "slice", "pad", "copy")
_MOVING = frozenset({*MOVES, "dynamic-slice", "transpose", "bitcast", "reshape", "broadcast",
                     "parameter", "constant", "tuple", "get-tuple-element"})


def hlo_computations(hlo: str) -> dict[str, list[str]]:
  """Computation name -> its instruction lines, in the order printed (ENTRY last)."""
  comps, name = {}, None
  for line in hlo.splitlines():
    if head := _COMPUTATION.match(line):
      name = head["name"]
      comps[name] = []
    elif name is not None and line.strip() not in ("", "}"):
      comps[name].append(line)
  return comps


def _elements(shape: str) -> int:
  """Elements of an HLO array shape `f32[8,125]{1,0}` (the first array of a tuple)."""
  dims = re.search(r"\[([\d,]*)\]", shape)[1]
  return math.prod(int(d) for d in dims.split(",") if d)


def shape_bytes(shape: str) -> int:
  """Bytes of an HLO shape: an array `bf16[8,125]{1,0}`, or the sum over a tuple's arrays.

  >>> shape_bytes("(f32[1000]{0}, bf16[8,125]{1,0})")
  6000
  """
  total = 0
  for dtype, dims in re.findall(r"\b(pred|[a-z]+\d+\w*)\[([\d,]*)\]", shape):
    bits = 8 if dtype == "pred" else int(re.match(r"[a-z]+(\d+)", dtype)[1])
    total += math.prod(int(d) for d in dims.split(",") if d) * bits // 8
  return total


class Collectives(NamedTuple):
  """The collectives of one kind in a program: instructions (one in a loop body counts
  once) and the sum of their result bytes, per device."""

  count: int
  bytes: int


def collectives(hlo: str) -> dict[str, Collectives]:
  """{kind: Collectives(count, bytes)} for each of COLLECTIVE_KINDS, async pairs once."""
  found = dict.fromkeys(COLLECTIVE_KINDS, Collectives(0, 0))
  for line in hlo.splitlines():
    m = _INSTRUCTION.match(line)
    kind = m and re.fullmatch(r"(?P<kind>[a-z\-]+?)(?:-done)?", m["op"])
    if kind and kind["kind"] in found:
      count, size = found[kind["kind"]]
      found[kind["kind"]] = Collectives(count + 1, size + shape_bytes(m["shape"]))
  return found


def data_moves(hlo: str) -> list[tuple[str, str, re.Match]]:
  """(kind, computation, instruction match) of each instruction that only moves data.

  Instructions outside fused and reducer computations (in the entry, loop bodies,
  branches): a concatenate, slice, pad or copy, or a fusion of only such ops and layout
  ops, under the first of MOVES it holds (a dynamic-slice is a "slice", a transpose
  alone a "copy").
  """
  comps = hlo_computations(hlo)
  called = {f for lines in comps.values() for line in lines
            for f in re.findall(r"(?:calls|to_apply)=%?([\w.\-]+)", line)}
  out = []
  for name, lines in comps.items():
    for m in filter(None, map(_INSTRUCTION.match, [] if name in called else lines)):
      ops = ({i["op"] for i in map(_INSTRUCTION.match, comps[_callee(m)]) if i}
             if m["op"] == "fusion" else {m["op"]})
      kind = next((k for k in MOVES if k in ops or k == "slice" and "dynamic-slice" in ops),
                  "copy" if "transpose" in ops else None)
      if kind is not None and ops <= _MOVING:
        out.append((kind, name, m))
  return out


def _callee(fusion: re.Match) -> str:
  return re.search(r"calls=%?([\w.\-]+)", fusion.string)[1]


def moved_bytes(hlo: str, kind: str) -> int:
  """Result bytes of the instructions of one kind of MOVES (`data_moves`), per device."""
  return sum(shape_bytes(m["shape"]) for k, _, m in data_moves(hlo) if k == kind)


def parameter_copies(hlo: str) -> int:
  """Copies (`data_moves` of kind "copy") in the entry computation of a whole entry
  parameter (of more than one element) into a buffer of the same shape and layout. XLA
  adds one to keep an input alive whose donated buffer an output takes; a step whose
  outputs alias its donated inputs needs none."""
  entry = next(m["name"] for line in hlo.splitlines()
               if (m := _COMPUTATION.match(line)) and m["entry"])
  params = {m["name"]: m["shape"] for m in map(_INSTRUCTION.match, hlo_computations(hlo)[entry])
            if m and m["op"] == "parameter" and _elements(m["shape"]) > 1}
  return sum(kind == "copy" and where == entry
             and any(params.get(o.strip().lstrip("%")) == m["shape"]
                     for o in m["operands"].split(","))
             for kind, where, m in data_moves(hlo))


def fused_kernels(hlo: str) -> int:
  """Distinct fused computations (compared as text without names and metadata): the
  kernels XLA:CPU compiles, which set how long the backend compiles."""
  comps = hlo_computations(hlo)
  called = {f for lines in comps.values() for line in lines if " fusion(" in line
            for f in re.findall(r"calls=%?([\w.\-]+)", line)}
  return len({"\n".join(re.sub(r"%[\w.\-]+", "%", re.sub(r", metadata=\{[^}]*\}", "", line))
                        for line in comps[f]) for f in called if f in comps})


def loop_bodies(hlo: str) -> set[str]:
  """Names of the computations that are while-loop bodies."""
  return set(re.findall(r"body=%?([\w.\-]+)", hlo))


def collective_shapes(lines, kind: str) -> list[str]:
  """Result shape of each `kind` instruction (e.g. "all-gather") among HLO lines:
  an array `f32[9]{0}` or, for collectives XLA combined, a tuple `(f32[9]{0}, f32[])`."""
  out = []
  for line in lines:
    m = re.match(r"\s*(?:ROOT )?%\S+ = (\(.*?\)|\S+) " + kind + r"(?:-start)?\(", line)
    if m:
      out.append(m.group(1))
  return out


def collective_arrays(lines, kind: str) -> list[str]:
  """The arrays `kind` instructions reduce or move, tuples taken apart: ["f32[9]", "f32[]"]."""
  return [a for shape in collective_shapes(lines, kind)
          for a in re.findall(r"\b[a-z]+\d*\[[\d,]*\]", shape)]


def replica_groups(line: str) -> list[tuple[int, ...]]:
  """The replica groups of an HLO collective: explicit, XLA's iota form
  `[a,b]<=[dims]T(perm)` (the iota over dims, transposed, read as a rows of b), or
  XLA 0.12's mesh form `mesh['data'=4,'model'=2] {'model'}` (device ids in mesh order)."""
  explicit = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", line)
  if explicit:
    return [tuple(int(d) for d in grp.split(",")) for grp in re.findall(r"\{([\d,]+)\}",
                                                                          explicit[1])]
  named = re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", line)
  if named:  # XLA 0.12: `mesh['data'=4,'model'=2] {'model'}`, the devices along 'model'.
    sizes = {a: int(n) for a, n in re.findall(r"'([^']+)'=(\d+)", named[1])}
    along = re.findall(r"'([^']+)'", named[2])
    ids = np.arange(np.prod(list(sizes.values()))).reshape(list(sizes.values()))
    order = [k for k, a in enumerate(sizes) if a not in along] + [list(sizes).index(a)
                                                                 for a in along]
    rows = ids.transpose(order).reshape(-1, int(np.prod([sizes[a] for a in along])))
    return [tuple(int(d) for d in row) for row in rows]
  iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
  dims = [int(d) for d in iota[3].split(",")]
  ids = np.arange(np.prod(dims)).reshape(dims)
  if iota[4]:
    ids = ids.transpose([int(p) for p in iota[4].split(",")])
  return [tuple(int(d) for d in row) for row in ids.reshape(int(iota[1]), int(iota[2]))]


def collective_lines(hlo: str, kind: str) -> list[str]:
  """HLO instruction lines of one collective kind (async pairs counted at -start)."""
  return [line for line in hlo.splitlines()
          if re.match(r"\s*(?:ROOT )?%\S+ = (?:\(.*?\)|\S+) " + kind + r"(?:-start)?\(", line)]
