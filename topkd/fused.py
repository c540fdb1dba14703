"""KD losses with the student's LM head fused in: the student's logits never exist whole.

``F.linear(hidden, weight, bias)`` is computed one block of rows at a time, inside the same
chunk engine that the logits losses run, and its gradient goes straight into the hidden
states', weight's and bias's gradients. The teacher can be logits, a :class:`SparseTeacher`,
or its own ``(hidden, weight[, bias])``, whose logits are likewise made block by block under no
grad. Logit scale and softcap (Gemma, Cohere) apply to the products, as in the model. Each
function is :func:`topkd.distill_loss` with a student ``(hidden, weight, bias)``.
"""

from __future__ import annotations

import torch

from .entry import distill_loss
from .losses import LossModule
from .options import FUSED_KL_OPTIONS, FUSED_TOPK_OPTIONS, KDOptions, keywords
from .teacher import SparseTeacher


def _teacher_k(options: KDOptions, teacher) -> KDOptions:
    """``k`` is required unless the teacher is a :class:`SparseTeacher` (which has its own)."""
    if options.k is None and not isinstance(teacher, SparseTeacher):
        raise ValueError("k is required when the teacher is given as logits or as "
                         "(hidden, weight[, bias])")
    return options


def _full_teacher(teacher) -> None:
    if isinstance(teacher, SparseTeacher):
        raise TypeError("fused_kl_loss needs the whole teacher distribution: teacher logits "
                        "or (hidden, weight[, bias]); use fused_topk_kl_loss for a "
                        "SparseTeacher")


def fused_topk_kl_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    teacher,
    k: int | None = None,
    *,
    bias: torch.Tensor | None = None,
    top_p: float | None = None,
    top_p_min_k: int = 1,
    temperature: float | None = None,
    divergence="kl",
    reverse: bool = False,
    normalize: str = "full",
    vocab_size: int | None = None,
    labels: torch.Tensor | None = None,
    ignore_index: int = -100,
    kd_weight: float = 1.0,
    ce_weight: float = 0.0,
    mask: torch.Tensor | None = None,
    reduction: str = "none",
    process_group=None,
    chunk_bytes: int | None = None,
    reduce_hidden_grad: bool = False,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    teacher_logit_scale: float = 1.0,
    teacher_softcap: float | None = None,
    return_components: bool = False,
    impl: str = "auto",
    sharded_head: str = "vocab_parallel",
    gradient_divide_factor: float | None = None,
):
    """:func:`topkd.topk_kl_loss` of the logits ``softcap * tanh(logit_scale * F.linear(
    hidden, weight, bias) / softcap)`` (no softcap: ``logit_scale * F.linear(...)``), never
    holding those logits.

    Args:
        hidden: the student's final hidden states ``[..., H]`` (float32/bfloat16/float16).
        weight: the student's LM head ``[V_r, H]`` (this rank's vocabulary rows). Under
            autocast ``hidden`` may be bfloat16/float16 and ``weight`` a float32 parameter:
            the products then run in the 16-bit dtype (the weight converted once per call, as
            autocast does) and the weight's gradient is returned in float32.
        teacher: teacher logits ``[..., V_r]`` (``k`` required); a :class:`SparseTeacher`
            (online or from a store: ``k``, ``top_p`` and the temperature are its own); or
            ``(teacher_hidden, teacher_weight[, teacher_bias])``, whose logits (with
            ``teacher_logit_scale`` and ``teacher_softcap``) are made block by block under no
            grad.
        k: entries kept per row (see :func:`topkd.select_topk`).
        bias: optional ``[V_r]``.
        logit_scale, softcap: the student's logit transform, applied before the temperature
            (Cohere's ``logit_scale``, Gemma's ``final_logit_softcapping``); the CE term sees
            the transformed logits too.
        reduce_hidden_grad: with ``process_group``, the hidden states' gradient on each rank is
            by default this rank's partial sum over its vocabulary shard, which the caller's
            tensor-parallel region all-reduces (Megatron's ``ColumnParallelLinear``
            convention). With ``True`` it is all-reduced here (once per call, in backward).
        temperature: ``None``: the SparseTeacher's own, or 1.0; when given with a
            SparseTeacher it must equal its temperature.
        sharded_head, gradient_divide_factor: when ``weight`` (or a teacher's weight) is a
            DTensor sharded by vocabulary rows (FSDP2's ``Shard(0)`` on a 1-D mesh): how the
            loss runs, ``"vocab_parallel"`` (no rank holds the whole head) or ``"gather"``
            (the head gathered once per call), and what the head's gradient is divided by
            (``None``: the mesh size, FSDP's average; else the value given to FSDP2's
            ``set_gradient_divide_factor``). Each rank's loss is over its own tokens; see
            :mod:`topkd.sharded`.
        top_p, top_p_min_k, divergence, reverse, normalize, vocab_size, labels, ignore_index,
        kd_weight, ce_weight, mask, reduction, process_group, chunk_bytes, return_components,
        impl: as in :func:`topkd.topk_kl_loss`.

    Returns:
        The float32 loss, equal to the unfused loss on the same logits to float32 rounding.
        Gradients flow to every one of ``hidden``, ``weight`` and ``bias`` that requires grad:
        hidden rows are written once, the weight's and bias's gradients are accumulated in a
        float32 buffer of their shape and returned in their dtype. No ``T**2`` factor.
    """
    options = KDOptions(**keywords(locals(), "hidden", "weight", "teacher", "bias"))
    return distill_loss((hidden, weight, bias), teacher, _teacher_k(options, teacher), mask=mask,
                        labels=labels)


def fused_kl_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    teacher,
    *,
    bias: torch.Tensor | None = None,
    temperature: float | None = None,
    divergence="kl",
    reverse: bool = False,
    vocab_size: int | None = None,
    labels: torch.Tensor | None = None,
    ignore_index: int = -100,
    kd_weight: float = 1.0,
    ce_weight: float = 0.0,
    mask: torch.Tensor | None = None,
    reduction: str = "none",
    process_group=None,
    chunk_bytes: int | None = None,
    reduce_hidden_grad: bool = False,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    teacher_logit_scale: float = 1.0,
    teacher_softcap: float | None = None,
    return_components: bool = False,
    impl: str = "auto",
    sharded_head: str = "vocab_parallel",
    gradient_divide_factor: float | None = None,
):
    """:func:`topkd.kl_loss` (any divergence over the whole vocabulary) of the logits of
    ``F.linear(hidden, weight, bias)``, never holding those logits.

    ``teacher`` is teacher logits ``[..., V_r]`` or ``(teacher_hidden, teacher_weight
    [, teacher_bias])`` (sharded like ``weight`` under tensor parallelism). ``temperature``
    ``None`` = 1.0. Everything else as in :func:`fused_topk_kl_loss` and :func:`topkd.kl_loss`.
    No ``T**2`` factor.
    """
    _full_teacher(teacher)
    options = KDOptions(**keywords(locals(), "hidden", "weight", "teacher", "bias"))
    return distill_loss((hidden, weight, bias), teacher, options, mask=mask, labels=labels)


class FusedTopKLogitsKLLoss(LossModule):
    """Module form of :func:`fused_topk_kl_loss`: holds ``k`` and the options as one
    :class:`~topkd.KDOptions`; called as ``loss_fn(hidden, weight, teacher, bias=None,
    mask=None, labels=None)``."""

    def __init__(self, k: int | None = None, **options):
        super().__init__()
        self.options = KDOptions.of(options, allowed=FUSED_TOPK_OPTIONS, k=k)

    @property
    def k(self) -> int | None:
        return self.options.k

    def forward(self, hidden, weight, teacher, bias=None, mask=None, labels=None):
        return distill_loss((hidden, weight, bias), teacher, _teacher_k(self.options, teacher),
                            mask=mask, labels=labels)


class FusedLogitsKLLoss(LossModule):
    """Module form of :func:`fused_kl_loss`: holds the options as one
    :class:`~topkd.KDOptions`; called as ``loss_fn(hidden, weight, teacher, bias=None,
    mask=None, labels=None)``."""

    def __init__(self, **options):
        super().__init__()
        self.options = KDOptions.of(options, allowed=FUSED_KL_OPTIONS)

    def forward(self, hidden, weight, teacher, bias=None, mask=None, labels=None):
        _full_teacher(teacher)
        return distill_loss((hidden, weight, bias), teacher, self.options, mask=mask,
                            labels=labels)
