"""Student side: the one autograd Function that touches the student's full vocabulary.

Forward reads the logits chunk by chunk into a float32 buffer and returns only what the
divergence needs, as log-probabilities computed relative to row maxima (never ``a - A`` with a
rounded absolute ``A``):

- ``logp_sel`` ``[n, K]``: ``log p`` at the teacher's kept indices (``-inf`` in unused slots),
- ``logp_rest`` ``[n]``: ``log p_g``, a log-sum-exp over every entry not kept.

It saves the logits (no copy), the [n, K] selected values and four per-row statistics. Backward
writes the gradient chunk by chunk. With ``M``/``S`` the row max and centered sum over the whole
vocabulary and ``M_g``/``S_g`` those over the ghost (entries not kept), and ``gA = -(sum of the
gradients of logp_sel and logp_rest)`` the gradient of the log-normalizer:

    ghost entry j:  da_j = exp(a_j - M_g) * (gA * exp(M_g - M) / S + g_rest / S_g)
    kept entry i:   da_i = gA * exp(a_i - M) / S + g_sel_i

and ``dz = da / T``. The ghost formula uses its own max, so it neither overflows nor underflows
when the student's ghost holds a tiny fraction of its mass.

With tensor parallelism each rank holds a vocabulary shard; forward makes one MAX and one SUM
all-reduce of O(n x K) numbers. Backward makes none: every rank backpropagates the same loss,
so the upstream gradients are already identical everywhere (as in Megatron's vocab-parallel
cross entropy).
"""

from __future__ import annotations

import torch

from . import parallel
from ._rows import Rows, chunk_rows, row_chunks

_NEG_INF = float("-inf")


def _finite_or_zero(x: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


class SparseStudentLogProbs(torch.autograd.Function):
    """``(logits [..., V_r], indices [n, K]) -> (logp_sel [n, K], logp_rest [n])``, float32."""

    @staticmethod
    def forward(ctx, logits, indices, temperature, shard, valid, group, chunk_bytes):
        rows = Rows(logits)
        n, k = indices.shape
        device = logits.device
        # Local column of each kept index; slots that are unused or on another rank point at a
        # spare column holding -inf, so gathers and scatters need no masks.
        local = indices - shard.offset
        on_rank = (indices >= 0) & (local >= 0) & (local < valid)
        columns = torch.where(on_rank, local, torch.full_like(local, valid))

        selected = torch.full((n, k), _NEG_INF, dtype=torch.float32, device=device)
        rest_max = torch.full((n,), _NEG_INF, dtype=torch.float32, device=device)
        rest_sum = torch.zeros(n, dtype=torch.float32, device=device)
        per = chunk_rows(chunk_bytes, valid + 1, n, logits.element_size())
        for start, stop in row_chunks(n if valid else 0, per):
            a = rows.float_chunk(start, stop, valid, spare=1)
            a[:, valid] = _NEG_INF
            if temperature != 1.0:
                a.div_(temperature)
            cols = columns[start:stop]
            selected[start:stop] = a.gather(1, cols)
            a.scatter_(1, cols, _NEG_INF)
            m = a.amax(dim=-1)
            rest_max[start:stop] = m
            rest_sum[start:stop] = a.sub_(_finite_or_zero(m)[:, None]).exp_().sum(-1)
            del a  # free this chunk's buffer before the next is allocated

        # Global statistics: the selected values live on one rank each (-inf elsewhere).
        maxes = parallel.all_reduce_max_(torch.cat([selected, rest_max[:, None]], -1), group)
        selected, rest_max_all = maxes[:, :k], maxes[:, k]
        rest_sum = parallel.all_reduce_sum_(
            rest_sum * torch.exp(rest_max - _finite_or_zero(rest_max_all)), group
        )
        rest_max = rest_max_all
        row_max = _finite_or_zero(torch.maximum(selected.amax(-1), rest_max))
        total = torch.exp(selected - row_max[:, None]).sum(-1)
        total += rest_sum * torch.exp(rest_max - row_max)
        log_total = total.log()
        logp_sel = (selected - row_max[:, None]) - log_total[:, None]
        logp_rest = (rest_max - row_max) + rest_sum.log() - log_total

        # int32 halves the saved [n, K] indices (scatter wants int64: converted per chunk).
        ctx.save_for_backward(logits, columns.int(), selected, row_max, total, rest_max, rest_sum)
        ctx.config = (temperature, valid, chunk_bytes)
        return logp_sel, logp_rest

    @staticmethod
    def backward(ctx, grad_sel, grad_rest):
        logits, columns, selected, row_max, total, rest_max, rest_sum = ctx.saved_tensors
        temperature, valid, chunk_bytes = ctx.config
        # d loss / d log-normalizer: every kept slot counts, on this rank or another (unused
        # slots have logp = -inf and get zero gradient from the divergence).
        grad_norm = -(grad_sel.sum(-1) + grad_rest)
        # Per-row coefficient of exp(a_j - M_g) on ghost entries, and the kept entries' values.
        has_rest = rest_sum > 0
        ghost_coef = grad_norm * torch.exp(rest_max - row_max) / total
        ghost_coef = ghost_coef + torch.where(has_rest, grad_rest / rest_sum.clamp_min(1e-38), 0.0)
        ghost_coef = torch.where(has_rest, ghost_coef, 0.0) / temperature
        kept_coef = grad_norm / total
        rest_max = _finite_or_zero(rest_max)

        rows = Rows(logits)
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        grad_rows = grad.view(rows.count, rows.width)
        grad_rows[:, valid:] = 0  # vocabulary padding is outside both distributions
        per = chunk_rows(chunk_bytes, valid + 1, rows.count, logits.element_size())
        for start, stop in row_chunks(rows.count if valid else 0, per):
            a = rows.float_chunk(start, stop, valid, spare=1)
            if temperature != 1.0:
                a.div_(temperature)
            a.sub_(rest_max[start:stop, None]).exp_().mul_(ghost_coef[start:stop, None])
            kept = torch.exp(selected[start:stop] - row_max[start:stop, None])
            kept.mul_(kept_coef[start:stop, None]).add_(grad_sel[start:stop]).div_(temperature)
            a.scatter_(1, columns[start:stop].long(), kept)
            grad_rows[start:stop, :valid].copy_(a[:, :valid])
            del a
        return grad, None, None, None, None, None, None
