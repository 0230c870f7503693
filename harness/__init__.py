"""Training harness: the console commands, their models, data, training loop and reports.

Packages, one concern each (each console command is a `console.Command`):
  training    `wus-train`: flags -> RunConfig, the loop, steps, optimizers, checkpoints, logs
  models      the models with their losses and metrics: Transformer LM, ResNets, MLPs
  data        data sources, byte-level text, global batches per process
  tools       measured reports (`report`), `wus-memory`, `wus-scale`, `wus-bench` (`bench/`)
Modules:
  console     the one entry point every console command shares (`Command`)
  errors      the one-line InputError
"""
