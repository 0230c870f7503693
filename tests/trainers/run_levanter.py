"""Levanter's own train loop (`levanter.main.train_lm`) on 8 CPU devices, unmodified and
with haliax's one `jax.jit` swapped for `wus.jit`, side by side.

Levanter jits its step with `haliax.named_jit`, which jits every function, Levanter's
`Trainer._train_step` among them, in one place, haliax/partitioning.py
`_named_pjit_cache`:

    return jax.jit(
        fun_wrapped,
        donate_argnums=0,
        static_argnums=2,
        **jitkwargs,
    )
becomes
    return wus.jit(
        ...

(with `import wus` at the top). `wus.jit` then sees the step through named_jit's wrapper,
`fun_wrapped(dynamic_donated, dynamic_reserved, static)` returning `(out_dynamic,
Static)`, and pairs the trainer state inside the first with the new state inside the
returned one by their structure (`wus.matching`, rule 4). Every other `named_jit` function
(the model's initialisation, evaluation) runs under `wus.jit` too, unchanged where it has
no state to shard. This runner changes no Levanter or haliax file: in the "wus" run,
`haliax.partitioning.jax` is a stand-in for the jax module whose `jit` is `wus.jit` when
called from `_named_pjit_cache` and `jax.jit` everywhere else. The "jax" run has the same
stand-in around `jax.jit`, so both runs are measured the same way.

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
  """A jitted named_jit function that keeps, for the train step, each call's loss, time (to
  its outputs ready) and last new state, and `wus.jit`'s Plan of its first call."""

  def __init__(self, step):
    self.step, self.losses, self.times, self.state, self.plan = step, [], [], None, None
    self.matched = None

  def __call__(self, *args, **kwargs):
    if self.plan is None and hasattr(self.step, "plan"):
      self.plan = self.step.plan(*args, **kwargs)
    import jax  # noqa: PLC0415
    start = time.perf_counter()
    out = jax.block_until_ready(self.step(*args, **kwargs))
    result = out[0]
    if hasattr(result, "new_state"):  # Trainer._train_step's TrainStepResult.
      if not self.times:  # Both runs: what wus.matching pairs through the wrapper.
        self.matched = _matched(args, out)
      self.times.append(time.perf_counter() - start)
      self.losses.append(result.loss)
      self.state = result.new_state
    return out

  def __getattr__(self, name):
    return getattr(self.step, name)


def _matched(args: tuple, out) -> str:
  """How many of the step's input leaves `wus.matching.match_state` pairs with an output
  leaf (their next value) through named_jit's wrapper."""
  import jax  # noqa: PLC0415
  from wus.matching import Signature, match_state  # noqa: PLC0415
  dynamic = args[:2]  # (dynamic_donated, dynamic_reserved); args[2] is static.
  match = match_state(dynamic, out, Signature(("dynamic_donated", "dynamic_reserved")))
  flat = jax.tree_util.tree_flatten_with_path(
      dynamic, is_leaf=lambda x: type(x).__name__ == "ShardedArray")[0]
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
  import haliax.partitioning as partitioning  # noqa: PLC0415 -- after the device flags
  import jax  # noqa: PLC0415
  import levanter.main.train_lm as train_lm  # noqa: PLC0415
  # The one line: `jax.jit` in haliax's `_named_pjit_cache`, and nowhere else.
  made = common.swap_jit(partitioning, common.variant_jit(args.variant),
                         lambda caller: (caller.co_name, caller.co_filename)
                         == ("_named_pjit_cache", partitioning.__file__), Recorded)
  with tempfile.TemporaryDirectory(prefix="levanter-") as tmp:
    train_lm.main(config(args, tmp))
  step = next(m for m in made if m.state is not None)
  is_leaf = lambda x: type(x).__name__ == "ShardedArray"  # noqa: E731
  opt = jax.tree.leaves(step.state.opt_state, is_leaf=is_leaf)
  flat = jax.tree_util.tree_flatten_with_path(step.state.model, is_leaf=is_leaf)[0]
  params = {jax.tree_util.keystr(p): common.whole(x) for p, x in flat}
  return {"losses": [float(x) for x in step.losses], "step_times": step.times,
          "opt_bytes_per_device": common.bytes_per_device(opt),
          "opt_bytes_whole": common.whole_bytes(opt),
          "params": common.save_params(args.variant, params),
          "plan": common.plan_summary(step.plan), "state_matched": step.matched}


if __name__ == "__main__":
  sys.exit(common.main(os.path.abspath(__file__), variants, child, add_arguments))
