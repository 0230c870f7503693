"""wus beside the hand-written per-tensor ZeRO with nothing else in the process (issue 42).

`wus-bench` times 6 variants and 10 parts in one process, and what one program costs
on XLA:CPU depends on what ran before it there (docs/measurements.md). This runs only
three of the bench's programs, built as the bench builds them (`variants.variant_steps`,
Adam, synthetic data, 8 simulated devices, one example per device): `handwritten`
(`zero.handwritten_step`), `wus` and `wus_undonated`, timed as the bench times them
(`timing.interleaved`: a new random order each round, each timed call after an untimed
one of the same program); `wus_alone`, wus with every unpadded tensor in a
collective of its own (the Plan's `alone_bytes` 1, set by wrapping
`wus.analysis.cost.bucket_bytes` while it plans: an experiment, no option of wus);
`wus_spanning`, wus with the bucket rule before issue 42's change (a tensor alone closes
no bucket, so one reduce-scatter may hold small gradients of every layer), and
`wus_closing`, the eleventh sitting's (a tensor alone closes the all-gathers' buckets
too), each set by forcing `closes` of `batched.buckets` where the collectives and the
model read it while it plans and traces; wus closes the reduce-scatters' buckets and
spans the all-gathers'. It prints each step's median and the medians over rounds of
the ratios.

  python tests/repro/wus_beside_handwritten.py [MODEL [ROUNDS]]

MODEL is a key of `tasks.MODELS` (default mlp_deep, the bench's weight-update-bound
model; transformer_mixed is its many-small-tensors one); ROUNDS defaults to 25.
"""

import os
import statistics
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8")

import jax  # noqa: E402

from wus.analysis import cost, network  # noqa: E402
from wus.collectives import batched  # noqa: E402
from wus.harness.tools.bench import regimes, summary, timing, variants  # noqa: E402
from wus.harness.training import steps  # noqa: E402


def main(model: str = "mlp_deep", rounds: int = 25) -> None:
  mesh = jax.make_mesh((8,), (steps.AXIS_NAME,))
  regime = variants.Regime("weight-update-bound", 1,
                           skip=("replicated", "gspmd_zero1", "handwritten_flat"))
  setting = regimes._setting(regime, model, rounds, mesh, seed=0)  # pylint: disable=protected-access
  built = variants.variant_steps(regime, setting.task, setting.tx, mesh, setting.state)

  def call(name):
    def run(r):
      out = built[name][0](*state[name], setting.data[r])
      jax.block_until_ready(out)
      state[name] = type(state[name])(*out[:3])
    return run

  chosen = cost.bucket_bytes

  def every_alone(*args, **kwargs):
    limit, _, words, made = chosen(*args, **kwargs)
    return limit, 1, words, made

  rule = batched.buckets

  def forced(closes):
    """`batched.buckets` with every tensor alone closing the bucket before it, or none."""
    def buckets(sizes, limit, alone_bytes=None, padded=(), _closes=True):
      return rule(sizes, limit, alone_bytes, padded, closes)
    return buckets

  state = {name: s for name, (_, s) in built.items()}
  for name, patches in (("wus_alone", ((cost, "bucket_bytes", every_alone),)),
                        ("wus_spanning", ((batched, "buckets", forced(False)),
                                          (network, "buckets", forced(False)))),
                        ("wus_closing", ((batched, "buckets", forced(True)),
                                         (network, "buckets", forced(True))))):
    saved = [(m, a, getattr(m, a)) for m, a, _ in patches]
    for m, a, f in patches:
      setattr(m, a, f)
    try:  # wus plans and traces at its first call.
      built[name] = (steps.map_train_step("wus", steps.make_train_step(
          setting.task, setting.tx), mesh), variants._copy(setting.state))  # pylint: disable=protected-access
      state[name] = built[name][1]
      call(name)(0)
    finally:
      for m, a, f in saved:
        setattr(m, a, f)

  for name in built:
    if name.startswith("wus"):
      plan = built[name][0].plan(*state[name], setting.data[0])
      # Counted in the compiled step: wus_alone's Plan words are the chosen plan's.
      hlo = built[name][0].lower(*state[name], setting.data[0]).compile().as_text()
      print(f"  {name}: buckets of {plan.bucket_bytes} B, alone from {plan.alone_bytes} B;"
            f" compiled: {hlo.count(' reduce-scatter(')} reduce-scatter(s),"
            f" {hlo.count(' all-gather(')} all-gather(s)")
  seconds = timing.interleaved({name: call(name) for name in built}, rounds)
  print(f"{model}, {rounds} rounds, JAX {jax.__version__}, load average "
        f"{os.getloadavg()[0]:.2f}")
  for name, t in seconds.items():
    print(f"  {name:14s} {1e3 * statistics.median(t):8.1f} ms")
  for a, b in (("wus", "handwritten"), ("wus", "wus_undonated"), ("wus_alone", "handwritten"),
               ("wus_alone", "wus"), ("wus_spanning", "handwritten"), ("wus", "wus_spanning"),
               ("wus", "wus_closing")):
    print(f"  {a} / {b}: {summary.paired_ratio(seconds[a], seconds[b]):.3f}")


if __name__ == "__main__":
  main(sys.argv[1] if len(sys.argv) > 1 else "mlp_deep",
       int(sys.argv[2]) if len(sys.argv) > 2 else 25)
