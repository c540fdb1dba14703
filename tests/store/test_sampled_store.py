"""Stores of sampled rows (kind "sampled", codec "counts"): the rows written are the rows read,
the codec round-trips any rows, damage is caught, settings are bound, a format-2 store still
reads, and ``topkd store build --samples`` stores the draws ``sample_teacher`` makes online,
whatever the batching."""

import json
import os
import shutil

import numpy as np
import pytest
import torch

pytest.importorskip("safetensors")

import topkd  # noqa: E402
from topkd.store import (  # noqa: E402
    TeacherDataset,
    TeacherStore,
    TeacherStoreWriter,
    codec,
    verify_store,
)
from topkd.store.rows import trimmed  # noqa: E402

V, N = 300, 12


def _rows(seed, length, vocab=V, samples=N, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, length, vocab, generator=g) * scale
    return trimmed(topkd.sample_teacher(logits, samples, sample_ids=[seed]).map(lambda t: t[0]))


def _write(path, sequences, **options):
    with TeacherStoreWriter(path, samples=N, vocab_size=V, **options) as writer:
        for sample_id, (ids, rows) in sequences.items():
            writer.add(sample_id, ids, rows)


@pytest.fixture
def stored(tmp_path):
    g = torch.Generator().manual_seed(0)
    sequences = {}
    for i, length in enumerate((9, 1, 0, 33)):
        ids = torch.randint(0, V, (length,), generator=g)
        sequences[f"s{i}"] = (ids, _rows(i, length))
    _write(tmp_path / "store", sequences, shard_bytes=60)  # several shards
    return tmp_path / "store", sequences


def test_rows_round_trip(stored):
    path, sequences = stored
    store = TeacherStore(path)
    assert (store.kind, store.samples, store.k) == ("sampled", N, N)
    assert len(store.files) > 1 and verify_store(path) == []
    for sample_id, (ids, rows) in sequences.items():
        got = store.get(sample_id, ids)
        assert isinstance(got, topkd.SampledTeacher) and got.samples == N
        assert torch.equal(got.indices[:, :rows.k], rows.indices)
        assert torch.equal(got.counts[:, :rows.k], rows.counts)
        assert bool((got.indices[:, rows.k:] == -1).all())
        assert torch.equal(store.tokens(sample_id), ids)
    batch = store.collate(["s0", "s3"])
    assert batch.indices.shape == (2, 33, N) and int(batch.mask.sum()) == 42
    manifest = json.loads((path / "manifest.json").read_text())
    assert (manifest["kind"], manifest["codec"], manifest["samples"],
            manifest["format_version"]) == ("sampled", "counts", N, 3)
    assert store.num_entries() == sum(int((r.counts > 0).sum()) for _, r in sequences.values())
    item = TeacherDataset(store)[0]
    assert isinstance(item["teacher"], topkd.SampledTeacher)


@pytest.mark.parametrize("vocab,samples", [(1024, 12), (151936, 12), (50, 40), (7, 3), (1, 1),
                                           (300, 255)])
@pytest.mark.parametrize("tokens", [True, False])
def test_codec_round_trips_any_rows(vocab, samples, tokens):
    rng = np.random.default_rng(vocab + samples)
    lengths = rng.integers(1, min(samples, vocab) + 1, 41)
    indices, counts = [], []
    for length in lengths:
        indices.append(rng.choice(vocab, length, replace=False))
        c = np.ones(length, np.int64)
        np.add.at(c, rng.integers(0, length, samples - length), 1)
        counts.append(c)
    indices, counts = np.concatenate(indices), np.concatenate(counts)
    ids = rng.integers(0, vocab, 41) if tokens else None
    payload, low = codec.encode_sampled(indices, counts, lengths, vocab, samples, ids)
    got_i, got_c = codec.decode_sampled(payload, low, 41, vocab, samples, tokens)
    assert codec.sampled_entries(payload, 41, vocab, samples, tokens) == lengths.sum()
    if tokens:
        assert np.array_equal(codec.sampled_tokens(payload, 41, vocab), ids)
    start = 0
    for r, length in enumerate(lengths):
        want = sorted(zip(indices[start:start + length].tolist(),
                          counts[start:start + length].tolist(), strict=True))
        assert list(zip(got_i[r, :length].tolist(), got_c[r, :length].tolist(),
                        strict=True)) == want
        assert (got_i[r, length:] == -1).all() and (got_c[r, length:] == 0).all()
        start += length
    with pytest.raises(ValueError):
        codec.decode_sampled(payload[:-1], low, 41, vocab, samples, tokens)


def test_bytes_per_position():
    """At V = 151,936 and 12 samples, a row of 6 distinct ids takes 14 bytes: 11 bits of
    counts, each id about 15 bits (Elias-Fano), where format 1's int32 index alone takes 4
    bytes; the token id 18 bits."""
    rng = np.random.default_rng(0)
    lengths = np.full(512, 6)
    indices = np.concatenate([rng.choice(151936, 6, replace=False) for _ in lengths])
    counts = np.tile([3, 3, 2, 2, 1, 1], 512)
    payload, _ = codec.encode_sampled(indices, counts, lengths, 151936, 12)
    assert len(payload) / len(lengths) < 14
    with_tokens, _ = codec.encode_sampled(indices, counts, lengths, 151936, 12,
                                          rng.integers(0, 151936, 512))
    assert len(with_tokens) - len(payload) <= 512 * 18 / 8 + 8


def test_damage_is_caught(stored):
    path, sequences = stored
    store = TeacherStore(path)
    shard = store.files[-1]  # holds s3
    file = os.path.join(path, shard)
    data = bytearray(open(file, "rb").read())
    data[-20] ^= 0xFF
    open(file, "wb").write(bytes(data))
    problems = verify_store(path)
    assert problems and shard in problems[0]
    with pytest.raises(ValueError, match="damaged|CRC|SHA"):
        TeacherStore(path).get("s3")


def test_settings_are_bound(stored, tmp_path):
    path, sequences = stored
    ids, rows = sequences["s0"]
    with pytest.raises(ValueError, match="kind"):
        TeacherStoreWriter(path, k=N, vocab_size=V)
    with pytest.raises(ValueError, match="samples"):
        TeacherStoreWriter(path, samples=8, vocab_size=V)
    with TeacherStoreWriter(path, samples=N, vocab_size=V) as writer:  # resumed
        assert "s0" in writer and len(writer) == 4
    fresh = tmp_path / "fresh"
    with pytest.raises(ValueError, match="exactly one of k"):
        TeacherStoreWriter(fresh, k=4, samples=N, vocab_size=V)
    with pytest.raises(ValueError, match="top_p"):
        TeacherStoreWriter(fresh, samples=N, vocab_size=V, top_p=0.9)
    with pytest.raises(ValueError, match="codec"):
        TeacherStoreWriter(fresh, samples=N, vocab_size=V, codec="exact")
    with TeacherStoreWriter(fresh, samples=N, vocab_size=V) as writer:
        with pytest.raises(TypeError, match="SampledTeacher"):
            writer.add("a", ids, topkd.select_topk(torch.randn(len(ids), V), 4))
        with pytest.raises(ValueError, match="samples"):
            writer.add("b", ids, trimmed(topkd.sample_teacher(torch.randn(1, len(ids), V), 8)
                                         .map(lambda t: t[0])))
        bad = rows.map(lambda t: t.clone())
        bad.counts[0, 0] += 1
        with pytest.raises(ValueError, match="summing to samples"):
            writer.add("c", ids, bad)
        with pytest.raises(ValueError, match=r"token ids must lie in \[0, vocab_size=300\)"):
            writer.add("d", torch.full((len(ids),), V), rows)
        assert "d" not in writer


def test_the_sampled_loss_from_a_store_is_the_online_one(stored):
    """Read back, the rows give the loss (and gradient) the in-memory rows give, with or
    without the teacher's log-probs (the value then differs by their constant)."""
    path, sequences = stored
    ids, rows = sequences["s3"]
    got = TeacherStore(path).get("s3", ids)
    z = torch.randn(len(ids), V)
    out = []
    for teacher in (rows.map(lambda t: t, mask=None), got):
        teacher.logprobs = None
        s = z.clone().requires_grad_(True)
        loss = topkd.sparse_kl_loss(s, teacher, reduction="sum", impl="eager")
        loss.backward()
        out.append((loss.detach(), s.grad))
    torch.testing.assert_close(out[0][0], out[1][0])
    torch.testing.assert_close(out[0][1], out[1][1])


def _v2_sequence(number):
    """What tests/store/data/store-v2-sampled holds (written by the format-2 writer with
    ``samples=12, vocab_size=300, name="old"``)."""
    g = torch.Generator().manual_seed(4040 + number)
    length = [4, 0, 6][number]
    tokens = torch.randint(0, 300, (length,), generator=g)
    logits = torch.randn(1, length, 300, generator=g) * 2
    rows = topkd.sample_teacher(logits, 12, seed=5, sample_ids=[number])
    return tokens, trimmed(rows.map(lambda t: t[0]))


def test_format_2_store_still_reads(tmp_path):
    here = os.path.dirname(os.path.abspath(__file__))
    path = tmp_path / "store"
    shutil.copytree(os.path.join(here, "data", "store-v2-sampled"), path)
    store = TeacherStore(path)
    assert store.manifest["format_version"] == 2 and verify_store(path) == []
    assert store.num_entries() == sum(int((_v2_sequence(n)[1].counts > 0).sum())
                                      for n in range(3))
    for number in range(3):
        tokens, rows = _v2_sequence(number)
        got = store.get(f"v2-{number}", tokens)
        assert torch.equal(got.indices[:, :rows.k], rows.indices)
        assert torch.equal(got.counts[:, :rows.k], rows.counts)
        assert torch.equal(store.tokens(f"v2-{number}"), tokens)
    with pytest.raises(ValueError, match="format 2, which this topkd reads but does not write"):
        TeacherStoreWriter(path, samples=12, vocab_size=300, name="old")
