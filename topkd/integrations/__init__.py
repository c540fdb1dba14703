"""Adapters to other training stacks (optional extras, imported on use).

- :mod:`topkd.integrations.megatron`: Megatron-Core's ``[s, b, V/TP]`` logits layout returning
  ``[b, s]``, the tensor-parallel group from ``parallel_state``, padded vocabularies.
- :mod:`topkd.integrations.megatron_fused`: the fused losses on a Megatron output layer's inputs
  (hidden states, sequence-sharded or not, and the weight shard): no ``[s, b, V/TP]`` student
  logits; ``fuse_output_layer``.
- :mod:`topkd.integrations.megatron_data`: a topkd store's teacher rows in Megatron's batches,
  by global sample index (no megatron-core import: it runs in the data loader's workers).
- :mod:`topkd.integrations.modelopt`: Model-Optimizer distillation criteria, for its Megatron
  plugin (``TopKLogitsKLLoss``, ``LogitsKLLoss``, the fused ``FusedTopKLogitsKLLoss``,
  ``FusedLogitsKLLoss`` with ``fuse_output_layers``) and its generic ``DistillationModel``
  (``TopKLogitsKLCriterion``, ``LogitsKLCriterion``).

Needs ``pip install "topkd[megatron]"`` (``nvidia-modelopt``, ``megatron-core``). Nothing here is
imported by ``import topkd``; docs/megatron.md shows the wiring.
"""
