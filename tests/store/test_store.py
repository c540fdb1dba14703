"""topkd.store: the on-disk teacher store (writer, reader, verify, Dataset and collate).

What is stored must come back as written (bit for bit in float32, rounded once in bf16/fp16);
every kind of damage, mismatch or misuse must fail loudly and name what is wrong; a writer
killed at any moment must leave a readable store it can resume; and the loss from a stored
batch must be the online loss on the same teacher logits.
"""

from __future__ import annotations

import functools
import json
import os
import pickle
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

pytest.importorskip("safetensors")

import helpers  # noqa: E402
import reference  # noqa: E402
import store_worker  # noqa: E402
from safetensors import safe_open  # noqa: E402

import topkd  # noqa: E402
from topkd.store import (  # noqa: E402
    MissingSampleError,
    TeacherDataset,
    TeacherStore,
    TeacherStoreWriter,
    collate,
    require_keys,
    verify_store,
)
from topkd.store.format import MANIFEST, shard_files  # noqa: E402
from topkd.store.reader import read_shard_ids  # noqa: E402

V, K = 300, 8
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


# -- helpers ---------------------------------------------------------------------------------


def _sequences(lengths, *, vocab=V, k=K, top_p=None, temperature=1.0, scale=3.0, seed=0):
    """(tokens [L], teacher logits [L, vocab], select_topk of them) per length."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for length in lengths:
        tokens = torch.randint(0, vocab, (length,), generator=g)
        logits = torch.randn(length, vocab, generator=g, dtype=torch.float64).float() * scale
        out.append((tokens, logits, topkd.select_topk(logits, k, top_p=top_p,
                                                       temperature=temperature)))
    return out


def _write(path, ids, seqs, **options):
    options = {"k": K, "vocab_size": V, **options}
    with TeacherStoreWriter(path, **options) as writer:
        for sample_id, (tokens, _, teacher) in zip(ids, seqs, strict=True):
            writer.add(sample_id, tokens, teacher)
    return writer


def _assert_same_teacher(got, want, what=""):
    assert got.indices.dtype == torch.int64 and got.logprobs.dtype == torch.float32
    assert got.rest_logprob.dtype == torch.float32
    assert torch.equal(got.indices, want.indices), f"{what}: indices differ"
    assert torch.equal(got.logprobs, want.logprobs), f"{what}: logprobs differ"
    assert torch.equal(got.rest_logprob, want.rest_logprob), f"{what}: rest_logprob differs"
    assert got.temperature == want.temperature and got.vocab_size == want.vocab_size, what


def _names(message: str, key: str, *values) -> None:
    """``message`` contains ``key=value`` for every value (as str or repr)."""
    for value in values:
        forms = {str(value), repr(value)}
        assert any(re.search(rf"(?<![\w]){re.escape(key)}={re.escape(f)}(?![\w.])", message)
                   for f in forms), f"{key}={value!r} not named in: {message}"


def _header(file):
    """(header length, header JSON dict, raw bytes) of a safetensors file."""
    raw = open(file, "rb").read()
    n = int.from_bytes(raw[:8], "little")
    return n, json.loads(raw[8:8 + n]), raw


def _rewrite_header(file, edit) -> None:
    """Replace the header text by ``edit(text)``, which must keep its length."""
    n, _, raw = _header(file)
    text = raw[8:8 + n].decode()
    new = edit(text)
    assert new != text and len(new.encode()) == n
    with open(file, "wb") as f:
        f.write(raw[:8] + new.encode() + raw[8 + n:])


def _shards(path):
    return shard_files(str(path))


# -- 1. round trip ---------------------------------------------------------------------------


def test_round_trip_float32_exact_over_shards_and_sessions(tmp_path):
    lengths = [3, 1, 6, 2, 4, 5, 1, 3, 2, 4]
    seqs = _sequences(lengths, temperature=2.0)
    ids = [0, "a", 5, "5", 17, "b/c", 2, "d", 3, "e"]  # 5 and "5" are different ids
    settings = dict(logprob_dtype="float32", temperature=2.0, shard_bytes=300)
    # two writer sessions under one name, each flushing several small shards
    _write(tmp_path, ids[:6], seqs[:6], **settings)
    first = _shards(tmp_path)
    assert len(first) >= 2
    _write(tmp_path, ids[6:], seqs[6:], **settings)
    files = _shards(tmp_path)
    assert set(first) < set(files) and len(files) >= 4
    # the second session numbered on after the first, overwriting nothing
    assert files == [f"shard-main-{n:06d}.safetensors" for n in range(len(files))]

    store = TeacherStore(tmp_path)
    assert len(store) == len(ids) and sorted(map(str, store.ids())) == sorted(map(str, ids))
    assert (store.k, store.vocab_size, store.temperature) == (K, V, 2.0)
    assert store.num_tokens() == sum(lengths)
    for sample_id, (tokens, _, teacher) in zip(ids, seqs, strict=True):
        got = store.get(sample_id, tokens)
        assert got.indices.shape == (len(tokens), K) and got.rest_logprob.shape == (len(tokens),)
        _assert_same_teacher(got, teacher, f"id {sample_id!r}")
        assert sample_id in store
    assert 6 not in store and "0" not in store
    with pytest.raises(KeyError, match="'nope'"):
        store.get("nope")
    assert verify_store(tmp_path) == []


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_round_trip_low_precision_is_one_rounding(tmp_path, dtype):
    seqs = _sequences([4, 2, 5, 3], top_p=0.95)
    _write(tmp_path, range(4), seqs, logprob_dtype=dtype, top_p=0.95, shard_bytes=300)
    assert len(_shards(tmp_path)) >= 2
    for file in _shards(tmp_path):
        with safe_open(os.path.join(tmp_path, file), framework="pt") as h:
            assert h.get_tensor("logprobs").dtype == DTYPES[dtype]
            assert h.get_tensor("indices").dtype == torch.int32
            assert h.get_tensor("rest_logprob").dtype == torch.float32
    store = TeacherStore(tmp_path)
    changed = False
    for i, (tokens, _, teacher) in enumerate(seqs):
        got = store.get(i, tokens)
        rounded = teacher.logprobs.to(DTYPES[dtype]).float()
        assert got.logprobs.dtype == torch.float32
        assert torch.equal(got.logprobs, rounded)
        assert torch.equal(got.indices, teacher.indices)
        assert torch.equal(got.rest_logprob, teacher.rest_logprob)
        changed |= not torch.equal(got.logprobs, teacher.logprobs)
    assert changed, "the storage dtype rounded nothing: the test would not see a float32 store"
    assert verify_store(tmp_path) == []


# -- 2. variable K (top-p) -------------------------------------------------------------------


def test_top_p_rows_and_counts_tensor(tmp_path):
    flat = _sequences([3, 2], top_p=0.9, scale=0.01, seed=1)  # top-p never reached in K
    peaked = _sequences([4, 3], top_p=0.9, scale=4.0, seed=2)  # most rows cut
    for _, _, t in flat:
        assert bool((t.indices >= 0).all())
    for _, _, t in peaked:
        assert bool((t.indices == -1).any()) and bool((t.logprobs == float("-inf")).any())
    with TeacherStoreWriter(tmp_path, k=K, vocab_size=V, top_p=0.9,
                            logprob_dtype="float32") as w:
        for i, (tokens, _, t) in enumerate(flat):
            w.add(f"flat{i}", tokens, t)
        w.flush()
        for i, (tokens, _, t) in enumerate(peaked):
            w.add(f"peaked{i}", tokens, t)
        w.flush()
        w.add("mixed0", flat[0][0], flat[0][2])  # a full and a cut sequence in one shard
        w.add("mixed1", peaked[0][0], peaked[0][2])
    files = _shards(tmp_path)
    assert len(files) == 3
    keys = []
    for file in files:
        with safe_open(os.path.join(tmp_path, file), framework="pt") as h:
            keys.append(set(h.keys()))
    assert "counts" not in keys[0]
    assert "counts" in keys[1] and "counts" in keys[2]
    store = TeacherStore(tmp_path)
    for name, group in (("flat", flat), ("peaked", peaked)):
        for i, (tokens, _, t) in enumerate(group):
            _assert_same_teacher(store.get(f"{name}{i}", tokens), t, f"{name}{i}")
    _assert_same_teacher(store.get("mixed0"), flat[0][2], "mixed0")
    _assert_same_teacher(store.get("mixed1"), peaked[0][2], "mixed1")
    assert verify_store(tmp_path) == []


# -- 3. empty sequences ----------------------------------------------------------------------


def test_empty_sequences(tmp_path):
    seqs = _sequences([0, 3, 0, 2, 0])
    _write(tmp_path, ["e0", "x", "e1", "y", "e2"], seqs, logprob_dtype="float32")
    _write(tmp_path, ["only_empty"], _sequences([0]), logprob_dtype="float32", name="w2")
    assert verify_store(tmp_path) == []
    store = TeacherStore(tmp_path)
    for sample_id in ("e0", "e1", "e2", "only_empty"):
        for empty in ([], torch.empty(0, dtype=torch.int64)):
            t = store.get(sample_id, empty)
            assert t.indices.shape == (0, K) and t.logprobs.shape == (0, K)
            assert t.rest_logprob.shape == (0,)
    with pytest.raises(ValueError, match="'e0'"):
        store.get("e0", [1])

    batch = store.collate(["e0", "x", "only_empty"], input_ids=[[], seqs[1][0], []])
    assert batch.indices.shape == (3, 3, K)
    assert batch.mask.tolist() == [[False] * 3, [True] * 3, [False] * 3]
    _assert_same_teacher(
        topkd.SparseTeacher(batch.indices[1], batch.logprobs[1], batch.rest_logprob[1], 1.0, V),
        seqs[1][2])
    empty = store.collate(["e0", "only_empty"])
    assert empty.indices.shape == (2, 0, K) and empty.mask.shape == (2, 0)
    student = torch.randn(2, 0, V, requires_grad=True)
    loss = topkd.sparse_kl_loss(student, empty, reduction="mean")
    assert float(loss.detach()) == 0.0
    loss.backward()
    assert topkd.sparse_kl_loss(student, empty).shape == (2, 0)

    items = [TeacherDataset(store, [("e1", []), ("y", seqs[3][0])])[i] for i in range(2)]
    b = collate(items)
    assert b["input_ids"].shape == (2, 2) and b["attention_mask"].tolist() == [[0, 0], [1, 1]]


# -- 4. damage -------------------------------------------------------------------------------


def _damage_fixture(path):
    seqs = _sequences([3, 4, 2, 3, 5, 2])
    _write(path, [f"s{i}" for i in range(6)], seqs, logprob_dtype="float32", shard_bytes=600)
    files = _shards(path)
    assert len(files) >= 2
    assert verify_store(path) == []
    return seqs, files


def test_flipped_data_bytes_named_by_get_and_verify(tmp_path):
    seqs, files = _damage_fixture(tmp_path)
    where = {sample_id: file for file in files for sample_id in read_shard_ids(tmp_path, file)}
    victim = files[1]
    in_victim = [s for s in where if where[s] == victim]
    elsewhere = [s for s in where if where[s] != victim]
    assert len(in_victim) >= 2 and elsewhere
    # flip bytes inside the first sequence's logprobs only
    file = os.path.join(tmp_path, victim)
    n, header, raw = _header(file)
    start = 8 + n + header["logprobs"]["data_offsets"][0]
    data = bytearray(raw)
    for offset in (start + 1, start + 6):
        data[offset] ^= 0xFF
    with open(file, "wb") as f:
        f.write(bytes(data))

    store = TeacherStore(tmp_path)  # the header is intact: opening works
    with pytest.raises(ValueError, match=re.escape(file)) as e:
        store.get(in_victim[0])
    assert "CRC" in str(e.value)
    # the other sequences of that shard and of the other shards still read correctly
    for sample_id in in_victim[1:] + elsewhere:
        number = int(sample_id[1:])
        _assert_same_teacher(store.get(sample_id, seqs[number][0]), seqs[number][2], sample_id)
    problems = verify_store(tmp_path)
    assert len(problems) == 1 and file in problems[0], problems


def test_truncated_shard_refused_at_opening(tmp_path):
    _, files = _damage_fixture(tmp_path)
    file = os.path.join(tmp_path, files[-1])
    with open(file, "r+b") as f:
        f.truncate(os.path.getsize(file) - 10)
    with pytest.raises(ValueError, match=re.escape(file)):
        TeacherStore(tmp_path)
    problems = verify_store(tmp_path)
    assert len(problems) == 1 and file in problems[0], problems
    # the writer cannot resume on top of it either
    with pytest.raises(ValueError, match=re.escape(file)):
        TeacherStoreWriter(tmp_path, k=K, vocab_size=V, logprob_dtype="float32")


def test_altered_header_metadata_detected(tmp_path):
    _damage_fixture(tmp_path)
    files = [os.path.join(tmp_path, f) for f in _shards(tmp_path)]
    # (a) two sample ids swapped: each would read the other's rows
    _, header, _ = _header(files[0])
    ids = json.loads(header["__metadata__"]["sample_ids"])
    a, b = ids[0], ids[1]
    _rewrite_header(files[0], lambda text: text.replace(f'\\"{a}\\", \\"{b}\\"',
                                                       f'\\"{b}\\", \\"{a}\\"'))
    # (b) one hex digit of a tensor's recorded SHA-256 changed
    _, header, _ = _header(files[1])
    digest = json.loads(header["__metadata__"]["sha256"])["rest_logprob"]
    other = ("1" if digest[0] != "1" else "2") + digest[1:]
    _rewrite_header(files[1], lambda text: text.replace(digest, other))

    problems = verify_store(tmp_path)
    assert len(problems) == 2, problems
    assert files[0] in problems[0] and "sample_ids" in problems[0]
    assert files[1] in problems[1] and "rest_logprob" in problems[1]
    with pytest.raises(ValueError, match=re.escape(files[0])):
        TeacherStore(tmp_path)


@pytest.mark.parametrize("tensor", ["seq_rows", "seq_entries", "token_hash", "crc"])
def test_flipped_sequence_arrays_named_when_the_shard_is_touched(tmp_path, tensor):
    """The per-sequence arrays steer every read: damage there is caught before any read."""
    seqs, files = _damage_fixture(tmp_path)
    file = os.path.join(tmp_path, files[0])
    n, header, raw = _header(file)
    data = bytearray(raw)
    data[8 + n + header[tensor]["data_offsets"][0]] ^= 0x01
    with open(file, "wb") as f:
        f.write(bytes(data))
    store = TeacherStore(tmp_path)
    first = read_shard_ids(tmp_path, files[0])[0]
    with pytest.raises(ValueError, match=re.escape(file)):
        store.get(first)
    other = read_shard_ids(tmp_path, files[1])[0]
    _assert_same_teacher(store.get(other), seqs[int(other[1:])][2], other)
    problems = verify_store(tmp_path)
    assert len(problems) == 1 and file in problems[0] and tensor in problems[0], problems


def test_bool_is_not_a_sample_id_and_padding_is_not_stored(tmp_path):
    seqs = _sequences([2, 3])
    with TeacherStoreWriter(tmp_path, k=K, vocab_size=V) as writer:
        writer.add(1, seqs[0][0], seqs[0][2])
        assert 1 in writer and True not in writer
        padded = topkd.store.collate_teachers([seqs[0][2]], pad_to=3)
        one = topkd.SparseTeacher(padded.indices[0], padded.logprobs[0],
                                  padded.rest_logprob[0], 1.0, V, padded.mask[0])
        with pytest.raises(ValueError, match="padding rows"):
            writer.add(2, torch.arange(3), one)
    store = TeacherStore(tmp_path)
    assert 1 in store and True not in store
    with pytest.raises(KeyError, match="True"):
        store.get(True)


# -- 5. mismatches ---------------------------------------------------------------------------


def test_token_hash_mismatch_names_the_id(tmp_path):
    seqs = _sequences([4, 3])
    _write(tmp_path, ["s0", 7], seqs)
    store = TeacherStore(tmp_path)
    store.get(7, seqs[1][0])
    for wrong in (seqs[0][0], seqs[1][0][:2], seqs[1][0] + 1, seqs[1][0].flip(0)):
        with pytest.raises(ValueError, match="sample_id 7:"):
            store.get(7, wrong)
    with pytest.raises(ValueError, match="'s0'"):
        store.collate(["s0", 7], input_ids=[seqs[1][0], seqs[1][0]])
    with pytest.raises(ValueError, match="input_ids"):
        store.get(7, seqs[1][0].float())


@pytest.mark.parametrize("key, value", [("vocab_size", V + 1), ("k", K - 1),
                                        ("temperature", 2.0),
                                        ("tokenizer_fingerprint", "sha256:other")])
def test_reader_refuses_other_settings(tmp_path, key, value):
    _write(tmp_path, ["a"], _sequences([2]), tokenizer_fingerprint="sha256:mine")
    stored = {"vocab_size": V, "k": K, "temperature": 1.0,
              "tokenizer_fingerprint": "sha256:mine"}[key]
    TeacherStore(tmp_path, **{key: stored})
    with pytest.raises(ValueError) as e:
        TeacherStore(tmp_path, **{key: value})
    _names(str(e.value), key, stored, value)


@pytest.mark.parametrize("key, value", [("vocab_size", V + 1), ("k", K - 1),
                                        ("temperature", 0.5), ("top_p", 0.8),
                                        ("logprob_dtype", "float32"),
                                        ("tokenizer_fingerprint", "sha256:other"),
                                        ("store_tokens", False)])
def test_writer_reopened_with_other_settings(tmp_path, key, value):
    settings = {"k": K, "vocab_size": V, "temperature": 1.0, "top_p": None,
                "logprob_dtype": "bfloat16", "tokenizer_fingerprint": "sha256:mine",
                "store_tokens": True}
    _write(tmp_path, ["a"], _sequences([2]), **settings)
    with pytest.raises(ValueError) as e:
        TeacherStoreWriter(tmp_path, **{**settings, key: value})
    _names(str(e.value), key, settings[key], value)
    # the refused writer took no lock: the right settings still open
    TeacherStoreWriter(tmp_path, **settings).close()


def test_loss_refuses_other_temperature_or_vocabulary(tmp_path):
    seqs = _sequences([3, 2], temperature=1.5)
    _write(tmp_path, ["a", "b"], seqs, temperature=1.5)
    batch = TeacherStore(tmp_path).collate(["a", "b"])
    student = torch.randn(2, 3, V)
    topkd.sparse_kl_loss(student, batch, temperature=1.5)
    with pytest.raises(ValueError) as e:
        topkd.sparse_kl_loss(student, batch, temperature=1.0)
    assert "temperature=1.0" in str(e.value) and "1.5" in str(e.value)
    with pytest.raises(ValueError) as e:
        topkd.sparse_kl_loss(torch.randn(2, 3, V + 7), batch)
    _names(str(e.value), "vocab_size", V)
    assert str(V + 7) in str(e.value)
    hidden, weight = torch.randn(2, 3, 8), torch.randn(V, 8)
    with pytest.raises(ValueError) as e:
        topkd.fused_topk_kl_loss(hidden, weight, batch, temperature=1.0)
    assert "temperature=1.0" in str(e.value) and "1.5" in str(e.value)


def test_writer_add_refuses_other_teacher(tmp_path):
    logits = torch.randn(3, V)
    tokens = torch.arange(3)
    with TeacherStoreWriter(tmp_path, k=K, vocab_size=V, temperature=1.0) as w:
        cases = [("vocab_size", topkd.select_topk(logits[:, :V - 4], K), V - 4, V),
                 ("k", topkd.select_topk(logits, K + 2), K + 2, K),
                 ("temperature", topkd.select_topk(logits, K, temperature=3.0), 3.0, 1.0)]
        for key, teacher, have, want in cases:
            with pytest.raises(ValueError) as e:
                w.add("x", tokens, teacher)
            _names(str(e.value), key, have, want)
            assert "'x'" in str(e.value)
        teacher = topkd.select_topk(logits, K)
        with pytest.raises(ValueError, match=re.escape(f"[4, {K}]")):
            w.add("x", torch.arange(4), teacher)  # 4 tokens, 3 teacher rows
        bad = topkd.SparseTeacher(teacher.indices, teacher.logprobs[:, :-1],
                                  teacher.rest_logprob, 1.0, V)
        with pytest.raises(ValueError, match="logprobs"):
            w.add("x", tokens, bad)
        bad = topkd.SparseTeacher(teacher.indices, teacher.logprobs,
                                  torch.zeros(4), 1.0, V)
        with pytest.raises(ValueError, match="rest_logprob"):
            w.add("x", tokens, bad)
        assert "x" not in w and len(w) == 0  # nothing refused was recorded
        w.add("x", tokens, teacher)
    assert TeacherStore(tmp_path).ids() == ["x"]


# -- 6. duplicate ids ------------------------------------------------------------------------


def test_duplicate_ids(tmp_path):
    seqs = _sequences([2, 3, 1])
    with TeacherStoreWriter(tmp_path, k=K, vocab_size=V) as w:
        w.add("a", *seqs[0][::2])
        w.flush()
        w.add(1, *seqs[1][::2])
        for sample_id in ("a", 1):  # flushed and still pending
            with pytest.raises(ValueError, match=re.escape(repr(sample_id))):
                w.add(sample_id, *seqs[2][::2])
    # a later session knows what the earlier one committed
    with TeacherStoreWriter(tmp_path, k=K, vocab_size=V) as w:
        assert "a" in w and 1 in w and "1" not in w and len(w) == 2
        with pytest.raises(ValueError, match="'a'"):
            w.add("a", *seqs[2][::2])
        w.add("1", *seqs[2][::2])  # the str "1" is another id than the int 1
    assert verify_store(tmp_path) == []

    # two live writers under different names cannot see each other's pending ids
    with TeacherStoreWriter(tmp_path, k=K, vocab_size=V, name="left") as left, \
            TeacherStoreWriter(tmp_path, k=K, vocab_size=V, name="right") as right:
        left.add("dup", *seqs[0][::2])
        right.add("dup", *seqs[1][::2])
    with pytest.raises(ValueError) as e:
        TeacherStore(tmp_path)
    for name in ("shard-left-000000.safetensors", "shard-right-000000.safetensors", "'dup'"):
        assert name in str(e.value)
    problems = verify_store(tmp_path)
    assert len(problems) == 1 and "'dup'" in problems[0], problems
    assert "shard-left-000000" in problems[0] and "shard-right-000000" in problems[0]


# -- 7. crash safety -------------------------------------------------------------------------


@pytest.mark.parametrize("codec", ["plain", "exact"])
def test_writer_killed_mid_shard_resumes(tmp_path, codec):
    path = str(tmp_path / "store")
    # a shard every two or three sequences
    count, shard_bytes = 400, {"plain": 500, "exact": 250}[codec]
    child = subprocess.Popen(
        [sys.executable, store_worker.__file__, "crash", path, str(count), str(shard_bytes),
         codec],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not (os.path.isdir(path) and len(_shards(path)) >= 2):
            assert child.poll() is None, child.stdout.read().decode()
            assert time.monotonic() < deadline, "the writer made no two shards in 60 s"
            time.sleep(0.01)
        time.sleep(0.03)  # let it add a sequence or two to the next shard
        assert child.poll() is None, "the writer finished before it could be killed"
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
        child.stdout.close()

    assert verify_store(path) == []
    store = TeacherStore(path)
    stored = set(store.ids())
    # shards are written in order and only when complete: the store is a prefix of the ids
    assert stored == {f"s{i}" for i in range(len(stored))} and 2 <= len(stored) < count
    for sample_id in stored:
        tokens, _, teacher = store_worker.sequence(int(sample_id[1:]))
        _assert_same_teacher(store.get(sample_id, tokens), teacher, sample_id)

    # the same name reopens (the dead writer's lock went with it) and resumes
    total = len(stored) + 7
    skipped = []
    with TeacherStoreWriter(path, **store_worker.CODEC_SETTINGS[codec],
                            shard_bytes=shard_bytes) as w:
        assert not [n for n in os.listdir(path) if ".tmp-" in n and n.startswith(".shard-")]
        for number in range(total):
            sample_id = f"s{number}"
            if sample_id in w:
                skipped.append(sample_id)
                continue
            tokens, _, teacher = store_worker.sequence(number)
            w.add(sample_id, tokens, teacher)
    assert set(skipped) == stored
    assert verify_store(path) == []
    final = TeacherStore(path)  # opening fails on an id stored twice
    assert sorted(final.ids()) == sorted(f"s{i}" for i in range(total))
    for number in range(total):
        tokens, _, teacher = store_worker.sequence(number)
        _assert_same_teacher(final.get(f"s{number}", tokens), teacher, f"s{number}")


def test_leftover_temporary_and_live_lock(tmp_path):
    seqs = _sequences([2, 3])
    _write(tmp_path, ["a"], seqs[:1])
    real = os.path.join(tmp_path, _shards(tmp_path)[0])
    partial = open(real, "rb").read()[:100]
    own = tmp_path / ".shard-main-000099.safetensors.tmp-12345"
    foreign = tmp_path / ".shard-other-000001.safetensors.tmp-777"
    own.write_bytes(partial)
    foreign.write_bytes(partial)
    store = TeacherStore(tmp_path)
    assert store.files == ["shard-main-000000.safetensors"] and store.ids() == ["a"]
    assert verify_store(tmp_path) == []

    writer = TeacherStoreWriter(tmp_path, k=K, vocab_size=V)
    assert not own.exists(), "the writer named main left its dead temporary"
    assert foreign.exists(), "a writer removed another writer's temporary"
    with pytest.raises(RuntimeError, match="'main'"):
        TeacherStoreWriter(tmp_path, k=K, vocab_size=V)
    with pytest.raises(RuntimeError, match="'main'"):
        TeacherStoreWriter(tmp_path, k=K, vocab_size=V, name="main")
    assert foreign.exists()
    other = TeacherStoreWriter(tmp_path, k=K, vocab_size=V, name="other")  # another name: fine
    other.close()
    assert not foreign.exists()
    writer.add("b", *seqs[1][::2])  # the refused writers did not disturb the live one
    writer.close()
    TeacherStoreWriter(tmp_path, k=K, vocab_size=V).close()  # released on close
    assert sorted(TeacherStore(tmp_path).ids()) == ["a", "b"]


# -- 8. two gloo ranks, one store ------------------------------------------------------------


@pytest.mark.skipif(not torch.distributed.is_available()
                    or not torch.distributed.is_gloo_available(),
                    reason="torch.distributed with gloo is not available")
def test_two_gloo_ranks_write_one_store(tmp_path):

    store_dir, result_dir = tmp_path / "store", tmp_path / "results"
    result_dir.mkdir()
    world, count, deadline_s = 2, 12, 120
    helpers.spawn_ranks(store_worker.gloo_writer, world,
                        (world, count, str(store_dir), str(result_dir)),
                        result_dir, deadline_s)

    assert verify_store(store_dir) == []
    store = TeacherStore(store_dir)
    assert sorted(store.ids()) == list(range(count))
    for number in range(count):
        tokens, _, teacher = store_worker.sequence(number)
        _assert_same_teacher(store.get(number, tokens), teacher, str(number))
    writers = {re.match(r"shard-(rank\d+)-\d+\.safetensors$", f)[1] for f in store.files}
    assert writers == {"rank00000", "rank00001"}
    for rank in range(world):
        mine = [sample_id for file in store.files if f"-rank{rank:05d}-" in file
                for sample_id in read_shard_ids(store_dir, file)]
        assert sorted(mine) == list(range(rank, count, world))


# -- 9. the loss from a stored batch ---------------------------------------------------------


LENGTHS = [5, 0, 3, 7, 1]


def _loss_fixture(path, dtype, *, top_p=0.9, temperature=1.0):
    seqs = _sequences(LENGTHS, top_p=top_p, temperature=temperature, seed=3)
    _write(path, range(len(seqs)), seqs, logprob_dtype=dtype, top_p=top_p,
           temperature=temperature, shard_bytes=700)
    store = TeacherStore(path)
    batch = store.collate(range(len(seqs)), input_ids=[s[0] for s in seqs], pad_to=8)
    student = helpers.logits(len(seqs), 8, V, scale=2.0, seed=4)  # padded rows random too
    return seqs, batch, student


def _online(student, seqs, teachers=None, **options):
    """Per-sequence online loss (reduction none) and gradient of its sum, on unpadded rows."""
    out = []
    for b, (tokens, _, teacher) in enumerate(seqs):
        teacher = teacher if teachers is None else teachers[b]
        out.append(helpers.run(topkd.sparse_kl_loss, student[b, :len(tokens)], teacher,
                               grad_output=torch.ones(len(tokens)), **options))
    return out


@pytest.mark.parametrize("normalize", ["full", "topk"])
@pytest.mark.parametrize("reverse", [False, True])
def test_store_loss_equals_online_float32(tmp_path, normalize, reverse):
    seqs, batch, student = _loss_fixture(tmp_path, "float32", temperature=1.3)
    mask = batch.mask
    assert mask.sum() == sum(LENGTHS) and not mask.all()
    opts = dict(normalize=normalize, reverse=reverse)
    online = _online(student, seqs, **opts)

    loss, grad = helpers.run(topkd.sparse_kl_loss, student, batch,
                             grad_output=torch.ones(mask.shape), **opts)
    assert loss.shape == mask.shape
    assert torch.all(loss[~mask] == 0)
    assert torch.all(grad[~mask] == 0), "padded rows got a gradient"
    for b, (row_loss, row_grad) in enumerate(online):
        n = LENGTHS[b]
        assert torch.equal(loss[b, :n], row_loss)
        assert torch.equal(grad[b, :n], row_grad)

    rows = torch.cat([row_loss for row_loss, _ in online]).double()
    # float32 summation of n terms: within n * 2^-24 * sum |terms| of the float64 sum
    slack = len(rows) * 2.0**-24 * float(rows.abs().sum())
    total, grad_sum = helpers.run(topkd.sparse_kl_loss, student, batch, reduction="sum", **opts)
    mean, grad_mean = helpers.run(topkd.sparse_kl_loss, student, batch, reduction="mean", **opts)
    assert abs(float(total) - float(rows.sum())) <= slack
    # "mean" divides by the unpadded rows only
    assert float(mean) == float(total / mask.sum())
    assert torch.equal(grad_sum, grad)
    assert torch.all(grad_mean[~mask] == 0)
    # the upstream 1/n enters the float32 row computations: the float32 gradient tolerance
    assert helpers.grad_err(grad_mean, grad.double() / int(mask.sum())) <= helpers.GRAD_TOL_F32

    # an explicit mask on top of the padding mask drops its rows as well
    extra = torch.ones_like(mask)
    extra[0, 1] = False
    masked, grad_masked = helpers.run(topkd.sparse_kl_loss, student, batch, mask=extra,
                                      reduction="mean", **opts)
    kept = mask & extra
    assert abs(float(masked) - float(loss[kept].double().mean())) <= slack / int(kept.sum())
    assert torch.all(grad_masked[~kept] == 0)
    assert helpers.grad_err(grad_masked, torch.where(kept[..., None], grad, 0).double()
                            / int(kept.sum())) <= helpers.GRAD_TOL_F32


@pytest.mark.parametrize("vocab, k", [(1, 1), (8, 8), (40, 3)])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("normalize", ["full", "topk"])
def test_padding_rows_have_zero_finite_gradient(tmp_path, vocab, k, reverse, normalize):
    """Padding must be harmless for every loss: with K = V the real rows have no ghost, with
    V = 1 nothing but one entry exists."""
    seqs = _sequences([3, 1], vocab=vocab, k=k)
    _write(tmp_path, ["a", "b"], seqs, k=k, vocab_size=vocab, logprob_dtype="float32")
    batch = TeacherStore(tmp_path).collate(["a", "b"], pad_to=4)
    student = helpers.logits(2, 4, vocab, seed=7)
    opts = dict(reverse=reverse, normalize=normalize)
    loss, grad = helpers.run(topkd.sparse_kl_loss, student, batch,
                             grad_output=torch.ones(2, 4), **opts)
    assert torch.all(loss[~batch.mask] == 0) and torch.all(grad[~batch.mask] == 0)
    for b, (row_loss, row_grad) in enumerate(_online(student, seqs, **opts)):
        n = len(seqs[b][0])
        assert torch.equal(loss[b, :n], row_loss) and torch.equal(grad[b, :n], row_grad)
    mean, grad = helpers.run(topkd.sparse_kl_loss, student, batch, reduction="mean", **opts)
    assert torch.isfinite(mean) and torch.all(grad[~batch.mask] == 0)


@pytest.mark.parametrize("reverse", [False, True])
def test_store_loss_bf16_within_storage_rounding(tmp_path, reverse):
    seqs, batch, student = _loss_fixture(tmp_path, "bfloat16")
    opts = dict(reverse=reverse)
    loss, grad = helpers.run(topkd.sparse_kl_loss, student, batch,
                             grad_output=torch.ones(batch.mask.shape), **opts)
    assert torch.all(loss[~batch.mask] == 0) and torch.all(grad[~batch.mask] == 0)
    # the online teacher with its logprobs rounded to bf16 and back is what the store holds
    rounded = [topkd.SparseTeacher(t.indices, t.logprobs.bfloat16().float(), t.rest_logprob,
                                   t.temperature, t.vocab_size) for _, _, t in seqs]
    exact = _online(student, seqs, rounded, **opts)
    online = _online(student, seqs, **opts)
    moved = False
    for b, (tokens, _, teacher) in enumerate(seqs):
        n = len(tokens)
        assert torch.equal(loss[b, :n], exact[b][0])
        assert torch.equal(grad[b, :n], exact[b][1])
        if n == 0:
            continue
        # analytical bound of what rounding log q by delta moves the loss (float64):
        # forward: d/dx e^x (x - log p) = e^x (x - log p + 1); reverse: d/dx p (log p - x) = -p
        x = teacher.logprobs.double()
        delta = (teacher.logprobs.bfloat16().double() - x).abs()
        used = teacher.indices >= 0
        logp = torch.log_softmax(student[b, :n].double(), -1).gather(
            -1, teacher.indices.clamp_min(0))
        if reverse:
            per = logp.exp() * delta
        else:
            per = (x + delta).exp() * ((x - logp).abs() + delta + 1) * delta
        bound = torch.where(used, per, torch.zeros_like(per)).sum(-1)
        diff = (loss[b, :n].double() - online[b][0].double()).abs()
        noise = 4 * 2.0**-24 * (online[b][0].double().abs() + 1)  # float32 rounding of both
        assert torch.all(diff <= bound + noise), (diff, bound)
        moved |= bool((diff > 0).any())
    assert moved, "bf16 storage changed no loss: the comparison has no teeth"


def test_store_loss_against_float64_reference(tmp_path):
    temperature, top_p = 1.5, 0.9
    seqs, batch, student = _loss_fixture(tmp_path, "float32", top_p=top_p,
                                         temperature=temperature)
    teacher_logits = helpers.logits(len(seqs), 8, V, seed=5)  # padding rows: anything
    for b, (tokens, logits, _) in enumerate(seqs):
        teacher_logits[b, :len(tokens)] = logits
    ref_teacher = reference.select(teacher_logits, K, top_p=top_p, temperature=temperature)
    assert reference.top_p_margin(ref_teacher, top_p) > 1e-5
    for reduction in ("none", "mean"):
        options = dict(temperature=temperature, mask=batch.mask, reduction=reduction)
        ref_loss, ref_grad = reference.loss_and_grad(reference.sparse_loss, student, ref_teacher,
                                                     **options)
        loss, grad = helpers.run(topkd.sparse_kl_loss, student, batch, reduction=reduction)
        helpers.assert_loss_close(loss, ref_loss)
        helpers.assert_grad_close(grad, ref_grad, torch.float32)
        assert torch.all(grad[~batch.mask] == 0)


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("reverse", [False, True])
def test_fused_loss_respects_batch_mask(tmp_path, reduction, reverse):
    seqs, batch, _ = _loss_fixture(tmp_path, "float32")
    g = torch.Generator().manual_seed(6)
    hidden = torch.randn(len(seqs), 8, 16, generator=g)
    weight = torch.randn(V, 16, generator=g) * 0.5
    mask = batch.mask

    def fused(h):
        return topkd.fused_topk_kl_loss(h, weight, batch, reduction=reduction, reverse=reverse)

    grad_output = torch.ones(mask.shape) if reduction == "none" else None
    loss, grad = helpers.run(fused, hidden, grad_output=grad_output)
    assert torch.all(grad[~mask] == 0), "padded rows of hidden got a gradient"
    # the same rows through the unfused loss, sequence by sequence (no padding at all)
    logits = hidden @ weight.T
    rows = torch.cat([topkd.sparse_kl_loss(logits[b, :len(tokens)], teacher, reverse=reverse)
                      for b, (tokens, _, teacher) in enumerate(seqs)])
    if reduction == "none":
        assert torch.all(loss[~mask] == 0)
        torch.testing.assert_close(loss[mask], rows, rtol=helpers.LOSS_RTOL, atol=1e-6)
    else:
        want = rows.double().sum() / (mask.sum() if reduction == "mean" else 1)
        assert abs(float(loss) - float(want)) <= helpers.LOSS_RTOL * abs(float(want))
    # changing the padded rows of hidden changes nothing
    other = hidden.clone()
    other[~mask] = torch.randn(int((~mask).sum()), 16, generator=g) * 10
    again, _ = helpers.run(fused, other, grad_output=grad_output)
    torch.testing.assert_close(again, loss, rtol=1e-6, atol=0)


# -- 10. Dataset, collate, DataLoader --------------------------------------------------------


@pytest.mark.parametrize("workers", [0, 1])
def test_dataset_and_dataloader(tmp_path, workers):
    seqs = _sequences([4, 2, 0, 5, 3], top_p=0.9)
    ids = ["a", 1, "c", "d", 4]
    _write(tmp_path, ids, seqs, top_p=0.9, shard_bytes=400)
    store = TeacherStore(tmp_path)
    store.get("a")  # maps a shard: the pickled store must map its own
    clone = pickle.loads(pickle.dumps(store))
    _assert_same_teacher(clone.get("d"), store.get("d"))
    # pairs and mappings (extra keys kept), token ids as lists or tensors
    samples = [("a", seqs[0][0].tolist()), {"sample_id": 1, "input_ids": seqs[1][0], "x": 9},
               ("c", []), {"sample_id": "d", "input_ids": seqs[3][0].tolist()},
               (4, seqs[4][0])]
    dataset = TeacherDataset(str(tmp_path), samples)
    assert len(dataset) == 5 and dataset[1]["x"] == 9
    for i, sample_id in enumerate(ids):
        item = dataset[i]
        assert item["sample_id"] == sample_id and item["input_ids"].dtype == torch.int64
        _assert_same_teacher(item["teacher"], store.get(sample_id), str(sample_id))

    pad = -7
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=3, num_workers=workers,
        collate_fn=functools.partial(collate, pad_token_id=pad),
        multiprocessing_context="spawn" if workers else None)
    batches = list(loader)
    assert [b["sample_ids"] for b in batches] == [["a", 1, "c"], ["d", 4]]
    for batch, start in zip(batches, (0, 3), strict=True):
        teacher = batch["teacher"]
        lengths = [len(seqs[start + j][0]) for j in range(len(batch["sample_ids"]))]
        width = max(lengths)
        assert batch["input_ids"].shape == (len(lengths), width)
        assert teacher.indices.shape == (len(lengths), width, K)
        for j, n in enumerate(lengths):
            assert torch.equal(batch["input_ids"][j, :n], seqs[start + j][0])
            assert torch.all(batch["input_ids"][j, n:] == pad)
            assert batch["attention_mask"][j].tolist() == [1] * n + [0] * (width - n)
            assert teacher.mask[j].tolist() == [True] * n + [False] * (width - n)
            one = store.get(batch["sample_ids"][j])
            assert torch.equal(teacher.indices[j, :n], one.indices)
            assert torch.equal(teacher.logprobs[j, :n], one.logprobs)
            assert torch.equal(teacher.rest_logprob[j, :n], one.rest_logprob)
    fixed = collate([dataset[0], dataset[1]], pad_to=6)
    assert fixed["input_ids"].shape == (2, 6) and fixed["teacher"].mask.shape == (2, 6)

    wrong = TeacherDataset(store, [("a", seqs[0][0].tolist()), ("d", seqs[4][0])])
    _assert_same_teacher(wrong[0]["teacher"], store.get("a"))
    with pytest.raises(ValueError, match="sample_id 'd'"):
        wrong[1]


# -- 11. bad writer inputs -------------------------------------------------------------------


def test_writer_bad_inputs(tmp_path):
    options = {"k": K, "vocab_size": V}
    for kwargs, error, word in [
        ({"logprob_dtype": "float64"}, ValueError, "logprob_dtype"),
        ({"logprob_dtype": torch.bfloat16}, ValueError, "logprob_dtype"),
        ({"name": "a/b"}, ValueError, "name"),
        ({"name": ""}, ValueError, "name"),
        ({"name": "x" * 65}, ValueError, "name"),
        ({"name": 3}, ValueError, "name"),
        ({"metadata": {"a": object()}}, TypeError, "metadata"),
        ({"metadata": {"a": {1, 2}}}, TypeError, "metadata"),
        ({"k": 0}, ValueError, "k"),
        ({"k": V + 1}, ValueError, "k"),
        ({"vocab_size": True}, TypeError, "vocab_size"),
        ({"temperature": 0.0}, ValueError, "temperature"),
        ({"top_p": 1.5}, ValueError, "top_p"),
        ({"shard_bytes": 0}, ValueError, "shard_bytes"),
        ({"tokenizer_fingerprint": 5}, TypeError, "tokenizer_fingerprint"),
    ]:
        with pytest.raises(error, match=rf"\b{word}\b"):
            TeacherStoreWriter(tmp_path / "bad", **{**options, **kwargs})
    assert not (tmp_path / "bad").exists() or not _shards(tmp_path / "bad")

    tokens, _, teacher = _sequences([3])[0]
    writer = TeacherStoreWriter(tmp_path, **options, metadata={"run": [1, "x"]})
    for sample_id in (1.5, True, None, ("a",), b"a"):
        with pytest.raises(TypeError, match="sample_id"):
            writer.add(sample_id, tokens, teacher)
    with pytest.raises(TypeError, match="teacher"):
        writer.add("a", tokens, (teacher.indices, teacher.logprobs))
    with pytest.raises(ValueError, match="input_ids"):
        writer.add("a", tokens[None], teacher)
    with pytest.raises(ValueError, match="input_ids"):
        writer.add("a", tokens.float(), teacher)
    too_big = teacher.indices.clone()
    too_big[1, 2] = V
    with pytest.raises(ValueError, match=f"vocab_size={V}"):
        writer.add("a", tokens, topkd.SparseTeacher(too_big, teacher.logprobs,
                                                    teacher.rest_logprob, 1.0, V))
    twice = teacher.indices.clone()
    twice[2, 3] = twice[2, 1]  # (every codec stored it before; a loss now refuses it)
    with pytest.raises(ValueError,
                       match=rf"'a'.*at most once per row; row \(2,\) holds {int(twice[2, 1])}"):
        writer.add("a", tokens, topkd.SparseTeacher(twice, teacher.logprobs,
                                                    teacher.rest_logprob, 1.0, V))
    hole, hole_q = teacher.indices.clone(), teacher.logprobs.clone()
    hole[0, 3], hole_q[0, 3] = -1, float("-inf")  # an unused slot before used ones
    with pytest.raises(ValueError, match=r"unused slots \(-1\)"):
        writer.add("a", tokens, topkd.SparseTeacher(hole, hole_q, teacher.rest_logprob, 1.0, V))
    # what a loss would refuse (each stored before, the mass of a -1 slot silently dropped)
    minus = teacher.indices.clone()
    minus[1, -1] = -1
    for indices, logprobs, error, match in (
            (minus, teacher.logprobs, ValueError, r"-inf at the unused slots.*row \(1,\)"),
            (minus.clone().fill_(-5), teacher.logprobs, ValueError, r"row \(0,\) holds -5"),
            (teacher.indices, teacher.logprobs.long(), TypeError, "logprobs must be a floating"),
            (teacher.indices.float(), teacher.logprobs, TypeError, "indices must be an integer")):
        with pytest.raises(error, match=rf"sample 'a': .*{match}"):
            writer.add("a", tokens, topkd.SparseTeacher(indices, logprobs,
                                                        teacher.rest_logprob, 1.0, V))
    assert len(writer) == 0
    writer.add("a", tokens, teacher)
    writer.close()
    writer.close()  # closing twice is harmless
    for call in (lambda: writer.add("b", tokens, teacher), writer.flush):
        with pytest.raises(ValueError, match="closed"):
            call()
    store = TeacherStore(tmp_path)
    assert store.ids() == ["a"] and store.manifest["metadata"] == {"run": [1, "x"]}


def test_numpy_integer_ids_are_ints(tmp_path):
    np = pytest.importorskip("numpy")
    seqs = _sequences([2, 3])
    with TeacherStoreWriter(tmp_path, k=K, vocab_size=V, codec="exact") as writer:
        writer.add(np.int64(5), seqs[0][0], seqs[0][2])
        assert 5 in writer and np.int32(5) in writer
        with pytest.raises(ValueError, match="already in the store"):
            writer.add(5, seqs[1][0], seqs[1][2])
    store = TeacherStore(tmp_path)
    assert store.ids() == [5] and type(store.ids()[0]) is int
    assert np.int64(5) in store
    _assert_same_teacher(store.get(np.int16(5), seqs[0][0]), seqs[0][2], "np id")


def test_failed_setup_releases_the_lock_and_failed_close_can_retry(tmp_path, monkeypatch):
    import fcntl

    _, files = _damage_fixture(tmp_path)
    file = os.path.join(tmp_path, files[-1])
    saved = open(file, "rb").read()
    with open(file, "r+b") as f:
        f.truncate(len(saved) - 10)
    with pytest.raises(ValueError, match=re.escape(file)) as failure:
        TeacherStoreWriter(tmp_path, k=K, vocab_size=V, logprob_dtype="float32")
    # while the exception (and its traceback) is alive, the lock is already free
    with open(os.path.join(tmp_path, ".writer-main.lock")) as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(lock, fcntl.LOCK_UN)
    del failure
    with open(file, "wb") as f:
        f.write(saved)

    # a shard write that fails once: close raises, the rows stay queued, close again works
    import topkd.store.format as fmt

    real, calls = fmt.write_durably, []

    def flaky(*args, **kwargs):
        calls.append(args[1])
        if len(calls) == 1:
            raise OSError("disk full")
        return real(*args, **kwargs)

    seqs = _sequences([2, 3], seed=5)
    writer = TeacherStoreWriter(tmp_path, k=K, vocab_size=V, logprob_dtype="float32")
    writer.add("late0", seqs[0][0], seqs[0][2])
    writer.add("late1", seqs[1][0], seqs[1][2])
    monkeypatch.setattr(fmt, "write_durably", flaky)
    with pytest.raises(OSError, match="disk full"):
        writer.close()
    assert not writer.closed
    writer.close()
    assert writer.closed and len(calls) == 2
    store = TeacherStore(tmp_path)
    for i in range(2):
        _assert_same_teacher(store.get(f"late{i}", seqs[i][0]), seqs[i][2], f"late{i}")
    assert verify_store(tmp_path) == []


# -- 12. stored token ids --------------------------------------------------------------------


def _token_rows(path):
    """Per shard: its input_ids tensor (None if absent) and its token rows."""
    out = []
    for file in _shards(path):
        with safe_open(os.path.join(path, file), framework="pt") as h:
            ids = h.get_tensor("input_ids") if "input_ids" in h.keys() else None
            out.append((ids, h.get_tensor("rest_logprob").shape[0]))
    return out


def test_tokens_round_trip_over_shards_top_p_and_writers(tmp_path):
    seqs = _sequences([4, 0, 3, 6, 2, 5, 1, 3], top_p=0.9, scale=5.0, seed=8)  # rows cut
    # large ids too: int32 holds every vocabulary up to 2**31 - 2
    seqs[2] = (torch.tensor([0, 2**31 - 1, 7]), None, seqs[2][2])
    ids = ["a", "empty", 2, "d", 4, "f", 6, "h"]
    settings = dict(top_p=0.9, shard_bytes=150, logprob_dtype="float32")
    _write(tmp_path, ids[:5], seqs[:5], **settings)
    _write(tmp_path, ids[5:], seqs[5:], name="other", **settings)
    shards = _token_rows(tmp_path)
    assert len(shards) >= 4 and {f.split("-")[1] for f in _shards(tmp_path)} == {"main", "other"}
    for tokens, rows in shards:
        assert tokens is not None and tokens.dtype == torch.int32 and tokens.shape == (rows,)
    store = TeacherStore(tmp_path)
    assert store.store_tokens and store.manifest["store_tokens"] is True
    assert any(_header(os.path.join(tmp_path, f))[1].get("counts") for f in _shards(tmp_path))
    for sample_id, (tokens, _, teacher) in zip(ids, seqs, strict=True):
        got = store.tokens(sample_id)
        assert got.dtype == torch.int64 and torch.equal(got, tokens), sample_id
        _assert_same_teacher(store.get(sample_id, got), teacher, str(sample_id))
    assert verify_store(tmp_path) == []
    with pytest.raises(KeyError, match="'nope'"):
        store.tokens("nope")

    with TeacherStoreWriter(tmp_path / "big", k=K, vocab_size=V) as writer:
        for bad in (torch.tensor([1, 2**31]), torch.tensor([-(2**31) - 1])):
            with pytest.raises(ValueError, match="int32.*store_tokens=False"):
                writer.add("x", bad, _sequences([len(bad)])[0][2])
        assert "x" not in writer


def test_tokens_opt_out(tmp_path):
    seqs = _sequences([4, 3, 5])
    _write(tmp_path / "with", range(3), seqs)
    _write(tmp_path / "without", range(3), seqs, store_tokens=False)
    assert all(t is None for t, _ in _token_rows(tmp_path / "without"))
    store = TeacherStore(tmp_path / "without")
    assert not store.store_tokens and store.manifest["store_tokens"] is False
    # the same teachers, 4 bytes per token (and the tensor's header entry) fewer
    saved = TeacherStore(tmp_path / "with").nbytes() - store.nbytes()
    assert 4 * 12 <= saved <= 4 * 12 + 300
    for i, (tokens, _, _) in enumerate(seqs):
        _assert_same_teacher(store.get(i, tokens), TeacherStore(tmp_path / "with").get(i), str(i))
    for call in (lambda: store.tokens(0), lambda: TeacherDataset(store)):
        with pytest.raises(ValueError, match="holds no token ids") as e:
            call()
        assert str(tmp_path / "without") in str(e.value) and "--no-tokens" in str(e.value)
    assert verify_store(tmp_path / "without") == []


def test_dataset_over_the_whole_store(tmp_path):
    seqs = _sequences([3, 0, 5, 2], top_p=0.9, seed=9)
    ids = ["a", "b", 7, "c"]
    _write(tmp_path, ids, seqs, top_p=0.9, shard_bytes=300)
    store = TeacherStore(tmp_path)
    order = store.ids()
    dataset = TeacherDataset(store)
    assert len(dataset) == 4
    for i, sample_id in enumerate(order):
        item = dataset[i]
        assert set(item) == {"sample_id", "input_ids", "teacher"}
        assert item["sample_id"] == sample_id
        tokens, _, teacher = seqs[ids.index(sample_id)]
        assert item["input_ids"].dtype == torch.int64 and torch.equal(item["input_ids"], tokens)
        _assert_same_teacher(item["teacher"], store.get(sample_id, tokens), str(sample_id))
    clone = pickle.loads(pickle.dumps(dataset))
    assert torch.equal(clone[2]["input_ids"], dataset[2]["input_ids"])
    loader = torch.utils.data.DataLoader(TeacherDataset(str(tmp_path)), batch_size=4,
                                         num_workers=1, collate_fn=collate,
                                         multiprocessing_context="spawn")
    (batch,) = list(loader)
    assert batch["sample_ids"] == order
    for j, sample_id in enumerate(order):
        tokens = seqs[ids.index(sample_id)][0]
        assert torch.equal(batch["input_ids"][j, :len(tokens)], tokens)
    assert len(TeacherDataset(_write(tmp_path / "empty", [], []).path)) == 0


def _drop_from_manifest(path, *keys):
    """Rewrite the manifest without ``keys`` (as a topkd that did not store tokens wrote it,
    or a hand edit)."""
    file = os.path.join(path, MANIFEST)
    manifest = json.load(open(file))
    for key in keys:
        del manifest[key]
    with open(file, "w") as f:
        json.dump(manifest, f)


@pytest.mark.parametrize("key", ["vocab_size", "k", "temperature"])
def test_manifest_without_a_setting_is_refused(tmp_path, key):
    """(A bare KeyError from get and from verify_store before.)"""
    seqs = _sequences([3])
    _write(tmp_path, ["a"], seqs, codec="exact")
    _drop_from_manifest(tmp_path, key)
    with pytest.raises(ValueError, match=rf"lacks \['{key}'\]"):
        TeacherStore(tmp_path).get("a", seqs[0][0])
    (problem,) = verify_store(tmp_path)  # (verify lists the problems it finds)
    assert f"lacks ['{key}']" in problem


def test_store_without_the_tokens_setting_reads_as_no_tokens(tmp_path):
    seqs = _sequences([3, 2])
    _write(tmp_path, ["a", "b"], seqs, store_tokens=False, codec="exact")
    _drop_from_manifest(tmp_path, "store_tokens")
    store = TeacherStore(tmp_path)
    assert store.store_tokens is False
    _assert_same_teacher(store.get("a", seqs[0][0]), seqs[0][2], "a")
    with pytest.raises(ValueError, match="holds no token ids"):
        store.tokens("a")
    assert verify_store(tmp_path) == []
    # resuming it: with store_tokens=False only (the shards could not all hold tokens)
    with pytest.raises(ValueError) as e:
        TeacherStoreWriter(tmp_path, k=K, vocab_size=V, codec="exact")
    _names(str(e.value), "store_tokens", False, True)
    with TeacherStoreWriter(tmp_path, k=K, vocab_size=V, store_tokens=False,
                            codec="exact") as writer:
        writer.add("c", *_sequences([2], seed=3)[0][::2])
    assert sorted(TeacherStore(tmp_path).ids()) == ["a", "b", "c"]


def test_damaged_token_ids_caught_by_tokens_and_verify(tmp_path):
    seqs = _sequences([3, 4, 2], seed=4)
    _write(tmp_path, ["s0", "s1", "s2"], seqs)
    (name,) = _shards(tmp_path)
    file = os.path.join(tmp_path, name)
    n, header, raw = _header(file)
    data = bytearray(raw)
    data[8 + n + header["input_ids"]["data_offsets"][0] + 4 * 3] ^= 0x01  # s1's first token
    with open(file, "wb") as f:
        f.write(bytes(data))
    store = TeacherStore(tmp_path)
    with pytest.raises(ValueError, match=re.escape(file)) as e:
        store.tokens("s1")
    assert "'s1'" in str(e.value) and "token hash" in str(e.value)
    assert torch.equal(store.tokens("s0"), seqs[0][0])
    assert torch.equal(store.tokens("s2"), seqs[2][0])
    _assert_same_teacher(store.get("s1"), store.get("s1", seqs[1][0]))  # the rows are whole
    unchecked = TeacherStore(tmp_path, verify_reads=False).tokens("s1")
    assert not torch.equal(unchecked, seqs[1][0])
    problems = verify_store(tmp_path)
    assert len(problems) == 1 and file in problems[0] and "input_ids" in problems[0], problems

    # a consistent rewrite of the tensor and its SHA-256 is still caught by the token hash
    import topkd.store.format as fmt

    recorded = json.loads(header["__metadata__"]["sha256"])["input_ids"]
    good = torch.tensor(seqs[0][0].tolist() + seqs[1][0].tolist() + seqs[2][0].tolist(),
                        dtype=torch.int32)
    damaged = good.clone()
    damaged[3] ^= 1
    assert fmt.sha256(good) == recorded
    _rewrite_header(file, lambda text: text.replace(recorded, fmt.sha256(damaged)))
    problems = verify_store(tmp_path)
    assert len(problems) == 1 and "'s1'" in problems[0] and "token hash" in problems[0], problems


# -- 13. a store binds its settings with its first shard -------------------------------------


def test_failed_writer_binds_no_settings(tmp_path):
    seqs = _sequences([3, 2])
    with pytest.raises(RuntimeError, match="teacher crashed"):
        with TeacherStoreWriter(tmp_path, k=2 * K, vocab_size=V, logprob_dtype="float32"):
            raise RuntimeError("teacher crashed")
    assert not (tmp_path / MANIFEST).exists()
    with pytest.raises(FileNotFoundError, match="not a topkd teacher store"):
        TeacherStore(tmp_path)
    # another k and dtype into the same directory: accepted
    _write(tmp_path, ["a"], seqs[:1])
    store = TeacherStore(tmp_path)
    assert (store.k, store.manifest["codec"]) == (K, "compact") and store.ids() == ["a"]
    # a store holding a shard keeps its settings
    with pytest.raises(ValueError) as e:
        TeacherStoreWriter(tmp_path, k=2 * K, vocab_size=V)
    _names(str(e.value), "k", K, 2 * K)
    assert "delete" not in str(e.value)

    # rows added before the error are stored, so they bind the settings
    with pytest.raises(RuntimeError):
        with TeacherStoreWriter(tmp_path / "partial", k=K, vocab_size=V) as writer:
            writer.add("a", *seqs[0][::2])
            raise RuntimeError("later failure")
    assert TeacherStore(tmp_path / "partial").ids() == ["a"]

    # closed without an error, an empty writer makes an empty store, which binds
    TeacherStoreWriter(tmp_path / "empty", k=K, vocab_size=V).close()
    assert len(TeacherStore(tmp_path / "empty")) == 0 and verify_store(tmp_path / "empty") == []
    with pytest.raises(ValueError) as e:
        TeacherStoreWriter(tmp_path / "empty", k=2 * K, vocab_size=V)
    _names(str(e.value), "k", K, 2 * K)
    assert "delete " + str(tmp_path / "empty" / MANIFEST) in str(e.value)

    # shards without a manifest: refused, not adopted with this writer's settings
    (tmp_path / "orphan").mkdir()
    shard = open(os.path.join(tmp_path, _shards(tmp_path)[0]), "rb").read()
    (tmp_path / "orphan" / "shard-main-000000.safetensors").write_bytes(shard)
    with pytest.raises(ValueError, match="no manifest.json"):
        TeacherStoreWriter(tmp_path / "orphan", k=K, vocab_size=V)


def test_concurrent_writers_with_other_settings_cannot_both_win(tmp_path):
    seqs = _sequences([3, 2, 4])
    first = TeacherStoreWriter(tmp_path, k=K, vocab_size=V, name="first")
    second = TeacherStoreWriter(tmp_path, k=K - 2, vocab_size=V, name="second")
    same = TeacherStoreWriter(tmp_path, k=K, vocab_size=V, name="same")
    first.add("a", *seqs[0][::2])
    second.add("b", seqs[1][0], topkd.select_topk(seqs[1][1], K - 2))
    same.add("c", *seqs[2][::2])
    first.close()
    with pytest.raises(ValueError) as e:
        second.close()
    _names(str(e.value), "k", K, K - 2)
    assert second.closed
    with pytest.raises(ValueError, match="closed"):
        second.add("d", *seqs[0][::2])
    same.close()
    assert sorted(TeacherStore(tmp_path).ids()) == ["a", "c"] and verify_store(tmp_path) == []
    TeacherStoreWriter(tmp_path, k=K, vocab_size=V, name="second").close()  # lock released


# -- 14. errors that name the fix ------------------------------------------------------------


def test_missing_sample_id_names_the_store_and_an_example(tmp_path):
    seqs = _sequences([2, 3, 1])
    _write(tmp_path, [3, "x", "y"], seqs)
    store = TeacherStore(tmp_path)
    with pytest.raises(KeyError) as e:
        store.get("nope")
    message = str(e.value)
    assert isinstance(e.value, MissingSampleError) and not message.startswith(("'", '"'))
    for part in ("sample_id 'nope'", str(tmp_path), "3 ids, e.g. 3", "id field"):
        assert part in message, message
    assert "of type" not in message
    with pytest.raises(KeyError, match="the store has 3, of type int"):
        store.get("3")
    with pytest.raises(KeyError, match="sample_id 4 is not"):
        store.collate(["x", 4])
    empty = _write(tmp_path / "empty", [], []).path
    with pytest.raises(KeyError, match="it holds no samples"):
        TeacherStore(empty).get(0)


def test_require_keys_names_the_key_and_the_fix(tmp_path):
    require_keys({"sample_id": 1, "input_ids": [1]}, ("sample_id", "input_ids"), "here")
    with pytest.raises(ValueError) as e:
        require_keys({"input_ids": [1], "attention_mask": [1]}, ["sample_id", "input_ids"],
                     "KDTrainer's collator")
    message = str(e.value)
    for part in ("KDTrainer's collator:", "no 'sample_id'",
                 "['attention_mask', 'input_ids']", "remove_unused_columns=False"):
        assert part in message, message
    assert "'input_ids' among" not in message
    with pytest.raises(TypeError, match="expected a mapping"):
        require_keys([1, 2], ("sample_id",), "here")

    seqs = _sequences([2])
    _write(tmp_path, ["a"], seqs)
    with pytest.raises(ValueError, match="TeacherDataset sample 0: the item has no 'sample_id'"):
        TeacherDataset(tmp_path, [{"id": "a", "input_ids": seqs[0][0]}])[0]
    item = TeacherDataset(tmp_path)[0]
    del item["teacher"]
    with pytest.raises(ValueError, match="topkd.store.collate: the item has no 'teacher'"):
        collate([item])
