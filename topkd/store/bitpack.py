"""Bit packing with numpy: unsigned fields of one width up to 64 bits, packed back to back,
least significant bit first, and Elias-Fano's unary-coded high parts.

Fields are packed in groups of 8 (a group takes ``width`` bytes). In the plain order field
``e`` is field ``e % 8`` of group ``e // 8``; in the column order (``columns=True``, format 3)
it is field ``e // groups`` of group ``e % groups``: the reader then unpacks field ``j`` of
every group into one contiguous run of the output, not every 8th element of it, which halves
the unpacking time.

Everything is vectorized over the fields; no Python loop runs per row or per field.
"""

from __future__ import annotations

import numpy as np

MAX_WIDTH = 64


def pack(values: np.ndarray, width: int, columns: bool = False) -> np.ndarray:
    """Pack each of ``values`` in ``width`` bits, back to back, least significant bit first,
    in the plain or the column order (module docstring); uint8 bytes, zero-padded to
    :func:`padded_bytes` (so that :func:`unpack` reads them in place)."""
    values = np.asarray(values, dtype=np.uint64).reshape(-1)
    if values.size == 0 or width == 0:
        return np.zeros(0, np.uint8)
    if columns:
        groups = (len(values) + 7) // 8
        padded = np.zeros(8 * groups, np.uint64)
        padded[: len(values)] = values
        values = padded.reshape(8, groups).T.reshape(-1)
    bits = (values[:, None] >> np.arange(width, dtype=np.uint64)) & np.uint64(1)
    packed = np.packbits(bits.astype(np.uint8).reshape(-1), bitorder="little")
    out = np.zeros(padded_bytes(len(values), width), np.uint8)
    out[: len(packed)] = packed
    return out


def unpack(data: np.ndarray, count: int, width: int, mask: bool = True,
           columns: bool = False) -> np.ndarray:
    """``count`` fields of ``width`` bits (<= :data:`MAX_WIDTH`) packed back to back from the
    start of ``data``, in the plain or the column order: uint32 for widths up to 25, else
    uint64. ``mask=False`` leaves the bits above each field as they come (the next fields'
    bits; for a caller that masks anyway).

    Field ``8 g + j`` starts at byte ``g * width + (j * width) // 8``: for each ``j`` the
    fields sit at a fixed byte stride, so eight strided word reads unpack them all, with no
    per-field gather."""
    word = np.uint32 if width <= 25 else np.uint64  # a field and its shift fit the word
    if count == 0 or width == 0:
        return np.zeros(count, word)
    groups = (count + 7) // 8
    padded = np.ascontiguousarray(data)
    if len(padded) < padded_bytes(count, width):  # (the store's payloads carry the padding)
        padded = np.zeros(padded_bytes(count, width), np.uint8)
        padded[: min(len(data), len(padded))] = data[: len(padded)]
    out = np.empty((8, groups), word)  # out[j, g]: field j of group g
    little = _LITTLE[word]
    for j in range(8):
        offset, shift = (j * width) // 8, (j * width) % 8
        words = np.ndarray(shape=(groups,), dtype=little, buffer=padded, offset=offset,
                           strides=(width,))
        np.right_shift(words, word(shift), out=out[j])
        if width + shift > 64:  # the field runs into the next word
            more = np.ndarray(shape=(groups,), dtype=little, buffer=padded,
                              offset=offset + 8, strides=(width,))
            out[j] |= more << word(64 - shift)
    if mask and width < 64:
        out &= word((1 << width) - 1)
    # (the plain order: one transposing copy)
    return (out if columns else out.T).reshape(-1)[:count]


_LITTLE = {np.uint32: np.dtype("<u4"), np.uint64: np.dtype("<u8")}


def padded_bytes(count: int, width: int) -> int:
    """The bytes :func:`unpack` reads for ``count`` fields of ``width`` bits: whole groups of
    8 fields plus one 8-byte word (two for fields wider than 57 bits)."""
    return ((count + 7) // 8) * width + (8 if width <= 57 else 16) if count and width else 0


def pack_unary(positions: np.ndarray, total_bits: int) -> np.ndarray:
    """A bitmap of ``total_bits`` bits with ones at ``positions`` (distinct), as bytes."""
    bits = np.zeros(total_bits, np.uint8)
    bits[positions] = 1
    return np.packbits(bits, bitorder="little")


def unpack_unary(data: np.ndarray, total_bits: int) -> np.ndarray:
    """The positions of the ones among the first ``total_bits`` bits of ``data``, ascending."""
    bits = np.unpackbits(data, count=total_bits, bitorder="little")
    return np.flatnonzero(bits.view(bool))  # (on bool, nonzero is ten times faster)


def bit_length(values: np.ndarray) -> np.ndarray:
    """Bits needed for each non-negative integer of ``values`` (0 for 0), as int64."""
    values = np.asarray(values, dtype=np.uint64)
    out = np.zeros(values.shape, np.int64)
    v = values.copy()
    for step in (32, 16, 8, 4, 2, 1):
        big = v >= (np.uint64(1) << np.uint64(step))
        out[big] += step
        v[big] >>= np.uint64(step)
    out[v > 0] += 1
    return out
