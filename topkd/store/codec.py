"""The row codecs of format-2 and 3 stores: one sequence's rows to bytes and back.

A row's kept entries are stored sorted by vocabulary index, which costs nothing to undo: the
reader sorts them back by (log-prob descending, index ascending) -- the order a
:class:`~topkd.SparseTeacher` has -- with one integer sort per row. Per sequence, the payload
holds two bit-packed sections, each starting on a byte:

1. the indices' high parts (``index >> low_bits``) as Elias-Fano's unary bitmap: per row,
   ``count + high_values`` bits, a one at ``high + rank`` for each entry (``rank`` its
   position among the row's sorted entries);
2. one field per entry, ``code << low_bits | (index & (2**low_bits - 1))``, in
   ``code_width + low_bits`` bits (zero-padded to whole groups of 8 fields plus 8 bytes, so
   that the reader unpacks them in place; in format 3 in the column order of
   :mod:`~topkd.store.bitpack`, in format 2 in the plain one), where
   ``low_bits = floor(log2(vocab_size / k))``. An index costs about ``log2(V/K) + 2`` bits
   (13.2 at K = 64, V = 151,936; int32 takes 32).

Beside the payload: ``row_base`` (4 bytes per row) and one byte per sequence, its code width
in bits 0-5 with bit 6 set when the all-ones code means ``-inf``.

Codecs:

- ``"exact"``: the code is the float32 log-prob's bit pattern, mapped to an integer that grows
  as the log-prob falls, minus the row's smallest (``row_base``, int32). Lossless: the reader
  returns the very float32 values written (``-inf`` and ``-0.0`` included).
- ``"compact"``: the code is ``q = round((max - logprob) / step)``, the distance below the
  row's largest log-prob in steps of ``step`` nats (:data:`COMPACT_STEP`), capped at
  ``2**24 - 2`` steps; a ``-inf`` gets the all-ones code. ``row_base`` (float32) is the
  log-prob the reader gives ``q = 0``, chosen when writing so that the row's kept entries hold
  exactly the probability they held before (float64 sums): the decoded row is
  ``row_base - q * step``, and the stored ghost stays the exact complement of the kept mass.
  Each log-prob moves by at most ``step / 2`` relative to the row's others, plus the common
  shift that restores the kept mass.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from . import bitpack

COMPACT_STEP = 1.0 / 32
MAX_STEPS = 2**24 - 2
NEG_INF_FLAG = 0x40
WIDTH_MASK = 0x3F


def low_bits(vocab_size: int, k: int) -> int:
    """Elias-Fano's low part, in bits: floor(log2(vocab_size / k)), at least 0."""
    return max(0, (vocab_size // k).bit_length() - 1)


def high_values(vocab_size: int, k: int) -> int:
    """How many values an index's high part takes: ``((vocab_size - 1) >> low_bits) + 1``."""
    return ((vocab_size - 1) >> low_bits(vocab_size, k)) + 1


def _section_bytes(bits: int) -> int:
    return (bits + 7) // 8


# -- float32 <-> an integer that grows as the value falls ---------------------------------

def _descending_key(values: np.ndarray) -> np.ndarray:
    bits = values.astype(np.float32).view(np.uint32)
    negative = (bits >> np.uint32(31)).astype(bool)
    ascending = np.where(negative, ~bits, bits | np.uint32(0x80000000))
    return ~ascending


def _from_descending_key(keys: np.ndarray) -> np.ndarray:
    ascending = ~keys.astype(np.uint32)
    positive = (ascending >> np.uint32(31)).astype(bool)
    bits = np.where(positive, ascending & np.uint32(0x7FFFFFFF), ~ascending)
    return bits.view(np.float32)


# -- encoding -----------------------------------------------------------------------------

def encode(codec: str, indices: np.ndarray, logprobs: np.ndarray, counts: np.ndarray,
           vocab_size: int, k: int, step: float | None = None, columns: bool = True):
    """Encode one sequence's rows: ``indices`` / ``logprobs`` are the kept entries of every
    row, row after row (int64 / float32 ``[E]``, in any order within a row), ``counts`` the
    entries per row ``[R]``; ``step`` the compact codec's (default :data:`COMPACT_STEP`);
    ``columns``: the fields in the column order (format 3) or the plain one (format 2).
    Returns ``(payload uint8, row_base [R] (float32 or int32),
    width)``, ``width`` the sequence's code byte."""
    rows = len(counts)
    row_of = np.repeat(np.arange(rows, dtype=np.int64), counts)
    order = np.lexsort((indices, row_of))  # by row, then by index
    indices, logprobs = indices[order], logprobs[order]
    starts = np.zeros(rows + 1, np.int64)
    np.cumsum(counts, out=starts[1:])
    entry = np.arange(len(indices), dtype=np.int64)
    low, hv = low_bits(vocab_size, k), high_values(vocab_size, k)
    unary = bitpack.pack_unary((indices >> low) + entry + row_of * hv, len(indices) + rows * hv)
    if codec == "exact":
        codes, base, width = _exact_codes(logprobs, row_of, starts, rows)
    else:
        codes, base, width = _compact_codes(logprobs, row_of, starts, rows,
                                            COMPACT_STEP if step is None else step)
    fields = (codes.astype(np.uint64) << np.uint64(low)) | (indices & ((1 << low) - 1)).astype(
        np.uint64)
    return (np.concatenate([unary, bitpack.pack(fields, (width & WIDTH_MASK) + low, columns)]),
            base, width)


def _row_reduce(ufunc, values, starts, rows, empty):
    """``ufunc.reduceat`` over each row's entries, ``empty`` for rows with none."""
    out = np.full(rows, empty, dtype=values.dtype)
    nonempty = starts[1:] > starts[:-1]
    if nonempty.any():
        out[nonempty] = ufunc.reduceat(values, starts[:-1][nonempty])
    return out


def _width(largest: int) -> int:
    return max(int(largest), 0).bit_length()


def _exact_codes(logprobs, row_of, starts, rows):
    keys = _descending_key(logprobs).astype(np.int64)
    base = _row_reduce(np.minimum, keys, starts, rows, 0)
    codes = keys - base[row_of]
    width = _width(codes.max(initial=0))
    return codes, base.astype(np.uint32).view(np.int32), width


def _compact_codes(logprobs, row_of, starts, rows, step):
    values = logprobs.astype(np.float64)
    finite = np.isfinite(values)
    top = _row_reduce(np.maximum, np.where(finite, values, -np.inf), starts, rows, -np.inf)
    has_finite = np.isfinite(top)
    top = np.where(has_finite, top, 0.0)
    steps = np.minimum(np.rint((top[row_of] - values) / step), MAX_STEPS)
    steps = np.where(finite, steps, 0).astype(np.int64)
    # the kept mass before and after rounding, relative to the row's largest entry
    before = np.bincount(row_of[finite], np.exp(values[finite] - top[row_of[finite]]),
                         minlength=rows)
    after = np.bincount(row_of[finite], np.exp(-steps[finite] * step), minlength=rows)
    with np.errstate(divide="ignore", invalid="ignore"):  # (rows without a finite entry)
        base = np.where(has_finite, top + np.log(before) - np.log(after), 0.0)
    infinite = not bool(finite.all())
    width = _width(steps.max(initial=0) + infinite)
    codes = np.where(finite, steps, (1 << width) - 1)
    return codes, base.astype(np.float32), width | (NEG_INF_FLAG if infinite else 0)


@functools.lru_cache(maxsize=8)
def _unary_offsets(rows: int, k: int, hv: int) -> np.ndarray:
    """Where the ``high = 0`` bit of each entry of full rows lies in the unary bitmap."""
    return (np.arange(rows, dtype=np.int64)[:, None] * (k + hv)
            + np.arange(k, dtype=np.int64)).reshape(-1)


@functools.lru_cache(maxsize=8)
def _unary_offsets_shifted(rows: int, k: int, hv: int, low: int, word) -> np.ndarray:
    """:func:`_unary_offsets` shifted left by ``low``, in ``word`` (wrapped around)."""
    return (_unary_offsets(rows, k, hv) << low).astype(word)


# -- decoding -----------------------------------------------------------------------------

_ALLOCATOR_WARM = False


def _warm_allocator() -> None:
    """Make the process's ``malloc`` serve a decode's arrays (100 KiB - 2 MiB each) from its
    heap. glibc's hands out blocks above 128 KiB as fresh memory maps, whose pages are zeroed
    and faulted in on first touch, until a freed block that large raises its threshold: in a
    fresh process (a DataLoader worker) that made every read 4x slower. One 16 MiB block,
    allocated and freed once, raises it (other allocators are not hurt by this)."""
    global _ALLOCATOR_WARM
    if not _ALLOCATOR_WARM:
        _ALLOCATOR_WARM = True
        block = np.empty(16 << 20, np.uint8)
        del block


def decode(codec: str, payload: np.ndarray, row_base: np.ndarray, width: int,
           counts: np.ndarray | None, vocab_size: int, k: int, step: float | None = None,
           columns: bool = True):
    """Decode one sequence: ``(indices int64 [R, K], logprobs float32 [R, K])``, each row
    ordered by log-prob descending, ties by lower index; unused slots ``-1`` / ``-inf``.
    ``counts`` None: every row keeps ``k`` entries; ``step``: the compact codec's step (the
    manifest's ``logprob_step``; default :data:`COMPACT_STEP`); ``columns``: the field order
    (:func:`encode`). Raises ValueError when the payload does not hold what the row arrays
    say."""
    _warm_allocator()
    rows = len(row_base)
    full = counts is None
    if not full:
        counts = counts.astype(np.int64)
    entries = rows * k if full else int(counts.sum())
    bits = width & WIDTH_MASK
    hv, low = high_values(vocab_size, k), low_bits(vocab_size, k)
    expected = (_section_bytes(entries + rows * hv)
                + bitpack.padded_bytes(entries, low + bits))
    if len(payload) != expected or bits > 32:
        raise ValueError(f"the payload has {len(payload)} bytes and code width {bits}, its "
                         f"rows need {expected} bytes and a width of at most 32")
    unary_bits = entries + rows * hv
    at = _section_bytes(unary_bits)
    ones = bitpack.unpack_unary(payload[:at], unary_bits)
    if len(ones) != entries:
        raise ValueError(f"the index bitmap holds {len(ones)} entries, the rows {entries}")
    # each field is code << low | the index's low bits, with other bits above it (masked here)
    fields = bitpack.unpack(payload[at:], entries, bits + low, mask=False, columns=columns)
    shift = low + max(1, (hv - 1).bit_length())  # the key: code, then index
    if bits + shift > 31:
        fields = fields.astype(np.uint64)  # (a no-op when the fields are already)
    word = fields.dtype.type
    # The key, ``code << shift | high << low | low bits``, in unsigned words, built in place
    # (any wrap-around on the way cancels out: the key itself is below 2**31, or 2**63).
    if full:
        high = ones.astype(word)
        high <<= word(low)
        high -= _unary_offsets_shifted(rows, k, hv, low, word)
    else:
        row_of = np.repeat(np.arange(rows, dtype=np.int64), counts)
        high = ones - np.arange(entries, dtype=np.int64)
        high -= row_of * hv
        high = high.astype(word)
        high <<= word(low)
    key = np.bitwise_and(fields, word(((1 << bits) - 1) << low))
    key <<= word(shift - low)
    fields &= word((1 << low) - 1)
    key |= fields
    key |= high
    del fields, high
    key = key.view(np.int32 if word is np.uint32 else np.int64)  # (the top bit is clear)
    if full:
        key = key.reshape(rows, k)
        key.sort(axis=1)  # (an int32 sort is twice as fast as an int64 one)
        base = row_base[:, None]
    elif max(rows - 1, 0).bit_length() + bits + shift <= 63:
        # rows of several lengths: one sort of (row, key), then the entries fill each row's
        # first slots in order (a boolean mask assigns in that order)
        key = key.astype(np.int64) | (row_of << (bits + shift))
        key.sort()
        key &= (1 << (bits + shift)) - 1
        base = row_base[row_of]
    else:
        starts = np.cumsum(counts) - counts
        padded = np.full((rows, k), np.iinfo(key.dtype).max, key.dtype)
        padded[row_of, np.arange(entries) - starts[row_of]] = key
        padded.sort(axis=1)
        used = np.arange(k)[None, :] < counts[:, None]
        key, base = padded[used], row_base[row_of]
    out_indices = np.bitwise_and(key, key.dtype.type((1 << shift) - 1))
    out_indices = out_indices.astype(np.int64, copy=False)
    out_codes = np.right_shift(key, shift, out=key)  # (the key is not needed any more)
    if codec == "exact":
        logprobs = _from_descending_key(out_codes.astype(np.uint32) + base.view(np.uint32))
    else:
        step = COMPACT_STEP if step is None else step
        # (float32(code) * float32(-step) + base, each rounded to float32: the same values as
        # one multiply with dtype=float32, without numpy's slower casting loop)
        logprobs = out_codes.astype(np.float32)
        logprobs *= np.float32(-step)
        logprobs += base
        if width & NEG_INF_FLAG:
            logprobs[out_codes == (1 << bits) - 1] = -math.inf
    if not full:
        used = np.arange(k)[None, :] < counts[:, None]
        flat_indices, flat_logprobs = out_indices, logprobs
        out_indices = np.full((rows, k), -1, np.int64)
        logprobs = np.full((rows, k), -math.inf, np.float32)
        out_indices[used], logprobs[used] = flat_indices, flat_logprobs
    return out_indices, logprobs


# -- sampled rows: distinct ids and their counts ------------------------------------------
#
# Format 3 (codec "counts"), per sequence of R rows drawn N = ``samples`` times, four
# sections, each starting on a byte:
#
# 1. the token ids (when the store keeps them): R fields of ``bit_length(vocab_size - 1)``
#    bits, in the column order;
# 2. the counts, N - 1 bits per row: a row whose distinct ids (ascending) were drawn
#    c_1, ..., c_d times is the N bits ``0^(c_1 - 1) 1 0^(c_2 - 1) 1 ... 0^(c_d - 1) 1``
#    (a one where each id's draws end), without its last bit, always a one. This says
#    the row's number of ids too (its ones), and counts that do not sum to N cannot be
#    written. (12 draws: 11 bits a row, whatever was drawn.)
# 3. the ids' Elias-Fano high parts, as for top-K rows (``entries + R * high_values`` bits);
# 4. their ``low`` low bits, in the column order.
#
# ``low`` (the sequence's width byte) is chosen when writing to make sections 3 and 4 the
# smallest for the sequence's own rows: about ``log2(V / d) + 2`` bits an id for rows of
# ``d`` ids.

def token_bits(vocab_size: int) -> int:
    """Bits of a stored token id in a format-3 sampled store: ``bit_length(vocab_size - 1)``."""
    return max(vocab_size - 1, 0).bit_length()


def _ef_bits(entries: int, rows: int, vocab_size: int, low: int) -> int:
    return entries * (low + 1) + rows * (((max(vocab_size, 1) - 1) >> low) + 1)


def encode_sampled(indices: np.ndarray, counts: np.ndarray, row_lengths: np.ndarray,
                   vocab_size: int, samples: int, tokens: np.ndarray | None = None):
    """Encode one sequence's sampled rows (format 3): ``indices`` the distinct ids drawn of
    every row, row after row (``[E]``, any order within a row), ``counts`` how often each was
    drawn (each row's summing to ``samples``), ``row_lengths`` the ids per row ``[R]`` (at
    least 1), ``tokens`` the sequence's token ids ``[R]`` (in ``[0, vocab_size)``) or None.
    Returns ``(payload uint8, low)``."""
    rows = len(row_lengths)
    row_of = np.repeat(np.arange(rows, dtype=np.int64), row_lengths)
    order = np.lexsort((indices, row_of))  # by row, then by index
    indices = indices[order].astype(np.int64)
    counts = counts[order].astype(np.int64)
    sections = [] if tokens is None else [
        bitpack.pack(np.asarray(tokens, np.int64), token_bits(vocab_size), columns=True)]
    # where each id's draws end, in the row's N bits (the row's last bit, always 1, dropped)
    drawn = np.concatenate([[0], np.cumsum(counts)])  # draws before each id and after
    drawn = drawn[1:] - np.repeat(drawn[np.cumsum(row_lengths) - row_lengths], row_lengths)
    ends = np.zeros((rows, samples), np.uint8)
    ends[row_of, drawn - 1] = 1
    sections.append(np.packbits(ends[:, :-1].reshape(-1), bitorder="little"))
    entries = len(indices)
    low = min(range(token_bits(vocab_size) + 1),
              key=lambda b: _ef_bits(entries, rows, vocab_size, b))
    hv = ((max(vocab_size, 1) - 1) >> low) + 1
    entry = np.arange(entries, dtype=np.int64)
    sections.append(bitpack.pack_unary((indices >> low) + entry + row_of * hv,
                                       entries + rows * hv))
    sections.append(bitpack.pack(indices & ((1 << low) - 1), low, columns=True))
    return np.concatenate(sections), low


def sampled_tokens(payload: np.ndarray, rows: int, vocab_size: int) -> np.ndarray:
    """The token ids (int64 ``[R]``) at the start of a format-3 sampled sequence's payload."""
    width = token_bits(vocab_size)
    return bitpack.unpack(payload[:bitpack.padded_bytes(rows, width)], rows, width,
                          columns=True).astype(np.int64)


def _counts_span(rows: int, vocab_size: int, samples: int, tokens: bool) -> tuple[int, int]:
    """Where a format-3 sampled sequence's counts section starts and ends in its payload
    (after the token ids, when it holds them)."""
    at = bitpack.padded_bytes(rows, token_bits(vocab_size)) if tokens else 0
    return at, at + _section_bytes(rows * (samples - 1))


def decode_sampled(payload: np.ndarray, low: int, rows: int, vocab_size: int, samples: int,
                   tokens: bool):
    """Decode one sequence of :func:`encode_sampled` (``tokens``: whether it holds the token
    ids, which are skipped: :func:`sampled_tokens` reads them): ``(indices int64 [R, samples],
    counts int32 [R, samples])``, each row's ids ascending, then unused slots ``-1`` / 0.
    Raises ValueError when the payload does not hold what its sections say."""
    at, end = _counts_span(rows, vocab_size, samples, tokens)
    if low > 31 or end > len(payload):
        raise ValueError(f"low bits {low} or a payload of {len(payload)} bytes too short for "
                         f"{rows} rows")
    ends = np.ones((rows, samples), np.uint8)
    ends[:, :-1] = np.unpackbits(payload[at:end], count=rows * (samples - 1),
                                 bitorder="little").reshape(rows, samples - 1)
    last = np.flatnonzero(ends.reshape(-1).view(bool))  # row * samples + the id's last draw
    lengths = ends.sum(axis=1, dtype=np.int64)
    entries = len(last)
    hv = ((max(vocab_size, 1) - 1) >> low) + 1
    unary_bits = entries + rows * hv
    at = end + _section_bytes(unary_bits)
    if len(payload) != at + bitpack.padded_bytes(entries, low):
        raise ValueError(f"the payload has {len(payload)} bytes, its rows need "
                         f"{at + bitpack.padded_bytes(entries, low)}")
    ones = bitpack.unpack_unary(payload[end:at], unary_bits)
    if len(ones) != entries:
        raise ValueError(f"the index bitmap holds {len(ones)} ids, the counts {entries}")
    row_of = np.repeat(np.arange(rows, dtype=np.int64), lengths)
    high = ones - np.arange(entries, dtype=np.int64) - row_of * hv
    if entries and (int(high.min()) < 0 or int(high.max()) >= hv):
        raise ValueError("the index bitmap's rows do not hold the counts' ids")
    fields = bitpack.unpack(payload[at:], entries, low, columns=True).astype(np.int64)
    used = np.arange(samples)[None, :] < lengths[:, None]
    indices = np.full((rows, samples), -1, np.int64)
    counts = np.zeros((rows, samples), np.int32)
    indices[used] = (high << low) | fields
    counts[used] = np.diff(last, prepend=-1)
    return indices, counts


def sampled_entries(payload: np.ndarray, rows: int, vocab_size: int, samples: int,
                    tokens: bool) -> int:
    """How many ids a format-3 sampled sequence holds (its rows plus the ones of its counts
    section)."""
    at, end = _counts_span(rows, vocab_size, samples, tokens)
    bits = np.unpackbits(payload[at:end], count=rows * (samples - 1), bitorder="little")
    return rows + int(bits.sum())


def decode_counts(payload: np.ndarray, width: int, row_lengths: np.ndarray, vocab_size: int,
                  samples: int):
    """Decode one sequence of a format-2 sampled store (read, no longer written): the
    sections 3 and 4 above with ``k = samples`` (``low = low_bits(vocab_size, samples)``),
    each field ``(count - 1) << low | low bits`` in ``width + low`` bits in the plain order,
    and a byte per row (``row_lengths``, its number of ids) beside the payload.
    Returns ``(indices int64 [R, samples], counts int32 [R, samples])``, each row's ids
    ascending, then unused slots ``-1`` / 0. Raises ValueError when the payload does not
    hold what the row lengths say."""
    rows = len(row_lengths)
    row_lengths = np.asarray(row_lengths).astype(np.int64)
    entries = int(row_lengths.sum())
    if width > 8 or bool((row_lengths > samples).any()):
        raise ValueError(f"code width {width} or row lengths above samples={samples}")
    low, hv = low_bits(vocab_size, samples), high_values(vocab_size, samples)
    unary_bits = entries + rows * hv
    expected = _section_bytes(unary_bits) + bitpack.padded_bytes(entries, low + width)
    if len(payload) != expected:
        raise ValueError(f"the payload has {len(payload)} bytes, its rows need {expected}")
    at = _section_bytes(unary_bits)
    ones = bitpack.unpack_unary(payload[:at], unary_bits)
    if len(ones) != entries:
        raise ValueError(f"the index bitmap holds {len(ones)} entries, the rows {entries}")
    fields = bitpack.unpack(payload[at:], entries, width + low).astype(np.int64)
    row_of = np.repeat(np.arange(rows, dtype=np.int64), row_lengths)
    high = ones - np.arange(entries, dtype=np.int64) - row_of * hv
    slot = np.arange(entries, dtype=np.int64) - (np.cumsum(row_lengths) - row_lengths)[row_of]
    indices = np.full((rows, samples), -1, np.int64)
    counts = np.zeros((rows, samples), np.int32)
    indices[row_of, slot] = (high << low) | (fields & ((1 << low) - 1))
    counts[row_of, slot] = (fields >> low) + 1
    return indices, counts
