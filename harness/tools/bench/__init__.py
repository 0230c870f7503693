"""`wus-bench`: wus beside the alternatives a JAX user has, measured in one run (`main`).

Modules, one concern each:
  main             the command: its flags, the regimes it runs, what it prints and writes
  variants         the variants and regimes (`Regime`), each variant's step
  regimes          one regime measured: compiled, warmed up, timed interleaved
  timing           calls timed interleaved, in a new order each round, with their page faults
  summary          what is printed: tables, the limit, predictions beside measurements, targets
  limit            the parts of a sharded step timed alone (the limit wus is compared with)
  compose          the limit's parts composed in one program, whole and by pairs
  calibrate        this machine's collective and memory costs, for the cost model
  choices          the cost model's batching choice, predicted beside measured
  zero             the hand-written and GSPMD ZeRO alternatives
  muon             the Muon regime: replicated, hand-written owner-computes, wus
  tensor_parallel  the tensor-parallel regime: optimizer state over data x model
"""
