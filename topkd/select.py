"""Teacher side: the top-K (and top-p) selection and its exact normalization.

The teacher is a constant target, so everything here runs under ``torch.no_grad``. Its logits
are read one chunk of rows at a time into a float32 work buffer; nothing of full size is made.
Each rank keeps, per row, its local top-K under the order (value descending, index ascending)
and the log-sum-exp of everything else it holds. Those two together partition the vocabulary,
so the merged candidates give the exact normalizer, the global top-K and the ghost bucket with
O(rows x K) communication and one pass over the logits.
"""

from __future__ import annotations

import bisect

import torch

from . import _checks, backends, memory, parallel
from .sources import LogitsSource, Scratch
from .teacher import SparseTeacher
from .topk import NO_INDEX, PAD_KEY, from_keys, key_values, sort_keys


def _local_candidates(source, k: int, temperature: float, valid: int, chunk_bytes, fused: bool,
                      logit_scale: float, softcap: float | None, backend, ordered: bool):
    """Per row of this shard's first ``valid`` columns: the top-k (values, local indices; at
    most ``valid`` of them; in canonical order with ``ordered``) and the rest's log-sum-exp as
    (max, log-sum), one chunk at a time by the backend's selection stage."""
    n, device = source.count, source.device
    k_local = min(k, valid)
    values = torch.empty(n, k_local, dtype=torch.float32, device=device)
    indices = torch.empty(n, k_local, dtype=torch.int64, device=device)
    rest_max = torch.full((n,), float("-inf"), dtype=torch.float32, device=device)
    rest_logsum = torch.full_like(rest_max, float("-inf"))
    if valid == 0:
        return values, indices, rest_max, rest_logsum
    per = memory.select_rows(chunk_bytes, n, valid, source.element_size, fused, backend,
                             device.type)
    done = torch.empty(n, dtype=torch.bool, device=device)
    options = (k_local, temperature, logit_scale, softcap, Scratch())
    for start, stop in memory.row_chunks(n, per):
        low = source.low_chunk(start, stop, valid)
        (values[start:stop], indices[start:stop], rest_max[start:stop],
         rest_logsum[start:stop], done[start:stop]) = backend.select(low, *options, ordered)
    # Rows whose sample misled (rare; which ones depends on each row alone): one host sync
    # for the whole call, then the exact selection of those rows, chunk by chunk.
    again = (~done).nonzero()[:, 0].tolist()  # ascending
    for start, stop in memory.row_chunks(n, per) if again else ():
        rows = again[bisect.bisect_left(again, start):bisect.bisect_left(again, stop)]
        if rows:
            low = source.low_chunk(start, stop, valid)[[row - start for row in rows]]
            rows = torch.tensor(rows, device=device)
            (values[rows], indices[rows], rest_max[rows],
             rest_logsum[rows]) = backend.select_exact(low, *options)
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
            the passes over the logits run compiled; the sorts stay eager.

    Returns:
        A :class:`SparseTeacher` with leading shape ``[...]``, identical on every rank.
        ``logprobs`` and ``rest_logprob`` are computed in float32 relative to the row maximum,
        so adding a constant to a row changes nothing.
    """
    _checks.logits("teacher_logits", teacher_logits)
    temperature = _checks.temperature(temperature)
    top_p, top_p_min_k = _checks.top_p(top_p, top_p_min_k)
    chunk_bytes = _checks.chunk_bytes(chunk_bytes)
    process_group = _checks.process_group(process_group)
    backend = backends.choose(impl, teacher_logits.device, process_group)
    shard = parallel.exchange_shards(process_group, {"teacher": teacher_logits.shape[-1]},
                                     teacher_logits.shape[:-1].numel(), teacher_logits.device,
                                     same=backends.across_ranks(backend))["teacher"]
    backends.ready(backend)
    vocab = _checks.vocab_size(vocab_size, ("teacher_logits", shard.total))
    k = _checks.integer("k", k, 1, vocab)
    return select_rows(LogitsSource(teacher_logits), k, top_p, top_p_min_k, temperature, vocab,
                       shard, process_group, chunk_bytes, backend=backend)


@torch.no_grad()
def select_rows(source, k, top_p, top_p_min_k, temperature, vocab, shard, process_group,
                chunk_bytes, fused: bool = False, logit_scale: float = 1.0,
                softcap: float | None = None, backend=backends.EAGER) -> SparseTeacher:
    """:func:`select_topk` after validation, from a row source (a
    :class:`~topkd.sources.LogitsSource` of teacher logits or a
    :class:`~topkd.sources.LinearSource` of a teacher's LM head), with this rank's shard known.

    The chunks and merge blocks come from :mod:`topkd.memory` (``fused``: the fused losses'
    smaller share). ``logit_scale`` and ``softcap`` turn a teacher LM head's products into its
    logits. ``backend`` runs each chunk's selection stage.
    """
    n, ranks = source.count, parallel.world_size(process_group)
    # Across ranks the merge sorts the gathered candidates, so no rank sorts its own.
    values, local_idx, rest_max, rest_logsum = _local_candidates(
        source, k, temperature, shard.valid(vocab), chunk_bytes, fused, logit_scale, softcap,
        backend, ordered=ranks == 1)
    indices = local_idx + shard.offset if shard.offset else local_idx
    if values.shape[-1] < k:  # this shard is narrower than k: pad so every rank sends [n, k]
        pad = k - values.shape[-1]
        values = torch.cat([values, values.new_full((source.count, pad), float("-inf"))], -1)
        indices = torch.cat([indices, indices.new_full((source.count, pad), NO_INDEX)], -1)

    # Merge in row blocks so the gathered candidates ([block, ranks * K]) stay within budget;
    # the block size comes from numbers every rank shares (one all-gather per block).
    per = memory.merge_rows(chunk_bytes, n, shard.total, ranks, k, source.element_size, fused)

    def merged(start, stop):
        return _merge(values[start:stop], indices[start:stop], rest_max[start:stop],
                      rest_logsum[start:stop], k, top_p, top_p_min_k, process_group, backend)

    spans = list(memory.row_chunks(n, per))
    if len(spans) == 1:  # one block: its results are the call's, no copy
        out_indices, out_logprobs, out_rest = merged(0, n)
    else:
        out_indices = torch.empty(n, k, dtype=torch.int64, device=values.device)
        out_logprobs = torch.empty(n, k, dtype=torch.float32, device=values.device)
        out_rest = torch.empty(n, dtype=torch.float32, device=values.device)
        for start, stop in spans:
            out_indices[start:stop], out_logprobs[start:stop], out_rest[start:stop] = merged(
                start, stop)

    lead = source.lead_shape
    teacher = SparseTeacher(
        indices=out_indices.reshape(*lead, k),
        logprobs=out_logprobs.reshape(*lead, k),
        rest_logprob=out_rest.reshape(lead),
        temperature=temperature,
        vocab_size=vocab,
    )
    _checks.mark_checked(teacher)  # valid by construction: a loss need not read it again
    return teacher


def _merge(values, indices, rest_max, rest_logsum, k, top_p, top_p_min_k, group, backend):
    """Global top-K, normalizer, top-p and ghost for a block of rows from every rank's local
    candidates (``values``/``indices`` ``[b, K]``, in canonical order on one rank, in any
    order across ranks; the rest's ``(max, log-sum)`` ``[b]``); the element-wise steps run
    as ``backend``'s kernels.

    Across ranks each merges a part of the block's rows (the sorted top K of every rank's
    candidates is most of a merge's time) and the parts are gathered: one all-to-all of the
    candidates as their int64 sort keys (value bits and index) bit-cast to float32, exactly,
    and one all-gather of the merged rows. A row's result is the same whichever rank merges
    it and whatever the block (see :func:`_merge_rows`).

    Returns ``(indices, logprobs, rest_logprob)`` for the block, identical on every rank.
    """
    ranks = parallel.world_size(group)
    if ranks == 1:  # no candidates past the K-th (a new empty tensor: one layout for the kernel)
        others = values.new_empty(values.shape[0], 0)
        return _merge_rows(values, indices, others, rest_max[:, None], rest_logsum[:, None],
                           top_p, top_p_min_k, backend)
    keys = sort_keys(values, indices).view(torch.float32)
    packed = torch.cat([keys, rest_max[:, None], rest_logsum[:, None]], -1)
    # [part, ranks, 2K + 2]: this rank's rows (padding rows of zeros: finite, merged, dropped)
    packed = parallel.rows_to_ranks(packed, group).transpose(0, 1)
    part = packed.shape[0]
    keys = packed[..., :2 * k].contiguous().view(torch.int64).flatten(1)
    top = keys.topk(k, dim=-1, sorted=True).values
    others = backend.kernel(_others)(keys, top[:, k - 1].contiguous())
    merged = _merge_rows(*from_keys(top), others, packed[..., 2 * k], packed[..., 2 * k + 1],
                         top_p, top_p_min_k, backend)
    # one all-gather of the parts: indices (below 2**31) as int32 bits beside the float32s
    out = torch.cat([merged[0].int().view(torch.float32), merged[1], merged[2][:, None]], -1)
    out = parallel.gather_rows(out, group, part)[:values.shape[0]]
    return (out[:, :k].contiguous().view(torch.int32).long(), out[:, k:2 * k].contiguous(),
            out[:, 2 * k].contiguous())


def _merge_rows(values, indices, others, rest_max, rest_logsum, top_p, top_p_min_k, backend):
    """``(indices, logprobs, rest_logprob)`` of rows from their global top K ``values`` /
    ``indices`` ``[b, K]`` (canonical order), the candidates past them ``others`` ``[b, c]``
    and every rank's rest ``(max, log-sum)`` ``[b, R]``; each row's result depends on the row
    alone."""
    centered, rest, log_norm = backend.kernel(_normalize)(
        values, others, rest_max.contiguous(), rest_logsum.contiguous())
    logprobs = centered - log_norm
    keep = _top_p_keep(logprobs, top_p, top_p_min_k)
    rest_logprob = backend.kernel(_ghost)(centered, keep, rest, log_norm)
    if top_p is None:  # every entry kept
        return indices, logprobs, rest_logprob
    return (indices.masked_fill(~keep, -1), logprobs.masked_fill(~keep, float("-inf")),
            rest_logprob)


def _others(keys, kth):
    """The values of the gathered candidates' ``keys`` ``[b, R K]`` past each row's K-th key
    ``kth`` ``[b]``; -inf at those it keeps."""
    return key_values(torch.where(keys >= kth[:, None], PAD_KEY, keys))


def _normalize(values, others, rest_max, rest_logsum):
    """``(centered [b, K], rest [b, R K + R], log-normalizer [b, 1])`` of the global top-K
    ``values``, the candidates past them and each rank's rest ``(max, log-sum)`` ``[b, R]``:
    everything relative to the row's maximum, so a large common offset cancels exactly."""
    top = values[:, :1]
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    centered = values - top
    rest = torch.cat([others - top, (rest_max - top) + rest_logsum], -1)  # no rank kept these
    log_norm = torch.logsumexp(torch.cat([centered, rest], -1), dim=-1, keepdim=True)
    return centered, rest, log_norm


def _ghost(centered, keep, rest, log_norm):
    """The ghost's log-probability ``[b]``: the entries not kept and the rest."""
    ghost = torch.cat([centered.masked_fill(keep, float("-inf")), rest], -1)
    return torch.logsumexp(ghost, dim=-1) - log_norm[:, 0]


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
