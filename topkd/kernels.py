"""Per-chunk math: plain functions of one chunk of rows, with no collectives and no host syncs.

Each takes the chunk as it comes from its source (``low``, ``[r, W]`` in the logits' own dtype)
or the float32 buffer made from it, plus per-row statistics, and returns float32 results. The
engine (:mod:`topkd.engine`) drives them chunk by chunk and calls every collective in between.
Nothing in them depends on the device. The eager backend (:mod:`topkd.backends.eager`) runs
them; :mod:`topkd.backends.compiled` holds compiled kernels that compute the same.

Everything is computed relative to row maxima: softmax is rebuilt from the row max and the
centered sums, never as ``exp(a - A)`` with a rounded absolute log-normalizer ``A``.
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def finite_or_zero(x: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


def widen(low: torch.Tensor, spare: int = 0, out: torch.Tensor | None = None) -> torch.Tensor:
    """``low`` copied into a float32 buffer (``out``, or a new one) with ``spare`` extra
    (uninitialized) columns."""
    if out is None:
        out = torch.empty(low.shape[0], low.shape[1] + spare, dtype=torch.float32,
                          device=low.device)
    out[:, :low.shape[1]].copy_(low)
    return out


def logits_(z: torch.Tensor, logit_scale: float, softcap: float | None) -> torch.Tensor:
    """The model's logits from the raw product, in place: ``softcap * tanh(logit_scale * z /
    softcap)`` (Gemma's final softcapping, Cohere's logit scale); identity by default."""
    if softcap is None:
        return z.mul_(logit_scale) if logit_scale != 1.0 else z
    return z.mul_(logit_scale / softcap).tanh_().mul_(softcap)


def logits_grad_(grad: torch.Tensor, low: torch.Tensor, logit_scale: float,
                 softcap: float | None) -> torch.Tensor:
    """``grad`` (w.r.t. the transformed logits, ``[r, >= W]``) times the transform's derivative
    at the raw chunk ``low`` ``[r, W]``, in place on its first W columns."""
    if softcap is None:
        return grad.mul_(logit_scale) if logit_scale != 1.0 else grad
    t = widen(low).mul_(logit_scale / softcap).tanh_()
    grad[:, :low.shape[1]].mul_(t.mul_(t).neg_().add_(1.0).mul_(logit_scale))
    return grad


def read(low: torch.Tensor, temperature: float, logit_scale: float = 1.0, softcap=None,
         spare: int = 0, label_columns: torch.Tensor | None = None, out=None):
    """``(a, z_label)``: the float32 buffer ``a = logits / T`` of a chunk (``spare`` extra
    columns, set to -inf; in ``out`` when given) and, with ``label_columns`` ``[r]``, each
    row's logit at its label column at temperature 1 (-inf where the column is the spare
    one)."""
    a = logits_(widen(low, spare, out), logit_scale, softcap)
    if spare:
        a[:, low.shape[1]:] = NEG_INF
    label = None if label_columns is None else a.gather(1, label_columns[:, None])[:, 0]
    if temperature != 1.0:
        a.div_(temperature)
    return a, label


def log_normalizer(z: torch.Tensor):
    """``(max, centered sum)`` of each row of ``z`` (max 0 where a row is all -inf or empty);
    ``z`` is left unchanged."""
    if z.shape[1] == 0:
        return (torch.full((z.shape[0],), NEG_INF, device=z.device),
                torch.zeros(z.shape[0], device=z.device))
    m = z.amax(-1)
    return m, torch.exp(z - finite_or_zero(m)[:, None]).sum(-1)


# ---- Top-K / sparse teacher: the student's statistics at the kept columns and over the rest


def sparse_statistics(a: torch.Tensor, columns: torch.Tensor):
    """This shard's ``(selected values [r, K], ghost max [r], ghost centered sum [r])``.

    ``a`` ``[r, W + 1]`` (last column -inf) is consumed: it is left holding
    ``exp(a_j - ghost max)`` on the ghost entries and 0 on the kept ones. ``columns``
    ``[r, K]`` points at each kept index's column here, or at the spare column."""
    selected = a.gather(1, columns)
    a.scatter_(1, columns, NEG_INF)
    rest_max = a.amax(dim=-1)
    rest_sum = a.sub_(finite_or_zero(rest_max)[:, None]).exp_().sum(-1)
    return selected, rest_max, rest_sum


def sparse_gradient_(a, columns, row_max, total, rest_max, rest_sum, selected, grad_sel,
                     grad_norm, grad_rest, temperature, exp_max=None):
    """Overwrite ``a`` with ``d loss / d (logits)`` for the chunk (the spare column is junk).

    With ``M``/``S`` the global row max and centered sum, ``M_g``/``S_g`` those of the ghost:

        ghost entry j:  da_j = exp(a_j - M_g) * (gA * exp(M_g - M) / S + g_rest / S_g)
        kept entry i:   da_i = gA * exp(a_i - M) / S + g_sel_i

    and ``dz = da / T``; ``grad_norm`` is ``gA``, the gradient of the log-normalizer. ``a`` is
    the chunk's ``z / T`` or, with ``exp_max`` ``[r]``, what :func:`sparse_statistics` left in
    it (``exp(a_j - exp_max)`` on this shard's ghost entries)."""
    has_rest = rest_sum > 0
    ghost = grad_norm * torch.exp(rest_max - row_max) / total
    ghost = ghost + torch.where(has_rest, grad_rest / rest_sum.clamp_min(1e-38), 0.0)
    ghost = torch.where(has_rest, ghost, 0.0) / temperature
    rest_max = finite_or_zero(rest_max)
    if exp_max is None:
        a.sub_(rest_max[:, None]).exp_().mul_(ghost[:, None])
    else:  # exp(a_j - M_g) = exp(a_j - exp_max) * exp(exp_max - M_g), the factor <= 1
        a.mul_((ghost * torch.exp(finite_or_zero(exp_max) - rest_max))[:, None])
    kept = torch.exp(selected - row_max[:, None])
    kept.mul_((grad_norm / total)[:, None]).add_(grad_sel).div_(temperature)
    a.scatter_(1, columns, kept)
    return a


# ---- full vocabulary: student and teacher chunks side by side


def center_(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """This shard's row maxima ``[r, 2]`` of ``a`` and ``b`` (-inf for an empty or all -inf
    row); both are centered on them in place (on 0 where the max is -inf)."""
    maxima = []
    for x in (a, b):
        if x.shape[1] == 0:  # a shard that is all vocabulary padding
            m = torch.full((x.shape[0],), NEG_INF, device=x.device)
        else:
            m = x.amax(-1)
        x.sub_(finite_or_zero(m)[:, None])
        maxima.append(m)
    return torch.stack(maxima, -1)


def dense_statistics(a: torch.Tensor, b: torch.Tensor):
    """``(maxima [r, 2], sums [r, 2], state)`` of this shard: each row's max of ``a`` and ``b``
    and their sums of ``exp(x - max)``; ``state`` = ``(a, b, ea, eb)``, the centered chunks and
    their exponentials, for :func:`dense_terms`."""
    maxima = center_(a, b)
    ea, eb = a.exp(), b.exp()
    return maxima, torch.stack([ea.sum(-1), eb.sum(-1)], -1), (a, b, ea, eb)


def dense_terms(divergence, state, log_shift, inverse_sum):
    """``(f row sums, h row sums, (p, h))`` of a divergence's :meth:`terms` for the chunk.

    ``state`` is :func:`dense_statistics`'s (consumed); ``log_shift`` ``[r, 2]`` = (global max
    - shard max) + log of the global sum, and ``inverse_sum`` ``[r, 2]`` = exp(shard max -
    global max) / global sum, so ``log p = a - log_shift[:, 0]`` and ``p = ea *
    inverse_sum[:, 0]`` (likewise ``q``). A term whose weight is 0 comes out of :meth:`terms`
    as ``0 * inf = NaN`` and counts
    0; a NaN in the inputs still reaches the loss through the row statistics."""
    a, b, ea, eb = state
    logp = a.sub_(log_shift[:, :1])
    logq = b.sub_(log_shift[:, 1:])
    p = ea.mul_(inverse_sum[:, :1])
    q = eb.mul_(inverse_sum[:, 1:])
    f, h = divergence.terms(logp, logq, p, q)
    inputs_nan = torch.isnan(log_shift).any(-1)
    f_sum = torch.where(inputs_nan, float("nan"), torch.nansum(f, -1))
    return f_sum, h.nan_to_num_(0.0, float("inf"), NEG_INF).sum(-1), (p, h)


def centered_kl_sums(weighted, sums, log_shift, inverse_sum, teacher_weighted: bool):
    """KL's ``(D row sums, h row sums)`` of a shard from its centered sums, with no pass over
    the chunk: for ``KL(q || p)`` (``teacher_weighted``; else ``KL(p || q)``, the roles
    swapped) ``weighted = sum_j eb_j (b_j - a_j)`` (``0 * inf`` counted 0) and ``sums = (sum
    ea, sum eb)`` ``[r, 2]``, where ``a``, ``b`` are the logits less the shard's maxima and
    ``ea``, ``eb`` their exponentials. With ``q = eb * inverse_sum_q`` and ``log q - log p =
    (b - a) - (log_shift_q - log_shift_p)``: ``D = inverse_sum_q * (weighted + (log_shift_p -
    log_shift_q) sum eb)``, ``h = -q`` (for ``KL(p || q)``, ``h = p (log p - log q) + p``)."""
    w, o = (1, 0) if teacher_weighted else (0, 1)
    offset = torch.where(sums[:, w] > 0, log_shift[:, o] - log_shift[:, w], 0.0)
    f_sum = inverse_sum[:, w] * (weighted + offset * sums[:, w])
    f_sum = torch.where(torch.isnan(log_shift).any(-1), float("nan"), f_sum)
    mass = inverse_sum * sums  # this shard's share of p and q
    return f_sum, -mass[:, 1] if teacher_weighted else f_sum + mass[:, 0]


def dense_refresh(divergence, a, b, row_max, row_sum):
    """:func:`dense_terms`' gradient state for fresh chunks ``a``/``b`` from the saved global
    row maxima and sums ``[r, 2]`` (backward)."""
    row_max = finite_or_zero(row_max)
    a.sub_(row_max[:, :1])
    b.sub_(row_max[:, 1:])
    return dense_terms(divergence, (a, b, a.exp(), b.exp()), row_sum.log(), 1 / row_sum)[2]


def dense_gradient_(state, h_sum, grad_kd, grad_norm_ce, temperature):
    """``d loss / d (logits)`` ``(g_kd * (h - p * sum h) + g_ce * p) / T`` into ``h``: the
    divergence's ``dD/da = h - p sum h`` and, folded in at temperature 1, the part of the
    cross-entropy's gradient that comes from its log-normalizer (``grad_norm_ce``)."""
    p, h = state
    coef = grad_kd * h_sum - grad_norm_ce
    h.mul_(grad_kd[:, None]).sub_(p.mul_(coef[:, None]))
    if temperature != 1.0:
        h.div_(temperature)
    return h


# ---- the hard-label term


def softmax_part_(grad: torch.Tensor, z: torch.Tensor, z_max, z_sum, weight) -> torch.Tensor:
    """``grad += weight * exp(z - z_max) / z_sum`` on ``z``'s columns (``z`` is consumed):
    the cross-entropy's normalizer gradient at temperature 1 when the KD term runs at T != 1."""
    coef = (weight / z_sum.clamp_min(1e-38))[:, None]
    grad[:, :z.shape[1]].add_(z.sub_(finite_or_zero(z_max)[:, None]).exp_().mul_(coef))
    return grad


def label_part_(grad: torch.Tensor, label_columns: torch.Tensor, weight) -> torch.Tensor:
    """``grad[r, label_r] -= weight_r``: the cross-entropy's gradient at the label's logit
    (labels on another rank, or ignored, point at a spare column the caller drops)."""
    return grad.scatter_add_(1, label_columns[:, None], -weight[:, None])
