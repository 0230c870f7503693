"""wus/matching.py's `match_state` alone, on abstract values: which output leaves are the
next value of which input leaves (the step's state), rule by rule (issue 31 item 7)."""

import jax
import jax.numpy as jnp
import optax

from wus.matching import Signature, match_state


def _f32(*shape):
  return jax.ShapeDtypeStruct(shape, jnp.float32)


PARAMS = {"b": _f32(4), "w": _f32(3, 4)}
BATCH = _f32(16, 3)


def _num_leaves(tree) -> int:
  return len(jax.tree.leaves(tree))


def test_position_pairs_the_elements_of_a_tuple_output_with_the_arguments():
  """`(params, opt_state, batch) -> (params, opt_state, metrics)`: each state leaf pairs with
  the leaf at its place in the same argument; the batch and the metrics pair with nothing."""
  opt_state = jax.eval_shape(optax.adam(1e-2).init, PARAMS)
  args = (PARAMS, opt_state, BATCH)
  out = (PARAMS, opt_state, {"loss": _f32()})
  match = match_state(args, out, Signature(("params", "opt_state", "batch")))
  n_params, n_state = _num_leaves(PARAMS), _num_leaves(opt_state)
  want = {k: k for k in range(n_params + n_state)}
  assert match.pairs == want
  assert set(match.how.values()) == {"position"}
  assert n_params + n_state not in match.pairs.values()  # The batch is no state.


def test_a_step_returning_only_its_new_weights_pairs_them_whole():
  """The JAX docs' data-parallel example ("Distributed arrays and automatic
  parallelization"): `train_step(params, batch)` returns the new params, a list of
  (W, b) pairs; the batch is an (inputs, targets) pair. Element 1 of the list, (W1, b1),
  has the batch's tree structure but none of its shapes: position pairs nothing there,
  and the whole list pairs with the params by structure, every layer (the four equal
  middle layers too)."""
  params = [(_f32(784, 128), _f32(128))] + [(_f32(128, 128), _f32(128))] * 4 + [
      (_f32(128, 8), _f32(8))]
  batch = (_f32(32, 784), _f32(32, 8))
  match = match_state((params, batch), list(params), Signature(("params", "batch")))
  assert match.pairs == {k: k for k in range(12)}
  assert set(match.how.values()) == {"structure"}


def test_name_pairs_a_dict_output_with_the_parameters_of_those_names():
  """jaxline's `{"params": ..., "mom": ...}` returned from `(params, mom, batch)`."""
  args = (PARAMS, PARAMS, BATCH)
  out = {"mom": PARAMS, "params": PARAMS}  # Flattened by key: mom's leaves first.
  match = match_state(args, out, Signature(("params", "mom", "batch")))
  n = _num_leaves(PARAMS)
  assert match.pairs == {**{k: n + k for k in range(n)}, **{n + k: k for k in range(n)}}
  assert match.how == {**dict.fromkeys(range(n), "name 'params'"),
                       **dict.fromkeys(range(n, 2 * n), "name 'mom'")}


def test_structure_pairs_one_tuple_argument_with_a_tuple_output():
  """`step((params, opt)) -> (params, opt)`: neither position nor name decides (the argument
  is one tuple); one level down, each part matches exactly one output element."""
  opt = {"count": jax.ShapeDtypeStruct((), jnp.int32), "mu": PARAMS}
  match = match_state(((PARAMS, opt),), (PARAMS, opt), Signature(("state",)))
  n = _num_leaves(PARAMS) + _num_leaves(opt)
  assert match.pairs == {k: k for k in range(n)}
  assert set(match.how.values()) == {"structure"}


def test_a_leaf_whose_dtype_the_step_changes_stays_unpaired():
  """Within paired parts, leaves pair only where shape and dtype agree."""
  args = ({"lr": jax.ShapeDtypeStruct((), jnp.float32), "w": _f32(3)}, BATCH)
  out = ({"lr": jax.ShapeDtypeStruct((), jnp.int32), "w": _f32(3)}, _f32())
  match = match_state(args, out, Signature(("state", "batch")))
  assert match.pairs == {1: 1}
  assert match.how == {1: "position"}


def test_inputs_that_several_outputs_match_stay_unpaired_and_say_why():
  """Two arguments of one structure, returned under names that are no parameter's: no rule
  decides, so neither pairs, and the reason names both sides and what to do."""
  args = (_f32(5), _f32(5))
  out = {"first": _f32(5), "second": _f32(5)}
  match = match_state(args, out, Signature(("a", "b")))
  assert match.pairs == {}
  assert set(match.how) == {0, 1}
  why = match.how[0]
  assert why.startswith("no next value: its tree structure, shapes and dtypes match output(s) "
                        "['first'], ['second'] and input(s) [1]")
  assert why.endswith("return it at its argument's position or under its parameter's name")


def test_nested_structure_pairs_state_a_wrapper_nests_on_both_sides():
  """haliax's `named_jit` jits `fun(dynamic_donated, dynamic_reserved, static)`: the state
  three levels down in the donated half (the other half None there), the batch in the
  reserved half; it returns `(out_dynamic, Static)`, the new state one level down. The
  state pairs leaf for leaf (Adam's mu and nu, alike, pair inside it); the batch and the
  loss pair with nothing."""
  opt_state = jax.eval_shape(optax.adam(1e-2).init, PARAMS)
  state = {"model": PARAMS, "opt_state": opt_state, "step": jax.ShapeDtypeStruct((), jnp.int32)}
  donated = (None, ((state, None), {}))
  reserved = (None, ((None, {"tokens": BATCH}), {}))
  out = ({"loss": _f32(), "new_state": state}, None)
  match = match_state((donated, reserved), out,
                      Signature(("dynamic_donated", "dynamic_reserved")))
  n = _num_leaves(state)
  assert match.pairs == {1 + k: k for k in range(n)}  # Output leaf 0 is the loss.
  assert set(match.how.values()) == {"nested structure"}


def test_nested_structure_leaves_twins_unpaired():
  """Two nested subtrees alike on the input side and one on the output side: nothing
  decides which the output follows, so neither pairs."""
  args = ((None, (PARAMS, PARAMS)),)
  out = (None, {"new": PARAMS})
  match = match_state(args, out, Signature(("wrapped",)))
  assert match.pairs == {}
