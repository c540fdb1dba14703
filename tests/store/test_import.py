"""Rows from serving engines: normalized top-k log-probs per position turned into teacher rows
(the ghost as log(1 - kept mass), in float64), and ``topkd store import`` of the JSON Lines
layout against a store built directly from the same logits."""

import json
import math

import pytest
import torch
from store_helpers import COMPACT_STEP

pytest.importorskip("safetensors")

import topkd  # noqa: E402
from topkd.cli import main  # noqa: E402
from topkd.store import TeacherStore, TeacherStoreWriter, verify_store  # noqa: E402
from topkd.store.serving import import_jsonl, teacher_from_logprobs  # noqa: E402

V, K = 5000, 16


# -- the ghost -------------------------------------------------------------------------------


def test_ghost_when_the_top_k_hold_all_but_1e_12():
    """One entry holds nearly everything: the ghost of 1e-12 comes out to float64 precision
    (not 1e-16 / 1e-12), and a store keeps it to float32's."""
    ghost, tail = 1e-12, 1e-15
    logprobs = [[math.log1p(-(ghost + 63 * tail))] + [math.log(tail)] * 63]
    teacher = teacher_from_logprobs([list(range(64))], logprobs, k=64, vocab_size=V)
    assert abs(math.exp(teacher.rest_logprob.double().item()) / ghost - 1) < 1e-6
    # the same mass spread over all 64 entries: float64's sum limits it to ~1e-16 absolute
    spread = 1e-9
    even = [[math.log((1 - spread) / 64)] * 64]
    teacher = teacher_from_logprobs([list(range(64))], even, k=64, vocab_size=V)
    assert abs(math.exp(teacher.rest_logprob.double().item()) / spread - 1) < 1e-5


def test_ghost_when_the_top_k_hold_5_percent():
    kept = [0.05 / 16] * 16
    teacher = teacher_from_logprobs([list(range(16))], [[math.log(p) for p in kept]], k=16,
                                    vocab_size=V)
    assert abs(teacher.rest_logprob.item() - math.log(0.95)) < 1e-7


@pytest.mark.parametrize("codec", ["exact", "compact"])
def test_stores_keep_the_ghost_as_given(tmp_path, codec):
    rows = [[math.log1p(-(1e-12 + 3e-15))] + [math.log(1e-15)] * 3,
            [math.log(0.05 / 4)] * 4]
    teacher = teacher_from_logprobs([[5, 6, 7, 8], [1, 2, 3, 4]], rows, k=4, vocab_size=V)
    with TeacherStoreWriter(tmp_path, k=4, vocab_size=V, codec=codec) as writer:
        writer.add("a", [10, 11], teacher)
    got = TeacherStore(tmp_path).get("a")
    assert torch.equal(got.rest_logprob, teacher.rest_logprob)
    torch.testing.assert_close(got.rest_logprob.double(),
                               torch.tensor([math.log(1e-12), math.log(0.95)],
                                            dtype=torch.float64), rtol=1e-7, atol=0)


def test_rows_are_ordered_cut_to_k_and_padded():
    # unordered, more than k (the cut one goes to the ghost), fewer than k, none
    ids = [[7, 3, 9], [4], []]
    logprobs = [[math.log(0.1), math.log(0.3), math.log(0.3)], [math.log(0.5)], []]
    teacher = teacher_from_logprobs(ids, logprobs, k=2, vocab_size=10)
    assert teacher.indices.tolist() == [[3, 9], [4, -1], [-1, -1]]
    assert teacher.logprobs[1, 1] == -math.inf and teacher.logprobs[2].isinf().all()
    torch.testing.assert_close(teacher.rest_logprob.double(),
                               torch.tensor([math.log(0.4), math.log(0.5), 0.0],
                                            dtype=torch.float64), rtol=1e-7, atol=1e-7)


@pytest.mark.parametrize("ids,logprobs,error,match", [
    ([[1, 10]], [[-1.0, -2.0]], ValueError, r"\[0, vocab_size=10\).*\[1, 10\] at position 0"),
    ([[1, 1]], [[-1.0, -2.0]], ValueError, r"repeat an id within a row at position 0"),
    ([[1], [2, 3]], [[-1.0], [-0.1, -0.2]], ValueError, r"position 1's probabilities sum to"),
    ([[1, 2]], [[-1.0, math.nan]], ValueError, r"must not be NaN"),
    ([[1, 2]], [[-1.0]], ValueError, r"position 0: 2 token_ids but 1 logprobs"),
    ([[1], [2]], [[-1.0]], ValueError, r"token_ids has 2 positions, logprobs 1"),
    ([[True]], [[-1.0]], TypeError, r"token_ids must be integers"),
])
def test_bad_rows_named(ids, logprobs, error, match):
    with pytest.raises(error, match=match):
        teacher_from_logprobs(ids, logprobs, k=2, vocab_size=10)


# -- import against a direct build -----------------------------------------------------------


def _sequences():
    g = torch.Generator().manual_seed(11)
    out = []
    for number, length in enumerate((6, 0, 9, 3)):
        tokens = torch.randint(0, V, (length,), generator=g)
        logits = torch.randn(length, V, generator=g) * 4
        out.append((f"doc-{number}", tokens, logits))
    return out


def _engine_rows(logits, extra=2):
    """What an engine returns per position: its top-(K + extra) log-probs (log-softmax in
    float32), as Python floats, most probable first (extras, as engines add the sampled
    token's, beyond K)."""
    values, ids = torch.log_softmax(logits, -1).topk(K + extra, -1)
    return ids.tolist(), values.tolist()


def _write_jsonl(path, sequences):
    with open(path, "w") as f:
        for sample_id, tokens, logits in sequences:
            ids, values = _engine_rows(logits)
            f.write(json.dumps({"id": sample_id, "input_ids": tokens.tolist(), "topk_ids": ids,
                                "topk_logprobs": values}) + "\n")


@pytest.mark.parametrize("codec", ["exact", "compact"])
def test_import_equals_a_direct_build(tmp_path, codec, capsys):
    sequences = _sequences()
    data = tmp_path / "rows.jsonl"
    _write_jsonl(data, sequences)
    imported, direct = tmp_path / "imported", tmp_path / "direct"
    args = ["store", "import", "--data", str(data), "--out", str(imported), "--k", str(K),
            "--vocab-size", str(V)] + (["--exact"] if codec == "exact" else [])
    assert main(args) == 0
    assert "added 4 sequences (18 tokens)" in capsys.readouterr().out
    with TeacherStoreWriter(direct, k=K, vocab_size=V, codec=codec) as writer:
        for sample_id, tokens, logits in sequences:
            writer.add(sample_id, tokens, topkd.select_topk(logits, K))
    a, b = TeacherStore(imported), TeacherStore(direct)
    assert a.manifest["codec"] == codec and verify_store(imported) == []
    for sample_id, tokens, _ in sequences:
        got, want = a.get(sample_id, tokens), b.get(sample_id, tokens)
        assert torch.equal(a.tokens(sample_id), tokens)
        assert torch.equal(got.indices.sort(-1).values, want.indices.sort(-1).values)
        # the ghost: log(1 - kept) from the engine's float32 log-probs (each within ~1e-7 of
        # the truth, so the kept mass within ~1e-6) against the direct log-sum-exp
        ghost = want.rest_logprob.double().exp()
        assert bool(((got.rest_logprob.double().exp() - ghost).abs() <= 2e-6).all())
        if codec == "exact":
            assert torch.equal(got.indices, want.indices)
            torch.testing.assert_close(got.logprobs, want.logprobs, rtol=0, atol=2e-6)
        else:  # to the codec's precision: a value at a rounding midpoint may go one step
            moved = (got.logprobs.sort(-1).values - want.logprobs.sort(-1).values).abs()
            assert bool((moved <= COMPACT_STEP + 1e-5).all())
            assert int((moved > 1e-5).sum()) <= max(1, moved.numel() // 50)
    # a rerun resumes: everything is stored already
    assert main(args) == 0
    assert "added 0 sequences (0 tokens), skipped 4" in capsys.readouterr().out


def test_import_names_the_line_of_a_bad_row(tmp_path, capsys):
    data = tmp_path / "rows.jsonl"
    good = {"input_ids": [1, 2], "topk_ids": [[3], [4]], "topk_logprobs": [[-1.0], [-2.0]]}
    bad = {"input_ids": [1, 2], "topk_ids": [[3]], "topk_logprobs": [[-1.0]]}
    data.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(ValueError, match=r"rows.jsonl:2: 2 input_ids but 1 rows of topk_ids"):
        import_jsonl(data, tmp_path / "out", k=2, vocab_size=10)
    data.write_text(json.dumps({"input_ids": [1]}) + "\n")
    out = tmp_path / "out2"
    assert main(["store", "import", "--data", str(data), "--out", str(out), "--k", "2",
                 "--vocab-size", "10"]) == 1
    assert "rows.jsonl:1: missing ['topk_ids', 'topk_logprobs']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["store", "import", "--data", str(data), "--out", str(out), "--k", "20",
              "--vocab-size", "10"])
    assert "--k: 20 is more than --vocab-size 10" in capsys.readouterr().err
