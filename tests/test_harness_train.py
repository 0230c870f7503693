"""Smoke test of the wus-train loop, replicated mode, at a tiny size."""

import math

import jax
import optax

from wus.harness import data, models, report, train

NUM_DEVICES = 8


def test_run_mode_replicated_trains_and_measures():
  mesh = jax.make_mesh((NUM_DEVICES,), ("data",))
  config = models.TransformerConfig(num_layers=1, emb_dim=16, num_heads=2, mlp_dim=32,
                                    max_len=8)
  train_tokens, eval_tokens = data.split(data.load_tokens()[:10_000])

  def batch(tokens, step):
    return data.on_mesh(data.windows(tokens, seed=0, step=step, batch_size=NUM_DEVICES,
                                     seq_len=8), mesh)

  result = train.run_mode("replicated", mesh, models.TransformerLM(config), optax.adam(1e-2),
                          lambda step: batch(train_tokens, step), batch(eval_tokens, 0),
                          num_steps=3, seed=0)

  assert len(result["losses"]) == len(result["step_seconds"]) == 3
  assert all(math.isfinite(x) for x in [*result["losses"], result["eval_loss"]])
  params = models.init(models.TransformerLM(config), seed=0)
  param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
  assert result["opt_state_bytes"] == 2 * param_bytes + 4  # Adam's mu, nu and int32 count
  # One all-reduce: the gradients (and the loss, combined into it by XLA).
  assert result["collectives"]["all-reduce"] == {"count": 1, "bytes": param_bytes + 4}
  assert all(result["collectives"][kind]["count"] == 0
             for kind in report.COLLECTIVE_KINDS if kind != "all-reduce")
  assert result["memory"]["argument"] >= 3 * param_bytes
  assert "replicated loss" in train.format_results({"replicated": result})
