"""Facts about a step's jaxpr, no rewriting (DESIGN.md §3).

Modules, one concern each, in the order the passes run:
  compat         the one place that touches JAX internals (cond / while / scan records)
  primitives     the facts every pass reads about a primitive, one table
  rules          rule tables filled by decorators at the rules (`registrar`)
  graph          one jaxpr's producers, readers, outputs and big values, built once
  redundancy     which values are identical on every replica (§3.1)
  dims           which dims an equation joins, sums or needs whole (GSPMD's rules, one table)
  dims_indexing  the dims rules of the primitives that index along a dim (slices, gathers)
  region_dims    the dims of a region's equations, its conditionals' branches included
  propagation    a `jax.jit` step's batch splits, carried from its placements; gradient sums
  global_view    a `jax.jit` step's update region: its sums and the update after them
  model_splits   which dims of the region's values the model (and FSDP) axes split
  shardable      which equations can run on shards, and how (`Kind` and its `Traits`, §4.1)
  clusters       weight-update clusters around the gradient all-reduces (§3.2)
  reduction_joins  which cluster a reduction of big tensors to small values joins
  roots          the updates no all-reduce reaches, and state updates beside a cluster
  formats        `ShardFormat`: reshape, pad, split (§4.1, Fig. 6)
  layouts        a format for every tensor of a cluster
  cost           shard a cluster or not, with the reason and predicted times (§3.2)
  costmodel      alpha-beta model of a step's or a cluster's collectives and update (§5)
  sizing         the model's choices: group size G, bucket limit, tensors alone (§5.2)
  network        the network in that model: mesh axes, ring collectives, batching
  verdicts       the cost model's verdicts on a cluster, as values
  reasons        why the Plan decides as it does, as values, and their words
  causes         what the reasons are built from: equations, splits, failed layouts
  refusals       why a front end runs a step, or part of its update, as JAX does, as values
  precision      which narrower float a sharded weight is read whole in (Fig. 7)
  loops          loop bodies and conditionals in the planner (§3.2, §4.2, Fig. 4)
  plan_cluster   the planner's decision for one cluster
  fsdp_blocks    FSDP blocks whose update copy axes repeat, sharded over those alone
  kept_state     the state a cluster keeps sharded between steps (§4.2)
  ownership      which updates can run whole on one replica each (Muon, Shampoo-like)
  owners         their predicted cost, the replica that owns each, and their rows
  divides        XLA:CPU's division rewrite, which owners reproduce to stay exact
  owned          ownership's types: rows, banks, formats and the Plan's part
  input_reasons  why each input is kept sharded or whole, by one stated precedence
  ordering       what the all-gathers of donated outputs follow (donation copies nothing)
  presliced      a region's stacked inputs read only as shards, taken split where computed
  planning       the planner's request (`PlanRequest`) and its stages' `PlanningContext`
  planner        `make_plan(request)`: the passes above over a step, frozen into a Plan
  plan_parts     the Plan's parts: tensors, clusters, inputs, a jaxpr's instructions, groups
  plan           the frozen, printable `Plan` the rewrite follows (the boundary)
"""
