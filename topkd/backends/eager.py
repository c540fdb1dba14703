"""The eager backend: the per-chunk stages as plain PyTorch (:mod:`topkd.kernels`), in place
on float32 work buffers widened from each chunk. Runs anywhere, traces under a user's own
``torch.compile``.

The full-vocabulary passes come in two kinds: KL in either direction runs the centered passes
of a plain KL (:class:`_CenteredKL`: the exponentials in place, no normalized
log-probabilities); every other divergence runs its :meth:`~topkd.Divergence.terms`
(:class:`_TermsPasses`).
"""

from __future__ import annotations

import torch

from .. import kernels, topk
from ..divergences import KL, ReverseKL
from ..kernels import finite_or_zero
from ..sources import empty
from .base import Backend

_NEG_INF = float("-inf")


def _ce_normalizer(cfg, low):
    """The CE's own ``(max, centered sum)`` of a chunk at temperature 1."""
    return kernels.log_normalizer(kernels.logits_(kernels.widen(low), cfg.logit_scale,
                                                  cfg.softcap))


def _label_gradient_(cfg, grad, low, label_columns, stats, g_ce):
    """Add the CE gradient that is not folded into the normalizer: the label's ``-g`` and,
    with its own normalizer (T != 1), ``g * softmax(z)`` at temperature 1."""
    if g_ce is None:
        return grad
    if "ce_max" in stats:
        z = kernels.logits_(kernels.widen(low), cfg.logit_scale, cfg.softcap)
        kernels.softmax_part_(grad, z, stats["ce_max"], stats["ce_sum"], g_ce)
    return kernels.label_part_(grad, label_columns, g_ce)


class _TermsPasses:
    """The full-vocabulary passes over a divergence's :meth:`~topkd.Divergence.terms`."""

    def __init__(self, divergence):
        self.divergence = divergence

    def statistics(self, a, b):
        return kernels.dense_statistics(a, b)

    def terms(self, state, log_shift, inverse_sum):
        return kernels.dense_terms(self.divergence, state, log_shift, inverse_sum)

    def refresh(self, a, b, row_max, row_sum):
        return kernels.dense_refresh(self.divergence, a, b, row_max, row_sum)

    def gradient(self, state, h_sum, grad_kd, grad_norm_ce, temperature):
        return kernels.dense_gradient_(state, h_sum, grad_kd, grad_norm_ce, temperature)


class _CenteredKL:
    """KL in either direction over the whole vocabulary in the passes of the plain KL: the
    terms are sums of ``exp(w) * (w - o)`` over the chunks centered on their maxima, so the
    exponentials are taken in place and no normalized log-probabilities are made.
    ``teacher_weighted``: KL(q || p), the teacher's q weights the terms; else KL(p || q)."""

    def __init__(self, teacher_weighted: bool):
        self.teacher_weighted = teacher_weighted

    def _columns(self):
        return (1, 0) if self.teacher_weighted else (0, 1)

    def statistics(self, a, b):
        maxima = kernels.center_(a, b)
        w, o = (b, a) if self.teacher_weighted else (a, b)
        diff = w - o
        a.exp_()
        b.exp_()
        sums = torch.stack([a.sum(-1), b.sum(-1)], -1)
        return maxima, sums, (a, b, diff, sums)

    def terms(self, state, log_shift, inverse_sum):
        ea, eb, diff, sums = state
        e_w = (ea, eb)[self._columns()[0]]
        # sum_j w_j (log w_j - log o_j), w_j = e_w * inverse_sum_w, log w_j = c_w -
        # log_shift_w; the reverse direction's gradient needs a - b again, so it keeps diff
        product = diff.mul_(e_w) if self.teacher_weighted else diff * e_w
        weighted = torch.nansum(product, -1)  # 0 * inf: a zero weight
        f_sum, h_sum = kernels.centered_kl_sums(weighted, sums, log_shift, inverse_sum,
                                                self.teacher_weighted)
        return f_sum, h_sum, (ea, eb, log_shift, inverse_sum,
                              None if self.teacher_weighted else diff)

    def refresh(self, a, b, row_max, row_sum):
        row_max = finite_or_zero(row_max)
        a.sub_(row_max[:, :1])
        b.sub_(row_max[:, 1:])
        diff = None if self.teacher_weighted else a - b
        return (a.exp_(), b.exp_(), row_sum.log(), 1 / row_sum, diff)

    def gradient(self, state, h_sum, grad_kd, grad_norm_ce, temperature):
        ea, eb, log_shift, inverse_sum, diff = state
        # dD/da = h - p sum h, with p = ea * inverse_sum_p and q = eb * inverse_sum_q
        coef = (grad_kd * h_sum - grad_norm_ce) / temperature
        if self.teacher_weighted:  # h = -q
            ea.mul_((-coef * inverse_sum[:, 0])[:, None])
            return ea.sub_(eb.mul_((grad_kd * inverse_sum[:, 1] / temperature)[:, None]))
        # h = p (log p - log q + 1), log p - log q = (a - b) + log_shift_q - log_shift_p
        row = grad_kd * (log_shift[:, 1] - log_shift[:, 0] + 1) / temperature - coef
        diff.mul_((grad_kd / temperature)[:, None]).add_(row[:, None])
        grad = ea.mul_(inverse_sum[:, :1]).mul_(diff)
        return grad.nan_to_num_(0.0, float("inf"), _NEG_INF)


def _passes(divergence):
    """The full-vocabulary passes this backend runs for ``divergence``."""
    if isinstance(divergence, KL):
        return _CenteredKL(teacher_weighted=True)
    if isinstance(divergence, ReverseKL):
        return _CenteredKL(teacher_weighted=False)
    return _TermsPasses(divergence)


def _read(low, temperature, logit_scale, softcap, scratch):
    """The selection's float32 chunk ``z / T`` (in ``scratch``'s buffer when given)."""
    out = empty(scratch, "select", *low.shape, torch.float32, low.device)
    return kernels.read(low, temperature, logit_scale, softcap, out=out)[0]


def _select_exact(b, k):
    """The exact selection of the float32 chunk ``b`` (consumed)."""
    values, indices, rest_max = topk.candidates_(b, k)
    center = finite_or_zero(rest_max)
    return values, indices, rest_max, b.sub_(center[:, None]).exp_().sum(-1).log_()


class _Sampled:
    """:func:`topkd.topk.sampled_top`'s kernels on the float32 chunk ``b`` (``z / T``): the
    sum below the threshold in place on ``b`` once the values above it are gathered."""

    rounding_gap = 0.0  # every value is read from ``b``

    @staticmethod
    def threshold(b, stride, keep):
        sample = b[:, ::stride].contiguous()  # (torch.topk runs faster on it)
        return torch.topk(sample, keep, dim=-1, sorted=False).values.amin(-1)

    @staticmethod
    def scan(b, threshold, capacity):
        columns, count = topk.compact(b >= threshold[:, None], capacity)
        keys = topk.candidate_keys(b.gather(1, columns.clamp_min(0)), columns)

        def below():  # the candidates out of the sum: -inf (padding repeats a row's first)
            at = torch.where(columns >= 0, columns, columns[:, :1]).clamp_min(0)
            at += torch.arange(0, b.numel(), b.shape[1], device=b.device)[:, None]
            b.view(-1).index_fill_(0, at.view(-1), float("-inf"))
            # (a threshold of -inf leaves nothing below it; centered on 0, not NaN)
            return b.sub_(finite_or_zero(threshold)[:, None]).exp_().sum(-1)

        return keys, count, below

    finish = staticmethod(topk.sampled_finish)


def _read_pair(cfg, low_s, low_t, label_columns):
    a, z_label = kernels.read(low_s, cfg.temperature, cfg.logit_scale, cfg.softcap, 1,
                              label_columns)
    b, _ = kernels.read(low_t, cfg.temperature, cfg.teacher_logit_scale, cfg.teacher_softcap,
                        1)
    return a, b, z_label


class EagerBackend(Backend):
    """Plain PyTorch stages on float32 work buffers (see :class:`~topkd.backends.base.Backend`
    for the signatures)."""

    name = "eager"
    widens_chunks = True
    least_rows = 1
    sparse_remade = ("selected",)  # the kept values, gathered again from the chunk

    # ---- Top-K path

    def sparse_statistics(self, cfg, low, columns, label_columns, ce):
        a, z_label = kernels.read(low, cfg.temperature, cfg.logit_scale, cfg.softcap, 1,
                                  label_columns)
        ce_norm = _ce_normalizer(cfg, low) if ce else None
        selected, rest_max, rest_sum = kernels.sparse_statistics(a, columns)
        # a now holds the ghost's exp(a_j - ghost max): the gradient reuses it
        return (low, a, columns, label_columns, rest_max), (selected, rest_max, rest_sum,
                                                            z_label, ce_norm)

    def sparse_refresh(self, cfg, low, columns, label_columns, stats):
        a, _ = kernels.read(low, cfg.temperature, cfg.logit_scale, cfg.softcap, 1, None)
        stats["selected"] = a.gather(1, columns)  # as forward read them: the same values
        return (low, a, columns, label_columns, None)

    def sparse_gradient(self, cfg, state, stats, upstream, g_ce, dtype, out=None):
        low, a, columns, label_columns, exp_max = state
        grad_sel, grad_norm, grad_rest = upstream
        kernels.sparse_gradient_(a, columns, stats["row_max"], stats["total"],
                                 stats["rest_max"], stats["rest_sum"], stats["selected"],
                                 grad_sel, grad_norm, grad_rest, cfg.temperature, exp_max)
        _label_gradient_(cfg, a, low, label_columns, stats, g_ce)
        return kernels.logits_grad_(a, low, cfg.logit_scale, cfg.softcap)

    # ---- full-vocabulary path

    def dense_statistics(self, cfg, low_s, low_t, label_columns, ce):
        a, b, z_label = _read_pair(cfg, low_s, low_t, label_columns)
        ce_norm = _ce_normalizer(cfg, low_s) if ce else None
        local_max, local_sum, state = _passes(cfg.divergence).statistics(a, b)
        return (low_s, state, label_columns), local_max, local_sum, z_label, ce_norm

    def dense_terms(self, cfg, state, local_max, log_shift, inverse_sum):
        low, state, label_columns = state
        f_sum, h_sum, state = _passes(cfg.divergence).terms(state, log_shift, inverse_sum)
        return f_sum, h_sum, (low, state, label_columns)

    def dense_refresh(self, cfg, low_s, low_t, label_columns, row_max, row_sum):
        a, b, _ = _read_pair(cfg, low_s, low_t, None)
        return (low_s, _passes(cfg.divergence).refresh(a, b, row_max, row_sum), label_columns)

    def dense_gradient(self, cfg, state, stats, g_kd, g_norm_ce, g_ce, dtype, out=None):
        low, state, label_columns = state
        grad = _passes(cfg.divergence).gradient(state, stats["h_sum"], g_kd, g_norm_ce,
                                                cfg.temperature)
        _label_gradient_(cfg, grad, low, label_columns, stats, g_ce)
        return kernels.logits_grad_(grad, low, cfg.logit_scale, cfg.softcap)

    # ---- the teacher's selection and the fused head's weight gradient

    def select(self, low, k, temperature, logit_scale, softcap, scratch=None, ordered=True):
        b = _read(low, temperature, logit_scale, softcap, scratch)
        plan = topk.sampled_plan(b.shape[1], k + 1)  # None where 16 (k + 1) > W
        if plan is None:
            return (*_select_exact(b, k), torch.ones(b.shape[0], dtype=torch.bool,
                                                     device=b.device))
        return topk.sampled_top(b, k + 1, plan, _Sampled, ordered)

    def select_exact(self, low, k, temperature, logit_scale, softcap, scratch=None):
        return _select_exact(_read(low, temperature, logit_scale, softcap, scratch), k)

    def accumulator(self, like):
        # one float32 tile made once per stage (widening first is twice as fast as add_'s
        # mixed-dtype path on CPU; fresh tile-sized tensors cost a quarter of the time)
        wide = torch.empty(like.shape, dtype=torch.float32, device=like.device)

        def add_(accumulator, product):
            accumulator.add_(wide[:product.shape[0]].copy_(product))

        return add_


EAGER = EagerBackend()
