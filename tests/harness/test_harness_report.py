"""Tests of wus.harness.tools.report on tiny programs whose bytes are known by hand."""

import doctest
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from wus.harness.tools import report

NUM_DEVICES = 8
NO_COLLECTIVES = {kind: (0, 0, 0) for kind in report.COLLECTIVE_KINDS}


@pytest.fixture(scope="module")
def mesh():
  return jax.make_mesh((NUM_DEVICES,), ("data",))


def _compile(f, mesh, x, in_spec, out_spec):
  mapped = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=in_spec, out_specs=out_spec,
                                 check_vma=False))
  return mapped.lower(jax.device_put(x, NamedSharding(mesh, in_spec))).compile()


@pytest.mark.parametrize(
    "f, x, in_spec, out_spec, kind, nbytes, wire",
    [
        # f32[1000] on each device, summed: the result is f32[1000]; a ring
        # all-reduce sends 7 of 8 blocks of 500 bytes twice.
        (lambda x: lax.psum(x, "data"), jnp.ones(1000, jnp.float32), P(), P(),
         "all-reduce", 1000 * 4, 2 * 7 * 500),
        # f32[8000] on each device, summed and split: each keeps f32[1000] and
        # sends the 7 other blocks.
        (lambda x: lax.psum_scatter(x, "data", tiled=True), jnp.ones(8000, jnp.float32),
         P(), P("data"), "reduce-scatter", 1000 * 4, 7 * 4000),
        # f32[1000] on each device, gathered: each gets f32[8000], sending its
        # own block to 7 others (along a ring: 7 blocks).
        (lambda x: lax.all_gather(x, "data", tiled=True), jnp.ones(8000, jnp.float32),
         P("data"), P(), "all-gather", 8000 * 4, 7 * 4000),
        # Sums within groups of 4 devices (axis_index_groups): 2 x 3 blocks of 1000.
        (lambda x: lax.psum(x, "data", axis_index_groups=[[0, 1, 2, 3], [4, 5, 6, 7]]),
         jnp.ones(1000, jnp.float32), P(), P(), "all-reduce", 1000 * 4, 2 * 3 * 1000),
        # s32[1000] on each device, shifted by one device.
        (lambda x: lax.ppermute(x, "data", [(i, (i + 1) % NUM_DEVICES)
                                            for i in range(NUM_DEVICES)]),
         jnp.ones(8000, jnp.int32), P("data"), P("data"), "collective-permute", 1000 * 4,
         1000 * 4),
        # f32[8,125] on each device, row i sent to device i: the CPU compiler
        # emits one all-to-all whose result is a tuple of 8 f32[1,125].
        (lambda x: lax.all_to_all(x, "data", 0, 0, tiled=True),
         jnp.ones((64, 125), jnp.float32), P("data"), P("data"), "all-to-all", 1000 * 4,
         7 * 500),
    ],
    ids=["psum", "psum_scatter", "all_gather", "psum_groups", "ppermute", "all_to_all"])
def test_collectives_of_compiled_program(mesh, f, x, in_spec, out_spec, kind, nbytes, wire):
  hlo_text = _compile(f, mesh, x, in_spec, out_spec).as_text()
  assert report.collectives(hlo_text) == {**NO_COLLECTIVES, kind: (1, nbytes, wire)}


def test_collectives_of_program_without_any():
  hlo_text = jax.jit(lambda x: x + 1).lower(jnp.ones(10)).compile().as_text()
  assert report.collectives(hlo_text) == NO_COLLECTIVES


# Async collectives and narrow types, as XLA prints them for GPUs (the CPU
# compiler emits neither): each -start/-done pair is one collective whose bytes
# are the -done result. The fusion's metadata mentions a collective; it is none.
ASYNC_HLO = """\
HloModule jit_step, is_scheduled=true, num_partitions=8

ENTRY %main (p: bf16[1024], q: f32[10], r: s32[3]) -> (bf16[8192], f32[10], s32[3], f32[4]) {
  %p = bf16[1024]{0} parameter(0)
  %ag-start = (bf16[1024]{0}, bf16[8192]{0}) all-gather-start(%p), channel_id=1, replica_groups=[2,4]<=[8], dimensions={0}
  %ar-start = (f32[10]{0}, s32[3]{0}) all-reduce-start(%q, %r), channel_id=2, replica_groups={}, to_apply=%add
  %ag-done = bf16[8192]{0} all-gather-done(%ag-start)
  %ar-done = (f32[10]{0}, s32[3]{0}) all-reduce-done(%ar-start)
  %fusion = f32[4]{0} fusion(%q), kind=kLoop, calls=%f, metadata={op_name="x all-reduce(y)"}
  %cp-start = (f32[4]{0}, f32[4]{0}, u32[], u32[]) collective-permute-start(%fusion), channel_id=3
  %cp-done = f32[4]{0} collective-permute-done(%cp-start)
  ROOT %t = (bf16[8192]{0}, f32[10]{0}, s32[3]{0}, f32[4]{0}) tuple(%ag-done, %ar-done, %cp-done)
}
"""


def test_collectives_of_async_pairs():
  assert report.collectives(ASYNC_HLO) == {
      **NO_COLLECTIVES,
      "all-gather": (1, 8192 * 2, 3 * 8192 * 2 // 4),         # groups of 4
      "all-reduce": (1, 10 * 4 + 3 * 4, 2 * 7 * (2 * 4 + 1 * 4)),  # 8 devices: chunks of 2 and 1
      "collective-permute": (1, 4 * 4, 4 * 4),
  }


@pytest.mark.parametrize("shape, nbytes", [
    ("f32[]", 4),
    ("pred[7]", 7),
    ("bf16[8,125]{1,0}", 8 * 125 * 2),
    ("f8e4m3fn[16]{0}", 16),
    ("s4[16]{0}", 8),
    ("(f32[2,3]{1,0}, /*index=1*/s64[5]{0}, u8[3])", 2 * 3 * 4 + 5 * 8 + 3),
])
def test_shape_bytes(shape, nbytes):
  assert report.shape_bytes(shape) == nbytes


def test_memory_per_device(mesh):
  # Each device reads its f32[1000] shard, writes an f32[1000] result.
  compiled = _compile(lambda x: lax.psum(x, "data"), mesh, jnp.ones(8000, jnp.float32),
                      P("data"), P("data"))
  assert report.memory(compiled) == {"argument": 4000, "output": 4000, "alias": 0, "temp": 0,
                                     "total": 8000}


def test_memory_counts_donated_output_as_alias():
  compiled = jax.jit(lambda x: x * 2, donate_argnums=0).lower(jnp.ones(1000)).compile()
  # The output is written over the donated input: one buffer in all.
  assert report.memory(compiled) == {"argument": 4000, "output": 4000, "alias": 4000, "temp": 0,
                                     "total": 4000}


def test_bytes_per_device(mesh):
  tree = {
      "replicated": jax.device_put(jnp.ones(1000, jnp.float32), NamedSharding(mesh, P())),
      "sharded": jax.device_put(jnp.ones(8000, jnp.float32), NamedSharding(mesh, P("data"))),
      "count": jnp.zeros([], jnp.int32),
      "none": None,
  }
  assert report.bytes_per_device(tree) == 4000 + 1000 * 4 + 4


def test_doctests():
  assert doctest.testmod(report).failed == 0


def test_table_aligns_columns():
  text = report.table(["step", "loss"], [[0, 5.9323], [100, np.float32(2.5)]])
  assert text.splitlines() == [
      "| step | loss  |",
      "|------|-------|",
      "| 0    | 5.932 |",
      "| 100  | 2.500 |",
  ]


def test_collectives_per_run_count_loop_iterations(mesh):
  def f(x):
    x = lax.fori_loop(0, 4, lambda i, x: lax.psum(x, "data") * 0.5, x)
    return lax.psum(x, "data")

  hlo_text = _compile(f, mesh, jnp.ones(1000, jnp.float32), P(), P()).as_text()
  assert report.collectives(hlo_text)["all-reduce"] == (2, 2 * 4000, 2 * 7000)
  assert report.collectives(hlo_text, per_run=True)["all-reduce"] == (5, 5 * 4000, 5 * 7000)
  runs = report.executions(hlo_text)
  assert sorted(runs[b] for b in re.findall(r"body=%?([\w.\-]+)", hlo_text)) == [4]
  inside = report.collectives(hlo_text, per_run=True, only=report.in_loops(hlo_text))
  assert inside["all-reduce"] == (4, 4 * 4000, 4 * 7000)


_MOVES_HLO = """HloModule m, is_scheduled=true

%fused_transpose (p0: f32[8,4]) -> f32[4,8] {
  %p0 = f32[8,4]{1,0} parameter(0)
  ROOT %transpose.1 = f32[4,8]{1,0} transpose(%p0), dimensions={1,0}
}

%fused_concatenate (p1: f32[8], p2: f32[4]) -> f32[12] {
  %p1 = f32[8]{0} parameter(0)
  %p2 = f32[4]{0} parameter(1)
  ROOT %concatenate.1 = f32[12]{0} concatenate(%p1, %p2), dimensions={0}
}

%fused_add (p3: f32[8]) -> f32[8] {
  %p3 = f32[8]{0} parameter(0)
  ROOT %add.1 = f32[8]{0} add(%p3, %p3)
}

ENTRY %main (param.1: f32[8,4], param.2: f32[8], param.3: f32[4], param.4: s32[]) -> f32[2] {
  %param.1 = f32[8,4]{1,0} parameter(0)
  %param.2 = f32[8]{0} parameter(1)
  %param.3 = f32[4]{0} parameter(2)
  %param.4 = s32[] parameter(3)
  %copy.1 = f32[8,4]{1,0} copy(%param.1)
  %copy.2 = s32[] copy(%param.4)
  %transpose_fusion = f32[4,8]{1,0} fusion(%param.1), kind=kLoop, calls=%fused_transpose
  %concatenate_fusion = f32[12]{0} fusion(%param.2, %param.3), kind=kLoop, calls=%fused_concatenate
  %add_fusion = f32[8]{0} fusion(%param.2), kind=kLoop, calls=%fused_add
  ROOT %slice.1 = f32[2]{0} slice(%param.3), slice={[0:2]}
}
"""


def test_data_movement_counts_copies_concatenates_and_slices():
  """A copy of a parameter into its own shape is a "parameter copy" (what
  donation without ordering costs); a transpose is a copy only; a scalar's
  copy is no parameter copy; arithmetic is no data movement."""
  moved = report.data_movement(_MOVES_HLO)
  assert moved["copy"] == report.Moves(3, 128 + 4 + 128)
  assert moved["parameter copy"] == report.Moves(1, 128)
  assert moved["concatenate"] == report.Moves(1, 48)
  assert moved["slice"] == report.Moves(1, 8)
  assert moved["pad"] == report.Moves(0, 0)


def test_data_movement_of_a_compiled_concatenation(mesh):
  f = jax.jit(lambda x, y: jnp.concatenate([x, y])[3:])
  hlo = f.lower(jnp.ones(1000), jnp.ones(24)).compile().as_text()
  moved = report.data_movement(hlo)
  assert moved["concatenate"].bytes + moved["slice"].bytes >= 4 * 1021
  assert moved["parameter copy"].count == 0
