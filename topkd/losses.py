"""The public logits losses and their nn.Modules: each is :func:`topkd.distill_loss` with its
own keyword signature.

All losses are exact (no approximation of the vocabulary sums) and carry no ``T**2`` factor:
multiply by ``temperature**2`` yourself if you want the Hinton scaling.
"""

from __future__ import annotations

import torch

from . import _checks
from .entry import distill_loss
from .options import KL_OPTIONS, TOPK_OPTIONS, KDOptions, keywords
from .teacher import SampledTeacher, SparseTeacher


def sparse_kl_loss(
    student_logits: torch.Tensor,
    teacher: SparseTeacher | SampledTeacher,
    *,
    divergence="kl",
    reverse: bool = False,
    normalize: str = "full",
    vocab_size: int | None = None,
    temperature: float | None = None,
    labels: torch.Tensor | None = None,
    ignore_index: int = -100,
    kd_weight: float = 1.0,
    ce_weight: float = 0.0,
    mask: torch.Tensor | None = None,
    reduction: str = "none",
    process_group=None,
    chunk_bytes: int | None = None,
    return_components: bool = False,
    impl: str = "auto",
):
    """A divergence between the student and a :class:`SparseTeacher` (online or offline),
    plus an optional hard-label cross-entropy; or forward KL against a :class:`SampledTeacher`
    (tokens drawn from the teacher, :func:`topkd.sample_teacher`): an unbiased estimate of the
    full-vocabulary KL's gradient (other divergences, ``normalize="topk"`` and ``top_p`` are
    refused with it). Against a SampledTeacher the value per row is ``-sum (c / N) log p(y)``
    over the ``N`` draws (the cross-entropy, which estimates ``KL(q || p) + H(q)``), plus
    ``sum (c / N) log q(y)`` when it carries the teacher's log-probs (then an unbiased estimate
    of ``KL(q || p)`` itself).

    Args:
        student_logits: ``[..., V_r]`` float32/bfloat16/float16, contiguous or not; with
            ``process_group``, this rank's contiguous vocabulary shard. Scaled by
            ``teacher.temperature``.
        teacher: from :func:`select_topk`, or a batch from a :mod:`topkd.store`, leading
            shape ``[...]``; rows its ``mask`` marks as padding are dropped like ``mask``'s.
        divergence: ``"kl"`` (``KL(q || p)``, ``q`` the teacher), ``"reverse_kl"``, ``"jsd"``,
            ``"skew_kl"``, ``"skew_reverse_kl"``, ``"tvd"``, or a :mod:`topkd.divergences`
            object (``topkd.JSD(beta=0.9)``). It acts on the K+1 buckets: the kept entries and
            the ghost (everything else).
        reverse: ``True`` means ``divergence="reverse_kl"`` (kept for compatibility).
        normalize: ``"full"``: K kept entries plus the exact ghost bucket, both distributions
            normalized over the whole vocabulary; ``"topk"``: no ghost, both renormalized over
            the kept entries (Model-Optimizer 0.47 / axolotl behaviour).
        vocab_size: the real vocabulary when the student is padded past it (columns at or past
            it get zero gradient); must equal ``teacher.vocab_size``.
        temperature: ``None`` (the teacher's own) or, when given, equal to
            ``teacher.temperature`` (a store built at another temperature is refused).
        labels: int ``[...]`` global token ids for the hard-label term; ``ignore_index`` rows
            have none. ``CE = -log softmax(z)_label`` at temperature 1 over ``vocab_size``.
        kd_weight, ce_weight: ``loss = kd_weight * KD + ce_weight * CE``.
        mask: bool ``[...]``; rows where it is False contribute 0 and get zero gradient.
        reduction: ``"none"`` (float32 ``[...]``), ``"sum"``, or ``"mean"`` (KD over kept
            rows, CE over kept rows with a label; each 0 with zero gradient when there are none).
        process_group: tensor-parallel group for vocabulary-sharded logits, or ``None``.
        chunk_bytes: float32 work buffers per chunk of rows (default: min(64 MiB, logits/16)).
        return_components: return ``LossParts(loss, kd, ce)``, the parts detached and reduced
            the same way (computed in the same pass).
        impl: ``"auto"`` (compiled kernels where the platform can build them, else eager
            with one warning; ``$TOPKD_IMPL`` replaces it for a whole run), ``"eager"`` or
            ``"compile"`` (a RuntimeError where it cannot). Equal to float32 rounding.

    Returns:
        float32 loss; the same on every rank. No ``T**2`` factor. The student gradient has
        the student's dtype and shape; all vocabulary sums are computed in float32 relative to
        row maxima, so the result is exact to float32 rounding and unchanged by a common offset.
    """
    if not isinstance(teacher, (SparseTeacher, SampledTeacher)):
        raise TypeError(f"teacher must be a topkd.SparseTeacher or SampledTeacher, got "
                        f"{type(teacher).__name__}")
    options = KDOptions(**keywords(locals(), "student_logits", "teacher"))
    return distill_loss(student_logits, teacher, options, mask=mask, labels=labels)


def topk_kl_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    k: int,
    *,
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
    return_components: bool = False,
    impl: str = "auto",
):
    """Top-K KD loss: ``sparse_kl_loss(student_logits, select_topk(teacher_logits, k, ...))``.

    The teacher's K largest entries (ties to the lower index; optionally cut by top-p) are kept
    individually and the rest of the vocabulary forms one ghost bucket whose mass is computed
    exactly, for teacher and student. With ``k`` equal to the vocabulary this is
    :func:`kl_loss`. ``temperature`` (``None`` = 1.0) scales both. Shapes, dtypes, options
    (``divergence``, ``labels``, ...) and exactness as in :func:`sparse_kl_loss` and
    :func:`select_topk`; ``teacher_logits`` has the student's leading shape and gets no
    gradient. No ``T**2`` factor.
    """
    _checks.logits("teacher_logits", teacher_logits)
    _checks.integer("k", k, 1)
    options = KDOptions(**keywords(locals(), "student_logits", "teacher_logits"))
    return distill_loss(student_logits, teacher_logits, options, mask=mask, labels=labels)


def kl_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    *,
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
    return_components: bool = False,
    impl: str = "auto",
):
    """Full-vocabulary KD loss: any divergence (the name is historical), by default
    ``KL(q || p) = sum_j q_j (log q_j - log p_j)`` over the whole vocabulary.

    Args:
        student_logits, teacher_logits: ``[..., V_r]`` float32/bfloat16/float16, the same
            leading shape; with ``process_group``, both sharded alike over the vocabulary.
        temperature: both are divided by it before the softmax (``None`` = 1.0). No ``T**2``.
        divergence: as in :func:`sparse_kl_loss`, over every vocabulary entry.
        vocab_size, labels, ignore_index, kd_weight, ce_weight, mask, reduction,
        process_group, chunk_bytes, return_components, impl: as in :func:`sparse_kl_loss`; with
            ``vocab_size`` the two widths may differ (e.g. 152,064 vs 151,936).

    Returns:
        float32 loss, identical on every rank; the student gradient has the student's dtype
        and shape, the teacher gets none. Computed per chunk of rows in float32 relative to row
        maxima: exact to float32 rounding, never a float32 copy of either logits tensor.
    """
    _checks.logits("teacher_logits", teacher_logits)
    options = KDOptions(**keywords(locals(), "student_logits", "teacher_logits"))
    return distill_loss(student_logits, teacher_logits, options, mask=mask, labels=labels)


class LossModule(torch.nn.Module):
    """A loss Module: holds its options as one :class:`~topkd.KDOptions` (``self.options``),
    shown by ``repr``."""

    options: KDOptions

    def extra_repr(self) -> str:
        return ", ".join(f"{n}={v!r}" for n, v in self.options.given().items())


class TopKLogitsKLLoss(LossModule):
    """Module form of :func:`topk_kl_loss`: holds ``k`` and the options (any keyword of
    :func:`topk_kl_loss` but ``mask`` and ``labels``, which are given per call) as one
    :class:`~topkd.KDOptions`, checked at construction."""

    def __init__(self, k: int, **options):
        super().__init__()
        _checks.integer("k", k, 1)
        self.options = KDOptions.of(options, allowed=TOPK_OPTIONS, k=k)

    @property
    def k(self) -> int:
        return self.options.k

    def forward(self, student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                mask: torch.Tensor | None = None, labels: torch.Tensor | None = None):
        _checks.logits("teacher_logits", teacher_logits)
        return distill_loss(student_logits, teacher_logits, self.options, mask=mask,
                            labels=labels)


class LogitsKLLoss(LossModule):
    """Module form of :func:`kl_loss`: holds the options (any keyword of :func:`kl_loss` but
    ``mask`` and ``labels``, which are given per call) as one :class:`~topkd.KDOptions`."""

    def __init__(self, **options):
        super().__init__()
        self.options = KDOptions.of(options, allowed=KL_OPTIONS)

    def forward(self, student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                mask: torch.Tensor | None = None, labels: torch.Tensor | None = None):
        _checks.logits("teacher_logits", teacher_logits)
        return distill_loss(student_logits, teacher_logits, self.options, mask=mask,
                            labels=labels)
