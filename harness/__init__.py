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

# The harness's dependencies are an extra (`pip install "wus[harness]"`), not the library's: say
# so where one is missing, before a module deep inside fails on it.
try:
  import flax
  import orbax.checkpoint
  import tensorboardX
  import tensorstore
  import tqdm
except ModuleNotFoundError as e:
  raise ModuleNotFoundError(
      f"wus.harness (wus-train, wus-bench, wus-memory, wus-scale) needs {e.name}, one of the "
      "harness's dependencies: pip install \"wus[harness]\" (or -e \".[harness]\" in a checkout)",
      name=e.name) from e
