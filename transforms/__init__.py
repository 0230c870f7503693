"""Turning a jaxpr and its `Plan` into programs (DESIGN.md §3).

Modules, one concern each:
  interpret  the one eval_jaxpr-style loop (env, literals, a per-equation hook) they all run on
  inline     calls inlined, all-reduces hoisted out of remat, scan and cond, for the analysis
  rewrite    the evaluate-and-retrace interpreter emitting the sharded step
  programs   the shard_state / step / unshard_state programs (§4.2)
  layout     `ShardedLayout`: where a tensor kept sharded lies (format, axes, spec, mesh, groups)
  groups     sharding groups of G consecutive replicas of one axis, on a derived mesh (§5.2)
  gc_pause   Python's cyclic GC paused while wus traces
"""
