"""The trainer benchmark section (``python -m benchmarks trainer``): its options, and one
case run in this process at a tiny shape (KDTrainer fused, eager kernels)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("datasets")

from benchmarks import trainer  # noqa: E402

TINY = ["--vocab", "256", "--seq", "16", "--steps", "3", "--hidden", "32", "--intermediate",
        "32", "--teacher-hidden", "32", "--teacher-intermediate", "32"]


def test_options():
    args = trainer.build_parser().parse_args([])
    assert (args.vocab, args.seq, args.batch, args.hidden, args.layers) == (151_936, 1024, 1,
                                                                            256, 2)
    assert args.impl == ["fused", "unfused", "trl", "fused-fp32"] and args.kernels == ["compile"]
    assert args.runs == 1 and args.save is None
    args = trainer.build_parser().parse_args([*TINY, "--impl", "fused", "--kernels", "eager",
                                              "--runs", "2", "--save", "out.json"])
    assert (args.vocab, args.seq, args.steps, args.runs) == (256, 16, 3, 2)
    assert args.impl == ["fused"] and args.kernels == ["eager"] and args.save == "out.json"
    with pytest.raises(SystemExit):
        trainer.main([*TINY[:-8], "--steps", "2"])


def test_tiny_case():
    args = trainer.build_parser().parse_args(TINY)
    args.mem_limit_gib = 0
    r = trainer.run_case(args, "fused", "eager")
    assert r["status"] == "ok", r.get("message")
    assert len(r["losses"]) == 3 and r["learned_tokens"] == [15, 15, 15]
    assert r["step_peak_bytes"] > 0 and r["fwd_bwd_peak_bytes"] <= r["step_peak_bytes"]
    assert r["live_before"]["optimizer"] > 0 and r["tokens_per_s"] > 0
    rows = trainer.summarize_runs([r])
    table = trainer.format_table(rows, {
        **vars(args), "torch": r["torch"], "threads": r["threads"], "runs": 1})
    assert "KDTrainer (fused)" in table
