"""Teacher side: the top-K (and top-p) selection and its exact normalization.

The teacher is a constant target, so everything here runs under ``torch.no_grad``. Its logits
are read one chunk of rows at a time into a float32 work buffer; nothing of full size is made.
Each rank keeps, per row, its local top-K under the order (value descending, index ascending)
and the log-sum-exp of everything else it holds. Those two together partition the vocabulary,
so the merged candidates give the exact normalizer, the global top-K and the ghost bucket with
O(rows x K) communication and one pass over the logits.
"""

from __future__ import annotations

import torch

from . import _checks, compiled, parallel
from .kernels import read
from .sources import Rows, budget_bytes, chunk_rows, least_rows, row_chunks
from .teacher import SparseTeacher

# Indices must stay below this for the packed sort key; it also marks a padding candidate (a rank
# whose shard is narrower than K), which the tie rule then ranks after every real entry.
_NO_INDEX = 2**31 - 1


def canonical_order(values: torch.Tensor, indices: torch.Tensor):
    """Sort each row by value descending, ties by index ascending (the selection's order).

    One sort of an int64 key: the float32 value's bits mapped to an order-preserving int32 in
    the high half, ``_NO_INDEX - index`` in the low half.
    """
    bits = (values + 0.0).view(torch.int32)  # + 0.0 turns -0.0 into +0.0, which compare equal
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long()
    order = ((ordered << 32) | (_NO_INDEX - indices)).argsort(dim=-1, descending=True)
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
    indices = torch.full((n, columns), _NO_INDEX, dtype=torch.int64, device=b.device)
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


def _local_candidates(rows, k: int, temperature: float, valid: int, chunk_bytes,
                      budget_factor: int, logit_scale: float, softcap: float | None,
                      use_compiled: bool = False):
    """Per row of this shard's first ``valid`` columns: the top-k in canonical order (values,
    local indices; at most ``valid`` of them) and the rest's log-sum-exp as (max, log-sum)."""
    n, device = rows.count, rows.device
    k_local = min(k, valid)
    values = torch.empty(n, k_local, dtype=torch.float32, device=device)
    indices = torch.empty(n, k_local, dtype=torch.int64, device=device)
    rest_max = torch.full((n,), float("-inf"), dtype=torch.float32, device=device)
    rest_logsum = torch.full_like(rest_max, float("-inf"))
    if valid == 0:
        return values, indices, rest_max, rest_logsum
    per = chunk_rows(budget_factor * budget_bytes(chunk_bytes, n, valid, rows.element_size),
                     valid, n, 4)
    per = least_rows(per, use_compiled)
    for start, stop in row_chunks(n, per):
        # the chunk's one large buffer
        low = rows.low_chunk(start, stop, valid)
        if use_compiled:
            b = compiled.read(low, temperature, logit_scale, softcap)
        else:
            b, _ = read(low, temperature, logit_scale, softcap)
        if k_local < valid:
            # One entry more than kept: the (k+1)-th largest is the maximum of the rest.
            v, i = topk_lowest_index(b, k_local + 1)
            m = v[:, k_local]
            v, i = v[:, :k_local], i[:, :k_local]
        else:
            v, i = topk_lowest_index(b, k_local)
            m = torch.full_like(v[:, 0], float("-inf"))
        values[start:stop], indices[start:stop] = v, i
        rest_max[start:stop] = m
        b.scatter_(1, i, float("-inf"))
        if use_compiled:
            rest_logsum[start:stop] = compiled.log_sum_exp(b, m)
        else:
            m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
            rest_logsum[start:stop] = b.sub_(m[:, None]).exp_().sum(-1).log_()
        del b  # free this chunk's buffer before the next is allocated
    return values, indices, rest_max, rest_logsum


@torch.no_grad()
def select_topk(
    teacher_logits: torch.Tensor,
    k: int,
    *,
    top_p: float | None = None,
    top_p_min_k: int = 1,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    process_group=None,
    chunk_bytes: int | None = None,
    impl: str = "auto",
) -> SparseTeacher:
    """Pick and normalize the teacher's top-K entries per row (no gradient).

    Args:
        teacher_logits: ``[..., V_r]`` float32/bfloat16/float16, contiguous or not; with
            ``process_group``, this rank's contiguous vocabulary shard (ranks in group order).
        k: entries kept per row, ``1 <= k <= vocabulary``. Ties at the K-th value go to the
            lower vocabulary index, so the result is the same for every ``chunk_bytes`` and
            tensor-parallel layout.
        top_p: optionally keep, in probability order, entry ``r`` while the probability of the
            entries before it is ``< top_p`` (or ``r < top_p_min_k``); the rest join the ghost.
        temperature: logits are divided by it before the softmax.
        vocab_size: the real vocabulary; columns at or past it (padding) are outside the
            distribution. Defaults to the full (summed) width.
        process_group: the tensor-parallel group for vocabulary-sharded logits, or ``None``.
        chunk_bytes: size of the float32 work buffer per chunk of rows (default: the smaller of
            64 MiB and 1/16 of the logits).
        impl: ``"auto"``, ``"eager"`` or ``"compile"``, as in :func:`topkd.sparse_kl_loss`:
            the widening and the rest's log-sum-exp run compiled; the sort stays eager.

    Returns:
        A :class:`SparseTeacher` with leading shape ``[...]``, identical on every rank.
        ``logprobs`` and ``rest_logprob`` are computed in float32 relative to the row maximum,
        so adding a constant to a row changes nothing.
    """
    _checks.logits("teacher_logits", teacher_logits)
    temperature = _checks.temperature(temperature)
    top_p, top_p_min_k = _checks.top_p(top_p, top_p_min_k)
    chunk_bytes = _checks.chunk_bytes(chunk_bytes)
    shard = parallel.exchange_shards(process_group, {"teacher": teacher_logits.shape[-1]},
                                     teacher_logits.shape[:-1].numel(),
                                     teacher_logits.device)["teacher"]
    vocab = _checks.vocab_size(vocab_size, ("teacher_logits", shard.total))
    k = _checks.integer("k", k, 1, vocab)
    use_compiled = compiled.use_compile(impl, teacher_logits.device)
    return select_rows(Rows(teacher_logits), k, top_p, top_p_min_k, temperature, vocab, shard,
                       process_group, chunk_bytes, compiled=use_compiled)


@torch.no_grad()
def select_rows(rows, k, top_p, top_p_min_k, temperature, vocab, shard, process_group,
                chunk_bytes, budget_factor: int = 4, logit_scale: float = 1.0,
                softcap: float | None = None, compiled: bool = False) -> SparseTeacher:
    """:func:`select_topk` after validation, from a row source (``Rows`` of teacher logits or
    ``LinearRows`` of a teacher's LM head), with this rank's shard known.

    The work buffers get ``budget_factor`` times the chunk budget: the logits losses select
    before the student's backward allocates its gradient, so the selection can afford larger
    chunks than the student's loop (4); the fused losses, whose whole budget is small, pass 1.
    ``logit_scale`` and ``softcap`` turn a teacher LM head's products into its logits.
    ``compiled``: the element-wise parts run as compiled kernels.
    """
    values, local_idx, rest_max, rest_logsum = _local_candidates(
        rows, k, temperature, shard.valid(vocab), chunk_bytes, budget_factor, logit_scale,
        softcap, compiled)
    indices = local_idx + shard.offset
    if values.shape[-1] < k:  # this shard is narrower than k: pad so every rank sends [n, k]
        pad = k - values.shape[-1]
        values = torch.cat([values, values.new_full((rows.count, pad), float("-inf"))], -1)
        indices = torch.cat([indices, indices.new_full((rows.count, pad), _NO_INDEX)], -1)

    n, ranks = rows.count, parallel.world_size(process_group)
    out_indices = torch.empty(n, k, dtype=torch.int64, device=values.device)
    out_logprobs = torch.empty(n, k, dtype=torch.float32, device=values.device)
    out_rest = torch.empty(n, dtype=torch.float32, device=values.device)
    # Merge in row blocks so the gathered candidates ([block, ranks * K]) stay within budget;
    # the block size comes from numbers every rank shares (one all-gather per block).
    budget = budget_bytes(chunk_bytes, n, -(-shard.total // ranks), rows.element_size)
    per = max(1, budget_factor * budget // (24 * ranks * k))
    for start, stop in row_chunks(n, per):
        block = _merge(values[start:stop], indices[start:stop], rest_max[start:stop],
                       rest_logsum[start:stop], k, top_p, top_p_min_k, process_group)
        out_indices[start:stop], out_logprobs[start:stop], out_rest[start:stop] = block

    lead = rows.lead_shape
    return SparseTeacher(
        indices=out_indices.reshape(*lead, k),
        logprobs=out_logprobs.reshape(*lead, k),
        rest_logprob=out_rest.reshape(lead),
        temperature=temperature,
        vocab_size=vocab,
    )


def _merge(values, indices, rest_max, rest_logsum, k, top_p, top_p_min_k, group):
    """Global top-K, normalizer, top-p and ghost for a block of rows from every rank's local
    candidates (``values``/``indices`` ``[b, K]``, the rest's ``(max, log-sum)`` ``[b]``).

    Returns ``(indices, logprobs, rest_logprob)`` for the block, identical on every rank.
    """
    if parallel.world_size(group) > 1:
        # One all-gather; int32 indices travel bit-cast inside the float32 tensor, exactly.
        packed = torch.cat([values, indices.int().view(torch.float32),
                            rest_max[:, None], rest_logsum[:, None]], -1)
        packed = parallel.all_gather_cat(packed[:, None, :], group, dim=1)  # [b, ranks, 2K+2]
        values, indices = canonical_order(
            packed[..., :k].flatten(1),
            packed[..., k:2 * k].contiguous().view(torch.int32).long().flatten(1),
        )
        rest_max, rest_logsum = packed[..., 2 * k], packed[..., 2 * k + 1]
    else:
        rest_max, rest_logsum = rest_max[:, None], rest_logsum[:, None]

    # Everything relative to the row max, so a large common offset cancels exactly.
    top = values[:, :1]
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    centered = values - top
    rest = (rest_max - top) + rest_logsum  # [b, ranks]: log-sum-exp of what no rank proposed
    log_norm = torch.logsumexp(torch.cat([centered, rest], -1), dim=-1, keepdim=True)
    logprobs = centered[:, :k] - log_norm

    keep = _top_p_keep(logprobs, top_p, top_p_min_k)
    dropped = torch.ones_like(centered, dtype=torch.bool)
    dropped[:, :k] = ~keep
    ghost = torch.cat([centered.masked_fill(~dropped, float("-inf")), rest], -1)
    rest_logprob = torch.logsumexp(ghost, dim=-1) - log_norm[:, 0]
    return (indices[:, :k].masked_fill(~keep, -1), logprobs.masked_fill(~keep, float("-inf")),
            rest_logprob)


def _top_p_keep(logprobs: torch.Tensor, top_p: float | None, min_k: int) -> torch.Tensor:
    """Bool ``[n, K]``: entry r is kept when the mass before it is < top_p or r < min_k."""
    keep = torch.ones_like(logprobs, dtype=torch.bool)
    if top_p is None:
        return keep
    mass = logprobs.double().exp()
    before = torch.cumsum(mass, dim=-1) - mass
    before[:, 0] = 0.0
    keep = before < top_p
    keep[:, :min_k] = True
    return keep
