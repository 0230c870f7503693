"""`analysis.refusals`: a front end's refusals are values, worded by `reasons.render` alone,
in the words the front end wrote before they were values (issue 38 item 4)."""

import dataclasses

import pytest
from jax.sharding import PartitionSpec as P

from wus.analysis import reasons, refusals
from wus.analysis.reasons import Reason

NO_PARALLELISM = "so there is no data parallelism to shard the update over"
WHOLE = Reason(refusals.NeedsWhole("scan", "f.py:3", 1, "float32[1,16,32]", ("model",), 7))
CASES = [
    (refusals.Pinned((("device", "CpuDevice(id=3)"),)),
     f"device=CpuDevice(id=3) pins the step to one device, {NO_PARALLELISM}"),
    (refusals.Pinned((("device", "CpuDevice(id=3)"), ("backend", "'cpu'"))),
     f"device=CpuDevice(id=3) and backend='cpu' pins the step to one device, {NO_PARALLELISM}"),
    (refusals.NoMesh(),
     f"no argument is placed on a mesh of more than one device, {NO_PARALLELISM}"),
    (refusals.ReadsRefs("state['w']"),
     "the step reads or writes JAX refs it does not create (state['w']): wus.jit shards "
     "updates of values the step takes and returns, so the step runs as jax.jit runs it; pass "
     "the values (ref[...]) and return the new ones to shard the update"),
    (refusals.NoBatchSplit(),
     "no argument is split over a mesh axis as the batch (the state aside), nor laid out so "
     f"by a sharding constraint in the step, {NO_PARALLELISM}"),
    (refusals.OwnError("wus/jit.py:12", "KeyError", "'x'"),
     "wus could not shard this step (an error of its own, at wus/jit.py:12: KeyError: 'x'); "
     "it runs as jax.jit runs it"),
    (refusals.NoUpdate(),
     "no update reads only whole values (the step's forward and backward pass read every "
     "result)"),
    (WHOLE.verdict,
     "scan at f.py:3 needs dim 1 of float32[1,16,32] whole, which is split over ['model']"),
    (refusals.Reshards("dot_general", "f.py:4", 1, "float32[8,16]", 0, "float32[16,4]",
                       ("model",), ()),
     "dot_general at f.py:4 lays dim 1 of float32[8,16] out as dim 0 of float32[16,4] (over "
     "['model'], then []): a reshard, which runs as jax.jit runs it"),
    (refusals.PlacedApart("float32[8,8]", ("model",), ("data",)),
     "a tensor float32[8,8] is placed over ('model',) where what it meets is placed over "
     "('data',)"),
    (refusals.SplitTwice("float32[8,8]", (("model",), ("model",))),
     "a value float32[8,8] would be split twice over one axis ((('model',), ('model',)))"),
    (refusals.Indivisible(7, "float32[7,8]", ("model",)),
     "a dim of 7 of float32[7,8] does not divide over ['model'], which its placement splits "
     "it over"),
    (refusals.SplitBothWays("float32[8]", (("model",),), (("fsdp",),)),
     "a dim of float32[8] is split over the model axes and over the batch axes at once "
     "((('model',),), (('fsdp',),))"),
    (refusals.SplitBothWays("float32[8]", (("model",),), P("data"), read=True),
     "a value float32[8] the update reads is split over the batch and the model axes on one "
     f"dim ({P('data')}, (('model',),))"),
    (refusals.OnBlocks(("model", "fsdp"), WHOLE),
     "the update cannot run on the blocks of the tensors split over ['model', 'fsdp']: scan "
     "at f.py:3 needs dim 1 of float32[1,16,32] whole, which is split over ['model']; the step "
     "runs as jax.jit runs it"),
    (refusals.ShardsNothing(None, 8, 16),
     "the update region shards nothing (no weight-update cluster with a tensor to shard: each "
     "is split by its placement already (FSDP), or has at most N=8 elements or fewer than "
     "min_shard_size=16); the step runs as jax.jit runs it"),
    (refusals.ShardsNothing(Reason(reasons.Tiny(8, 0)), 8, 0, WHOLE, ("model",)),
     "the update region shards nothing (every weight-update cluster stays replicated, cluster "
     "0: scalar or tiny (at most 8 elements, or fewer than min_shard_size=0): kept "
     "replicated; parts of the update run outside it, on the blocks of the tensors split over "
     "['model']: scan at f.py:3 needs dim 1 of float32[1,16,32] whole, which is split over "
     "['model']); the step runs as jax.jit runs it"),
]


@pytest.mark.parametrize("verdict,words", CASES, ids=[type(v).__name__ for v, _ in CASES])
def test_each_refusal_is_worded_by_render_as_the_front_end_worded_it(verdict, words):
  assert reasons.render(Reason(verdict)) == words
  assert str(Reason(verdict)) == words


def test_every_refusal_has_its_words_and_is_a_frozen_value():
  kinds = {v for v in vars(refusals).values()
           if isinstance(v, type) and dataclasses.is_dataclass(v) and v.__module__ ==
           refusals.__name__}
  assert kinds == set(refusals.RENDER), kinds ^ set(refusals.RENDER)
  assert kinds - {refusals.SplitEnds} == {type(v) for v, _ in CASES}
  with pytest.raises(dataclasses.FrozenInstanceError):
    WHOLE.verdict.dim = 0  # type: ignore[misc]


def test_where_the_split_ends_is_a_note_after_the_refusal():
  why = Reason(refusals.NoUpdate()).noted(refusals.SplitEnds("fft", "f.py:9"))
  assert str(why) == (
      "no update reads only whole values (the step's forward and backward pass read every "
      "result); the batch's split ends at fft (f.py:9): wus has no rule carrying it through "
      "there, so no gradient after it is seen as a sum over the batch")
