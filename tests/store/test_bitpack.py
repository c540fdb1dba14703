"""Bit packing: fields of every width from 1 to 64 bits, any count, round trip in place."""

import numpy as np
import pytest

from topkd.store import bitpack


@pytest.mark.parametrize("width", [1, 7, 8, 19, 25, 26, 31, 32, 33, 57, 58, 60, 63, 64])
@pytest.mark.parametrize("count", [1, 5, 8, 9, 100])
def test_fields_round_trip(width, count):
    rng = np.random.default_rng(width * 1000 + count)
    values = rng.integers(0, 2**63, count, dtype=np.uint64) * np.uint64(2) + rng.integers(
        0, 2, count, dtype=np.uint64)
    if width < 64:
        values &= np.uint64((1 << width) - 1)
    data = bitpack.pack(values, width)
    assert len(data) == bitpack.padded_bytes(count, width)
    assert data.dtype == np.uint8 and not data[len(data) - 8:].any()  # the padding
    got = bitpack.unpack(data, count, width)
    assert got.dtype == (np.uint32 if width <= 25 else np.uint64)
    assert np.array_equal(got.astype(np.uint64), values)
    # a buffer without the padding is copied, not read past its end
    assert np.array_equal(bitpack.unpack(data[:(count * width + 7) // 8], count, width), got)


def test_unary_and_bit_length():
    positions = np.array([0, 3, 4, 17, 63, 64])
    data = bitpack.pack_unary(positions, 70)
    assert np.array_equal(bitpack.unpack_unary(data, 70), positions)
    values = np.array([0, 1, 2, 3, 255, 256, 2**32 - 1, 2**32, 2**63], dtype=np.uint64)
    assert bitpack.bit_length(values).tolist() == [0, 1, 2, 2, 8, 9, 32, 33, 64]


@pytest.mark.parametrize("width", [3, 19, 33, 60])
@pytest.mark.parametrize("count", [1, 9, 100])
def test_column_order_round_trips(width, count):
    values = np.arange(count, dtype=np.uint64) * np.uint64(7919) % np.uint64(2**width)
    data = bitpack.pack(values, width, columns=True)
    assert len(data) == bitpack.padded_bytes(count, width)
    assert np.array_equal(bitpack.unpack(data, count, width, columns=True), values)
    groups = (count + 7) // 8  # field e is field e // groups of group e % groups
    plain = bitpack.unpack(data, 8 * groups, width)
    assert np.array_equal(plain[8 * (np.arange(count) % groups) + np.arange(count) // groups],
                          values)
