"""What the trainer runners share: running each variant of a trainer in a fresh process,
measuring what it left behind, and printing the runs side by side.

A runner (`run_maxtext.py`, `run_levanter.py`) runs the trainer's own train loop once per
variant ("jax": unmodified; "wus": the one documented line swapped for wus; others the
trainer's own options), each in a new process of the same Python (its JIT caches, global
configuration and memory its own), on 8 simulated CPU devices. Each child writes one JSON
record (`Record`); the parent prints them side by side and writes them all to `--json`.

This module imports neither JAX nor the trainers at import time: the parent process only
starts children and reads what they wrote.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable, Sequence

DEVICES = 8


def cpu_devices(n: int = DEVICES) -> None:
  """Sets up `n` simulated CPU devices; call before JAX is imported."""
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")


def bytes_per_device(leaves: Sequence) -> int:
  """The most bytes any device holds of `leaves`, from the arrays' own shards (a
  `wus.ShardedArray` by its padded data); 0 for none."""
  per_device: dict = {}
  for x in leaves:
    data = getattr(x, "data", x)  # wus.ShardedArray: its padded, sharded array.
    for shard in getattr(data, "addressable_shards", ()):
      per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
  return max(per_device.values(), default=0)


def whole_bytes(leaves: Sequence) -> int:
  """The bytes of one whole copy of `leaves` (logical shapes)."""
  return sum(math.prod(x.shape) * x.dtype.itemsize for x in leaves)


def run_children(script: str, variants: Sequence[str], argv: Sequence[str],
                 rounds: int = 1) -> dict:
  """Runs `script --variant V --out FILE *argv` for each variant, one at a time, each in a
  new process of this Python; {variant: its record}. A child that fails is recorded with
  its return code and the end of what it printed. With `rounds` > 1 the variants run that
  many times, each round starting one variant later (jax, wus, zero1; wus, zero1, jax;
  ...), so that a slower spell of a shared machine falls on each in turn: the first
  round's records are kept, and each record's `round_medians` holds its median step time
  of every round."""
  records: dict = {}
  with tempfile.TemporaryDirectory(prefix="wus-trainer-") as tmp:
    for r in range(rounds):
      for v in [*variants[r % len(variants):], *variants[:r % len(variants)]]:
        record = _run_child(script, v, argv, tmp)
        records.setdefault(v, record).setdefault("round_medians", [])
        if "error" not in record:
          records[v]["round_medians"].append(round(median_step(record["step_times"]), 4))
  return records


def _run_child(script: str, variant: str, argv: Sequence[str], tmp: str) -> dict:
  """One child's record (or its failure), with its wall time."""
  out = os.path.join(tmp, f"{variant}.json")
  start = time.perf_counter()
  proc = subprocess.run([sys.executable, script, "--variant", variant, "--out", out, *argv],
                        capture_output=True, text=True, cwd=tmp, check=False)
  if proc.returncode == 0 and os.path.exists(out):
    with open(out, encoding="utf8") as f:
      record = json.load(f)
    os.remove(out)
  else:
    record = {"error": proc.returncode, "output": (proc.stdout + proc.stderr)[-6000:]}
  record["wall_seconds"] = round(time.perf_counter() - start, 1)
  return record


def relative_difference(a: Sequence[float], b: Sequence[float]) -> float:
  """max |a - b| / max(|a|, tiny) over the steps; inf where the lengths differ."""
  if len(a) != len(b) or not a:
    return math.inf
  return max(abs(x - y) / max(abs(x), 1e-30) for x, y in zip(a, b, strict=True))


def median_step(times: Sequence[float], skip: int = 2) -> float:
  """The median step time after the first `skip` steps (compilation)."""
  rest = list(times[skip:]) or list(times)
  return statistics.median(rest) if rest else math.nan


def compiled_summary(lowered, hlo_path: str | None = None) -> str | None:
  """The compiled step's collectives and data movement, from its optimized HLO (per
  device: count / MiB), or None if the step was not lowered by the trainer. With
  `hlo_path`, the optimized HLO is also written there."""
  if lowered is None:
    return None
  from wus.harness.tools import report as hlo  # noqa: PLC0415 -- after the device flags
  text = lowered.compile().as_text()
  if hlo_path:
    os.makedirs(os.path.dirname(hlo_path), exist_ok=True)
    with open(hlo_path, "w", encoding="utf8") as f:
      f.write(text)
  parts = [f"{k} {c.count} / {c.bytes / 2**20:.3g}"
           for k, c in sorted(hlo.collectives(text).items()) if c.count]
  parts += [f"{k} {m.count} / {m.bytes / 2**20:.3g}"
            for k, m in sorted(hlo.data_movement(text).items()) if m.count]
  return ", ".join(parts) + " (count / MiB per device)"


def report(title: str, records: dict, base: str = "jax") -> str:
  """The runs side by side: losses per step, optimizer state per device, step times."""
  lines = [title]
  ok = {k: r for k, r in records.items() if "error" not in r}
  for k, r in records.items():
    if "error" in r:
      lines.append(f"  {k}: FAILED (exit {r['error']}):\n{r['output']}")
  if not ok:
    return "\n".join(lines)
  names = list(ok)
  steps = max(len(r["losses"]) for r in ok.values())
  lines.append("  step  " + "".join(f"{n + ' loss':>22}" for n in names))
  for s in range(steps):
    row = "".join(f"{r['losses'][s]:>22.9g}" if s < len(r["losses"]) else f"{'-':>22}"
                  for r in ok.values())
    lines.append(f"  {s:>4}  {row}")
  for n, r in ok.items():
    if n == base or base not in ok:
      continue
    lines.append(f"  {n} vs {base}: losses max relative difference "
                 f"{relative_difference(ok[base]['losses'], r['losses']):.3g}"
                 + (f", final parameters max |diff| {r['param_diff']:.3g}"
                    if r.get("param_diff") is not None else ""))
  lines.append("  optimizer state per device (B), whole copy (B), fraction of a copy, "
               "median step time (s, after 2), wall (s):")
  for n, r in ok.items():
    frac = r["opt_bytes_per_device"] / r["opt_bytes_whole"] if r["opt_bytes_whole"] else 0
    lines.append(f"    {n:>8}: {r['opt_bytes_per_device']:>12,} {r['opt_bytes_whole']:>12,} "
                 f"{frac:>8.4f} {median_step(r['step_times']):>10.4f} {r['wall_seconds']:>8}")
  if any(len(r.get("round_medians", ())) > 1 for r in ok.values()):
    lines.append("  median step time (s) of each round, in the order the rounds ran:")
    lines += [f"    {n:>8}: {' '.join(f'{t:.4f}' for t in r['round_medians'])}"
              for n, r in ok.items()]
  for n, r in ok.items():
    if r.get("plan"):
      lines.append(f"  {n}'s Plan: {r['plan']}")
    if r.get("compiled"):
      lines.append(f"  {n}'s compiled step: {r['compiled']}")
    if r.get("state_matched"):
      lines.append(f"  {n}'s state: {r['state_matched']}")
  return "\n".join(lines)


def param_differences(records: dict, base: str = "jax") -> None:
  """Adds to each record `param_diff`: max |diff| of its final parameters from `base`'s
  (each child saved them as .npz beside its record)."""
  import numpy as np  # noqa: PLC0415 -- the parent imports NumPy only here
  if base not in records or "params" not in records[base]:
    return
  ref = np.load(records[base]["params"])
  for r in records.values():
    if "params" in r:
      got = np.load(r["params"])
      r["param_diff"] = float(max((np.max(np.abs(ref[k] - got[k])) for k in ref.files),
                                  default=0.0))


def main(script: str, variants_of: Callable[[argparse.Namespace], Sequence[str]],
         child: Callable[[argparse.Namespace], dict], add_arguments: Callable) -> int:
  """The runner's command line: as the parent, runs every variant and prints them side by
  side (`--json`: all the records too); as a child (`--variant`), runs one."""
  parser = argparse.ArgumentParser(description=sys.modules["__main__"].__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  add_arguments(parser)
  parser.add_argument("--steps", type=int, default=6)
  parser.add_argument("--json", help="write every run's record here")
  parser.add_argument("--rounds", type=int, default=1,
                      help="run the variants this many times, interleaved, for step times")
  parser.add_argument("--variant", help=argparse.SUPPRESS)
  parser.add_argument("--out", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.variant:
    record = child(args)
    with open(args.out, "w", encoding="utf8") as f:
      json.dump(record, f)
    return 0
  argv = sys.argv[1:]  # The children read what they need (not --json).
  with tempfile.TemporaryDirectory(prefix="wus-params-") as keep:
    os.environ["WUS_TRAINER_PARAMS_DIR"] = keep
    os.environ["WUS_TRAINER_CWD"] = os.getcwd()  # Children run elsewhere: for their paths.
    records = run_children(script, variants_of(args), argv, args.rounds)
    param_differences(records)
  print(report(f"{os.path.basename(script)} {' '.join(argv)}", records), flush=True)
  if args.json:
    with open(args.json, "w", encoding="utf8") as f:
      json.dump(records, f, indent=1)
  return 0 if all("error" not in r for r in records.values()) else 1


def save_params(name: str, arrays: dict) -> str:
  """Saves a child's final parameters (whole, as NumPy) for the parent to compare."""
  import numpy as np  # noqa: PLC0415
  path = os.path.join(os.environ.get("WUS_TRAINER_PARAMS_DIR", tempfile.gettempdir()),
                      f"{name}-params.npz")
  np.savez(path, **arrays)
  return path


def whole(x):
  """A state leaf as one whole NumPy array (a `wus.ShardedArray` gathered)."""
  import numpy as np  # noqa: PLC0415
  if type(x).__name__ == "ShardedArray":
    import wus  # noqa: PLC0415
    x = wus.unshard(x)
  return np.asarray(x)


def plan_summary(plan) -> str | None:
  """A line for wus's Plan of the step: how many clusters it shards, or why it runs
  unchanged; None for the unmodified run."""
  if plan is None:
    return None
  if plan.unchanged:
    return f"runs unchanged: {plan.unchanged}"
  return "; ".join(line.strip() for line in str(plan).splitlines()[:3])


def variant_jit(variant: str):
  """The jit a run swaps in at the trainer's one line: `wus.jit` for "wus", else `jax.jit`."""
  if variant == "wus":
    import wus  # noqa: PLC0415
    return wus.jit
  import jax  # noqa: PLC0415
  return jax.jit


def swap_jit(module, jit, called_from: Callable, wrap: Callable) -> list:
  """`module.jax.jit`, called from code `called_from(code)` accepts, becomes `wrap(jit(...))`:
  the trainer's one line. `module.jax` becomes a stand-in for the jax module whose `jit` is
  `jax.jit` everywhere else and every other name jax's; no file of the trainer changes.
  Returns the steps it made (wrapped)."""
  real, made = module.jax, []

  class Jax(types.ModuleType):
    def __getattr__(self, name):
      return getattr(real, name)

  def swapped(*args, **kwargs):
    if not called_from(sys._getframe(1).f_code):
      return real.jit(*args, **kwargs)
    made.append(wrap(jit(*args, **kwargs)))
    return made[-1]
  stand_in = Jax("jax")
  stand_in.jit = swapped
  module.jax = stand_in
  return made
