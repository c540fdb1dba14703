"""The few collectives of the vocabulary-parallel losses.

Every function is a no-op for ``group=None`` (one process), so the math modules call them
unconditionally and single-process runs pay nothing. Each rank holds a contiguous vocabulary
shard, ranks in group order (Megatron's vocab-parallel layout); shards may differ in size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


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


def exchange_shards(group, widths: dict[str, int], rows: int, device) -> dict[str, Shard]:
    """Each named tensor's shard on this rank, from every rank's widths (one small all-gather
    of a few integers, on the inputs' ``device``).

    Every rank validates the same gathered numbers, so a bad input raises the same error on
    all ranks instead of leaving some of them waiting in a collective.
    """
    local = [*widths.values(), rows]
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
