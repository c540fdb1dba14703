"""Full-vocabulary KL, chunk by chunk over rows.

Per row, with ``w`` the weighting distribution's scaled logits and ``o`` the other's (``w = b``,
the teacher, for forward KL; ``w = a``, the student, for reverse KL), each centered on its own
row max and ``s_w``, ``s_o`` their centered exp-sums:

    L = sum_j exp(w_j) * (w_j - o_j) / s_w - log s_w + log s_o

which is offset-free: a common shift of either model's row cancels in ``w_j - max``. Across
tensor-parallel ranks the per-rank sums are rescaled to the global maxima (one MAX and one SUM
all-reduce of O(rows) numbers). The gradient, recomputed per chunk:

    forward KL: dL/da_j = p_j - q_j
    reverse KL: dL/da_j = p_j * (log p_j - log q_j - L)

needs no collective (the upstream gradient is the same on every rank).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import parallel
from ._rows import chunk_rows, row_chunks, widen
from .student import _finite_or_zero


def check_aligned(shards, vocab: int) -> int:
    """This rank's real columns, after checking student and teacher are sharded alike."""
    student, teacher = shards["student"], shards["teacher"]
    valid = student.valid(vocab)
    if (student.offset, valid) != (teacher.offset, teacher.valid(vocab)):
        raise ValueError(
            "the student and teacher logits must be sharded alike over the vocabulary: this "
            f"rank holds student columns from {student.offset} ({student.width} wide) and "
            f"teacher columns from {teacher.offset} ({teacher.width} wide)"
        )
    return valid


def scaled_chunks(student_low, teacher_low, temperature):
    """Float32 ``z / T`` and ``t / T`` from chunks in the logits' dtypes."""
    a = widen(student_low)
    b = widen(teacher_low)
    if temperature != 1.0:
        a.div_(temperature)
        b.div_(temperature)
    return a, b


def _low_chunks(student, teacher, start, stop, valid):
    return student.low_chunk(start, stop, valid), teacher.low_chunk(start, stop, valid)


def chunk_statistics(a: torch.Tensor, b: torch.Tensor, reverse: bool, keep_diff: bool = False):
    """``[r, 5]``: student max, teacher max, student sum, teacher sum, weighted sum, this
    shard's, each sum relative to this shard's max (0 for a max of -inf).

    Leaves ``a = exp(a - max a)`` and ``b = exp(b - max b)``; with ``keep_diff`` also returns
    ``w - o`` (both centered), else ``None``."""
    if a.shape[-1] == 0:  # a shard that is all vocabulary padding
        empty = torch.tensor([float("-inf"), float("-inf"), 0.0, 0.0, 0.0], device=a.device)
        return empty.expand(a.shape[0], 5), (a if keep_diff else None)
    a_max, b_max = a.amax(-1), b.amax(-1)
    a.sub_(_finite_or_zero(a_max)[:, None])
    b.sub_(_finite_or_zero(b_max)[:, None])
    w, o = (a, b) if reverse else (b, a)
    diff = w - o
    o_sum = o.exp_().sum(-1)
    w_sum = w.exp_().sum(-1)
    # 0 * inf (a zero weight against a -inf log-prob) is NaN here and must count as 0.
    weighted = torch.nansum(w * diff if keep_diff else diff.mul_(w), -1)
    a_sum, b_sum = (w_sum, o_sum) if reverse else (o_sum, w_sum)
    stats = torch.stack([a_max, b_max, a_sum, b_sum, weighted], -1)
    return stats, (diff if keep_diff else None)


@dataclass
class Statistics:
    row_max: torch.Tensor  # [n, 2] global student and teacher maxima (0 if all -inf)
    a_sum: torch.Tensor  # [n] sum exp(a - max a)
    b_sum: torch.Tensor  # [n] sum exp(b - max b)
    loss: torch.Tensor  # [n]

    def rows(self, start: int, stop: int) -> Statistics:
        return Statistics(self.row_max[start:stop], self.a_sum[start:stop],
                          self.b_sum[start:stop], self.loss[start:stop])


def combine(stats: torch.Tensor, reverse: bool, group) -> Statistics:
    """Global statistics and the per-row loss from each shard's :func:`chunk_statistics`."""
    local_max = stats[:, :2]
    global_max = _finite_or_zero(parallel.all_reduce_max_(local_max.clone(), group))
    scale = torch.exp(local_max - global_max)  # 0 where this rank's shard is all -inf
    shift = torch.where(scale > 0, local_max - global_max, 0.0)  # rank max vs global max
    w_col, o_col = (0, 1) if reverse else (1, 0)
    weighted = stats[:, 4] + stats[:, 2 + w_col] * (shift[:, w_col] - shift[:, o_col])
    sums = torch.stack([stats[:, 2] * scale[:, 0], stats[:, 3] * scale[:, 1],
                        torch.where(scale[:, w_col] > 0, weighted * scale[:, w_col], 0.0)], -1)
    a_sum, b_sum, weighted = parallel.all_reduce_sum_(sums, group).unbind(-1)
    w_sum, o_sum = (a_sum, b_sum) if reverse else (b_sum, a_sum)
    return Statistics(global_max, a_sum, b_sum, weighted / w_sum - w_sum.log() + o_sum.log())


def chunk_gradient(a, b, stats: Statistics, grad_loss, temperature, reverse):
    """Overwrite ``a`` (the chunk's ``z / T``) with ``d loss / d z``; ``b`` is consumed."""
    a.sub_(stats.row_max[:, :1])
    b.sub_(stats.row_max[:, 1:])
    a_coef = (grad_loss / (stats.a_sum * temperature))[:, None]
    if reverse:  # p_j * (log p_j - log q_j - L)
        shift = stats.b_sum.log() - stats.a_sum.log() - stats.loss
        b.neg_().add_(a).add_(shift[:, None])
        a.exp_().mul_(a_coef).mul_(b)
        torch.nan_to_num_(a, nan=0.0, posinf=float("inf"), neginf=float("-inf"))
    else:  # p_j - q_j
        a.exp_().mul_(a_coef)
        a.sub_(b.exp_().mul_((grad_loss / (stats.b_sum * temperature))[:, None]))
    return a


class DenseKL(torch.autograd.Function):
    """``(student tensors, teacher tensors) -> loss [n]`` float32.

    ``student_kind``/``teacher_kind`` build the row sources (``Rows`` or ``LinearRows``) from
    the first ``n_student`` tensors and the rest; the teacher gets no gradient.
    """

    @staticmethod
    def forward(ctx, student_kind, teacher_kind, n_student, temperature, reverse, valid, group,
                chunk_bytes, *tensors):
        student = student_kind(*tensors[:n_student])
        teacher = teacher_kind(*tensors[n_student:])
        n = student.count
        stats = torch.zeros(n, 5, dtype=torch.float32, device=student.device)
        stats[:, :2] = float("-inf")
        per = chunk_rows(chunk_bytes, valid, n, student.element_size, buffers=3)
        for start, stop in row_chunks(n if valid else 0, per):
            a, b = scaled_chunks(*_low_chunks(student, teacher, start, stop, valid), temperature)
            stats[start:stop] = chunk_statistics(a, b, reverse)[0]
            del a, b  # free this chunk's buffers before the next is allocated
        stats = combine(stats, reverse, group)
        ctx.save_for_backward(stats.row_max, stats.a_sum, stats.b_sum, stats.loss, *tensors)
        ctx.config = (student_kind, teacher_kind, n_student, temperature, reverse, valid,
                      chunk_bytes)
        return stats.loss

    @staticmethod
    def backward(ctx, grad_loss):
        row_max, a_sum, b_sum, loss, *tensors = ctx.saved_tensors
        student_kind, teacher_kind, n_student, temperature, reverse, valid, chunk_bytes = \
            ctx.config
        stats = Statistics(row_max, a_sum, b_sum, loss)
        student = student_kind(*tensors[:n_student])
        teacher = teacher_kind(*tensors[n_student:])
        sink = student.gradient(ctx.needs_input_grad[8:8 + n_student])
        per = chunk_rows(chunk_bytes, valid, student.count, student.element_size, buffers=2)
        for start, stop in row_chunks(student.count if valid else 0, per):
            a, b = scaled_chunks(*_low_chunks(student, teacher, start, stop, valid), temperature)
            chunk_gradient(a, b, stats.rows(start, stop), grad_loss[start:stop], temperature,
                           reverse)
            sink.add(start, stop, a, valid)
            del a, b
        sink.finish(valid)
        return (None,) * 8 + tuple(sink.result()) + (None,) * (len(tensors) - n_student)


def _gradient_from_exp(a, b, diff, local_max, stats: Statistics, grad_loss, temperature,
                       reverse):
    """``d loss / d z`` into ``a``, from what :func:`chunk_statistics` left: ``a``/``b`` the
    exponentials relative to this shard's maxima ``local_max`` ``[r, 2]``, ``diff`` (reverse
    KL) the centered ``a - b``."""
    shift = _finite_or_zero(local_max) - stats.row_max  # this shard's max vs the global one
    a_coef = grad_loss / (stats.a_sum * temperature) * torch.exp(shift[:, 0])
    if reverse:  # p_j * (log p_j - log q_j - L)
        offset = shift[:, 0] - shift[:, 1] - stats.a_sum.log() + stats.b_sum.log() - stats.loss
        a.mul_(a_coef[:, None]).mul_(diff.add_(offset[:, None]))
        torch.nan_to_num_(a, nan=0.0, posinf=float("inf"), neginf=float("-inf"))
    else:  # p_j - q_j
        b_coef = grad_loss / (stats.b_sum * temperature) * torch.exp(shift[:, 1])
        a.mul_(a_coef[:, None]).sub_(b.mul_(b_coef[:, None]))
    return a


def scalar_loss_and_gradients(student, teacher, row_weight, temperature, reverse, valid, group,
                              rows_per_chunk, sink):
    """``sum(row_weight * loss)`` with the student's gradient added to ``sink`` on the way:
    one pass, for losses reduced to a scalar (the upstream gradient is ``row_weight``).
    ``rows_per_chunk`` must be the same on every rank (statistics are combined per chunk)."""
    total = torch.zeros((), dtype=torch.float32, device=student.device)
    for start, stop in row_chunks(student.count, rows_per_chunk):
        a, b = scaled_chunks(*_low_chunks(student, teacher, start, stop, valid), temperature)
        local, diff = chunk_statistics(a, b, reverse, keep_diff=reverse)
        stats = combine(local, reverse, group)
        weight = row_weight[start:stop]
        total += torch.where(weight != 0, stats.loss * weight, 0.0).sum()
        _gradient_from_exp(a, b, diff, local[:, :2], stats, weight, temperature, reverse)
        sink.add(start, stop, a, valid)
        del a, b, diff
    sink.finish(valid)
    return total
