"""The ``topkd`` command line: build, inspect and verify teacher stores; distill; the demo.

    topkd store build --teacher DIR --data FILE --k 64 --out DIR [options]
    topkd store info DIR
    topkd store verify DIR
    topkd store import --data FILE --out DIR --k 64 --vocab-size V [options]
    topkd distill --teacher DIR --student DIR --data FILE --out DIR [options]
    topkd demo [options]

Also ``python -m topkd ...``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from . import divergences
from ._args import float_in as _float_in
from ._args import int_at_least as _int_at_least
from .options import IMPLS

EPILOG_BUILD = """\
data formats (by file name):
  .jsonl/.ndjson/.json  JSON Lines: one object per line with a text field (--text-field) or
                        token ids (--ids-field; used when both are present) and an optional
                        id (--id-field); default id: the 0-based line number
  .parquet/.pq          the same fields as columns; default id: the 0-based row number
  .txt                  one text sample per line (empty lines too); id: the 0-based line number

A rerun with the same --out resumes: samples already stored are skipped. Under torchrun
(WORLD_SIZE > 1) rank r takes samples i with i % WORLD_SIZE == r and writes its own shards;
with --shard-teacher the ranks also shard the teacher between them (FSDP2) and run their
forwards in step:
  torchrun --nproc-per-node 8 -m topkd.cli store build --shard-teacher --teacher DIR ...
"""


def build_parser(argv=None) -> argparse.ArgumentParser:
    """The parser; ``argv`` (the arguments to be parsed) names the command whose options are
    defined elsewhere and imported only when it runs (``demo``)."""
    parser = argparse.ArgumentParser(
        prog="topkd", description="topkd: exact knowledge-distillation losses; offline "
        "teacher stores.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    store = commands.add_parser("store", help="build, inspect and verify teacher stores",
                                description="Offline teacher stores: a teacher's top-K rows "
                                "on disk, read by sample id (topkd.store.TeacherStore).")
    actions = store.add_subparsers(dest="action", metavar="ACTION", required=True)

    build = actions.add_parser(
        "build", help="run a Hugging Face causal LM over a data file and store its top-K",
        description="Run a Hugging Face causal LM over a data file and store each sequence's\n"
        "teacher top-K (topkd.select_topk) under its sample id.",
        epilog=EPILOG_BUILD, formatter_class=argparse.RawDescriptionHelpFormatter)
    build.add_argument("--teacher", required=True, metavar="DIR",
                       help="a local model directory (AutoModelForCausalLM; its tokenizer, if "
                       "any, tokenizes text samples)")
    build.add_argument("--data", required=True, metavar="FILE",
                       help="JSON Lines, Parquet or text file")
    rows = build.add_mutually_exclusive_group(required=True)
    rows.add_argument("--k", type=_int_at_least(1), help="entries kept per token row")
    rows.add_argument("--samples", type=_int_at_least(1), metavar="N",
                      help="instead of --k: N tokens drawn per position from the teacher "
                      "(RS-KD, topkd.sample_teacher), stored as distinct ids and counts; "
                      "trains forward KL only")
    build.add_argument("--out", required=True, metavar="DIR",
                       help="the store's directory (created, or resumed)")
    build.add_argument("--top-p", type=_float_in("--top-p", 0.0, 1.0), metavar="P",
                       help="also cut each row at top-p mass (variable K per row)")
    build.add_argument("--top-p-min-k", type=_int_at_least(1), default=1, metavar="N",
                       help="with --top-p, always keep at least N entries (default 1)")
    build.add_argument("--seed", type=int, default=0,
                       help="with --samples: the draws' seed (each sequence's from (seed, its "
                       "sample id); default 0)")
    build.add_argument("--temperature", type=_float_in("--temperature", 0.0, None),
                       default=1.0, metavar="T", help="teacher temperature (default 1)")
    build.add_argument("--batch-size", type=_int_at_least(1), default=8, metavar="B",
                       help="sequences per forward pass (default 8)")
    build.add_argument("--padding-free", action="store_true",
                       help="run each batch's sequences packed in one row (position_ids "
                       "restarting at each), no padding; the rows stored are the same")
    build.add_argument("--max-length", type=_int_at_least(1), metavar="L",
                       help="truncate every sequence to L tokens (default: no truncation)")
    build.add_argument("--exact", action="store_true",
                       help="store the float32 log-probs losslessly (about 4.8 B per kept "
                       "entry at K=64, V=151,936; default: the compact codec, about 2.8 B, "
                       "log-probs within 1/64 nat)")
    build.add_argument("--logprob-dtype", choices=("float16", "bfloat16", "float32"),
                       help="store the format-1 layout instead: int32 indices and log-probs "
                       "in this dtype (6-8 B per entry; what older stores hold)")
    build.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"),
                       default="auto", help="the teacher's weights (default auto: the "
                       "checkpoint's)")
    build.add_argument("--text-field", default="text", metavar="NAME",
                       help="text field of JSON Lines / Parquet samples (default text)")
    build.add_argument("--ids-field", default="input_ids", metavar="NAME",
                       help="token ids field of JSON Lines / Parquet samples (default "
                       "input_ids)")
    build.add_argument("--id-field", default="id", metavar="NAME",
                       help="sample id field of JSON Lines / Parquet samples (default id)")
    build.add_argument("--device", help="where the teacher runs (default: cuda if available, "
                       "else cpu; cuda:LOCAL_RANK under torchrun)")
    build.add_argument("--shard-teacher", action="store_true",
                       help="under torchrun, shard the teacher over the ranks with FSDP2 "
                       "(each decoder layer gathered for its forward; the checkpoint read "
                       "by rank 0 alone): a teacher larger than one device; the rows stored "
                       "are the same (one rank: unsharded)")
    build.add_argument("--shard-mib", type=_float_in("--shard-mib", 0.0, None), default=256.0,
                       metavar="MIB", help="write a shard every MIB MiB of rows (default 256)")
    build.add_argument("--no-tokens", action="store_true",
                       help="do not store the token ids (saves 4 B per token; training must "
                       "then tokenize the data exactly as this build did)")
    build.add_argument("--no-progress", action="store_true", help="no progress bars")
    build.set_defaults(run=_build)

    info = actions.add_parser("info", help="print a store's manifest and size",
                              description="Print a store's manifest and its size.")
    info.add_argument("path", metavar="DIR", help="the store's directory")
    info.add_argument("--json", action="store_true", help="one JSON object instead of text")
    info.set_defaults(run=_info)

    verify = actions.add_parser(
        "verify", help="check every byte of every shard; exit 1 on any problem",
        description="Check every shard in full (SHA-256 of each tensor, offsets, checksums, "
        "duplicate ids). Prints each problem and exits 1 if there is any.")
    verify.add_argument("path", metavar="DIR", help="the store's directory")
    verify.set_defaults(run=_verify)

    imp = actions.add_parser(
        "import", help="store a serving engine's top-k log-probs (JSON Lines)",
        description="Store per-position top-k log-probs, normalized over the vocabulary (what "
        "vLLM's and SGLang's prompt_logprobs give), from JSON Lines: one sequence per line, "
        '{"id": ..., "input_ids": [L ids], "topk_ids": [L rows of ids], "topk_logprobs": '
        "[L rows of log-probs]}; row t is the distribution of the token after input_ids[t]. "
        "Each row keeps its k most probable entries; the ghost is log(1 - their mass), in "
        "float64. A rerun resumes.")
    imp.add_argument("--data", required=True, metavar="FILE", help="the JSON Lines file")
    imp.add_argument("--out", required=True, metavar="DIR", help="the store's directory")
    imp.add_argument("--k", required=True, type=_int_at_least(1), metavar="K",
                     help="entries kept per token row")
    imp.add_argument("--vocab-size", required=True, type=_int_at_least(1), metavar="V",
                     help="the vocabulary the log-probs are normalized over")
    imp.add_argument("--exact", action="store_true", help="lossless float32 log-probs "
                     "(default: the compact codec)")
    imp.add_argument("--temperature", type=_float_in("--temperature", 0.0, None), default=1.0,
                     metavar="T", help="the temperature the engine normalized at (default 1)")
    imp.add_argument("--tokenizer", metavar="DIR", help="a tokenizer directory whose "
                     "fingerprint the store records (needs transformers)")
    imp.add_argument("--id-field", default="id", metavar="NAME",
                     help="sample id field (default id; absent: the 0-based line number)")
    imp.add_argument("--ids-field", default="input_ids", metavar="NAME",
                     help="token ids field (default input_ids)")
    imp.set_defaults(run=_import)
    _add_distill(commands)
    _add_demo(commands, load=bool(argv) and argv[0] == "demo")
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv)
    args, extra = parser.parse_known_args(argv)
    if extra and getattr(args, "demo_error", None) is None:  # (a demo that failed to import
        _command_parser(parser, args).error(  # reports that instead)
            f"unrecognized arguments: {' '.join(extra)}{_suggestions(parser, args, extra)}")
    return args.run(parser, args)


def _command_parser(parser, args) -> argparse.ArgumentParser:
    """The (sub)parser of the command ``args`` ran: its usage goes with its errors."""
    names = [getattr(args, "command", None), getattr(args, "action", None)]
    for name in names:
        subparsers = next((a for a in parser._actions
                           if isinstance(a, argparse._SubParsersAction)), None)
        if name is None or subparsers is None or name not in subparsers.choices:
            break
        parser = subparsers.choices[name]
    return parser


def _suggestions(parser, args, extra) -> str:
    """`` (did you mean --max-steps?)`` for unknown flags close to one the command has."""
    import difflib

    known = [o for a in _command_parser(parser, args)._actions for o in a.option_strings
             if o.startswith("--")]
    hints = []
    for flag in (x.split("=", 1)[0] for x in extra if x.startswith("--")):
        close = (difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
                 or [o for o in known if len(flag) > 3 and flag[2:] in o][:1])
        if close:
            hints.append(f"{flag}: did you mean {close[0]}?")
    return f" ({'; '.join(hints)})" if hints else ""


def _fail(prog: str, message) -> int:
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 1


def _no_transformers_bars() -> None:
    """``--no-progress``: transformers' own progress bars off too (when it is installed)."""
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass


def _build(parser, args) -> int:
    prog = "topkd store build"
    if not os.path.isdir(args.teacher):
        parser.error(f"argument --teacher: {args.teacher!r} is not a directory")
    if not os.path.isfile(args.data):
        parser.error(f"argument --data: {args.data!r} is not a file")
    from .store.build import data_format

    try:
        data_format(args.data)
    except ValueError as e:
        parser.error(f"argument --data: {e}")
    if args.top_p is None and args.top_p_min_k != 1:
        parser.error("argument --top-p-min-k: only meaningful with --top-p")
    if args.no_progress:
        _no_transformers_bars()
    from .store.build import build_store

    try:
        summary = build_store(
            args.teacher, args.data, args.out, k=args.k, samples=args.samples,
            seed=args.seed, top_p=args.top_p,
            top_p_min_k=args.top_p_min_k, temperature=args.temperature,
            batch_size=args.batch_size, max_length=args.max_length,
            padding_free=args.padding_free, codec=_codec_arg(parser, args),
            logprob_dtype=args.logprob_dtype,
            text_field=args.text_field,
            id_field=args.id_field, ids_field=args.ids_field, dtype=args.dtype,
            device=args.device, shard_teacher=args.shard_teacher,
            shard_bytes=max(1, int(args.shard_mib * 2**20)),
            store_tokens=not args.no_tokens, progress=not args.no_progress)
    except (ValueError, TypeError, KeyError, OSError, RuntimeError, ImportError) as e:
        return _fail(prog, e)
    who = "" if summary["world_size"] == 1 else f"rank {summary['rank']}: "
    seconds = summary["seconds"]
    sharded = f", teacher sharded over {summary['world_size']} ranks" if summary["sharded"] else ""
    print(f"{who}added {summary['added']} sequences ({summary['tokens']} tokens, "
          f"{summary['tokens'] / max(seconds, 1e-9):.0f} tokens/s), skipped "
          f"{summary['skipped']} already stored, {seconds:.1f} s{sharded} -> {summary['path']}")
    return 0


def _codec_arg(parser, args) -> str | None:
    if args.exact and args.logprob_dtype is not None:
        parser.error("argument --exact: not allowed with --logprob-dtype (the format-1 layout)")
    return "exact" if args.exact else None


def store_info(path: str) -> dict:
    """A store's manifest and size: sequences, tokens, kept entries, bytes (shards and
    manifest), bytes per token and per kept entry, shards."""
    from .store import TeacherStore
    from .store import format as fmt

    store = TeacherStore(path)
    tokens, nbytes, entries = store.num_tokens(), store.nbytes(), store.num_entries()
    total = nbytes + os.path.getsize(os.path.join(store.path, fmt.MANIFEST))
    unfinished = [n for n in os.listdir(store.path)
                  if n.startswith(".shard-") and ".safetensors.tmp" in n]
    return {"path": store.path, "manifest": store.manifest, "sequences": len(store),
            "tokens": tokens, "store_tokens": store.store_tokens, "bytes": nbytes,
            "manifest_bytes": os.path.getsize(os.path.join(store.path, fmt.MANIFEST)),
            "bytes_per_token": nbytes / tokens if tokens else None,
            "codec": store.manifest["codec"], "entries": entries, "total_bytes": total,
            "total_bytes_per_token": total / tokens if tokens else None,
            "total_bytes_per_entry": total / entries if entries else None,
            "shards": len(store.files), "unfinished_shards": len(unfinished)}


def _info(parser, args) -> int:
    try:
        info = store_info(args.path)
    except (ValueError, OSError) as e:
        return _fail("topkd store info", e)
    if args.json:
        print(json.dumps(info, indent=2, sort_keys=True))
        return 0
    print(f"store: {info['path']}")
    print("manifest:")
    for line in json.dumps(info["manifest"], indent=2, sort_keys=True).splitlines():
        print(f"  {line}")
    per_token = info["bytes_per_token"]
    print(f"sequences: {info['sequences']}")
    print(f"tokens: {info['tokens']}")
    print(f"token ids stored: {'yes' if info['store_tokens'] else 'no'}")
    print(f"bytes on disk: {info['bytes']} ({info['bytes'] / 2**20:.2f} MiB in shards)")
    print(f"bytes per token: {'-' if per_token is None else f'{per_token:.1f}'}")
    print(f"codec: {info['codec']}")
    print(f"kept entries: {info['entries']}")
    for what in ("token", "entry"):
        value = info[f"total_bytes_per_{what}"]
        print(f"bytes per {what}, manifest included: "
              f"{'-' if value is None else f'{value:.3f}'}")
    print(f"shards: {info['shards']}")
    if info["unfinished_shards"]:
        print(f"unfinished shard files: {info['unfinished_shards']} (a live writer, or one "
              f"that died; its next run removes them)")
    return 0


def _verify(parser, args) -> int:
    from .store import TeacherStore, verify_store

    problems = verify_store(args.path)
    for problem in problems:
        print(problem)
    if problems:
        print(f"topkd store verify: {len(problems)} problem(s) in {args.path}", file=sys.stderr)
        return 1
    store = TeacherStore(args.path, verify_reads=False)
    print(f"ok: {len(store)} sequences, {len(store.files)} shards")
    return 0


def _import(parser, args) -> int:
    prog = "topkd store import"
    if not os.path.isfile(args.data):
        parser.error(f"argument --data: {args.data!r} is not a file")
    if args.k > args.vocab_size:
        parser.error(f"argument --k: {args.k} is more than --vocab-size {args.vocab_size}")
    from .store.serving import import_jsonl

    try:
        fingerprint = None
        if args.tokenizer is not None:
            from transformers import AutoTokenizer

            from .store import tokenizer_fingerprint

            fingerprint = tokenizer_fingerprint(AutoTokenizer.from_pretrained(args.tokenizer))
        summary = import_jsonl(args.data, args.out, k=args.k, vocab_size=args.vocab_size,
                               codec="exact" if args.exact else None,
                               temperature=args.temperature,
                               tokenizer_fingerprint=fingerprint, id_field=args.id_field,
                               ids_field=args.ids_field)
    except (ValueError, TypeError, KeyError, OSError, RuntimeError, ImportError) as e:
        return _fail(prog, e)
    print(f"added {summary['added']} sequences ({summary['tokens']} tokens), skipped "
          f"{summary['skipped']} already stored -> {summary['path']}")
    return 0


# -- topkd distill ---------------------------------------------------------------------------

EPILOG_DISTILL = """\
The data files are read as by `topkd store build` (JSON Lines, Parquet, text; the same
--text-field / --ids-field / --id-field) and tokenized with the student's tokenizer (else the
teacher's); every token is learned (no prompt masking); sequences under 2 tokens are skipped.

Online (--teacher): the teacher runs beside the student. Offline (--store): the teacher's
top-K rows are read from a store built from the same data file (the same sample ids; its
max_length is the default), and no teacher model is loaded.

OUT receives checkpoint-N directories every --save-steps steps (and at the end), the run's
settings (topkd_distill.json) and the distilled student (model and tokenizer). --resume
continues a stopped or killed run from its newest complete checkpoint, with the same data
order, and ends where an uninterrupted run ends.

Under torchrun every rank runs this command (DDP; gloo on CPU, NCCL on CUDA).
"""



def _add_distill(commands) -> None:
    p = commands.add_parser(
        "distill", help="distill a teacher (a model, or its store) into a student",
        description="Distill a Hugging Face causal LM teacher, run online or read from a "
        "teacher store, into a student (topkd.hf.KDTrainer), and save the student.",
        epilog=EPILOG_DISTILL, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--teacher", metavar="DIR", help="the teacher's model directory (online; "
                   "not loaded with --store)")
    p.add_argument("--student", required=True, metavar="DIR",
                   help="the student's model directory (trained in float32 parameters)")
    p.add_argument("--data", required=True, metavar="FILE",
                   help="JSON Lines, Parquet or text file")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="checkpoints, the run's settings and the distilled student")
    p.add_argument("--store", metavar="DIR", help="a teacher store built from --data (offline)")
    p.add_argument("--eval-data", metavar="FILE", help="held-out data: KL(teacher || student) "
                   "and CE before and after (with --store: read from the store too)")
    p.add_argument("--eval-steps", type=_int_at_least(1), metavar="N",
                   help="also evaluate every N steps")
    p.add_argument("--k", type=_int_at_least(1), help="teacher entries kept per token (default: "
                   "the full vocabulary online, the store's k offline)")
    p.add_argument("--top-p", type=_float_in("--top-p", 0.0, 1.0), metavar="P",
                   help="also cut the teacher's top-k at top-p mass (online, with --k)")
    p.add_argument("--temperature", type=_float_in("--temperature", 0.0, None), metavar="T",
                   help="distillation temperature (default 1 online, the store's offline)")
    p.add_argument("--divergence", choices=divergences.names(), default="kl",
                   help="a registered divergence (topkd.divergences.register); default kl: "
                   "KL(teacher || student)")
    p.add_argument("--impl", choices=IMPLS, default="auto",
                   help="the loss kernels (default auto: compiled where the platform builds "
                   "them; eager skips compiling)")
    p.add_argument("--beta", type=_float_in("--beta", 0.0, 1.0, low_open=False),
                   help="JSD's mixture weight (with --divergence jsd; default 0.5)")
    p.add_argument("--alpha", type=_float_in("--alpha", 0.0, 1.0, low_open=False),
                   help="skew KL's mixture weight (with --divergence skew_kl or "
                   "skew_reverse_kl; default 0.1)")
    for flag, default, what in (("--kd-weight", 1.0, "weight of the KD term (default 1)"),
                                ("--ce-weight", 0.0, "weight of the next-token CE (default 0)")):
        p.add_argument(flag, type=_float_in(flag, 0.0, None, low_open=False), default=default,
                       metavar="W", help=what)
    p.add_argument("--max-steps", type=_int_at_least(1), metavar="N",
                   help="optimizer steps (default: --epochs passes over the data)")
    p.add_argument("--epochs", type=_float_in("--epochs", 0.0, None), metavar="E",
                   help="passes over the data when --max-steps is not given (default 1)")
    p.add_argument("--batch-size", type=_int_at_least(1), default=8, metavar="B",
                   help="sequences per device per micro-batch (default 8)")
    p.add_argument("--grad-accum", type=_int_at_least(1), default=1, metavar="G",
                   help="micro-batches per optimizer step (default 1)")
    p.add_argument("--padding-free", action="store_true",
                   help="pack each micro-batch's sequences into one row (position_ids "
                   "restarting at each), no padding: the same loss, no padded tokens computed")
    p.add_argument("--lr", type=_float_in("--lr", 0.0, None), default=5e-5,
                   help="peak learning rate, AdamW, linear decay (default 5e-5)")
    p.add_argument("--max-length", type=_int_at_least(2), metavar="L",
                   help="truncate every sequence to L tokens (default: none, or the store's)")
    p.add_argument("--bf16", action="store_true", help="bfloat16 autocast (float32 parameters)")
    p.add_argument("--fsdp", action="store_true",
                   help="shard the student with FSDP2 (accelerate's plugin, fsdp_version 2: "
                   "each decoder layer and the root, resharded after forward); CUDA GPUs only, "
                   "launched with accelerate launch or torchrun")
    p.add_argument("--deepspeed", metavar="CONFIG",
                   help="train under DeepSpeed with this JSON config (TrainingArguments' "
                   "deepspeed=; ZeRO stage 3 partitions the student, its LM head gathered "
                   "for the fused loss); launched with deepspeed, accelerate launch or "
                   "torchrun. Not with --fsdp")
    p.add_argument("--teacher-dtype", choices=("auto", "float32", "bfloat16", "float16"),
                   help="the online teacher's weights (default bfloat16 with --bf16, else "
                   "float32; auto: the checkpoint's)")
    p.add_argument("--seed", type=int, default=42, help="seed of the data order (default 42)")
    for flag, least, default, what in (
            ("--save-steps", 1, 500, "a checkpoint every N steps, and at the end (default 500)"),
            ("--save-total-limit", 0, 2, "keep the newest N checkpoints (0: all; default 2)"),
            ("--logging-steps", 1, 10,
             "log loss and kd every N steps, and at the end (default 10)")):
        p.add_argument(flag, type=_int_at_least(least), default=default, metavar="N", help=what)
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out from its newest complete checkpoint")
    p.add_argument("--text-field", default="text", metavar="NAME",
                   help="text field of JSON Lines / Parquet samples (default text)")
    p.add_argument("--ids-field", default="input_ids", metavar="NAME",
                   help="token ids field of JSON Lines / Parquet samples (default input_ids)")
    p.add_argument("--id-field", default="id", metavar="NAME",
                   help="sample id field of JSON Lines / Parquet samples (default id)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(run=lambda _, args: _distill(p, args))  # (errors show distill's usage)


def _distill(parser, args) -> int:
    prog = "topkd distill"
    if args.teacher is None and args.store is None:
        parser.error("one of --teacher (online) and --store (offline) is required")
    for name, path in (("--teacher", args.teacher), ("--student", args.student),
                       ("--store", args.store)):
        if path is not None and not os.path.isdir(path):
            parser.error(f"argument {name}: {path!r} is not a directory")
    from .store.build import data_format

    for name, path in (("--data", args.data), ("--eval-data", args.eval_data)):
        if path is None:
            continue
        if not os.path.isfile(path):
            parser.error(f"argument {name}: {path!r} is not a file")
        try:
            data_format(path)
        except ValueError as e:
            parser.error(f"argument {name}: {e}")
    if args.beta is not None and args.divergence != "jsd":
        parser.error(f"argument --beta: only with --divergence jsd (got {args.divergence})")
    if args.alpha is not None and args.divergence not in ("skew_kl", "skew_reverse_kl"):
        parser.error(f"argument --alpha: only with --divergence skew_kl or skew_reverse_kl "
                     f"(got {args.divergence})")
    if args.top_p is not None and (args.k is None or args.store is not None):
        parser.error("argument --top-p: needs --k, online (a store's rows were cut at build)")
    if args.store is not None and args.teacher_dtype is not None:
        parser.error("argument --teacher-dtype: no teacher is loaded with --store")
    if args.max_steps is not None and args.epochs is not None:
        parser.error("argument --epochs: give --max-steps or --epochs, not both")
    if args.eval_steps is not None and args.eval_data is None:
        parser.error("argument --eval-steps: needs --eval-data")
    if args.kd_weight == 0 and args.ce_weight == 0:
        parser.error("--kd-weight and --ce-weight are both 0: nothing to train")
    if args.store is not None and args.teacher is not None:
        print(f"{prog}: offline: the teacher in {args.teacher} is not loaded (its rows come "
              f"from {args.store}); the store is checked to be its rows", file=sys.stderr)
    if args.no_progress:
        _no_transformers_bars()
    try:
        from .hf.distill import distill, summary_lines

        summary = distill(
            args.student, args.data, args.out,
            teacher=args.teacher, store=args.store,
            eval_data=args.eval_data, k=args.k, top_p=args.top_p,
            temperature=args.temperature, divergence=args.divergence, impl=args.impl,
            beta=0.5 if args.beta is None else args.beta,
            alpha=0.1 if args.alpha is None else args.alpha, kd_weight=args.kd_weight,
            ce_weight=args.ce_weight, max_steps=args.max_steps,
            epochs=1.0 if args.epochs is None else args.epochs, batch_size=args.batch_size,
            grad_accum=args.grad_accum, lr=args.lr, max_length=args.max_length,
            padding_free=args.padding_free, bf16=args.bf16, teacher_dtype=args.teacher_dtype,
            fsdp=args.fsdp, deepspeed=args.deepspeed,
            seed=args.seed,
            save_steps=args.save_steps, save_total_limit=args.save_total_limit or None,
            logging_steps=args.logging_steps, eval_steps=args.eval_steps, resume=args.resume,
            text_field=args.text_field, id_field=args.id_field, ids_field=args.ids_field,
            progress=not args.no_progress)
    except (ValueError, TypeError, KeyError, OSError, ImportError) as e:
        return _fail(prog, e)
    finally:
        _end_process_group()
    if summary["rank"] == 0:
        for line in summary_lines(summary):
            print(f"{prog}: {line}")
    return 0


def _end_process_group() -> None:
    """torchrun: the Trainer started the process group; the command ends it."""
    torch_dist = sys.modules.get("torch.distributed")
    if torch_dist is not None and torch_dist.is_available() and torch_dist.is_initialized():
        torch_dist.destroy_process_group()


# -- topkd demo ------------------------------------------------------------------------------

def _add_demo(commands, load: bool) -> None:
    """``topkd demo``: its options and its body live in :mod:`topkd.hf.demo`, imported only
    when the command runs (it needs transformers)."""
    demo = commands.add_parser(
        "demo", help="train a tiny teacher on a synthetic language and distill it three ways "
        "(no downloads, a few minutes on CPU)",
        description="Generate a synthetic corpus, train a small teacher on it, distill a "
        "student three ways (CE only, online top-K KD, KD from a store) and print a table.")
    demo.set_defaults(run=_demo, demo_error=None)
    if not load:
        return
    try:
        from .hf import demo as module

        module.add_arguments(demo)
    except ImportError as e:  # _demo reports it, whatever the options
        demo.set_defaults(demo_error=e)


def _demo(parser, args) -> int:
    if args.demo_error is not None:
        from ._extras import missing

        absent = missing("hf")
        needs = f"{', '.join(absent)}, not installed here" if absent else "topkd[hf]"
        return _fail("topkd demo", f"topkd demo needs {needs}: pip install 'topkd[hf]' "
                     f"(import error: {args.demo_error})")
    from .hf import demo

    try:
        return demo.run(args)
    except (ImportError, ValueError) as e:  # check_ready's: what is missing, before any work
        return _fail("topkd demo", e)


if __name__ == "__main__":
    sys.exit(main())
