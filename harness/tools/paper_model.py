"""The paper's named optimizers as workloads of the alpha-beta cost model.

`wus-scale` (the paper's settings) and `wus-bench`'s predictions price steps
whose update is a named optimizer on a list of weight tensors, not a traced
step: this module turns (tensors, optimizer) into the
`wus.analysis.costmodel.Workload` the planner builds from a cluster's facts.
The memory traffic of each optimizer per weight element is the paper's
memory-bound update (Xu et al. 2020, arXiv:2004.13336, §2.2); LARS and LAMB
also all-reduce per-tensor norms when they run on shards (§4.1, Fig. 6).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from wus.analysis import costmodel


@dataclasses.dataclass(frozen=True)
class Optimizer:
  """The memory traffic of an optimizer's update, per weight element.

  Attributes:
    name: as printed.
    reads: the tensors read per weight element, one pass each ("w" weight,
      "g" gradient, "m", "v" moments); a tensor read twice appears twice (the
      norms of LARS and LAMB read before the update can use them).
    writes: the tensors written.
    norms: per-tensor norms the update needs (LARS: |w|, |g|; LAMB: |w|,
      |u|). On shards each is a partial sum, all-reduced within the group,
      batched (§4.1, Fig. 6).
  """

  name: str
  reads: tuple[str, ...]
  writes: tuple[str, ...]
  norms: int = 0

  def bytes_per_element(self, state_bytes: int = 4, copy_bytes: int = 0) -> int:
    """Bytes read and written per weight element.

    Args:
      state_bytes: bytes per element of the weights, gradients and moments.
      copy_bytes: bytes per element of a narrow copy of the weight the update
        also writes for the next forward pass (2 for bfloat16, §4.2 Fig. 7; 0
        for none).
    """
    return (len(self.reads) + len(self.writes)) * state_bytes + copy_bytes


OPTIMIZERS = {
    # w -= lr g
    "sgd": Optimizer("sgd", reads=("w", "g"), writes=("w",)),
    # m = mu m + g; w -= lr m
    "momentum": Optimizer("momentum", reads=("w", "g", "m"), writes=("w", "m")),
    # m, v moving averages of g and g^2; w -= lr m^ / (sqrt(v^) + eps)
    "adam": Optimizer("adam", reads=("w", "g", "m", "v"), writes=("w", "m", "v")),
    # You et al. 2017: momentum with a per-tensor trust ratio |w| / |g|; the two
    # norms are a first pass over w and g.
    "lars": Optimizer("lars", reads=("w", "g", "w", "g", "m"), writes=("w", "m"), norms=2),
    # You et al. 2019: Adam's direction u, then a trust ratio |w| / |u|; the
    # second pass recomputes u from m, v and w for its norm.
    "lamb": Optimizer("lamb", reads=("w", "g", "m", "v", "w", "m", "v"),
                      writes=("w", "m", "v"), norms=2),
}


def workload(tensors: Sequence[int], optimizer: Optimizer | str, *, grad_bytes: int = 4,
             gather_bytes: int = 4, state_bytes: int = 4, copy_bytes: int = 0,
             forward_bytes: int | None = None) -> costmodel.Workload:
  """The cost model's workload of `optimizer` updating weight tensors of `tensors` elements.

  Args:
    tensors: elements of each weight tensor, in the order the collectives
      see them.
    optimizer: an `Optimizer`, or a key of `OPTIMIZERS`.
    grad_bytes: bytes per element of the reduced gradients.
    gather_bytes: bytes per element of the weights all-gathered after a
      sharded update (2: bfloat16, when the forward pass reads the weights in
      bfloat16 and they stay sharded across steps, §4.2 Fig. 7).
    state_bytes, copy_bytes: as for `Optimizer.bytes_per_element`.
    forward_bytes: bytes per element of the weights as the forward pass reads
      them, if fewer than `state_bytes` (2: bfloat16, §4.2 Fig. 7): each
      weight is converted, `Workload.cast` (state_bytes read, forward_bytes
      written). None: read as stored.

  Raises:
    KeyError: an optimizer name not in `OPTIMIZERS`.
  """
  opt = OPTIMIZERS[optimizer] if isinstance(optimizer, str) else optimizer
  per_element = opt.bytes_per_element(state_bytes, copy_bytes)
  return costmodel.Workload(gradients=tuple((n, grad_bytes) for n in tensors),
                            gathered=tuple((n, gather_bytes) for n in tensors),
                            updated=tuple((n, per_element) for n in tensors),
                            norms=opt.norms,
                            cast=() if forward_bytes is None else tuple(
                                (n, state_bytes, forward_bytes) for n in tensors))
