"""The one place that picks an input's reason (analysis/input_reasons.py, issue 31 item 2):
candidates proposed in any order, the reason picked by the stated precedence."""

from __future__ import annotations

import itertools

import pytest

from wus.analysis import causes, reasons
from wus.analysis.input_reasons import InputReasons

KEPT = ("keep", reasons.OnlySharded(False))
OWNED = ("own", reasons.OnOwner(1, 2, False))
SHARDED = ("shard", reasons.OnlyCluster(3))
NOTE = ("note", reasons.NotKeptByShardWeights(causes.ReadInFloats(("float32",))))
FALLBACK = ("whole", reasons.ClusterReplicated(0))


def _propose(r: InputReasons, k: int, kind: str, why) -> None:
  if kind == "own":
    r.own({k: (False, why)})
  elif kind == "note":
    r.note(k, 5, why)
  else:
    getattr(r, kind)(k, why)


def _picked(*proposals) -> tuple[bool, object]:
  r = InputReasons()
  for kind, why in proposals:
    _propose(r, 0, kind, why)
  return r.pick(0)


def test_nothing_proposed_picks_nothing():
  assert InputReasons().pick(0) is None and InputReasons().picked() == {}


@pytest.mark.parametrize("order", itertools.permutations([KEPT, OWNED, SHARDED, NOTE, FALLBACK]))
def test_the_highest_precedence_wins_in_any_order(order):
  assert _picked(*order) == (True, KEPT[1])
  rest = [p for p in order if p is not KEPT]
  assert _picked(*rest) == (False, OWNED[1])
  rest = [p for p in rest if p is not OWNED]
  assert _picked(*rest) == (True, SHARDED[1])
  rest = [p for p in rest if p is not SHARDED]
  assert _picked(*rest) == (False, reasons.Reason(FALLBACK[1], (NOTE[1],)))


def test_the_first_fallback_and_the_last_sharding_win():
  assert _picked(FALLBACK, ("whole", reasons.SlicedLocally(4))) == (False, FALLBACK[1])
  assert _picked(SHARDED, ("shard", reasons.LoopCarried("f.py:3"))) == (
      True, reasons.LoopCarried("f.py:3"))


def test_notes_without_a_fallback_name_the_cluster_that_updates_the_weight():
  other = reasons.NotKeptByShardWeights(causes.Returned("float32[8]"))
  assert _picked(NOTE, ("note", other)) == (
      False, reasons.Reason(reasons.ClusterUpdates(5), (NOTE[1], other)))


def test_picked_lists_inputs_in_the_order_first_proposed():
  r = InputReasons()
  _propose(r, 2, *FALLBACK)
  _propose(r, 0, *SHARDED)
  _propose(r, 2, *KEPT)
  r.own({1: (False, OWNED[1]), 0: (False, OWNED[1])})
  assert list(r.picked()) == [2, 0, 1]
  assert r.picked() == {2: (True, KEPT[1]), 0: (False, OWNED[1]), 1: (False, OWNED[1])}
