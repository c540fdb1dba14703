"""Subprocess bodies for the teacher-store tests (see test_store.py).

- ``python tests/store_worker.py crash PATH COUNT SHARD_BYTES [CODEC]``: a writer adding
  sequences ``s0, s1, ...`` slowly, to be killed with SIGKILL by the test while a shard is
  pending (CODEC: ``plain``, the default, or ``exact``).
- :func:`gloo_writer`: one rank of a gloo group writing its share of the ids to one store.
- ``python tests/store_worker.py builds DIR ARGV_JSON``: one rank of ``topkd store build`` runs
  under torchrun's environment (see :func:`cli_builds`).

Both make every sequence from its number alone (:func:`sequence`), so the parent process can
recompute what must be stored.
"""

from __future__ import annotations

import os
import sys
import time

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
for _p in (_HERE, os.path.dirname(_HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import topkd  # noqa: E402
from topkd.store import TeacherStoreWriter  # noqa: E402

VOCAB, K, TOP_P = 500, 8, 0.9
# lossless storage, so a read must equal the selection bit for bit
SETTINGS = dict(k=K, vocab_size=VOCAB, top_p=TOP_P, logprob_dtype="float32")
CODEC_SETTINGS = {"plain": SETTINGS,
                  "exact": dict(k=K, vocab_size=VOCAB, top_p=TOP_P, codec="exact")}


def sequence(number: int):
    """Tokens ``[L]`` (L = number % 6, so 0 occurs), teacher logits ``[L, VOCAB]`` and their
    top-K/top-p selection, all from ``number``."""
    g = torch.Generator().manual_seed(1000 + number)
    length = number % 6
    tokens = torch.randint(0, VOCAB, (length,), generator=g)
    logits = torch.randn(length, VOCAB, generator=g) * 3
    return tokens, logits, topkd.select_topk(logits, K, top_p=TOP_P)


def crash_writer(path: str, count: int, shard_bytes: int, codec: str = "plain") -> None:
    torch.set_num_threads(1)
    with TeacherStoreWriter(path, **CODEC_SETTINGS[codec], shard_bytes=shard_bytes) as writer:
        for number in range(count):
            tokens, _, teacher = sequence(number)
            writer.add(f"s{number}", tokens, teacher)
            time.sleep(0.02)


def gloo_writer(rank, world, count, store_dir, result_dir):
    import torch.distributed as dist
    from tp_worker import run_rank

    def body(group, failures):
        # the default name comes from the rank; each rank writes its own ids
        with TeacherStoreWriter(store_dir, **SETTINGS, shard_bytes=400) as writer:
            if writer.name != f"rank{rank:05d}":
                failures.append(f"writer name {writer.name!r} on rank {rank}")
            for number in range(rank, count, world):
                tokens, _, teacher = sequence(number)
                writer.add(number, tokens, teacher)
        dist.barrier(group)

    run_rank(rank, world, result_dir, body)


def sharded_load_failures(rank, world, teacher_dir, result_dir):
    """:func:`topkd.store.sharded_teacher.load_sharded` where it must stop every rank without
    a hang: rank 0's load fails (rank 0 raises its own error, the others one naming it); rank
    0 loads a model another rank's config does not make (every rank raises, naming the rank);
    then a good load, whose logits are the unsharded model's."""
    import torch.distributed as dist
    from tp_worker import run_rank

    from topkd.store.build import _load_model
    from topkd.store.sharded_teacher import load_sharded

    def broken(*_):
        raise OSError("no such checkpoint")

    def other(*args):
        model = _load_model(*args)
        model.lm_head.weight.data = model.lm_head.weight.data[:-1]  # not the config's shape
        return model

    def body(group, failures):
        cpu = torch.device("cpu")
        failed = "of the sharded teacher's build failed"
        for load, expected in ((broken, f"rank 0 {failed}" if rank else "no such checkpoint"),
                               (other, f"rank {rank} built a model" if rank else
                                f"rank 1 {failed}")):
            try:
                load_sharded(load, teacher_dir, "auto", cpu, world)
                failures.append(f"{load.__name__}: no error")
            except (OSError, RuntimeError) as e:
                if expected not in str(e):
                    failures.append(f"{load.__name__}: {e!r}")
        model, device = load_sharded(_load_model, teacher_dir, "auto", cpu, world)
        ids = torch.tensor([[1, 2, 3, 4, 5]])
        with torch.inference_mode():
            logits = model(input_ids=ids, use_cache=False).logits
            whole = _load_model(teacher_dir, "auto", cpu)(input_ids=ids, use_cache=False).logits
        if device != cpu or not torch.equal(logits, whole):
            failures.append(f"sharded logits differ from the unsharded ({device})")
        dist.barrier(group)

    run_rank(rank, world, result_dir, body)


def cli_builds(directory: str, argvs: list) -> None:
    """``topkd store build`` once per argument list of ``argvs``, in one process (starting a
    rank is the slow part), printing one JSON line of ``{"code", "out", "err"}`` per build.
    The first starts its own gloo group from torchrun's environment (``WORLD_SIZE``, ...) and
    ends it; the others run in a gloo group started here (through a file in ``directory``,
    every wait with a 60 s timeout), as a user's script would."""
    import contextlib
    import io
    import json
    from datetime import timedelta

    import torch.distributed as dist

    from topkd.cli import main

    torch.set_num_threads(1)
    if int(os.environ["RANK"]) > 0:  # a sharded teacher is read from disk by rank 0 alone
        import transformers

        load = transformers.AutoModelForCausalLM.from_pretrained

        def only_unsharded(*args, **kwargs):  # (``argv``: the build running now)
            assert "--shard-teacher" not in argv, "a rank > 0 read the sharded teacher"
            return load(*args, **kwargs)

        transformers.AutoModelForCausalLM.from_pretrained = only_unsharded
    for number, argv in enumerate(argvs):
        if number == 1:
            dist.init_process_group(
                "gloo", init_method=f"file://{os.path.join(directory, 'rendezvous')}",
                rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                timeout=timedelta(seconds=60))
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
        print(json.dumps({"code": code, "out": out.getvalue(), "err": err.getvalue()}),
              flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1] == "crash":
        crash_writer(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), *sys.argv[5:6])
    elif sys.argv[1] == "builds":
        import json

        cli_builds(sys.argv[2], json.loads(sys.argv[3]))
    else:
        raise SystemExit(f"unknown command {sys.argv[1]!r}")
