"""The float64 reference of topkd's losses, written straight from their definitions.

The one reference in the repository: the tests compare topkd with it, and the benchmarks
(``benchmarks/``, which put this directory on ``sys.path``) measure topkd's errors against it.
Its own checks, against closed forms and values worked out by hand, are test_reference.py and
test_reference_divergences.py.

Definitions. ``p`` is the student's distribution, ``q`` the teacher's, both softmaxes of the
(transformed, then temperature-divided) logits. The Top-K losses act on the teacher's K largest
entries, ties to the lower vocabulary index (the set S; S' after top-p drops its tail), plus a
ghost bucket holding the rest of the vocabulary's mass (``normalize="full"``), or on S' alone
with both distributions renormalized over it (``"topk"``). The full-vocabulary losses act on
every entry. A term whose weight is exactly 0 is exactly 0, in value and gradient.

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


def select(teacher_logits, k, *, top_p=None, top_p_min_k=1, temperature=1.0, vocab_size=None,
           indices=None):
    """Reference of ``select_topk``.

    ``indices`` (int64 [..., K], distinct per row): a given selection in place of the K largest
    entries, e.g. another implementation's ``torch.topk``, whose ties may fall otherwise; the
    loss is then measured on that selection. Not with ``top_p``.

    Returns a dict with ``indices`` (int64 [..., K], -1 where dropped by top-p), ``logprobs``
    (float64 [..., K], -inf where dropped), ``rest_logprob`` (float64 [...], log q_g),
    ``kept`` (bool [N, V], the set S'), ``logq`` (float64 [N, V]), ``lead`` and ``vocab_size``.
    """
    t, lead, v = _rows(teacher_logits.detach().to(torch.float64), vocab_size)
    n = t.shape[0]
    assert 1 <= k <= v
    b = t / temperature
    logq = torch.log_softmax(b, dim=-1)  # b - B, over the whole vocabulary
    if indices is None:
        # Selection: the K largest b, ties to the lower index <=> stable ascending sort of -b.
        order = torch.sort(-b, dim=-1, stable=True).indices[:, :k]
    else:
        assert top_p is None, "a given selection has no top-p"
        order = indices.reshape(n, k).to(device=b.device, dtype=torch.int64)
        assert bool(((order >= 0) & (order < v)).all()), "index out of range"
        assert bool((order.sort(-1).values.diff(dim=-1) > 0).all()), "repeated index"
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


# ---------------------------------------------------------------------------------------------
# Divergences, hard-label term, logit transforms.
#
# Everything below is float64 and written from the formulas: log-probabilities from a full
# log_softmax, mixtures formed explicitly as probabilities (beta q + (1 - beta) p), and every
# term whose weight is exactly 0 dropped before any log is taken, so float64 autograd gives
# finite gradients (no 0 * log 0, no inf * 0 through an unused torch.where branch).
# ---------------------------------------------------------------------------------------------

DIVERGENCES = ("kl", "reverse_kl", "jsd", "skew_kl", "skew_reverse_kl", "tvd")
_DEFAULT_PARAM = {"jsd": 0.5, "skew_kl": 0.1, "skew_reverse_kl": 0.1}
_CLASS_NAMES = {"KL": "kl", "ReverseKL": "reverse_kl", "JSD": "jsd", "SkewKL": "skew_kl",
                "SkewReverseKL": "skew_reverse_kl", "TVD": "tvd"}


def parse_divergence(spec) -> tuple[str, float | None]:
    """A divergence spec as ``(name, param)``; ``param`` is beta (jsd), alpha (skew) or None.

    Accepts a name (``"jsd"``), a pair (``("jsd", 0.3)``), a dict (``{"name": "jsd",
    "beta": 0.3}``) or, by duck typing, an object whose class is named like topkd's
    (``JSD(beta=0.3)``, ``SkewKL(alpha=0.2)``, ...). The reference never imports topkd.
    """
    if spec is None:
        spec = "kl"
    if isinstance(spec, str):
        name, param = spec, None
    elif isinstance(spec, tuple):
        name, param = spec
    elif isinstance(spec, dict):
        name = spec["name"]
        param = spec.get("beta", spec.get("alpha"))
    else:
        name = _CLASS_NAMES[type(spec).__name__]
        param = getattr(spec, "beta", getattr(spec, "alpha", None))
    assert name in DIVERGENCES, name
    if name in _DEFAULT_PARAM:
        param = _DEFAULT_PARAM[name] if param is None else float(param)
        assert 0.0 <= param <= 1.0, (name, param)
    else:
        assert param is None, (name, param)
    return name, param


def _prob(logw: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """exp(logw) on active entries, exactly 0 elsewhere (and no gradient through -inf)."""
    live = active & (logw > NEG_INF)
    return torch.where(live, torch.where(live, logw, torch.zeros_like(logw)).exp(),
                       torch.zeros_like(logw))


def _log_mixture(c_a: float, log_a: torch.Tensor, c_b: float, log_b: torch.Tensor,
                 active: torch.Tensor) -> torch.Tensor:
    """log(c_a * a + c_b * b), the mixture formed explicitly in probability space.

    A component with coefficient exactly 0 is absent, so the endpoints are exact:
    ``c_a = 0`` returns ``log_b`` itself (e.g. SkewKL(alpha=0) is exactly KL).
    """
    if c_a == 0.0:
        return log_b
    if c_b == 0.0:
        return log_a
    m = c_a * _prob(log_a, active) + c_b * _prob(log_b, active)
    live = m > 0
    return torch.where(live, torch.where(live, m, torch.ones_like(m)).log(),
                       torch.full_like(m, NEG_INF))


def bucket_divergence(logq: torch.Tensor, logp: torch.Tensor, active: torch.Tensor,
                      spec="kl") -> torch.Tensor:
    """Per-row D(q, p) over the buckets of the last dim (q teacher, p student), float64 [N].

    ``logq``/``logp`` are log-probabilities over the buckets (each a distribution over the
    ``active`` entries); inactive entries are outside both and contribute nothing.
    """
    name, c = parse_divergence(spec)
    if name == "kl":
        return _kl_terms(logq, logp, active)
    if name == "reverse_kl":
        return _kl_terms(logp, logq, active)
    if name == "jsd":
        if c == 0.0:
            return _kl_terms(logq, logp, active)
        if c == 1.0:
            return _kl_terms(logp, logq, active)
        logm = _log_mixture(c, logq, 1.0 - c, logp, active)  # M = beta q + (1 - beta) p
        return c * _kl_terms(logq, logm, active) + (1.0 - c) * _kl_terms(logp, logm, active)
    if name == "skew_kl":  # KL(q || alpha q + (1 - alpha) p)
        return _kl_terms(logq, _log_mixture(c, logq, 1.0 - c, logp, active), active)
    if name == "skew_reverse_kl":  # KL(p || alpha p + (1 - alpha) q)
        return _kl_terms(logp, _log_mixture(c, logp, 1.0 - c, logq, active), active)
    # tvd: 0.5 sum |q - p|
    return 0.5 * (_prob(logq, active) - _prob(logp, active)).abs().sum(-1)


def transform_logits(x: torch.Tensor, logit_scale: float = 1.0,
                     softcap: float | None = None) -> torch.Tensor:
    """``softcap * tanh(logit_scale * x / softcap)`` (or ``logit_scale * x`` without softcap),
    in float64; applied before any temperature."""
    y = x.to(torch.float64) * logit_scale
    if softcap is not None:
        y = softcap * torch.tanh(y / softcap)
    return y


def buckets(student_logits, kept, logq, lead, *, temperature=1.0, normalize="full",
            vocab_size=None):
    """The bucket distributions D acts on: ``(logq_b, logp_b, active_b)``, float64.

    ``normalize="full"``: the entries of S' (``kept``, bool [N, V]) plus one ghost bucket with
    the exact complement masses (the whole vocabulary when ``kept`` is all true: the ghost is
    then empty, mass 0); ``"topk"``: the entries of S' alone, both renormalized over S'.
    ``logq`` is the teacher's full-vocabulary log q [N, V] (from ``select`` / ``full_logq``).
    """
    z, lead_s, _ = _rows(student_logits.to(torch.float64), vocab_size)
    assert lead_s == tuple(lead), (lead_s, lead)
    logp = torch.log_softmax(z / temperature, dim=-1)
    neg = torch.full_like(logq, NEG_INF)
    if normalize == "topk":
        lq = torch.where(kept, logq - _safe_lse(logq, kept).unsqueeze(-1), neg)
        lp = torch.where(kept, logp - _safe_lse(logp, kept).unsqueeze(-1), neg)
        return lq, lp, kept
    assert normalize == "full", normalize
    comp = ~kept
    lq = torch.cat([torch.where(kept, logq, neg), _safe_lse(logq, comp).unsqueeze(-1)], -1)
    lp = torch.cat([torch.where(kept, logp, neg), _safe_lse(logp, comp).unsqueeze(-1)], -1)
    active = torch.cat([kept, torch.ones_like(kept[:, :1])], -1)
    return lq, lp, active


def full_logq(teacher_logits, *, temperature=1.0, vocab_size=None):
    """Teacher log q over the whole vocabulary: ``(kept=all true, logq, lead)``."""
    t, lead, _ = _rows(teacher_logits.detach().to(torch.float64), vocab_size)
    logq = torch.log_softmax(t / temperature, dim=-1)
    return torch.ones_like(logq, dtype=torch.bool), logq, lead


def kd_rows(student_logits, kept, logq, lead, *, divergence="kl", temperature=1.0,
            normalize="full", vocab_size=None) -> torch.Tensor:
    """Unreduced per-row D over the chosen buckets, float64 [N]."""
    lq, lp, active = buckets(student_logits, kept, logq, lead, temperature=temperature,
                             normalize=normalize, vocab_size=vocab_size)
    return bucket_divergence(lq, lp, active, divergence)


def cross_entropy_rows(student_logits, labels, *, ignore_index=-100, vocab_size=None):
    """``-log softmax(z)_label`` at temperature 1 over ``vocab_size``: ``(ce [N], has [N])``.

    ``student_logits`` are already transformed (logit scale / softcap). Rows whose label is
    ``ignore_index`` have ``has = False`` and ce exactly 0.
    """
    z, lead, v = _rows(student_logits.to(torch.float64), vocab_size)
    lab = labels.reshape(-1).to(torch.int64)
    assert tuple(labels.shape) == lead, (tuple(labels.shape), lead)
    has = lab != ignore_index
    assert bool(((lab[has] >= 0) & (lab[has] < v)).all()), "label out of range"
    logp = torch.log_softmax(z, dim=-1)
    picked = logp.gather(-1, torch.where(has, lab, torch.zeros_like(lab)).unsqueeze(-1))
    ce = torch.where(has, -picked.squeeze(-1), torch.zeros_like(picked.squeeze(-1)))
    return ce, has


def combine(kd, ce, ce_has, lead, *, mask=None, kd_weight=1.0, ce_weight=0.0,
            reduction="none"):
    """``kd_weight * KD + ce_weight * CE`` with the mask / ignore_index / reduction rules.

    ``kd``, ``ce`` are float64 [N] (``ce``/``ce_has`` may be None: no labels). KD counts the
    rows ``mask`` keeps; CE the rows ``mask`` keeps whose label is not ``ignore_index``.
    ``"mean"`` divides each part by its own row count (0 when it has no rows), ``"sum"`` sums,
    ``"none"`` gives the weighted per-row sum. A part whose weight is exactly 0 is left out of
    the loss entirely (value and gradient exactly 0). Returns ``(loss, kd, ce)``, the parts
    reduced the same way (float64; ce all zero without labels).
    """
    n = kd.shape[0]
    keep = torch.ones(n, dtype=torch.bool) if mask is None else mask.reshape(-1).to(torch.bool)
    assert keep.shape[0] == n
    if ce is None:
        ce = torch.zeros_like(kd)
        ce_has = torch.zeros(n, dtype=torch.bool)
    kd_rows_ = torch.where(keep, kd, torch.zeros_like(kd))
    ce_keep = keep & ce_has
    ce_rows_ = torch.where(ce_keep, ce, torch.zeros_like(ce))

    def red(x, count):
        if reduction == "none":
            return x.reshape(lead)
        if reduction == "sum":
            return x.sum()
        if reduction == "mean":
            return x.sum() / max(int(count), 1)
        raise ValueError(reduction)

    kd_red = red(kd_rows_, keep.sum())
    ce_red = red(ce_rows_, ce_keep.sum())
    loss = torch.zeros_like(kd_red)
    if kd_weight != 0:
        loss = loss + kd_weight * kd_red
    if ce_weight != 0:
        loss = loss + ce_weight * ce_red
    return loss, kd_red.detach(), ce_red.detach()


def _loss(student_logits, kept, logq, lead, *, divergence, reverse, temperature, normalize,
          vocab_size, mask, reduction, labels, ignore_index, kd_weight, ce_weight, logit_scale,
          softcap, return_components):
    if reverse:
        assert parse_divergence(divergence)[0] == "kl", "reverse=True only with divergence kl"
        divergence = "reverse_kl"
    z = transform_logits(student_logits, logit_scale, softcap)
    kd = kd_rows(z, kept, logq, lead, divergence=divergence, temperature=temperature,
                 normalize=normalize, vocab_size=vocab_size)
    ce = has = None
    if labels is not None:
        ce, has = cross_entropy_rows(z, labels, ignore_index=ignore_index, vocab_size=vocab_size)
    else:
        assert ce_weight == 0, "ce_weight needs labels"
    out = combine(kd, ce, has, lead, mask=mask, kd_weight=kd_weight, ce_weight=ce_weight,
                  reduction=reduction)
    return out if return_components else out[0]


def topk_loss(student_logits, teacher_logits, k, *, divergence="kl", reverse=False, top_p=None,
              top_p_min_k=1, temperature=1.0, normalize="full", vocab_size=None, mask=None,
              reduction="none", labels=None, ignore_index=-100, kd_weight=1.0, ce_weight=0.0,
              logit_scale=1.0, softcap=None, teacher_logit_scale=1.0, teacher_softcap=None,
              return_components=False, indices=None):
    """Reference of ``topk_kl_loss`` / ``fused_topk_kl_loss`` with every option they take.

    Teacher and student logits are transformed (scale, softcap) first, then divided by the
    temperature; the K+1 buckets (``normalize="full"``) or the K renormalized entries
    (``"topk"``) carry the divergence; CE is at temperature 1 on the transformed student.
    ``indices``: a given selection instead of the K largest (see ``select``). Returns the loss,
    or ``(loss, kd, ce)`` with ``return_components``.
    """
    t = transform_logits(teacher_logits.detach(), teacher_logit_scale, teacher_softcap)
    sel = select(t, k, top_p=top_p, top_p_min_k=top_p_min_k, temperature=temperature,
                 vocab_size=vocab_size, indices=indices)
    return _loss(student_logits, sel["kept"], sel["logq"], sel["lead"], divergence=divergence,
                 reverse=reverse, temperature=temperature, normalize=normalize,
                 vocab_size=vocab_size, mask=mask, reduction=reduction, labels=labels,
                 ignore_index=ignore_index, kd_weight=kd_weight, ce_weight=ce_weight,
                 logit_scale=logit_scale, softcap=softcap, return_components=return_components)


def sparse_loss(student_logits, teacher_ref: dict, *, temperature, divergence="kl",
                reverse=False, normalize="full", vocab_size=None, mask=None, reduction="none",
                labels=None, ignore_index=-100, kd_weight=1.0, ce_weight=0.0, logit_scale=1.0,
                softcap=None, return_components=False):
    """``topk_loss`` from a reference ``select`` result (offline-teacher path)."""
    return _loss(student_logits, teacher_ref["kept"], teacher_ref["logq"], teacher_ref["lead"],
                 divergence=divergence, reverse=reverse, temperature=temperature,
                 normalize=normalize, vocab_size=vocab_size, mask=mask, reduction=reduction,
                 labels=labels, ignore_index=ignore_index, kd_weight=kd_weight,
                 ce_weight=ce_weight, logit_scale=logit_scale, softcap=softcap,
                 return_components=return_components)


def full_loss(student_logits, teacher_logits, *, divergence="kl", reverse=False,
              temperature=1.0, vocab_size=None, mask=None, reduction="none", labels=None,
              ignore_index=-100, kd_weight=1.0, ce_weight=0.0, logit_scale=1.0, softcap=None,
              teacher_logit_scale=1.0, teacher_softcap=None, return_components=False):
    """Reference of ``kl_loss`` / ``fused_kl_loss``: the divergence over the whole vocabulary."""
    t = transform_logits(teacher_logits.detach(), teacher_logit_scale, teacher_softcap)
    kept, logq, lead = full_logq(t, temperature=temperature, vocab_size=vocab_size)
    return _loss(student_logits, kept, logq, lead, divergence=divergence, reverse=reverse,
                 temperature=temperature, normalize="full", vocab_size=vocab_size, mask=mask,
                 reduction=reduction, labels=labels, ignore_index=ignore_index,
                 kd_weight=kd_weight, ce_weight=ce_weight, logit_scale=logit_scale,
                 softcap=softcap, return_components=return_components)


def linear_logits(hidden, weight, bias=None) -> torch.Tensor:
    """``hidden @ weight.T + bias`` in float64 (the fused losses' logits)."""
    y = hidden.to(torch.float64) @ weight.to(torch.float64).T
    return y if bias is None else y + bias.to(torch.float64)


def linear_loss_and_grads(fn, hidden, weight, *args, bias=None, grad_output=None, **kwargs):
    """Like ``loss_and_grad`` for a fused loss: ``fn(linear_logits(hidden, weight, bias), ...)``
    in float64; returns ``(loss, grad_hidden, grad_weight, grad_bias or None)``."""
    h = hidden.detach().to(torch.float64).requires_grad_(True)
    w = weight.detach().to(torch.float64).requires_grad_(True)
    b = None if bias is None else bias.detach().to(torch.float64).requires_grad_(True)
    loss = fn(linear_logits(h, w, b), *args, **kwargs)
    g = torch.ones_like(loss) if grad_output is None else grad_output.to(torch.float64)
    grads = [torch.zeros_like(h), torch.zeros_like(w), None if b is None else torch.zeros_like(b)]
    if loss.requires_grad:
        loss.backward(g)
        grads = [x.grad if x.grad is not None else torch.zeros_like(x) for x in (h, w)] + [
            None if b is None else (b.grad if b.grad is not None else torch.zeros_like(b))]
    return (loss.detach(), *[None if x is None else x.detach() for x in grads])


def sampled_loss(student_logits, indices, counts, samples, *, temperature=1.0, logq=None,
                 vocab_size=None, mask=None, reduction="none", labels=None, ignore_index=-100,
                 kd_weight=1.0, ce_weight=0.0, logit_scale=1.0, softcap=None,
                 return_components=False):
    """Reference of the loss against a ``SampledTeacher``: per row ``-sum_i (c_i / N) log
    p(y_i)`` over the distinct ids drawn (``indices`` ``[..., S]``, ``-1`` unused, ``counts``
    ``[..., S]``), plus ``sum_i (c_i / N) log q(y_i)`` when the teacher's ``logq`` of the ids
    are given. Its gradient is ``(p - c / N) / T``."""
    z = transform_logits(student_logits, logit_scale, softcap)
    zr, lead, v = _rows(z, vocab_size)
    logp = torch.log_softmax(zr / temperature, dim=-1)
    s = indices.shape[-1]
    ids = indices.reshape(-1, s).to(torch.int64)
    w = counts.reshape(-1, s).to(torch.float64) / samples
    used = w > 0
    picked = logp.gather(-1, torch.where(used, ids, torch.zeros_like(ids)))
    kd = -torch.where(used, w * picked, torch.zeros_like(picked)).sum(-1)
    if logq is not None:
        lq = logq.reshape(-1, s).to(torch.float64)
        kd = kd + torch.where(used, w * torch.where(used, lq, 0.0), 0.0).sum(-1)
    ce = has = None
    if labels is not None:
        ce, has = cross_entropy_rows(z, labels, ignore_index=ignore_index, vocab_size=vocab_size)
    out = combine(kd, ce, has, lead, mask=mask, kd_weight=kd_weight, ce_weight=ce_weight,
                  reduction=reduction)
    return out if return_components else out[0]
