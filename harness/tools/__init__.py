"""Measurements and predictions beside training: the reports and their commands.

Modules, one concern each:
  report         measured memory and collectives of compiled programs; tables
  memory_report  `wus-memory`: per-device bytes of the replicated and wus steps
  scale          `wus-scale`: the cost model at the paper's scale, predicted
  bench          `wus-bench`: wus beside the alternatives, measured (a package)
"""
