"""Measurements and predictions beside training: the reports and their commands.

Modules, one concern each:
  report         measured memory and collectives of compiled programs; tables
  memory_report  `wus-memory`: per-device bytes of the replicated and wus steps
  scale          `wus-scale`: the cost model at the paper's scale, predicted
  scale_tp       `wus-scale --model_parallel`: the Transformer on data x model, predicted
  tpu_v3         TPU v3's published figures, sources and assumptions, as a topology
  paper_model    the paper's models and optimizers as cost-model workloads
  bench          `wus-bench`: wus beside the alternatives, measured (a package)
"""
