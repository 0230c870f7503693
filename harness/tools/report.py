"""Measurements of compiled programs and live state, and text tables of them.

Everything here is read from what XLA compiled or from arrays that exist:
`Compiled.memory_analysis()` for memory, the optimized HLO text
(`Compiled.as_text()`) for collectives, array shards for state bytes. Nothing is
predicted.
"""

import math
import numbers
import re
from collections.abc import Sequence

from typing import NamedTuple

import jax

COLLECTIVE_KINDS = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all",
                    "collective-permute")

# A line of HLO text holding one instruction whose opcode is a collective:
#   [ROOT] %name = <shape> <kind>[-start|-done](operands), attributes...
# <shape> is an array shape `f32[8,125]{1,0}` or a tuple of them, possibly nested
# once: `(f32[1,125]{1,0}, /*index=5*/f32[1,125]{1,0})`.
_COLLECTIVE_RE = re.compile(
    r"\s*(?:ROOT )?%(?P<name>[\w.\-]+) = (?P<shape>\((?:[^()]|\([^()]*\))*\)|\S+) "
    r"(?P<kind>" + "|".join(COLLECTIVE_KINDS)
    + r")(?P<async>-start|-done)?\(%?(?P<operand>[\w.\-]*)")
# One array shape inside <shape>: element type and dims, e.g. `bf16[8,125]`.
_ARRAY_RE = re.compile(r"\b(?P<dtype>pred|[a-z]+\d+\w*)\[(?P<dims>[\d,]*)\]")
# The size of a collective's groups: `replica_groups={{0,1,2,3},{4,5,6,7}}` (the
# first group's members) or the iota form `replica_groups=[2,4]<=[8]` (2 groups
# of 4). `replica_groups={}` means one group of every device of the program,
# whose count the module header gives: `num_partitions=8`, `replica_count=1`.
# XLA 0.12 also names mesh axes: `replica_groups=mesh['data'=4,'model'=2] {'model'}`
# (groups of the devices along the axes in braces: 2).
_GROUP_RE = re.compile(r"replica_groups=(?:\{\{(?P<members>[\d,]*)\}|\[\d+,(?P<size>\d+)\]<="
                       r"|mesh\[(?P<mesh>[^\]]*)\] \{(?P<axes>[^}]*)\})")
_AXIS_RE = re.compile(r"'(?P<name>[^']+)'(?:=(?P<size>\d+))?")
_DEVICES_RE = re.compile(r"\b(?P<key>num_partitions|replica_count)=(?P<n>\d+)")

# Bytes each device sends for one array of a collective's result (`elements` of
# `itemsize` bytes), in groups of `g` devices, by the bandwidth-optimal ring
# algorithms. A ring splits each array into g chunks of ceil(elements / g); an
# all-reduce is a reduce-scatter then an all-gather of those chunks, 2 (g - 1)
# chunks in all. A reduce-scatter's result is one chunk; an all-gather's result
# is g chunks, one of them its own.
_WIRE = {
    "all-reduce": lambda elements, itemsize, g: 2 * (g - 1) * -(-elements // g) * itemsize,
    "reduce-scatter": lambda elements, itemsize, g: (g - 1) * elements * itemsize,
    "all-gather": lambda elements, itemsize, g: (g - 1) * elements / g * itemsize,
    "all-to-all": lambda elements, itemsize, g: (g - 1) * elements / g * itemsize,
    "collective-permute": lambda elements, itemsize, g: elements * itemsize,
}


class Collectives(NamedTuple):
  """The collectives of one kind in a program.

  count: instructions (one inside a loop body counts once).
  bytes: sum of their result sizes, per device.
  wire_bytes: bytes each device sends for them, by the ring algorithms, per
    result array of n elements in groups of g devices: all-reduce
    2 (g-1) ceil(n/g), reduce-scatter (g-1) n, all-gather and all-to-all
    (g-1) n/g elements, collective-permute n. A model of a network, computed
    from the HLO: on simulated CPU devices nothing is sent, and the
    collectives are memory copies.
  """

  count: int
  bytes: int
  wire_bytes: int


def _group_size(g: re.Match | None, everyone: int) -> int:
  """Devices in each group of a collective's `replica_groups` (`_GROUP_RE`'s match)."""
  if g is None:
    return everyone
  if g["mesh"] is not None:
    sizes = {a["name"]: int(a["size"]) for a in _AXIS_RE.finditer(g["mesh"])}
    return math.prod(sizes[a["name"]] for a in _AXIS_RE.finditer(g["axes"]))
  return int(g["size"]) if g["size"] else len(g["members"].split(","))


def _bits(dtype: str) -> int:
  """Bit width of an HLO element type: pred=8, s32=32, bf16=16, f8e4m3fn=8."""
  return 8 if dtype == "pred" else int(re.match(r"[a-z]+(\d+)", dtype).group(1))


def _arrays(shape: str) -> list[tuple[int, int]]:
  """(elements, bits per element) of each array in an HLO shape string."""
  return [(math.prod(int(d) for d in m["dims"].split(",") if d), _bits(m["dtype"]))
          for m in _ARRAY_RE.finditer(shape)]


def shape_bytes(shape: str) -> int:
  """Bytes of an HLO shape string: an array, or the sum over a tuple's arrays.

  >>> shape_bytes("(f32[1000]{0}, bf16[8,125]{1,0})")
  6000
  """
  return sum(elements * bits // 8 for elements, bits in _arrays(shape))


# The first line of a computation: `[ENTRY ]%name (params) -> shape {`.
_COMPUTATION_RE = re.compile(r"^(?P<entry>ENTRY )?%?(?P<name>[\w.\-]+) .*\{$")
# Computations an instruction calls, and how often per call of the instruction.
_WHILE_RE = re.compile(r"condition=%?(?P<cond>[\w.\-]+), body=%?(?P<body>[\w.\-]+)")
_TRIP_COUNT_RE = re.compile(r'"known_trip_count":\{"n":"(?P<n>\d+)"\}')
_CALLED_RE = re.compile(r"(?:to_apply|calls|true_computation|false_computation)=%?([\w.\-]+)"
                        r"|branch_computations=\{([^}]*)\}")


def computations(hlo_text: str) -> dict[str, list[str]]:
  """Optimized HLO text split into computations: name -> instruction lines (ENTRY last)."""
  comps, name = {}, None
  for line in hlo_text.splitlines():
    head = _COMPUTATION_RE.match(line)
    if head:
      name = head["name"]
      comps[name] = []
    elif name is not None and line.strip() and line.strip() != "}":
      comps[name].append(line)
  return comps


def fused_kernels(hlo_text: str) -> int:
  """How many distinct fused computations the fusions of optimized HLO call.

  XLA:CPU compiles one kernel per distinct fused computation, so this, more
  than the number of fusions, sets how long the backend compiles: equal
  updates of equal shapes are one kernel. Computations are compared as text
  without names and metadata.

  Args:
    hlo_text: `Compiled.as_text()`.
  """
  comps = computations(hlo_text)
  called = {f for lines in comps.values() for line in lines if " fusion(" in line
            for f in _FUSED_RE.findall(line)}
  return len({"\n".join(re.sub(r"%[\w.\-]+", "%", re.sub(r", metadata=\{[^}]*\}", "", line))
                        for line in comps[f]) for f in called if f in comps})


def _calls(comps: dict[str, list[str]]):
  """Yields (caller, callee, runs of callee per run of caller, callee is a loop's)."""
  for name, lines in comps.items():
    for line in lines:
      loop = _WHILE_RE.search(line)
      if loop:
        trips = _TRIP_COUNT_RE.search(line)
        n = int(trips["n"]) if trips else 1
        yield name, loop["body"], n, True
        yield name, loop["cond"], n + 1, True
      for one, many in _CALLED_RE.findall(line):
        for callee in [one] if one else re.findall(r"%?([\w.\-]+)", many):
          yield name, callee, 1, False


def in_loops(hlo_text: str) -> set[str]:
  """The computations that run inside a while loop (its body and what it calls)."""
  comps = computations(hlo_text)
  inside = set()
  for name in reversed(list(comps)):  # Callers are printed after their callees.
    for caller, callee, _, loop in _calls({name: comps[name]}):
      if loop or caller in inside:
        inside.add(callee)
  return inside


def executions(hlo_text: str) -> dict[str, int]:
  """How many times each computation runs per run of the program.

  The entry computation runs once; a while loop's body runs its known trip
  count times per run of the loop (once if XLA does not know it) and its
  condition once more; a conditional's branches each count as running
  whenever the conditional does (an upper bound); other called computations
  (fusions, reductions) run when their caller does.
  """
  comps = computations(hlo_text)
  runs = {name: 0 for name in comps}
  entry = next((m["name"] for line in hlo_text.splitlines()
                if (m := _COMPUTATION_RE.match(line)) and m["entry"]), None)
  if entry is None:
    return {name: 1 for name in comps}
  runs[entry] = 1
  for name in reversed(list(comps)):  # Callers are printed after their callees.
    for _, callee, n, _ in _calls({name: comps[name]}):
      runs[callee] = runs.get(callee, 0) + runs[name] * n
  return runs


def collectives(hlo_text: str, *, per_run: bool = False,
                only: set[str] | None = None) -> dict[str, Collectives]:
  """Collective instructions in optimized HLO text, per kind.

  An async pair `<kind>-start` / `<kind>-done` is one collective, counted at
  its `-done`, whose shape is the collective's result (the `-start` shape also
  holds the operands and context buffers); its groups are read from the
  `-start`.

  Args:
    hlo_text: `Compiled.as_text()`.
    per_run: count each collective as many times as it runs per run of the
      program (`executions`: a loop body's per iteration; a conditional's as
      if its branch were taken); else each instruction once.
    only: if given, count only the collectives of these computations (e.g.
      `in_loops(hlo_text)`).

  Returns:
    {kind: Collectives(count, bytes, wire_bytes)} for each kind in
    COLLECTIVE_KINDS; bytes per device.
  """
  header = {m["key"]: int(m["n"]) for m in _DEVICES_RE.finditer(hlo_text.split("\n", 1)[0])}
  everyone = header.get("num_partitions", 1) * header.get("replica_count", 1)
  runs = executions(hlo_text) if per_run else {}
  found = {kind: Collectives(0, 0, 0) for kind in COLLECTIVE_KINDS}
  start_groups = {}  # -start name -> its group size
  computation = None
  for line in hlo_text.splitlines():
    head = _COMPUTATION_RE.match(line)
    if head:
      computation = head["name"]
    m = _COLLECTIVE_RE.match(line)
    if not m or (only is not None and computation not in only):
      continue
    group = _group_size(_GROUP_RE.search(line), everyone)
    if m["async"] == "-start":
      start_groups[m["name"]] = group
      continue
    if m["async"] == "-done":
      group = start_groups.get(m["operand"], everyone)
    times = runs.get(computation, 1) if per_run else 1
    arrays = _arrays(m["shape"])
    wire = sum(_WIRE[m["kind"]](elements, bits / 8, group) for elements, bits in arrays)
    count, total, sent = found[m["kind"]]
    found[m["kind"]] = Collectives(count + times, total + times * shape_bytes(m["shape"]),
                                   sent + times * round(wire))
  return found


# An instruction line: `[ROOT ]%name = <shape> <opcode>(<operands>), ...`.
_INSTRUCTION_RE = re.compile(r"\s*(?:ROOT )?%(?P<name>[\w.\-]+) = "
                             r"(?P<shape>\((?:[^()]|\([^()]*\))*\)|\S+) "
                             r"(?P<op>[\w\-]+)\((?P<operands>[^)]*)\)")
_FUSED_RE = re.compile(r"calls=%?([\w.\-]+)")
# Opcodes that only move data, in the order a fusion of several is named by.
MOVES = ("concatenate", "slice", "pad", "copy")
_MOVING = frozenset({*MOVES, "transpose", "bitcast", "reshape", "broadcast", "parameter",
                     "constant", "tuple", "get-tuple-element", "dynamic-slice"})


class Moves(NamedTuple):
  """Data movement of one kind in a program: `count` instructions of `bytes` result bytes."""

  count: int
  bytes: int


def data_movement(hlo_text: str) -> dict[str, Moves]:
  """Instructions of optimized HLO that only move data, per kind (bytes per device).

  Each instruction outside fusions (in the entry computation, loop bodies,
  branches) that is a `concatenate`, `slice`, `pad` or `copy`, or a fusion of
  only such data movement (and layout ops), is counted once, under the first
  kind of MOVES it holds (a dynamic-slice is a "slice", a transpose alone a
  "copy"), with its result's bytes; "parameter copy" counts the copies (and copying fusions) of an
  entry parameter of more than one element into a buffer of its own shape
  and layout: a whole input copied each run, as XLA does to keep a donated
  input whose buffer an output takes (a transpose into another layout is a
  "copy" only).

  Args:
    hlo_text: `Compiled.as_text()`.

  Returns:
    {kind: Moves(count, bytes)} for each of MOVES and "parameter copy".
  """
  comps = computations(hlo_text)
  fused = {f for lines in comps.values() for line in lines if " fusion(" in line
           for f in _FUSED_RE.findall(line)}
  reducers = {c for lines in comps.values() for line in lines
              for c in re.findall(r"to_apply=%?([\w.\-]+)", line)}
  ops = {name: [m["op"] for line in lines if (m := _INSTRUCTION_RE.match(line))]
         for name, lines in comps.items()}
  entry = next(m["name"] for line in hlo_text.splitlines()
               if (m := _COMPUTATION_RE.match(line)) and m["entry"])
  params = {m["name"]: m["shape"] for line in comps[entry]
            if (m := _INSTRUCTION_RE.match(line)) and m["op"] == "parameter"
            and _arrays(m["shape"])[0][0] > 1}
  found = {kind: Moves(0, 0) for kind in (*MOVES, "parameter copy")}
  for name, lines in comps.items():
    if name in fused or name in reducers:
      continue
    for line in lines:
      m = _INSTRUCTION_RE.match(line)
      if not m:
        continue
      inner = ops.get(next(iter(_FUSED_RE.findall(line)), ""), []) if m["op"] == "fusion" else [
          m["op"]]
      kind = next((k for k in MOVES if k in inner or k == "slice" and "dynamic-slice" in inner),
                  "copy" if "transpose" in inner else None)
      if kind is None or not set(inner) <= _MOVING:
        continue
      size = shape_bytes(m["shape"])
      found[kind] = Moves(found[kind].count + 1, found[kind].bytes + size)
      operands = [o.strip().lstrip("%") for o in m["operands"].split(",")]
      if kind == "copy" and name == entry and any(params.get(o) == m["shape"] for o in operands):
        found["parameter copy"] = Moves(found["parameter copy"].count + 1,
                                        found["parameter copy"].bytes + size)
  return found


def memory(compiled: jax.stages.Compiled) -> dict[str, int]:
  """Per-device bytes of a compiled program, from `memory_analysis()`.

  Returns:
    {"argument", "output", "alias", "temp", "total"}: bytes per device of the
    inputs, the outputs, the outputs that alias (reuse) input buffers, the
    scratch space XLA allocates while the program runs, and all the program
    allocates, argument + output - alias + temp: its peak if all were live at
    once. (`peak_memory_in_bytes` is not used: the CPU backend leaves the
    temporaries out of it.)
  """
  stats = compiled.memory_analysis()
  out = {
      "argument": stats.argument_size_in_bytes,
      "output": stats.output_size_in_bytes,
      "alias": stats.alias_size_in_bytes,
      "temp": stats.temp_size_in_bytes,
  }
  out["total"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
  return out


def bytes_per_device(tree) -> int:
  """Bytes that device 0 holds of the jax.Array leaves of `tree`.

  A replicated leaf counts in full; a leaf split over the mesh counts its shard.
  """
  return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
  """A Markdown table; ints get thousands separators, floats 4 significant digits.

  >>> print(table(["kind", "bytes"], [["all-reduce", 4000]]))
  | kind       | bytes |
  |------------|-------|
  | all-reduce | 4,000 |
  """
  cells = [list(headers)] + [[_cell(v) for v in row] for row in rows]
  widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
  lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"
           for row in cells]
  lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
  return "\n".join(lines)


def _cell(value: object) -> str:
  if isinstance(value, numbers.Integral):
    return f"{value:,}"
  if isinstance(value, numbers.Real):
    return f"{value:#.4g}"
  return str(value)
