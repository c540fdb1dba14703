"""KD losses with the student's LM head fused in: the student's logits never exist whole.

``F.linear(hidden, weight, bias)`` is computed one chunk of rows at a time, inside the same loops
that the logits losses run, and its gradient goes straight into the hidden states', weight's
and bias's gradients. The teacher can be logits, a :class:`SparseTeacher`, or its own
``(hidden, weight[, bias])``, whose logits are likewise made chunk by chunk under no grad.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist

from . import _checks, dense, parallel, student
from ._rows import BlockedRows, LinearRows, Rows, budget_bytes, chunk_rows
from .losses import (
    _KL_OPTIONS,
    _check_options,
    _common_checks,
    dense_from_rows,
    sparse_from_rows,
)
from .select import SparseTeacher, select_rows


class _AllReduceGradient(torch.autograd.Function):
    """Identity forward; SUM all-reduce of the gradient in backward (Megatron's
    ``copy_to_tensor_model_parallel_region``)."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _PrecomputedLoss(torch.autograd.Function):
    """A scalar loss whose gradients ``run`` accumulated while computing it; backward only
    scales them by the upstream gradient. One pass over the vocabulary instead of two (and
    one matrix product fewer) when the reduction is ``"sum"`` or ``"mean"``."""

    @staticmethod
    def forward(ctx, run, *tensors):
        loss, ctx.sink = run(ctx.needs_input_grad[1:], *tensors)
        return loss

    @staticmethod
    def backward(ctx, grad):
        return (None, *ctx.sink.result(None if bool(grad == 1) else grad))


def _row_weights(mask, reduction: str, rows: int, device) -> torch.Tensor:
    """The upstream gradient of each row's loss under a scalar reduction."""
    weight = torch.ones(rows, device=device) if mask is None else mask.reshape(rows).float()
    if reduction == "mean":
        weight = weight / max(int(weight.sum()), 1)
    return weight


def _one_pass(tensors, reduction) -> bool:
    return (reduction != "none" and torch.is_grad_enabled()
            and any(t is not None and t.requires_grad for t in tensors))


# The fused losses make the logits with one matrix product per block of rows and stage the
# logits gradient for the products that make the hidden states' and weight's gradients (see
# BlockedRows, LinearGradient); those products run near full speed from ~100 rows. By default
# the blocks and the float32 work chunks share a fifth of the bytes the logits would take (at
# most 512 MiB): 80% for the blocks, 20% for the work chunks. A teacher given as (hidden,
# weight) gets blocks a quarter as tall as the student's: its blocks only feed its own
# product, while the student's also set how often the weight's float32 accumulator is read
# and written (once per block), which costs more than a shorter teacher product.
_FUSED_CHUNK_BYTES = 512 * 2**20
_FUSED_FRACTION = 5
_TEACHER_BLOCK_DIVISOR = 4


def _budget(chunk_bytes, shard, rows, weight, process_group, teacher_blocks):
    """``(work chunk rows, student block rows, teacher block rows)``, the teacher's only with
    ``teacher_blocks`` (a hidden/weight teacher), from numbers every rank shares: the one-pass
    loops combine statistics per chunk, so every rank must cut the same chunks. One-pass losses
    stage the student's gradient in its own blocks; the two-pass ones hold a stage of that many
    rows but no student block."""
    width = -(-shard.total // parallel.world_size(process_group)) + 1
    element = weight.element_size()
    total = chunk_bytes
    if total is None:
        total = max(1, min(_FUSED_CHUNK_BYTES, rows * width * element // _FUSED_FRACTION))
    row_bytes = width * element * (1 + (1 / _TEACHER_BLOCK_DIVISOR if teacher_blocks else 0))
    per = chunk_rows(total // 5, width, rows, element, buffers=3)
    # Whole chunks per block: a block starts at a chunk, so a remainder would be made again.
    block = max(per, int(total * 4 // 5 // row_bytes) // per * per)
    teacher_block = max(1, block // _TEACHER_BLOCK_DIVISOR) if teacher_blocks else 0
    return per, block, teacher_block


def _teacher_slice(teacher: SparseTeacher, rows: int, start: int, stop: int) -> SparseTeacher:
    k = teacher.k
    return SparseTeacher(teacher.indices.reshape(rows, k)[start:stop],
                         teacher.logprobs.reshape(rows, k)[start:stop],
                         teacher.rest_logprob.reshape(rows)[start:stop],
                         teacher.temperature, teacher.vocab_size)


def _check_linear(prefix: str, hidden, weight, bias) -> None:
    """``hidden [..., H]``, ``weight [V_r, H]``, ``bias [V_r]`` or None, one float dtype."""
    _checks.logits(f"{prefix}hidden", hidden)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"{prefix}weight must be a 2-D tensor [V_r, H], got "
                         f"{getattr(weight, 'shape', type(weight).__name__)}")
    if hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"{prefix}hidden width {hidden.shape[-1]} differs from {prefix}weight "
                         f"width {weight.shape[1]} (weight is [V_r, H] = {tuple(weight.shape)})")
    if bias is not None and (not isinstance(bias, torch.Tensor)
                             or tuple(bias.shape) != (weight.shape[0],)):
        raise ValueError(f"{prefix}bias must be a tensor of shape ({weight.shape[0]},), got "
                         f"{getattr(bias, 'shape', type(bias).__name__)}")
    dtypes = {hidden.dtype, weight.dtype} | ({bias.dtype} if bias is not None else set())
    if len(dtypes) > 1:
        raise TypeError(f"{prefix}hidden, {prefix}weight and {prefix}bias must share one dtype, "
                        f"got {sorted(str(d) for d in dtypes)}")


def _teacher_source(teacher, lead_shape):
    """``(kind, tensors, width)`` of a teacher given as logits or ``(hidden, weight[, bias])``."""
    if isinstance(teacher, torch.Tensor):
        _checks.logits("teacher logits", teacher)
        _checks.same_leading("hidden", lead_shape, "teacher logits", teacher.shape[:-1])
        return Rows, (teacher.detach(),), teacher.shape[-1]
    if isinstance(teacher, tuple) and len(teacher) in (2, 3):
        hidden, weight, bias = (*teacher, None)[:3]
        _check_linear("teacher ", hidden, weight, bias)
        _checks.same_leading("hidden", lead_shape, "teacher hidden", hidden.shape[:-1])
        tensors = tuple(None if t is None else t.detach() for t in (hidden, weight, bias))
        return LinearRows, tensors, weight.shape[0]
    raise TypeError(
        "teacher must be teacher logits [..., V_r], a topkd.SparseTeacher (fused_topk_kl_loss "
        f"only) or a tuple (teacher_hidden, teacher_weight[, teacher_bias]), got "
        f"{type(teacher).__name__}" + (f" of length {len(teacher)}" if isinstance(teacher, tuple)
                                       else "")
    )


def _student(hidden, weight, bias, process_group, reduce_hidden_grad):
    _check_linear("", hidden, weight, bias)
    if reduce_hidden_grad and process_group is not None:
        hidden = _AllReduceGradient.apply(hidden, process_group)
    return (hidden, weight, bias)


def fused_topk_kl_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    teacher,
    k: int | None = None,
    *,
    bias: torch.Tensor | None = None,
    top_p: float | None = None,
    top_p_min_k: int = 1,
    temperature: float = 1.0,
    reverse: bool = False,
    normalize: str = "full",
    vocab_size: int | None = None,
    mask: torch.Tensor | None = None,
    reduction: str = "none",
    process_group=None,
    chunk_bytes: int | None = None,
    reduce_hidden_grad: bool = False,
) -> torch.Tensor:
    """:func:`topkd.topk_kl_loss` of ``F.linear(hidden, weight, bias)``, never holding those
    logits.

    Args:
        hidden: the student's final hidden states ``[..., H]`` (float32/bfloat16/float16).
        weight: the student's LM head ``[V_r, H]`` (this rank's vocabulary rows), same dtype.
        teacher: teacher logits ``[..., V_r]`` (``k`` required); a :class:`SparseTeacher`
            (online or from a store: ``k``, ``top_p`` and the temperature are its own, so
            ``temperature`` must equal its temperature); or ``(teacher_hidden, teacher_weight
            [, teacher_bias])``, whose logits are computed chunk by chunk under no grad.
        k: entries kept per row (see :func:`topkd.select_topk`).
        bias: optional ``[V_r]``.
        reduce_hidden_grad: with ``process_group``, the hidden states' gradient on each rank is
            by default this rank's partial sum over its vocabulary shard, which the caller's
            tensor-parallel region all-reduces (Megatron's ``ColumnParallelLinear``
            convention: hidden went through ``copy_to_tensor_model_parallel_region``). With
            ``True`` it is all-reduced here (once per call, in backward), so every rank gets
            the full gradient.
        top_p, top_p_min_k, temperature, reverse, normalize, vocab_size, mask, reduction,
        process_group, chunk_bytes: as in :func:`topkd.topk_kl_loss`.

    Returns:
        The float32 loss, equal to the unfused loss on the same logits to float32 rounding.
        Gradients flow to every one of ``hidden``, ``weight`` and ``bias`` that requires grad:
        hidden rows are written once, the weight's and bias's gradients are accumulated in a
        float32 buffer of their shape and returned in their dtype. No ``T**2`` factor.
    """
    _common_checks(hidden, mask, reduction, chunk_bytes, name="hidden")
    _checks.choice("normalize", normalize, _checks.NORMALIZE)
    temperature = _checks.temperature(temperature)
    top_p, top_p_min_k = _checks.top_p(top_p, top_p_min_k)
    lead_shape = hidden.shape[:-1]
    tensors = _student(hidden, weight, bias, process_group, reduce_hidden_grad)
    rows = lead_shape.numel()
    if isinstance(teacher, SparseTeacher):
        if k is not None and k != teacher.k:
            raise ValueError(f"k={k} differs from the SparseTeacher's K={teacher.k}")
        if top_p is not None:
            raise ValueError("top_p applies when selecting; this SparseTeacher is already "
                             "selected (pass top_p to select_topk)")
        _checks.teacher_temperature(temperature, teacher)
        _checks.same_leading("hidden", lead_shape, "teacher", teacher.indices.shape[:-1])
        mask = _checks.teacher_mask(mask, teacher, lead_shape)
        shards = parallel.exchange_shards(process_group, {"student": weight.shape[0]}, rows)
        vocab = _checks.vocab_size(vocab_size, ("weight rows", shards["student"].total))
        if vocab != teacher.vocab_size:
            raise ValueError(f"the teacher was normalized over vocab_size={teacher.vocab_size} "
                             f"but the student's vocabulary is {vocab}")

        teacher_source = None

        def teacher_rows(start, stop, source=None):
            return _teacher_slice(teacher, rows, start, stop)
    else:
        kind, teacher_tensors, width = _teacher_source(teacher, lead_shape)
        if k is None:
            raise ValueError("k is required when the teacher is given as logits or as "
                             "(hidden, weight[, bias])")
        widths = {"student": weight.shape[0], "teacher": width}
        shards = parallel.exchange_shards(process_group, widths, rows)
        vocab = _checks.vocab_size(vocab_size, ("weight rows", shards["student"].total),
                                   ("teacher width", shards["teacher"].total))
        k = _checks.integer("k", k, 1, vocab)
        teacher_source = kind(*teacher_tensors)
        # One budget for the whole call (the chunks' own row counts would shrink it).
        teacher_bytes = budget_bytes(chunk_bytes, rows, shards["teacher"].width,
                                     teacher_source.element_size)

        def teacher_rows(start, stop, source=teacher_source):
            return select_rows(source.rows(start, stop), k, top_p, top_p_min_k,
                               temperature, vocab, shards["teacher"], process_group,
                               teacher_bytes, scale=1)

    shard = shards["student"]
    per, block, teacher_block = _budget(chunk_bytes, shard, rows, weight, process_group,
                                        isinstance(teacher_source, LinearRows))
    if _one_pass(tensors, reduction):
        if isinstance(teacher_source, LinearRows):
            teacher_source = BlockedRows(teacher_source, teacher_block)

        def run(needs, *tensors):
            source = BlockedRows(LinearRows(*tensors), block)
            sink = source.gradient(needs)  # staged in the blocks' own storage
            loss = student.scalar_loss_and_gradients(
                source, partial(teacher_rows, source=teacher_source),
                _row_weights(mask, reduction, rows, weight.device), shard, shard.valid(vocab),
                process_group, per, sink, reverse=reverse, normalize=normalize)
            return loss, sink

        return _PrecomputedLoss.apply(run, *tensors)
    student_kind = partial(LinearRows, stage_rows=block)
    return sparse_from_rows(student_kind, tensors, lead_shape, teacher_rows(0, rows), shard,
                            vocab, reverse=reverse, normalize=normalize, mask=mask,
                            reduction=reduction, process_group=process_group,
                            chunk_bytes=chunk_bytes)


def fused_kl_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    teacher,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    reverse: bool = False,
    vocab_size: int | None = None,
    mask: torch.Tensor | None = None,
    reduction: str = "none",
    process_group=None,
    chunk_bytes: int | None = None,
    reduce_hidden_grad: bool = False,
) -> torch.Tensor:
    """:func:`topkd.kl_loss` of ``F.linear(hidden, weight, bias)``, never holding those logits.

    ``teacher`` is teacher logits ``[..., V_r]`` or ``(teacher_hidden, teacher_weight
    [, teacher_bias])`` (sharded like ``weight`` under tensor parallelism). Everything else as
    in :func:`fused_topk_kl_loss` and :func:`topkd.kl_loss`. No ``T**2`` factor.
    """
    _common_checks(hidden, mask, reduction, chunk_bytes, name="hidden")
    temperature = _checks.temperature(temperature)
    lead_shape = hidden.shape[:-1]
    tensors = _student(hidden, weight, bias, process_group, reduce_hidden_grad)
    if isinstance(teacher, SparseTeacher):
        raise TypeError("fused_kl_loss needs the whole teacher distribution: teacher logits "
                        "or (hidden, weight[, bias]); use fused_topk_kl_loss for a "
                        "SparseTeacher")
    kind, teacher_tensors, width = _teacher_source(teacher, lead_shape)
    widths = {"student": weight.shape[0], "teacher": width}
    shards = parallel.exchange_shards(process_group, widths, lead_shape.numel())
    vocab = _checks.vocab_size(vocab_size, ("weight rows", shards["student"].total),
                               ("teacher width", shards["teacher"].total))
    rows = lead_shape.numel()
    per, block, teacher_block = _budget(chunk_bytes, shards["student"], rows, weight,
                                        process_group, kind is LinearRows)
    if _one_pass(tensors, reduction):
        shard = shards["student"]
        dense.check_aligned(shards, vocab)

        def run(needs, *tensors):
            source = BlockedRows(LinearRows(*tensors), block)
            sink = source.gradient(needs)  # staged in the blocks' own storage
            loss = dense.scalar_loss_and_gradients(
                # (teacher logits are read chunk by chunk as they are: no blocks to make)
                source, kind(*teacher_tensors) if kind is Rows else
                BlockedRows(kind(*teacher_tensors), teacher_block),
                _row_weights(mask, reduction, rows, weight.device), temperature, bool(reverse),
                shard.valid(vocab), process_group, per, sink)
            return loss, sink

        return _PrecomputedLoss.apply(run, *tensors)
    return dense_from_rows(partial(LinearRows, stage_rows=block), tensors, kind,
                           teacher_tensors, lead_shape, shards, vocab, temperature=temperature,
                           reverse=reverse, mask=mask, reduction=reduction,
                           process_group=process_group, chunk_bytes=chunk_bytes)


class FusedTopKLogitsKLLoss(torch.nn.Module):
    """Module form of :func:`fused_topk_kl_loss`: holds ``k`` and the options; called as
    ``loss_fn(hidden, weight, teacher, bias=None, mask=None)``."""

    def __init__(self, k: int | None = None, **options):
        super().__init__()
        if k is not None:
            _checks.integer("k", k, 1)
        _check_options(options, _KL_OPTIONS | {"top_p", "top_p_min_k", "normalize",
                                               "reduce_hidden_grad"})
        self.k = k
        self.options = options

    def forward(self, hidden, weight, teacher, bias=None, mask=None) -> torch.Tensor:
        return fused_topk_kl_loss(hidden, weight, teacher, self.k, bias=bias, mask=mask,
                                  **self.options)


class FusedLogitsKLLoss(torch.nn.Module):
    """Module form of :func:`fused_kl_loss`: holds the options; called as
    ``loss_fn(hidden, weight, teacher, bias=None, mask=None)``."""

    def __init__(self, **options):
        super().__init__()
        _check_options(options, _KL_OPTIONS | {"reduce_hidden_grad"})
        self.options = options

    def forward(self, hidden, weight, teacher, bias=None, mask=None) -> torch.Tensor:
        return fused_kl_loss(hidden, weight, teacher, bias=bias, mask=mask, **self.options)
