"""The chunk engine: one driver that every loss runs through.

Per chunk of rows the driver asks a *path* to read the chunk and compute its statistics, the
path combines them across tensor-parallel ranks (the collectives are
:mod:`topkd.parallel`'s, called from here per chunk: two all-reduces on the Top-K path, three
on the full-vocabulary path), computes each row's KD and CE values, and, when the upstream
gradient is known, the chunk's gradient, which goes to a *sink* (the logits' gradient, or a
fused LM head's hidden, weight and bias gradients). Two paths:

- :class:`SparsePath`: the teacher is K kept entries plus a ghost bucket per row (a
  :class:`~topkd.SparseTeacher`, given or selected chunk by chunk); the divergence runs by
  autograd over the ``[rows, K+1]`` buckets.
- :class:`DensePath`: the teacher is a whole distribution (logits or an LM head); the
  divergence's terms run over every vocabulary entry.

The per-chunk math is a *backend*'s (:mod:`topkd.backends`: eager or compiled, chosen once per
call and held by the :class:`Config`); the paths call its stages and never ask which it is.
The rows per chunk come from :mod:`topkd.memory`.

Two autograd Functions use the driver: :class:`RowLoss` returns per-row values and writes the
gradient in backward (a second pass); :class:`ScalarLoss`, for a loss reduced to a scalar,
writes the gradients in forward (one pass) and saves them for backward to scale.

Every rank cuts the same chunks (from numbers the ranks share), since the statistics are
combined chunk by chunk.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from . import backends, parallel
from .backends import Backend
from .divergences import Divergence
from .kernels import finite_or_zero
from .memory import row_chunks
from .sources import BlockedSource, LinearSource, LogitsSource


class LossParts(NamedTuple):
    """``return_components=True``: the loss, and its KD and CE parts (detached, float32)."""

    loss: torch.Tensor
    kd: torch.Tensor
    ce: torch.Tensor


@dataclass(frozen=True)
class Config:
    """Everything but tensors that a loss call needs; travels as one object."""

    divergence: Divergence
    temperature: float
    normalize: str = "full"
    kd_weight: float = 1.0
    ce_weight: float = 0.0
    ignore_index: int = -100
    logit_scale: float = 1.0
    softcap: float | None = None
    teacher_logit_scale: float = 1.0
    teacher_softcap: float | None = None
    offset: int = 0  # this rank's first vocabulary column
    valid: int = 0  # this rank's columns below vocab_size
    group: Any = None
    rows_per_chunk: int = 1
    backward_rows_per_chunk: int = 0  # backward has no collectives: its own chunks (0 = same)
    block_rows: int = 0  # fused: student block rows (0 = logits)
    teacher_block_rows: int = 0  # fused: a (hidden, weight) teacher's block rows
    backend: Backend = backends.EAGER  # impl: the backend that runs the per-chunk stages


def local_columns(indices: torch.Tensor, offset: int, valid: int) -> torch.Tensor:
    """This shard's column of each global index; indices that are negative, on another rank or
    padding point at the spare column ``valid``, so gathers and scatters need no masks."""
    local = indices - offset
    on_rank = (indices >= 0) & (local >= 0) & (local < valid)
    return torch.where(on_rank, local, torch.full_like(local, valid))


# ---- the hard-label term's bookkeeping ---------------------------------------------------


class _Labels:
    """Per chunk: the label's column here (spare when ignored or on another rank) and which
    rows have a label. ``folded``: at temperature 1 the CE term shares the KD normalizer."""

    def __init__(self, labels: torch.Tensor | None, cfg: Config):
        self.labels = labels
        self.cfg = cfg
        self.folded = cfg.temperature == 1.0

    def columns(self, start: int, stop: int):
        if self.labels is None:
            return None
        return local_columns(self._real(start, stop), self.cfg.offset, self.cfg.valid)

    def _real(self, start, stop):
        labels = self.labels[start:stop]
        return torch.where(labels == self.cfg.ignore_index, -1, labels)

    @property
    def own_normalizer(self) -> bool:
        """Whether the CE term needs its own temperature-1 normalizer (labels at T != 1)."""
        return self.labels is not None and not self.folded

    def has(self, start: int, stop: int):
        return self.labels[start:stop] != self.cfg.ignore_index

    def upstream(self, g_ce):
        """The CE rows' upstream gradient as the backends take it: None without labels."""
        return None if self.labels is None else g_ce

    def folded_upstream(self, g_kd, g_ce):
        """The CE's upstream gradient where it shares the KD normalizer, else 0."""
        if self.labels is not None and self.folded:
            return g_ce
        return torch.zeros_like(g_kd)


def _ce_rows(has, norm_max, norm_sum, z_label):
    """``-log softmax(z)_label = (max - z_label) + log sum`` on rows with a label, else 0."""
    ce = (finite_or_zero(norm_max) - z_label) + norm_sum.log()
    return torch.where(has, ce, 0.0)


# ---- paths --------------------------------------------------------------------------------


class SparsePath:
    """The student against K kept teacher entries and a ghost bucket per row.

    ``teacher_rows(start, stop)`` gives the chunk's :class:`~topkd.SparseTeacher` rows (as
    ``[r, K]``); in backward only the saved columns are used."""

    def __init__(self, cfg: Config, backend: Backend, student, teacher_rows, labels):
        self.cfg, self.backend = cfg, backend
        self.student, self.teacher_rows = student, teacher_rows
        self.labels = _Labels(labels, cfg)
        # Row statistics that backward remakes per chunk, so :class:`RowLoss` does not save
        # them (the kept values: the combined ones come from the one rank holding each
        # column; elsewhere the gradient goes to the spare column).
        self.remade = backend.sparse_remade

    def forward(self, start: int, stop: int):
        """The chunk's statistics (its rows' values come from :meth:`values`)."""
        cfg, labels = self.cfg, self.labels
        teacher = self.teacher_rows(start, stop)
        r, k = stop - start, teacher.indices.shape[-1]
        columns = local_columns(teacher.indices.reshape(r, k), cfg.offset, cfg.valid)
        low = self.student.low_chunk(start, stop, cfg.valid)
        state, (selected, rest_max, rest_sum, z_label, ce_norm) = self.backend.sparse_statistics(
            cfg, low, columns, labels.columns(start, stop), labels.own_normalizer)
        # combine: one MAX (kept values, ghost max, label logit, CE max), one SUM (the ghost's
        # and the CE's sums, relative to their maxima)
        maxima = [selected, rest_max[:, None]] + ([] if z_label is None else [z_label[:, None]])
        maxima += [] if ce_norm is None else [ce_norm[0][:, None]]
        sums = [rest_sum[:, None]] + ([] if ce_norm is None else [ce_norm[1][:, None]])
        maxima, sums = parallel.combine_statistics(maxima, sums, [k, k + 2][:len(sums)],
                                                   cfg.group)
        stats = self._statistics(maxima[0], maxima[1][:, 0], sums[0][:, 0], columns)
        stats["logq_sel"] = teacher.logprobs.reshape(r, k)
        stats["logq_rest"] = teacher.rest_logprob.reshape(r)
        if z_label is not None:
            stats["z_label"] = maxima[2][:, 0]
        if ce_norm is not None:
            stats["ce_max"], stats["ce_sum"] = maxima[3][:, 0], sums[1][:, 0]
        return state, stats

    def values(self, stats: dict, start: int, stop: int) -> None:
        """Add the rows' KD, its gradient w.r.t. the buckets, and CE to ``stats`` (those of one
        chunk, or of all of them at once when the gradient waits for backward)."""
        labels = self.labels
        logq = stats.pop("logq_sel"), stats.pop("logq_rest")
        stats["kd"], stats["grad_sel"], stats["grad_rest"] = self.backend.kernel(bucket_values)(
            self.cfg.divergence, self.cfg.normalize == "topk", stats["selected"],
            stats["row_max"], stats["total"], stats["rest_max"], stats["rest_sum"], *logq)
        if labels.labels is not None:
            has = labels.has(start, stop)
            if labels.folded:
                stats["ce"] = _ce_rows(has, stats["row_max"], stats["total"], stats["z_label"])
            else:
                stats["ce"] = _ce_rows(has, stats["ce_max"], stats["ce_sum"], stats["z_label"])

    @staticmethod
    def _statistics(selected, rest_max, rest_sum, columns):
        row_max = finite_or_zero(torch.maximum(selected.amax(-1), rest_max))
        total = torch.exp(selected - row_max[:, None]).sum(-1)
        total += rest_sum * torch.exp(rest_max - row_max)
        return {"columns": columns.int(), "selected": selected, "row_max": row_max,
                "total": total, "rest_max": rest_max, "rest_sum": rest_sum}

    def refresh(self, start, stop, stats):
        low = self.student.low_chunk(start, stop, self.cfg.valid)
        return self.backend.sparse_refresh(self.cfg, low, stats["columns"].long(),
                                           self.labels.columns(start, stop), stats)

    def _upstream(self, stats, g_kd, g_ce):
        """``(grad_sel, grad_norm, grad_rest)``: the rows' upstream gradients of the kept
        values, the log-normalizer (the folded CE's included) and the ghost."""
        grad_sel = stats["grad_sel"] * g_kd[:, None]
        grad_rest = stats["grad_rest"] * g_kd
        grad_norm = -(grad_sel.sum(-1) + grad_rest)
        if self.labels.labels is not None and self.labels.folded:
            grad_norm = grad_norm + g_ce
        return grad_sel, grad_norm, grad_rest

    def gradient(self, state, stats, g_kd, g_ce, dtype, out=None):
        """The chunk's ``d loss / d (logits)`` (in ``dtype``, the sink's, or float32), in
        ``out`` (the sink's rows) where the backend writes there."""
        return self.backend.sparse_gradient(self.cfg, state, stats,
                                            self._upstream(stats, g_kd, g_ce),
                                            self.labels.upstream(g_ce), dtype, out)


def bucket_values(divergence, renormalize: bool, selected, row_max, total, rest_max, rest_sum,
                  logq_sel, logq_rest):
    """``(kd [r], grad_sel [r, K], grad_rest [r])``: per row, the KD over the buckets and its
    gradient w.r.t. the student's bucket log-probabilities (by ``torch.func.grad``, so a
    compiling backend fuses value and gradient into one kernel), from the combined statistics
    (``selected`` ``[r, K]``, the others ``[r]``) and the teacher's ``logq_sel`` ``[r, K]`` and
    ``logq_rest`` ``[r]``. ``renormalize`` (``normalize="topk"``): both sides renormalized
    over the kept entries, the ghost left out (its gradient 0). A divergence that ignores the
    student (``SkewKL(1)``) gets a zero gradient."""
    log_total = total.log()
    logp_sel = (selected - row_max[:, None]) - log_total[:, None]
    logp_rest = (rest_max - row_max) + rest_sum.log() - log_total

    def kd_of(logp_sel, logp_rest):
        if renormalize:
            kd = divergence.buckets(_renormalize(logp_sel), _renormalize(logq_sel))
        else:
            kd = divergence.buckets(torch.cat([logp_sel, logp_rest[:, None]], -1),
                                    torch.cat([logq_sel, logq_rest[:, None]], -1))
        return kd.sum(), kd

    (grad_sel, grad_rest), kd = torch.func.grad(kd_of, argnums=(0, 1), has_aux=True)(
        logp_sel, logp_rest)
    return kd, grad_sel, grad_rest


def _renormalize(logp: torch.Tensor) -> torch.Tensor:
    """``logp`` renormalized over its finite entries; a row with none stays all ``-inf``."""
    any_live = torch.isfinite(logp).any(-1, keepdim=True)
    safe = torch.where(any_live, logp, torch.zeros_like(logp))
    return logp - torch.logsumexp(safe, dim=-1, keepdim=True)


class DensePath:
    """The student against the teacher's whole distribution (logits or an LM head)."""

    remade = ()

    def __init__(self, cfg: Config, backend: Backend, student, teacher, labels):
        self.cfg, self.backend = cfg, backend
        self.student, self.teacher = student, teacher
        self.labels = _Labels(labels, cfg)

    def _lows(self, start, stop):
        valid = self.cfg.valid
        return (self.student.low_chunk(start, stop, valid),
                self.teacher.low_chunk(start, stop, valid))

    def forward(self, start: int, stop: int):
        cfg, labels = self.cfg, self.labels
        state, local_max, local_sum, z_label, ce_norm = self.backend.dense_statistics(
            cfg, *self._lows(start, stop), labels.columns(start, stop), labels.own_normalizer)

        # combine 1: maxima (student, teacher, label logit, CE max) and sums
        maxima = [local_max] + ([] if z_label is None else [z_label[:, None]])
        maxima += [] if ce_norm is None else [ce_norm[0][:, None]]
        sums = [local_sum] + ([] if ce_norm is None else [ce_norm[1][:, None]])
        maxima, sums = parallel.combine_statistics(maxima, sums, [0, 1, 3][:len(sums) + 1],
                                                   cfg.group)
        row_max, row_sum = maxima[0], sums[0]
        log_shift, inverse_sum = row_sum.log(), row_sum.reciprocal()
        if cfg.group is not None:  # this shard's maxima below the global ones
            shift = finite_or_zero(row_max) - finite_or_zero(local_max)
            log_shift, inverse_sum = log_shift + shift, inverse_sum * torch.exp(-shift)
        f_sum, h_sum, state = self.backend.dense_terms(cfg, state, local_max, log_shift,
                                                       inverse_sum)
        # combine 2: the divergence's row sums
        kd, h_sum = parallel.sum_rows([f_sum, h_sum], cfg.group)
        stats = {"row_max": row_max, "row_sum": row_sum, "h_sum": h_sum, "kd": kd}
        if labels.labels is not None:
            has = labels.has(start, stop)
            if labels.folded:
                stats["ce"] = _ce_rows(has, row_max[:, 0], row_sum[:, 0], maxima[1][:, 0])
            else:
                stats["ce_max"], stats["ce_sum"] = maxima[2][:, 0], sums[1][:, 0]
                stats["ce"] = _ce_rows(has, stats["ce_max"], stats["ce_sum"], maxima[1][:, 0])
        return state, stats

    def values(self, stats: dict, start: int, stop: int) -> None:
        """Nothing: the terms need the chunk itself, so :meth:`forward` made the values."""

    def refresh(self, start, stop, stats):
        return self.backend.dense_refresh(self.cfg, *self._lows(start, stop),
                                          self.labels.columns(start, stop),
                                          stats["row_max"], stats["row_sum"])

    def gradient(self, state, stats, g_kd, g_ce, dtype, out=None):
        labels = self.labels
        return self.backend.dense_gradient(self.cfg, state, stats, g_kd,
                                           labels.folded_upstream(g_kd, g_ce),
                                           labels.upstream(g_ce), dtype, out)


# ---- the driver ---------------------------------------------------------------------------


def _cat_stats(parts: list[dict]) -> dict:
    if not parts:
        return {}
    return {key: torch.cat([p[key] for p in parts]) for key in parts[0]}


def _slice_stats(stats: dict, start: int, stop: int) -> dict:
    return {key: value[start:stop] for key, value in stats.items()}


def _idle_rows(g_kd: torch.Tensor, g_ce: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    """The rows whose upstream gradients are both 0 (a mask dropped them, or a weight of 0),
    ascending, on the host (one sync per call) and on the gradients' device. Their gradient
    is written as 0: computed, it is 0 times the row's terms, which are NaN where the row's
    inputs hold a NaN or an infinity (a teacher's padding row, say), and through a fused head
    a NaN row would make all of the weight's gradient NaN."""
    rows = ((g_kd == 0) & (g_ce == 0)).nonzero()[:, 0]
    return rows.tolist(), rows


def _zero_rows(grad: torch.Tensor, idle: tuple, start: int, stop: int) -> torch.Tensor:
    """``grad`` (the rows ``[start, stop)``) with the rows of ``idle`` among them set to 0
    (no host sync: the rows' indices are sliced on the device)."""
    listed, rows = idle
    lo, hi = bisect.bisect_left(listed, start), bisect.bisect_left(listed, stop)
    if lo < hi:
        grad.index_fill_(0, rows[lo:hi].to(grad.device) - start, 0)
    return grad


def sweep_forward(path, count: int, per: int, sink=None, weights=None):
    """Every chunk's statistics and row values; with ``sink`` (and per-row ``weights``, the
    upstream gradients of the KD and CE rows) each chunk's gradient too, in the same pass.
    Returns the rows' statistics and values (only ``kd`` and ``ce`` with a sink)."""
    parts = []
    idle = None if sink is None else _idle_rows(*weights)
    for start, stop in row_chunks(count, per):
        state, stats = path.forward(start, stop)
        if sink is not None:
            path.values(stats, start, stop)
            w_kd, w_ce = weights[0][start:stop], weights[1][start:stop]
            grad = path.gradient(state, stats, w_kd, w_ce, sink.chunk_dtype,
                                 sink.destination(start, stop))
            sink.add(start, stop, _zero_rows(grad, idle, start, stop), path.cfg.valid)
            stats = {key: stats[key] for key in ("kd", "ce") if key in stats}
            del grad
        del state  # free this chunk's buffers before the next is made
        parts.append(stats)
    if sink is not None:
        sink.finish(path.cfg.valid)
    stats = _cat_stats(parts)
    if sink is None and stats:
        path.values(stats, 0, count)  # the rows' values at once: fewer small operations
    return stats


def sweep_backward(path, count: int, per: int, stats: dict, g_kd, g_ce, sink) -> None:
    """Each chunk's gradient from the saved row statistics and the rows' upstream gradients."""
    idle = _idle_rows(g_kd, g_ce)
    for start, stop in row_chunks(count, per):
        part = _slice_stats(stats, start, stop)
        state = path.refresh(start, stop, part)
        grad = path.gradient(state, part, g_kd[start:stop], g_ce[start:stop], sink.chunk_dtype,
                             sink.destination(start, stop))
        sink.add(start, stop, _zero_rows(grad, idle, start, stop), path.cfg.valid)
        del state, grad  # free this chunk's buffers before the next is made
    sink.finish(path.cfg.valid)


# ---- what a call is made of ----------------------------------------------------------------


@dataclass(frozen=True)
class Call:
    """A loss call without its tensors: the config, which path, and the names of the tensors
    given to the autograd Functions (in that order; ``student`` names first)."""

    config: Config
    sparse: bool
    student: tuple[str, ...]  # ("logits",) or ("hidden", "weight", "bias")
    teacher: tuple[str, ...]  # sparse: ("indices", "logprobs", "rest"); dense: logits or LM head
    count: int
    # a batch gathered over config.group whose rows [start, start + count) are this rank's:
    # the loss is over those, the gradients over every rank's (topkd.sharded)
    own: tuple[int, int] | None = None

    @property
    def names(self) -> tuple[str, ...]:
        return self.student + self.teacher + ("labels",)

    def student_source(self, named: dict, blocked: bool):
        if self.student == ("logits",):
            return LogitsSource(named["logits"])
        source = LinearSource(named["hidden"], named["weight"], named["bias"],
                              stage_rows=self.config.block_rows)
        return BlockedSource(source, self.config.block_rows) if blocked else source

    def teacher_source(self, named: dict):
        if "teacher" in named:
            return LogitsSource(named["teacher"])
        source = LinearSource(named["teacher_hidden"], named["teacher_weight"],
                              named["teacher_bias"])
        return BlockedSource(source, self.config.teacher_block_rows)

    def backend(self) -> Backend:
        """The backend that runs this call's chunks: the configured one's runner; a shard that
        is all vocabulary padding runs eager (nothing to compute; its chunks stay those the
        configured backend cut, as on every other rank)."""
        cfg = self.config
        return cfg.backend.runner(cfg.divergence, self.sparse) if cfg.valid else backends.EAGER

    def path(self, named: dict, blocked: bool, teacher_rows=None):
        cfg = self.config
        student = self.student_source(named, blocked)
        if self.sparse:
            if teacher_rows is None:
                teacher_rows = _given_rows(named)
            path = SparsePath(cfg, self.backend(), student, teacher_rows, named["labels"])
        else:
            path = DensePath(cfg, self.backend(), student, self.teacher_source(named),
                             named["labels"])
        return path, student


class _Slice(NamedTuple):
    indices: torch.Tensor
    logprobs: torch.Tensor
    rest_logprob: torch.Tensor


def _given_rows(named):
    indices, logprobs, rest = named["indices"], named["logprobs"], named["rest"]

    def teacher_rows(start, stop):
        return _Slice(indices[start:stop], logprobs[start:stop], rest[start:stop])

    return teacher_rows


class RowLoss(torch.autograd.Function):
    """``(call, *tensors) -> (kd [n], ce [n])`` float32; the gradient is written in backward
    from saved per-row statistics (a second pass over the chunks)."""

    @staticmethod
    def forward(ctx, call: Call, *tensors):
        named = dict(zip(call.names, tensors, strict=True))
        path, _ = call.path(named, blocked=False)
        stats = sweep_forward(path, call.count, call.config.rows_per_chunk)
        kd = stats.pop("kd", None)
        ce = stats.pop("ce", None)
        kd = torch.zeros(call.count, device=_device(tensors)) if kd is None else kd
        ce = torch.zeros_like(kd) if ce is None else ce
        for key in path.remade:  # backward makes these again, a chunk at a time
            stats.pop(key, None)
        keep = [name for name in call.names if name not in ("indices", "logprobs", "rest")]
        ctx.call, ctx.keys, ctx.kept = call, tuple(stats), tuple(keep)
        ctx.save_for_backward(*(named[n] for n in keep), *stats.values())
        return kd, ce

    @staticmethod
    def backward(ctx, g_kd, g_ce):
        call = ctx.call
        saved = ctx.saved_tensors
        named = dict.fromkeys(call.names)
        named.update(zip(ctx.kept, saved[:len(ctx.kept)], strict=True))
        stats = dict(zip(ctx.keys, saved[len(ctx.kept):], strict=True))
        path, student = call.path(named, blocked=False, teacher_rows=lambda *_: None)
        needs = ctx.needs_input_grad[1:1 + len(call.student)]
        sink = student.gradient(needs, call.config.backend)
        g_ce = torch.zeros_like(g_kd) if g_ce is None else g_ce
        g_kd = torch.zeros_like(g_ce) if g_kd is None else g_kd
        cfg = call.config
        per = cfg.backward_rows_per_chunk or cfg.rows_per_chunk
        sweep_backward(path, call.count, per, stats, g_kd, g_ce, sink)
        grads = sink.result()
        return (None, *grads, *(None,) * (len(call.names) - len(grads)))


class ScalarLoss(torch.autograd.Function):
    """``(call, weights, teacher_rows, *tensors) -> (loss, kd, ce)`` scalars: ``loss = sum
    w_kd * kd_rows + sum w_ce * ce_rows`` with the gradients computed in the same pass and
    saved; backward scales them by the upstream gradient (new tensors, so a second backward
    sees the same values). ``kd``/``ce`` are the parts for logging (non-differentiable).

    With ``call.own`` (a batch gathered over the group, :mod:`topkd.sharded`) the returned
    values sum this rank's rows only, while the gradients are those of every rank's rows: the
    upstream gradient must then be the same on every rank, which backward checks
    (:func:`topkd.parallel.same_upstream`)."""

    @staticmethod
    def forward(ctx, call: Call, weights, teacher_rows, *tensors):
        # weights: per-row (KD, CE) reduction weights: mask / count for "mean"
        named = dict(zip(call.names, tensors, strict=True))
        path, student = call.path(named, blocked=True, teacher_rows=teacher_rows)
        sink = student.gradient(ctx.needs_input_grad[3:3 + len(call.student)],
                                call.config.backend)
        cfg = call.config
        upstream = (weights[0] * cfg.kd_weight, weights[1] * cfg.ce_weight)
        stats = sweep_forward(path, call.count, cfg.rows_per_chunk, sink, upstream)
        device = _device(tensors)
        parts = []
        for key, weight in zip(("kd", "ce"), weights, strict=True):
            values = stats.get(key)
            if values is None:
                parts.append(torch.zeros((), device=device))
                continue
            if call.own is not None:  # this rank's rows of a gathered batch
                start, count = call.own
                values, weight = values[start:start + count], weight[start:start + count]
            parts.append(torch.where(weight != 0, values * weight, 0.0).sum())
        loss = cfg.kd_weight * parts[0] + cfg.ce_weight * parts[1]
        accumulators = sink.accumulators()
        inputs = (student.source.inputs if isinstance(student, BlockedSource)
                  else student.inputs)
        ctx.likes = [None if a is None else (x.dtype, x.shape)
                     for a, x in zip(accumulators, inputs, strict=True)]
        ctx.save_for_backward(*(a for a in accumulators if a is not None))
        ctx.count = len(call.names)
        ctx.group = cfg.group if call.own is not None else None
        ctx.mark_non_differentiable(parts[0], parts[1])
        return loss, parts[0], parts[1]

    @staticmethod
    def backward(ctx, grad, _kd, _ce):
        saved = iter(ctx.saved_tensors)
        if ctx.group is not None:  # the gradients hold every rank's rows: one scale for all
            grad = parallel.same_upstream(grad, ctx.group)
        unit = bool(grad == 1)
        grads = []
        for like in ctx.likes:
            if like is None:
                grads.append(None)
                continue
            acc = next(saved)
            # a new tensor either way: the accumulators stay as they are for another backward
            if unit:
                out = acc.clone() if acc.dtype == like[0] else acc.to(like[0])
            else:
                out = (acc.float() * grad.float()).to(like[0])
            grads.append(out.view(like[1]))
        return (None, None, None, *grads, *(None,) * (ctx.count - len(grads)))


def _device(tensors) -> torch.device:
    return next(t.device for t in tensors if isinstance(t, torch.Tensor))
