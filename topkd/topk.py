"""One chunk's top-K in the selection's canonical order (value descending, ties to the lower
index), so a selection depends on the row alone: never on chunk size, thread count or
tensor-parallel layout. Plain functions of ``[r, W]`` chunks; no collectives.

Two ways, each exact (the same entries, values and order):

- :func:`sampled_top`, where ``k`` is small next to the row: a threshold per row from a
  strided sample, one pass that counts the entries at or above it and sums the exponentials
  of those below, the entries above gathered without a host sync, and a top-k of about 1.3 k
  candidates, sorted unless the caller sorts anyway (a merge across ranks). A row where the
  sample misleads is marked not done (the caller runs the exact way on it); whether a row is
  done depends on the row alone.
- :func:`candidates_`, on a float32 buffer: ``torch.topk`` with the tied K-th values
  refilled, then the rest's log-sum-exp over the buffer.
"""

from __future__ import annotations

import math
import sys

import torch
from torch.torch_version import TorchVersion

# Indices must stay below this for the packed sort key; it also marks a padding candidate (a rank
# whose shard is narrower than K), which the tie rule then ranks after every real entry.
NO_INDEX = 2**31 - 1
# The sort key of a padding candidate (-inf, NO_INDEX): below every real entry's.
PAD_KEY = (-(2**23) ^ 0x7FFFFFFF) << 32
# torch.nonzero_static has CUDA kernels from PyTorch 2.7 on (2.6 at the earliest); before,
# the candidates are found with one host sync.
_NONZERO_STATIC_OFF_CPU = TorchVersion(torch.__version__) >= (2, 7)


def sort_keys(values: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Int64 keys whose descending order is the canonical one: the float32 value's bits mapped
    to an order-preserving int32 in the high half, ``NO_INDEX - index`` in the low half."""
    bits = (values + 0.0).view(torch.int32)  # + 0.0 turns -0.0 into +0.0, which compare equal
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long()
    return (ordered << 32) | (NO_INDEX - indices)


def from_keys(keys: torch.Tensor):
    """``(values, indices)`` of :func:`sort_keys`' keys (a -0.0 comes back as +0.0)."""
    return key_values(keys), NO_INDEX - (keys & 0xFFFFFFFF)


def key_values(keys: torch.Tensor) -> torch.Tensor:
    """The float32 values of :func:`sort_keys`' keys."""
    ordered = (keys >> 32).int()
    return torch.where(ordered < 0, ordered ^ 0x7FFFFFFF, ordered).view(torch.float32)


def candidate_keys(values: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """:func:`sort_keys` of ``values`` at ``columns`` ``[r, c]``, and :data:`PAD_KEY` where a
    column is -1 (padding; its value is ignored)."""
    return torch.where(columns >= 0, sort_keys(values, columns), PAD_KEY)


def rest_sum(keys: torch.Tensor, kth: torch.Tensor) -> torch.Tensor:
    """Per row, ``sum exp(value - center)`` over the keys at or below ``kth`` ``[r]`` (a key
    of each row), ``center`` being ``kth``'s value (0 where it is not finite)."""
    center = key_values(kth)
    center = torch.where(torch.isfinite(center), center, 0.0)
    rest = torch.exp(key_values(keys) - center[:, None])
    return torch.where(keys <= kth[:, None], rest, 0.0).sum(-1)


def canonical_order(values: torch.Tensor, indices: torch.Tensor):
    """Sort each row by value descending, ties by index ascending (the selection's order):
    one sort of :func:`sort_keys`."""
    order = sort_keys(values, indices).argsort(dim=-1, descending=True)
    return values.gather(-1, order), indices.gather(-1, order)


def topk_lowest_index(b: torch.Tensor, k: int):
    """Top-``k`` of each row of ``b`` (float32 ``[r, V]``) in canonical order: value
    descending, ties (the K-th value's included) to the lower index, so the result depends on
    the row alone."""
    width = b.shape[1]
    if k >= width:
        return canonical_order(b, torch.arange(width, device=b.device).expand_as(b))
    return _topk_ties_fixed(b, k)


# ---- the sampled selection --------------------------------------------------------------------


def sampled_plan(width: int, k: int):
    """``(stride, keep, capacity)`` of :func:`sampled_top` for the top ``k`` of ``width``
    columns, or None where ``k`` is too large next to the row (above a sixteenth) for a sample
    to pay.

    The threshold is the ``keep``-th largest of every ``stride``-th column, so about ``stride
    * keep`` = 1.25 ``k`` (+ 16 strides) entries lie at or above it, give or take ``stride *
    sqrt(keep)`` where the sample is like the row; ``capacity`` candidate slots per row hold
    8 of those more, so a row falls short or overflows only where its sample is far off.
    """
    if width < 16 * k:  # the exact selection costs less
        return None
    stride = min(16, width // (4 * k))
    keep = min(-(-width // stride), -(-k // stride) * 5 // 4 + 16)
    return stride, keep, stride * (keep + 8 * math.isqrt(keep) + 8)


def sampled_top(low: torch.Tensor, k: int, plan, kernels, ordered: bool = True):
    """The top ``k - 1`` of each row of the chunk ``low`` ``[r, W]`` and the rest's
    log-sum-exp, from a sampled threshold: ``(values [r, k-1], indices [r, k-1], rest max [r],
    rest log-sum [r], done [r] bool)``, each row's exact where ``done`` (its ``k``-th entry is
    the rest's maximum). The top is in canonical order with ``ordered``, else in
    ``torch.topk``'s order (the same entries; for a caller that sorts them anyway).

    ``kernels`` (a backend's) turns the chunk into its values ``b`` (``z / T``) as it goes:

    - ``threshold(low, stride, keep)``: per row, a value with about ``keep`` of the
      ``stride``-th columns' ``b`` at or above it (float32 ``[r]``): their ``keep``-th
      largest, or a value near it (any threshold gives the same exact result);
    - ``scan(low, threshold, capacity)``: ``(keys, count, below)``: :func:`candidate_keys`
      of ``b`` at :func:`compact`'s columns of the entries ``b >= threshold`` (``[r, c]``,
      :data:`PAD_KEY` at its padding), how many each row has, and a callable giving each
      row's ``sum exp(b - threshold)`` over the entries below it (it may consume ``low``, so
      it runs last);
    - ``finish``: :func:`sampled_finish`, as the backend runs it (a kernel);
    - ``rounding_gap``: 0, or where the keys and the comparison with the threshold may round
      ``b`` differently (separate compiled kernels with a transcendental softcap: vectorized and
      scalar ``tanh`` can differ in the last bits), the relative gap by which the rest's
      maximum must clear the threshold for the row to be done.

    A row is done when it has between ``k`` and ``capacity`` candidates: they then hold its
    top ``k``, ties included. The rest (everything but the top ``k - 1``) is summed as its
    candidates from the ``k``-th on plus the entries below the threshold, rescaled from the
    threshold to the rest's maximum (at most 1): no scatter into the chunk, no second pass.
    """
    stride, keep, capacity = plan
    threshold = kernels.threshold(low, stride, keep)
    keys, count, below = kernels.scan(low, threshold, capacity)
    top = keys.topk(k, dim=-1, sorted=ordered).values  # padding sorts after every real entry
    if not ordered:
        top = kth_last(top)
    return kernels.finish(keys, top, threshold, below(), count, capacity, kernels.rounding_gap)


def kth_last(top: torch.Tensor) -> torch.Tensor:
    """``top`` (int64 ``[r, k]``, each row's top ``k`` keys in any order) with each row's least
    key, its ``k``-th, swapped into the last column, in place."""
    at = top.argmin(-1, keepdim=True)
    least, last = top.gather(1, at), top[:, -1:].clone()
    top.scatter_(1, at, last)
    top[:, -1:] = least
    return top


def sampled_finish(keys, top, threshold, below, count, capacity: int, gap: float):
    """:func:`sampled_top`'s result from the candidates' ``keys`` ``[r, c]``, their top ``k``
    ``top`` ``[r, k]`` (the ``k``-th last, the others in any order), the ``threshold``
    ``[r]``, the sum ``below`` it ``[r]`` (relative to it) and the candidates' ``count``
    ``[r]``; ``gap``: the kernels' ``rounding_gap``."""
    k = top.shape[1]
    values, indices = from_keys(top)
    rest_max = values[:, k - 1]
    center = torch.where(torch.isfinite(rest_max), rest_max, 0.0)
    rest = rest_sum(keys, top[:, k - 1])
    rest_logsum = torch.log(rest + torch.exp(threshold - center) * below)
    done = (count >= k) & (count <= capacity)
    if gap:  # an entry the scan put below the threshold could read a few ulps above it
        done &= rest_max > threshold + threshold.abs() * gap
    return values[:, :k - 1], indices[:, :k - 1], rest_max, rest_logsum, done


def compact(above: torch.Tensor, capacity: int, sync_free: bool | None = None):
    """``(columns, count)``: int64 ``[r, capacity + 1]``, each row's first ``capacity + 1``
    columns where ``above`` (bool ``[r, W]``) is True, ascending, -1 padded (a full row has
    more than ``capacity``), and int64 ``[r]``, how many each row has (0 for a row left
    out), from :func:`positions` (``sync_free``: see there). ``above`` may be consumed."""
    rows, width = above.shape
    flat, row, count = positions(above, capacity, sync_free)
    # each entry's rank in its row: its position less its row's first (the spare row's first
    # is past every real entry); past capacity + 1, the spare column ``capacity + 1``
    rank = torch.arange(flat.shape[0], device=flat.device) - row_starts(count).index_select(0, row)
    out = torch.full((rows + 1, capacity + 2), -1, dtype=torch.int64, device=flat.device)
    out.index_put_((row, rank.clamp_max_(capacity + 1)), flat - row * width)
    return out[:rows, :capacity + 1], count


def positions(above: torch.Tensor, capacity: int, sync_free: bool | None = None):
    """``(flat, row, count)`` of ``above`` (bool ``[r, W]``, may be consumed): the flat
    positions of its True entries (int64 ``[n]``, ascending, so row by row), each one's row,
    and how many each row has (int64 ``[r]``).

    ``sync_free`` (by default :func:`no_host_sync`) finds them without a host sync, by one
    ``nonzero_static`` of at most ``capacity`` entries per row, where a row with more is left
    out (count 0), so that it crowds out none of the rows after it; the unused positions are
    -1, of the spare row ``r``. Else by :func:`flat_nonzero`."""
    rows, width = above.shape
    if sync_free is None:
        sync_free = no_host_sync(above.device)
    if not sync_free:
        flat = flat_nonzero(above.view(-1))
        row = flat // width
        return flat, row, torch.bincount(row, minlength=rows)
    count = above.sum(-1)
    count = torch.where(count <= capacity, count, 0)
    above &= (count > 0)[:, None]
    flat = torch.nonzero_static(above.view(-1), size=rows * capacity, fill_value=-1)[:, 0]
    return flat, torch.where(flat >= 0, flat // width, rows), count


def no_host_sync(device: torch.device) -> bool:
    """Whether :func:`positions` finds the entries without a host sync by default: off a CPU
    (where the sync costs nothing and ``nonzero`` runs faster), with a PyTorch whose
    ``nonzero_static`` runs there."""
    return device.type != "cpu" and _NONZERO_STATIC_OFF_CPU


def row_starts(count: torch.Tensor) -> torch.Tensor:
    """``[r + 1]``: where each row's entries start among :func:`positions`' (row by row),
    then their total: the cumulative ``count`` from 0."""
    return torch.cumsum(torch.cat([count.new_zeros(1), count]), 0)


def flat_nonzero(flags: torch.Tensor) -> torch.Tensor:
    """The positions of the set entries of the 1-D one-byte ``flags``, ascending: one
    ``nonzero`` of its 8-byte words, then one of the bytes of the words that have any (a fifth
    less time than one ``nonzero`` of the bytes where about 2% are set, on a CPU)."""
    if not _words_fit(flags):
        return flags.nonzero()[:, 0]
    words, at = nonzero_words(flags)
    return (words.index_select(0, at >> 3) << 3) | (at & 7)


def nonzero_words(flags: torch.Tensor):
    """``(words, at)`` (int64 ``[m]``, ``[n]``) of the 1-D one-byte ``flags``: its set
    entries are at ``(words[at >> 3] << 3) | (at & 7)``, ascending, as :func:`flat_nonzero`
    finds them before it puts them together (a kernel may do that as it reads them)."""
    if not _words_fit(flags):
        return word_parts(flags.nonzero()[:, 0])
    words = flags.view(torch.int64)
    nonzero = words.nonzero()[:, 0]
    return nonzero, words.index_select(0, nonzero).view(torch.int8).nonzero()[:, 0]


def word_parts(flat: torch.Tensor):
    """:func:`nonzero_words`' ``(words, at)`` of the flat positions ``flat`` (ascending; -1:
    none, which keep ``at`` -1)."""
    at = (torch.arange(flat.shape[0], device=flat.device) << 3) | (flat & 7)
    return flat >> 3, torch.where(flat >= 0, at, -1)


def _words_fit(flags: torch.Tensor) -> bool:
    """Whether ``flags`` (one byte each) reads as whole little-endian 8-byte words."""
    return not (flags.numel() % 8 or flags.storage_offset() % 8 or sys.byteorder != "little")


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
