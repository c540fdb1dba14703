"""Format-3 stores (codecs ``compact`` and ``exact``): round trips at several K and V, the loss
from a store against the float64 reference, the ghost at extreme tails, damaged shards, a
format-1 store written by the previous topkd, still read and resumed, and a format-2 store,
still read."""

import math
import os
import re
import shutil

import numpy as np
import pytest
import reference
import torch
from store_helpers import COMPACT_STEP, through_codec

pytest.importorskip("safetensors")

import topkd  # noqa: E402
from topkd.store import TeacherStore, TeacherStoreWriter, verify_store  # noqa: E402
from topkd.store import codec as row_codec  # noqa: E402
from topkd.store.format import shard_files  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
LM_VOCAB, LM_K = 151_936, 64


def _teacher(rows, vocab, k, *, seed, top_p=None, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * scale
    tokens = torch.randint(0, vocab, (rows,), generator=g)
    return tokens, topkd.select_topk(logits, k, top_p=top_p, impl="eager")


def _write(path, teachers, **settings):
    first = teachers[0][1]
    with TeacherStoreWriter(path, k=first.k, vocab_size=first.vocab_size, **settings) as w:
        for number, (tokens, teacher) in enumerate(teachers):
            w.add(f"s{number}", tokens, teacher)
    return TeacherStore(path)


def _canonical(teacher):
    """Each row sorted by log-prob descending, ties by lower index, unused slots last: the
    order a store returns."""
    key_index = torch.where(teacher.indices >= 0, teacher.indices, 2**62)
    order = torch.sort(key_index, dim=-1, stable=True).indices
    logprobs = teacher.logprobs.gather(-1, order)
    order = order.gather(-1, torch.sort(-logprobs, dim=-1, stable=True).indices)
    return teacher.indices.gather(-1, order), teacher.logprobs.gather(-1, order)


def _assert_ordered(got):
    """Rows in the store's order: log-prob descending, ties by lower index, unused last."""
    lp, ix = got.logprobs, got.indices
    used = ix >= 0
    assert bool((used[:, 1:] <= used[:, :-1]).all())
    both = used[:, 1:]
    desc = lp[:, 1:] < lp[:, :-1]
    tie = (lp[:, 1:] == lp[:, :-1]) & (ix[:, 1:] > ix[:, :-1])
    assert bool((desc | tie)[both].all()), "not ordered by log-prob, ties by lower index"


def _assert_compact(got, want):
    """``got`` is ``want`` through the compact codec: the same index set per row, each
    log-prob within half a step of the original after a common per-row shift, the kept mass
    (and the ghost) unchanged."""
    _assert_ordered(got)
    assert torch.equal(got.indices.sort(-1).values, want.indices.sort(-1).values)
    assert torch.equal(got.rest_logprob, want.rest_logprob)
    # pair the entries by index
    a = got.logprobs.gather(-1, got.indices.clamp(min=0).argsort(-1)).double()
    b = want.logprobs.gather(-1, want.indices.clamp(min=0).argsort(-1)).double()
    finite = torch.isfinite(b)
    assert torch.equal(torch.isfinite(a), finite)
    moved = torch.where(finite, a - b, torch.nan)
    spread = moved.nan_to_num(-math.inf).amax(-1) - moved.nan_to_num(math.inf).amin(-1)
    has = finite.any(-1)
    assert bool((spread[has] <= COMPACT_STEP + 1e-5).all()), float(spread[has].max())
    torch.testing.assert_close(torch.logsumexp(a, -1)[has], torch.logsumexp(b, -1)[has],
                               rtol=0, atol=2e-6)


# -- round trips -----------------------------------------------------------------------------


@pytest.mark.parametrize("vocab,k", [(2, 1), (2, 2), (300, 1), (300, 7), (300, 64),
                                     (2**17 + 5, 64), (2**18 + 1, 8), (2**18 + 1, 64)])
@pytest.mark.parametrize("codec", ["exact", "compact"])
def test_round_trip_through_a_store(tmp_path, codec, vocab, k):
    rows = 3 if vocab > 2**16 else 9
    teachers = [_teacher(n, vocab, k, seed=10 * n + k) for n in (rows, 0, 1, rows + 2)]
    # entries of probability 0 (-inf) among the kept ones, and a row of them only
    tokens, t = teachers[0]
    t.logprobs[0, k // 2:] = -math.inf
    if rows > 1:
        t.logprobs[1, :] = -math.inf
    store = _write(tmp_path, teachers, codec=codec, shard_bytes=2000)
    assert store.manifest["format_version"] == 3 and store.manifest["codec"] == codec
    assert verify_store(tmp_path) == []
    for number, (tokens, teacher) in enumerate(teachers):
        got = store.get(f"s{number}", tokens)
        assert got.indices.dtype == torch.int64 and got.logprobs.dtype == torch.float32
        assert got.indices.shape == teacher.indices.shape
        if codec == "exact":
            indices, logprobs = _canonical(teacher)
            assert torch.equal(got.indices, indices)
            assert torch.equal(got.logprobs.view(torch.int32), logprobs.view(torch.int32))
            assert torch.equal(got.rest_logprob, teacher.rest_logprob)
        else:
            _assert_compact(got, teacher)


@pytest.mark.parametrize("codec", ["exact", "compact"])
def test_top_p_rows_round_trip(tmp_path, codec):
    teachers = [_teacher(n, 2**18 + 1, 64, seed=n, top_p=0.5, scale=6.0) for n in (4, 3)]
    counts = torch.cat([(t.indices >= 0).sum(-1) for _, t in teachers])
    assert int(counts.min()) < 64 and int(counts.max()) > 1  # rows of several lengths
    store = _write(tmp_path, teachers, codec=codec, top_p=0.5)
    assert verify_store(tmp_path) == []
    for number, (tokens, teacher) in enumerate(teachers):
        got = store.get(f"s{number}", tokens)
        if codec == "exact":
            assert torch.equal(got.indices, teacher.indices)
            assert torch.equal(got.logprobs, teacher.logprobs)
        else:
            _assert_compact(got, teacher)


def test_exact_keeps_every_bit_and_ties_go_to_the_lower_index():
    values = torch.tensor([[0.0, -0.0, -1e-30, -3.5, -3.5, -3.5, -math.inf, -1e30]])
    indices = torch.tensor([[9, 3, 0, 7, 2, 5, 1, 4]])
    teacher = topkd.SparseTeacher(indices, values, torch.tensor([-5.0]), 1.0, 10)
    got = through_codec(teacher, "exact")
    # (0.0 before -0.0: the order of the floats' bits; equal values go to the lower index)
    assert got.indices.tolist() == [[9, 3, 0, 2, 5, 7, 4, 1]]
    assert got.logprobs.view(torch.int32).tolist() == values[:, [0, 1, 2, 4, 5, 3, 7, 6]].view(
        torch.int32).tolist()


@pytest.mark.parametrize("codec", ["exact", "compact"])
def test_largest_vocabulary_and_widest_codes(codec):
    """V = 2**31 - 2 with codes of 32 bits (log-probs from -1e-30 to -1e30) and rows of
    several lengths: the key no longer fits beside a row number, and the rows sort apart."""
    vocab = 2**31 - 2
    indices = torch.tensor([[vocab - 1, 0, 7, -1], [5, -1, -1, -1], [1, 2, 3, 4],
                            [vocab - 2, 9, -1, -1], [-1, -1, -1, -1]])
    values = torch.tensor([[-1e-30, -3.0, -3.0, -math.inf], [-0.5, -math.inf, -math.inf,
                           -math.inf], [-1.0, -2.0, -1e30, -math.inf], [-7.0, -7.0, -math.inf,
                           -math.inf], [-math.inf] * 4])
    values[2, 3] = -math.inf  # a kept entry of probability 0
    values = torch.where(indices >= 0, values, -math.inf)
    teacher = topkd.SparseTeacher(indices, values, torch.full((5,), -1.0), 1.0, vocab)
    got = through_codec(teacher, codec)
    _assert_ordered(got)
    want_indices, want_logprobs = _canonical(teacher)
    assert torch.equal(got.indices, want_indices)
    if codec == "exact":
        assert torch.equal(got.logprobs.view(torch.int32), want_logprobs.view(torch.int32))
    else:
        assert torch.equal(torch.isinf(got.logprobs), torch.isinf(want_logprobs))


def test_compact_payload_size():
    """At K = 64, V = 151,936 on LM-like rows the compact codec takes the bits its layout
    says (Elias-Fano indices: 11 low bits + 139 unary bits a row; codes of 8 bits), and the
    exact codec more than 4 bytes an entry."""
    rows = _lm_rows(8, seed=1)
    teacher = topkd.select_topk(rows, LM_K, impl="eager")
    flat = teacher.indices.reshape(-1).numpy(), teacher.logprobs.reshape(-1).numpy()
    counts = np.full(8, LM_K)
    payload, _, width = row_codec.encode("compact", *flat, counts, LM_VOCAB, LM_K)
    assert row_codec.low_bits(LM_VOCAB, LM_K) == 11 and row_codec.high_values(LM_VOCAB, LM_K) == 75
    assert width == 8  # a 4.2-nat range in 1/32-nat steps
    # the fields padded to whole groups of 8 plus one 8-byte word, for reading in place
    assert len(payload) == math.ceil(8 * (64 + 75) / 8) + 8 * 64 * (11 + 8) // 8 + 8
    exact, _, _ = row_codec.encode("exact", *flat, counts, LM_VOCAB, LM_K)
    assert len(exact) > 4 * 8 * 64 > len(payload) * 1.5


# -- the loss from a store against float64 ---------------------------------------------------


def _lm_rows(rows, *, seed, exponent=1.0):
    """LM-like teacher logits ``[rows, 151,936]``: Zipf by rank (logit ``-exponent * log r``)
    in a random token order per row."""
    g = torch.Generator().manual_seed(seed)
    by_rank = -exponent * torch.log(torch.arange(1, LM_VOCAB + 1, dtype=torch.float64))
    return torch.stack([by_rank[torch.randperm(LM_VOCAB, generator=g)]
                        for _ in range(rows)]).float()


def _students(teacher_logits, seed):
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(teacher_logits.shape, generator=g)
    return {"random": 2.0 * torch.randn(teacher_logits.shape, generator=g),
            "correlated": 0.8 * teacher_logits + 1.2 * noise,
            "close": teacher_logits + 0.3 * noise}


def _relative_errors(tmp_path, teacher_logits, codec, step=None):
    """For each student: (store loss - float64 loss) / float64 loss, the mean over the rows,
    and the online loss's own relative error."""
    online_teacher = topkd.select_topk(teacher_logits, LM_K, impl="eager")
    if step is None:
        tokens = torch.zeros(len(teacher_logits), dtype=torch.int64)
        path = tmp_path / f"{codec}"
        stored = _write(path, [(tokens, online_teacher)], codec=codec).get("s0", tokens)
    else:
        stored = through_codec(online_teacher, codec, step)
    ref_teacher = reference.select(teacher_logits, LM_K)
    out = {}
    for name, student in _students(teacher_logits, seed=7).items():
        ref = reference.sparse_loss(student, ref_teacher, temperature=1.0, reduction="mean")
        online = topkd.sparse_kl_loss(student, online_teacher, reduction="mean", impl="eager")
        loss = topkd.sparse_kl_loss(student, stored, reduction="mean", impl="eager")
        out[name] = (float((loss.double() - ref) / ref), float((online.double() - ref) / ref),
                     float((loss - online) / online))
    return out


@pytest.fixture(scope="module")
def lm_rows():
    return _lm_rows(48, seed=3)


def test_compact_loss_within_1e3_on_lm_like_rows(tmp_path, lm_rows):
    errors = _relative_errors(tmp_path, lm_rows, "compact")
    for name, (to_ref, online_to_ref, _) in errors.items():
        assert abs(to_ref) <= 1e-3, (name, errors)
        assert abs(online_to_ref) <= 1e-5, (name, errors)
    # the bound has teeth: a coarser step (1/2 nat) breaks it
    coarse = _relative_errors(tmp_path, lm_rows, "compact", step=0.5)
    assert max(abs(e[0]) for e in coarse.values()) > 1e-3, coarse


def test_compact_loss_on_random_normal_rows(tmp_path):
    logits = torch.randn(48, LM_VOCAB, generator=torch.Generator().manual_seed(4))
    errors = _relative_errors(tmp_path, logits, "compact")
    for name, (to_ref, _, _) in errors.items():
        assert abs(to_ref) <= 1e-3, (name, errors)


def test_exact_loss_is_the_online_loss(tmp_path, lm_rows):
    errors = _relative_errors(tmp_path, lm_rows, "exact")
    for name, (to_ref, online_to_ref, to_online) in errors.items():
        assert abs(to_online) <= 1e-6, (name, errors)
        assert abs(to_ref - online_to_ref) <= 1e-6, (name, errors)


# -- damage ----------------------------------------------------------------------------------


def _header(file):
    import json

    raw = open(file, "rb").read()
    n = int.from_bytes(raw[:8], "little")
    return n, json.loads(raw[8:8 + n]), raw


def _flip(file, tensor, offset=1, bits=0x5A):
    n, header, raw = _header(file)
    data = bytearray(raw)
    data[8 + n + header[tensor]["data_offsets"][0] + offset] ^= bits
    with open(file, "wb") as f:
        f.write(bytes(data))


@pytest.mark.parametrize("tensor", ["payload", "row_base", "rest_logprob"])
@pytest.mark.parametrize("codec", ["exact", "compact"])
def test_damaged_rows_refused_by_reads_and_verify(tmp_path, codec, tensor):
    teachers = [_teacher(n, 5000, 16, seed=n) for n in (4, 3, 5)]
    _write(tmp_path, teachers, codec=codec)
    file = os.path.join(tmp_path, shard_files(str(tmp_path))[0])
    _flip(file, tensor)
    store = TeacherStore(tmp_path)
    with pytest.raises(ValueError, match="XXH3-64 checksum mismatch") as e:
        store.get("s0")
    assert file in str(e.value)
    for number in (1, 2):  # the other sequences still read
        store.get(f"s{number}", teachers[number][0])
    problems = verify_store(tmp_path)
    assert len(problems) == 1 and file in problems[0] and tensor in problems[0], problems


@pytest.mark.parametrize("codec", ["exact", "compact"])
def test_verify_finds_an_index_twice_anywhere_in_a_row(tmp_path, codec, monkeypatch):
    """A row holding one index twice, not next to each other (written here past the writer's
    own refusal, as a store from before it could hold one): verify names its sequence (it
    compared neighbours only, which missed it)."""
    tokens, teacher = _teacher(4, 5000, 16, seed=1)
    indices = teacher.indices.clone()
    indices[2, 9] = indices[2, 3]
    twice = topkd.SparseTeacher(indices, teacher.logprobs, teacher.rest_logprob, 1.0, 5000)
    with monkeypatch.context() as m:  # the writer's check off
        m.setattr(topkd._checks, "repeated",
                  lambda i, used: (i, torch.zeros_like(i[..., 1:], dtype=torch.bool)))
        _write(tmp_path, [(tokens, twice), _teacher(3, 5000, 16, seed=2)], codec=codec)
    problems = verify_store(tmp_path)
    assert len(problems) == 1 and "'s0'" in problems[0] and "repeated" in problems[0], problems


@pytest.mark.parametrize("tensor", ["seq_bytes", "seq_width"])
def test_damaged_sequence_arrays_refused(tmp_path, tensor):
    teachers = [_teacher(n, 5000, 16, seed=n) for n in (4, 3)]
    _write(tmp_path, teachers)
    file = os.path.join(tmp_path, shard_files(str(tmp_path))[0])
    _flip(file, tensor, offset=0)
    store = TeacherStore(tmp_path)
    with pytest.raises(ValueError, match="SHA-256"):
        store.get("s1")
    problems = verify_store(tmp_path)
    assert len(problems) == 1 and tensor in problems[0], problems


def test_truncated_shard_refused(tmp_path):
    _write(tmp_path, [_teacher(4, 5000, 16, seed=1)])
    file = os.path.join(tmp_path, shard_files(str(tmp_path))[0])
    with open(file, "r+b") as f:
        f.truncate(os.path.getsize(file) - 7)
    with pytest.raises(ValueError, match=re.escape(file)):
        TeacherStore(tmp_path)
    assert len(verify_store(tmp_path)) == 1


def test_undetected_damage_is_still_an_error_without_checked_reads(tmp_path):
    """With ``verify_reads=False``, one bit flipped in the index bitmap is still refused (by
    the decoder: the row no longer holds K entries), not read as other rows."""
    teachers = [_teacher(n, 5000, 16, seed=n) for n in (4,)]
    _write(tmp_path, teachers, codec="compact")
    file = os.path.join(tmp_path, shard_files(str(tmp_path))[0])
    _flip(file, "payload", offset=0, bits=0x04)  # a bit of the first row's unary bitmap
    with pytest.raises(ValueError, match="damaged"):
        TeacherStore(tmp_path, verify_reads=False).get("s0")


# -- the format-1 store of the previous topkd ------------------------------------------------


def _v1_sequence(number):
    """What tests/store/data/store-v1 holds (written by the previous topkd's writer with
    ``k=8, vocab_size=300, logprob_dtype="float16", shard_bytes=200, name="old"``)."""
    g = torch.Generator().manual_seed(2024 + number)
    length = [5, 0, 3, 7][number]
    tokens = torch.randint(0, 300, (length,), generator=g)
    logits = torch.randn(length, 300, generator=g) * 3
    return tokens, topkd.select_topk(logits, 8)


def test_format_1_store_still_reads_and_resumes(tmp_path):
    path = tmp_path / "store-v1"
    shutil.copytree(os.path.join(HERE, "data", "store-v1"), path)
    store = TeacherStore(path)
    assert store.manifest["format_version"] == 1 and store.manifest["codec"] == "plain"
    assert sorted(store.ids()) == ["v1-0", "v1-1", "v1-2"]
    assert verify_store(path) == []
    for number in range(3):
        tokens, teacher = _v1_sequence(number)
        got = store.get(f"v1-{number}", tokens)
        assert torch.equal(store.tokens(f"v1-{number}"), tokens)
        assert torch.equal(got.indices, teacher.indices)
        assert torch.equal(got.logprobs, teacher.logprobs.half().float())
        # (selected again here, by kernels that may round the ghost's float32 otherwise)
        torch.testing.assert_close(got.rest_logprob, teacher.rest_logprob, rtol=1e-6, atol=0)
    # this topkd's default writer is refused, naming the codecs; the format-1 one resumes
    with pytest.raises(ValueError, match="codec='plain'.*codec='compact'"):
        TeacherStoreWriter(path, k=8, vocab_size=300)
    with TeacherStoreWriter(path, k=8, vocab_size=300, logprob_dtype="float16",
                            name="old") as writer:
        assert "v1-2" in writer
        writer.add("v1-3", *_v1_sequence(3))
    store = TeacherStore(path)
    assert store.manifest["format_version"] == 1 and len(store) == 4
    assert verify_store(path) == []
    tokens, teacher = _v1_sequence(3)
    assert torch.equal(store.get("v1-3", tokens).logprobs, teacher.logprobs.half().float())


def _v2_sequence(number):
    """What tests/store/data/store-v2 holds (written by the format-2 writer with ``k=8,
    vocab_size=300, top_p=0.9, shard_bytes=100, name="old"``, codec compact)."""
    g = torch.Generator().manual_seed(3030 + number)
    length = [5, 0, 3][number]
    tokens = torch.randint(0, 300, (length,), generator=g)
    logits = torch.randn(length, 300, generator=g) * 3
    return tokens, topkd.select_topk(logits, 8, top_p=0.9, impl="eager")


def test_format_2_store_still_reads(tmp_path):
    """Its rows are the rows a format-3 store of the same teacher gives, bit for bit (the
    same codes, the fields in the other order, CRC-32s; the rest's log-mass to its last
    bits); it is not resumed."""
    path = tmp_path / "store-v2"
    shutil.copytree(os.path.join(HERE, "data", "store-v2"), path)
    store = TeacherStore(path)
    assert store.manifest["format_version"] == 2 and store.manifest["codec"] == "compact"
    assert verify_store(path) == []
    sequences = [_v2_sequence(number) for number in range(3)]
    assert any(bool((t.indices < 0).any()) for _, t in sequences)  # top-p rows (counts)
    fresh = _write(tmp_path / "fresh", sequences, top_p=0.9)
    assert fresh.manifest["format_version"] == 3
    for number, (tokens, _) in enumerate(sequences):
        got, want = store.get(f"v2-{number}", tokens), fresh.get(f"s{number}", tokens)
        assert torch.equal(got.indices, want.indices)
        assert torch.equal(got.logprobs.view(torch.int32), want.logprobs.view(torch.int32))
        # (the fixture's rest was summed by the selection of its day, which added the rest in
        # another order than today's sampled one: the same number to the last bits)
        torch.testing.assert_close(got.rest_logprob, want.rest_logprob, rtol=0, atol=2e-6)
        assert torch.equal(store.tokens(f"v2-{number}"), tokens)
    assert store.num_entries() == fresh.num_entries()
    with pytest.raises(ValueError, match="format 2, which this topkd reads but does not write"):
        TeacherStoreWriter(path, k=8, vocab_size=300, top_p=0.9, name="old")


# -- bad input -------------------------------------------------------------------------------


def test_writer_codec_arguments(tmp_path):
    with pytest.raises(ValueError, match=r"codec must be one of .*'zip'"):
        TeacherStoreWriter(tmp_path, k=4, vocab_size=10, codec="zip")
    with pytest.raises(ValueError, match="logprob_dtype='float16' is for codec='plain'.*exact"):
        TeacherStoreWriter(tmp_path, k=4, vocab_size=10, codec="exact", logprob_dtype="float16")
    assert not os.listdir(tmp_path)  # nothing written before the check
    tokens, teacher = _teacher(3, 50, 4, seed=1)
    teacher.logprobs[1, 2] = math.nan
    with TeacherStoreWriter(tmp_path, k=4, vocab_size=50) as writer:
        with pytest.raises(ValueError, match="logprobs of kept entries must not be NaN"):
            writer.add("a", tokens, teacher)
        assert "a" not in writer
    teacher.logprobs[1, 2] = -1.0
    teacher.rest_logprob[0] = 0.5
    with TeacherStoreWriter(tmp_path, k=4, vocab_size=50) as writer:
        with pytest.raises(ValueError, match="rest_logprob must be"):
            writer.add("a", tokens, teacher)


def test_store_info_shows_the_codec_and_bytes_per_entry(tmp_path, capsys):
    from topkd.cli import main

    teachers = [_teacher(n, 5000, 16, seed=n, top_p=0.9) for n in (6, 4)]
    _write(tmp_path, teachers, codec="compact", top_p=0.9)
    assert main(["store", "info", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    entries = sum(int((t.indices >= 0).sum()) for _, t in teachers)
    total = sum(os.path.getsize(tmp_path / f) for f in os.listdir(tmp_path)
                if not f.startswith("."))
    assert "codec: compact" in out and f"kept entries: {entries}\n" in out
    assert f"bytes per entry, manifest included: {total / entries:.3f}" in out
    assert f"bytes per token, manifest included: {total / 10:.3f}" in out


def _reference_decode(name, payload, base, width, counts, vocab, k, columns,
                      step=COMPACT_STEP):
    """The layout of ``codec.py`` read bit by bit, row by row (slow and plain): what
    :func:`codec.decode` must return exactly. ``columns``: field ``e`` is field ``e // groups``
    of group ``e % groups`` (format 3), else field ``e % 8`` of group ``e // 8``."""
    rows, bits = len(base), width & row_codec.WIDTH_MASK
    low, hv = row_codec.low_bits(vocab, k), row_codec.high_values(vocab, k)
    counts = np.full(rows, k) if counts is None else np.asarray(counts)
    entries = int(counts.sum())
    unary = np.unpackbits(payload, bitorder="little")[:entries + rows * hv]
    at = (entries + rows * hv + 7) // 8
    groups = (entries + 7) // 8
    fbits = np.unpackbits(payload[at:], bitorder="little")[:8 * groups * (bits + low)]
    fields = (fbits.reshape(8 * groups, bits + low).astype(np.uint64)
              << np.arange(bits + low, dtype=np.uint64)).sum(-1) if entries else []
    if columns and entries:
        entry = np.arange(entries)
        fields = fields[8 * (entry % groups) + entry // groups]
    indices = np.full((rows, k), -1, np.int64)
    logprobs = np.full((rows, k), -math.inf, np.float32)
    entry, bit = 0, 0
    for r in range(rows):
        row_bits = unary[bit:bit + int(counts[r]) + hv]
        bit += int(counts[r]) + hv
        highs = np.flatnonzero(row_bits) - np.arange(int(counts[r]))
        found = []
        for high in highs:
            field = int(fields[entry])
            entry += 1
            code, index = field >> low, (int(high) << low) | (field & ((1 << low) - 1))
            found.append((code, index))
        found.sort()
        for slot, (code, index) in enumerate(found):
            indices[r, slot] = index
            if name == "exact":
                key = np.array([code + int(base.view(np.uint32)[r])], np.uint32)
                logprobs[r, slot] = row_codec._from_descending_key(key)[0]
            elif width & row_codec.NEG_INF_FLAG and code == (1 << bits) - 1:
                logprobs[r, slot] = -math.inf
            else:
                logprobs[r, slot] = np.float32(code) * np.float32(-step) + base[r]
    return indices, logprobs


@pytest.mark.parametrize("vocab,k,columns", [(300, 7, True), (300, 64, True),
                                             (LM_VOCAB, LM_K, True), (2**18 + 1, 8, True),
                                             (300, 7, False)])
@pytest.mark.parametrize("codec", ["exact", "compact"])
@pytest.mark.parametrize("top_p", [None, 0.5])
def test_decode_equals_a_plain_reading_of_the_layout(codec, vocab, k, columns, top_p):
    """The vectorized decoder returns exactly (every bit of every float) what reading the
    layout entry by entry gives: full rows, rows of several lengths, and -inf entries; in
    format 3's field order and format 2's."""
    tokens, teacher = _teacher(40, vocab, k, seed=vocab + k, top_p=top_p, scale=6.0)
    teacher.logprobs[3, k // 2:] = torch.where(teacher.indices[3, k // 2:] >= 0, -math.inf,
                                               teacher.logprobs[3, k // 2:])
    used = teacher.indices >= 0
    counts = used.sum(-1).numpy().astype(np.int64)
    payload, base, width = row_codec.encode(codec, teacher.indices[used].numpy(),
                                            teacher.logprobs[used].numpy(), counts, vocab, k,
                                            columns=columns)
    given = None if top_p is None else counts
    got = row_codec.decode(codec, payload, base, width, given, vocab, k, columns=columns)
    want = _reference_decode(codec, payload, base, width, given, vocab, k, columns)
    assert got[0].dtype == np.int64 and got[1].dtype == np.float32
    assert np.array_equal(got[0], want[0])
    assert np.array_equal(got[1].view(np.int32), want[1].view(np.int32))
