"""Training data: where examples come from, and how a step picks and places them.

Modules, one concern each:
  datasets  digits, text, .npz, image folders, synthetic; order per (seed, step)
  text      byte-level text: the corpus, the split, the windows
  batches   global batches, each process loading its own devices' rows
"""
