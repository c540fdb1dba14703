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
    """This rank's vocabulary columns ``[offset, offset + width)`` of ``total`` columns."""

    offset: int
    width: int
    total: int

    def valid(self, vocab_size: int) -> int:
        """How many of this shard's leading columns lie below ``vocab_size`` (the rest pad)."""
        return max(0, min(self.width, vocab_size - self.offset))


def exchange_shapes(group, local: list[int]) -> list[list[int]]:
    """All ranks' ``local`` integer lists, in rank order (one small all-gather).

    Used to agree on shard offsets and to validate shapes identically on every rank, so that a
    bad input raises the same error everywhere instead of leaving some ranks in a collective.
    """
    if group is None:
        return [list(local)]
    device = _device(group)
    mine = torch.tensor(local, dtype=torch.int64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    return [t.tolist() for t in everyone]


def shard_of(widths: list[int], rank_index: int) -> Shard:
    return Shard(offset=sum(widths[:rank_index]), width=widths[rank_index], total=sum(widths))


def rank_in(group) -> int:
    return 0 if group is None else dist.get_rank(group)


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


def _device(group) -> torch.device:
    # NCCL only moves CUDA tensors; gloo moves CPU tensors.
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
