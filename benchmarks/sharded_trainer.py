"""The Python side of ``benchmarks/gpu_trainer.sh``: ``topkd distill`` runs of ``KDTrainer``
under DDP, FSDP2 (``--fsdp``) and DeepSpeed ZeRO-3 (``--deepspeed``), each with its loss curve
and every rank's peak memory. Three commands, ``python -m benchmarks.sharded_trainer ...``:

``setup DIR [sizes]``
    a student and a teacher (``LlamaForCausalLM``, random init from a config: nothing
    downloaded; untied heads; the teacher initialized wider, ``initializer_range`` 0.1, so the
    divergence is far from 0) saved in ``DIR/student`` and ``DIR/teacher``; ``DIR/train.jsonl``
    (random ``input_ids``, no tokenizer: the vocabulary is the heads' width); ``DIR/zero3.json``
    (ZeRO stage 3, every other setting ``"auto"``: the Trainer's batch sizes, accumulation,
    clipping, precision, optimizer and scheduler).
``run RECORD -- DISTILL_ARGS...``
    one rank (under ``torchrun``) of ``topkd distill DISTILL_ARGS``, then ``RECORD-rank<r>.json``:
    this rank's peak memory over the whole run (``torch.cuda.max_memory_allocated``; none on the
    CPU) and, on rank 0, the run's log (``loss`` and ``kd`` at each logged step, from the last
    checkpoint's ``trainer_state.json``) and its wall time.
``summary RECORD...``
    one line per run: the ranks' peaks, the steps' time, the first and last logged KD, and the
    largest relative difference of its KD curve from the first run's of the same world size.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time

ZERO3 = {"zero_optimization": {"stage": 3}, "bf16": {"enabled": "auto"},
         "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
         "gradient_accumulation_steps": "auto", "gradient_clipping": "auto"}


def setup(args) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    def model(hidden, layers, seed, init):
        config = LlamaConfig(vocab_size=args.vocab, hidden_size=hidden,
                             intermediate_size=4 * hidden, num_hidden_layers=layers,
                             num_attention_heads=hidden // 64,
                             num_key_value_heads=max(1, hidden // 128),
                             max_position_embeddings=max(args.seq, 128),
                             tie_word_embeddings=False, initializer_range=init)
        torch.manual_seed(seed)
        return LlamaForCausalLM(config)

    os.makedirs(args.dir, exist_ok=True)
    model(args.hidden, args.layers, 0, 0.02).save_pretrained(os.path.join(args.dir, "student"))
    model(args.teacher_hidden, args.teacher_layers, 1, 0.1).save_pretrained(
        os.path.join(args.dir, "teacher"))
    g = torch.Generator().manual_seed(2)
    with open(os.path.join(args.dir, "train.jsonl"), "w") as f:
        for _ in range(args.samples):
            ids = torch.randint(0, args.vocab, (args.seq,), generator=g).tolist()
            f.write(json.dumps({"input_ids": ids}) + "\n")
    with open(os.path.join(args.dir, "zero3.json"), "w") as f:
        json.dump(ZERO3, f, indent=1)
    print(f"sharded_trainer: student (H={args.hidden}, {args.layers} layers) and teacher "
          f"(H={args.teacher_hidden}, {args.teacher_layers} layers), V={args.vocab}, "
          f"{args.samples} sequences of {args.seq} tokens in {args.dir}")


def run(args) -> int:
    import torch

    from topkd.cli import main

    start = time.perf_counter()
    code = main(["distill", *args.distill])
    seconds = time.perf_counter() - start
    rank = int(os.environ.get("RANK", "0"))
    record = {"rank": rank, "world": int(os.environ.get("WORLD_SIZE", "1")), "exit": code,
              "seconds": seconds, "peak_bytes": None}
    if torch.cuda.is_available():
        record["peak_bytes"] = torch.cuda.max_memory_allocated()
        record["device"] = torch.cuda.get_device_name()
    if rank == 0:
        record["log"] = _log(_value(args.distill, "--out"))
    with open(f"{args.record}-rank{rank}.json", "w") as f:
        json.dump(record, f, indent=1)
    return code


def _value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def _log(out: str) -> list[dict]:
    """The logged steps of the newest checkpoint under ``out`` (``step``, ``loss``, ``kd``)."""
    states = sorted(glob.glob(os.path.join(out, "checkpoint-*", "trainer_state.json")),
                    key=lambda p: int(p.split("checkpoint-")[-1].split(os.sep)[0]))
    if not states:
        return []
    with open(states[-1]) as f:
        history = json.load(f)["log_history"]
    return [{k: e[k] for k in ("step", "loss", "kd") if k in e} for e in history if "kd" in e]


def summary(args) -> int:
    base: dict[int, list] = {}
    failed = 0
    for record in args.records:
        name = os.path.basename(record)
        ranks = [json.load(open(p)) for p in sorted(glob.glob(f"{record}-rank*.json"))]
        if not ranks or any(r["exit"] != 0 for r in ranks) or "log" not in ranks[0]:
            print(f"{name}: no complete run ({len(ranks)} rank records)")
            failed = 1
            continue
        first, world = ranks[0], ranks[0]["world"]
        kd = [e["kd"] for e in first["log"]]
        peaks = [r["peak_bytes"] for r in ranks]
        peak = ("peak " + " / ".join(f"{p / 2**30:.2f}" for p in peaks) + " GiB"
                if None not in peaks else "peak (CPU: not measured)")
        line = (f"{name}: {world} rank(s), {peak}, {first['seconds']:.0f} s, "
                f"kd {kd[0]:.4f} -> {kd[-1]:.4f} over {first['log'][-1]['step']} steps"
                if kd else f"{name}: no KD logged")
        if kd and world in base:
            ref = base[world]
            diff = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(kd, ref, strict=False))
            line += f", kd curve vs the first {world}-rank run: max rel. diff {diff:.2e}"
        elif kd:
            base[world] = kd
        print(line)
        print("    kd: " + " ".join(f"{v:.4f}" for v in kd))
    return failed


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sharded_trainer",
                                description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("setup", help="save the models, the data and a ZeRO-3 config")
    s.add_argument("dir")
    s.add_argument("--vocab", type=int, default=151_936)
    s.add_argument("--hidden", type=int, default=1024)
    s.add_argument("--layers", type=int, default=4)
    s.add_argument("--teacher-hidden", type=int, default=2048)
    s.add_argument("--teacher-layers", type=int, default=4)
    s.add_argument("--seq", type=int, default=1024)
    s.add_argument("--samples", type=int, default=512)
    r = sub.add_parser("run", help="one rank of topkd distill, then its record")
    r.add_argument("record", help="records go to RECORD-rank<r>.json")
    r.add_argument("distill", nargs=argparse.REMAINDER, help="-- then topkd distill's arguments")
    m = sub.add_parser("summary", help="one line per run")
    m.add_argument("records", nargs="+")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "setup":
        setup(args)
        return 0
    if args.command == "run":
        if args.distill[:1] == ["--"]:
            args.distill = args.distill[1:]
        return run(args)
    return summary(args)


if __name__ == "__main__":
    sys.exit(main())
