"""float64 references of the losses the benchmark measures (SPEC section 1), and the error
measures against them. Independent of topkd: written from the definitions, on a few rows.

Logits of any float dtype are upcast to float64 exactly and divided by the temperature; ``p``
is the student's distribution, ``q`` the teacher's. The Top-K losses act on K + 1 buckets:
the teacher's K largest entries (ties to the lower vocabulary index, unless ``indices`` gives
another selection) and the ghost bucket, the rest of the vocabulary, by a log-sum-exp over the
complement. The full-vocabulary losses act on every entry. A term whose weight is exactly 0
is exactly 0, in value and gradient.
"""

from __future__ import annotations

import torch

DIVERGENCES = ("kl", "jsd", "tvd")
JSD_BETA = 0.5  # the benchmark's JSD: beta * KL(q || M) + (1 - beta) * KL(p || M)
_NEG_INF = float("-inf")


def _kl_terms(log_w: torch.Tensor, log_o: torch.Tensor) -> torch.Tensor:
    """Elementwise ``w * (log w - log o)``, exactly 0 where ``w = 0``."""
    live = log_w > _NEG_INF
    zero = torch.zeros_like(log_w)
    return torch.where(live, log_w.exp() * (torch.where(live, log_w, zero)
                                            - torch.where(live, log_o, zero)), zero)


def divergence_rows(logp: torch.Tensor, logq: torch.Tensor, divergence: str = "kl",
                    beta: float = JSD_BETA) -> torch.Tensor:
    """Per-row divergence over the last dimension of float64 log-probabilities ``[rows, n]``.

    ``kl``: ``KL(q || p)``; ``jsd``: with ``M = beta q + (1 - beta) p``, ``beta KL(q || M) +
    (1 - beta) KL(p || M)``; ``tvd``: ``0.5 sum |q - p|``.
    """
    if divergence == "kl":
        return _kl_terms(logq, logp).sum(-1)
    if divergence == "jsd":
        m = beta * logq.exp() + (1 - beta) * logp.exp()
        live = m > 0
        logm = torch.where(live, torch.where(live, m, torch.ones_like(m)).log(),
                           torch.full_like(m, _NEG_INF))
        return (beta * _kl_terms(logq, logm) + (1 - beta) * _kl_terms(logp, logm)).sum(-1)
    if divergence == "tvd":
        return 0.5 * (logq.exp() - logp.exp()).abs().sum(-1)
    raise ValueError(f"unknown divergence {divergence!r}")


def topk_buckets(student, teacher, k: int, temperature: float, indices=None):
    """``(logp, logq)``: float64 ``[rows, K + 1]`` log-masses of the K selected entries and the
    ghost (``[rows, K]`` when K is the whole vocabulary). ``indices`` defaults to SPEC's
    selection: the teacher's K largest values, ties to the lower vocabulary index."""
    a = student.double() / temperature
    b = teacher.double() / temperature
    lse_a = torch.logsumexp(a, dim=-1, keepdim=True)
    lse_b = torch.logsumexp(b, dim=-1, keepdim=True)
    if indices is None:
        indices = torch.sort(b, dim=-1, descending=True, stable=True).indices[:, :k]
    logp = a.gather(-1, indices) - lse_a
    logq = b.gather(-1, indices) - lse_b
    if indices.shape[-1] < a.shape[-1]:
        selected = torch.zeros_like(b, dtype=torch.bool).scatter_(-1, indices, True)
        ghost_p = torch.logsumexp(a.masked_fill(selected, _NEG_INF), dim=-1, keepdim=True)
        ghost_q = torch.logsumexp(b.masked_fill(selected, _NEG_INF), dim=-1, keepdim=True)
        logp = torch.cat([logp, ghost_p - lse_a], -1)
        logq = torch.cat([logq, ghost_q - lse_b], -1)
    return logp, logq


def topk_loss(student, teacher, k: int, temperature: float, divergence: str = "kl",
              indices=None) -> torch.Tensor:
    """Per-row Top-K loss (``topk_kl_loss``) over the K + 1 buckets, float64 ``[rows]``."""
    return divergence_rows(*topk_buckets(student, teacher, k, temperature, indices), divergence)


def full_loss(student, teacher, temperature: float, divergence: str = "kl") -> torch.Tensor:
    """Per-row full-vocabulary loss (``kl_loss``), float64 ``[rows]``."""
    logp = torch.log_softmax(student.double() / temperature, dim=-1)
    logq = torch.log_softmax(teacher.double() / temperature, dim=-1)
    return divergence_rows(logp, logq, divergence)


def rel_err(got, ref) -> float:
    """``max |got - ref| / |ref|`` (elementwise over tensors, or of two numbers)."""
    if isinstance(ref, torch.Tensor):
        return ((got - ref).abs() / ref.abs()).max().item()
    return abs(got - ref) / abs(ref)


def grad_err(g: torch.Tensor, g64: torch.Tensor, dtype) -> tuple[float, float]:
    """``(err, floor)``: ``max |g - g64| / max |g64|``, and the same for ``g64`` rounded to
    ``dtype`` (what a correctly rounded gradient in that dtype gets)."""
    scale = g64.abs().max().item()
    err = (g.double() - g64).abs().max().item() / scale
    floor = (g64.to(dtype).double() - g64).abs().max().item() / scale
    return err, floor
