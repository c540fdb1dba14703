"""Every collective of the vocabulary-parallel losses: no other module calls
``torch.distributed``'s collectives.

Every function is a no-op for ``group=None`` (one process), so the callers call them
unconditionally and single-process runs pay nothing. Each rank holds a contiguous vocabulary
shard, ranks in group order (Megatron's vocab-parallel layout); shards may differ in size.
Who calls what, per loss call (forward; backward has none but the last):

- :func:`exchange_shards`: one all-gather of a few integers, at the start of each public
  loss and of :func:`topkd.select_topk`.
- :func:`combine_statistics` (one MAX and one SUM all-reduce) and :func:`sum_rows` (one SUM),
  from :mod:`topkd.engine` per chunk of rows: the Top-K path 2 all-reduces per chunk, the
  full-vocabulary path 3.
- :func:`all_gather_cat`: the teacher's selection (:mod:`topkd.select`), one all-gather of
  the candidates per merge block of rows.
- :class:`AllReduceGradient`: the fused losses with ``reduce_hidden_grad=True``, one SUM
  all-reduce of the hidden states' gradient in backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .kernels import finite_or_zero


def world_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


@dataclass(frozen=True)
class Shard:
    """This rank's vocabulary columns ``[offset, offset + width)`` of ``total`` columns;
    ``widest`` is the largest shard of the group (every rank cuts its chunks by it)."""

    offset: int
    width: int
    total: int
    widest: int

    def valid(self, vocab_size: int) -> int:
        """How many of this shard's leading columns lie below ``vocab_size`` (the rest pad)."""
        return max(0, min(self.width, vocab_size - self.offset))


def exchange_shards(group, widths: dict[str, int], count: int, device) -> dict[str, Shard]:
    """Each named tensor's shard on this rank, from every rank's widths (one small all-gather
    of a few integers, on the inputs' ``device``).

    Every rank validates the same gathered numbers, so a bad input raises the same error on
    all ranks instead of leaving some of them waiting in a collective.
    """
    local = [*widths.values(), count]
    if group is None:
        shapes = [local]
    else:
        mine = torch.tensor(local, dtype=torch.int64, device=device)
        everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(everyone, mine, group=group)
        shapes = [t.tolist() for t in everyone]
    row_counts = [s[-1] for s in shapes]
    if len(set(row_counts)) > 1:
        raise ValueError(f"the number of rows differs across ranks: {row_counts}")
    rank = 0 if group is None else dist.get_rank(group)
    shards = {}
    for i, name in enumerate(widths):
        all_widths = [s[i] for s in shapes]
        shards[name] = Shard(offset=sum(all_widths[:rank]), width=all_widths[rank],
                             total=sum(all_widths), widest=max(all_widths))
    return shards


def all_reduce_max_(tensor: torch.Tensor, group) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor


def all_reduce_sum_(tensor: torch.Tensor, group) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def all_gather_cat(tensor: torch.Tensor, group, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` (same shape on all ranks) along ``dim``."""
    if group is None:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


# ---- what the losses call per chunk and per call ---------------------------------------------


def combine_statistics(maxima: list, sums: list, paired: list[int], group):
    """Global row maxima and sums from this shard's (one MAX, one SUM all-reduce), as lists of
    ``[r, c]`` parts. Column ``paired[i]`` of the concatenated maxima is the max that column
    ``i`` of the concatenated sums (sums of ``exp(x - max)``) is relative to; each sum is
    rescaled to the global max before the SUM. The other columns (kept values, a label's
    logit) live on one rank and are -inf elsewhere."""
    if group is None:
        return maxima, sums
    local = torch.cat(maxima, -1)
    reduced = all_reduce_max_(local.clone(), group)
    rescale = torch.exp(local[:, paired] - finite_or_zero(reduced[:, paired]))
    summed = torch.cat(sums, -1)
    summed = all_reduce_sum_(torch.where(summed > 0, summed * rescale, 0.0), group)
    return (list(reduced.split([m.shape[1] for m in maxima], -1)),
            list(summed.split([x.shape[1] for x in sums], -1)))


def sum_rows(values: list, group) -> list:
    """Per-row sums of every shard's ``values`` (``[r]`` each): one SUM all-reduce."""
    if group is None:
        return values
    return list(all_reduce_sum_(torch.stack(values, -1), group).unbind(-1))


class AllReduceGradient(torch.autograd.Function):
    """Identity forward; SUM all-reduce of the gradient in backward (Megatron's
    ``copy_to_tensor_model_parallel_region``)."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None
