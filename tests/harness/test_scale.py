"""`wus-scale`: the paper's settings through the cost model, in-process."""

import dataclasses
import json

import pytest
from absl import flags
from absl.testing import flagsaver

from wus.analysis import costmodel, sizing
from wus.harness.tools import paper_model, scale, scale_tp, tpu_v3


@pytest.fixture
def run(tmp_path, capsys):
  """Runs `wus-scale` in-process with flags; returns (stdout, the JSON it wrote)."""
  scale._define_flags()

  def _run(*args):
    path = tmp_path / "scale.json"
    with flagsaver.flagsaver():
      flags.FLAGS.unparse_flags()
      # Explicit: another command run in this process may define --model_parallel.
      mp = [] if any(a.startswith("--model_parallel") for a in args) else ["--model_parallel=1"]
      flags.FLAGS(["wus-scale", f"--output={path}", *mp, *args])
      scale.main(["wus-scale"])
    flags.FLAGS.unparse_flags()
    return capsys.readouterr().out, json.loads(path.read_text())
  return _run


def test_model_sizes():
  resnet = paper_model.resnet50_tensors()
  assert (len(resnet), sum(resnet)) == (161, 25_557_032)  # torchvision's num_params
  transformer = paper_model.transformer_big_tensors()
  assert (len(transformer), sum(transformer)) == (185, 211_047_424)
  assert sum(transformer) == pytest.approx(213e6, rel=0.02)  # Vaswani et al., Table 3


@pytest.mark.parametrize("m", [2, 4, 16])
def test_a_model_ranks_blocks_are_1_over_m_but_the_layer_norms_and_second_biases(m):
  whole, block = (paper_model.transformer_big_tensors(model_parallel=k) for k in (1, m))
  assert len(block) == len(whole)
  kept = [n for n, b in zip(whole, block, strict=True) if n == b]
  norms = 2 * (2 * 6 + 1) + 2 * (3 * 6 + 1)  # Scale and bias of each layer norm.
  assert set(kept) == {1024} and len(kept) == norms + 2 * 6  # and the second FFN biases.
  split = [(n, b) for n, b in zip(whole, block, strict=True) if n != b]
  assert all(b * m == n for n, b in split[1:])  # The embedding: ceil(33945 / M) rows.
  assert split[0] == (33945 * 1024, -(-33945 // m) * 1024)
  with pytest.raises(ValueError):
    paper_model.transformer_big_tensors(model_parallel=3)


def test_hardware_from_the_published_figures():
  # All-reduce bandwidth 340 TB/s over 1024 chips x 4 ports; bisection 6.4 TB/s over 64.
  assert tpu_v3.LINK_BANDWIDTH == pytest.approx(83.0e9, rel=1e-3)
  assert tpu_v3.BISECTION_LINK_BANDWIDTH == 100e9
  t = tpu_v3.topology(32, 32, torus=True)
  assert t.num_devices == 2048 and t.memory_bandwidth == 450e9
  assert [a.bandwidth for a in t.axes[1:]] == [tpu_v3.LINK_BANDWIDTH] * 2
  assert tpu_v3.topology(4, 4, torus=False).axes[1].bandwidth == tpu_v3.LINK_BANDWIDTH / 2


def test_the_replicated_step_converts_whole_weights_and_the_sharded_its_shards():
  """Fig. 7: the replicated step's bfloat16 copy reads 4 and writes 2 bytes of every
  weight on every core; the sharded step's update writes 2 bytes of its shard."""
  case = scale.TRANSFORMER_BASELINE_CASE
  r = scale.predict_case(case)
  n = 211_047_424
  assert r["replicated"]["cast_ms"] == pytest.approx(n * 6 / 450e9 * 1e3, rel=0.01)
  g = r["sharded"]["group_size"]
  assert r["sharded"]["cast_ms"] == pytest.approx(n * 2 / g / 450e9 * 1e3, rel=0.05)
  # Without the copy priced, the model predicts less of a change.
  plain = scale.predict_case(case, tpu_v3.Settings(cast=(0, 0)))
  assert plain["predicted_reduction"] < r["predicted_reduction"]


def test_writes_rows_beside_the_paper_with_citations(run):
  out, data = run()
  assert "PREDICTED" in out and "Sources:" in out
  rows = {(r["model"], r["cores"]): r for r in data["rows"]}
  assert set(rows) == {(m, c) for m in ("resnet50", "transformer") for c in (32, 2048)}
  for r in data["rows"]:
    assert r["sharded"]["step_ms"] > r["sharded"]["rest_ms"] > 0
    assert r["predicted_reduction"] == pytest.approx(
        1 - r["sharded"]["step_ms"] / r["replicated"]["step_ms"])
    assert r["cores"] % r["sharded"]["group_size"] == 0
    if r["published_reduction"] is not None:
      assert r["relative_error"] == pytest.approx(
          r["predicted_reduction"] / r["published_reduction"] - 1)
      assert f"{100 * r['relative_error']:+.1f}%" in out
  big = rows[("transformer", 2048)]
  # Its rest is the published baseline minus the model's own all-reduce and update.
  assert big["replicated"]["step_ms"] == pytest.approx(46.5)
  assert big["relative_error_sharded_ms"] == pytest.approx(
      big["sharded"]["step_ms"] / 25.6 - 1)
  # The first line: that prediction, its error and the TPU v3 figures it uses.
  first = out.splitlines()[0]
  assert first.startswith("1024-chip Transformer, PREDICTED 46.50 -> ")
  assert f"relative error {100 * big['relative_error']:+.1f}%" in first
  assert "HBM 450 GB/s per core" in first and "ICI 83 GB/s per port" in first
  for r in (r for r in data["rows"] if r["cores"] == 2048):
    assert set(r["sharded"]["collectives"]) == {"reduce-scatter", "all-reduce", "all-gather"}
  for key in ("paper", "cloud-tpu-v3", "cloud-tpu-v5e", "perf-guide", "thakur2005", "resnet50",
              "mlperf-transformer", "flax-imagenet"):
    assert key in data["citations"] and f"[{key}]" in out
  for figure in data["hardware"].values():
    assert figure["source"]
  assert data["assumptions"] and data["sensitivity"]
  assert [c["section"] for c in data["checks"]] == ["§2.2", "§5.2", "§5.2"]
  assert "model_parallel" not in data and "Data x model" not in out


def test_model_parallel_prints_state_per_device_and_the_change(run):
  out, data = run("--model_parallel=2")
  assert "Data x model, PREDICTED" in out
  rows = {r["cores"]: r for r in data["model_parallel"]}
  assert set(rows) == {32, 2048}
  for cores, r in rows.items():
    assert (r["data"], r["model"]) == (cores // 2, 2)
    # The data group is the chips' torus or mesh: the two cores of a chip are the ranks.
    assert r["data_ring"] == ("x=32 x y=32" if cores == 2048 else "x=4 x y=4")
    tp, wus = r["tp"], r["wus"]
    # TP keeps half a copy of the state (plus the whole layer norms) on every core.
    assert 0.5 < tp["state"]["fraction_of_a_copy"] < 0.501
    g = wus["group_size"]
    assert r["data"] % g == 0 and g > 1
    assert wus["state"]["bytes"] <= tp["state"]["bytes"] / g * 1.05
    assert wus["state_full_sharding"]["bytes"] <= wus["state"]["bytes"]
    assert r["predicted_change"] == pytest.approx(wus["step_ms"] / tp["step_ms"] - 1)
    assert f"{100 * r['predicted_change']:+.1f}%" in out
    assert wus["step_ms"] < tp["step_ms"]


def test_the_data_x_model_step_is_priced_on_the_strided_data_group():
  """Each rank's blocks over the cores M apart: the TP step is the replicated step of
  the 1/M blocks on `Topology.strided(M, cores / M)`."""
  case, settings = scale.TRANSFORMER_BASELINE_CASE, tpu_v3.Settings()
  rest = 0.01
  w = scale.workload(case.model, case.optimizer, settings, model_parallel=4)
  r = scale_tp.predict(case, 4, rest, w, settings)
  group = tpu_v3.topology(*case.chips, torus=True).strided(4, 512)
  assert [a.name for a in group.axes] == ["x/2", "y"]
  tp = costmodel.predict_replicated(w, group, rest, sizing.choose_bucket_bytes(w, group))
  assert r["tp"]["step_ms"] == pytest.approx(tp.total * 1e3)
  assert r["data_ring"] == "x/2=16 x y=32"


def test_model_parallel_that_splits_nothing_evenly_is_refused(run):
  for bad in ("--model_parallel=3", "--model_parallel=32"):
    with pytest.raises(SystemExit, match="model_parallel"):
      run(bad)


@pytest.mark.slow
def test_rest_scales_with_examples_per_core(run):
  _, data = run("--alpha_us=2")
  rows = {(r["model"], r["cores"]): r for r in data["rows"]}
  for model in ("resnet50", "transformer"):
    small, large = rows[(model, 32)], rows[(model, 2048)]
    assert small["rest_ms"] / large["rest_ms"] == pytest.approx(
        small["per_core"] / large["per_core"])


def test_a_fixed_group_size_overrides_the_choice(run):
  _, data = run("--group_size=4")
  assert {r["sharded"]["group_size"] for r in data["rows"]} == {4}


def test_nothing_is_fitted_to_the_compared_results(monkeypatch):
  """Changing what the paper reports after the baseline changes no prediction."""
  before = [scale.predict_case(c) for c in scale.CASES]
  moved = tuple(dataclasses.replace(c, published_reduction=0.5,
                                    published_ms=(c.published_ms[0], 1.0) if c.published_ms
                                    else None) for c in scale.CASES)
  monkeypatch.setattr(scale, "CASES", moved)
  after = [scale.predict_case(c) for c in moved]
  for b, a in zip(before, after, strict=True):
    assert (a["replicated"], a["sharded"]) == (b["replicated"], b["sharded"])
