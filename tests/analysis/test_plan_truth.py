"""The Plan says what the step does: each tensor under one cluster, the totals of them.

Issue 38 item 4: in a Muon step on a (4, 2) mesh, the momenta were listed under several
clusters (Muon's Newton-Schulz `scan` runs the same-shape momenta together, so the rest
of each replicated cluster's update reached all of them), the replicated bytes counted
them once per cluster, and the totals called the momenta kept whole "weights, tiny
tensors".
"""

import jax
import optax
import pytest
from jax.sharding import PartitionSpec as P

import tensor_parallel as tp
import wus
from wus.analysis import causes, reasons


def _muon_plan(monkeypatch):
  """The Plan of Muon on the GELU MLP, w1 and w2 split over "model" on a (4, 2) mesh."""
  params, batches = tp.gelu_inputs(4, steps=1)
  tx = optax.contrib.muon(1e-2)
  tp.use_tx(monkeypatch, tx, params)
  mesh, spec = tp.two_axis_mesh(4, 2), tp.GELU_SPEC
  specs = tp.opt_specs(spec)  # As use_tx set it: the momenta split as their weights.
  ws = wus.shard_map(tp.gelu_step, mesh=mesh, in_specs=(spec, specs, P("data")),
                     out_specs=(spec, specs, P()))
  batch = tuple(jax.device_put(x, jax.NamedSharding(mesh, P("data"))) for x in batches[0])
  return ws.plan(tp.put(mesh, params, spec), tp.put(mesh, tx.init(params), specs), batch)


def test_muon_momenta_listed_once_counted_once_and_named_in_the_totals(monkeypatch):
  plan = _muon_plan(monkeypatch)
  assert len(plan.clusters) == 2 and not any(c.sharded or c.owner for c in plan.clusters)
  momenta = [i.name for i in plan.inputs if ".mu[" in i.name]
  assert len(momenta) == 2, momenta
  listed = [t.name for c in plan.clusters for t in c.tensors if t.role in ("weight", "state")]
  # Each weight and momentum under one cluster: the two weights, the two momenta.
  assert sorted(listed) == sorted(["params['w1']", "params['w2']", *momenta]), plan.details()
  assert plan.replicated_bytes == 4 * 16 * 16 * 4  # Two [16,16] blocks and their momenta.
  for c in plan.clusters:  # Titled by its weight; not owned: its gradient is a block.
    assert c.tensors[0].role in ("root", "weight"), c.tensors
    assert any(t.role == "weight" for t in c.tensors), c.tensors
    (note,) = [n for n in c.why.notes if isinstance(n, reasons.NotOwned)]
    assert note.why == causes.BlockOfSplit(note.why.line, ("model",)), note
  whole = [i for i in plan.inputs if i.state and not i.sharded]
  assert {i.name for i in whole} >= set(momenta)
  assert "state kept whole: 4.02 KiB (weights, tiny tensors, optimizer state of replicated " \
      "clusters)" in str(plan), str(plan)
  assert ("state kept whole 4116 B (weights, tiny tensors, optimizer state of replicated "
          "clusters: see inputs)") in plan.details()


def test_a_reason_holds_values_not_words():
  """`Reason.verdict` and its notes are values (`reasons.render` words them): words are
  refused where they would be stored, and each front end's split is a value too."""
  with pytest.raises(TypeError, match="values, not words"):
    reasons.Reason("too large to balance")
  with pytest.raises(TypeError, match="values, not words"):
    reasons.Reason(reasons.NotRead(), ("a note",))
  differs = reasons.Reason(reasons.Differs(("data",), causes.MAPPED_COPIES_DIFFER))
  assert str(differs) == "not identical across ['data'] (mapped, and its per-device copies differ)"
  assert causes.words(causes.SPEC_SPLITS) == "its in_spec splits it"
  assert causes.words(causes.BATCH_SPLITS) == "split over the batch axes"
