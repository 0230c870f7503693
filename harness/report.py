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

import jax

COLLECTIVE_KINDS = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all",
                    "collective-permute")

# A line of HLO text holding one instruction whose opcode is a collective:
#   [ROOT] %name = <shape> <kind>[-start|-done](operands), attributes...
# <shape> is an array shape `f32[8,125]{1,0}` or a tuple of them, possibly nested
# once: `(f32[1,125]{1,0}, /*index=5*/f32[1,125]{1,0})`.
_COLLECTIVE_RE = re.compile(
    r"\s*(?:ROOT )?%[\w.\-]+ = (?P<shape>\((?:[^()]|\([^()]*\))*\)|\S+) "
    r"(?P<kind>" + "|".join(COLLECTIVE_KINDS) + r")(?P<async>-start|-done)?\(")
# One array shape inside <shape>: element type and dims, e.g. `bf16[8,125]`.
_ARRAY_RE = re.compile(r"\b(?P<dtype>pred|[a-z]+\d+\w*)\[(?P<dims>[\d,]*)\]")


def _bits(dtype: str) -> int:
  """Bit width of an HLO element type: pred=8, s32=32, bf16=16, f8e4m3fn=8."""
  return 8 if dtype == "pred" else int(re.match(r"[a-z]+(\d+)", dtype).group(1))


def shape_bytes(shape: str) -> int:
  """Bytes of an HLO shape string: an array, or the sum over a tuple's arrays.

  >>> shape_bytes("(f32[1000]{0}, bf16[8,125]{1,0})")
  6000
  """
  total = 0
  for m in _ARRAY_RE.finditer(shape):
    dims = [int(d) for d in m["dims"].split(",") if d]
    total += math.prod(dims) * _bits(m["dtype"]) // 8
  return total


def collectives(hlo_text: str) -> dict[str, tuple[int, int]]:
  """Collective instructions in optimized HLO text, per kind.

  Counts every instruction in every computation of the module once (a
  collective inside a loop body counts once, not once per iteration). An async
  pair `<kind>-start` / `<kind>-done` is one collective, counted at its `-done`,
  whose shape is the collective's result (the `-start` shape also holds the
  operands and context buffers).

  Args:
    hlo_text: `Compiled.as_text()`.

  Returns:
    {kind: (count, bytes)} for each kind in COLLECTIVE_KINDS, where bytes is the
    sum of the result shapes' sizes, per device.
  """
  found = {kind: (0, 0) for kind in COLLECTIVE_KINDS}
  for line in hlo_text.splitlines():
    m = _COLLECTIVE_RE.match(line)
    if not m or m["async"] == "-start":
      continue
    count, size = found[m["kind"]]
    found[m["kind"]] = (count + 1, size + shape_bytes(m["shape"]))
  return found


def memory(compiled: jax.stages.Compiled) -> dict[str, int]:
  """Per-device bytes of a compiled program, from `memory_analysis()`.

  Returns:
    {"argument", "output", "alias", "temp"}: bytes per device of the inputs,
    the outputs, the outputs that alias (reuse) input buffers, and the scratch
    space XLA allocates while the program runs.
  """
  stats = compiled.memory_analysis()
  return {
      "argument": stats.argument_size_in_bytes,
      "output": stats.output_size_in_bytes,
      "alias": stats.alias_size_in_bytes,
      "temp": stats.temp_size_in_bytes,
  }


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
