"""The paper's models and named optimizers as workloads of the alpha-beta cost model.

`wus-scale` (the paper's settings) and `wus-bench`'s predictions price steps
whose update is a named optimizer on a list of weight tensors, not a traced
step: this module turns (tensors, optimizer) into the
`wus.analysis.costmodel.Workload` the planner builds from a cluster's facts.
The memory traffic of each optimizer per weight element is the paper's
memory-bound update (Xu et al. 2020, arXiv:2004.13336, §2.2); LARS and LAMB
also all-reduce per-tensor norms when they run on shards (§4.1, Fig. 6). The
models are the paper's Table 1 (ResNet-50, the Transformer "big" as MLPerf 0.6 ran
it) as lists of weight tensors, the Transformer's also as one model rank's blocks
when it is split Megatron-style over a model axis.
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

  @property
  def state(self) -> tuple[str, ...]:
    """The optimizer state kept per weight element: what it reads but the weight and the
    gradient ("m", "v" for Adam)."""
    return tuple(dict.fromkeys(t for t in self.reads if t not in ("w", "g")))

  def bytes_per_element(self, state_bytes: int = 4, copy_bytes: int = 0) -> int:
    """Bytes read and written per weight element.

    Args:
      state_bytes: bytes per element of the weights, gradients and moments.
      copy_bytes: bytes per element of a narrow copy of the weight the update
        also writes for the next forward pass (2 for bfloat16, §4.2 Fig. 7; 0
        for none).
    """
    return (len(self.reads) + len(self.writes)) * state_bytes + copy_bytes


CITATIONS = {
    "resnet50": "torchvision, resnet50 (pytorch.org/vision/stable/models/generated/"
                "torchvision.models.resnet50.html): num_params 25,557,032 (ResNet v1.5, "
                "the MLPerf variant; 161 tensors, rebuilt here from He et al. 2016 Table 1).",
    "mlperf-transformer": "MLPerf training reference (github.com/mlcommons/training), "
                          "translation/tensorflow/transformer/model: model_params.py "
                          "TransformerBigParams (hidden 1024, filter 4096, 16 heads, 6 "
                          "layers, vocab_size 33945); attention_layer.py (q, k, v, output "
                          "without bias); ffn_layer.py (with bias); transformer.py (layer "
                          "norm scale and bias, input embedding shared with the softmax).",
    "vaswani2017": "Vaswani et al., 'Attention Is All You Need', NIPS 2017, Table 3: "
                   "Transformer (big) 213 x 10^6 parameters (with a 37,000-token vocabulary).",
    "megatron": "Shoeybi et al., 'Megatron-LM', arXiv:1909.08053 (2019), §3: the first "
                "matmul of the MLP and q, k, v split by columns, the second and the "
                "attention output by rows, the embedding (shared with the output layer) by "
                "vocabulary; layer norms and the second biases whole on every rank.",
}


def resnet50_tensors() -> tuple[int, ...]:
  """Elements of ResNet-50's 161 weight tensors (v1.5; no conv biases; BN scale and bias).

  25,557,032 in all (torchvision's num_params).
  """
  out = [7 * 7 * 3 * 64, 64, 64]
  cin = 64
  for width, blocks in zip((64, 128, 256, 512), (3, 4, 6, 3), strict=True):
    for b in range(blocks):
      out += [cin * width, width, width, 9 * width * width, width, width,
              width * 4 * width, 4 * width, 4 * width]
      if b == 0:  # projection shortcut
        out += [cin * 4 * width, 4 * width, 4 * width]
      cin = 4 * width
  return tuple(out + [2048 * 1000, 1000])


def transformer_big_tensors(vocab: int = 33945, hidden: int = 1024, filter_size: int = 4096,
                            layers: int = 6, heads: int = 16,
                            model_parallel: int = 1) -> tuple[int, ...]:
  """Elements of the MLPerf reference Transformer big's 185 weight tensors (of one model rank's).

  Shared input/output embedding; attention projections without bias; the
  feed-forward network with biases; a layer norm (scale, bias) before each
  sublayer and after each stack. 211,047,424 in all with MLPerf's 33,945-token
  vocabulary (Vaswani et al. report 213 M with 37,000 tokens). With
  `model_parallel` = M > 1, one rank's blocks of the model split Megatron-style
  (`CITATIONS["megatron"]`): q, k, v, the attention output, both feed-forward
  matrices and the first bias 1/M each; the embedding ceil(vocab / M) rows;
  layer norms and the second bias whole.

  Raises:
    ValueError: M does not divide the heads, the hidden or the filter size.
  """
  m = model_parallel
  if m < 1 or heads % m or hidden % m or filter_size % m:
    raise ValueError(f"model_parallel={m} must divide the {heads} heads, hidden {hidden} "
                     f"and filter {filter_size}")
  norm = [hidden, hidden]
  attention = [hidden * hidden // m] * 4
  ffn = [hidden * filter_size // m, filter_size // m, filter_size * hidden // m, hidden]
  encoder = (norm + attention + norm + ffn) * layers + norm
  decoder = (norm + attention + norm + attention + norm + ffn) * layers + norm
  return tuple([-(-vocab // m) * hidden] + encoder + decoder)


MODELS = {"resnet50": resnet50_tensors, "transformer": transformer_big_tensors}


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
