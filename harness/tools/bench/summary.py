"""What `wus-bench` prints of its measurements: a table per regime, the limit, the cost
model's predictions beside the measured times, and the targets met or not."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from wus.analysis import costmodel, network, sizing
from wus.harness.tools import paper_model, report
from wus.harness.tools.bench import choices, compose, limit
from wus.harness.tools.bench.variants import (ALTERNATIVES, JIT_ALTERNATIVES, VARIANTS,
                                              group_size)

MIB = 2 ** 20

# Targets of issues 5 and 22, checked on the measurements of one run.
TIME_RATIO = 1.0         # wus / each alternative (and donated / undonated), median step time
STATE_TOLERANCE = 0.01   # |opt state per device / (V/N) - 1|
BF16_WIRE_RATIO = 0.76   # wus / replicated collective bytes, bf16 weight gather
ANALYSIS_FRACTION = 0.1  # (analysis + rewrite) / XLA compile time of the wus step
LIMIT_RATIO = 1.05       # wus / the sum of its parts timed alone (`limit`)
COMPILE_RATIO = 1.2      # XLA compile time, wus / replicated
# Regimes whose wus step is compared with its parts alone and the alternatives.
LIMIT_REGIMES = ("weight-update-bound", "many-small-tensors")


def paired_ratio(a: Sequence[float], b: Sequence[float]) -> float:
  """The median over rounds of a[r] / b[r]: two variants timed in the same round share its
  load, so their ratio is steadier than the ratio of their medians."""
  return statistics.median(x / y for x, y in zip(a, b, strict=True))


def limit_of(result: dict) -> dict | None:
  """The limit of a regime whose parts were timed (seconds per update), or None.

  Returns:
    {"rest", "collectives", "update": medians of the parts alone, "total":
    their sum, "rounds": the sum of the parts in each round}.
  """
  if not result.get("collectives_seconds"):
    return None
  parts = {k: statistics.median(result[f"{k}_seconds"]) for k in ("rest", "collectives", "update")}
  rounds = [sum(t) for t in zip(*(result[f"{k}_seconds"] for k in parts), strict=True)]
  return {**parts, "total": sum(parts.values()), "rounds": rounds}


def breakdown(result: dict) -> dict | None:
  """wus's step time by its parts (seconds per update, medians over the rounds of each
  round's figure), or None without the parts or the Plan's batching timed alone.

  Returns:
    {"wus": its step, "rest": forward and backward, "collectives": the reduce-scatters
    and all-gathers as the Plan batches them, alone, "flat": one flat pair of the same
    bytes, "update": the optimizer on each tensor's shard, "flat_update": on one flat
    shard, "unaccounted": the step less rest, collectives and update, "donation": the
    donated step less the undonated one (part of the unaccounted; None without the
    undonated variant)}.
  """
  bound = limit_of(result)
  if (bound is None or not result.get("update_per_tensor_seconds")
      or "plan" not in result.get("choices", {})):
    return None
  step, plan = result["wus"]["step_seconds"], result["choices"]["plan"]["seconds"]
  update = result["update_per_tensor_seconds"]
  rounds = zip(step, result["rest_seconds"], plan, update, strict=True)
  undonated = result.get("wus_undonated", {}).get("step_seconds")
  return {"wus": statistics.median(step), "rest": bound["rest"],
          "collectives": statistics.median(plan), "flat": bound["collectives"],
          "update": statistics.median(update), "flat_update": bound["update"],
          "unaccounted": statistics.median(t - a - c - u for t, a, c, u in rounds),
          "donation": None if undonated is None else statistics.median(
              a - b for a, b in zip(step, undonated, strict=True))}


def predict(result: dict, topology: network.Topology) -> dict | None:
  """The cost model's step time of each of a regime's replicated and wus variants
  (seconds per update).

  Fed this machine's measured costs (`calibrate.measure`) and the measured
  median of the forward and backward pass alone as "rest"; nothing is fitted
  to the step times it is compared with. Adam, sharded G ways (`wus`: G = N;
  `wus_gG`: groups of G, §5.2), the collectives batched as each wus step
  batches them (its Plan's `bucket_bytes` and `alone_bytes`).

  Returns:
    {variant: StepPrediction} for "replicated" and every wus variant of one
    sharding group size ("wus", "wus_gG"), or None for a regime with several
    updates per call (no "rest" measured).
  """
  sizes = {v: result["num_devices"] if v == "wus" else group_size(v)
           for v in result["variants"] if v == "wus" or group_size(v)}
  if not result.get("rest_seconds") or not sizes:
    return None
  workload = paper_model.workload(result["tensor_elements"], "adam")
  rest = statistics.median(result["rest_seconds"])
  bucket = result[next(iter(sizes))]["bucket_bytes"]
  out = {"replicated": costmodel.predict_replicated(workload, topology, rest, bucket)}
  for v, g in sizes.items():
    out[v] = costmodel.predict_sharded(workload, topology, g, rest, result[v]["bucket_bytes"],
                                       result[v].get("alone_bytes"))
  return out


def group_size_choice(result: dict, topology: network.Topology,
                      p: dict | None = None) -> str | None:
  """The sharding group size the cost model predicts fastest beside the one measured
  fastest, among a regime's partial-sharding variants (issue 30), or None.

  `p`: the regime's `predict(result, topology)`, if already made."""
  p = p if p is not None else predict(result, topology)
  sizes = {v: group_size(v) for v in result["variants"] if group_size(v)}
  if not p or not sizes:
    return None
  workload = paper_model.workload(result["tensor_elements"], "adam")
  best = sizing.best_sharded(workload, topology, p["replicated"].rest)
  fastest = min(sizes, key=lambda v: result[v]["median"])
  predicted = min(sizes, key=lambda v: p[v].with_copies)
  return (f"{result['regime']}: of G = {sorted(sizes.values())}, predicted fastest "
          f"G={sizes[predicted]}, measured fastest G={sizes[fastest]}; "
          f"shard_group_size='auto' on these costs: G={best.group_size} of "
          f"{result['num_devices']}")


def prediction_markdown(results: list[dict], topology: network.Topology, raw: dict) -> str:
  """Predicted beside measured, per regime with one update per call and per variant."""
  axis = topology.axes[0]
  (d0, t0), (d1, t1) = raw["all_reduce"]
  chain = raw["chain"]
  rows, choices_made = [], []
  for r in results:
    p = predict(r, topology)
    if p is None:
      continue
    for v, x in p.items():
      sharded = v != "replicated"
      rows.append([r["regime"], v, 1e3 * r[v]["median"], 1e3 * x.with_copies,
                   1e3 * x.rest, 1e3 * (x.communication + x.copies), 1e3 * x.update,
                   x.with_copies / p["replicated"].total if sharded else "-",
                   r[v]["median"] / r["replicated"]["median"] if sharded else "-"])
    if line := group_size_choice(r, topology, p):
      choices_made.append(line)
  return "\n\n".join([
      "### Cost model: predicted beside measured",
      f"This machine, measured before the regimes ran: all-reduce over {axis.size} devices of "
      f"{d0} B in {1e3 * t0:.3f} ms and {d1} B in {1e3 * t1:.3f} ms (each its own program), "
      f"{chain[0]} dependent ones of {d0} B in one program in {1e3 * chain[1]:.3f} ms, i.e. "
      f"alpha {1e6 * axis.alpha:.1f} us per ring step inside a program and "
      f"{axis.bandwidth / 1e9:.2f} GB/s per "
      f"device; memory {topology.memory_bandwidth / 1e9:.2f} GB/s per device (all devices "
      "busy). \"rest\" is the measured forward and backward pass alone; the model adds "
      "collectives and the update to it (`wus.analysis.costmodel`, nothing fitted to "
      "the step times).",
      report.table(["regime", "variant", "measured ms", "predicted ms", "rest ms",
                    "collectives + copies ms (pred.)", "update ms (pred.)",
                    "/replicated predicted",
                    "/replicated measured"], rows),
      *(["Sharding group size: " + "; ".join(choices_made)] if choices_made else [])])


def targets(results: list[dict]) -> list[tuple[str, bool | None, str]]:
  """The targets of issues 5 and 22 on measured results: (target, met or None if not
  measured, detail)."""
  rows = []
  for r in results:
    name = r["regime"]
    for v in r.get("variants", ()):
      if (g := group_size(v)) is None:
        continue
      share = r[v]["opt_state_per_device"] * g / r["opt_state_bytes"]
      rows.append((f"{name}: {v} optimizer state per device within {STATE_TOLERANCE:.0%} of V/G",
                   abs(share - 1) <= STATE_TOLERANCE, f"{share:.4f} x V/{g}"))
      wire = r[v]["wire_bytes"] / r["replicated"]["wire_bytes"]
      rows.append((f"{name}: {v} collective bytes <= replicated all-reduce's (§5.2)", wire <= 1,
                   f"ratio {wire:.4f}"))
    rows += _jit_targets(r)
    if "wus" not in r:
      continue
    ws = r["wus"]
    if name in LIMIT_REGIMES:
      for alt in (a for a in ALTERNATIVES if a in r):
        ratio = paired_ratio(ws["step_seconds"], r[alt]["step_seconds"])
        rows.append((f"{name}: wus step time <= {alt}'s (median of per-round ratios)",
                     ratio <= TIME_RATIO, f"ratio {ratio:.3f}"))
      rows += _copy_free_targets(r)
    share = ws["opt_state_per_device"] * r["num_devices"] / r["opt_state_bytes"]
    rows.append((f"{name}: optimizer state per device within {STATE_TOLERANCE:.0%} of V/N",
                 abs(share - 1) <= STATE_TOLERANCE, f"{share:.4f} x V/N"))
    wire = ws["wire_bytes"] / r["replicated"]["wire_bytes"]
    if r["steps_per_call"] > 1:
      # Per step of the loop; what is gathered once after it is amortized over
      # the loop's steps (§4.2), and shown in the regime's table.
      wire = ws["loop_wire_bytes"] / r["replicated"]["loop_wire_bytes"]
      rows.append((f"{name}: collective bytes per step in the loop <= {BF16_WIRE_RATIO:.0%} of "
                   "replicated (bfloat16 weight all-gather)", wire <= BF16_WIRE_RATIO,
                   f"ratio {wire:.3f}"))
    else:
      rows.append((f"{name}: collective bytes <= replicated all-reduce's", wire <= 1,
                   f"ratio {wire:.4f}"))
    fraction = (ws["analysis_seconds"] + ws["rewrite_seconds"]) / ws["compile_seconds"]
    rows.append((f"{name}: wus analysis + rewrite < {ANALYSIS_FRACTION:.0%} of XLA compile time",
                 fraction < ANALYSIS_FRACTION, f"{fraction:.1%}"))
  return rows


def _jit_targets(r: dict) -> list[tuple[str, bool | None, str]]:
  """Issue 20's targets of a regime with the `jax.jit` user's variants."""
  if "wus_jit" not in r:
    return []
  name, wj, rows = r["regime"], r["wus_jit"], []
  for alt in (a for a in JIT_ALTERNATIVES if a in r):
    ratio = paired_ratio(wj["step_seconds"], r[alt]["step_seconds"])
    rows.append((f"{name}: wus_jit step time <= {alt}'s (median of per-round ratios)",
                 ratio <= TIME_RATIO, f"ratio {ratio:.3f}"))
  share = wj["opt_state_per_device"] * r["num_devices"] / r["opt_state_bytes"]
  rows.append((f"{name}: wus_jit optimizer state per device within {STATE_TOLERANCE:.0%} of "
               "V/N", abs(share - 1) <= STATE_TOLERANCE, f"{share:.4f} x V/N"))
  return rows


def jit_markdown(r: dict) -> str:
  """The `jax.jit` user's variants side by side: wus_jit's step time over each, state / (V/N)."""
  names = [v for v in (*JIT_ALTERNATIVES, "wus_jit") if v in r]
  if "wus_jit" not in names:
    return ""
  per = r["opt_state_bytes"] / r["num_devices"]
  rows = [[v, 1e3 * r[v]["median"], paired_ratio(r["wus_jit"]["step_seconds"],
                                                  r[v]["step_seconds"]),
           r[v]["opt_state_per_device"] / per, r[v]["moves"]["copy"]["bytes"] / MIB,
           r[v]["compile_cpu_seconds"]] for v in names]
  return "\n\n".join([
      "For a `jax.jit` user (the step on global arrays, the batch on P(\"data\")):",
      report.table(["variant", "median ms/update", "wus_jit / it (per-round ratio, median)",
                    "opt state / (V/N)", "HLO copy MiB", "XLA compile CPU s"], rows)])


def _copy_free_targets(r: dict) -> list[tuple[str, bool | None, str]]:
  """Issue 22's targets of a regime: at the limit, donation no slower, no weight copied."""
  name, ws, rows = r["regime"], r["wus"], []
  bound = limit_of(r)
  if bound is not None:
    ratio = paired_ratio(ws["step_seconds"], bound["rounds"])
    medians = ws["median"] / bound["total"]
    rows.append((f"{name}: wus / limit (the parts timed alone) <= {LIMIT_RATIO}",
                 ratio <= LIMIT_RATIO, f"ratio {ratio:.3f} (of the medians: {medians:.3f})"))
    if r.get("sequence_seconds"):
      ratio = paired_ratio(ws["step_seconds"], r["sequence_seconds"])
      rows.append((f"{name}: wus / the limit's parts run back to back <= {LIMIT_RATIO}",
                   ratio <= LIMIT_RATIO, f"ratio {ratio:.3f}"))
    if (c := compose.composition(r)) is not None:
      rows.append((f"{name}: wus / the limit in one program <= {LIMIT_RATIO}",
                   c["wus_over_step"] <= LIMIT_RATIO, f"ratio {c['wus_over_step']:.3f}"))
  if "wus_undonated" in r:
    ratio = paired_ratio(ws["step_seconds"], r["wus_undonated"]["step_seconds"])
    rows.append((f"{name}: wus with the state donated no slower than without",
                 ratio <= TIME_RATIO, f"ratio {ratio:.3f}"))
  copies = ws["moves"]["parameter copy"]
  rows.append((f"{name}: the compiled wus step copies no parameter", copies["count"] == 0,
               f"{copies['count']} copies, {copies['bytes'] / MIB:.3g} MiB"))
  ratio = ws["compile_cpu_seconds"] / r["replicated"]["compile_cpu_seconds"]
  wall = ws["compile_seconds"] / r["replicated"]["compile_seconds"]
  rows.append((f"{name}: XLA compile time (CPU seconds), wus / replicated <= {COMPILE_RATIO}",
               ratio <= COMPILE_RATIO, f"ratio {ratio:.3f} (wall clock {wall:.3f})"))
  return rows


def choices_markdown(r: dict) -> str:
  """The Plan's batching beside the two extremes, each predicted and measured (`choices`)."""
  if "choices" not in r:
    return ""
  rows = choices.rows(r)
  best = min(rows, key=lambda row: row[3])[0]
  picked = min(rows, key=lambda row: row[2])[0]
  return "\n\n".join([
      "Batching of wus's reduce-scatters and all-gathers, each alone as a program of those "
      "collectives (`choices`): the cost model's prediction for the topology wus planned with "
      f"beside the measured median. Predicted fastest: {picked}; measured fastest: {best}.",
      report.table(["batching", "collectives each way", "predicted ms", "measured ms",
                    "measured / predicted"], rows)])


def limit_markdown(r: dict) -> str:
  """The regime's limit (its parts timed alone) beside wus, and wus's data movement."""
  bound = limit_of(r)
  if bound is None:
    return ""
  moved = lambda v, k: r[v]["moves"][k]["bytes"] / MIB  # noqa: E731
  flat = 4 * limit.flat_elements(r["tensor_elements"], r["num_devices"]) / MIB
  lines = [f"Limit: forward and backward {1e3 * bound['rest']:.2f} ms + one reduce-scatter and "
           f"one all-gather of {flat:.3g} MiB {1e3 * bound['collectives']:.2f} ms + Adam on a "
           f"1/{r['num_devices']} shard "
           f"{1e3 * bound['update']:.2f} ms = {1e3 * bound['total']:.2f} ms (medians of the same "
           "rounds)."]
  rows = [[v, paired_ratio(r[v]["step_seconds"], bound["rounds"]), moved(v, "copy"),
           moved(v, "concatenate"), moved(v, "slice"), r[v]["moves"]["parameter copy"]["count"],
           r[v]["compile_cpu_seconds"]]
          for v in r["variants"]]
  lines.append(report.table(["variant", "/ limit (per-round ratio, median)", "HLO copy MiB",
                             "concatenate MiB", "slice MiB", "parameter copies",
                             "XLA compile CPU s"], rows))
  if "buckets" in r.get("wus", {}):
    lines.append(f"wus plan: {r['wus']['buckets']}.")
  if r.get("sequence_seconds"):
    back = statistics.median(r["sequence_seconds"])
    lines.append(
        f"The same three parts back to back, each its own program run after the other: "
        f"{1e3 * back:.2f} ms, {paired_ratio(r['sequence_seconds'], bound['rounds']):.3f} x "
        "their sum alone (per-round ratio, median): what a part costs more after other work "
        "than after itself, which a step of the parts pays too.")
  if text := compose.markdown(r):
    lines.append(text)
  if (parts := breakdown(r)) is not None:
    ms = {k: 1e3 * v for k, v in parts.items() if v is not None}
    donation = ("" if parts["donation"] is None else
                f"; the donated step less the undonated one: {ms['donation']:.2f} ms")
    lines.append(
        f"wus's {ms['wus']:.2f} ms by its parts (medians of each round's figure): forward and "
        f"backward {ms['rest']:.2f} + its collectives as the Plan batches them, alone "
        f"{ms['collectives']:.2f} ({ms['collectives'] - ms['flat']:+.2f} against one flat "
        f"pair) + Adam on each tensor's shard {ms['update']:.2f} "
        f"({ms['update'] - ms['flat_update']:+.2f} against one flat shard) + unaccounted "
        f"{ms['unaccounted']:.2f} ms ({ms['unaccounted'] / ms['wus']:.1%}: scheduling, "
        f"dispatch, the parts' overlap){donation}.")
  return "\n\n".join(lines)


def markdown(results: list[dict]) -> str:
  """The benchmark as Markdown: one table per regime, then the targets."""
  parts = []
  for r in results:
    names = r.get("variants") or [v for v in VARIANTS if v in r]
    alternatives = [v for v in names if v in ALTERNATIVES or v == "replicated"]
    best = min(alternatives, key=lambda v: r[v]["median"])
    rows = []
    for v in names:
      m = r[v]
      rows.append([v, 1e3 * m["median"], f"{1e3 * m['min']:.2f}-{1e3 * m['max']:.2f}",
                   m.get("page_faults", "-"), m["median"] / r["replicated"]["median"],
                   m["median"] / r[best]["median"] if v == "wus" else "-",
                   m["memory"]["total"] / MIB, m["opt_state_per_device"] / MIB,
                   m["wire_bytes"] / MIB, m["compile_seconds"], m["max_param_difference"]])
    parts += [f"### {r['regime']}: {r['model']} + Adam, N={r['num_devices']}, "
              f"{r['batch_size']} examples per replica per update"
              + (f", {r['steps_per_call']} updates per call" if r["steps_per_call"] > 1 else "")
              + f"; {len(r['replicated']['step_seconds'])} timed calls per variant",
              report.table(["variant", "median ms/update", "min-max ms",
                            "minor page faults/call (median)", "/ replicated",
                            f"/ best alternative ({best})", "memory MiB/device",
                            "opt state MiB/device", "collective wire MiB/update",
                            "XLA compile s",
                            "max |Δ params| vs replicated"], rows)]
    parts += [text for text in (limit_markdown(r), choices_markdown(r), jit_markdown(r))
              if text]
    parts += [f"{v} analysis {r[v]['analysis_seconds']:.3f} s + rewrite "
              f"{r[v]['rewrite_seconds']:.3f} s, beside XLA's compile of the {v} step "
              f"{r[v]['compile_seconds']:.2f} s." for v in names if "analysis_seconds" in r[v]]
    if r["steps_per_call"] > 1:
      parts.append("Collective wire MiB per update inside the loop: " + ", ".join(
          f"{v} {r[v]['loop_wire_bytes'] / MIB:.3f}" for v in names) + " (the table's column "
          "adds what is gathered once per call after the loop, spread over its updates).")
  parts += ["### Targets", report.table(
      ["target", "", "measured"],
      [[t, {True: "met", False: "NOT MET", None: "-"}[ok], d] for t, ok, d in targets(results)])]
  return "\n\n".join(parts)
