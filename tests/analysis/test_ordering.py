"""The set cover behind the copy-free order of donated weights (`analysis/ordering.py`)."""

import collections

from hypothesis import given, settings, strategies as st

from wus.analysis import ordering


def _greedy(masks: list[int], width: int) -> list[int]:
  """The cover as first written: recount every mask for every bit, each round."""
  chosen = []
  while masks:
    bit = max(range(width), key=lambda b: sum(m >> b & 1 for m in masks))
    chosen.append(bit)
    masks = [m for m in masks if not m >> bit & 1]
  return chosen


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 70).flatmap(
    lambda w: st.tuples(st.just(w), st.lists(st.integers(1, 2**w - 1), max_size=60))))
def test_cover_meets_every_mask_and_chooses_as_the_plain_greedy_does(case):
  width, masks = case
  chosen = ordering._cover(collections.Counter(masks), width)
  assert all(any(m >> b & 1 for b in chosen) for m in masks)
  assert chosen == _greedy(masks, width)
