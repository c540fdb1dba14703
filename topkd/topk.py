"""One chunk's top-K in the selection's canonical order (value descending, ties to the lower
index), so a selection depends on the row alone: never on chunk size, thread count or
tensor-parallel layout. Plain functions of float32 ``[r, W]`` chunks; no collectives.
"""

from __future__ import annotations

import torch

# Indices must stay below this for the packed sort key; it also marks a padding candidate (a rank
# whose shard is narrower than K), which the tie rule then ranks after every real entry.
NO_INDEX = 2**31 - 1


def canonical_order(values: torch.Tensor, indices: torch.Tensor):
    """Sort each row by value descending, ties by index ascending (the selection's order).

    One sort of an int64 key: the float32 value's bits mapped to an order-preserving int32 in
    the high half, ``NO_INDEX - index`` in the low half.
    """
    bits = (values + 0.0).view(torch.int32)  # + 0.0 turns -0.0 into +0.0, which compare equal
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long()
    order = ((ordered << 32) | (NO_INDEX - indices)).argsort(dim=-1, descending=True)
    return values.gather(-1, order), indices.gather(-1, order)


def topk_lowest_index(b: torch.Tensor, k: int):
    """Top-``k`` of each row of ``b`` (float32 ``[r, V]``) in canonical order: value
    descending, ties (the K-th value's included) to the lower index, so the result depends on
    the row alone.

    When ``k`` is small next to the row, a threshold from a strided sample of the row cuts it to
    about 1.25 k candidates, which hold every entry at or above the K-th value (checked by their
    count); sorting those is the whole selection, ties included. Chunks where the sample misleads
    take the exact path instead.
    """
    n, width = b.shape
    if k >= width:
        return canonical_order(b, torch.arange(width, device=b.device).expand_as(b))
    stride = min(16, width // (8 * k))
    if stride < 2:
        return _topk_ties_fixed(b, k)
    sample = b[:, ::stride]
    keep = min(sample.shape[1], -(-k // stride) * 5 // 4 + 16)
    threshold = torch.topk(sample, keep, dim=-1, sorted=False).values.amin(-1, keepdim=True)
    row, col = (b >= threshold).nonzero(as_tuple=True)
    count, position = _count_and_rank(row, n)
    if not bool(((count >= k) & (count <= 4 * k)).all()):
        return _topk_ties_fixed(b, k)
    columns = int(count.max())
    values = b.new_full((n, columns), float("-inf"))
    indices = torch.full((n, columns), NO_INDEX, dtype=torch.int64, device=b.device)
    values[row, position] = b[row, col]
    indices[row, position] = col
    values, indices = canonical_order(values, indices)
    return values[:, :k], indices[:, :k]


def _count_and_rank(row: torch.Tensor, rows: int):
    """For the row ids of a row-major ``nonzero``: entries per row, and each entry's rank
    within its row (columns ascending)."""
    count = torch.bincount(row, minlength=rows)
    start = torch.cumsum(count, 0) - count
    return count, torch.arange(row.numel(), device=row.device) - start[row]


def _topk_ties_fixed(b: torch.Tensor, k: int):
    """:func:`topk_lowest_index` by ``torch.topk``, refilling tied K-th values where needed.

    Taking one extra entry shows which rows have a tie across the K-th place; only then is the
    chunk scanned for the tied positions.
    """
    width = b.shape[-1]
    values, indices = torch.topk(b, min(k + 1, width), dim=-1, sorted=True)
    if k < width:
        straddle = values[:, k] == values[:, k - 1]
        values, indices = values[:, :k], indices[:, :k]
        if bool(straddle.any()):
            kth = values[:, -1:]
            above = (values > kth).sum(-1)
            row, col = (b == kth).nonzero(as_tuple=True)
            _, rank = _count_and_rank(row, b.shape[0])
            # The sorted top-k holds the K-th value in positions above..k-1: refill them with
            # the lowest tied indices (the others go to a spare column, dropped).
            slot = above[row] + rank
            slot = torch.where(straddle[row] & (slot < k), slot, k)
            spare = torch.cat([indices, indices[:, :1]], -1)
            spare[row, slot] = col
            indices = spare[:, :k]
    return canonical_order(values, indices)


def candidates_(b: torch.Tensor, k: int):
    """``(values [r, k], indices [r, k], rest max [r])`` of a chunk ``b`` (float32 ``[r, W]``,
    ``k <= W``): its top-``k`` in canonical order and the maximum of the rest (-inf when
    nothing is left). ``b`` is left holding -inf at the kept entries, so what remains is the
    rest."""
    if k < b.shape[1]:
        # One entry more than kept: the (k+1)-th largest is the maximum of the rest.
        values, indices = topk_lowest_index(b, k + 1)
        rest_max = values[:, k].contiguous()  # a plain [r]: kernels see one layout
        values, indices = values[:, :k], indices[:, :k]
    else:
        values, indices = topk_lowest_index(b, k)
        rest_max = torch.full_like(values[:, 0], float("-inf"))
    b.scatter_(1, indices, float("-inf"))
    return values, indices, rest_max
