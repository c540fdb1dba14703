"""``topkd store build / info / verify``: a tiny Hugging Face teacher built in the test (no
downloads), run over JSON Lines, Parquet and text data; every stored teacher checked against the
same model run online."""

import json
import os
import shutil
import subprocess
import sys

import helpers
import pytest
import torch
from store_helpers import COMPACT_STEP, through_codec

pytest.importorskip("safetensors")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

import topkd  # noqa: E402
from topkd.cli import main  # noqa: E402
from topkd.store import (  # noqa: E402
    TeacherDataset,
    TeacherStore,
    build_store,
    tokenizer_fingerprint,
    verify_store,
)
from topkd.store.reader import read_shard_ids  # noqa: E402

ROOT = helpers.ROOT
VOCAB = 300  # the model's vocabulary; the tokenizer has fewer tokens (as Qwen's, padded)
WORDS = [f"w{i}" for i in range(200)]
K = 16


def _tokenizer(words):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["[UNK]", "[PAD]", *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]")


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """A 1-layer Llama (float32) and a word-level tokenizer, saved to one directory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = str(tmp_path_factory.mktemp("teacher"))
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, intermediate_size=64,
                         max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(1234)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # a peaked teacher, so top-p cuts rows below K
        model.lm_head.weight.mul_(40.0)
    model.save_pretrained(path)
    tokenizer = _tokenizer(WORDS)
    tokenizer.save_pretrained(path)
    return path, model, tokenizer


def _text(rng, n):
    return " ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (n,), generator=rng))


def _run(argv, capsys):
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def _build(teacher_dir, data, out, *extra):
    return ["store", "build", "--teacher", teacher_dir, "--data", str(data), "--k", str(K),
            "--out", str(out), "--no-progress", *extra]


def _online(model, ids):
    """The teacher's logits for one sequence, run alone (no padding, no batch)."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]


def _check_against_online(store_dir, model, samples, *, top_p=None, top_p_min_k=1,
                          temperature=1.0, low=None):
    """For every sample: the stored teacher, read with its token ids, gives the student the
    loss the online teacher gives (float32 storage: to float32 rounding; ``low`` (bfloat16 or
    float16) storage: against the online teacher's log-probs rounded to ``low``)."""
    store = TeacherStore(store_dir, vocab_size=VOCAB, k=K, temperature=temperature)
    assert set(store.ids()) == set(samples)
    options = {"top_p": top_p, "top_p_min_k": top_p_min_k, "temperature": temperature}
    for sample_id, ids in samples.items():
        stored = store.get(sample_id, ids)
        if store.store_tokens:  # the tokens the teacher saw, as the data gave them
            assert store.tokens(sample_id).tolist() == ids, sample_id
        student = torch.randn(len(ids), VOCAB) * 3
        if not ids:
            assert stored.indices.shape == (0, K) and stored.rest_logprob.shape == (0,)
            assert topkd.sparse_kl_loss(student, stored).shape == (0,)
            continue
        logits = _online(model, ids)
        online = topkd.select_topk(logits, K, vocab_size=VOCAB, **options)
        loss = topkd.sparse_kl_loss(student, stored)
        if low == "compact":
            # the online teacher through the codec; the batched forward may differ from this
            # unbatched one by float32 rounding, which can move a log-prob lying that close to
            # a rounding midpoint one step
            coded = through_codec(online, "compact")
            assert torch.equal(stored.indices.sort(-1).values, coded.indices.sort(-1).values)
            torch.testing.assert_close(stored.rest_logprob, coded.rest_logprob, rtol=1e-5,
                                       atol=1e-6)
            moved = (stored.logprobs.sort(-1).values - coded.logprobs.sort(-1).values).abs()
            finite = torch.isfinite(coded.logprobs.sort(-1).values)
            assert bool((moved[finite] <= COMPACT_STEP + 1e-5).all()), sample_id
            assert int((moved[finite] > 1e-5).sum()) <= max(1, int(finite.sum()) // 100)
            expected = topkd.sparse_kl_loss(student, coded)
            torch.testing.assert_close(loss, expected, rtol=1e-3, atol=1e-5)
            continue
        assert torch.equal(stored.indices, online.indices), sample_id
        torch.testing.assert_close(stored.rest_logprob, online.rest_logprob, rtol=1e-5,
                                   atol=1e-6)
        if low is not None:
            # each stored log-prob is the online one rounded to ``low``; the batched forward
            # may differ from this unbatched one by float32 rounding (~1e-7), which can only
            # flip a value lying that close to a rounding midpoint to the other neighbour
            assert stored.logprobs.dtype == torch.float32
            rounded = online.logprobs.to(low).float()
            flipped = stored.logprobs != rounded
            to_stored = (stored.logprobs - online.logprobs).abs()[flipped]
            to_rounded = (rounded - online.logprobs).abs()[flipped]
            assert bool(((to_stored - to_rounded).abs() < 1e-5).all()), sample_id
            assert int(flipped.sum()) <= max(1, flipped.numel() // 100)
            rounded = topkd.SparseTeacher(online.indices,
                                          torch.where(flipped, stored.logprobs, rounded),
                                          online.rest_logprob, temperature, VOCAB)
            expected = topkd.sparse_kl_loss(student, rounded)
        else:
            torch.testing.assert_close(stored.logprobs, online.logprobs, rtol=1e-5, atol=1e-6)
            expected = topkd.topk_kl_loss(student, logits, K, vocab_size=VOCAB, **options)
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    return store


def _contents(path):
    """Every file of a store but the writers' lock files: name -> bytes."""
    result = {}
    for name in sorted(os.listdir(path)):
        if not name.startswith(".writer-"):
            with open(os.path.join(path, name), "rb") as f:
                result[name] = f.read()
    return result


def test_jsonl_text_float32_info_verify(teacher, tmp_path, capsys):
    path, model, tokenizer = teacher
    rng = torch.Generator().manual_seed(0)
    rows = [{"id": "a", "text": _text(rng, 9)}, {"id": "empty", "text": ""},
            {"text": _text(rng, 4) + " unknownword"}, None, {"id": 7, "text": _text(rng, 23)},
            {"id": "b", "text": _text(rng, 1), "other": [1, 2]}]
    data = tmp_path / "data.jsonl"
    data.write_text("".join("\n" if r is None else json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "store"

    code, stdout, _ = _run(_build(path, data, out, "--logprob-dtype", "float32",
                                  "--batch-size", "3"), capsys)
    assert code == 0 and "added 5 sequences" in stdout
    # default id: the 0-based line number (the blank line 3 is skipped but counted)
    samples = {r.get("id", i): tokenizer(r["text"])["input_ids"]
               for i, r in enumerate(rows) if r is not None}
    assert list(samples) == ["a", "empty", 2, 7, "b"] and samples["empty"] == []
    tokens = sum(map(len, samples.values()))

    code, stdout, _ = _run(["store", "info", str(out)], capsys)
    assert code == 0
    assert "sequences: 5\n" in stdout and f"tokens: {tokens}\n" in stdout
    assert "shards: 1\n" in stdout and "bytes per token: " in stdout
    assert "token ids stored: yes\n" in stdout
    assert '"k": 16' in stdout and '"logprob_dtype": "float32"' in stdout
    code, stdout, _ = _run(["store", "info", "--json", str(out)], capsys)
    info = json.loads(stdout)
    manifest = info["manifest"]
    assert info["sequences"] == 5 and info["tokens"] == tokens and info["shards"] == 1
    assert info["store_tokens"] is True and manifest["store_tokens"] is True
    assert info["bytes"] == sum(os.path.getsize(out / f) for f in os.listdir(out)
                                if f.startswith("shard-"))
    assert info["bytes_per_token"] == pytest.approx(info["bytes"] / tokens)
    assert manifest["vocab_size"] == VOCAB and manifest["top_p"] is None
    assert manifest["tokenizer_fingerprint"] == tokenizer_fingerprint(tokenizer)
    assert manifest["metadata"]["model_type"] == "llama"
    assert manifest["metadata"]["teacher"] == os.path.basename(path)
    assert manifest["metadata"]["data"] == "data.jsonl"
    assert manifest["metadata"]["max_length"] is None

    code, stdout, _ = _run(["store", "verify", str(out)], capsys)
    assert code == 0 and stdout.strip() == "ok: 5 sequences, 1 shards"
    store = _check_against_online(out, model, samples)
    assert store.store_tokens
    # training needs only the store: its samples with their stored tokens
    dataset = TeacherDataset(out)
    assert [item["sample_id"] for item in dataset] == store.ids()
    for item in dataset:
        assert item["input_ids"].tolist() == samples[item["sample_id"]]


def test_jsonl_token_ids_bfloat16_truncated(teacher, tmp_path, capsys):
    path, model, _ = teacher
    rng = torch.Generator().manual_seed(1)
    lists = [torch.randint(0, VOCAB, (n,), generator=rng).tolist() for n in (5, 0, 20, 12, 1)]
    data = tmp_path / "ids.jsonl"
    data.write_text("".join(json.dumps({"input_ids": ids}) + "\n" for ids in lists))
    out = tmp_path / "store"
    code, _, _ = _run(_build(path, data, out, "--max-length", "12", "--batch-size", "2",
                             "--logprob-dtype", "bfloat16"), capsys)
    assert code == 0
    store = TeacherStore(out)
    assert store.manifest["logprob_dtype"] == "bfloat16"
    assert store.manifest["metadata"]["max_length"] == 12
    assert store.num_tokens() == 5 + 0 + 12 + 12 + 1
    with pytest.raises(ValueError, match="token hash differs"):
        store.get(2, lists[2])  # stored truncated to 12 tokens
    _check_against_online(out, model, {i: ids[:12] for i, ids in enumerate(lists)},
                          low=torch.bfloat16)


def test_text_file_top_p_variable_k(teacher, tmp_path, capsys):
    path, model, tokenizer = teacher
    rng = torch.Generator().manual_seed(2)
    lines = [_text(rng, 15), "", _text(rng, 30), _text(rng, 3)]
    data = tmp_path / "data.txt"
    data.write_text("\n".join(lines) + "\n")
    out = tmp_path / "store"
    code, _, _ = _run(_build(path, data, out, "--top-p", "0.8", "--top-p-min-k", "2",
                             "--temperature", "1.5", "--logprob-dtype", "float32"), capsys)
    assert code == 0
    samples = {i: tokenizer(line)["input_ids"] for i, line in enumerate(lines)}
    store = _check_against_online(out, model, samples, top_p=0.8, top_p_min_k=2,
                                  temperature=1.5)
    counts = torch.cat([(store.get(i).indices >= 0).sum(-1) for i in samples])
    assert counts.min() >= 2 and counts.min() < K and len(set(counts.tolist())) > 2
    assert store.manifest["top_p"] == 0.8 and store.manifest["top_p_min_k"] == 2
    assert verify_store(out) == []


def test_parquet_and_tokenizer_fingerprint(teacher, tmp_path, capsys):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path, model, tokenizer = teacher
    rng = torch.Generator().manual_seed(3)
    ids = [f"doc-{i}" for i in range(4)]
    texts = [_text(rng, n) for n in (6, 11, 0, 8)]
    data = tmp_path / "data.parquet"
    pq.write_table(pa.table({"doc": ids, "body": texts, "n": [1, 2, 3, 4]}), data)
    out = tmp_path / "store"
    code, _, _ = _run(_build(path, data, out, "--text-field", "body", "--id-field", "doc"),
                      capsys)
    assert code == 0
    samples = {i: tokenizer(t)["input_ids"] for i, t in zip(ids, texts, strict=True)}
    assert TeacherStore(out).manifest["codec"] == "compact"  # the default
    _check_against_online(out, model, samples, low="compact")

    # read with another tokenizer's fingerprint: refused, naming both values
    other = _tokenizer([f"x{i}" for i in range(200)])
    assert tokenizer_fingerprint(other) != tokenizer_fingerprint(tokenizer)
    TeacherStore(out, tokenizer_fingerprint=tokenizer_fingerprint(tokenizer))
    with pytest.raises(ValueError, match="tokenizer_fingerprint"):
        TeacherStore(out, tokenizer_fingerprint=tokenizer_fingerprint(other))
    # and building into it with a teacher directory holding another tokenizer: refused too
    other_dir = tmp_path / "other-teacher"
    shutil.copytree(path, other_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        os.unlink(other_dir / name)
    other.save_pretrained(other_dir)
    before = _contents(out)
    code, _, err = _run(_build(str(other_dir), data, out, "--text-field", "body",
                               "--id-field", "doc"), capsys)
    assert code == 1 and "tokenizer_fingerprint" in err
    assert _contents(out) == before


def test_resume(teacher, tmp_path, capsys):
    path, model, tokenizer = teacher
    rng = torch.Generator().manual_seed(4)
    texts = [_text(rng, n) for n in (7, 3, 12, 0, 5, 9)]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    out = tmp_path / "store"
    # a shard per sequence with rows (the empty one, 0 bytes, shares the next one's)
    options = {"k": K, "batch_size": 4, "shard_bytes": 1, "progress": False}

    first = build_store(path, data, out, **options)
    assert (first["added"], first["skipped"], first["tokens"]) == (6, 0, 36)
    before = _contents(out)
    shards = sorted(n for n in before if n.startswith("shard-"))
    assert [read_shard_ids(str(out), n) for n in shards] == [[0], [1], [2], [3, 4], [5]]

    second = build_store(path, data, out, **options)  # nothing to do, nothing changes
    assert (second["added"], second["skipped"], second["tokens"]) == (0, 6, 0)
    assert _contents(out) == before

    samples = {i: tokenizer(t)["input_ids"] for i, t in enumerate(texts)}
    store = TeacherStore(out)
    lost = shards[3]
    lost_ids = [3, 4]
    kept = {i: store.get(i) for i in lost_ids}
    os.unlink(out / lost)
    third = build_store(path, data, out, **options)
    assert (third["added"], third["skipped"]) == (len(lost_ids), 6 - len(lost_ids))
    after = _contents(out)
    new = set(after) - set(before)
    assert set(before) - set(after) == {lost} and len(new) == 1
    assert read_shard_ids(str(out), new.pop()) == lost_ids
    store = TeacherStore(out)
    for i in lost_ids:  # the same rows again (to float32 rounding: another batch)
        again = store.get(i, samples[i])
        assert torch.equal(again.indices, kept[i].indices)
        torch.testing.assert_close(again.logprobs, kept[i].logprobs, rtol=0, atol=1e-5)
    assert verify_store(out) == [] and len(store) == 6

    # resuming with another truncation would mix targets: refused
    code, _, err = _run(_build(path, data, out, "--max-length", "4"), capsys)
    assert code == 1 and "max_length" in err


def test_cli_errors(teacher, tmp_path, capsys):
    path, _, _ = teacher
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"text": "w1 w2"}) + "\n")
    out = tmp_path / "store"

    def usage_error(argv, message):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "usage:" in err and message in err, err

    usage_error(["store", "build", "--teacher", path, "--data", str(data), "--out", str(out)],
                "one of the arguments --k --samples is required")
    usage_error(_build(path, data, out, "--k", "0"), "argument --k: must be >= 1")
    usage_error(_build(path, data, out, "--top-p", "1.5"), "--top-p must be in (0.0, 1.0]")
    usage_error(_build(path, data, out, "--temperature", "0"), "--temperature must be in")
    usage_error(_build(path, data, out, "--logprob-dtype", "int8"), "invalid choice")
    usage_error(_build(str(tmp_path / "nope"), data, out), "is not a directory")
    usage_error(_build(path, tmp_path / "nope.jsonl", out), "is not a file")
    csv = tmp_path / "data.csv"
    csv.write_text("text\nw1\n")
    usage_error(_build(path, csv, out), "unknown format")
    usage_error(["store", "frobnicate"], "invalid choice")
    assert not out.exists()

    # errors found by the build itself: exit 1, one line, no traceback, nothing stored
    code, _, err = _run(_build(path, data, out, "--k", "1000"), capsys)
    assert code == 1 and err.startswith("topkd store build: error: k must be in [1, 300]")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "w1"}) + "\n" + json.dumps({"body": "w2"}) + "\n")
    code, _, err = _run(_build(path, bad, tmp_path / "s2"), capsys)
    assert code == 1 and "bad.jsonl:2: no text field 'text'" in err
    bad.write_text(json.dumps({"id": 1, "text": "w1"}) + "\n" +
                   json.dumps({"id": 1, "text": "w2"}) + "\n")
    code, _, err = _run(_build(path, bad, tmp_path / "s3"), capsys)
    assert code == 1 and "sample id 1 appears twice" in err
    bad.write_text(json.dumps({"input_ids": [1, VOCAB]}) + "\n")
    code, _, err = _run(_build(path, bad, tmp_path / "s4"), capsys)
    assert code == 1 and f"token id {VOCAB}, outside" in err

    # a teacher directory without a tokenizer: token ids only
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in os.listdir(path):
        if not name.startswith("tokenizer"):
            shutil.copy(os.path.join(path, name), bare / name)
    code, _, err = _run(_build(str(bare), data, tmp_path / "s5"), capsys)
    assert code == 1 and "has no tokenizer" in err
    ids = tmp_path / "ids.jsonl"
    ids.write_text(json.dumps({"input_ids": [3, 4, 5]}) + "\n")
    code, _, _ = _run(_build(str(bare), ids, tmp_path / "s6"), capsys)
    assert code == 0 and TeacherStore(tmp_path / "s6").manifest["tokenizer_fingerprint"] is None

    # info / verify on something that is not a store
    code, _, err = _run(["store", "info", str(tmp_path)], capsys)
    assert code == 1 and "is not a topkd teacher store" in err
    code, stdout, _ = _run(["store", "verify", str(tmp_path)], capsys)
    assert code == 1 and "is not a topkd teacher store" in stdout


def _shard(path):
    """A shard's header metadata and each array's bytes (the header's key order varies from
    one writing process to another, so the files' bytes may differ)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        return handle.metadata(), {name: handle.get_tensor(name).view(torch.uint8).tolist()
                                   for name in handle.keys()}


def test_entry_point_subprocess(teacher, tmp_path):
    """``python -m topkd store verify`` as a real process: 0 on a whole store, 1 and the
    damaged shard named when one byte changes."""
    path, _, _ = teacher
    data = tmp_path / "data.txt"
    data.write_text("w1 w2 w3\nw4\n")
    out = tmp_path / "store"
    build_store(path, data, out, k=K, progress=False)
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}

    def verify():
        return subprocess.run([sys.executable, "-m", "topkd", "store", "verify", str(out)],
                              capture_output=True, text=True, env=env, cwd=tmp_path,
                              timeout=120)

    result = verify()
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok: 2 sequences, 1 shards"
    shard = next(n for n in os.listdir(out) if n.startswith("shard-"))
    with open(out / shard, "r+b") as f:
        f.seek(-3, os.SEEK_END)
        byte = f.read(1)
        f.seek(-3, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0x10]))
    result = verify()
    assert result.returncode == 1 and shard in result.stdout


def test_torchrun_two_ranks(teacher, tmp_path):
    """WORLD_SIZE=2 as torchrun sets it, four builds in one pair of ranks:

    1. each rank starts a gloo group, takes samples i % 2 == rank and writes its own shards;
       together they hold every sample once;
    2. ``--shard-teacher`` (FSDP2 over the two ranks, in a group the script started): the
       same shards, byte for byte; rank 0 has two batches, rank 1 one (and an empty sequence
       in a batch), so rank 1 runs a dummy forward;
    3. resumed with two more samples: rank 1's one batch holds only an empty sequence, so both
       ranks' batches differ in kind (a forward, a dummy one);
    4. a bad token id in rank 1's second batch: both ranks stop at that step, rank 1 naming
       the sample, rank 0 naming rank 1 (no hang)."""
    path, model, tokenizer = teacher
    rng = torch.Generator().manual_seed(5)
    texts = [_text(rng, n) for n in (4, 6, 0, 3, 8, 0, 5)]

    def jsonl(name, rows):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        return tmp_path / name

    first = jsonl("data.jsonl", [{"id": f"s{i}", "text": t} for i, t in enumerate(texts[:5])])
    more = jsonl("more.jsonl", [{"id": f"s{i}", "text": t} for i, t in enumerate(texts)])
    bad = jsonl("bad.jsonl", [{"id": f"b{i}", "input_ids": [2, 3, 4][:i] + [999] * (i == 5)}
                              for i in range(6)])
    out, sharded = tmp_path / "store", tmp_path / "sharded"
    options = ("--device", "cpu", "--logprob-dtype", "float32", "--batch-size", "2")
    argvs = [_build(path, first, out, *options),
             _build(path, first, sharded, *options, "--shard-teacher"),
             _build(path, more, sharded, *options, "--shard-teacher"),
             _build(path, bad, tmp_path / "bad", *options, "--shard-teacher")]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(helpers.free_port()),
           "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, os.path.join(ROOT, "tests", "store_worker.py"), "builds",
               str(tmp_path), json.dumps(argvs)]
    ranks = [subprocess.Popen(command, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=tmp_path) for r in range(2)]
    try:
        results = [p.communicate(timeout=180) for p in ranks]
    finally:
        for p in ranks:
            p.kill()
    for p, (_, stderr) in zip(ranks, results, strict=True):
        assert p.returncode == 0, stderr
    builds = [[json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
              for stdout, _ in results]
    assert [len(b) for b in builds] == [4, 4], results
    for rank, rank_builds in enumerate(builds):
        for number, build in enumerate(rank_builds[:3]):
            assert build["code"] == 0, (rank, number, build["err"])
            assert ("teacher sharded over 2 ranks" in build["out"]) == (number > 0)
    (zero, one) = builds
    assert "rank 0: added 3 sequences" in zero[0]["out"]
    assert "rank 1: added 2 sequences" in one[0]["out"]
    shards = sorted(n for n in os.listdir(out) if n.startswith("shard-"))
    assert shards == ["shard-rank00000-000000.safetensors", "shard-rank00001-000000.safetensors"]
    assert read_shard_ids(str(out), shards[0]) == ["s0", "s2", "s4"]
    assert read_shard_ids(str(out), shards[1]) == ["s1", "s3"]
    samples = {f"s{i}": tokenizer(t)["input_ids"] for i, t in enumerate(texts)}
    _check_against_online(out, model, dict(list(samples.items())[:5]))
    # the sharded teacher's rows: the unsharded build's, bit for bit
    for name in shards:
        assert _shard(sharded / name) == _shard(out / name), name
    assert "rank 0: added 1 sequences" in zero[2]["out"] and "skipped 3" in zero[2]["out"]
    assert "rank 1: added 1 sequences" in one[2]["out"] and "skipped 2" in one[2]["out"]
    _check_against_online(sharded, model, samples)
    assert zero[3]["code"] == one[3]["code"] == 1
    assert "sample 'b5' has token id 999" in one[3]["err"], one[3]["err"]
    assert "rank 1 of the sharded teacher's build failed" in zero[3]["err"], zero[3]["err"]


def test_sharded_teacher_read_by_rank_zero_alone(teacher, tmp_path):
    """``--shard-teacher``'s load (the torchrun test checks that no other rank reads the
    checkpoint): a failed load on rank 0, or a model another rank's config does not make,
    stops every rank with a message, not a hang; the sharded logits are the unsharded ones."""
    import store_worker

    helpers.spawn_ranks(store_worker.sharded_load_failures, 2, (2, teacher[0], tmp_path),
                        tmp_path, deadline_s=180)


def test_resume_refuses_another_checkpoint_of_the_same_name(teacher, tmp_path, capsys):
    """Two checkpoints in directories of one name (run-a/final, run-b/final): the second
    build into the first's store is refused by the teacher fingerprint."""
    path, model, _ = teacher
    first, second = tmp_path / "run-a" / "final", tmp_path / "run-b" / "final"
    shutil.copytree(path, first)
    shutil.copytree(path, second)
    changed = type(model)(model.config)
    changed.load_state_dict(model.state_dict())
    with torch.no_grad():
        changed.lm_head.weight.add_(1.0)
    changed.save_pretrained(second)
    data = tmp_path / "ids.jsonl"
    data.write_text("".join(json.dumps({"input_ids": [i, i + 1, i + 2]}) + "\n"
                            for i in range(4)))
    out = tmp_path / "store"
    assert _run(_build(str(first), data, out), capsys)[0] == 0
    before = _contents(out)
    data.write_text(data.read_text() + json.dumps({"input_ids": [7, 8]}) + "\n")
    code, _, err = _run(_build(str(second), data, out), capsys)
    assert code == 1 and "teacher_fingerprint" in err, err
    assert _contents(out) == before


def test_build_checks_settings_before_loading_the_teacher(tmp_path):
    data = tmp_path / "ids.jsonl"
    data.write_text(json.dumps({"input_ids": [1, 2]}) + "\n")
    # the teacher directory does not even exist: the settings are refused first
    for options, name in (({"temperature": -1.0}, "temperature"), ({"top_p": 2.0}, "top_p"),
                          ({"shard_bytes": 0}, "shard_bytes")):
        with pytest.raises(ValueError, match=name):
            topkd.store.build_store(tmp_path / "missing", data, tmp_path / "out", k=4,
                                    **options)
    with pytest.raises(TypeError, match="shard_teacher must be a bool"):
        topkd.store.build_store(tmp_path / "missing", data, tmp_path / "out", k=4,
                                shard_teacher="yes")


def test_sharded_teacher_layers(teacher):
    """``--shard-teacher`` wraps the model's decoder layers (``_no_split_modules``) one by one;
    a model naming none is refused."""
    from topkd.store.sharded_teacher import decoder_layers

    _, model, _ = teacher
    assert decoder_layers(model) == list(model.model.layers)
    with pytest.raises(ValueError, match="names no decoder layer class"):
        decoder_layers(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_no_tokens(teacher, tmp_path, capsys):
    path, model, tokenizer = teacher
    rng = torch.Generator().manual_seed(6)
    texts = [_text(rng, n) for n in (5, 9, 2)]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    out, full = tmp_path / "store", tmp_path / "full"
    assert _run(_build(path, data, out, "--no-tokens"), capsys)[0] == 0
    assert _run(_build(path, data, full), capsys)[0] == 0
    samples = {i: tokenizer(t)["input_ids"] for i, t in enumerate(texts)}
    store = _check_against_online(out, model, samples, low="compact")
    assert not store.store_tokens
    with pytest.raises(ValueError, match="holds no token ids"):
        store.tokens(0)
    tokens = sum(map(len, samples.values()))
    assert TeacherStore(full).nbytes() - store.nbytes() >= 4 * tokens
    code, stdout, _ = _run(["store", "info", str(out)], capsys)
    assert code == 0 and "token ids stored: no\n" in stdout
    # resuming it with tokens would leave some sequences without: refused
    before = _contents(out)
    code, _, err = _run(_build(path, data, out), capsys)
    assert code == 1 and "store_tokens=False" in err and "store_tokens=True" in err, err
    assert _contents(out) == before


def test_failed_build_binds_no_settings(teacher, tmp_path, capsys, monkeypatch):
    """A k=32 build that fails before storing anything, then a k=16 build into the same
    directory: accepted. After a build that stored something, another k is refused."""
    path, model, _ = teacher
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"input_ids": [1, VOCAB]}) + "\n" +
                   json.dumps({"input_ids": [3, 4]}) + "\n")
    out = tmp_path / "store"
    code, _, err = _run(_build(path, bad, out, "--k", "32"), capsys)  # (the last --k wins)
    assert code == 1 and f"token id {VOCAB}, outside" in err
    assert not os.path.exists(out / "manifest.json")
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"input_ids": [1, 2, 3]}) + "\n")
    # a teacher that fails on the first batch, from the API
    import topkd.store.build

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("out of memory")

    with monkeypatch.context() as patch:
        patch.setattr(topkd.store.build, "_teachers", out_of_memory)
        with pytest.raises(RuntimeError, match="out of memory"):
            build_store(path, good, out, k=32, progress=False)
    assert not os.path.exists(out / "manifest.json")

    code, stdout, err = _run(_build(path, good, out), capsys)
    assert code == 0 and "added 1 sequences" in stdout, err
    assert TeacherStore(out).k == K
    _check_against_online(out, model, {0: [1, 2, 3]}, low="compact")
    before = _contents(out)
    code, _, err = _run(_build(path, good, out, "--k", "32"), capsys)
    assert code == 1 and "k=16" in err and "k=32" in err, err
    assert _contents(out) == before


def test_padding_free_build_stores_the_padded_rows(teacher, tmp_path, capsys, monkeypatch):
    """--padding-free runs each batch packed in one row (position_ids restarting at each
    sequence): every sequence's rows are those of the padded build (float32 storage: indices
    equal, log-probs to 1e-6), and the online teacher's. A teacher whose attention lets packed
    sequences see each other is refused before the first batch, its implementation named."""
    path, model, tokenizer = teacher
    rng = torch.Generator().manual_seed(7)
    texts = [_text(rng, n) for n in (9, 0, 23, 4, 1, 15, 6)]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    stores = {}
    for name, extra in (("padded", ()), ("packed", ("--padding-free",))):
        out = tmp_path / name
        code, stdout, err = _run(_build(path, data, out, "--logprob-dtype", "float32",
                                        "--batch-size", "3", *extra), capsys)
        assert code == 0 and "added 7 sequences" in stdout, err
        stores[name] = TeacherStore(out)
    assert stores["packed"].manifest["metadata"]["padding_free"] is True
    samples = {i: tokenizer(t)["input_ids"] for i, t in enumerate(texts)}
    for i, ids in samples.items():
        padded, packed = stores["padded"].get(i, ids), stores["packed"].get(i, ids)
        assert torch.equal(packed.indices, padded.indices), i
        torch.testing.assert_close(packed.logprobs, padded.logprobs, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(packed.rest_logprob, padded.rest_logprob, rtol=1e-6,
                                   atol=1e-6)
    _check_against_online(tmp_path / "packed", model, samples)

    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    import topkd.store.build

    AttentionInterface.register("causal_only", sdpa_attention_forward)
    load = topkd.store.build._load_model

    def causal_only(*args, **kwargs):
        model = load(*args, **kwargs)
        model.set_attn_implementation("causal_only")
        return model

    monkeypatch.setattr(topkd.store.build, "_load_model", causal_only)
    code, _, err = _run(_build(path, data, tmp_path / "refused", "--padding-free"), capsys)
    assert code == 1 and "'causal_only'" in err and "packed sequences apart" in err, err
    assert not os.path.exists(tmp_path / "refused" / "manifest.json")
    code, _, err = _run(_build(path, data, tmp_path / "padded-again"), capsys)  # padded: runs
    assert code == 0, err


def test_sampled_build_draws_per_sample_id(teacher, tmp_path, capsys):
    """``--samples N --seed S``: each sequence's rows are ``sample_teacher`` of its own online
    logits with sample id and seed, whatever the batch size; the store verifies and a resumed
    build with another seed is refused."""
    path, model, tokenizer = teacher
    rng = torch.Generator().manual_seed(3)
    rows = [{"id": f"q{i}", "text": _text(rng, n)} for i, n in enumerate((7, 0, 15, 3))]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    stores = []
    for batch in (1, 3):
        out = tmp_path / f"store{batch}"
        argv = ["store", "build", "--teacher", path, "--data", str(data), "--samples", "12",
                "--seed", "5", "--temperature", "1.5", "--out", str(out), "--no-progress",
                "--batch-size", str(batch)]
        code, stdout, _ = _run(argv, capsys)
        assert code == 0 and "added 4 sequences" in stdout
        stores.append(TeacherStore(out))
    code, stdout, _ = _run(["store", "verify", str(tmp_path / "store3")], capsys)
    assert code == 0
    code, stdout, _ = _run(["store", "info", str(tmp_path / "store3")], capsys)
    assert '"kind": "sampled"' in stdout and '"samples": 12' in stdout
    for row in rows:
        ids = tokenizer(row["text"])["input_ids"]
        got = [s.get(row["id"], ids) for s in stores]
        assert torch.equal(got[0].indices, got[1].indices)
        assert torch.equal(got[0].counts, got[1].counts)
        if ids:
            want = topkd.sample_teacher(_online(model, ids)[None], 12, temperature=1.5, seed=5,
                                        sample_ids=[row["id"]], vocab_size=VOCAB)
            assert torch.equal(got[0].indices[:, :want.k], want.indices[0, :, :got[0].k])
    code, _, err = _run(["store", "build", "--teacher", path, "--data", str(data), "--samples",
                         "12", "--seed", "6", "--temperature", "1.5", "--out",
                         str(tmp_path / "store3"), "--no-progress"], capsys)
    assert code != 0 and "seed" in err
    with pytest.raises(SystemExit):  # argparse: --k and --samples exclude each other
        main(["store", "build", "--teacher", path, "--data", str(data), "--samples", "12",
              "--k", "4", "--out", str(tmp_path / "x")])
