r"""TPU v3 as the cost model sees it: published figures, their sources, and the assumptions.

`wus-scale` (`scale.py`) prices the paper's runs (Xu et al. 2020, arXiv:2004.13336,
§6: 16 and 1024 TPU v3 chips, two cores per chip, one replica per core) on the
`wus.analysis.network.Topology` built here. Every figure is a published one,
cited by key in `CITATIONS`; what no source gives is an assumption, named in
`ASSUMPTIONS` and varied in `wus-scale`'s sensitivity table (`SENSITIVITY`).
Nothing here is fitted to the results the predictions are compared with.
"""

from __future__ import annotations

import dataclasses

from wus.analysis import network

CITATIONS = {
    "paper": "Xu, Lee, Chen, Choi, Hechtman, Wang, 'Automatic Cross-Replica Sharding of "
             "Weight Update in Data-Parallel Training', arXiv:2004.13336 (2020): Table 1 "
             "(models, optimizers, batch sizes, core counts), §6 (16 and 1024 TPU v3 chips "
             "in a 2D mesh, 2 cores per chip, one replica per core), §6.1 and Fig. 11 "
             "(results), §4.2 and Fig. 7 (weights kept sharded and all-gathered in bfloat16, "
             "which 'dramatically reduces the amount of memory access and communication'), "
             "§5 (multi-phase, partial sharding, batching).",
    "cloud-tpu-v3": "Google Cloud, 'TPU v3', cloud.google.com/tpu/docs/v3: two TensorCores "
                    "per chip; HBM2 32 GiB, 900 GBps per chip; TPU Pod of 1024 chips; "
                    "interconnect topology 2D torus; all-reduce bandwidth per Pod 340 TB/s; "
                    "bisection bandwidth per Pod 6.4 TB/s.",
    "cloud-tpu-v5e": "Google Cloud, 'TPU v5e', cloud.google.com/tpu/docs/v5e: 4 ICI ports "
                     "and 400 GBps bidirectional ICI bandwidth per chip (50 GB/s per port "
                     "per direction), 256 chips in a 2D torus of 16 x 16, all-reduce "
                     "bandwidth per Pod 51.2 TB/s (= 256 chips x 4 ports x 50 GB/s) and "
                     "bisection bandwidth 1.6 TB/s (= 32 links x 50 GB/s): the conventions "
                     "used to read v3's two pod figures.",
    "perf-guide": "Google Cloud, 'Cloud TPU performance guide', "
                  "cloud.google.com/tpu/docs/performance-guide (the paper's ref [7]): XLA "
                  "pads tensors into 8 x 128 tiles.",
    "thakur2005": "Thakur, Rabenseifner, Gropp, 'Optimization of Collective Communication "
                  "Operations in MPICH', IJHPCA 19(1) 2005 (the paper's ref [22]): ring "
                  "reduce-scatter, all-gather, all-reduce.",
}

CORES_PER_CHIP = 2                     # cloud-tpu-v3
HBM_PER_CHIP = 900e9                   # bytes/s, cloud-tpu-v3
PORTS_PER_CHIP = 4                     # a 2D torus: x+, x-, y+, y- (cloud-tpu-v3, -v5e)
POD_SIDE = 32                          # 1024 chips in a 2D torus: 32 x 32, cloud-tpu-v3
POD_CHIPS = POD_SIDE * POD_SIDE
ALL_REDUCE_PER_POD = 340e12            # bytes/s, cloud-tpu-v3
BISECTION_PER_POD = 6.4e12             # bytes/s, cloud-tpu-v3
# v5e's page fixes the conventions: its all-reduce bandwidth per Pod is chips x ports x
# the one-way bandwidth of a port, its bisection bandwidth the one-way bandwidth of the
# links a halving cuts. Read so, v3's all-reduce figure gives 83 GB/s per port per
# direction, its bisection figure (32 rows, each cut twice with its wraparound link)
# 100 GB/s. The all-reduce figure is the one taken: it is the pod's rate for the very
# collective priced here (the lower of the two); the bisection reading is a variant.
LINK_BANDWIDTH = ALL_REDUCE_PER_POD / (POD_CHIPS * PORTS_PER_CHIP)  # per port per direction
BISECTION_LINK_BANDWIDTH = BISECTION_PER_POD / (2 * POD_SIDE)
TILE_ELEMENTS = 8 * 128                # perf-guide
ALPHA = 1e-6                           # seconds per ring step: ASSUMED, see ASSUMPTIONS

ASSUMPTIONS = [
    "alpha, the latency of one ring step, is 1 us on every axis: no published TPU v3 "
    "figure was found (secondary sources say sub-microsecond between neighbouring chips); "
    "the sensitivity table varies it 10x each way.",
    "The two TensorCores of a chip exchange data at one core's HBM bandwidth (450 GB/s): "
    "the on-chip path is not published. Varied in the sensitivity table (at one ICI link "
    "instead).",
    "Rings along a torus axis use both directions of both links of a chip (two "
    "counter-rotating rings), shared by its 2 cores: 2 x 83 / 2 = 83 GB/s per core. The "
    "16-chip slice is a 4 x 4 mesh without wraparound (the paper, §6: '2D mesh'): a ring "
    "uses each link one way, 83 / 2 GB/s per core. A ring along one axis leaves the other "
    "axis's links idle (no concurrent 2-D algorithm is modelled).",
    "Gradients are reduced in float32; the weights and optimizer state are float32. The "
    "forward and backward passes read the weights in bfloat16 (§4.2, Fig. 7). Replicated "
    "(Fig. 7 left), each replica converts every whole weight in a pass of its own, 4 bytes "
    "read and 2 written per weight: XLA's choice to fuse that convert into the matmuls "
    "instead is not published (fused, the two matmuls read 4 bytes each where they read 2: "
    "4 bytes more per weight rather than 6; a sensitivity row). Sharded (Fig. 7 right), the "
    "update writes its shard in bfloat16 beside the float32 one and the all-gather sends "
    "the bfloat16 shards.",
    "Nothing overlaps: step = rest + collectives + update + bfloat16 copy.",
    "The rest of the step scales linearly with the examples per core. This ignores that "
    "few examples per core run less efficiently (it underestimates the rest when scaling "
    "down, as for ResNet-50 at 16 per core, and overestimates it when scaling up, as for "
    "the Transformer at 16 per core).",
    "ResNet-50's rest comes from another implementation (Flax, SGD momentum, bfloat16) than "
    "MLPerf's, and its wall time includes evaluation and compilation: an upper bound on its "
    "rest per example. The README's TPU v3-32 row is not used: its pod command sets a batch "
    "of 32 x 256 = 8192, while its 125,100 steps imply 1024 (100 epochs).",
]

# Variants of the assumptions: (name, changes to the settings); "group_size": None
# stands for G = N of each case.
SENSITIVITY = (
    ("as above", {}),
    ("alpha / 10", {"alpha": lambda s: s.alpha / 10}),
    ("alpha x 10", {"alpha": lambda s: s.alpha * 10}),
    ("core-to-core at one ICI link", {"core_bandwidth": lambda s: s.link_bandwidth}),
    ("ICI port from the bisection figure (100 GB/s)",
     {"link_bandwidth": lambda s: BISECTION_LINK_BANDWIDTH}),
    ("bfloat16 convert fused into the matmuls (+4 B read)", {"cast": lambda s: (2, 2)}),
    ("no bfloat16 copy priced (the model before Fig. 7's)", {"cast": lambda s: (0, 0)}),
    ("all-gather in float32 (no Fig. 7)", {"gather_bytes": lambda s: 4}),
    ("no tile padding", {"tile_elements": lambda s: 1}),
    ("full sharding, G = N", {"group_size": None}),
)


@dataclasses.dataclass(frozen=True)
class Settings:
  """The model's inputs that are assumptions or choices; the defaults are the main prediction.

  Attributes:
    alpha: seconds per ring step, every axis.
    core_bandwidth: bytes/s per core between the two cores of a chip.
    link_bandwidth: bytes/s per ICI port per direction.
    gather_bytes: bytes per element of the all-gathered weights.
    cast: (bytes read, bytes written) per weight element to give the forward pass
      its bfloat16 weights when the update is replicated (Fig. 7 left).
    tile_elements: elements per tile of the memory layout (1: no padding).
    group_size: G; 0: `sizing.choose_group_size` picks it.
  """

  alpha: float = ALPHA
  core_bandwidth: float = HBM_PER_CHIP / CORES_PER_CHIP
  link_bandwidth: float = LINK_BANDWIDTH
  gather_bytes: int = 2
  cast: tuple[int, int] = (4, 2)
  tile_elements: int = TILE_ELEMENTS
  group_size: int = 0


def topology(chips_x: int, chips_y: int, *, torus: bool,
             settings: Settings = Settings()) -> network.Topology:
  """TPU v3 cores as a cost-model topology: axes core (2), x, y; fast to slow.

  Args:
    chips_x, chips_y: the 2D array of chips.
    torus: whether the axes wrap around (the full pod) or not (a mesh slice).
    settings: alpha, the core-to-core and link bandwidths, the tile.
  """
  per_chip = settings.link_bandwidth * (2 if torus else 1)  # a ring step's send rate per chip
  per_core = per_chip / CORES_PER_CHIP
  return network.Topology(
      (network.Axis("core", CORES_PER_CHIP, settings.alpha, settings.core_bandwidth),
       network.Axis("x", chips_x, settings.alpha, per_core),
       network.Axis("y", chips_y, settings.alpha, per_core)),
      memory_bandwidth=HBM_PER_CHIP / CORES_PER_CHIP, tile_elements=settings.tile_elements)


def hardware(settings: Settings = Settings()) -> dict:
  """The TPU v3 figures used, with their sources."""
  return {
      "cores_per_chip": {"value": CORES_PER_CHIP, "source": "cloud-tpu-v3"},
      "hbm_bytes_per_second_per_core": {
          "value": HBM_PER_CHIP / CORES_PER_CHIP,
          "source": "cloud-tpu-v3: 900 GBps per chip / 2 cores"},
      "ici_port_bytes_per_second_per_direction": {
          "value": settings.link_bandwidth,
          "source": "cloud-tpu-v3: all-reduce bandwidth 340 TB/s / (1024 chips x 4 ports); "
                    "convention from cloud-tpu-v5e (its bisection figure, read the same "
                    f"way, gives {BISECTION_LINK_BANDWIDTH / 1e9:g} GB/s)"},
      "topology": {"value": "2D torus of 32 x 32 chips (1024 chips); 16 chips: 4 x 4 mesh",
                   "source": "cloud-tpu-v3; paper §6"},
      "tile_elements": {"value": TILE_ELEMENTS, "source": "perf-guide: 8 x 128 tiles"},
      "bfloat16_copy_bytes_per_weight": {
          "value": f"{settings.cast[0]} read + {settings.cast[1]} written, replicated",
          "source": "paper §4.2, Fig. 7 (float32 weights read in bfloat16)"},
      "core_to_core_bytes_per_second": {"value": settings.core_bandwidth,
                                        "source": "ASSUMED (see assumptions)"},
      "alpha_seconds": {"value": settings.alpha, "source": "ASSUMED (see assumptions)"},
  }
