"""MaxText's own train loop on 8 CPU devices, unmodified and with its one `jax.jit` swapped
for `wus.jit`, side by side (and on data-only meshes, MaxText's own
`shard_optimizer_over_data=true`).

The one line a user changes, in maxtext/utils/train_utils.py `jit_train_step`:

    p_train_step = jax.jit(functional_train, in_shardings=..., out_shardings=...,
                           static_argnums=..., donate_argnums=...)
becomes
    p_train_step = wus.jit(functional_train, in_shardings=..., out_shardings=...,
                           static_argnums=..., donate_argnums=...)

(with `import wus` at the top). This runner changes no MaxText file: in the "wus" run,
`train_utils.jax` is a stand-in for the jax module whose `jit` is `wus.jit` when called
from `jit_train_step` and `jax.jit` everywhere else; every other name is jax's. The
"jax" run has the same stand-in around `jax.jit` itself, so both runs are measured the
same way (the step's output state is kept after each call, to measure it at the end).

Each run is MaxText's `train.main` with a tiny model (`hardware=cpu
dataset_type=synthetic`, 2 layers, embed 32, vocabulary 256, float32), in a fresh
process. Printed: the loss of every step of each run, the largest relative difference
from the unmodified run, the final parameters' largest difference, the optimizer state's
bytes per device (measured from the arrays' shards) beside a whole copy's, MaxText's own
step times, and wus's Plan (or why the step runs unchanged).

Usage (Python >= 3.12, MaxText 0.2.5 and wus installed; docs/trainers/maxtext.md):

    python tests/trainers/run_maxtext.py --mesh data8 [--shard-mode explicit] [--steps 6]
        [--size small]  # a model whose update matters on these CPUs, for step times
        [--hlo-dir DIR]  # each run's optimized HLO, as DIR/VARIANT.hlo
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402 -- beside this script

# Mesh name -> MaxText's ici_*_parallelism (the rest 1).
MESHES = {"data8": {"data": 8}, "d2f2t2": {"data": 2, "fsdp": 2, "tensor": 2},
          "f4t2": {"fsdp": 4, "tensor": 2}}
# A model small enough for 8 CPU devices on 2 cores, large enough that every weight has
# more elements than devices.
TINY = ["hardware=cpu", "dataset_type=synthetic", "enable_checkpointing=False",
        "skip_jax_distributed_system=True", "base_emb_dim=32", "base_num_query_heads=4",
        "base_num_kv_heads=4", "base_mlp_dim=64", "base_num_decoder_layers=2", "head_dim=8",
        "vocab_size=256", "max_target_length=16", "per_device_batch_size=1", "dtype=float32",
        "enable_dropout=False", "attention=dot_product", "enable_tensorboard=False"]


# A model whose weight update is a real part of the step on these CPUs (4.6M weights), for
# step times: `--size small`.
SMALL = ["base_emb_dim=256", "base_num_query_heads=8", "base_num_kv_heads=8",
         "base_mlp_dim=1024", "base_num_decoder_layers=4", "head_dim=32", "vocab_size=2048"]


def add_arguments(parser) -> None:
  parser.add_argument("--mesh", choices=sorted(MESHES), default="data8")
  parser.add_argument("--size", choices=["tiny", "small"], default="tiny")
  parser.add_argument("--shard-mode", choices=["auto", "explicit"], default="auto")
  parser.add_argument("--hlo-dir", help="write each run's optimized HLO here, as VARIANT.hlo")


def variants(args) -> list[str]:
  """jax and wus; on a data-only mesh also MaxText's own ZeRO-1 (its flag refuses FSDP)."""
  return ["jax", "wus", *(["zero1"] if set(MESHES[args.mesh]) == {"data"} else [])]


class Recorded:
  """A jitted step that keeps its last output state (to measure it after the loop) and,
  for `wus.jit`, the Plan of its first call; anything else is the step's own."""

  def __init__(self, step):
    self.step, self.state, self.plan, self.lowered = step, None, None, None

  def lower(self, *args, **kwargs):  # MaxText lowers and compiles the step itself.
    self.lowered = self.step.lower(*args, **kwargs)
    return self.lowered

  def __call__(self, *args, **kwargs):
    if self.plan is None and hasattr(self.step, "plan"):
      self.plan = self.step.plan(*args, **kwargs)
    out = self.step(*args, **kwargs)
    self.state = out[0]
    return out

  def __getattr__(self, name):
    return getattr(self.step, name)


def child(args) -> dict:
  """One MaxText run; its record (`common.report` reads it)."""
  common.cpu_devices()
  import jax  # noqa: PLC0415 -- after the device flags
  import maxtext  # noqa: PLC0415
  from maxtext.trainers.pre_train import train  # noqa: PLC0415
  from maxtext.utils import train_utils  # noqa: PLC0415
  # The one line: `jax.jit` in `jit_train_step`, and nowhere else.
  code = train_utils.jit_train_step.__code__
  made = common.swap_jit(train_utils, common.variant_jit(args.variant),
                         lambda caller: caller is code, Recorded)
  metrics = os.path.abspath(f"{args.variant}-metrics.txt")
  mesh = [f"ici_{a}_parallelism={MESHES[args.mesh].get(a, 1)}"
          for a in ("data", "fsdp", "tensor")]
  config = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
  size = SMALL if args.size == "small" else []
  train.main([None, config, *TINY, *size, *mesh, f"steps={args.steps}",
              f"shard_mode={args.shard_mode}", f"run_name={args.variant}",
              f"base_output_directory={os.path.abspath('out')}", f"metrics_file={metrics}",
              f"shard_optimizer_over_data={args.variant == 'zero1'}"])
  with open(metrics, encoding="utf8") as f:
    lines = [json.loads(line) for line in f if line.strip()]
  step = made[0]
  flat = jax.tree_util.tree_flatten_with_path(
      step.state, is_leaf=lambda x: type(x).__name__ == "ShardedArray")[0]
  opt = [x for p, x in flat if "opt_state" in jax.tree_util.keystr(p)]
  params = {jax.tree_util.keystr(p): common.whole(x) for p, x in flat
            if jax.tree_util.keystr(p).startswith("['model']")
            and jax.numpy.issubdtype(x.dtype, jax.numpy.floating)}
  return {"losses": [line["learning/loss"] for line in lines],
          "step_times": [line["perf/step_time_seconds"] for line in lines],
          "opt_bytes_per_device": common.bytes_per_device(opt),
          "opt_bytes_whole": common.whole_bytes(opt),
          "params": common.save_params(args.variant, params),
          "plan": common.plan_summary(step.plan),
          "compiled": common.compiled_summary(step.lowered, args.hlo_dir and os.path.join(
              os.environ.get("WUS_TRAINER_CWD", ""), args.hlo_dir, f"{args.variant}.hlo"))}


if __name__ == "__main__":
  sys.exit(common.main(os.path.abspath(__file__), variants, child, add_arguments))
