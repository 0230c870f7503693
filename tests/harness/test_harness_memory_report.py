"""The memory report reads its numbers from the compiled programs: a tiny case known by hand."""

import dataclasses
import json

import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from wus.harness.tools import memory_report
from wus.harness.models import mlp, tasks
from wus.harness.training import steps

N = 8
BATCH = 2  # per replica
# An MLP 16 -> 64 -> 16 on 4x4x1 images. Every tensor is a multiple of N in
# size, and bigger than N (a tensor of N elements or fewer stays whole).
W = 4 * (16 * 64 + 64 + 64 * 16 + 16)  # float32 params: 8,448 bytes
V = 2 * W + 4                          # Adam's mu and nu, and its int32 count
BATCH_BYTES = BATCH * (16 * 4 + 4)     # this device's images and labels


@pytest.fixture(scope="module")
def measured():
  mesh = jax.make_mesh((N,), (steps.AXIS_NAME,))
  task = tasks.ImageClassifier("tiny", mlp.MLPConfig(hidden=(64,)), num_classes=16,
                               axis_name=steps.AXIS_NAME)
  tx = optax.adam(1e-3)
  batch = {"image": np.zeros((N * BATCH, 4, 4, 1), np.float32),
           "label": np.zeros((N * BATCH,), np.int32)}
  params, model_state = task.init(0, batch)
  state = jax.device_put(steps.TrainState(params, model_state, tx.init(params)),
                         NamedSharding(mesh, P()))
  batch = jax.device_put(batch, NamedSharding(mesh, P(steps.AXIS_NAME)))
  return memory_report.measure_step(task, tx, state, batch, mesh)


def test_state_bytes(measured):
  assert measured["weights_bytes"] == W
  assert measured["opt_state_bytes"] == V


def test_argument_bytes_are_the_state_each_device_holds(measured):
  assert measured["replicated"]["memory"]["argument"] == W + V + BATCH_BYTES
  # Each device holds 1/N of mu and nu, and the whole count.
  assert measured["wus"]["memory"]["argument"] == W + 2 * W // N + 4 + BATCH_BYTES
  assert measured["wus"]["opt_state_per_device"] == 2 * W // N + 4
  # Donated: outputs reuse the state's buffers.
  assert measured["wus"]["memory"]["alias"] == W + 2 * W // N + 4


def test_collectives(measured):
  rep, ws = measured["replicated"]["collectives"], measured["wus"]["collectives"]
  # Replicated: the gradients and the two metrics are all-reduced, nothing else.
  assert rep["all-reduce"]["bytes"] == W + 8
  # A ring sends 2 (N - 1) chunks of each array: 1/N of each gradient, and one
  # float of each metric.
  assert rep["all-reduce"]["wire_bytes"] == 2 * (N - 1) * (W // N + 2 * 4)
  assert rep["reduce-scatter"]["count"] == rep["all-gather"]["count"] == 0
  # wus: every gradient reduce-scattered (each device keeps 1/N), every weight
  # all-gathered; only the metrics are still all-reduced.
  assert ws["reduce-scatter"]["bytes"] == W // N
  assert ws["all-gather"]["bytes"] == W
  assert ws["all-reduce"]["bytes"] == 8
  assert ws["reduce-scatter"]["wire_bytes"] == ws["all-gather"]["wire_bytes"] == (N - 1) * W // N


def test_prediction_uses_the_paper_formula(measured):
  p = measured["activations_bytes"]
  assert p >= W  # the gradients, at least
  assert measured["predicted"] == {"replicated": W + V + p, "wus": W + V / N + p}
  assert 0 < measured["wus_seconds"] and 0 < measured["compile_seconds"]


def test_markdown_json_and_png(measured, tmp_path):
  result = {**dataclasses.asdict(memory_report.Case("mlp_small", "adam", N, BATCH)), **measured}
  paths = memory_report.write([result], tmp_path)
  text = paths["md"].read_text()
  assert "| mlp_small + adam, N=8 | wus        |" in text
  assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert json.loads(paths["json"].read_text())[0]["opt_state_bytes"] == V
