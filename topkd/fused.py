"""KD losses with the student's LM head fused in: the student's logits never exist whole.

``F.linear(hidden, weight, bias)`` is computed one block of rows at a time, inside the same
chunk engine that the logits losses run, and its gradient goes straight into the hidden
states', weight's and bias's gradients. The teacher can be logits, a :class:`SparseTeacher`,
or its own ``(hidden, weight[, bias])``, whose logits are likewise made block by block under no
grad. Logit scale and softcap (Gemma, Cohere) apply to the products, as in the model.
"""

from __future__ import annotations

import torch

from . import _checks, memory, parallel
from .engine import Call, Config
from .losses import (
    KL_OPTIONS,
    TOPK_OPTIONS,
    check_options,
    common_checks,
    objective,
    run,
    sparse_tensors,
)
from .parallel import AllReduceGradient as _AllReduceGradient
from .select import select_rows
from .sources import BlockedSource, LinearSource, LogitsSource, product_dtype
from .teacher import SparseTeacher


def _one_pass(tensors, reduction) -> bool:
    return (reduction != "none" and torch.is_grad_enabled()
            and any(t is not None and t.requires_grad for t in tensors))


def _check_linear(prefix: str, hidden, weight, bias) -> None:
    """``hidden [..., H]``, ``weight [V_r, H]``, ``bias [V_r]`` or None; float dtypes that
    :func:`~topkd.sources.product_dtype` can combine."""
    _checks.logits(f"{prefix}hidden", hidden)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"{prefix}weight must be a 2-D tensor [V_r, H], got "
                         f"{getattr(weight, 'shape', type(weight).__name__)}")
    _checks.logits(f"{prefix}weight", weight)
    if hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"{prefix}hidden width {hidden.shape[-1]} differs from {prefix}weight "
                         f"width {weight.shape[1]} (weight is [V_r, H] = {tuple(weight.shape)})")
    if bias is not None and (not isinstance(bias, torch.Tensor)
                             or tuple(bias.shape) != (weight.shape[0],)):
        raise ValueError(f"{prefix}bias must be a tensor of shape ({weight.shape[0]},), got "
                         f"{getattr(bias, 'shape', type(bias).__name__)}")
    if bias is not None:
        _checks.logits(f"{prefix}bias", bias)
    try:
        product_dtype(hidden.dtype, weight.dtype, *(() if bias is None else (bias.dtype,)))
    except TypeError as e:
        raise TypeError(f"{prefix}hidden, {prefix}weight and {prefix}bias: {e}") from None


def _teacher_source(teacher, lead_shape):
    """``(tensors by name, width)`` of a teacher given as logits or ``(hidden, weight[,
    bias])``."""
    if isinstance(teacher, torch.Tensor):
        _checks.logits("teacher logits", teacher)
        _checks.same_leading("hidden", lead_shape, "teacher logits", teacher.shape[:-1])
        return {"teacher": teacher.detach()}, teacher.shape[-1]
    if isinstance(teacher, tuple) and len(teacher) in (2, 3):
        hidden, weight, bias = (*teacher, None)[:3]
        _check_linear("teacher ", hidden, weight, bias)
        _checks.same_leading("hidden", lead_shape, "teacher hidden", hidden.shape[:-1])
        names = ("teacher_hidden", "teacher_weight", "teacher_bias")
        tensors = (None if t is None else t.detach() for t in (hidden, weight, bias))
        return dict(zip(names, tensors, strict=True)), weight.shape[0]
    raise TypeError(
        "teacher must be teacher logits [..., V_r], a topkd.SparseTeacher (fused_topk_kl_loss "
        f"only) or a tuple (teacher_hidden, teacher_weight[, teacher_bias]), got "
        f"{type(teacher).__name__}" + (f" of length {len(teacher)}" if isinstance(teacher, tuple)
                                       else "")
    )


def _student(hidden, weight, bias, process_group, reduce_hidden_grad) -> dict:
    _check_linear("", hidden, weight, bias)
    if reduce_hidden_grad and process_group is not None:
        hidden = _AllReduceGradient.apply(hidden, process_group)
    return {"hidden": hidden, "weight": weight, "bias": bias}


def _transforms(logit_scale, softcap, teacher_logit_scale, teacher_softcap) -> dict:
    return {"logit_scale": _checks.scale("logit_scale", logit_scale),
            "softcap": _checks.softcap("softcap", softcap),
            "teacher_logit_scale": _checks.scale("teacher_logit_scale", teacher_logit_scale),
            "teacher_softcap": _checks.softcap("teacher_softcap", teacher_softcap)}


def _config(fields, shard, vocab, group, chunk_bytes, n, hidden, weight, labels, sparse,
            teacher_blocks) -> Config:
    cfg = Config(offset=shard.offset, valid=shard.valid(vocab), group=group, **fields)
    dtype = product_dtype(hidden.dtype, weight.dtype)
    per, block, teacher_block = memory.fused_rows(cfg, sparse, labels, chunk_bytes,
                                                  shard.widest, n, dtype, hidden.device,
                                                  teacher_blocks)
    return Config(**{**cfg.__dict__, "rows_per_chunk": per, "block_rows": block,
                     "teacher_block_rows": teacher_block})


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
        top_p, top_p_min_k, divergence, reverse, normalize, vocab_size, labels, ignore_index,
        kd_weight, ce_weight, mask, reduction, process_group, chunk_bytes, return_components,
        impl: as in :func:`topkd.topk_kl_loss`.

    Returns:
        The float32 loss, equal to the unfused loss on the same logits to float32 rounding.
        Gradients flow to every one of ``hidden``, ``weight`` and ``bias`` that requires grad:
        hidden rows are written once, the weight's and bias's gradients are accumulated in a
        float32 buffer of their shape and returned in their dtype. No ``T**2`` factor.
    """
    common_checks(hidden, mask, reduction, chunk_bytes, name="hidden")
    _checks.choice("normalize", normalize, _checks.NORMALIZE)
    top_p, top_p_min_k = _checks.top_p(top_p, top_p_min_k)
    lead = hidden.shape[:-1]
    student = _student(hidden, weight, bias, process_group, reduce_hidden_grad)
    transforms = _transforms(logit_scale, softcap, teacher_logit_scale, teacher_softcap)
    fields, labels = objective(divergence, reverse, labels, ignore_index, kd_weight, ce_weight,
                               lead, hidden.device, impl)
    fields.update(transforms, normalize=normalize)
    n = lead.numel()
    one_pass = _one_pass(student.values(), reduction)
    if isinstance(teacher, SparseTeacher):
        if k is not None and k != teacher.k:
            raise ValueError(f"k={k} differs from the SparseTeacher's K={teacher.k}")
        if top_p is not None:
            raise ValueError("top_p applies when selecting; this SparseTeacher is already "
                             "selected (pass top_p to select_topk)")
        _checks.teacher_temperature(temperature, teacher)
        _checks.same_leading("hidden", lead, "teacher", teacher.indices.shape[:-1])
        mask = _checks.teacher_mask(mask, teacher, lead)
        shards = parallel.exchange_shards(process_group, {"student": weight.shape[0]}, n,
                                          hidden.device)
        vocab = _checks.vocab_size(vocab_size, ("weight rows", shards["student"].total))
        _checks.teacher_vocab(vocab, teacher, f"weight rows {shards['student'].total}")
        fields["temperature"] = teacher.temperature
    else:
        named, width = _teacher_source(teacher, lead)
        if k is None:
            raise ValueError("k is required when the teacher is given as logits or as "
                             "(hidden, weight[, bias])")
        fields["temperature"] = _checks.temperature(1.0 if temperature is None else temperature)
        widths = {"student": weight.shape[0], "teacher": width}
        shards = parallel.exchange_shards(process_group, widths, n, hidden.device)
        vocab = _checks.vocab_size(vocab_size, ("weight rows", shards["student"].total),
                                   ("teacher width", shards["teacher"].total))
        k = _checks.integer("k", k, 1, vocab)
    _checks.label_range(labels, fields["ignore_index"], vocab)
    cfg = _config(fields, shards["student"], vocab, process_group, chunk_bytes, n, hidden,
                  weight, labels, True, isinstance(teacher, tuple))
    teacher_rows = None
    if isinstance(teacher, SparseTeacher):
        teacher_tensors = sparse_tensors(teacher, n)
    else:
        teacher_source = LogitsSource(named["teacher"]) if "teacher" in named else LinearSource(
            named["teacher_hidden"], named["teacher_weight"], named["teacher_bias"])
        # One budget for the whole call (the chunks' own row counts would shrink it).
        teacher_bytes = memory.budget_bytes(chunk_bytes, n, shards["teacher"].width,
                                            teacher_source.element_size)

        def select(source):
            return select_rows(source, k, top_p, top_p_min_k, cfg.temperature, vocab,
                               shards["teacher"], process_group, teacher_bytes,
                               fused=True, logit_scale=cfg.teacher_logit_scale,
                               softcap=cfg.teacher_softcap, backend=cfg.backend)

        if one_pass:  # the [rows, K] targets exist one chunk at a time
            teacher_tensors = dict.fromkeys(("indices", "logprobs", "rest"))
            if isinstance(teacher_source, LinearSource):
                teacher_source = BlockedSource(teacher_source, cfg.teacher_block_rows)

            def teacher_rows(start, stop):
                return select(teacher_source.slice(start, stop))
        else:
            teacher_tensors = sparse_tensors(select(teacher_source), n)
    call = Call(cfg, sparse=True, student=("hidden", "weight", "bias"),
                teacher=("indices", "logprobs", "rest"), count=n)
    return run(call, {**student, **teacher_tensors}, mask=mask, reduction=reduction,
               lead_shape=lead, labels=labels, teacher_rows=teacher_rows, one_pass=one_pass,
               return_components=return_components)


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
):
    """:func:`topkd.kl_loss` (any divergence over the whole vocabulary) of the logits of
    ``F.linear(hidden, weight, bias)``, never holding those logits.

    ``teacher`` is teacher logits ``[..., V_r]`` or ``(teacher_hidden, teacher_weight
    [, teacher_bias])`` (sharded like ``weight`` under tensor parallelism). ``temperature``
    ``None`` = 1.0. Everything else as in :func:`fused_topk_kl_loss` and :func:`topkd.kl_loss`.
    No ``T**2`` factor.
    """
    common_checks(hidden, mask, reduction, chunk_bytes, name="hidden")
    lead = hidden.shape[:-1]
    student = _student(hidden, weight, bias, process_group, reduce_hidden_grad)
    fields, labels = objective(divergence, reverse, labels, ignore_index, kd_weight, ce_weight,
                               lead, hidden.device, impl)
    fields.update(_transforms(logit_scale, softcap, teacher_logit_scale, teacher_softcap))
    fields["temperature"] = _checks.temperature(1.0 if temperature is None else temperature)
    if isinstance(teacher, SparseTeacher):
        raise TypeError("fused_kl_loss needs the whole teacher distribution: teacher logits "
                        "or (hidden, weight[, bias]); use fused_topk_kl_loss for a "
                        "SparseTeacher")
    named, width = _teacher_source(teacher, lead)
    n = lead.numel()
    widths = {"student": weight.shape[0], "teacher": width}
    shards = parallel.exchange_shards(process_group, widths, n, hidden.device)
    vocab = _checks.vocab_size(vocab_size, ("weight rows", shards["student"].total),
                               ("teacher width", shards["teacher"].total))
    _checks.aligned(shards, vocab)
    _checks.label_range(labels, fields["ignore_index"], vocab)
    cfg = _config(fields, shards["student"], vocab, process_group, chunk_bytes, n, hidden,
                  weight, labels, False, "teacher" not in named)
    call = Call(cfg, sparse=False, student=("hidden", "weight", "bias"), teacher=tuple(named),
                count=n)
    return run(call, {**student, **named}, mask=mask, reduction=reduction, lead_shape=lead,
               labels=labels, one_pass=_one_pass(student.values(), reduction),
               return_components=return_components)


_FUSED_OPTIONS = {"reduce_hidden_grad", "logit_scale", "softcap", "teacher_logit_scale",
                  "teacher_softcap"}


class FusedTopKLogitsKLLoss(torch.nn.Module):
    """Module form of :func:`fused_topk_kl_loss`: holds ``k`` and the options; called as
    ``loss_fn(hidden, weight, teacher, bias=None, mask=None, labels=None)``."""

    def __init__(self, k: int | None = None, **options):
        super().__init__()
        if k is not None:
            _checks.integer("k", k, 1)
        check_options(options, TOPK_OPTIONS | _FUSED_OPTIONS)
        self.k = k
        self.options = options

    def forward(self, hidden, weight, teacher, bias=None, mask=None, labels=None):
        return fused_topk_kl_loss(hidden, weight, teacher, self.k, bias=bias, mask=mask,
                                  labels=labels, **self.options)


class FusedLogitsKLLoss(torch.nn.Module):
    """Module form of :func:`fused_kl_loss`: holds the options; called as
    ``loss_fn(hidden, weight, teacher, bias=None, mask=None, labels=None)``."""

    def __init__(self, **options):
        super().__init__()
        check_options(options, KL_OPTIONS | _FUSED_OPTIONS)
        self.options = options

    def forward(self, hidden, weight, teacher, bias=None, mask=None, labels=None):
        return fused_kl_loss(hidden, weight, teacher, bias=bias, mask=mask, labels=labels,
                             **self.options)
