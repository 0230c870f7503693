"""Training harness: the `wus-train` CLI, its models, data, loop, checkpoints and reports.

Modules, one concern each:
  cli         flags -> RunConfig; JAX set-up (devices, processes)
  config      RunConfig and each model's defaults
  train       the `wus-train` main: runs each mode, prints the comparison
  loop        resume, train, evaluate, checkpoint, measure
  steps       the per-replica train / eval steps, mapped by jax or by wus
  tasks       the models with their losses and metrics
  resnet      ResNets (Flax ImageNet example), batch norm across replicas
  models      the byte-level Transformer LM (Flax lm1b / WMT examples)
  optim       LARS and Adam with their schedules (optax)
  datasets    digits, text, .npz, image folders, synthetic; order per (seed, step)
  data        byte-level text
  batches     global batches, each process loading its own devices' rows
  checkpoint  Orbax checkpoints of sharded state
  logs        progress bar, JSON-lines metrics, TensorBoard
  report      measured memory and collectives of compiled programs; tables
  errors      the one-line InputError
"""
