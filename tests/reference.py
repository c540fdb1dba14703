"""Independent float64 reference of SPEC section 1, written straight from the definitions.

Deliberately simple and slow: full log-softmax in float64, selection by a stable sort, ghost
bucket by a log-sum-exp over the complement. It does not import topkd. Gradients come from
float64 autograd through these functions.

Every function takes logits of shape ``[..., W]`` (any float dtype; they are upcast to float64
exactly) and works on the flattened rows ``[N, V]`` with ``V = vocab_size or W``; columns at or
past ``V`` are sliced away, so they are outside both distributions and get zero gradient.
"""

from __future__ import annotations

import math

import torch

NEG_INF = float("-inf")


def _rows(x: torch.Tensor, vocab_size: int | None) -> tuple[torch.Tensor, tuple, int]:
    width = x.shape[-1]
    v = width if vocab_size is None else vocab_size
    assert 1 <= v <= width
    lead = tuple(x.shape[:-1])
    return x[..., :v].reshape(-1, v), lead, v


def select(teacher_logits, k, *, top_p=None, top_p_min_k=1, temperature=1.0, vocab_size=None):
    """Reference of ``select_topk``.

    Returns a dict with ``indices`` (int64 [..., K], -1 where dropped by top-p), ``logprobs``
    (float64 [..., K], -inf where dropped), ``rest_logprob`` (float64 [...], log q_g),
    ``kept`` (bool [N, V], the set S'), ``logq`` (float64 [N, V]), ``lead`` and ``vocab_size``.
    """
    t, lead, v = _rows(teacher_logits.detach().to(torch.float64), vocab_size)
    n = t.shape[0]
    assert 1 <= k <= v
    b = t / temperature
    logq = torch.log_softmax(b, dim=-1)  # b - B, over the whole vocabulary
    # Selection: the K largest b, ties to the lower index <=> stable ascending sort of -b.
    order = torch.sort(-b, dim=-1, stable=True).indices[:, :k]
    sel_logq = logq.gather(-1, order)
    keep = torch.ones(n, k, dtype=torch.bool)
    if top_p is not None:
        q = sel_logq.exp()
        # sum of q over entries 0..r-1 (exclusive prefix sum, sequential float64)
        before = torch.zeros_like(q)
        if k > 1:
            before[:, 1:] = torch.cumsum(q, dim=-1)[:, :-1]
        r = torch.arange(k).expand(n, k)
        keep = (before < top_p) | (r < top_p_min_k)
    kept = torch.zeros(n, v, dtype=torch.bool)
    kept.scatter_(-1, order, keep)
    # Ghost: log-sum-exp over the complement of S', directly.
    rest = torch.logsumexp(torch.where(kept, NEG_INF, b), dim=-1) - torch.logsumexp(b, dim=-1)
    if n and (~kept).sum(-1).eq(0).any():
        rest = torch.where((~kept).any(-1), rest, torch.full_like(rest, NEG_INF))
    indices = torch.where(keep, order, torch.full_like(order, -1))
    logprobs = torch.where(keep, sel_logq, torch.full_like(sel_logq, NEG_INF))
    return {
        "indices": indices.reshape(*lead, k),
        "logprobs": logprobs.reshape(*lead, k),
        "rest_logprob": rest.reshape(lead),
        "kept": kept,
        "logq": logq,
        "lead": lead,
        "vocab_size": v,
        "before": None if top_p is None else before,
    }


def _safe_lse(x: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """logsumexp over ``active`` entries per row; -inf (no NaN in value or gradient) if none."""
    usable = active & (x > NEG_INF)
    nonempty = usable.any(-1, keepdim=True)
    xs = torch.where(usable, x, torch.full_like(x, NEG_INF))
    xs = torch.where(nonempty, xs, torch.zeros_like(x))
    lse = torch.logsumexp(xs, dim=-1)
    return torch.where(nonempty.squeeze(-1), lse, torch.full_like(lse, NEG_INF))


def _kl_terms(logw: torch.Tensor, logv: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """sum over active entries of w * (log w - log v), with 0 * log 0 = 0 (no NaN gradient)."""
    act = active & (logw > NEG_INF)
    lw = torch.where(act, logw, torch.zeros_like(logw))
    lv = torch.where(act, logv, torch.zeros_like(logv))
    term = torch.where(act, lw.exp() * (lw - lv), torch.zeros_like(lw))
    return term.sum(-1)


def _reduce(loss_rows: torch.Tensor, lead, mask, reduction):
    loss = loss_rows.reshape(lead)
    if mask is not None:
        loss = torch.where(mask, loss, torch.zeros_like(loss))
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    if reduction == "mean":
        count = loss.numel() if mask is None else int(mask.sum())
        return loss.sum() / max(count, 1)
    raise ValueError(reduction)


def divergence(student_logits, kept, logq, lead, *, temperature=1.0, reverse=False,
               normalize="full", vocab_size=None, mask=None, reduction="none"):
    """KL between student and teacher given the kept set S' (bool [N, V]) and teacher log q."""
    z, lead_s, _ = _rows(student_logits.to(torch.float64), vocab_size)
    assert lead_s == tuple(lead), (lead_s, lead)
    a = z / temperature
    logp = torch.log_softmax(a, dim=-1)
    if normalize == "topk":
        # both renormalized over S' alone, no ghost
        lq = logq - _safe_lse(logq, kept).unsqueeze(-1)
        lp = logp - _safe_lse(logp, kept).unsqueeze(-1)
        if reverse:
            rows = _kl_terms(lp, lq, kept)
        else:
            rows = _kl_terms(lq, lp, kept)
    elif normalize == "full":
        comp = ~kept
        lqg = _safe_lse(logq, comp).unsqueeze(-1)
        lpg = _safe_lse(logp, comp).unsqueeze(-1)
        one = torch.ones_like(lqg, dtype=torch.bool)
        if reverse:
            rows = _kl_terms(logp, logq, kept) + _kl_terms(lpg, lqg, one)
        else:
            rows = _kl_terms(logq, logp, kept) + _kl_terms(lqg, lpg, one)
    else:
        raise ValueError(normalize)
    return _reduce(rows, lead, mask, reduction)


def topk_kl(student_logits, teacher_logits, k, *, top_p=None, top_p_min_k=1, temperature=1.0,
            reverse=False, normalize="full", vocab_size=None, mask=None, reduction="none"):
    sel = select(teacher_logits, k, top_p=top_p, top_p_min_k=top_p_min_k,
                 temperature=temperature, vocab_size=vocab_size)
    return divergence(student_logits, sel["kept"], sel["logq"], sel["lead"],
                      temperature=temperature, reverse=reverse, normalize=normalize,
                      vocab_size=vocab_size, mask=mask, reduction=reduction)


def full_kl(student_logits, teacher_logits, *, temperature=1.0, reverse=False, vocab_size=None,
            mask=None, reduction="none"):
    t, lead, _ = _rows(teacher_logits.detach().to(torch.float64), vocab_size)
    logq = torch.log_softmax(t / temperature, dim=-1)
    kept = torch.ones_like(logq, dtype=torch.bool)
    return divergence(student_logits, kept, logq, lead, temperature=temperature,
                      reverse=reverse, normalize="full", vocab_size=vocab_size, mask=mask,
                      reduction=reduction)


def sparse_kl(student_logits, teacher_ref: dict, *, temperature, reverse=False, normalize="full",
              vocab_size=None, mask=None, reduction="none"):
    """The same loss, from a reference ``select`` result (offline-teacher path)."""
    return divergence(student_logits, teacher_ref["kept"], teacher_ref["logq"],
                      teacher_ref["lead"], temperature=temperature, reverse=reverse,
                      normalize=normalize, vocab_size=vocab_size, mask=mask,
                      reduction=reduction)


def loss_and_grad(fn, student_logits, *args, grad_output=None, **kwargs):
    """Run a reference loss in float64 and return (loss, d loss / d student) in float64.

    ``grad_output`` is the upstream gradient (defaults to ones for a scalar loss).
    """
    z = student_logits.detach().to(torch.float64).requires_grad_(True)
    loss = fn(z, *args, **kwargs)
    g = torch.ones_like(loss) if grad_output is None else grad_output.to(torch.float64)
    if loss.requires_grad:
        loss.backward(g)
        grad = z.grad if z.grad is not None else torch.zeros_like(z)
    else:
        grad = torch.zeros_like(z)
    return loss.detach(), grad.detach()


def top_p_margin(sel: dict, top_p: float, top_p_min_k: int = 1) -> float:
    """Smallest distance between top_p and any prefix sum that decides a kept/dropped entry.

    Tests use it to stay away from boundary cases where float32 and float64 prefix sums could
    legitimately decide differently.
    """
    before = sel["before"]
    if before is None:
        return math.inf
    before = before[:, top_p_min_k:]  # entries r < top_p_min_k are kept regardless
    if before.numel() == 0:
        return math.inf
    return float((before - top_p).abs().min())
