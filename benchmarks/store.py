"""Benchmark, teacher store section: ``python -m benchmarks store``.

Measures :mod:`topkd.store` at K = 64, V = 151,936 (the default sizes), for each layout
(``--layouts``: the codecs ``compact`` and ``exact`` of format 2, and the format-1 layout in a
``logprob_dtype``: ``float16``, ``bfloat16``, ``float32``), without top-p and with ``top_p``
(0.95): a store is written by :class:`~topkd.store.TeacherStoreWriter` into a temporary
directory and read back by :class:`~topkd.store.TeacherStore`. Each phase runs in its own fresh
Python process:

* **teacher rows**: ``--pool`` distinct sequences of ``--seq-len`` rows are made once by
  :func:`topkd.select_topk` over teacher logits of kind ``--rows``: ``lm`` (the default),
  LM-like rows, Zipf by rank (logit ``-log r`` of the token of rank ``r``) in a random token
  order per row; ``peaked``, bf16 ``3 N(0, 1)`` plus 1-3 peaked tokens per row at a logit drawn
  from U(12, 28), so that top-p cuts some rows short and keeps all K in others. Making logits
  of V columns is slow on a small CPU, so the store's ``--tokens`` rows reuse that pool under
  distinct sample ids and distinct random token ids (the token hash differs per sequence); the
  selection is not timed.
* **bytes per token and per kept entry**: everything on disk (the shard files and the
  manifest) over the token rows and over the kept entries.
* **write**: tokens/s and MB/s (10^6 bytes of shard files per second) of the writer alone:
  its construction, ``add`` of every sequence, and ``close``, which fsyncs each shard and the
  directory (``write_durably``). Median over ``--write-runs`` writes (1), each into a fresh
  directory, after an untimed warm-up write of a few sequences. A breakdown of one shard's
  write (the row packing in ``add``, ``torch.cat``, the CRC-32s, the SHA-256s, the safetensors
  serialization, the write and the fsync) is timed apart.
* **read**: in a new process (no state of the writer's process; the OS page cache still holds
  the shards just written, so these are reads from memory, not from the disk, unless
  ``--drop-cache``), random sample ids by ``store.get(id, input_ids)`` (checksum and token hash
  checked), by ``store.get(id)`` of a store opened with ``verify_reads=False`` (nothing
  checked), and ``store.collate`` of batches of ``--batch`` ids (checked). Sequences/s and
  tokens/s, median over ``--runs`` runs of ``--read-seqs`` sequences each, after an untimed
  warm-up run, with ``--read-threads`` torch threads (1, as in a ``DataLoader`` worker). Each
  run opens a new store object (its shards opened before the clock starts), so every page
  is mapped into the process for the first time, as in an epoch of training. A per-sequence
  breakdown of the checked read (token hash, safetensors slicing, checksum, building the
  ``SparseTeacher``) is timed apart.
* **loss**: a batch of ``--loss-batch`` x ``--loss-seq-len`` rows at V, of LM-like teacher
  logits and of random-normal ones (``N(0, 1)``), the student ``0.8 t + 1.2 N(0, 1)``, in
  memory; ``topkd.topk_kl_loss(student, teacher_logits, K, reduction="mean")`` online against
  ``topkd.sparse_kl_loss(student, batch, reduction="mean")``, ``batch`` collated from a store
  of the same selection written in each layout; with and without top-p. The exact codec and
  float32 keep the selection's values exactly.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from . import harness
from .harness import DTYPES, MiB

MB = 10**6
PEAK_LOW, PEAK_HIGH = 12.0, 28.0  # peaked tokens' logits, uniform in [low, high)


# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------


def teacher_logits(rows, vocab, generator, student=False):
    """bf16 ``[rows, V]``: ``3 N(0, 1)`` plus, per row, 1-3 tokens at a logit from U(12, 28).
    With ``student``, also a correlated student ``0.8 t + 1.2 N(0, 1)`` (bf16). Made in chunks
    of rows, never whole in float32."""
    import torch

    teacher = torch.empty(rows, vocab, dtype=torch.bfloat16)
    other = torch.empty(rows, vocab, dtype=torch.bfloat16) if student else None
    step = max(1, (64 * MiB) // (4 * vocab))
    for lo in range(0, rows, step):
        hi = min(rows, lo + step)
        t = torch.randn(hi - lo, vocab, generator=generator) * 3.0
        peaks = torch.randint(1, 4, (hi - lo,), generator=generator)
        for j in range(3):
            where = torch.randint(0, vocab, (hi - lo,), generator=generator)
            height = PEAK_LOW + (PEAK_HIGH - PEAK_LOW) * torch.rand(hi - lo, generator=generator)
            chosen = peaks > j
            rows_j = torch.arange(hi - lo)[chosen]
            t[rows_j, where[chosen]] = height[chosen]
        teacher[lo:hi] = t.to(torch.bfloat16)
        if student:
            other[lo:hi] = (0.8 * t + 1.2 * torch.randn(hi - lo, vocab, generator=generator)
                            ).to(torch.bfloat16)
        del t
    return (other, teacher) if student else teacher


LAYOUTS = ("compact", "exact") + tuple(DTYPES)
ROW_KINDS = ("lm", "peaked")


def writer_layout(layout: str) -> dict:
    """The writer's keywords for a layout: a codec, or a format-1 log-prob dtype."""
    return {"codec": layout} if layout in ("compact", "exact") else {"logprob_dtype": layout}


def lm_logits(rows, vocab, generator):
    """LM-like float32 ``[rows, V]``: Zipf by rank, logit ``-log r`` for the token of rank
    ``r``, in a random token order per row."""
    import torch

    by_rank = -torch.log(torch.arange(1, vocab + 1, dtype=torch.float32))
    return torch.stack([by_rank[torch.randperm(vocab, generator=generator)]
                        for _ in range(rows)])


def sample_id(i: int) -> str:
    return f"sample-{i:09d}"


def input_ids(seed: int, i: int, length: int, vocab: int):
    """The token ids stored with sequence ``i`` (a function of the seed and ``i`` alone, so the
    reading process makes the same ones)."""
    import torch

    g = torch.Generator().manual_seed(seed * 1_000_003 + i)
    return torch.randint(0, vocab, (length,), generator=g)


def store_name(layout: str, top_p) -> str:
    return f"{layout}-top_p{top_p:g}" if top_p is not None else layout


def store_configs(args):
    return [(layout, top_p) for layout in args.layouts for top_p in (None, args.top_p)]


def _shard_bytes_on_disk(path):
    from topkd.store import format as fmt

    files = fmt.shard_files(path)
    return sum(os.path.getsize(os.path.join(path, f)) for f in files), len(files)


def _entries(path, k):
    from topkd.store import TeacherStore

    return TeacherStore(path, k=k).num_entries()


def _setup(args):
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    return torch


# --------------------------------------------------------------------------------------------
# Child: write
# --------------------------------------------------------------------------------------------


def _write_store(args, path, layout, top_p, pool, sequences, ids_of):
    """Write one store, timing the writer alone; returns the timings."""
    from topkd.store import TeacherStoreWriter

    timing = {"flush_s": 0.0, "flush_in_add_s": 0.0}
    phase = {"adding": False}
    t0 = time.perf_counter()
    writer = TeacherStoreWriter(path, k=args.k, vocab_size=args.vocab, top_p=top_p,
                                **writer_layout(layout), shard_bytes=args.shard_bytes,
                                metadata={"benchmark": "benchmarks store"})
    flush = writer.flush

    def timed_flush():  # add() and close() call self.flush: time the shard writes apart
        a = time.perf_counter()
        flush()
        spent = time.perf_counter() - a
        timing["flush_s"] += spent
        if phase["adding"]:
            timing["flush_in_add_s"] += spent

    writer.flush = timed_flush
    t_open = time.perf_counter()
    phase["adding"] = True
    for i in range(sequences):
        writer.add(sample_id(i), ids_of[i], pool[i % len(pool)])
    phase["adding"] = False
    t_added = time.perf_counter()
    writer.close()
    t_end = time.perf_counter()
    timing.update(total_s=t_end - t0, open_s=t_open - t0, add_s=t_added - t_open,
                  close_s=t_end - t_added)
    # add() without the shard writes it triggers: validating and packing the rows
    timing["rows_s"] = timing["add_s"] - timing["flush_in_add_s"]
    return timing


def _write_breakdown(args, path, layout, pool, ids_of):
    """Time the parts of writing a format-1 store's first shard one by one (private internals
    of the writer: may fail if they change; the benchmark reports that instead)."""
    import torch
    from safetensors.torch import load_file, save

    from topkd.store import TeacherStoreWriter
    from topkd.store import format as fmt

    files = fmt.shard_files(path)
    tensors = load_file(os.path.join(path, files[0]))
    rows, entries = tensors["seq_rows"], tensors["seq_entries"]
    sequences = len(rows) - 1
    shard_bytes = os.path.getsize(os.path.join(path, files[0]))
    out = {"shard_bytes": shard_bytes, "sequences": sequences}
    scratch = os.path.join(path, "..", f"scratch-{os.getpid()}")
    os.makedirs(scratch, exist_ok=True)
    try:
        writer = TeacherStoreWriter(scratch, k=args.k, vocab_size=args.vocab,
                                    logprob_dtype=layout, name="breakdown")
        try:
            a = time.perf_counter()
            for i in range(sequences):
                writer._rows(sample_id(i), pool[i % len(pool)], args.seq_len)
            out["pack_rows_s"] = time.perf_counter() - a
        finally:
            writer._pending = []
            writer.close()
        a = time.perf_counter()
        for _ in range(sequences):
            fmt.token_hash(ids_of[0])
        out["token_hash_s"] = time.perf_counter() - a
        row_tensors = [n for n in fmt.ROW_TENSORS if n in tensors]
        pieces = {n: [] for n in row_tensors}
        for i in range(sequences):
            r0, r1, e0, e1 = int(rows[i]), int(rows[i + 1]), int(entries[i]), int(entries[i + 1])
            for n in row_tensors:
                lo, hi = (e0, e1) if n in ("indices", "logprobs") else (r0, r1)
                pieces[n].append(tensors[n][lo:hi].clone())
        a = time.perf_counter()
        for n in row_tensors:
            torch.cat(pieces[n])
        out["cat_s"] = time.perf_counter() - a
        a = time.perf_counter()
        for i in range(sequences):
            fmt.crc([pieces[n][i] for n in row_tensors])
        out["crc_s"] = time.perf_counter() - a
        a = time.perf_counter()
        hashes = {n: fmt.sha256(t) for n, t in tensors.items()}
        out["sha256_s"] = time.perf_counter() - a
        a = time.perf_counter()
        data = save(tensors, metadata={"sha256": json.dumps(hashes)})
        out["serialize_s"] = time.perf_counter() - a
        file = os.path.join(scratch, "x.safetensors")
        with open(file, "wb") as f:
            a = time.perf_counter()
            f.write(data)
            f.flush()
            b = time.perf_counter()
            os.fsync(f.fileno())
            c = time.perf_counter()
        out["write_s"], out["fsync_s"] = b - a, c - b
        out["status"] = "ok"
    except Exception as exc:  # internals changed: say so, keep the rest of the results
        out.update(status="error", message=f"{type(exc).__name__}: {exc}"[:300])
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return out


def run_write(args) -> dict:
    torch = _setup(args)
    import topkd

    result = {"status": "error", "torch": torch.__version__, "threads": torch.get_num_threads()}
    try:
        import safetensors

        result["safetensors"] = safetensors.__version__
    except ImportError as exc:
        result.update(status="unavailable", message=f"{exc} (pip install topkd[store])")
        return result
    g = torch.Generator().manual_seed(args.seed)
    pools = {None: [], args.top_p: []}
    gen_s = select_s = select_p_s = 0.0
    kept = []
    for _ in range(args.pool):
        a = time.perf_counter()
        if args.rows == "lm":
            logits = lm_logits(args.seq_len, args.vocab, g)
        else:
            logits = teacher_logits(args.seq_len, args.vocab, g)
        b = time.perf_counter()
        pools[None].append(topkd.select_topk(logits, args.k))
        c = time.perf_counter()
        teacher_p = topkd.select_topk(logits, args.k, top_p=args.top_p)
        d = time.perf_counter()
        pools[args.top_p].append(teacher_p)
        kept.append((teacher_p.indices >= 0).sum(-1))
        gen_s += b - a
        select_s += c - b
        select_p_s += d - c
        del logits
    kept = torch.cat(kept).float()
    result["pool"] = {"sequences": args.pool, "rows": args.pool * args.seq_len,
                      "logits_s_per_seq": gen_s / args.pool,
                      "select_s_per_seq": select_s / args.pool,
                      "select_top_p_s_per_seq": select_p_s / args.pool,
                      "top_p_kept_mean": float(kept.mean()),
                      "top_p_kept_median": float(kept.median()),
                      "top_p_rows_cut": float((kept < args.k).float().mean())}
    sequences = max(1, args.tokens // args.seq_len)
    ids_of = [input_ids(args.seed, i, args.seq_len, args.vocab) for i in range(sequences)]
    # warm-up (imports, first calls), not timed: a small store of each kind
    for layout, top_p in store_configs(args):
        path = os.path.join(args.root, f".warm-up-{store_name(layout, top_p)}")
        _write_store(args, path, layout, top_p, pools[top_p], min(4, sequences), ids_of)
        shutil.rmtree(path)
    stores = []
    for layout, top_p in store_configs(args):
        name = store_name(layout, top_p)
        final = os.path.join(args.root, name)
        runs = []
        for run in range(args.write_runs):
            path = final if run == args.write_runs - 1 else os.path.join(args.root,
                                                                          f".{name}-{run}")
            timing = _write_store(args, path, layout, top_p, pools[top_p], sequences, ids_of)
            nbytes, shards = _shard_bytes_on_disk(path)
            timing.update(bytes=nbytes, shards=shards)
            runs.append(timing)
            if path != final:
                shutil.rmtree(path)
        tokens = sequences * args.seq_len
        times = [r["total_s"] for r in runs]
        median = statistics.median(times)
        nbytes = runs[-1]["bytes"]
        manifest_bytes = os.path.getsize(os.path.join(final, "manifest.json"))
        entries = _entries(final, args.k)
        entry = {"name": name, "path": final, "layout": layout, "top_p": top_p,
                 "sequences": sequences, "tokens": tokens, "bytes": nbytes,
                 "manifest_bytes": manifest_bytes, "entries": entries,
                 "shards": runs[-1]["shards"], "bytes_per_token": nbytes / tokens,
                 "total_bytes_per_token": (nbytes + manifest_bytes) / tokens,
                 "total_bytes_per_entry": (nbytes + manifest_bytes) / entries,
                 "kept_mean": args.k if top_p is None else float(kept.mean()),
                 "write_times_s": times, "write_median_s": median,
                 "write_tokens_per_s": tokens / median, "write_mb_per_s": nbytes / median / MB,
                 "write_runs": runs}
        print(f"  wrote {name}: {entry['total_bytes_per_token']:.1f} B/token, "
              f"{entry['total_bytes_per_entry']:.3f} B/entry, {tokens / median:,.0f} tokens/s, "
              f"{nbytes / median / MB:,.0f} MB/s", file=sys.stderr, flush=True)
        stores.append(entry)
    first = next((s for s in stores if s["layout"] in DTYPES and s["top_p"] is None), None)
    if first is not None:
        result["write_breakdown"] = _write_breakdown(args, first["path"], first["layout"],
                                                     pools[None], ids_of)
        result["write_breakdown"]["store"] = first["name"]
    result.update(status="ok", stores=stores)
    return result


# --------------------------------------------------------------------------------------------
# Child: read (one store, in a fresh process)
# --------------------------------------------------------------------------------------------


def _drop_cache(path) -> bool:
    """Ask the kernel to drop the shards' clean pages from the page cache (POSIX_FADV_DONTNEED;
    a request, which a virtual machine's host cache may undo)."""
    from topkd.store import format as fmt

    if not hasattr(os, "posix_fadvise"):
        return False
    for file in fmt.shard_files(path):
        fd = os.open(os.path.join(path, file), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def _read_breakdown(path, ids, tokens_of):
    """Per-sequence microseconds of the parts of a checked ``get``, each sequence's pages
    touched for the first time in this process (the reader's private internals; may fail if
    they change: reported instead). Then whole gets of the same ids on another fresh store
    object (first touch again), and again on that object (pages already mapped)."""
    from topkd.store import TeacherStore
    from topkd.store import format as fmt

    parts = {"token_hash": [], "slice": [], "crc": [], "build": [], "get": [], "get_again": []}
    try:
        store = TeacherStore(path)
        store.num_tokens()  # opens every shard
        for sid in ids:
            number, position = store._where[sid]
            shard = store._shard(number)
            tokens = tokens_of(sid)
            a = time.perf_counter()
            ok = fmt.token_hash(tokens) == bytes(shard.token_hash[position].tolist())
            b = time.perf_counter()
            sliced = shard.parts(position)
            c = time.perf_counter()
            ok &= shard.checksum(sliced) == shard.crc[position]
            d = time.perf_counter()
            shard.rows(sliced, position)
            e = time.perf_counter()
            if not ok:
                raise ValueError(f"{sid}: check failed")
            for key, value in (("token_hash", b - a), ("slice", c - b), ("crc", d - c),
                               ("build", e - d)):
                parts[key].append(value * 1e6)
        del store
        store = TeacherStore(path)
        store.num_tokens()
        for key in ("get", "get_again"):
            for sid in ids:
                tokens = tokens_of(sid)
                a = time.perf_counter()
                store.get(sid, tokens)
                parts[key].append((time.perf_counter() - a) * 1e6)
    except Exception as exc:
        return {"status": "error", "message": f"{type(exc).__name__}: {exc}"[:300]}
    out = {key: statistics.median(v) for key, v in parts.items()}
    out.update(status="ok", sequences=len(ids))
    return out


def run_read(args, path) -> dict:
    import torch

    torch.set_num_threads(args.read_threads)
    from topkd.store import TeacherStore

    result = {"status": "error", "threads": torch.get_num_threads()}
    a = time.perf_counter()
    store = TeacherStore(path, k=args.k, vocab_size=args.vocab)
    store.num_tokens()  # opens every shard
    result["open_s"] = time.perf_counter() - a
    ids = store.ids()
    length = args.seq_len
    index = {sid: int(sid.rsplit("-", 1)[1]) for sid in ids}
    tokens = {sid: input_ids(args.seed, index[sid], length, args.vocab) for sid in ids}
    count = min(len(ids), args.read_seqs) if args.read_seqs else len(ids)
    rng = random.Random(args.seed + 1)
    orders = [rng.sample(ids, count) for _ in range(args.runs + 1)]  # the first: warm-up
    result.update(sequences_in_store=len(ids), sequences_per_run=count,
                  tokens_per_run=count * length, drop_cache=args.drop_cache)
    # the stored rows must be the ones written: spot-check one sequence's shape
    teacher = store.get(ids[0], tokens[ids[0]])
    if tuple(teacher.indices.shape) != (length, args.k):
        raise ValueError(f"read back shape {tuple(teacher.indices.shape)}")
    del store, teacher
    batch = args.batch

    def checked(s, order):
        for sid in order:
            s.get(sid, tokens[sid])

    def unchecked(s, order):
        for sid in order:
            s.get(sid)

    def collate(s, order):
        for lo in range(0, len(order) - batch + 1, batch):
            group = order[lo:lo + batch]
            s.collate(group, input_ids=[tokens[sid] for sid in group])

    modes = {}
    for mode, fn, verify in (("checked", checked, True), ("unchecked", unchecked, False),
                             ("collate", collate, True)):
        times, cpu_times = [], []
        for run, order in enumerate(orders):
            # a fresh store object per run: its memory maps are new, so every sequence's pages
            # are touched for the first time in this process, as in one epoch of training
            s = TeacherStore(path, verify_reads=verify)
            s.num_tokens()  # opens every shard, not timed
            if args.drop_cache:
                _drop_cache(path)
            a, cpu = time.perf_counter(), time.process_time()
            fn(s, order)
            if run:  # run 0 is the warm-up (first calls), not counted
                times.append(time.perf_counter() - a)
                cpu_times.append(time.process_time() - cpu)
            del s
        median = statistics.median(times)
        seqs = count if mode != "collate" else (count // batch) * batch
        modes[mode] = {"times_s": times, "median_s": median, "sequences": seqs,
                       "seq_per_s": seqs / median, "tokens_per_s": seqs * length / median,
                       "cpu_times_s": cpu_times,
                       "cpu_tokens_per_s": seqs * length / min(cpu_times)}
        if mode == "collate":
            modes[mode]["batches_per_s"] = (count // batch) / median
    result["modes"] = modes
    rng.shuffle(ids)
    result["breakdown"] = _read_breakdown(path, ids[:min(len(ids), 128)], tokens.__getitem__)
    result["status"] = "ok"
    return result


# --------------------------------------------------------------------------------------------
# Child: loss from the store vs online
# --------------------------------------------------------------------------------------------


def run_loss(args) -> dict:
    torch = _setup(args)
    import topkd
    from topkd import SparseTeacher
    from topkd.store import TeacherStore, TeacherStoreWriter

    b, length, v, k = args.loss_batch, args.loss_seq_len, args.vocab, args.k
    result = {"status": "error", "batch": b, "seq_len": length, "rows": b * length}
    ids = [sample_id(i) for i in range(b)]
    tokens = [input_ids(args.seed + 7, i, length, v) for i in range(b)]
    cases = []
    for kind in ("lm", "normal"):
        g = torch.Generator().manual_seed(args.seed + 7)
        a = time.perf_counter()
        if kind == "lm":
            logits = lm_logits(b * length, v, g)
        else:
            logits = torch.randn(b * length, v, generator=g)
        student = 0.8 * logits + 1.2 * torch.randn(b * length, v, generator=g)
        student, logits = student.reshape(b, length, v), logits.reshape(b, length, v)
        result[f"make_{kind}_s"] = time.perf_counter() - a
        with torch.no_grad():
            for top_p in (None, args.top_p):
                a = time.perf_counter()
                online = float(topkd.topk_kl_loss(student, logits, k, top_p=top_p,
                                                  reduction="mean"))
                online_s = time.perf_counter() - a
                teacher = topkd.select_topk(logits, k, top_p=top_p)
                for layout in args.layouts:
                    path = os.path.join(args.root, f"loss-{kind}-{store_name(layout, top_p)}")
                    with TeacherStoreWriter(path, k=k, vocab_size=v, top_p=top_p,
                                            **writer_layout(layout)) as writer:
                        for i in range(b):
                            writer.add(ids[i], tokens[i], SparseTeacher(
                                teacher.indices[i], teacher.logprobs[i],
                                teacher.rest_logprob[i], teacher.temperature,
                                teacher.vocab_size))
                    batch = TeacherStore(path, k=k, vocab_size=v).collate(ids,
                                                                          input_ids=tokens)
                    a = time.perf_counter()
                    stored = float(topkd.sparse_kl_loss(student, batch, reduction="mean"))
                    stored_s = time.perf_counter() - a
                    used = teacher.indices >= 0
                    same_indices = bool(torch.equal(batch.indices.sort(-1).values,
                                                    teacher.indices.sort(-1).values))
                    # entries paired by index (the codecs may reorder ties)
                    order_a = batch.indices.clamp(min=0).argsort(-1)
                    order_b = teacher.indices.clamp(min=0).argsort(-1)
                    mine = batch.logprobs.gather(-1, order_a)[used.gather(-1, order_b)]
                    theirs = teacher.logprobs.gather(-1, order_b)[used.gather(-1, order_b)]
                    finite = torch.isfinite(theirs)
                    diff = (mine[finite] - theirs[finite]).abs()
                    cases.append({
                        "rows": kind, "layout": layout, "top_p": top_p, "online": online,
                        "stored": stored, "rel_diff": abs(stored - online) / abs(online),
                        "max_logprob_diff": float(diff.max()),
                        "same_indices": same_indices,
                        "kept_mean": float(used.sum(-1).float().mean()),
                        "online_s": online_s, "stored_loss_s": stored_s,
                    })
                    shutil.rmtree(path)
                    print(f"  loss {kind} {store_name(layout, top_p)}: rel diff "
                          f"{cases[-1]['rel_diff']:.2e}", file=sys.stderr, flush=True)
        del student, logits, teacher
    result.update(status="ok", cases=cases)
    return result


# --------------------------------------------------------------------------------------------
# Parent
# --------------------------------------------------------------------------------------------


def _run_child(args, phase, *job) -> dict:
    """One phase (``run_write``, ``run_read``, ``run_loss``) in a fresh process; its wall time,
    process start included, as ``process_s``."""
    t0 = time.perf_counter()
    result = harness.run_child(f"benchmarks.store:{phase}", vars(args), *job,
                               timeout=args.timeout, echo=True)
    result["process_s"] = time.perf_counter() - t0
    return result


def _filesystem(path):
    """The filesystem type of ``path`` from /proc/mounts (longest matching mount point)."""
    try:
        path = os.path.realpath(path)
        best, kind = "", None
        with open("/proc/mounts") as f:
            for line in f:
                fields = line.split()
                mount = fields[1]
                if (path == mount or path.startswith(mount.rstrip("/") + "/")) and \
                        len(mount) >= len(best):
                    best, kind = mount, fields[2]
        return kind
    except OSError:
        return None


def _git_state():
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here,
                              capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "."], cwd=os.path.join(
            here, ".."), capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{head}{' + uncommitted changes in topkd/' if dirty else ''}" if head else None


# --------------------------------------------------------------------------------------------
# Table
# --------------------------------------------------------------------------------------------


def _rate(x):
    if x >= 1e6:
        return f"{x / 1e6:.2f} M"
    if x >= 1e3:
        return f"{x / 1e3:.1f} k"
    return f"{x:.0f}"


def _rate_spread(mode, batch=1):
    """`` [slowest-fastest]`` run of a read mode, in its unit (sequences or batches per s)."""
    times = mode.get("times_s") or []
    if len(times) < 2:
        return ""
    units = mode["sequences"] / batch
    return f" [{units / max(times):,.0f}-{units / min(times):,.0f}]"


def _upgrade(saved) -> None:
    """Results saved before layouts (format-1 stores by ``dtype``) in today's terms."""
    for s in saved["results"]:
        if "layout" not in s:
            s["layout"] = s["dtype"]
            s["entries"] = round(s["kept_mean"] * s["tokens"])
            total = s["bytes"] + s["manifest_bytes"]
            s["total_bytes_per_token"] = total / s["tokens"]
            s["total_bytes_per_entry"] = total / s["entries"]
    for c in (saved.get("loss") or {}).get("cases", []):
        c.setdefault("layout", c.get("dtype"))
        c.setdefault("rows", "peaked")


def format_table(saved) -> str:
    _upgrade(saved)
    meta, stores = saved["meta"], saved["results"]
    k = meta["k"]
    lines = [
        f"Teacher store: K = {k}, V = {meta['vocab']:,}, {meta['tokens']:,} tokens per store "
        f"({meta['sequences']:,} sequences of {meta['seq_len']:,}), shard_bytes = "
        f"{meta['shard_bytes'] / MiB:g} MiB, {meta.get('write_runs', meta['runs'])} write(s) "
        f"per store, {meta['runs']} read runs, torch {meta['torch']}, "
        f"safetensors {meta.get('safetensors')}, {meta['threads']} threads, stores in "
        f"{meta['dir']} ({meta.get('filesystem') or 'filesystem unknown'}), topkd "
        f"{meta.get('git') or 'unknown revision'}",
    ]
    load = harness.load_line(meta)
    if load:
        lines += ["", load]
    pool = meta.get("pool")
    if pool:
        made = ("LM-like logits (Zipf by rank, logit -log r, random token order per row)"
                if meta.get("rows", "peaked") == "lm" else
                f"bf16 logits 3 N(0, 1) + 1-3 peaked tokens per row at U({PEAK_LOW:g}, "
                f"{PEAK_HIGH:g})")
        lines += ["", f"Teacher rows: a pool of {pool['sequences']} distinct sequences "
                      f"({pool['rows']:,} rows) from topkd.select_topk over {made} "
                      f"(per sequence: making the logits "
                      f"{pool['logits_s_per_seq']:.1f} s, select_topk "
                      f"{pool['select_s_per_seq']:.1f} s, with top-p "
                      f"{pool.get('select_top_p_s_per_seq', float('nan')):.1f} s; not timed), "
                      f"reused under distinct sample ids and random token ids for every "
                      f"sequence of the store. With top_p = {meta['top_p']:g} a row keeps "
                      f"{pool['top_p_kept_mean']:.1f} entries on average (median "
                      f"{pool['top_p_kept_median']:.0f}; {100 * pool['top_p_rows_cut']:.0f}% of "
                      f"the rows keep fewer than K)."]
    lines += ["",
              "| layout | top-p | kept / row | B / token | B / kept entry | "
              "write tok/s | write MB/s (median [min-max]) | read checked seq/s (tok/s) "
              "[slowest-fastest run] | read checked tok/s of CPU time | read unchecked seq/s "
              "(tok/s) [runs] | collate x"
              + str(meta["batch"]) + " batches/s (tok/s) [runs] |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in stores:
        top_p = "-" if s["top_p"] is None else f"{s['top_p']:g}"
        layout = s["layout"] if s["layout"] in ("compact", "exact") else \
            f"format 1, {s['layout']}"
        row = (f"| {layout} | {top_p} | {s['entries'] / s['tokens']:.1f} "
               f"| {s['total_bytes_per_token']:.1f} | {s['total_bytes_per_entry']:.3f} "
               f"| {_rate(s['write_tokens_per_s'])} | {s['write_mb_per_s']:,.0f}"
               f"{harness.spread(s['write_times_s'], ' s')} |")
        read = s.get("read") or {}
        if read.get("status") == "ok":
            m = read["modes"]
            row += (f" {m['checked']['seq_per_s']:,.0f} ({_rate(m['checked']['tokens_per_s'])})"
                    f"{_rate_spread(m['checked'])} "
                    f"| {_rate(m['checked'].get('cpu_tokens_per_s', float('nan')))} "
                    f"| {m['unchecked']['seq_per_s']:,.0f} "
                    f"({_rate(m['unchecked']['tokens_per_s'])}){_rate_spread(m['unchecked'])} "
                    f"| {m['collate']['batches_per_s']:,.0f} "
                    f"({_rate(m['collate']['tokens_per_s'])})"
                    f"{_rate_spread(m['collate'], batch=meta['batch'])} |")
        else:
            row += f" {read.get('status', 'not run')} | - | - | - |"
        lines.append(row)
    seq_note = meta.get("read_seqs_per_run")
    lines += [
        "",
        "B / token and B / kept entry: every byte on disk (shard files and manifest; token "
        "ids, ghost log-masses, offsets, hashes and checksums included) over the token rows and "
        "over "
        "the kept entries. write = the writer alone (construction, add of every "
        "sequence, close; each shard and the directory fsynced), median of the writes after "
        "an untimed warm-up write, MB = 10^6 B of shards. read = a fresh process with "
        f"{meta.get('read_threads', '?')} torch thread(s) (a DataLoader worker has 1), sample "
        "ids in random order"
        + (f", {seq_note:,} sequences per run" if seq_note else "")
        + ", median of the runs after an untimed warm-up run, each run on a new store object "
        "(new memory maps: first touch of every page in the process, as in one epoch; shards "
        "opened before the clock); tok/s of CPU time: the fastest run's tokens over the "
        "process's CPU time (time.process_time), what a worker that has a core to itself "
        "reads, on a busy machine too: checked = store.get(id, "
        "input_ids) (the sequence's checksum, CRC-32 in format 1, XXH3-64 in format 3, and "
        "its token hash checked); unchecked = store.get(id) with "
        "verify_reads=False (nothing checked); "
        f"collate = store.collate of {meta['batch']} ids with their input_ids (checked) into "
        f"[{meta['batch']}, {meta['seq_len']}, {k}]. "
        + ("The page cache was asked to drop the shards before every run "
           "(POSIX_FADV_DONTNEED)." if meta.get("drop_cache") else
           "The shards were just written, so the OS page cache holds them: reads come from "
           "memory (mapped pages), not from the disk."),
    ]
    wb = meta.get("write_breakdown")
    if wb and wb.get("status") == "ok":
        size = wb["shard_bytes"]
        parts = [("packing rows in add (writer._rows)", wb["pack_rows_s"]),
                 ("token hash", wb["token_hash_s"]), ("torch.cat", wb["cat_s"]),
                 ("CRC-32 per sequence", wb["crc_s"]), ("SHA-256 per tensor", wb["sha256_s"]),
                 ("safetensors serialize", wb["serialize_s"]), ("file write", wb["write_s"]),
                 ("fsync", wb["fsync_s"])]
        total = sum(t for _, t in parts)
        lines += ["", f"Write breakdown, one shard of {wb['store']} ({size / MB:,.0f} MB, "
                      f"{wb['sequences']} sequences), each part timed alone: "
                  + "; ".join(f"{name} {t:.3f} s ({size / t / MB:,.0f} MB/s)"
                              for name, t in parts)
                  + f"; sum {total:.2f} s = {size / total / MB:,.0f} MB/s."]
    elif wb:
        lines += ["", f"Write breakdown: {wb.get('message')}"]
    for s in stores:
        if s["top_p"] is not None:
            continue
        run = sorted(s["write_runs"], key=lambda r: r["total_s"])[len(s["write_runs"]) // 2]
        lines.append(
            f"Write time of {s['name']} (median run, {run['total_s']:.2f} s): opening the "
            f"writer {run['open_s']:.3f} s, add() packing the rows {run['rows_s']:.2f} s, "
            f"writing {run['shards']} shard(s) (flush: checksums, SHA-256, serialize, write, "
            f"fsync) "
            f"{run['flush_s']:.2f} s.")
    for s in stores:
        bd = (s.get("read") or {}).get("breakdown")
        if bd and bd.get("status") == "ok" and s["top_p"] is None:
            lines.append(
                f"Read breakdown, {s['name']}, median us per sequence of {meta['seq_len']:,} "
                f"rows ({bd['sequences']} sequences, first touch): token hash "
                f"{bd['token_hash']:.0f}, "
                f"safetensors slicing {bd['slice']:.0f}, checksum {bd['crc']:.0f}, building the "
                f"SparseTeacher {bd['build']:.0f}; a whole checked get {bd['get']:.0f}, "
                f"{bd['get_again']:.0f} when read again by the same store object (its pages "
                f"already mapped).")
    for s in stores:
        read = s.get("read") or {}
        if read.get("status") == "ok":
            continue
        lines.append(f"- read {s['name']}: {read.get('status')}: {read.get('message', '')}")
    loss = saved.get("loss")
    if loss and loss.get("status") == "ok":
        lines += ["", f"Loss from the store vs online, {loss['batch']} x {loss['seq_len']:,} "
                      f"rows at V = {meta['vocab']:,}, LM-like (Zipf by rank, random order) "
                      f"and random-normal N(0, 1) teacher logits, student = 0.8 t + 1.2 N(0, 1), "
                      f"float32, reduction = 'mean':", "",
                  "| rows | layout | top-p | kept / row | online topk_kl_loss | sparse_kl_loss "
                  "from the store | rel diff | max abs log-prob diff | same indices |",
                  "|---|---|---|---:|---:|---:|---:|---:|---|"]
        for c in loss["cases"]:
            top_p = "-" if c["top_p"] is None else f"{c['top_p']:g}"
            rows = {"lm": "LM-like", "normal": "normal"}.get(c["rows"], c["rows"])
            lines.append(f"| {rows} | {c['layout']} | {top_p} | {c['kept_mean']:.1f} "
                         f"| {c['online']:.7g} | {c['stored']:.7g} | {c['rel_diff']:.1e} "
                         f"| {c['max_logprob_diff']:.1e} "
                         f"| {'yes' if c['same_indices'] else 'no'} |")
        lines += ["", "rel diff = |L_store - L_online| / |L_online|; same indices: the same "
                      "set per row (the compact codec may order entries its rounding ties "
                      "otherwise)."]
    elif loss:
        lines += ["", f"Loss comparison: {loss.get('status')}: {loss.get('message', '')}"]
    if meta.get("command"):
        lines += ["", f"Command: `{meta['command']}`"]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def build_parser():
    p = argparse.ArgumentParser(
        prog="python -m benchmarks store",
        description="Teacher store section: bytes per token on disk, write throughput "
                    "(fsync included), random-access read throughput in a fresh process, and "
                    "the loss from the store against the online Top-K loss, for the compact "
                    "and exact codecs and the format-1 layout, without and with top-p.")
    p.add_argument("--k", type=int, default=64, help="entries per row K (64)")
    p.add_argument("--vocab", type=int, default=151_936, help="vocabulary V (151936)")
    p.add_argument("--tokens", type=int, default=1_048_576,
                   help="token rows per store, rounded down to whole sequences (1048576 = "
                        "512 x 2048; ~400 MB at bf16)")
    p.add_argument("--seq-len", type=int, default=2048, help="rows per sequence (2048)")
    p.add_argument("--runs", type=int, default=3,
                   help="read runs per mode (each of --read-seqs sequences); median reported (3)")
    p.add_argument("--write-runs", type=int, default=1,
                   help="writes of each store (of --tokens each); median reported (1)")
    p.add_argument("--pool", type=int, default=4,
                   help="distinct teacher sequences made by select_topk and reused (4)")
    p.add_argument("--top-p", type=float, default=0.95, help="top_p of the second row (0.95)")
    p.add_argument("--layouts", nargs="+", choices=LAYOUTS,
                   default=["compact", "exact", "float16"],
                   help="the stores' layouts: codecs compact and exact (format 2), or the "
                        "format-1 layout with that log-prob dtype (compact exact float16)")
    p.add_argument("--rows", choices=ROW_KINDS, default="lm",
                   help="the stored teacher rows: lm (Zipf by rank, random order) or peaked "
                        "(3 N(0, 1) + 1-3 peaked tokens) (lm)")
    p.add_argument("--shard-bytes", type=harness.int_bytes, default=256 * MiB,
                   help="the writer's shard_bytes (256MiB, its default)")
    p.add_argument("--read-seqs", type=int, default=256,
                   help="sequences read per run, distinct, random order (256; 0: all)")
    p.add_argument("--read-threads", type=int, default=1,
                   help="torch threads of the reading process (1, as in a DataLoader worker)")
    p.add_argument("--batch", type=int, default=8, help="sequences per collate batch (8)")
    p.add_argument("--loss-batch", type=int, default=4, help="sequences of the loss batch (4)")
    p.add_argument("--loss-seq-len", type=int, default=512,
                   help="rows per sequence of the loss batch (512)")
    p.add_argument("--no-loss", dest="loss", action="store_false",
                   help="skip the loss comparison")
    p.add_argument("--drop-cache", action="store_true",
                   help="ask the kernel to drop the shards from the page cache before every "
                        "read run (posix_fadvise DONTNEED; the host of a VM may still cache)")
    p.add_argument("--dir", default=None,
                   help="where to make the temporary stores (default: the system temp dir); "
                        "a fresh subdirectory, removed after unless --keep")
    p.add_argument("--keep", action="store_true", help="keep the stores (path printed)")
    p.add_argument("--seed", type=int, default=0, help="seed of the logits and token ids (0)")
    harness.add_process_options(p, mem_limit=False)
    harness.add_output_options(p)
    return p


def main(argv) -> int:
    args = build_parser().parse_args(argv)
    if args.load:
        harness.show_saved(args, format_table)
        return 0
    if args.seq_len < 1 or args.tokens < args.seq_len or min(args.runs, args.write_runs,
                                                             args.pool, args.batch) < 1:
        raise SystemExit("need --seq-len >= 1, --tokens >= --seq-len, and --runs, --write-runs, "
                         "--pool, --batch >= 1")

    t_start = time.perf_counter()
    load_start = harness.loadavg()
    root = tempfile.mkdtemp(prefix="topkd-bench-store-", dir=args.dir)
    args.root = root
    loss = None
    try:
        sequences = args.tokens // args.seq_len
        print(f"[1/3] write: pool of {args.pool} teacher sequences, then "
              f"{len(store_configs(args))} stores of {sequences * args.seq_len:,} tokens x "
              f"{args.write_runs} write(s) in {root} ...", file=sys.stderr, flush=True)
        written = _run_child(args, "run_write")
        if written.get("status") != "ok":
            print(f"write failed: {written.get('message')}", file=sys.stderr)
            return 1
        stores = written["stores"]
        for n, s in enumerate(stores, 1):
            print(f"[2/3] read {s['name']} ({n}/{len(stores)}) in a fresh process ...",
                  file=sys.stderr, flush=True)
            s["read"] = _run_child(args, "run_read", s["path"])
            r = s["read"]
            if r.get("status") == "ok":
                m = r["modes"]
                print(f"        checked {m['checked']['seq_per_s']:,.0f} seq/s, unchecked "
                      f"{m['unchecked']['seq_per_s']:,.0f} seq/s, collate "
                      f"{m['collate']['batches_per_s']:,.0f} batches/s", file=sys.stderr,
                      flush=True)
            else:
                print(f"        {r.get('status')}: {r.get('message')}", file=sys.stderr)
        if args.loss:
            print(f"[3/3] loss: {args.loss_batch} x {args.loss_seq_len} rows, store vs online "
                  "...", file=sys.stderr, flush=True)
            loss = _run_child(args, "run_loss")
    finally:
        if args.keep:
            print(f"stores kept in {root}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)

    meta = {
        "k": args.k, "vocab": args.vocab, "tokens": sequences * args.seq_len,
        "sequences": sequences, "seq_len": args.seq_len, "runs": args.runs,
        "write_runs": args.write_runs,
        "pool": written.get("pool"), "top_p": args.top_p, "layouts": args.layouts,
        "rows": args.rows,
        "shard_bytes": args.shard_bytes, "batch": args.batch,
        "read_threads": args.read_threads,
        "read_seqs_per_run": (stores[0].get("read") or {}).get("sequences_per_run"),
        "drop_cache": args.drop_cache, "torch": written.get("torch"),
        "safetensors": written.get("safetensors"), "threads": written.get("threads"),
        "dir": args.dir or tempfile.gettempdir(),
        "filesystem": _filesystem(args.dir or tempfile.gettempdir()),
        "write_breakdown": written.get("write_breakdown"), "git": _git_state(),
        **harness.run_meta("store", argv, t_start, load_start),
    }
    for s in stores:
        s.pop("path", None)
    harness.emit(args, {"meta": meta, "results": stores, "loss": loss}, format_table)
    ok = all((s.get("read") or {}).get("status") == "ok" for s in stores)
    return 0 if ok and (loss is None or loss.get("status") == "ok") else 1
