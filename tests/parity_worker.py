"""Runs the unmodified step and wus on the same inputs under XLA's default flags.

As a script, in a process that `test_parity.py` starts with XLA_FLAGS set to
the device count alone: no `--xla_cpu_max_isa=AVX` (XLA may contract
`a * b + c` into a fused multiply-add, differently in the two programs) and no
`--xla_allow_excess_precision=false` (tests/conftest.py sets both for every
other test). Adam over the params of `helpers.make_params` for three steps;
the two results must agree within a few ulps. Exits non-zero, with the
difference, if they do not.
"""

from __future__ import annotations

import os
import sys

DEVICES = 8
FLAGS = f"--xla_force_host_platform_device_count={DEVICES}"  # The only flag.
# Within a few float32 ulps of the values (|param| ~ 0.1, ulp ~ 7e-9).
RTOL, ATOL = 1e-6, 1e-7


def main() -> None:
  if os.environ.get("XLA_FLAGS") != FLAGS:
    sys.exit(f"XLA_FLAGS must be {FLAGS!r} alone, got {os.environ.get('XLA_FLAGS')!r}")
  import jax  # noqa: PLC0415
  import optax  # noqa: PLC0415

  import wus  # noqa: PLC0415
  from helpers import assert_trees_equal, both, mesh  # noqa: PLC0415

  assert jax.device_count() == DEVICES, jax.devices()
  ref, got, _ = both(optax.adam(1e-2), mesh())
  assert_trees_equal(ref[0], got[0], rtol=RTOL, atol=ATOL)
  assert_trees_equal(ref[1], wus.unshard(got[1]), rtol=RTOL, atol=ATOL)
  assert_trees_equal(ref[3], got[3], rtol=RTOL, atol=ATOL)


if __name__ == "__main__":
  main()
