"""What a shard_map step's specs split of each operand besides the replica axes, as the
Plan reports it: the other axes an in_spec splits an operand over (tensor parallelism),
the replica axes it splits one over itself (FSDP), and the state whose in_spec and
out_spec split it differently (kept whole between steps).
"""

from __future__ import annotations

from collections.abc import Sequence

from jax.sharding import Mesh

from wus import runtime
from wus.analysis.causes import SplitDifferently
from wus.transforms.layout import spec_axes, split_axes


def split_over(in_specs: Sequence, axes: tuple, mesh: Mesh, home) -> dict:
  """Operand position -> the axes of size > 1 (and their sizes) its in_spec splits it
  over besides the replica axes (tensor parallelism), for the Plan."""
  out = {}
  for k, spec in enumerate(in_specs):
    names = [a for a in split_axes(spec, axes, mesh, home) if mesh.shape[a] > 1]
    if names:
      out[k] = tuple((a, mesh.shape[a]) for a in names)
  return out


def fsdp_axes(in_specs: Sequence, sources: tuple, replicated: frozenset, axes: tuple,
          mesh: Mesh) -> dict:
  """Operand position -> the replica axes of size > 1 its in_spec splits it over itself
  (FSDP), with their sizes, for the Plan; not `wus.pmap`'s equal per-device copies
  (`replicated`)."""
  out = {}
  for k, (spec, src) in enumerate(zip(in_specs, sources, strict=True)):
    fsdp = tuple((a, mesh.shape[a]) for a in axes
                 if a in spec_axes(spec) and mesh.shape[a] > 1)
    if fsdp and not (src[0] == "arg" and src[1] in replicated):
      out[k] = fsdp
  return out


def split_differently(pairs: dict, in_specs: Sequence, out_specs: Sequence,
                       out_names: Sequence[str]) -> dict:
  """State whose in_spec and out_spec split it differently (by input position, with the
  reason for the Plan): kept whole between steps, since its shards would lie one way
  when read and another when returned."""
  out = {}
  for o, i in pairs.items():
    if runtime.normal(in_specs[i]) != runtime.normal(out_specs[o]):
      out[i] = SplitDifferently(str(in_specs[i]), str(out_specs[o]), out_names[o])
  return out
