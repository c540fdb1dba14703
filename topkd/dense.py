"""Full-vocabulary KL as one autograd Function, chunk by chunk over rows.

Per row, with ``w`` the weighting distribution's scaled logits and ``o`` the other's (``w = b``,
the teacher, for forward KL; ``w = a``, the student, for reverse KL), each centered on its own
row max and ``s_w``, ``s_o`` their centered exp-sums:

    L = sum_j exp(w_j) * (w_j - o_j) / s_w - log s_w + log s_o

which is offset-free: a common shift of either model's row cancels in ``w_j - max``. Across
tensor-parallel ranks the per-rank sums are rescaled to the global maxima (one MAX and one SUM
all-reduce of O(rows) numbers). Backward recomputes per chunk:

    forward KL: dL/da_j = p_j - q_j
    reverse KL: dL/da_j = p_j * (log p_j - log q_j - L)

and makes no collective (the upstream gradient is the same on every rank).
"""

from __future__ import annotations

import torch

from . import parallel
from ._rows import chunk_rows, row_chunks
from .student import _finite_or_zero


def _scaled_chunks(student, teacher, start, stop, valid, temperature):
    a = student.float_chunk(start, stop, valid)
    b = teacher.float_chunk(start, stop, valid)
    if temperature != 1.0:
        a.div_(temperature)
        b.div_(temperature)
    return a, b


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
        # Columns of stats: student max, teacher max, student sum, teacher sum, weighted sum.
        stats = torch.zeros(n, 5, dtype=torch.float32, device=student.device)
        stats[:, :2] = float("-inf")
        per = chunk_rows(chunk_bytes, valid, n, student.element_size, buffers=3)
        for start, stop in row_chunks(n if valid else 0, per):
            a, b = _scaled_chunks(student, teacher, start, stop, valid, temperature)
            a_max, b_max = a.amax(-1), b.amax(-1)
            a.sub_(_finite_or_zero(a_max)[:, None])
            b.sub_(_finite_or_zero(b_max)[:, None])
            w, o = (a, b) if reverse else (b, a)
            diff = w - o
            o_sum = o.exp_().sum(-1)
            w_sum = w.exp_().sum(-1)
            # 0 * inf (a zero weight against a -inf log-prob) is NaN here and must count as 0.
            weighted = torch.nansum(w.mul_(diff), -1)
            a_sum, b_sum = (w_sum, o_sum) if reverse else (o_sum, w_sum)
            stats[start:stop] = torch.stack([a_max, b_max, a_sum, b_sum, weighted], -1)
            del a, b, w, o, diff  # free this chunk's buffers before the next is allocated

        local_max = stats[:, :2]
        global_max = _finite_or_zero(parallel.all_reduce_max_(local_max.clone(), group))
        scale = torch.exp(local_max - global_max)  # 0 where this rank's shard is all -inf
        shift = torch.where(scale > 0, local_max - global_max, 0.0)  # rank max vs global max
        w_col, o_col = (0, 1) if reverse else (1, 0)
        weighted = stats[:, 4] + stats[:, 2 + w_col] * (shift[:, w_col] - shift[:, o_col])
        sums = torch.stack([stats[:, 2] * scale[:, 0], stats[:, 3] * scale[:, 1],
                            torch.where(scale[:, w_col] > 0, weighted * scale[:, w_col], 0.0)], -1)
        sums = parallel.all_reduce_sum_(sums, group)
        a_sum, b_sum, weighted = sums.unbind(-1)
        w_sum, o_sum = (a_sum, b_sum) if reverse else (b_sum, a_sum)
        loss = weighted / w_sum - w_sum.log() + o_sum.log()

        ctx.save_for_backward(global_max, a_sum, b_sum, loss, *tensors)
        ctx.config = (student_kind, teacher_kind, n_student, temperature, reverse, valid,
                      chunk_bytes)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        global_max, a_sum, b_sum, loss, *tensors = ctx.saved_tensors
        student_kind, teacher_kind, n_student, temperature, reverse, valid, chunk_bytes = \
            ctx.config
        student = student_kind(*tensors[:n_student])
        teacher = teacher_kind(*tensors[n_student:])
        sink = student.gradient(ctx.needs_input_grad[8:8 + n_student])
        a_coef = grad_loss / (a_sum * temperature)
        b_coef = grad_loss / (b_sum * temperature)
        log_ratio_shift = b_sum.log() - a_sum.log() - loss
        per = chunk_rows(chunk_bytes, valid, student.count, student.element_size, buffers=2)
        for start, stop in row_chunks(student.count if valid else 0, per):
            a, b = _scaled_chunks(student, teacher, start, stop, valid, temperature)
            a.sub_(global_max[start:stop, :1])
            b.sub_(global_max[start:stop, 1:])
            if reverse:  # p_j * (log p_j - log q_j - L)
                b.neg_().add_(a).add_(log_ratio_shift[start:stop, None])
                a.exp_().mul_(a_coef[start:stop, None]).mul_(b)
                torch.nan_to_num_(a, nan=0.0, posinf=float("inf"), neginf=float("-inf"))
            else:  # p_j - q_j
                a.exp_().mul_(a_coef[start:stop, None])
                a.sub_(b.exp_().mul_(b_coef[start:stop, None]))
            sink.add(start, stop, a, valid)
            del a, b
        if not valid:
            sink.add(0, student.count, torch.zeros(student.count, 1, device=student.device), 0)
        n_teacher = len(tensors) - n_student
        return (None,) * 8 + tuple(sink.result()) + (None,) * n_teacher
