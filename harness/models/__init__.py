"""The models the harness trains, each with its loss, metrics and kind of data.

Modules, one concern each:
  tasks           the models by name (`MODELS`), with their losses and metrics
  transformer     the byte-level Transformer LM (Flax lm1b / WMT examples)
  transformer_tp  that Transformer split Megatron-style over the model axis, in a shard_map
  resnet          ResNets (Flax ImageNet example), batch norm across replicas
  mlp             MLP image classifiers
"""
