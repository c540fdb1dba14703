"""Student side: everything that touches the student's full vocabulary.

Per chunk of rows the student's logits (a tensor, or a fused LM head's product) are read into a
float32 buffer. Forward returns only what the divergence needs, as log-probabilities computed
relative to row maxima (never ``a - A`` with a rounded absolute ``A``):

- ``logp_sel`` ``[n, K]``: ``log p`` at the teacher's kept indices (``-inf`` in unused slots),
- ``logp_rest`` ``[n]``: ``log p_g``, a log-sum-exp over every entry not kept.

With ``M``/``S`` the row max and centered sum over the whole vocabulary, ``M_g``/``S_g`` those
over the ghost (entries not kept), and ``gA = -(sum of the gradients of logp_sel and
logp_rest)`` the gradient of the log-normalizer, the gradient is

    ghost entry j:  da_j = exp(a_j - M_g) * (gA * exp(M_g - M) / S + g_rest / S_g)
    kept entry i:   da_i = gA * exp(a_i - M) / S + g_sel_i

and ``dz = da / T``. The ghost formula uses its own max, so it neither overflows nor underflows
when the student's ghost holds a tiny fraction of its mass.

Tensor parallelism: each rank holds a vocabulary shard; forward makes one MAX and one SUM
all-reduce of O(n x K) numbers. Backward makes none: every rank backpropagates the same loss,
so the upstream gradients are already identical everywhere (as in Megatron's vocab-parallel
cross entropy).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import parallel
from ._rows import chunk_rows, row_chunks, widen
from .divergence import bucket_kl

_NEG_INF = float("-inf")


def _finite_or_zero(x: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


def local_columns(indices: torch.Tensor, offset: int, valid: int) -> torch.Tensor:
    """This shard's column of each kept index; slots that are unused or on another rank point
    at the spare column ``valid`` (holding -inf), so gathers and scatters need no masks."""
    local = indices - offset
    on_rank = (indices >= 0) & (local >= 0) & (local < valid)
    return torch.where(on_rank, local, torch.full_like(local, valid))


def scaled_chunk(low: torch.Tensor, temperature: float) -> torch.Tensor:
    """Float32 ``[r, valid + 1]`` buffer of ``z / T`` from the chunk ``low`` (``[r, valid]``
    in the logits' dtype); the spare last column is -inf."""
    a = widen(low, spare=1)
    a[:, -1] = _NEG_INF
    if temperature != 1.0:
        a.div_(temperature)
    return a


def chunk_statistics(a: torch.Tensor, columns: torch.Tensor):
    """This shard's ``(selected values, ghost max, ghost centered sum)`` for a chunk; ``a`` is
    consumed (overwritten)."""
    selected = a.gather(1, columns)
    a.scatter_(1, columns, _NEG_INF)
    rest_max = a.amax(dim=-1)
    rest_sum = a.sub_(_finite_or_zero(rest_max)[:, None]).exp_().sum(-1)
    return selected, rest_max, rest_sum


@dataclass
class Statistics:
    """Per-row statistics over the whole vocabulary (all ranks), and the log-probabilities."""

    selected: torch.Tensor  # [n, K] a at the kept indices (-inf in unused slots)
    row_max: torch.Tensor  # [n] M (0 where the row is all -inf)
    total: torch.Tensor  # [n] S = sum exp(a - M)
    rest_max: torch.Tensor  # [n] M_g (-inf when the ghost is empty)
    rest_sum: torch.Tensor  # [n] S_g = sum over the ghost of exp(a - M_g)
    logp_sel: torch.Tensor  # [n, K]
    logp_rest: torch.Tensor  # [n]


def combine(selected, rest_max, rest_sum, group) -> Statistics:
    """Global statistics from each rank's local ones (one MAX and one SUM all-reduce).

    A kept index lives on one rank; the others hold -inf in its slot.
    """
    k = selected.shape[-1]
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
    return Statistics(selected, row_max, total, rest_max, rest_sum, logp_sel, logp_rest)


def chunk_gradient(a, columns, stats: Statistics, grad_sel, grad_rest, temperature,
                   exp_max=None):
    """Overwrite ``a`` with ``d loss / d z`` for the chunk's rows.

    ``a`` is the chunk's ``z / T`` (float32), or, with ``exp_max`` ``[r]``, what
    :func:`chunk_statistics` left in it: ``exp(a_j - exp_max)`` on this shard's ghost entries.
    ``stats``, ``grad_sel`` and ``grad_rest`` are those rows' slices. Unused slots have
    ``logp = -inf`` and zero gradient from the divergence; off-rank slots scatter into the
    spare column, which the caller drops.
    """
    grad_norm = -(grad_sel.sum(-1) + grad_rest)  # d loss / d log-normalizer (all kept slots)
    has_rest = stats.rest_sum > 0
    ghost = grad_norm * torch.exp(stats.rest_max - stats.row_max) / stats.total
    ghost = ghost + torch.where(has_rest, grad_rest / stats.rest_sum.clamp_min(1e-38), 0.0)
    ghost = torch.where(has_rest, ghost, 0.0) / temperature
    rest_max = _finite_or_zero(stats.rest_max)
    if exp_max is None:
        a.sub_(rest_max[:, None]).exp_().mul_(ghost[:, None])
    else:  # exp(a_j - M_g) = exp(a_j - exp_max) * exp(exp_max - M_g), the factor <= 1
        a.mul_((ghost * torch.exp(_finite_or_zero(exp_max) - rest_max))[:, None])
    kept = torch.exp(stats.selected - stats.row_max[:, None])
    kept.mul_((grad_norm / stats.total)[:, None]).add_(grad_sel).div_(temperature)
    a.scatter_(1, columns, kept)
    return a


def _rows_slice(stats: Statistics, start: int, stop: int) -> Statistics:
    fields = (getattr(stats, f) for f in Statistics.__dataclass_fields__)
    return Statistics(*(None if x is None else x[start:stop] for x in fields))


class SparseStudentLogProbs(torch.autograd.Function):
    """``source tensors -> (logp_sel [n, K], logp_rest [n])``, float32.

    ``kind`` builds the row source from ``tensors``: ``Rows`` for a logits tensor
    ``[..., V_r]``, ``LinearRows`` for ``(hidden, weight, bias)``.
    """

    @staticmethod
    def forward(ctx, kind, indices, temperature, shard, valid, group, chunk_bytes, *tensors):
        source = kind(*tensors)
        n, k = indices.shape
        device = source.device
        columns = local_columns(indices, shard.offset, valid)
        selected = torch.full((n, k), _NEG_INF, dtype=torch.float32, device=device)
        rest_max = torch.full((n,), _NEG_INF, dtype=torch.float32, device=device)
        rest_sum = torch.zeros(n, dtype=torch.float32, device=device)
        per = chunk_rows(chunk_bytes, valid + 1, n, source.element_size)
        for start, stop in row_chunks(n if valid else 0, per):
            a = scaled_chunk(source.low_chunk(start, stop, valid), temperature)
            selected[start:stop], rest_max[start:stop], rest_sum[start:stop] = \
                chunk_statistics(a, columns[start:stop])
            del a  # free this chunk's buffer before the next is allocated
        stats = combine(selected, rest_max, rest_sum, group)

        # int32 halves the saved [n, K] indices (scatter wants int64: converted per chunk).
        ctx.save_for_backward(columns.int(), stats.selected, stats.row_max, stats.total,
                              stats.rest_max, stats.rest_sum, *tensors)
        ctx.config = (kind, temperature, valid, chunk_bytes)
        return stats.logp_sel, stats.logp_rest

    @staticmethod
    def backward(ctx, grad_sel, grad_rest):
        columns, selected, row_max, total, rest_max, rest_sum, *tensors = ctx.saved_tensors
        kind, temperature, valid, chunk_bytes = ctx.config
        stats = Statistics(selected, row_max, total, rest_max, rest_sum, None, None)
        source = kind(*tensors)
        sink = source.gradient(ctx.needs_input_grad[7:])
        per = chunk_rows(chunk_bytes, valid + 1, source.count, source.element_size)
        for start, stop in row_chunks(source.count if valid else 0, per):
            a = scaled_chunk(source.low_chunk(start, stop, valid), temperature)
            chunk_gradient(a, columns[start:stop].long(), _rows_slice(stats, start, stop),
                           grad_sel[start:stop], grad_rest[start:stop], temperature)
            sink.add(start, stop, a, valid)
            del a
        sink.finish(valid)
        return (None,) * 7 + tuple(sink.result())


def scalar_loss_and_gradients(source, teacher_rows, row_weight, shard, valid, group,
                              rows_per_chunk, sink, *, reverse, normalize):
    """``sum(row_weight * loss)`` with the student's gradient added to ``sink`` on the way:
    one pass over the student, for losses reduced to a scalar (the upstream gradient of each
    row's loss is its ``row_weight``). ``teacher_rows(start, stop)`` gives the chunk's
    :class:`SparseTeacher`, so the ``[rows, K]`` targets exist one chunk at a time.
    ``rows_per_chunk`` must be the same on every rank (statistics are combined per chunk)."""
    total = torch.zeros((), dtype=torch.float32, device=source.device)
    for start, stop in row_chunks(source.count, rows_per_chunk):
        teacher = teacher_rows(start, stop)
        r, k = stop - start, teacher.k
        cols = local_columns(teacher.indices.reshape(r, k), shard.offset, valid)
        a = scaled_chunk(source.low_chunk(start, stop, valid), teacher.temperature)
        selected, local_max, local_sum = chunk_statistics(a, cols)  # a: exp(a - local_max)
        stats = combine(selected, local_max, local_sum, group)
        weight = row_weight[start:stop]
        with torch.enable_grad():
            logp_sel = stats.logp_sel.requires_grad_()
            logp_rest = stats.logp_rest.requires_grad_()
            loss = bucket_kl(logp_sel, logp_rest, teacher.logprobs.reshape(r, k),
                             teacher.rest_logprob.reshape(r), reverse=reverse,
                             normalize=normalize)
            loss = torch.where(weight != 0, loss * weight, 0.0).sum()
            # normalize="topk" leaves logp_rest out: its gradient is zero.
            grad_sel, grad_rest = torch.autograd.grad(loss, (logp_sel, logp_rest),
                                                      allow_unused=True, materialize_grads=True)
        total += loss.detach()
        chunk_gradient(a, cols, stats, grad_sel, grad_rest, teacher.temperature, local_max)
        sink.add(start, stop, a, valid)
        del a
    sink.finish(valid)
    return total
