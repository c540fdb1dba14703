"""Divergences over the K+1 buckets (the kept entries and the ghost), in plain autograd.

Inputs are float32 log-probabilities ``[n, K]`` (kept entries, ``-inf`` in unused slots) and
``[n]`` (ghost) for student ``p`` and teacher ``q``. These are small tensors: a new divergence
is a new function here, not a new kernel.
"""

from __future__ import annotations

import torch


def _weighted_log_ratio(log_w: torch.Tensor, log_o: torch.Tensor) -> torch.Tensor:
    """``sum w * (log w - log o)`` over the last dim, with ``0 * log 0 = 0`` exactly.

    Zero-weight terms are replaced before the subtraction, so neither the value nor the
    gradient sees ``-inf - -inf``.
    """
    weight = log_w.exp()
    live = weight > 0
    zero = torch.zeros_like(log_w)
    return (weight * (torch.where(live, log_w, zero) - torch.where(live, log_o, zero))).sum(-1)


def _renormalize(logp: torch.Tensor) -> torch.Tensor:
    """``logp`` renormalized over its finite entries; a row with none stays all ``-inf``."""
    any_live = torch.isfinite(logp).any(-1, keepdim=True)
    safe = torch.where(any_live, logp, torch.zeros_like(logp))
    return logp - torch.logsumexp(safe, dim=-1, keepdim=True)


def bucket_kl(
    logp_sel: torch.Tensor,
    logp_rest: torch.Tensor,
    logq_sel: torch.Tensor,
    logq_rest: torch.Tensor,
    *,
    reverse: bool = False,
    normalize: str = "full",
) -> torch.Tensor:
    """Per-row KL over the K+1 buckets: ``KL(q || p)``, or ``KL(p || q)`` when ``reverse``.

    ``normalize="full"`` keeps the ghost bucket (the exact full-vocabulary log-masses);
    ``"topk"`` drops it and renormalizes both distributions over the kept entries alone.
    Returns float32 ``[n]``.
    """
    if normalize == "topk":
        logp, logq = _renormalize(logp_sel), _renormalize(logq_sel)
    else:
        logp = torch.cat([logp_sel, logp_rest[:, None]], -1)
        logq = torch.cat([logq_sel, logq_rest[:, None]], -1)
    return _weighted_log_ratio(logp, logq) if reverse else _weighted_log_ratio(logq, logp)
