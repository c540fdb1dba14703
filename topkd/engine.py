"""The chunk engine: one driver that every loss runs through.

Per chunk of rows the driver asks a *path* to read the chunk and compute its statistics, the
path combines them across tensor-parallel ranks (every collective of the losses is in
``_combine*`` below), computes each row's KD and CE values, and, when the upstream gradient
is known, the chunk's gradient, which goes to a *sink* (the logits' gradient, or a fused LM
head's hidden, weight and bias gradients). Two paths:

- :class:`SparsePath`: the teacher is K kept entries plus a ghost bucket per row (a
  :class:`~topkd.SparseTeacher`, given or selected chunk by chunk); the divergence runs by
  autograd over the ``[rows, K+1]`` buckets.
- :class:`DensePath`: the teacher is a whole distribution (logits or an LM head); the
  divergence's terms run over every vocabulary entry.

With ``impl="compile"`` the paths' compiled twins (:class:`CompiledSparsePath`,
:class:`CompiledDensePath`) run the per-chunk math as kernels of :mod:`topkd.compiled`; the
driver, the combines and the autograd Functions are the same.

Two autograd Functions use the driver: :class:`RowLoss` returns per-row values and writes the
gradient in backward (a second pass); :class:`ScalarLoss`, for a loss reduced to a scalar,
writes the gradients in forward (one pass) and saves them for backward to scale.

Every rank cuts the same chunks (from numbers the ranks share), since the statistics are
combined chunk by chunk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from . import compiled, kernels, parallel
from .divergences import Divergence
from .kernels import finite_or_zero
from .sources import BlockedRows, LinearRows, Rows, chunk_rows, least_rows, row_chunks


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
    compiled: bool = False  # impl: the compiled kernels (topkd.compiled) where they apply


def local_columns(indices: torch.Tensor, offset: int, valid: int) -> torch.Tensor:
    """This shard's column of each global index; indices that are negative, on another rank or
    padding point at the spare column ``valid``, so gathers and scatters need no masks."""
    local = indices - offset
    on_rank = (indices >= 0) & (local >= 0) & (local < valid)
    return torch.where(on_rank, local, torch.full_like(local, valid))


def row_chunk_count(chunk_bytes, rows: int, widest: int, element_size: int, buffers: int,
                    compiled: bool = False) -> int:
    """Rows per chunk, from numbers every rank shares: ``buffers`` float32 rows of the widest
    shard (+1 spare column) within the budget (default ``min(64 MiB, logits / 16)``); at least
    two for the compiled kernels (:func:`least_rows`)."""
    return least_rows(chunk_rows(chunk_bytes, widest + 1, rows, element_size, buffers), compiled)


# ---- collectives ------------------------------------------------------------------------


def _combine(maxima: list, sums: list, paired: list[int], group):
    """Global row maxima and sums from this shard's (one MAX, one SUM all-reduce), as lists of
    ``[r, c]`` parts. Column ``paired[i]`` of the concatenated maxima is the max that column
    ``i`` of the concatenated sums (sums of ``exp(x - max)``) is relative to; each sum is
    rescaled to the global max before the SUM. The other columns (kept values, a label's
    logit) live on one rank and are -inf elsewhere."""
    if group is None:
        return maxima, sums
    local = torch.cat(maxima, -1)
    reduced = parallel.all_reduce_max_(local.clone(), group)
    scale = torch.exp(local[:, paired] - finite_or_zero(reduced[:, paired]))
    summed = torch.cat(sums, -1)
    summed = parallel.all_reduce_sum_(torch.where(summed > 0, summed * scale, 0.0), group)
    return (list(reduced.split([m.shape[1] for m in maxima], -1)),
            list(summed.split([x.shape[1] for x in sums], -1)))


def _combine_sum(rows: list, group) -> list:
    """Per-row sums of every shard's ``rows`` (``[r]`` each): one SUM all-reduce."""
    if group is None:
        return rows
    return list(parallel.all_reduce_sum_(torch.stack(rows, -1), group).unbind(-1))


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

    def normalizer(self, low):
        """The CE's own ``(max, centered sum)`` of a chunk, or None when it shares KD's."""
        if not self.own_normalizer:
            return None
        return kernels.log_normalizer(kernels.logits_(kernels.widen(low), self.cfg.logit_scale,
                                                      self.cfg.softcap))

    def compiled_extras(self, extra, label_columns):
        """``(label logit, CE normalizer)`` from a compiled statistics kernel's extra
        results (see :func:`topkd.compiled._label_statistics`)."""
        z_label = extra[0] if label_columns is not None else None
        return z_label, tuple(extra[-2:]) if self.own_normalizer else None

    def has(self, start: int, stop: int):
        return self.labels[start:stop] != self.cfg.ignore_index

    def gradient_(self, grad, low, columns, rows, g_ce):
        """Add the CE gradient that is not folded into the normalizer: the label's ``-g`` and,
        at T != 1, ``g * softmax(z)`` at temperature 1."""
        if self.labels is None:
            return grad
        if not self.folded:
            z = kernels.logits_(kernels.widen(low), self.cfg.logit_scale, self.cfg.softcap)
            kernels.softmax_part_(grad, z, rows["ce_max"], rows["ce_sum"], g_ce)
        return kernels.label_part_(grad, columns, g_ce)


def _ce_rows(has, norm_max, norm_sum, z_label):
    """``-log softmax(z)_label = (max - z_label) + log sum`` on rows with a label, else 0."""
    ce = (finite_or_zero(norm_max) - z_label) + norm_sum.log()
    return torch.where(has, ce, 0.0)


# ---- paths --------------------------------------------------------------------------------


class SparsePath:
    """The student against K kept teacher entries and a ghost bucket per row.

    ``teacher_rows(start, stop)`` gives the chunk's :class:`~topkd.SparseTeacher` rows (as
    ``[r, K]``); in backward only the saved columns are used."""

    def __init__(self, cfg: Config, student, teacher_rows, labels):
        self.cfg, self.student, self.teacher_rows = cfg, student, teacher_rows
        self.labels = _Labels(labels, cfg)

    @staticmethod
    def buffers(cfg: Config, labels, backward: bool = False) -> int:
        return 1 + (labels is not None and cfg.temperature != 1.0) + (cfg.softcap is not None)

    def _read(self, start, stop, with_label):
        cfg = self.cfg
        low = self.student.low_chunk(start, stop, cfg.valid)
        label_columns = self.labels.columns(start, stop) if with_label else None
        a, z_label = kernels.read(low, cfg.temperature, cfg.logit_scale, cfg.softcap, 1,
                                  label_columns)
        return low, a, label_columns, z_label

    def _local(self, start, stop, columns):
        """``(state, (selected, ghost max, ghost sum, label logit, CE normalizer))`` of this
        shard's chunk; the state is what :meth:`gradient` needs."""
        low, a, label_columns, z_label = self._read(start, stop, self.labels.labels is not None)
        ce_norm = self.labels.normalizer(low)
        selected, rest_max, rest_sum = kernels.sparse_statistics(a, columns)
        return (low, a, columns, label_columns, rest_max), (selected, rest_max, rest_sum,
                                                            z_label, ce_norm)

    def forward(self, start: int, stop: int):
        """The chunk's statistics (its rows' values come from :meth:`values`)."""
        cfg = self.cfg
        teacher = self.teacher_rows(start, stop)
        r, k = stop - start, teacher.indices.shape[-1]
        columns = local_columns(teacher.indices.reshape(r, k), cfg.offset, cfg.valid)
        state, (selected, rest_max, rest_sum, z_label, ce_norm) = self._local(start, stop,
                                                                              columns)
        # combine: one MAX (kept values, ghost max, label logit, CE max), one SUM (the ghost's
        # and the CE's sums, relative to their maxima)
        maxima = [selected, rest_max[:, None]] + ([] if z_label is None else [z_label[:, None]])
        maxima += [] if ce_norm is None else [ce_norm[0][:, None]]
        sums = [rest_sum[:, None]] + ([] if ce_norm is None else [ce_norm[1][:, None]])
        maxima, sums = _combine(maxima, sums, [k, k + 2][:len(sums)], cfg.group)
        rows = self._statistics(maxima[0], maxima[1][:, 0], sums[0][:, 0], columns)
        rows["logq_sel"] = teacher.logprobs.reshape(r, k)
        rows["logq_rest"] = teacher.rest_logprob.reshape(r)
        if z_label is not None:
            rows["z_label"] = maxima[2][:, 0]
        if ce_norm is not None:
            rows["ce_max"], rows["ce_sum"] = maxima[3][:, 0], sums[1][:, 0]
        return state, rows

    def values(self, rows: dict, start: int, stop: int) -> None:
        """Add the rows' KD, its gradient w.r.t. the buckets, and CE to ``rows`` (those of one
        chunk, or of all of them at once when the gradient waits for backward)."""
        labels = self.labels
        logq = rows.pop("logq_sel"), rows.pop("logq_rest")
        rows["kd"], rows["grad_sel"], rows["grad_rest"] = self._buckets(rows, *logq)
        if labels.labels is not None:
            has = labels.has(start, stop)
            if labels.folded:
                rows["ce"] = _ce_rows(has, rows["row_max"], rows["total"], rows["z_label"])
            else:
                rows["ce"] = _ce_rows(has, rows["ce_max"], rows["ce_sum"], rows["z_label"])

    @staticmethod
    def _statistics(selected, rest_max, rest_sum, columns):
        row_max = finite_or_zero(torch.maximum(selected.amax(-1), rest_max))
        total = torch.exp(selected - row_max[:, None]).sum(-1)
        total += rest_sum * torch.exp(rest_max - row_max)
        return {"columns": columns.int(), "selected": selected, "row_max": row_max,
                "total": total, "rest_max": rest_max, "rest_sum": rest_sum}

    def _buckets(self, rows, logq_sel, logq_rest):
        """Per-row KD over the buckets, and its gradient w.r.t. the student's bucket
        log-probabilities (autograd over ``[r, K+1]``)."""
        cfg = self.cfg
        log_total = rows["total"].log()
        logp_sel = (rows["selected"] - rows["row_max"][:, None]) - log_total[:, None]
        logp_rest = (rows["rest_max"] - rows["row_max"]) + rows["rest_sum"].log() - log_total
        with torch.enable_grad():
            logp_sel.requires_grad_(True)
            logp_rest.requires_grad_(True)
            if cfg.normalize == "topk":
                kd = cfg.divergence.buckets(_renormalize(logp_sel), _renormalize(logq_sel))
            else:
                kd = cfg.divergence.buckets(torch.cat([logp_sel, logp_rest[:, None]], -1),
                                            torch.cat([logq_sel, logq_rest[:, None]], -1))
            if not kd.requires_grad:  # a divergence that ignores the student (SkewKL(1))
                return kd, torch.zeros_like(logp_sel), torch.zeros_like(logp_rest)
            # normalize="topk" leaves logp_rest out: its gradient is zero.
            grad_sel, grad_rest = torch.autograd.grad(kd.sum(), (logp_sel, logp_rest),
                                                      allow_unused=True,
                                                      materialize_grads=True)
        return kd.detach(), grad_sel, grad_rest

    # Row statistics that backward remakes per chunk, so :class:`RowLoss` does not save them:
    # the kept values are the chunk's own at this shard's kept columns (the combined ones come
    # from the one rank holding each column; elsewhere the gradient goes to the spare column).
    remade = ("selected",)

    def refresh(self, start, stop, rows):
        low, a, label_columns, _ = self._read(start, stop, False)
        columns = rows["columns"].long()
        rows["selected"] = a.gather(1, columns)  # as forward read them: the same values
        return (low, a, columns, self.labels.columns(start, stop), None)

    def _upstream(self, rows, g_kd, g_ce):
        """``(grad_sel, grad_norm, grad_rest)``: the rows' upstream gradients of the kept
        values, the log-normalizer (the folded CE's included) and the ghost."""
        grad_sel = rows["grad_sel"] * g_kd[:, None]
        grad_rest = rows["grad_rest"] * g_kd
        grad_norm = -(grad_sel.sum(-1) + grad_rest)
        if self.labels.labels is not None and self.labels.folded:
            grad_norm = grad_norm + g_ce
        return grad_sel, grad_norm, grad_rest

    def gradient(self, state, rows, g_kd, g_ce, dtype):
        """The chunk's ``d loss / d (logits)`` (float32 here; the compiled path's in
        ``dtype``, the sink's)."""
        cfg = self.cfg
        low, a, columns, label_columns, exp_max = state
        grad_sel, grad_norm, grad_rest = self._upstream(rows, g_kd, g_ce)
        kernels.sparse_gradient_(a, columns, rows["row_max"], rows["total"], rows["rest_max"],
                                 rows["rest_sum"], rows["selected"], grad_sel, grad_norm,
                                 grad_rest, cfg.temperature, exp_max)
        self.labels.gradient_(a, low, label_columns, rows, g_ce)
        return kernels.logits_grad_(a, low, cfg.logit_scale, cfg.softcap)


class CompiledSparsePath(SparsePath):
    """:class:`SparsePath` with the compiled kernels: no float32 copy of a chunk is made;
    the gradient reads the chunk again."""

    @staticmethod
    def buffers(cfg: Config, labels, backward: bool = False) -> int:
        # the gradient chunk; the float32 kept-column bias (compiled.kept_bias) is not counted
        return 1

    remade = ()  # the kernels take the saved kept values

    def _local(self, start, stop, columns):
        cfg, labels = self.cfg, self.labels
        low = self.student.low_chunk(start, stop, cfg.valid)
        label_columns = labels.columns(start, stop)
        selected, rest_max, rest_sum, *extra = compiled.sparse_statistics(
            low, columns, compiled.kept_bias(columns, low.shape[1]), label_columns,
            cfg.temperature, cfg.logit_scale, cfg.softcap, labels.own_normalizer)
        z_label, ce_norm = labels.compiled_extras(extra, label_columns)
        return (low, columns, label_columns), (selected, rest_max, rest_sum, z_label, ce_norm)

    def refresh(self, start, stop, rows):
        low = self.student.low_chunk(start, stop, self.cfg.valid)
        return (low, rows["columns"].long(), self.labels.columns(start, stop))

    def gradient(self, state, rows, g_kd, g_ce, dtype):
        cfg = self.cfg
        low, columns, label_columns = state
        grad_sel, grad_norm, grad_rest = self._upstream(rows, g_kd, g_ce)
        return compiled.sparse_gradient(
            low, columns, label_columns, rows["row_max"], rows["total"], rows["rest_max"],
            rows["rest_sum"], rows["selected"], grad_sel, grad_norm, grad_rest,
            None if label_columns is None else g_ce, rows.get("ce_max"), rows.get("ce_sum"),
            cfg.temperature, cfg.logit_scale, cfg.softcap, dtype)


def _renormalize(logp: torch.Tensor) -> torch.Tensor:
    """``logp`` renormalized over its finite entries; a row with none stays all ``-inf``."""
    any_live = torch.isfinite(logp).any(-1, keepdim=True)
    safe = torch.where(any_live, logp, torch.zeros_like(logp))
    return logp - torch.logsumexp(safe, dim=-1, keepdim=True)


class DensePath:
    """The student against the teacher's whole distribution (logits or an LM head)."""

    remade = ()

    def __init__(self, cfg: Config, student, teacher, labels):
        self.cfg, self.student, self.teacher = cfg, student, teacher
        self.labels = _Labels(labels, cfg)

    @staticmethod
    def buffers(cfg: Config, labels, backward: bool = False) -> int:
        div = cfg.divergence
        return ((div.backward_buffers if backward else div.buffers)
                + (labels is not None and cfg.temperature != 1.0) + (cfg.softcap is not None))

    def _read(self, start, stop, label_columns):
        cfg = self.cfg
        low = self.student.low_chunk(start, stop, cfg.valid)
        a, z_label = kernels.read(low, cfg.temperature, cfg.logit_scale, cfg.softcap, 1,
                                  label_columns)
        b, _ = kernels.read(self.teacher.low_chunk(start, stop, cfg.valid), cfg.temperature,
                            cfg.teacher_logit_scale, cfg.teacher_softcap, 1)
        return low, a, b, z_label

    def _local(self, start, stop, label_columns):
        """``(state, local maxima [r, 2], local sums [r, 2], label logit, CE normalizer)``."""
        low, a, b, z_label = self._read(start, stop, label_columns)
        ce_norm = self.labels.normalizer(low)
        local_max, local_sum, state = self.cfg.divergence.dense_statistics(a, b)
        return (low, state, label_columns), local_max, local_sum, z_label, ce_norm

    def _terms(self, state, local_max, log_shift, scale):
        """``(D row sums, h row sums, state for the gradient)`` of this shard's chunk."""
        low, state, label_columns = state
        f_sum, h_sum, state = self.cfg.divergence.dense_terms(state, log_shift, scale)
        return f_sum, h_sum, (low, state, label_columns)

    def forward(self, start: int, stop: int):
        cfg, labels = self.cfg, self.labels
        label_columns = labels.columns(start, stop)
        state, local_max, local_sum, z_label, ce_norm = self._local(start, stop, label_columns)

        # combine 1: maxima (student, teacher, label logit, CE max) and sums
        maxima = [local_max] + ([] if z_label is None else [z_label[:, None]])
        maxima += [] if ce_norm is None else [ce_norm[0][:, None]]
        sums = [local_sum] + ([] if ce_norm is None else [ce_norm[1][:, None]])
        maxima, sums = _combine(maxima, sums, [0, 1, 3][:len(sums) + 1], cfg.group)
        row_max, row_sum = maxima[0], sums[0]
        log_shift, scale = row_sum.log(), row_sum.reciprocal()
        if cfg.group is not None:  # this shard's maxima below the global ones
            shift = finite_or_zero(row_max) - finite_or_zero(local_max)
            log_shift, scale = log_shift + shift, scale * torch.exp(-shift)
        f_sum, h_sum, state = self._terms(state, local_max, log_shift, scale)
        # combine 2: the divergence's row sums
        kd, h_sum = _combine_sum([f_sum, h_sum], cfg.group)
        rows = {"row_max": row_max, "row_sum": row_sum, "h_sum": h_sum, "kd": kd}
        if labels.labels is not None:
            has = labels.has(start, stop)
            if labels.folded:
                rows["ce"] = _ce_rows(has, row_max[:, 0], row_sum[:, 0], maxima[1][:, 0])
            else:
                rows["ce_max"], rows["ce_sum"] = maxima[2][:, 0], sums[1][:, 0]
                rows["ce"] = _ce_rows(has, rows["ce_max"], rows["ce_sum"], maxima[1][:, 0])
        return state, rows

    def values(self, rows: dict, start: int, stop: int) -> None:
        """Nothing: the terms need the chunk itself, so :meth:`forward` made the values."""

    def refresh(self, start, stop, rows):
        low, a, b, _ = self._read(start, stop, None)
        state = self.cfg.divergence.dense_refresh(a, b, rows["row_max"], rows["row_sum"])
        return (low, state, self.labels.columns(start, stop))

    def _folded(self, g_kd, g_ce):
        """The CE's upstream gradient where it shares the KD normalizer, else 0."""
        if self.labels.labels is not None and self.labels.folded:
            return g_ce
        return torch.zeros_like(g_kd)

    def gradient(self, state, rows, g_kd, g_ce, dtype):
        cfg = self.cfg
        low, state, label_columns = state
        grad = cfg.divergence.dense_gradient(state, rows["h_sum"], g_kd,
                                             self._folded(g_kd, g_ce), cfg.temperature)
        self.labels.gradient_(grad, low, label_columns, rows, g_ce)
        return kernels.logits_grad_(grad, low, cfg.logit_scale, cfg.softcap)


class CompiledDensePath(DensePath):
    """:class:`DensePath` with the compiled kernels over the divergence's :meth:`terms`: the
    chunks are read again for the terms and the gradient; no float32 copy is made."""

    @staticmethod
    def buffers(cfg: Config, labels, backward: bool = False) -> int:
        return 1  # the gradient chunk

    def _transforms(self):
        cfg = self.cfg
        return (cfg.logit_scale, cfg.softcap, cfg.teacher_logit_scale, cfg.teacher_softcap)

    def _lows(self, start, stop):
        valid = self.cfg.valid
        return (self.student.low_chunk(start, stop, valid),
                self.teacher.low_chunk(start, stop, valid))

    def _local(self, start, stop, label_columns):
        cfg, labels = self.cfg, self.labels
        low_s, low_t = self._lows(start, stop)
        local_max, local_sum, *extra = compiled.dense_statistics(
            low_s, low_t, label_columns, cfg.temperature, *self._transforms(),
            labels.own_normalizer)
        z_label, ce_norm = labels.compiled_extras(extra, label_columns)
        return (low_s, low_t, label_columns), local_max, local_sum, z_label, ce_norm

    def _terms(self, state, local_max, log_shift, scale):
        low_s, low_t, _ = state
        f_sum, h_sum = compiled.dense_terms(self.cfg.divergence, low_s, low_t,
                                            finite_or_zero(local_max), log_shift, scale,
                                            self.cfg.temperature, *self._transforms())
        return f_sum, h_sum, state

    def refresh(self, start, stop, rows):
        return (*self._lows(start, stop), self.labels.columns(start, stop))

    def gradient(self, state, rows, g_kd, g_ce, dtype):
        cfg = self.cfg
        low_s, low_t, label_columns = state
        return compiled.dense_gradient(
            cfg.divergence, low_s, low_t, label_columns, rows["row_max"], rows["row_sum"],
            rows["h_sum"], g_kd, self._folded(g_kd, g_ce),
            None if label_columns is None else g_ce, rows.get("ce_max"), rows.get("ce_sum"),
            cfg.temperature, *self._transforms(), dtype)


def path_class(cfg: Config, sparse: bool):
    """The path a call runs: compiled where ``cfg.compiled`` and the divergence has its own
    :meth:`~topkd.divergences.Divergence.terms` (or the path is sparse, where the divergence
    acts on the small buckets only)."""
    if sparse:
        return CompiledSparsePath if cfg.compiled else SparsePath
    own_terms = type(cfg.divergence).terms is not Divergence.terms
    return CompiledDensePath if cfg.compiled and own_terms else DensePath


# ---- the driver ---------------------------------------------------------------------------


def _cat_rows(parts: list[dict]) -> dict:
    if not parts:
        return {}
    return {key: torch.cat([p[key] for p in parts]) for key in parts[0]}


def _slice_rows(rows: dict, start: int, stop: int) -> dict:
    return {key: value[start:stop] for key, value in rows.items()}


def sweep_forward(path, count: int, per: int, sink=None, weights=None):
    """Every chunk's statistics and row values; with ``sink`` (and per-row ``weights``, the
    upstream gradients of the KD and CE rows) each chunk's gradient too, in the same pass.
    Returns the rows' values (only ``kd`` and ``ce`` with a sink)."""
    parts = []
    for start, stop in row_chunks(count, per):
        state, rows = path.forward(start, stop)
        if sink is not None:
            path.values(rows, start, stop)
            w_kd, w_ce = weights[0][start:stop], weights[1][start:stop]
            grad = path.gradient(state, rows, w_kd, w_ce, sink.chunk_dtype)
            sink.add(start, stop, grad, path.cfg.valid)
            rows = {key: rows[key] for key in ("kd", "ce") if key in rows}
            del grad
        del state  # free this chunk's buffers before the next is made
        parts.append(rows)
    if sink is not None:
        sink.finish(path.cfg.valid)
    rows = _cat_rows(parts)
    if sink is None and rows:
        path.values(rows, 0, count)  # the rows' values at once: fewer small operations
    return rows


def sweep_backward(path, count: int, per: int, rows: dict, g_kd, g_ce, sink) -> None:
    """Each chunk's gradient from the saved row statistics and the rows' upstream gradients."""
    for start, stop in row_chunks(count, per):
        part = _slice_rows(rows, start, stop)
        state = path.refresh(start, stop, part)
        grad = path.gradient(state, part, g_kd[start:stop], g_ce[start:stop], sink.chunk_dtype)
        sink.add(start, stop, grad, path.cfg.valid)
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

    @property
    def names(self) -> tuple[str, ...]:
        return self.student + self.teacher + ("labels",)

    def student_source(self, named: dict, blocked: bool):
        if self.student == ("logits",):
            return Rows(named["logits"])
        source = LinearRows(named["hidden"], named["weight"], named["bias"],
                            stage_rows=self.config.block_rows)
        return BlockedRows(source, self.config.block_rows) if blocked else source

    def teacher_source(self, named: dict):
        if "teacher" in named:
            return Rows(named["teacher"])
        source = LinearRows(named["teacher_hidden"], named["teacher_weight"],
                            named["teacher_bias"])
        return BlockedRows(source, self.config.teacher_block_rows)

    def path(self, named: dict, blocked: bool, teacher_rows=None):
        cfg = self.config
        student = self.student_source(named, blocked)
        cls = path_class(cfg, self.sparse)
        if cfg.valid == 0:  # a shard that is all vocabulary padding: nothing to compile
            cls = SparsePath if self.sparse else DensePath
        if self.sparse:
            if teacher_rows is None:
                teacher_rows = _given_rows(named)
            return cls(cfg, student, teacher_rows, named["labels"]), student
        return cls(cfg, student, self.teacher_source(named), named["labels"]), student


class _Slice(NamedTuple):
    indices: torch.Tensor
    logprobs: torch.Tensor
    rest_logprob: torch.Tensor


def _given_rows(named):
    indices, logprobs, rest = named["indices"], named["logprobs"], named["rest"]

    def rows(start, stop):
        return _Slice(indices[start:stop], logprobs[start:stop], rest[start:stop])

    return rows


class RowLoss(torch.autograd.Function):
    """``(call, *tensors) -> (kd [n], ce [n])`` float32; the gradient is written in backward
    from saved per-row statistics (a second pass over the chunks)."""

    @staticmethod
    def forward(ctx, call: Call, *tensors):
        named = dict(zip(call.names, tensors, strict=True))
        path, _ = call.path(named, blocked=False)
        rows = sweep_forward(path, call.count, call.config.rows_per_chunk)
        kd = rows.pop("kd", None)
        ce = rows.pop("ce", None)
        kd = torch.zeros(call.count, device=_device(tensors)) if kd is None else kd
        ce = torch.zeros_like(kd) if ce is None else ce
        for key in path.remade:  # backward makes these again, a chunk at a time
            rows.pop(key, None)
        keep = [name for name in call.names if name not in ("indices", "logprobs", "rest")]
        ctx.call, ctx.keys, ctx.kept = call, tuple(rows), tuple(keep)
        ctx.save_for_backward(*(named[n] for n in keep), *rows.values())
        return kd, ce

    @staticmethod
    def backward(ctx, g_kd, g_ce):
        call = ctx.call
        saved = ctx.saved_tensors
        named = dict.fromkeys(call.names)
        named.update(zip(ctx.kept, saved[:len(ctx.kept)], strict=True))
        rows = dict(zip(ctx.keys, saved[len(ctx.kept):], strict=True))
        path, student = call.path(named, blocked=False, teacher_rows=lambda *_: None)
        needs = ctx.needs_input_grad[1:1 + len(call.student)]
        sink = student.gradient(needs, call.config.compiled)
        g_ce = torch.zeros_like(g_kd) if g_ce is None else g_ce
        g_kd = torch.zeros_like(g_ce) if g_kd is None else g_kd
        cfg = call.config
        per = cfg.backward_rows_per_chunk or cfg.rows_per_chunk
        sweep_backward(path, call.count, per, rows, g_kd, g_ce, sink)
        grads = sink.result()
        return (None, *grads, *(None,) * (len(call.names) - len(grads)))


class ScalarLoss(torch.autograd.Function):
    """``(call, weights, teacher_rows, *tensors) -> (loss, kd, ce)`` scalars: ``loss = sum
    w_kd * kd_rows + sum w_ce * ce_rows`` with the gradients computed in the same pass and
    saved; backward scales them by the upstream gradient (new tensors, so a second backward
    sees the same values). ``kd``/``ce`` are the parts for logging (non-differentiable)."""

    @staticmethod
    def forward(ctx, call: Call, weights, teacher_rows, *tensors):
        # weights: per-row (KD, CE) reduction weights: mask / count for "mean"
        named = dict(zip(call.names, tensors, strict=True))
        path, student = call.path(named, blocked=True, teacher_rows=teacher_rows)
        sink = student.gradient(ctx.needs_input_grad[3:3 + len(call.student)],
                                call.config.compiled)
        cfg = call.config
        upstream = (weights[0] * cfg.kd_weight, weights[1] * cfg.ce_weight)
        rows = sweep_forward(path, call.count, cfg.rows_per_chunk, sink, upstream)
        device = _device(tensors)
        parts = []
        for key, weight in zip(("kd", "ce"), weights, strict=True):
            values = rows.get(key)
            if values is None:
                parts.append(torch.zeros((), device=device))
            else:
                parts.append(torch.where(weight != 0, values * weight, 0.0).sum())
        loss = cfg.kd_weight * parts[0] + cfg.ce_weight * parts[1]
        accumulators = sink.accumulators()
        inputs = student.source.inputs if isinstance(student, BlockedRows) else student.inputs
        ctx.likes = [None if a is None else (x.dtype, x.shape)
                     for a, x in zip(accumulators, inputs, strict=True)]
        ctx.save_for_backward(*(a for a in accumulators if a is not None))
        ctx.count = len(call.names)
        ctx.mark_non_differentiable(parts[0], parts[1])
        return loss, parts[0], parts[1]

    @staticmethod
    def backward(ctx, grad, _kd, _ce):
        saved = iter(ctx.saved_tensors)
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
