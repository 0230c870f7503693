"""Training harness: the `wus-train` CLI, a byte-level Transformer LM, its data, and measured reports."""
