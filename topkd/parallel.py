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
- :func:`rows_to_ranks` and :func:`gather_rows`: the teacher's selection
  (:mod:`topkd.select`), per merge block of rows one all-to-all of the candidates (each rank
  merges a part of the rows) and one all-gather of the merged parts; called only across ranks
  (neither is a no-op for ``None``).
- :class:`AllReduceGradient`: the fused losses with ``reduce_hidden_grad=True``, one SUM
  all-reduce of the hidden states' gradient in backward.

A head that is a DTensor sharded by vocabulary rows over a data-parallel mesh (FSDP2;
:mod:`topkd.sharded` routes it) adds, with the mesh's group (these are not no-ops for
``None``; they are only called with a group):

- ``sharded_head="vocab_parallel"``: :func:`exchange_counts` (the ranks' row counts and teacher
  widths), :class:`GatherRows` / :func:`gather_rows` (every rank's hidden states, teacher rows,
  labels, mask and row weights), or :func:`columns_to_rows` (teacher logits, one all-to-all),
  then the engine's collectives above over the gathered batch; backward: :class:`GatherRows`'s
  reduce-scatter of the hidden states' gradient, and :func:`same_upstream` (a scalar loss) or
  :class:`OwnRows` (per-row losses) gathering the upstream gradients.
- ``sharded_head="gather"``: :class:`GatherShards` (the head, all-gathered; backward: its
  gradient reduce-scattered and divided) and :func:`gather_shards` (a sharded teacher head).
"""

from __future__ import annotations

import zlib
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


def exchange_shards(group, widths: dict[str, int], count: int, device,
                    same: dict[str, tuple[str, tuple[str, ...]]] | None = None
                    ) -> dict[str, Shard]:
    """Each named tensor's shard on this rank, from every rank's widths (one small all-gather
    of a few integers, on the inputs' ``device``).

    ``same``: ``{what: (this rank's value, values to name)}``, strings every rank must share
    (the kernels: their chunk heights, and so their collectives, differ), sent with the
    widths as their CRC-32; a rank's value outside the names (and this rank's own) is shown
    as ``"?"``.

    Every rank validates the same gathered numbers, so a bad input raises the same error on
    all ranks instead of leaving some of them waiting in a collective.
    """
    same = same or {}
    codes = [_code(value) for value, _ in same.values()]
    local = [*widths.values(), *codes, count]
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
    for i, (what, (value, names)) in enumerate(same.items()):
        ranks = [s[len(widths) + i] for s in shapes]
        if len(set(ranks)) > 1:
            named = {_code(name): name for name in (*names, value)}
            seen = [named.get(code, "?") for code in ranks]
            raise ValueError(f"{what} differ across ranks: {seen} (by rank); every rank must "
                             f"run the same")
    rank = 0 if group is None else dist.get_rank(group)
    shards = {}
    for i, name in enumerate(widths):
        all_widths = [s[i] for s in shapes]
        shards[name] = Shard(offset=sum(all_widths[:rank]), width=all_widths[rank],
                             total=sum(all_widths), widest=max(all_widths))
    return shards


def _code(value: str) -> int:
    """``value`` as an integer every process computes alike (Python's ``hash`` is salted)."""
    return zlib.crc32(value.encode())


def all_reduce_max_(tensor: torch.Tensor, group) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor


def all_reduce_sum_(tensor: torch.Tensor, group) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def rows_to_ranks(tensor: torch.Tensor, group) -> torch.Tensor:
    """Part ``r`` of every rank's ``tensor`` (``[n, ...]``, the same ``n`` on every rank, cut
    into ``world`` parts of ``ceil(n / world)`` rows, the last padded with zeros) to rank
    ``r``, stacked in rank order: ``[world, part, ...]``. One all-to-all; no gradient."""
    world = dist.get_world_size(group)
    part = -(-tensor.shape[0] // world)
    receive = tensor.new_empty((world, part, *tensor.shape[1:]))
    dist.all_to_all_single(receive, _pad_rows(tensor.detach(), world * part), group=group)
    return receive


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


class GradientMap(torch.autograd.Function):
    """Identity forward; in backward the gradient goes through ``ctx.map``, which a
    subclass's ``forward(ctx, tensor, arg)`` sets (``arg`` gets no gradient)."""

    @staticmethod
    def backward(ctx, grad):
        return ctx.map(grad), None


def _all_reduced(grad, group):
    grad = grad.contiguous()
    dist.all_reduce(grad, group=group)
    return grad


class AllReduceGradient(GradientMap):
    """Identity forward; SUM all-reduce of the gradient in backward (Megatron's
    ``copy_to_tensor_model_parallel_region``)."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.map = lambda grad: _all_reduced(grad, group)
        return tensor.view_as(tensor)


# ---- a head sharded by vocabulary rows over a data-parallel mesh (FSDP2) --------------------
#
# Each rank holds its own tokens and the vocabulary rows ``[offset, offset + size)`` of the
# head (DTensor ``Shard(0)`` on a 1-D mesh, torch.chunk's sizes: uneven shards included). Row
# tensors are padded to the largest row count so every collective has equal parts.


def exchange_counts(group, values: list[int], device) -> list[list[int]]:
    """Every rank's ``values`` (a few integers: its row count, ...; one all-gather)."""
    if group is None:
        return [list(values)]
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    return [t.tolist() for t in everyone]


def raise_together(error: Exception | None, group, device) -> None:
    """Raise on every rank of ``group`` if any rank found its inputs bad (``error``, this
    rank's, or None): one all-gather of a flag, so that no rank waits in a collective that a
    refusing rank never joins. A refusing rank raises its own ``error``; the others a
    ``ValueError`` naming those ranks."""
    flags = exchange_counts(group, [error is not None], device)
    if error is not None:
        raise error
    refused = [rank for rank, (flag,) in enumerate(flags) if flag]
    if refused:
        raise ValueError(f"rank(s) {refused} of the group found their inputs bad (their own "
                         f"error says why); no rank ran the loss")


def _reduce_scatter(output, tensor, group) -> None:
    """SUM reduce-scatter of ``tensor`` (``world`` equal parts along dim 0) into ``output``
    (``reduce_scatter_single`` where torch has it: newer torch deprecates the other name)."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(output, tensor, group=group)


def _pad_rows(tensor: torch.Tensor, rows: int, value=0) -> torch.Tensor:
    if tensor.shape[0] == rows:
        return tensor.contiguous()
    pad = tensor.new_full((rows - tensor.shape[0], *tensor.shape[1:]), value)
    return torch.cat([tensor, pad])


def gather_rows(tensor: torch.Tensor, group, rows: int, value=0) -> torch.Tensor:
    """Every rank's ``tensor`` (``[n_r, ...]``, padded with ``value`` to ``rows``) stacked in
    rank order: ``[world * rows, ...]``. No gradient (the teacher's tensors, labels, masks)."""
    padded = _pad_rows(tensor.detach(), rows, value)
    if tensor.dtype == torch.bool:  # gathered as bytes: not every backend reduces bools
        return gather_rows(padded.to(torch.uint8), group, rows).bool()
    parts = [torch.empty_like(padded) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, padded, group=group)
    return torch.cat(parts)


class GatherRows(torch.autograd.Function):
    """Every rank's rows ``[n_r, H]`` as one ``[world * rows, H]`` batch (padded to ``rows``
    each); backward: a SUM reduce-scatter, so each rank gets the sum over every rank's
    vocabulary shard of the gradient of its own rows."""

    @staticmethod
    def forward(ctx, tensor, group, rows):
        ctx.group, ctx.count = group, tensor.shape[0]
        return gather_rows(tensor, group, rows)

    @staticmethod
    def backward(ctx, grad):
        world = dist.get_world_size(ctx.group)
        out = grad.new_empty((grad.shape[0] // world, *grad.shape[1:]))
        _reduce_scatter(out, grad.contiguous(), group=ctx.group)
        return out[:ctx.count], None, None


class OwnRows(torch.autograd.Function):
    """This rank's rows ``[start, start + count)`` of per-row values that every rank holds
    alike; backward: every rank's upstream gradient of its own rows, all-gathered, which is
    the whole batch's upstream gradient."""

    @staticmethod
    def forward(ctx, values, group, start, count, rows):
        ctx.group, ctx.rows = group, rows
        return values[start:start + count]

    @staticmethod
    def backward(ctx, grad):
        return gather_rows(grad, ctx.group, ctx.rows), None, None, None, None


def same_upstream(grad: torch.Tensor, group) -> torch.Tensor:
    """The upstream gradient of a loss whose gradients were written in forward for every
    rank's rows at once: it must be the same on every rank (one all-gather of a scalar)."""
    everyone = gather_rows(grad.reshape(1).float(), group, 1)
    if not bool((everyone == everyone[0]).all()):
        raise RuntimeError(
            "the upstream gradient of a loss over a vocabulary-sharded DTensor head differs "
            f"across ranks ({everyone.tolist()}); with sharded_head='vocab_parallel' a scalar "
            "loss's gradients are written in forward for every rank's tokens and need the "
            "same scale on every rank (scale every rank's loss alike, or use "
            "sharded_head='gather' or reduction='none')")
    return grad


class GatherShards(torch.autograd.Function):
    """The whole ``[V, ...]`` tensor from every rank's rows (``sizes[r]`` on rank r; padded to
    the largest for the all-gather); backward: a SUM reduce-scatter of the whole gradient,
    divided by ``divide``, so each rank gets its rows of ``sum_r grad_r / divide`` (FSDP's
    gradient reduction: ``divide`` = the mesh size averages)."""

    @staticmethod
    def forward(ctx, shard, group, sizes, divide):
        ctx.group, ctx.sizes, ctx.divide = group, sizes, divide
        return gather_shards(shard, group, sizes)

    @staticmethod
    def backward(ctx, grad):
        sizes, widest = ctx.sizes, max(ctx.sizes)
        world = len(sizes)
        parts = list(grad.split(sizes))
        padded = torch.cat([_pad_rows(p, widest) for p in parts]) if world > 1 else grad
        out = grad.new_empty((widest, *grad.shape[1:]))
        _reduce_scatter(out, padded.contiguous(), group=ctx.group)
        mine = out[:sizes[dist.get_rank(ctx.group)]]
        return mine.div_(ctx.divide), None, None, None


def gather_shards(shard: torch.Tensor, group, sizes: list[int]) -> torch.Tensor:
    """The whole tensor from every rank's ``sizes[r]`` rows (no gradient)."""
    widest = max(sizes)
    parts = [shard.new_empty((widest, *shard.shape[1:])) for _ in sizes]
    dist.all_gather(parts, _pad_rows(shard.detach(), widest), group=group)
    return torch.cat([p[:s] for p, s in zip(parts, sizes, strict=True)])


def columns_to_rows(tensor: torch.Tensor, group, sizes: list[int], rows: int) -> torch.Tensor:
    """``[n_r, V]`` (this rank's rows, every column) to ``[world * rows, sizes[rank]]`` (every
    rank's rows, padded to ``rows`` each, this rank's columns): one all-to-all. No gradient
    (a teacher's logits)."""
    rank = dist.get_rank(group)
    padded = _pad_rows(tensor.detach(), rows)
    blocks = padded.split(sizes, dim=-1)
    send = torch.cat([b.reshape(-1) for b in blocks])
    receive = padded.new_empty(len(sizes) * rows * sizes[rank])
    dist.all_to_all_single(receive, send, [rows * sizes[rank]] * len(sizes),
                           [rows * s for s in sizes], group=group)
    return receive.view(len(sizes) * rows, sizes[rank])
