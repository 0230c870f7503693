"""`wus-scale`: the paper's settings through the cost model, in-process."""

import dataclasses
import json

import pytest
from absl import flags
from absl.testing import flagsaver

from wus.harness.tools import scale


@pytest.fixture
def run(tmp_path, capsys):
  """Runs `wus-scale` in-process with flags; returns (stdout, the JSON it wrote)."""
  scale._define_flags()

  def _run(*args):
    path = tmp_path / "scale.json"
    with flagsaver.flagsaver():
      flags.FLAGS.unparse_flags()
      flags.FLAGS(["wus-scale", f"--output={path}", *args])
      scale.main(["wus-scale"])
    flags.FLAGS.unparse_flags()
    return capsys.readouterr().out, json.loads(path.read_text())
  return _run


def test_model_sizes():
  resnet = scale.resnet50_tensors()
  assert (len(resnet), sum(resnet)) == (161, 25_557_032)  # torchvision's num_params
  transformer = scale.transformer_big_tensors()
  assert (len(transformer), sum(transformer)) == (185, 211_047_424)
  assert sum(transformer) == pytest.approx(213e6, rel=0.02)  # Vaswani et al., Table 3


def test_hardware_from_the_published_figures():
  assert scale.LINK_BANDWIDTH == 100e9  # 6.4 TB/s over 64 links
  t = scale.tpu_v3_topology(32, 32, torus=True)
  assert t.num_devices == 2048 and t.memory_bandwidth == 450e9
  assert [a.bandwidth for a in t.axes[1:]] == [100e9, 100e9]
  assert scale.tpu_v3_topology(4, 4, torus=False).axes[1].bandwidth == 50e9


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
  for r in (r for r in data["rows"] if r["cores"] == 2048):
    assert set(r["sharded"]["collectives"]) == {"reduce-scatter", "all-reduce", "all-gather"}
  for key in ("paper", "cloud-tpu-v3", "perf-guide", "thakur2005", "resnet50",
              "mlperf-transformer", "flax-imagenet"):
    assert key in data["citations"] and f"[{key}]" in out
  for figure in data["hardware"].values():
    assert figure["source"]
  assert data["assumptions"] and data["sensitivity"]
  assert [c["section"] for c in data["checks"]] == ["§2.2", "§5.2", "§5.2"]


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
