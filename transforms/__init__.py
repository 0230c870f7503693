"""Turning a jaxpr and its `Plan` into programs (DESIGN.md §3).

Modules, one concern each:
  interpret    the one eval_jaxpr-style loop (env, literals, a per-equation hook) they all run on
  inline       calls inlined, all-reduces hoisted out of remat, scan and cond, for the analysis
  cond_parts   a `cond` split into its independent parts (MultiSteps around FSDP weights)
  values       each value of the rewritten step whole, as shards, or both, made on demand
  schedule     the order the rewrite runs equations in, so waiting sums batch (§5.2)
  rewrite      the evaluate-and-retrace interpreter emitting the sharded step
  owned        owned updates: rows in, a switch on the replica index, rows out
  programs     the shard_state / step / unshard_state programs (§4.2)
  layout       `ShardedLayout`: where a tensor kept sharded lies (format, axes, spec, mesh, groups)
  groups       sharding groups of G consecutive replicas of one axis, on a derived mesh (§5.2)
  global_view  a `jax.jit` step's program: the forward and backward pass, then the region
  model_local  one equation of the region on model blocks
  gc_pause     Python's cyclic GC paused while wus traces
"""
