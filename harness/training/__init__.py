"""`wus-train`: training a model replicated and with wus, compared (`train`).

Modules, one concern each:
  cli         flags -> RunConfig; JAX set-up (devices, processes)
  config      RunConfig and each model's defaults
  train       the `wus-train` command: runs each mode, prints the comparison
  loop        resume, train, evaluate, checkpoint, measure
  steps       the per-replica train / eval steps, mapped by jax or by wus
  optim       LARS and Adam with their schedules (optax)
  checkpoint  Orbax checkpoints of sharded state
  logs        progress bar, JSON-lines metrics, TensorBoard
  figure      the run's picture: the modes' loss curves and each device's memory
"""
