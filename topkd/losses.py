"""The public logits losses: validation, layout, then the engine; and their nn.Modules.

All losses are exact (no approximation of the vocabulary sums) and carry no ``T**2`` factor:
multiply by ``temperature**2`` yourself if you want the Hinton scaling.
"""

from __future__ import annotations

import torch

from . import _checks, backends, memory, parallel
from .divergences import resolve
from .engine import Call, Config, LossParts, RowLoss, ScalarLoss
from .select import select_rows
from .sources import LogitsSource
from .teacher import SparseTeacher

_SPARSE_NAMES = ("indices", "logprobs", "rest")


def objective(divergence, reverse, labels, ignore_index, kd_weight, ce_weight, lead_shape,
              device, impl="auto") -> dict:
    """The checked divergence, hard-label settings and implementation, as
    :class:`~topkd.engine.Config` fields, and the labels flattened (int64 ``[n]``, on
    ``device``)."""
    div = resolve(divergence, reverse)
    kd_weight = _checks.weight("kd_weight", kd_weight)
    ce_weight = _checks.weight("ce_weight", ce_weight)
    ignore_index = _checks.integer("ignore_index", ignore_index, -(2**63))
    labels = _checks.labels(labels, lead_shape, device)
    if labels is None and ce_weight != 0:
        raise ValueError(f"ce_weight={ce_weight} needs labels= (the hard-label term)")
    fields = {"divergence": div, "kd_weight": kd_weight, "ce_weight": ce_weight,
              "ignore_index": ignore_index, "backend": backends.choose(impl, device)}
    return fields, labels


def run(call: Call, tensors: dict, *, mask, reduction, lead_shape, labels, teacher_rows=None,
        one_pass=False, return_components=False):
    """Run the engine for a checked call and reduce the rows: ``kd_weight * KD + ce_weight *
    CE``, each averaged over its own rows for ``"mean"``."""
    cfg, n = call.config, call.count
    named = dict(tensors, labels=labels)
    args = [named.get(name) for name in call.names]
    device = next(t.device for t in args if isinstance(t, torch.Tensor))
    keep = None if mask is None else mask.reshape(n)
    has_label = None if labels is None else labels != cfg.ignore_index
    keep_ce = has_label if keep is None else (None if has_label is None else keep & has_label)
    if one_pass:
        weights = (_row_weights(keep, n, reduction, device),
                   torch.zeros(n, device=device) if labels is None else
                   _row_weights(keep_ce, n, reduction, device))
        loss, kd, ce = ScalarLoss.apply(call, weights, teacher_rows, *args)
        return LossParts(loss, kd, ce) if return_components else loss
    kd_rows, ce_rows = RowLoss.apply(call, *args)
    kd = reduce_rows(kd_rows, keep, reduction, lead_shape)
    ce = reduce_rows(ce_rows, keep_ce, reduction, lead_shape)
    loss = cfg.kd_weight * kd + cfg.ce_weight * ce if labels is not None else cfg.kd_weight * kd
    if return_components:
        return LossParts(loss, kd.detach(), ce.detach())
    return loss


def _row_weights(keep, n: int, reduction: str, device) -> torch.Tensor:
    """The upstream gradient of each row's value under a scalar reduction."""
    weight = torch.ones(n, device=device) if keep is None else keep.float()
    if reduction == "mean":
        weight = weight / max(int(weight.sum()), 1)
    return weight


def reduce_rows(loss: torch.Tensor, keep, reduction: str, lead_shape) -> torch.Tensor:
    """``"none"`` (rows not kept are 0), ``"sum"`` or ``"mean"`` over the kept rows."""
    if keep is not None:
        loss = torch.where(keep, loss, torch.zeros_like(loss))
    if reduction == "none":
        return loss.reshape(lead_shape)
    total = loss.sum()
    if reduction == "sum":
        return total
    kept = loss.numel() if keep is None else int(keep.sum())
    return total / max(kept, 1)


def common_checks(student, mask, reduction, chunk_bytes, name="student_logits"):
    _checks.logits(name, student)
    _checks.chunk_bytes(chunk_bytes)
    _checks.choice("reduction", reduction, _checks.REDUCTIONS)
    _checks.mask(mask, student.shape[:-1])


def sparse_tensors(teacher: SparseTeacher, n: int) -> dict:
    """A :class:`SparseTeacher`'s tensors as the engine takes them (``[n, K]``, ``[n]``)."""
    k = teacher.k
    return dict(zip(_SPARSE_NAMES, (teacher.indices.reshape(n, k),
                                    teacher.logprobs.reshape(n, k),
                                    teacher.rest_logprob.reshape(n)), strict=True))


def _logits_config(fields, temperature, normalize, shard, vocab, group, chunk_bytes, n,
                   element_size, labels, sparse) -> Config:
    cfg = Config(temperature=temperature, normalize=normalize, offset=shard.offset,
                 valid=shard.valid(vocab), group=group, **fields)
    per, backward = memory.logits_rows(cfg, sparse, labels, chunk_bytes, n, shard.widest,
                                       element_size)
    return Config(**{**cfg.__dict__, "rows_per_chunk": per, "backward_rows_per_chunk": backward})


def sparse_kl_loss(
    student_logits: torch.Tensor,
    teacher: SparseTeacher,
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
    plus an optional hard-label cross-entropy.

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
    common_checks(student_logits, mask, reduction, chunk_bytes)
    if not isinstance(teacher, SparseTeacher):
        raise TypeError(f"teacher must be a topkd.SparseTeacher, got {type(teacher).__name__}")
    _checks.choice("normalize", normalize, _checks.NORMALIZE)
    lead = student_logits.shape[:-1]
    _checks.same_leading("student_logits", lead, "teacher", teacher.indices.shape[:-1])
    _checks.teacher_temperature(temperature, teacher)
    mask = _checks.teacher_mask(mask, teacher, lead)
    fields, labels = objective(divergence, reverse, labels, ignore_index, kd_weight, ce_weight,
                               lead, student_logits.device, impl)
    n = lead.numel()
    shard = parallel.exchange_shards(process_group, {"student": student_logits.shape[-1]}, n,
                                     student_logits.device)["student"]
    vocab = _checks.vocab_size(vocab_size, ("student_logits", shard.total))
    _checks.teacher_vocab(vocab, teacher, f"student_logits width {shard.total}, "
                                          f"vocab_size={vocab_size}")
    _checks.label_range(labels, fields["ignore_index"], vocab)
    cfg = _logits_config(fields, teacher.temperature, normalize, shard, vocab, process_group,
                         chunk_bytes, n, student_logits.element_size(), labels, True)
    call = Call(cfg, sparse=True, student=("logits",), teacher=_SPARSE_NAMES, count=n)
    return run(call, {"logits": student_logits, **sparse_tensors(teacher, n)}, mask=mask,
               reduction=reduction, lead_shape=lead, labels=labels,
               return_components=return_components)


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
    common_checks(student_logits, mask, reduction, chunk_bytes)
    _checks.logits("teacher_logits", teacher_logits)
    lead = student_logits.shape[:-1]
    _checks.same_leading("student_logits", lead, "teacher_logits", teacher_logits.shape[:-1])
    _checks.choice("normalize", normalize, _checks.NORMALIZE)
    temperature = _checks.temperature(1.0 if temperature is None else temperature)
    top_p, top_p_min_k = _checks.top_p(top_p, top_p_min_k)
    fields, labels = objective(divergence, reverse, labels, ignore_index, kd_weight, ce_weight,
                               lead, student_logits.device, impl)
    n = lead.numel()
    widths = {"student": student_logits.shape[-1], "teacher": teacher_logits.shape[-1]}
    shards = parallel.exchange_shards(process_group, widths, n, student_logits.device)
    vocab = _checks.vocab_size(vocab_size, ("student_logits", shards["student"].total),
                               ("teacher_logits", shards["teacher"].total))
    k = _checks.integer("k", k, 1, vocab)
    _checks.label_range(labels, fields["ignore_index"], vocab)
    teacher = select_rows(LogitsSource(teacher_logits.detach()), k, top_p, top_p_min_k,
                          temperature, vocab, shards["teacher"], process_group, chunk_bytes,
                          backend=fields["backend"])
    cfg = _logits_config(fields, temperature, normalize, shards["student"], vocab,
                         process_group, chunk_bytes, n, student_logits.element_size(), labels,
                         True)
    call = Call(cfg, sparse=True, student=("logits",), teacher=_SPARSE_NAMES, count=n)
    return run(call, {"logits": student_logits, **sparse_tensors(teacher, n)}, mask=mask,
               reduction=reduction, lead_shape=lead, labels=labels,
               return_components=return_components)


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
    common_checks(student_logits, mask, reduction, chunk_bytes)
    _checks.logits("teacher_logits", teacher_logits)
    lead = student_logits.shape[:-1]
    _checks.same_leading("student_logits", lead, "teacher_logits", teacher_logits.shape[:-1])
    temperature = _checks.temperature(1.0 if temperature is None else temperature)
    fields, labels = objective(divergence, reverse, labels, ignore_index, kd_weight, ce_weight,
                               lead, student_logits.device, impl)
    n = lead.numel()
    widths = {"student": student_logits.shape[-1], "teacher": teacher_logits.shape[-1]}
    shards = parallel.exchange_shards(process_group, widths, n, student_logits.device)
    vocab = _checks.vocab_size(vocab_size, ("student_logits", shards["student"].total),
                               ("teacher_logits", shards["teacher"].total))
    _checks.aligned(shards, vocab)
    _checks.label_range(labels, fields["ignore_index"], vocab)
    cfg = _logits_config(fields, temperature, "full", shards["student"], vocab, process_group,
                         chunk_bytes, n, student_logits.element_size(), labels, False)
    call = Call(cfg, sparse=False, student=("logits",), teacher=("teacher",), count=n)
    return run(call, {"logits": student_logits, "teacher": teacher_logits.detach()},
               mask=mask, reduction=reduction, lead_shape=lead, labels=labels,
               return_components=return_components)


def check_options(options: dict, allowed: set[str]) -> None:
    """A Module's options, checked at construction."""
    unknown = set(options) - allowed
    if unknown:
        raise TypeError(f"unknown loss options {sorted(unknown)}; allowed: {sorted(allowed)}")
    if options.get("temperature") is not None:
        _checks.temperature(options["temperature"])
    if "top_p" in options or "top_p_min_k" in options:
        _checks.top_p(options.get("top_p"), options.get("top_p_min_k", 1))
    if "chunk_bytes" in options:
        _checks.chunk_bytes(options["chunk_bytes"])
    if "reduction" in options:
        _checks.choice("reduction", options["reduction"], _checks.REDUCTIONS)
    if "normalize" in options:
        _checks.choice("normalize", options["normalize"], _checks.NORMALIZE)
    resolve(options.get("divergence", "kl"), options.get("reverse", False))
    backends.check_impl(options.get("impl", "auto"))
    for name in ("kd_weight", "ce_weight"):
        if name in options:
            _checks.weight(name, options[name])
    for name in ("logit_scale", "teacher_logit_scale"):
        if name in options:
            _checks.scale(name, options[name])
    for name in ("softcap", "teacher_softcap"):
        if name in options:
            _checks.softcap(name, options[name])


# Options every loss takes; the Modules take them at construction (labels and mask per call).
KL_OPTIONS = {"temperature", "divergence", "reverse", "vocab_size", "reduction",
              "process_group", "chunk_bytes", "ignore_index", "kd_weight", "ce_weight",
              "return_components", "impl"}
TOPK_OPTIONS = KL_OPTIONS | {"top_p", "top_p_min_k", "normalize"}


class TopKLogitsKLLoss(torch.nn.Module):
    """Module form of :func:`topk_kl_loss`: holds ``k`` and the options (any keyword of
    :func:`topk_kl_loss` but ``mask`` and ``labels``, which are given per call)."""

    def __init__(self, k: int, **options):
        super().__init__()
        _checks.integer("k", k, 1)
        check_options(options, TOPK_OPTIONS)
        self.k = k
        self.options = options

    def forward(self, student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                mask: torch.Tensor | None = None, labels: torch.Tensor | None = None):
        return topk_kl_loss(student_logits, teacher_logits, self.k, mask=mask, labels=labels,
                            **self.options)

    def extra_repr(self) -> str:
        return ", ".join([f"k={self.k}"] + [f"{n}={v!r}" for n, v in self.options.items()])


class LogitsKLLoss(torch.nn.Module):
    """Module form of :func:`kl_loss`: holds the options (any keyword of :func:`kl_loss` but
    ``mask`` and ``labels``, which are given per call)."""

    def __init__(self, **options):
        super().__init__()
        check_options(options, KL_OPTIONS)
        self.options = options

    def forward(self, student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                mask: torch.Tensor | None = None, labels: torch.Tensor | None = None):
        return kl_loss(student_logits, teacher_logits, mask=mask, labels=labels,
                       **self.options)

    def extra_repr(self) -> str:
        return ", ".join(f"{n}={v!r}" for n, v in self.options.items())
