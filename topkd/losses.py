"""The public losses: validation, layout, then the math modules; and their nn.Modules.

All losses are exact (no approximation of the vocabulary sums) and carry no ``T**2`` factor:
multiply by ``temperature**2`` yourself if you want the Hinton scaling.
"""

from __future__ import annotations

import torch

from . import _checks, parallel
from ._rows import Rows
from .dense import DenseKL, check_aligned
from .divergence import bucket_kl
from .select import SparseTeacher, select_rows
from .student import SparseStudentLogProbs


def reduce_rows(loss: torch.Tensor, mask, reduction: str, lead_shape) -> torch.Tensor:
    if mask is not None:
        mask = mask.reshape(-1)
        loss = torch.where(mask, loss, torch.zeros_like(loss))
    if reduction == "none":
        return loss.reshape(lead_shape)
    total = loss.sum()
    if reduction == "sum":
        return total
    kept = loss.numel() if mask is None else int(mask.sum())
    return total / max(kept, 1)


def _common_checks(student_logits, mask, reduction, chunk_bytes, name="student_logits"):
    _checks.logits(name, student_logits)
    _checks.chunk_bytes(chunk_bytes)
    _checks.choice("reduction", reduction, _checks.REDUCTIONS)
    _checks.mask(mask, student_logits.shape[:-1])


def sparse_from_rows(kind, tensors, lead_shape, teacher: SparseTeacher, shard, vocab, *,
                     reverse, normalize, mask, reduction, process_group, chunk_bytes):
    """The sparse loss for a student row source (``Rows`` of logits, ``LinearRows`` of a
    fused LM head) built by ``kind`` from ``tensors``, after validation."""
    n, k = teacher.indices.shape[:-1].numel(), teacher.k
    logp_sel, logp_rest = SparseStudentLogProbs.apply(
        kind, teacher.indices.reshape(n, k), teacher.temperature, shard, shard.valid(vocab),
        process_group, chunk_bytes, *tensors,
    )
    loss = bucket_kl(logp_sel, logp_rest, teacher.logprobs.reshape(n, k),
                     teacher.rest_logprob.reshape(n), reverse=reverse, normalize=normalize)
    return reduce_rows(loss, mask, reduction, lead_shape)


def sparse_kl_loss(
    student_logits: torch.Tensor,
    teacher: SparseTeacher,
    *,
    reverse: bool = False,
    normalize: str = "full",
    vocab_size: int | None = None,
    temperature: float | None = None,
    mask: torch.Tensor | None = None,
    reduction: str = "none",
    process_group=None,
    chunk_bytes: int | None = None,
) -> torch.Tensor:
    """KL divergence between the student and a :class:`SparseTeacher` (online or offline).

    Args:
        student_logits: ``[..., V_r]`` float32/bfloat16/float16, contiguous or not; with
            ``process_group``, this rank's contiguous vocabulary shard. Scaled by
            ``teacher.temperature``.
        teacher: from :func:`select_topk`, or a batch from a :mod:`topkd.store`, leading
            shape ``[...]``; rows its ``mask`` marks as padding are dropped like ``mask``'s.
        reverse: ``KL(p || q)`` instead of ``KL(q || p)`` (``q`` the teacher).
        normalize: ``"full"``: K kept entries plus the exact ghost bucket (everything else),
            both distributions normalized over the whole vocabulary; ``"topk"``: no ghost, both
            renormalized over the kept entries (Model-Optimizer 0.47 / axolotl behaviour).
        vocab_size: the real vocabulary when the student is padded past it (columns at or past
            it get zero gradient); must equal ``teacher.vocab_size``.
        temperature: optional; when given it must equal ``teacher.temperature`` (a store built
            at another temperature is refused instead of silently used).
        mask: bool ``[...]``; rows where it is False contribute 0 and get zero gradient.
        reduction: ``"none"`` (float32 ``[...]``), ``"sum"``, or ``"mean"`` over kept rows
            (0 with zero gradient when there are none).
        process_group: tensor-parallel group for vocabulary-sharded logits, or ``None``.
        chunk_bytes: float32 work buffer per chunk of rows (default: min(64 MiB, logits/16)).

    Returns:
        float32 loss; the same on every rank. No ``T**2`` factor. The student gradient has
        the student's dtype and shape; all vocabulary sums are computed in float32 relative to
        row maxima, so the result is exact to float32 rounding and unchanged by a common offset.
    """
    _common_checks(student_logits, mask, reduction, chunk_bytes)
    if not isinstance(teacher, SparseTeacher):
        raise TypeError(f"teacher must be a topkd.SparseTeacher, got {type(teacher).__name__}")
    _checks.choice("normalize", normalize, _checks.NORMALIZE)
    _checks.same_leading("student_logits", student_logits.shape[:-1],
                         "teacher", teacher.indices.shape[:-1])
    _checks.teacher_temperature(temperature, teacher)
    mask = _checks.teacher_mask(mask, teacher, student_logits.shape[:-1])
    shard = parallel.exchange_shards(process_group, {"student": student_logits.shape[-1]},
                                     student_logits.shape[:-1].numel())["student"]
    vocab = _checks.vocab_size(vocab_size, ("student_logits", shard.total))
    if vocab != teacher.vocab_size:
        raise ValueError(
            f"the teacher was normalized over vocab_size={teacher.vocab_size} but the student's "
            f"vocabulary is {vocab} (student_logits width {shard.total}, vocab_size={vocab_size})"
        )
    return sparse_from_rows(Rows, (student_logits,), student_logits.shape[:-1], teacher, shard,
                            vocab, reverse=reverse, normalize=normalize, mask=mask,
                            reduction=reduction, process_group=process_group,
                            chunk_bytes=chunk_bytes)


def topk_kl_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    k: int,
    *,
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
) -> torch.Tensor:
    """Top-K KD loss: ``sparse_kl_loss(student_logits, select_topk(teacher_logits, k, ...))``.

    The teacher's K largest entries (ties to the lower index; optionally cut by top-p) are kept
    individually and the rest of the vocabulary forms one ghost bucket whose mass is computed
    exactly, for teacher and student. With ``k`` equal to the vocabulary this is
    :func:`kl_loss`. Shapes, dtypes, options and exactness as in :func:`sparse_kl_loss` and
    :func:`select_topk`; ``teacher_logits`` has the student's leading shape and gets no
    gradient. No ``T**2`` factor.
    """
    _common_checks(student_logits, mask, reduction, chunk_bytes)
    _checks.logits("teacher_logits", teacher_logits)
    _checks.same_leading("student_logits", student_logits.shape[:-1],
                         "teacher_logits", teacher_logits.shape[:-1])
    _checks.choice("normalize", normalize, _checks.NORMALIZE)
    temperature = _checks.temperature(temperature)
    top_p, top_p_min_k = _checks.top_p(top_p, top_p_min_k)
    widths = {"student": student_logits.shape[-1], "teacher": teacher_logits.shape[-1]}
    shards = parallel.exchange_shards(process_group, widths, student_logits.shape[:-1].numel())
    vocab = _checks.vocab_size(vocab_size, ("student_logits", shards["student"].total),
                               ("teacher_logits", shards["teacher"].total))
    k = _checks.integer("k", k, 1, vocab)
    teacher = select_rows(Rows(teacher_logits), k, top_p, top_p_min_k, temperature, vocab,
                          shards["teacher"], process_group, chunk_bytes)
    return sparse_from_rows(Rows, (student_logits,), student_logits.shape[:-1], teacher,
                            shards["student"], vocab, reverse=reverse, normalize=normalize,
                            mask=mask, reduction=reduction, process_group=process_group,
                            chunk_bytes=chunk_bytes)


def kl_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    *,
    temperature: float = 1.0,
    reverse: bool = False,
    vocab_size: int | None = None,
    mask: torch.Tensor | None = None,
    reduction: str = "none",
    process_group=None,
    chunk_bytes: int | None = None,
) -> torch.Tensor:
    """Full-vocabulary KD loss ``sum_j q_j (log q_j - log p_j)`` (``reverse``: p and q swapped).

    Args:
        student_logits, teacher_logits: ``[..., V_r]`` float32/bfloat16/float16, the same
            leading shape; with ``process_group``, both sharded alike over the vocabulary.
        temperature: both are divided by it before the softmax. No ``T**2`` factor.
        vocab_size, mask, reduction, process_group, chunk_bytes: as in :func:`sparse_kl_loss`;
            with ``vocab_size`` the two widths may differ (e.g. 152,064 vs 151,936).

    Returns:
        float32 loss, identical on every rank; the student gradient has the student's dtype
        and shape, the teacher gets none. Computed per chunk of rows in float32 relative to row
        maxima: exact to float32 rounding, never a float32 copy of either logits tensor.
    """
    _common_checks(student_logits, mask, reduction, chunk_bytes)
    _checks.logits("teacher_logits", teacher_logits)
    _checks.same_leading("student_logits", student_logits.shape[:-1],
                         "teacher_logits", teacher_logits.shape[:-1])
    temperature = _checks.temperature(temperature)
    widths = {"student": student_logits.shape[-1], "teacher": teacher_logits.shape[-1]}
    shards = parallel.exchange_shards(process_group, widths, student_logits.shape[:-1].numel())
    vocab = _checks.vocab_size(vocab_size, ("student_logits", shards["student"].total),
                               ("teacher_logits", shards["teacher"].total))
    return dense_from_rows(Rows, (student_logits,), Rows, (teacher_logits.detach(),),
                           student_logits.shape[:-1], shards, vocab, temperature=temperature,
                           reverse=reverse, mask=mask, reduction=reduction,
                           process_group=process_group, chunk_bytes=chunk_bytes)


def dense_from_rows(student_kind, student_tensors, teacher_kind, teacher_tensors, lead_shape,
                    shards, vocab, *, temperature, reverse, mask, reduction, process_group,
                    chunk_bytes):
    """The full-vocabulary loss for row sources (``Rows``/``LinearRows``), after validation."""
    valid = check_aligned(shards, vocab)
    loss = DenseKL.apply(student_kind, teacher_kind, len(student_tensors), temperature,
                         bool(reverse), valid, process_group, chunk_bytes, *student_tensors,
                         *teacher_tensors)
    return reduce_rows(loss, mask, reduction, lead_shape)


def _check_options(options: dict, allowed: set[str]) -> None:
    unknown = set(options) - allowed
    if unknown:
        raise TypeError(f"unknown loss options {sorted(unknown)}; allowed: {sorted(allowed)}")
    if "temperature" in options:
        _checks.temperature(options["temperature"])
    if "top_p" in options or "top_p_min_k" in options:
        _checks.top_p(options.get("top_p"), options.get("top_p_min_k", 1))
    if "chunk_bytes" in options:
        _checks.chunk_bytes(options["chunk_bytes"])
    if "reduction" in options:
        _checks.choice("reduction", options["reduction"], _checks.REDUCTIONS)
    if "normalize" in options:
        _checks.choice("normalize", options["normalize"], _checks.NORMALIZE)


_KL_OPTIONS = {"temperature", "reverse", "vocab_size", "reduction", "process_group",
               "chunk_bytes"}


class TopKLogitsKLLoss(torch.nn.Module):
    """Module form of :func:`topk_kl_loss`: holds ``k`` and the options (any keyword of
    :func:`topk_kl_loss` but ``mask``, which is given per call)."""

    def __init__(self, k: int, **options):
        super().__init__()
        _checks.integer("k", k, 1)
        _check_options(options, _KL_OPTIONS | {"top_p", "top_p_min_k", "normalize"})
        self.k = k
        self.options = options

    def forward(self, student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        return topk_kl_loss(student_logits, teacher_logits, self.k, mask=mask, **self.options)

    def extra_repr(self) -> str:
        return ", ".join([f"k={self.k}"] + [f"{n}={v!r}" for n, v in self.options.items()])


class LogitsKLLoss(torch.nn.Module):
    """Module form of :func:`kl_loss`: holds the options (any keyword of :func:`kl_loss` but
    ``mask``, which is given per call)."""

    def __init__(self, **options):
        super().__init__()
        _check_options(options, _KL_OPTIONS)
        self.options = options

    def forward(self, student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        return kl_loss(student_logits, teacher_logits, mask=mask, **self.options)

    def extra_repr(self) -> str:
        return ", ".join(f"{n}={v!r}" for n, v in self.options.items())
