"""topkd's losses as NVIDIA Model-Optimizer (``modelopt.torch.distill``) criteria.

For its Megatron plugin (``modelopt.torch.distill.plugins.megatron``), drop-in replacements for
its classes of the same names, in ``DistillationConfig(criterion={...})``:

- ``TopKLogitsKLLoss(model_config, k=..., **options)``;
- ``LogitsKLLoss(model_config, **options)``;
- ``FusedTopKLogitsKLLoss`` / ``FusedLogitsKLLoss``, the same on the student's output-layer
  inputs instead of its logits, with ``fuse_output_layers(model, distill_cfg)`` (the student's
  ``[s, b, V/TP]`` logits are never made; see docs/megatron.md).

They take ``[s, b, V/TP]`` logits or ``ColumnParallelLinear``'s ``(logits, bias)`` tuple and
return what ``BaseLoss.post_forward`` returns: ``(loss [b, s], tp_reduce=False,
is_sequence_parallel=False)``; every tensor-parallel rank already holds the whole loss, so
Megatron's loss function must not all-reduce it again. Their names keep ``Logits``:
``LogitsAndIntermediatesLossBalancer`` finds the logits loss by the class name. They need
``megatron-core`` and are imported on first use (see :mod:`topkd.integrations.megatron` for the
layout, the group and the padded vocabulary).

For Model-Optimizer's generic ``DistillationModel`` (any ``nn.Module`` student), whose config
accepts only ``torch.nn.modules.loss._Loss`` criteria:

- ``TopKLogitsKLCriterion(k, reduction="mean", **options)``;
- ``LogitsKLCriterion(reduction="mean", **options)``.

They are called as ``loss_fn(student_logits, teacher_logits)`` on ``[..., V]`` (``[b, s, V]``
for a language model), or on model outputs that carry ``.logits``, and return a tensor as
``DistillationModel.compute_kd_loss`` expects: a scalar for ``"mean"``/``"sum"``, or the
per-token loss for ``"none"`` (then reduce it with ``compute_kd_loss(loss_reduction_fn=...)``).
They are not named after Model-Optimizer's ``LogitsDistillationLoss`` because they do not
compute what it does: its ``"mean"`` divides by ``b x s x V`` and it multiplies by ``T**2``;
these average over tokens, and carry no ``T**2`` factor (as every topkd loss).
"""

from __future__ import annotations

import torch
from torch.nn.modules.loss import _Loss

from .. import _checks
from ..entry import distill_loss
from ..options import KL_OPTIONS, TOPK_OPTIONS
from .criteria import criterion_options

_MEGATRON_CLASSES = ("LogitsKLLoss", "TopKLogitsKLLoss", "FusedLogitsKLLoss",
                     "FusedTopKLogitsKLLoss", "fuse_output_layers")

# the Megatron classes come through __getattr__
__all__ = ["LogitsKLCriterion", "TopKLogitsKLCriterion", *_MEGATRON_CLASSES]


def __getattr__(name: str):
    # The Megatron-plugin classes subclass Model-Optimizer's BaseLoss, whose module imports
    # megatron-core: only a user of those pays for (and needs) it.
    if name in _MEGATRON_CLASSES:
        from . import modelopt_megatron

        return getattr(modelopt_megatron, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def model_logits(name: str, output) -> torch.Tensor:
    """Logits given as a tensor, or as a model output carrying them (``output.logits``, as a
    Hugging Face model returns when the criterion is keyed on the whole model)."""
    if not isinstance(output, torch.Tensor) and isinstance(getattr(output, "logits", None),
                                                           torch.Tensor):
        return output.logits
    if not isinstance(output, torch.Tensor):
        raise TypeError(f"{name} must be a logits tensor [..., V] or a model output with "
                        f".logits, got {type(output).__name__}")
    return output


# Every topkd option but those the criterion owns (reduction, via _Loss) or that would change
# the return type (return_components).
_GENERIC_KL_OPTIONS = KL_OPTIONS - {"reduction", "return_components"}
_GENERIC_TOPK_OPTIONS = TOPK_OPTIONS - {"reduction", "return_components"}


class TopKLogitsKLCriterion(_Loss):
    """:func:`topkd.topk_kl_loss` as a Model-Optimizer criterion for its generic
    ``DistillationModel``.

    Args:
        k: teacher entries kept individually (the rest: the exact ghost bucket).
        reduction: ``"mean"`` (over tokens, or the tokens ``mask`` keeps), ``"sum"`` or
            ``"none"`` (float32 with the logits' leading shape).
        options: any other keyword of :func:`topkd.topk_kl_loss` (``temperature``,
            ``divergence``, ``reverse``, ``top_p``, ``top_p_min_k``, ``normalize``,
            ``vocab_size``, ``chunk_bytes``, ``impl``, ``process_group``, ``kd_weight``,
            ``ce_weight``, ``ignore_index``), checked here.

    Called as ``loss_fn(student_logits, teacher_logits, mask=None, labels=None)``
    (``compute_kd_loss(mask=..., labels=...)`` passes them through); no ``T**2`` factor.
    """

    def __init__(self, k: int, *, reduction: str = "mean", **options):
        super().__init__(reduction=_checks.choice("reduction", reduction, _checks.REDUCTIONS))
        _checks.integer("k", k, 1)
        self.options = criterion_options(options, _GENERIC_TOPK_OPTIONS, k,
                                         reduction=reduction)

    @property
    def k(self) -> int:
        return self.options.k

    def forward(self, student_logits, teacher_logits, mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None) -> torch.Tensor:
        return _criterion_loss(self, student_logits, teacher_logits, mask, labels)

    def extra_repr(self) -> str:
        return ", ".join(f"{n}={v!r}" for n, v in self.options.given().items())


class LogitsKLCriterion(_Loss):
    """:func:`topkd.kl_loss` (the whole vocabulary) as a Model-Optimizer criterion for its
    generic ``DistillationModel``; arguments and call as in :class:`TopKLogitsKLCriterion`
    (the options of :func:`topkd.kl_loss`)."""

    def __init__(self, *, reduction: str = "mean", **options):
        super().__init__(reduction=_checks.choice("reduction", reduction, _checks.REDUCTIONS))
        self.options = criterion_options(options, _GENERIC_KL_OPTIONS, reduction=reduction)

    def forward(self, student_logits, teacher_logits, mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None) -> torch.Tensor:
        return _criterion_loss(self, student_logits, teacher_logits, mask, labels)

    def extra_repr(self) -> str:
        return ", ".join(f"{n}={v!r}" for n, v in self.options.given().items())


def _criterion_loss(criterion, student_logits, teacher_logits, mask, labels) -> torch.Tensor:
    """A generic criterion's loss: the model outputs' logits, its options."""
    teacher = model_logits("teacher_logits", teacher_logits)
    _checks.logits("teacher_logits", teacher)
    return distill_loss(model_logits("student_logits", student_logits), teacher,
                        criterion.options, mask=mask, labels=labels)
