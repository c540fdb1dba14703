"""The one entry point every loss runs through: :func:`distill_loss`.

It takes the student (logits, or an LM head ``(hidden, weight[, bias])``), the teacher
(logits, a :class:`~topkd.SparseTeacher`, or an LM head) and a :class:`~topkd.KDOptions`;
checks the tensors against each other and against the options (before any collective: every
rank sees the same gathered shapes, so a bad input raises on all ranks); learns this rank's
vocabulary shard once; selects the teacher's top K where the options ask for it; and runs the
chunk engine. The public functions of :mod:`topkd.losses` and :mod:`topkd.fused` are this
function with their own keyword signatures.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from . import _checks, backends, memory, parallel, sharded
from .divergences import KL, SAMPLED_CE
from .engine import Call, Config, LossParts, RowLoss, ScalarLoss
from .options import KDOptions
from .parallel import AllReduceGradient
from .select import select_rows
from .sources import BlockedSource, LinearSource, LogitsSource, product_dtype
from .teacher import SampledTeacher, SparseTeacher

_SPARSE_NAMES = ("indices", "logprobs", "rest")
_HEAD_NAMES = ("hidden", "weight", "bias")
_TEACHER_HEAD_NAMES = ("teacher_hidden", "teacher_weight", "teacher_bias")


@dataclass(frozen=True)
class RowOwner:
    """A batch gathered from every rank of ``group`` (``rows`` per rank, padded), of which this
    rank owns ``[start, start + count)``: its loss is over those rows (``lead_shape``, kept by
    ``keep``), and ``weights`` ``[world * rows, 2]`` are every rank's rows' (KD, CE) upstream
    gradients under a scalar reduction (:func:`row_weights`). Made by :mod:`topkd.sharded`."""

    group: Any
    start: int
    count: int
    rows: int
    lead_shape: torch.Size
    keep: torch.Tensor | None
    weights: torch.Tensor


def distill_loss(student, teacher, options: KDOptions, *, mask: torch.Tensor | None = None,
                 labels: torch.Tensor | None = None, shards: dict | None = None,
                 owner: RowOwner | None = None):
    """``kd_weight * D(teacher || student) + ce_weight * CE``, reduced as ``options`` say.

    Args:
        student: logits ``[..., V_r]`` (float32/bfloat16/float16), or an LM head
            ``(hidden [..., H], weight [V_r, H][, bias [V_r]])`` whose logits are made one
            block of rows at a time and never held whole. With ``options.process_group``,
            ``V_r`` is this rank's contiguous vocabulary shard.
        teacher: logits ``[..., V_r]`` (the student's leading shape), a
            :class:`~topkd.SparseTeacher`, or an LM head ``(hidden, weight[, bias])`` (with
            an LM-head student only). Gets no gradient.
        options: a :class:`~topkd.KDOptions`. ``options.k`` set (or a SparseTeacher): the
            Top-K loss with the exact ghost bucket; ``k=None`` with a whole teacher: every
            vocabulary entry.
        mask: bool ``[...]``; rows where it is False contribute 0 and get zero gradient.
        labels: int ``[...]`` token ids for the hard-label term (``options.ce_weight``).
        shards: for an integration that has exchanged the shard widths already (to check them
            against its own config first): ``{"student": Shard, "teacher": Shard}`` from
            :func:`topkd.parallel.exchange_shards` with the same row count and
            ``same=topkd.backends.across_ranks(...)`` of the call's kernels (``"teacher"``
            omitted for a SparseTeacher). ``None``: exchanged here (one small all-gather).
        owner: internal (:mod:`topkd.sharded`): the rows of a gathered batch this rank owns.

    An LM head whose ``weight`` is a DTensor sharded by vocabulary rows (FSDP2) is handled by
    :mod:`topkd.sharded` (``options.sharded_head``), which calls back here with plain tensors.

    Returns:
        The float32 loss (``[...]`` for ``reduction="none"``, else a scalar), the same on
        every rank, or ``LossParts(loss, kd, ce)`` with ``options.return_components``. The
        student's gradients have its tensors' dtypes and shapes. Exact to float32 rounding;
        no ``T**2`` factor.
    """
    if not isinstance(options, KDOptions):
        raise TypeError(f"options must be a topkd.KDOptions, got {type(options).__name__}")
    if owner is None and sharded.involved(student, teacher):
        return sharded.sharded_loss(distill_loss, student, teacher, options, mask, labels)
    fused = isinstance(student, tuple)
    if fused:
        student_tensors, names = _student_head(student, options, mask)
        x = student_tensors["hidden"]
    else:
        _checks.logits("student_logits", student)
        _checks.mask(mask, student.shape[:-1])
        student_tensors, x = {"logits": student}, student
        names = {"student": "student_logits", "width": "student_logits",
                 "teacher": "teacher_logits", "teacher_width": "teacher_logits"}
        if options.reduce_hidden_grad:
            raise ValueError("reduce_hidden_grad=True applies to a fused LM head, not to logits")
    lead = x.shape[:-1]
    # a fused loss being trained to a scalar writes its gradients in forward
    one_pass = fused and _one_pass(student_tensors.values(), options.reduction)
    if isinstance(teacher, SparseTeacher):
        return _sparse_teacher(student_tensors, teacher, options, names, lead, x, mask, labels,
                               shards, one_pass, owner)
    if isinstance(teacher, SampledTeacher):
        return _sampled_teacher(student_tensors, teacher, options, names, lead, x, mask,
                                labels, shards, one_pass, owner)
    if options.k is None:
        if options.top_p is not None:
            raise ValueError(f"top_p={options.top_p} needs k (the full-vocabulary loss keeps "
                             f"every entry)")
        if options.normalize != "full":
            raise ValueError(f"normalize={options.normalize!r} needs k (the full-vocabulary "
                             f"loss has no kept set to renormalize over)")
    teacher_tensors, width = _teacher_input(teacher, lead, fused, names)
    temperature = 1.0 if options.temperature is None else options.temperature
    fields, labels = _objective(options, labels, lead, x.device)
    fields["temperature"] = temperature
    n = lead.numel()
    widths = {"student": _width(student_tensors), "teacher": width}
    shards = _exchange(options, widths, n, x.device, shards, fields["backend"])
    vocab = _checks.vocab_size(options.vocab_size,
                               (names["width"], shards["student"].total),
                               (names["teacher_width"], shards["teacher"].total))
    if options.k is None:
        _checks.aligned(shards, vocab)
        _checks.label_range(labels, fields["ignore_index"], vocab)
        cfg = _config(fields, options, shards["student"], vocab, _budget_rows(n, owner),
                      student_tensors, labels,
                      sparse=False, teacher_blocks=fused and "teacher" not in teacher_tensors)
        call = Call(cfg, sparse=False, student=tuple(student_tensors),
                    teacher=tuple(teacher_tensors), count=n)
        return _run(call, {**student_tensors, **teacher_tensors}, options, mask=mask,
                    lead_shape=lead, labels=labels, one_pass=one_pass, owner=owner)
    k = _checks.integer("k", options.k, 1, vocab)
    _checks.label_range(labels, fields["ignore_index"], vocab)
    cfg = _config(fields, options, shards["student"], vocab, _budget_rows(n, owner),
                  student_tensors, labels,
                  sparse=True, teacher_blocks=fused and "teacher" not in teacher_tensors)
    source = (LogitsSource(teacher_tensors["teacher"]) if "teacher" in teacher_tensors
              else LinearSource(*teacher_tensors.values()))
    if not fused:
        teacher = select_rows(source, k, options.top_p, options.top_p_min_k, temperature, vocab,
                              shards["teacher"], options.process_group, options.chunk_bytes,
                              backend=cfg.backend)
        return _run(_sparse_call(cfg, student_tensors, n),
                    {**student_tensors, **sparse_tensors(teacher, n)}, options, mask=mask,
                    lead_shape=lead, labels=labels, owner=owner)
    # One selection budget for the whole call (the chunks' own row counts would shrink it).
    teacher_bytes = memory.budget_bytes(options.chunk_bytes, _budget_rows(n, owner),
                                        shards["teacher"].width,
                                        source.element_size)

    def select(rows, budget=teacher_bytes):
        return select_rows(rows, k, options.top_p, options.top_p_min_k, temperature, vocab,
                           shards["teacher"], options.process_group, budget,
                           fused=True, logit_scale=cfg.teacher_logit_scale,
                           softcap=cfg.teacher_softcap, backend=cfg.backend)

    teacher_rows = None
    if one_pass:  # the [rows, K] targets exist a span of chunks at a time
        teacher_tensors = dict.fromkeys(_SPARSE_NAMES)
        if isinstance(source, LinearSource):
            source = BlockedSource(source, cfg.teacher_block_rows)
        span, budget = memory.fused_select(cfg, True, labels, shards["student"].widest, k)
        teacher_rows = _Spans(lambda rows: select(rows, budget), source, span)
    else:
        teacher_tensors = sparse_tensors(select(source), n)
    return _run(_sparse_call(cfg, student_tensors, n), {**student_tensors, **teacher_tensors},
                options, mask=mask, lead_shape=lead, labels=labels, teacher_rows=teacher_rows,
                one_pass=one_pass, owner=owner)


class _Spans:
    """``teacher_rows(start, stop)`` of a one-pass fused loss: the teacher selected ``span``
    rows at a time (from ``start`` on, in order, as the chunks ask), each span's targets held
    until a chunk asks for rows past it."""

    def __init__(self, select, source, span: int):
        self.select, self.source, self.span = select, source, span
        self.first, self.rows = 0, None

    def __call__(self, start: int, stop: int) -> SparseTeacher:
        rows = self.rows
        if rows is None or start < self.first or stop > self.first + rows.indices.shape[0]:
            self.rows = rows = None  # free the last span's targets before the next
            last = min(self.source.count, start + max(self.span, stop - start))
            rows = self.select(self.source.slice(start, last))
            self.first, self.rows = start, rows
        lo, hi = start - self.first, stop - self.first
        return SparseTeacher(rows.indices[lo:hi], rows.logprobs[lo:hi],
                             rows.rest_logprob[lo:hi], rows.temperature, rows.vocab_size)


def _sparse_teacher(student_tensors, teacher, options, names, lead, x, mask, labels, shards,
                    one_pass, owner=None):
    """The loss against a :class:`SparseTeacher` (its K, top-p and temperature are its own)."""
    if options.k is not None and options.k != teacher.k:
        raise ValueError(f"k={options.k} differs from the SparseTeacher's K={teacher.k}")
    if options.top_p is not None:
        raise ValueError("top_p applies when selecting; this SparseTeacher is already "
                         "selected (pass top_p to select_topk)")
    _checks.integer_tensor("SparseTeacher.indices", teacher.indices)
    _checks.same_leading(names["student"], lead, "teacher", teacher.indices.shape[:-1])
    _checks.sparse_teacher(teacher, _checks.teacher_mask(mask, teacher, lead),
                           masses=options.normalize == "full")
    return _rows_teacher(student_tensors, teacher, sparse_tensors(teacher, lead.numel()), options,
                         names, lead, x, mask, labels, shards, one_pass, owner)


def _sampled_teacher(student_tensors, teacher, options, names, lead, x, mask, labels, shards,
                     one_pass, owner=None):
    """The loss against a :class:`SampledTeacher`: ``-sum_i (c_i / N) log p(y_i)`` per row,
    whose gradient ``p - c / N`` w.r.t. the student's (tempered) logits is an unbiased estimate
    of forward KL's ``p - q``; plus ``sum_i (c_i / N) log q(y_i)`` (no gradient) when the
    teacher has its log-probs, making the value an unbiased estimate of ``KL(q || p)``."""
    if not isinstance(options.divergence, KL):
        raise ValueError(f"divergence={options.divergence!r} cannot be estimated without bias "
                         f"from a SampledTeacher (tokens drawn from the teacher): only forward "
                         f"KL (divergence='kl') can; use a top-K teacher for other divergences")
    if options.normalize != "full":
        raise ValueError(f"normalize={options.normalize!r} applies to top-K teachers; a "
                         f"SampledTeacher's counts already estimate the whole distribution")
    if options.top_p is not None:
        raise ValueError(f"top_p={options.top_p} applies to top-K selection; a SampledTeacher "
                         f"holds tokens drawn from the whole distribution (no nucleus to cut)")
    if options.k is not None and options.k != teacher.k:
        raise ValueError(f"k={options.k} applies to top-K teachers; a SampledTeacher has "
                         f"{teacher.samples} samples in {teacher.k} slots per row")
    _checks.integer_tensor("SampledTeacher.indices", teacher.indices)
    _checks.same_leading(names["student"], lead, "teacher", teacher.indices.shape[:-1])
    _checks.sampled_teacher(teacher, _checks.teacher_mask(mask, teacher, lead))
    n, k = lead.numel(), teacher.k
    weights = teacher.weights()
    tensors = dict(zip(_SPARSE_NAMES, (
        teacher.indices.reshape(n, k).long(),
        torch.where(weights > 0, weights.log(), float("-inf")).reshape(n, k),
        torch.full((n,), float("-inf"), device=weights.device)), strict=True))
    offset = None
    if teacher.logprobs is not None:
        logq = teacher.logprobs.float().reshape(n, k)
        offset = torch.where(weights.reshape(n, k) > 0, weights.reshape(n, k) * logq,
                             0.0).sum(-1)
    return _rows_teacher(student_tensors, teacher, tensors,
                         options.replace(divergence=SAMPLED_CE, k=None), names, lead, x, mask,
                         labels, shards, one_pass, owner, kd_offset=offset)


def _rows_teacher(student_tensors, teacher, teacher_tensors, options, names, lead, x, mask,
                  labels, shards, one_pass, owner=None, kd_offset=None):
    """The loss against a teacher given as rows of kept entries (``teacher_tensors``, the
    engine's ``[n, K]`` indices and log-probs and ``[n]`` ghost)."""
    _checks.teacher_temperature(options.temperature, teacher)
    if options.teacher_logit_scale != 1 or options.teacher_softcap is not None:
        raise ValueError(f"teacher_logit_scale={options.teacher_logit_scale} and "
                         f"teacher_softcap={options.teacher_softcap} transform teacher logits; "
                         f"a {type(teacher).__name__} holds log-probs already (transform the "
                         f"teacher's logits before selecting or sampling from them)")
    mask = _checks.teacher_mask(mask, teacher, lead)
    fields, labels = _objective(options, labels, lead, x.device)
    fields["temperature"] = teacher.temperature
    n = lead.numel()
    shard = _exchange(options, {"student": _width(student_tensors)}, n, x.device,
                      shards, fields["backend"])["student"]
    vocab = _checks.vocab_size(options.vocab_size, (names["width"], shard.total))
    desc = (f"{names['width']} {shard.total}" if "logits" not in student_tensors else
            f"student_logits width {shard.total}, vocab_size={options.vocab_size}")
    _checks.teacher_vocab(vocab, teacher, desc)
    _checks.label_range(labels, fields["ignore_index"], vocab)
    cfg = _config(fields, options, shard, vocab, _budget_rows(n, owner), student_tensors,
                  labels, sparse=True,
                  teacher_blocks=False)
    return _run(_sparse_call(cfg, student_tensors, n), {**student_tensors, **teacher_tensors},
                options, mask=mask, lead_shape=lead, labels=labels, one_pass=one_pass,
                owner=owner, kd_offset=kd_offset)


# ---- inputs -------------------------------------------------------------------------------


def check_inputs(student: tuple, teacher, options: KDOptions, mask, labels) -> None:
    """The checks of an LM-head call that need no collective (shapes, dtypes, the labels'
    range against the whole vocabulary), for :mod:`topkd.sharded` to run before its first
    collective; ``weight`` may be a DTensor (its shape is the whole head's)."""
    hidden, weight, bias = (*student, None)[:3]
    _check_linear("", hidden, weight, bias)
    lead = hidden.shape[:-1]
    _checks.mask(mask, lead)
    names = {"student": "hidden", "teacher": "teacher logits"}
    if isinstance(teacher, (SparseTeacher, SampledTeacher)):
        _checks.integer_tensor(f"{type(teacher).__name__}.indices", teacher.indices)
        _checks.same_leading("hidden", lead, "teacher", teacher.indices.shape[:-1])
        keep = _checks.teacher_mask(mask, teacher, lead)
        if isinstance(teacher, SampledTeacher):
            _checks.sampled_teacher(teacher, keep)
        else:
            _checks.sparse_teacher(teacher, keep, masses=options.normalize == "full")
    else:
        _teacher_input(teacher, lead, True, names)
    flat = _checks.labels(labels, lead, hidden.device)
    if flat is None and options.ce_weight != 0:
        raise ValueError(f"ce_weight={options.ce_weight} needs labels= (the hard-label term)")
    vocab = options.vocab_size or weight.shape[0]
    _checks.label_range(flat, options.ignore_index, vocab)
    if options.k is not None:
        _checks.integer("k", options.k, 1, vocab)


def _student_head(student: tuple, options: KDOptions, mask):
    """A student LM head's tensors by name, checked, and the names its messages use."""
    if len(student) not in (2, 3):
        raise TypeError(f"student must be logits or (hidden, weight[, bias]), got a tuple of "
                        f"length {len(student)}")
    hidden, weight, bias = (*student, None)[:3]
    _check_linear("", hidden, weight, bias)
    _checks.mask(mask, hidden.shape[:-1])
    if options.reduce_hidden_grad and options.process_group is not None:
        hidden = AllReduceGradient.apply(hidden, options.process_group)
    names = {"student": "hidden", "width": "weight rows", "teacher": "teacher logits",
             "teacher_width": "teacher width"}
    return dict(zip(_HEAD_NAMES, (hidden, weight, bias), strict=True)), names


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


def _teacher_input(teacher, lead_shape, fused: bool, names: dict):
    """``(tensors by name, width)`` of a teacher given as logits or (with an LM-head student)
    ``(hidden, weight[, bias])``; detached."""
    if isinstance(teacher, torch.Tensor):
        _checks.logits(names["teacher"], teacher)
        _checks.same_leading(names["student"], lead_shape, names["teacher"],
                             teacher.shape[:-1])
        return {"teacher": teacher.detach()}, teacher.shape[-1]
    if fused and isinstance(teacher, tuple) and len(teacher) in (2, 3):
        hidden, weight, bias = (*teacher, None)[:3]
        _check_linear("teacher ", hidden, weight, bias)
        _checks.same_leading("hidden", lead_shape, "teacher hidden", hidden.shape[:-1])
        tensors = (None if t is None else t.detach() for t in (hidden, weight, bias))
        return dict(zip(_TEACHER_HEAD_NAMES, tensors, strict=True)), weight.shape[0]
    if not fused:
        raise TypeError(f"teacher_logits must be a torch.Tensor, got {type(teacher).__name__}")
    raise TypeError(
        "teacher must be teacher logits [..., V_r], a topkd.SparseTeacher (fused_topk_kl_loss "
        f"only) or a tuple (teacher_hidden, teacher_weight[, teacher_bias]), got "
        f"{type(teacher).__name__}" + (f" of length {len(teacher)}" if isinstance(teacher, tuple)
                                       else "")
    )


def _exchange(options: KDOptions, widths: dict, n: int, device, shards, backend):
    """This rank's shard of each tensor in ``widths``: exchanged here (with ``backend``, which
    every rank must share), or the caller's; then the backend must be one that can run
    (:func:`topkd.backends.ready`)."""
    if shards is None:
        shards = parallel.exchange_shards(options.process_group, widths, n, device,
                                          same=backends.across_ranks(backend, options))
        backends.ready(backend)
        return shards
    backends.ready(backend)
    if set(widths) - set(shards):
        raise ValueError(f"shards must hold {sorted(widths)}, got {sorted(shards)}")
    for name, width in widths.items():
        if shards[name].width != width:
            raise ValueError(f"shards[{name!r}] is {shards[name].width} columns wide on this "
                             f"rank but the {name} has {width}")
    return shards


def _width(student_tensors: dict) -> int:
    """The student's vocabulary columns on this rank."""
    if "logits" in student_tensors:
        return student_tensors["logits"].shape[-1]
    return student_tensors["weight"].shape[0]


def sparse_tensors(teacher: SparseTeacher, n: int) -> dict:
    """A :class:`SparseTeacher`'s tensors as the engine takes them (``[n, K]``, ``[n]``)."""
    k, indices = teacher.k, teacher.indices
    if indices.dtype not in (torch.int32, torch.int64):  # (gather takes no narrower index)
        indices = indices.long()
    logq, rest = (t.float() if t.dtype == torch.float64 else t  # (the loss is float32)
                  for t in (teacher.logprobs, teacher.rest_logprob))
    return dict(zip(_SPARSE_NAMES, (indices.reshape(n, k), logq.reshape(n, k), rest.reshape(n)),
                    strict=True))


def _objective(options: KDOptions, labels, lead_shape, device):
    """The engine's config fields that come from the options, and the labels flattened (int64
    ``[n]`` on ``device``)."""
    labels = _checks.labels(labels, lead_shape, device)
    if labels is None and options.ce_weight != 0:
        raise ValueError(f"ce_weight={options.ce_weight} needs labels= (the hard-label term)")
    fields = {"divergence": options.divergence, "kd_weight": options.kd_weight,
              "ce_weight": options.ce_weight, "ignore_index": options.ignore_index,
              "normalize": options.normalize, "logit_scale": options.logit_scale,
              "softcap": options.softcap, "teacher_logit_scale": options.teacher_logit_scale,
              "teacher_softcap": options.teacher_softcap,
              "backend": backends.choose(options.impl, device, options.process_group)}
    return fields, labels


def _one_pass(tensors, reduction) -> bool:
    """Whether a fused loss writes its gradients in forward (a scalar loss being trained)."""
    return (reduction != "none" and torch.is_grad_enabled()
            and any(t is not None and t.requires_grad for t in tensors))


# ---- the engine's configuration ------------------------------------------------------------


def _budget_rows(n: int, owner) -> int:
    """The rows the default memory budget is cut for: all of them, or, for a batch gathered
    over a mesh (:mod:`topkd.sharded`), one rank's share. A rank then works on ``world``
    times the rows over ``1/world`` of the vocabulary in blocks as tall as one process's, so
    its work memory shrinks with the mesh like the head itself."""
    return n if owner is None else owner.rows


def _config(fields, options, shard, vocab, n, student_tensors, labels, *, sparse,
            teacher_blocks) -> Config:
    group, chunk_bytes = options.process_group, options.chunk_bytes
    if "logits" in student_tensors:
        return _logits_config(fields, shard, vocab, group, chunk_bytes, n,
                              student_tensors["logits"].element_size(), labels, sparse)
    return _fused_config(fields, shard, vocab, group, chunk_bytes, n, student_tensors["hidden"],
                         student_tensors["weight"], labels, sparse, teacher_blocks)


def _logits_config(fields, shard, vocab, group, chunk_bytes, n, element_size, labels,
                   sparse) -> Config:
    cfg = Config(offset=shard.offset, valid=shard.valid(vocab), group=group, **fields)
    per, backward = memory.logits_rows(cfg, sparse, labels, chunk_bytes, n, shard.widest,
                                       element_size)
    return Config(**{**cfg.__dict__, "rows_per_chunk": per, "backward_rows_per_chunk": backward})


def _fused_config(fields, shard, vocab, group, chunk_bytes, n, hidden, weight, labels, sparse,
                  teacher_blocks) -> Config:
    cfg = Config(offset=shard.offset, valid=shard.valid(vocab), group=group, **fields)
    dtype = product_dtype(hidden.dtype, weight.dtype)
    per, block, teacher_block = memory.fused_rows(cfg, sparse, labels, chunk_bytes,
                                                  shard.widest, n, dtype, hidden.device,
                                                  teacher_blocks)
    return Config(**{**cfg.__dict__, "rows_per_chunk": per, "block_rows": block,
                     "teacher_block_rows": teacher_block})


def _sparse_call(cfg: Config, student_tensors: dict, n: int) -> Call:
    return Call(cfg, sparse=True, student=tuple(student_tensors), teacher=_SPARSE_NAMES,
                count=n)


# ---- running and reducing ------------------------------------------------------------------


def _run(call: Call, tensors: dict, options: KDOptions, *, mask, lead_shape, labels,
         teacher_rows=None, one_pass=False, owner: RowOwner | None = None, kd_offset=None):
    """Run the engine for a checked call and reduce the rows: ``kd_weight * KD + ce_weight *
    CE``, each averaged over its own rows for ``"mean"``. With ``owner``, over this rank's rows
    of a gathered batch only. ``kd_offset``: per-row constants (``[n]``, no gradient) added to
    the KD rows."""
    cfg, n, reduction = call.config, call.count, options.reduction
    named = dict(tensors, labels=labels)
    args = [named.get(name) for name in call.names]
    device = next(t.device for t in args if isinstance(t, torch.Tensor))
    keep = None if mask is None else mask.reshape(n)
    has_label = None if labels is None else labels != cfg.ignore_index
    keep_ce = has_label if keep is None else (None if has_label is None else keep & has_label)
    if one_pass:
        if owner is None:
            weights = tuple(row_weights(keep, labels, options, n, device).unbind(-1))
        else:
            weights = tuple(owner.weights.unbind(-1))
            call = dataclasses.replace(call, own=(owner.start, owner.count))
        loss, kd, ce = ScalarLoss.apply(call, weights, teacher_rows, *args)
        if kd_offset is not None:  # (this rank's rows only, with an owner)
            own = slice(None) if owner is None else slice(owner.start,
                                                          owner.start + owner.count)
            constant = (weights[0][own] * kd_offset[own]).sum()
            loss, kd = loss + cfg.kd_weight * constant, kd + constant
        return LossParts(loss, kd, ce) if options.return_components else loss
    kd_rows, ce_rows = RowLoss.apply(call, *args)
    if kd_offset is not None:
        kd_rows = kd_rows + kd_offset
    if owner is not None:  # this rank's rows; backward gathers every rank's upstream
        kd_rows, ce_rows = (parallel.OwnRows.apply(x, owner.group, owner.start, owner.count,
                                                   owner.rows) for x in (kd_rows, ce_rows))
        lead_shape, keep = owner.lead_shape, owner.keep
        if labels is not None:
            has_label = labels[owner.start:owner.start + owner.count] != cfg.ignore_index
            keep_ce = has_label if keep is None else keep & has_label
    kd = reduce_rows(kd_rows, keep, reduction, lead_shape)
    ce = reduce_rows(ce_rows, keep_ce, reduction, lead_shape)
    loss = cfg.kd_weight * kd + cfg.ce_weight * ce if labels is not None else cfg.kd_weight * kd
    if options.return_components:
        return LossParts(loss, kd.detach(), ce.detach())
    return loss


def row_weights(keep, labels, options: KDOptions, n: int, device) -> torch.Tensor:
    """``[n, 2]``: each row's (KD, CE) upstream gradient under ``options.reduction`` (scalar
    reductions), from the rows ``keep`` keeps and the ``labels`` (``[n]`` or None)."""
    kd = _row_weights(keep, n, options.reduction, device)
    if labels is None:
        return torch.stack([kd, torch.zeros_like(kd)], -1)
    has = labels.to(device) != options.ignore_index
    keep_ce = has if keep is None else keep & has
    return torch.stack([kd, _row_weights(keep_ce, n, options.reduction, device)], -1)


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
