"""Adapters to other training stacks (optional extras, imported on use).

- :mod:`topkd.integrations.megatron`: Megatron-Core's ``[s, b, V/TP]`` logits layout returning
  ``[b, s]``, the tensor-parallel group from ``parallel_state``, padded vocabularies.
- :mod:`topkd.integrations.modelopt`: Model-Optimizer distillation criteria, for its Megatron
  plugin (``TopKLogitsKLLoss``, ``LogitsKLLoss``) and its generic ``DistillationModel``
  (``TopKLogitsKLCriterion``, ``LogitsKLCriterion``).

Needs ``pip install "topkd[megatron]"`` (``nvidia-modelopt``, ``megatron-core``). Nothing here is
imported by ``import topkd``.
"""
