"""The ``topkd`` command line: build, inspect and verify teacher stores.

    topkd store build --teacher DIR --data FILE --k 64 --out DIR [options]
    topkd store info DIR
    topkd store verify DIR

Also ``python -m topkd ...``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

EPILOG_BUILD = """\
data formats (by file name):
  .jsonl/.ndjson/.json  JSON Lines: one object per line with a text field (--text-field) or
                        token ids (--ids-field; used when both are present) and an optional
                        id (--id-field); default id: the 0-based line number
  .parquet/.pq          the same fields as columns; default id: the 0-based row number
  .txt                  one text sample per line (empty lines too); id: the 0-based line number

A rerun with the same --out resumes: samples already stored are skipped. Under torchrun
(WORLD_SIZE > 1) rank r takes samples i with i % WORLD_SIZE == r and writes its own shards.
"""


def _int_at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    parse.__name__ = "int"
    return parse


def _float_in(name: str, low: float, high: float | None, low_open: bool = True):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        above = value > low if low_open else value >= low
        if not math.isfinite(value) or not above or (high is not None and value > high):
            bound = f"({low}, {high}]" if high is not None else f"> {low}"
            raise argparse.ArgumentTypeError(f"{name} must be in {bound}, got {text}")
        return value

    parse.__name__ = "float"
    return parse


def build_parser() -> argparse.ArgumentParser:
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
    build.add_argument("--k", required=True, type=_int_at_least(1),
                       help="entries kept per token row")
    build.add_argument("--out", required=True, metavar="DIR",
                       help="the store's directory (created, or resumed)")
    build.add_argument("--top-p", type=_float_in("--top-p", 0.0, 1.0), metavar="P",
                       help="also cut each row at top-p mass (variable K per row)")
    build.add_argument("--top-p-min-k", type=_int_at_least(1), default=1, metavar="N",
                       help="with --top-p, always keep at least N entries (default 1)")
    build.add_argument("--temperature", type=_float_in("--temperature", 0.0, None),
                       default=1.0, metavar="T", help="teacher temperature (default 1)")
    build.add_argument("--batch-size", type=_int_at_least(1), default=8, metavar="B",
                       help="sequences per forward pass (default 8)")
    build.add_argument("--max-length", type=_int_at_least(1), metavar="L",
                       help="truncate every sequence to L tokens (default: no truncation)")
    build.add_argument("--logprob-dtype", choices=("float16", "bfloat16", "float32"),
                       default="float16", help="dtype of the stored log-probs (default "
                       "float16: as small as bfloat16, 8x finer)")
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
    build.add_argument("--shard-mib", type=_float_in("--shard-mib", 0.0, None), default=256.0,
                       metavar="MIB", help="write a shard every MIB MiB of rows (default 256)")
    build.add_argument("--no-progress", action="store_true", help="no progress bars")
    build.set_defaults(run=_build)

    info = actions.add_parser("info", help="print a store's manifest and size",
                              description="Print a store's manifest and its size.")
    info.add_argument("path", metavar="DIR", help="the store's directory")
    info.add_argument("--json", action="store_true", help="one JSON object instead of text")
    info.set_defaults(run=_info)

    verify = actions.add_parser(
        "verify", help="check every byte of every shard; exit 1 on any problem",
        description="Check every shard in full (SHA-256 of each tensor, offsets, CRC-32s, "
        "duplicate ids). Prints each problem and exits 1 if there is any.")
    verify.add_argument("path", metavar="DIR", help="the store's directory")
    verify.set_defaults(run=_verify)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return args.run(parser, args)


def _fail(prog: str, message) -> int:
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 1


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
        try:
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
        except ImportError:
            pass
    from .store.build import build_store

    try:
        summary = build_store(
            args.teacher, args.data, args.out, k=args.k, top_p=args.top_p,
            top_p_min_k=args.top_p_min_k, temperature=args.temperature,
            batch_size=args.batch_size, max_length=args.max_length,
            logprob_dtype=args.logprob_dtype, text_field=args.text_field,
            id_field=args.id_field, ids_field=args.ids_field, dtype=args.dtype,
            device=args.device, shard_bytes=max(1, int(args.shard_mib * 2**20)),
            progress=not args.no_progress)
    except (ValueError, TypeError, KeyError, OSError, RuntimeError, ImportError) as e:
        return _fail(prog, e)
    who = "" if summary["world_size"] == 1 else f"rank {summary['rank']}: "
    seconds = summary["seconds"]
    print(f"{who}added {summary['added']} sequences ({summary['tokens']} tokens, "
          f"{summary['tokens'] / max(seconds, 1e-9):.0f} tokens/s), skipped "
          f"{summary['skipped']} already stored, {seconds:.1f} s -> {summary['path']}")
    return 0


def store_info(path: str) -> dict:
    """A store's manifest and size: sequences, tokens, bytes, bytes per token, shards."""
    from .store import TeacherStore
    from .store import format as fmt

    store = TeacherStore(path)
    tokens, nbytes = store.num_tokens(), store.nbytes()
    unfinished = [n for n in os.listdir(store.path)
                  if n.startswith(".shard-") and ".safetensors.tmp" in n]
    return {"path": store.path, "manifest": store.manifest, "sequences": len(store),
            "tokens": tokens, "bytes": nbytes,
            "manifest_bytes": os.path.getsize(os.path.join(store.path, fmt.MANIFEST)),
            "bytes_per_token": nbytes / tokens if tokens else None,
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
    print(f"bytes on disk: {info['bytes']} ({info['bytes'] / 2**20:.2f} MiB in shards)")
    print(f"bytes per token: {'-' if per_token is None else f'{per_token:.1f}'}")
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


if __name__ == "__main__":
    sys.exit(main())
