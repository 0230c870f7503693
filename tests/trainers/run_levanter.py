"""Levanter's own train loop (`levanter.main.train_lm`) on 8 CPU devices, unmodified and
with its train step's `named_jit` swapped for `wus.named_jit`, side by side.

Levanter jits its step, `Trainer._train_step`, with haliax's `named_jit`, imported at the
top of levanter/trainer.py. The one line a user changes there:

    from haliax.partitioning import ResourceMapping, named_jit
becomes
    from haliax.partitioning import ResourceMapping
    from wus import named_jit

(`wus.named_jit` takes `named_jit`'s arguments; both of the trainer's steps, with and
without its jit hooks, then run under `wus.jit`). This runner changes no Levanter or
haliax file: in the "wus" run, `levanter.trainer.named_jit` is `wus.named_jit`; in the
"jax" run it stays haliax's. Both are wrapped alike to measure them.

Each run is `train_lm.main` with Levanter's own tiny test Llama (2 layers, hidden 32,
`levanter.testing.model_configs.llama_test_config`) on a cache of random tokens (vocabulary
256, `levanter.testing.tiny_corpus.construct_small_data_cache`), Adam, batch 16 of 64
tokens, in a fresh process. Printed: each step's loss, the largest relative difference from
the unmodified run, the final parameters' largest difference, the optimizer state's bytes
per device (from the arrays' shards) beside a whole copy's, step times (each call of the
step to its outputs ready), and wus's Plan of the step (or why it runs unchanged).

Usage (Python >= 3.12, marin-levanter and wus installed; docs/trainers/levanter.md):

    python tests/trainers/run_levanter.py --mesh r8 [--steps 6]
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402 -- beside this script

# Mesh name -> Levanter's MeshConfig axes (ICI sizes).
MESHES = {"r8": {"replica": 8, "data": 1, "model": 1},
          "d2r2m2": {"data": 2, "replica": 2, "model": 2}}


def add_arguments(parser) -> None:
  parser.add_argument("--mesh", choices=sorted(MESHES), default="r8")


def variants(args) -> list[str]:
  del args
  return ["jax", "wus"]


class Recorded:
  """A jitted train step that logs each call's loss, time (to its outputs ready) and new
  state in `log` (which the trainer's two steps, with and without its jit hooks, share),
  and keeps `wus.named_jit`'s Plan of its first call."""

  def __init__(self, step, log: dict):
    self.step, self.log, self.plan, self.matched = step, log, None, None

  def __call__(self, *args, **kwargs):
    if self.plan is None and hasattr(self.step, "plan"):
      self.plan = self.step.plan(*args, **kwargs)
    import jax  # noqa: PLC0415
    start = time.perf_counter()
    result = jax.block_until_ready(self.step(*args, **kwargs))
    if self.matched is None:  # Both runs: what wus.matching pairs (state, next value).
      self.matched = _matched(args, result)
    self.log["times"].append(time.perf_counter() - start)
    self.log["losses"].append(result.loss)
    self.log["state"] = result.new_state
    return result

  def __getattr__(self, name):
    return getattr(self.step, name)


def _matched(args: tuple, out) -> str:
  """How many of the step's input array leaves `wus.matching.match_state` pairs with an
  output leaf (their next value)."""
  import jax  # noqa: PLC0415
  from wus.filter_jit import filtered  # noqa: PLC0415
  from wus.matching import Signature, match_state  # noqa: PLC0415
  (arrays, _), _ = filtered(args, {})
  (out_arrays, _), _ = filtered((out,), {})
  match = match_state(arrays, out_arrays[0], Signature(("state", "batch", "batch_kwargs")))
  flat = jax.tree_util.tree_flatten_with_path(
      arrays, is_leaf=lambda x: type(x).__name__ == "ShardedArray")[0]
  unpaired = [jax.tree_util.keystr(p) for k, (p, _) in enumerate(flat)
              if k not in set(match.pairs.values())]
  return (f"{len(match.pairs)} of {len(flat)} input leaves paired with their next value; "
          f"unpaired: {', '.join(unpaired) or 'none'}")


def config(args, tmp: str):
  """`train_lm`'s configuration: Levanter's tiny test Llama on random tokens."""
  import levanter.main.train_lm as train_lm  # noqa: PLC0415
  from levanter.checkpoint import CheckpointerConfig  # noqa: PLC0415
  from levanter.data.text.formats import PrebuiltLmDatasetFormat  # noqa: PLC0415
  from levanter.optim.config import AdamConfig  # noqa: PLC0415
  from levanter.testing.model_configs import llama_test_config  # noqa: PLC0415
  from levanter.testing.tiny_corpus import construct_small_data_cache  # noqa: PLC0415
  from levanter.tracker.tracker import NoopConfig  # noqa: PLC0415
  from levanter.trainer import TrainerConfig  # noqa: PLC0415
  from levanter.utils.mesh import MeshConfig  # noqa: PLC0415
  data, _ = construct_small_data_cache(tmp, num_shards=1, chunk_size=64, doc_len=64,
                                       vocab_size=256, tokenizer="passthrough")
  # Token ids as they are (the cache holds ids; "passthrough" has no text to tokenize).
  data = dataclasses.replace(data, components={
      k: dataclasses.replace(c, format=PrebuiltLmDatasetFormat())
      for k, c in data.components.items()})
  # The tokenizer given, so that the model's HF converter loads none from the hub.
  model = dataclasses.replace(llama_test_config(seq_len=64), tokenizer=data.the_tokenizer)
  trainer = TrainerConfig(
      num_train_steps=args.steps, train_batch_size=16, tracker=NoopConfig(),
      mesh=MeshConfig(axes=MESHES[args.mesh]), require_accelerator=False,
      log_jaxprs=False, log_xla_hlo=False, max_eval_batches=1,
      checkpointer=CheckpointerConfig(base_path=os.path.join(tmp, "checkpoints"),
                                      save_interval=datetime.timedelta(days=1)))
  return train_lm.TrainLmConfig(data=data, model=model, trainer=trainer,
                                optimizer=AdamConfig(learning_rate=1e-3))


def child(args) -> dict:
  """One Levanter run; its record (`common.report` reads it)."""
  common.cpu_devices()
  import jax  # noqa: PLC0415 -- after the device flags
  import levanter.main.train_lm as train_lm  # noqa: PLC0415
  import levanter.trainer as trainer  # noqa: PLC0415
  # The one line: levanter/trainer.py's `named_jit`, wus's in the "wus" run.
  if args.variant == "wus":
    import wus  # noqa: PLC0415
    named_jit = wus.named_jit
  else:
    named_jit = trainer.named_jit
  made, log = [], {"losses": [], "times": [], "state": None}

  def recorded(*a, **k):
    made.append(Recorded(named_jit(*a, **k), log))
    return made[-1]
  trainer.named_jit = recorded
  with tempfile.TemporaryDirectory(prefix="levanter-") as tmp:
    train_lm.main(config(args, tmp))
  step = next(m for m in made if m.matched is not None)
  is_leaf = lambda x: type(x).__name__ == "ShardedArray"  # noqa: E731
  opt = jax.tree.leaves(log["state"].opt_state, is_leaf=is_leaf)
  flat = jax.tree_util.tree_flatten_with_path(log["state"].model, is_leaf=is_leaf)[0]
  params = {jax.tree_util.keystr(p): common.whole(x) for p, x in flat}
  return {"losses": [float(x) for x in log["losses"]], "step_times": log["times"],
          "opt_bytes_per_device": common.bytes_per_device(opt),
          "opt_bytes_whole": common.whole_bytes(opt),
          "params": common.save_params(args.variant, params),
          "plan": common.plan_summary(step.plan), "state_matched": step.matched}


if __name__ == "__main__":
  sys.exit(common.main(os.path.abspath(__file__), variants, child, add_arguments))
