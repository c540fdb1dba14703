"""Fused section, a head sharded by vocabulary rows (FSDP2's DTensor ``Shard(0)``):
``python -m benchmarks fused --sharded-ranks W`` (with the fused section's shape options).

Three cases, each in its own child process (:func:`benchmarks.harness.run_child`) that spawns
its ranks (gloo on this machine, a file rendezvous):

* ``one process``: ``fused_kl_loss(hidden, weight, (teacher_hidden, teacher_weight))`` (or
  ``fused_topk_kl_loss`` against teacher logits, ``--loss topk``) with the whole head, N tokens:
  the baseline, the same per-rank batch.
* ``vocab_parallel`` and ``gather`` at W ranks: each rank N tokens of its own, the student's
  and the teacher's heads DTensors ``Shard(0)`` on a 1-D mesh (``distribute_tensor``), the
  loss with ``sharded_head=`` that design.

Per rank: the peak of one forward + backward above what was allocated before it (the
profiler's allocations, ``profile_memory=True``, walked in time order as in the fused section),
not counting the returned gradients (``hidden.grad`` and the head's gradient, this rank's
rows); the float32 accumulator of the head's gradient *is* counted (it is work memory here,
the same way in every case). Also the raw peak, and the median forward + backward time of
``--repeats`` runs after one warm-up. The table gives the largest over the ranks and each
against one process. Ranks share the machine's cores (``--threads`` per rank, default 1).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import tempfile
import time

from . import harness
from .harness import MiB

DESIGNS = ("one process", "vocab_parallel", "gather")


def _rank(rank, world, settings, design, tmp):
    import argparse
    from datetime import timedelta

    result = {"rank": rank}
    args = argparse.Namespace(**settings)
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(args.threads or 1)
        if world > 1:
            dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank,
                                    world_size=world, timeout=timedelta(seconds=600))
        result.update(_measure(torch, args, rank, world, design))
        result["status"] = "ok"
        if world > 1:
            dist.barrier()
    except Exception as exc:  # noqa: BLE001
        import traceback

        traceback.print_exc()
        result.update(status="error", message=f"{type(exc).__name__}: {str(exc)[:400]}")
    with open(os.path.join(tmp, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def _inputs(torch, args, rank, loss):
    """This rank's tokens (seeded by rank) and the whole heads (the same on every rank)."""
    dtype = getattr(torch, args.dtype)
    n, h, v, ht = args.tokens, args.hidden, args.vocab, args.teacher_hidden
    g = torch.Generator().manual_seed(args.seed)
    weight = torch.empty(v, h, dtype=dtype)
    t_weight = torch.empty(v, ht, dtype=dtype)
    step = 16384
    for lo in range(0, v, step):
        hi = min(v, lo + step)
        weight[lo:hi] = torch.randn(hi - lo, h, generator=g) * (2.0 / math.sqrt(h))
        t_weight[lo:hi] = torch.randn(hi - lo, ht, generator=g) * (2.0 / math.sqrt(ht))
    g = torch.Generator().manual_seed(args.seed + 1 + rank)
    hidden = torch.randn(n, h, generator=g).to(dtype)
    t_hidden = torch.randn(n, ht, generator=g).to(dtype)
    d = {"hidden": hidden, "weight": weight, "t_hidden": t_hidden, "t_weight": t_weight}
    if loss == "topk":  # teacher logits of this rank's tokens, every column
        with torch.no_grad():
            d["t_logits"] = torch.cat([t_hidden[i:i + 256] @ t_weight.T
                                       for i in range(0, n, 256)])
        del d["t_weight"]
    return d


def _measure(torch, args, rank, world, design):
    from torch.profiler import ProfilerActivity, profile

    import topkd

    loss = args.loss[0]
    d = _inputs(torch, args, rank, loss)
    if design != "one process":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (world,))
        for key in ("weight", "t_weight"):
            if key in d:
                d[key] = distribute_tensor(d[key], mesh, [Shard(0)])
        options = {"sharded_head": design}
    else:
        options = {}
    hidden, weight = d["hidden"].requires_grad_(True), d["weight"].requires_grad_(True)
    options.update(temperature=args.temperature, reduction=args.reduction,
                   chunk_bytes=args.chunk_bytes, impl=args.kernels[0])
    if loss == "topk":
        def fn():
            return topkd.fused_topk_kl_loss(hidden, weight, d["t_logits"], args.k, **options)
    else:
        def fn():
            return topkd.fused_kl_loss(hidden, weight, (d["t_hidden"], d["t_weight"]),
                                       **options)
    values = {}

    def step():
        hidden.grad = weight.grad = None
        out = fn()
        (out.sum() if out.dim() else out).backward()
        values["loss"] = float(out.detach().sum())

    out = {"first_call_s": harness.first_call(step)}
    hidden.grad = weight.grad = None
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    allocs = harness.allocations(prof)
    grad = weight.grad
    local = grad.to_local() if hasattr(grad, "to_local") else grad
    ptrs = {"hidden": hidden.grad.untyped_storage().data_ptr(),
            "weight": local.untyped_storage().data_ptr()}
    peak, raw, excluded, notes = harness.peak_excluding(allocs, ptrs, None)
    out.update(peak_bytes=peak, raw_peak_bytes=raw, excluded_bytes=excluded, excluded=notes,
               local_rows=int(local.shape[0]), loss_value=values["loss"])
    del prof, allocs
    out["times_s"] = harness.timed(step, args.repeats)
    out["median_s"] = statistics.median(out["times_s"])
    return out


def run_case(args, design) -> dict:
    """One design, in the harness's child: its ranks spawned, their results gathered."""
    import torch.multiprocessing as mp

    world = 1 if design == "one process" else args.sharded_ranks
    result = {"design": design, "ranks": world, "status": "error"}
    with tempfile.TemporaryDirectory(prefix="topkd-sharded-") as tmp:
        ctx = mp.start_processes(_rank, args=(world, vars(args), design, tmp), nprocs=world,
                                 join=False, start_method="spawn")
        deadline = time.monotonic() + args.timeout
        try:
            while not ctx.join(timeout=5):
                if time.monotonic() > deadline:
                    result["message"] = f"the ranks did not finish within {args.timeout} s"
                    return result
        except Exception as exc:  # noqa: BLE001  (a rank that died)
            result["message"] = f"{type(exc).__name__}: {str(exc)[:400]}"
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        per_rank = []
        for r in range(world):
            path = os.path.join(tmp, f"rank{r}.json")
            if not os.path.exists(path):
                result["message"] = result.get("message", f"rank {r} wrote no result")
                return result
            with open(path) as f:
                per_rank.append(json.load(f))
    result["per_rank"] = per_rank
    bad = [r for r in per_rank if r["status"] != "ok"]
    if bad:
        result["message"] = f"rank {bad[0]['rank']}: {bad[0].get('message')}"
        return result
    result.update(status="ok", peak_bytes=max(r["peak_bytes"] for r in per_rank),
                  raw_peak_bytes=max(r["raw_peak_bytes"] for r in per_rank),
                  median_s=max(r["median_s"] for r in per_rank))
    return result


def format_table(results, meta) -> str:
    base = next((r for r in results if r["design"] == "one process" and r["status"] == "ok"),
                None)
    lines = [
        f"Sharded head (DTensor Shard(0)), {meta['ranks']} ranks: N = {meta['tokens']:,} tokens "
        f"per rank, H = {meta['hidden']:,}, V = {meta['vocab']:,}, H_t = "
        f"{meta['teacher_hidden']:,}, loss {meta['loss']}"
        + (f" (K = {meta['k']:,})" if meta["loss"] == "topk" else "")
        + f", {meta['dtype']}, reduction = {meta['reduction']!r}, impl = {meta['impl']}, "
        f"torch {meta['torch']}, {meta['threads']} thread(s) per rank, repeats = "
        f"{meta['repeats']}"]
    load = harness.load_line(meta)
    if load:
        lines += ["", load]
    lines += ["", "| case | ranks | per-rank peak excl. returned grads (MiB) | x one process "
                  "| raw peak (MiB) | fwd+bwd s | x one process |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        if r["status"] != "ok":
            lines.append(f"| {r['design']} | {r['ranks']} | {r['status']}: "
                         f"{r.get('message', '')[:200]} | - | - | - | - |")
            continue
        ratio = (f"{r['peak_bytes'] / base['peak_bytes']:.3f}" if base else "-")
        t_ratio = (f"{r['median_s'] / base['median_s']:.2f}" if base else "-")
        lines.append(f"| {r['design']} | {r['ranks']} | {r['peak_bytes'] / MiB:,.0f} | {ratio} "
                     f"| {r['raw_peak_bytes'] / MiB:,.0f} | {r['median_s']:.2f} | {t_ratio} |")
    lines += ["", "Per-rank peak: bytes allocated during one forward + backward (the profiler's "
                  "allocations), less the returned hidden and head gradients (this rank's rows "
                  "of the head) while alive; the head gradient's float32 accumulator counts. "
                  "The largest over the ranks; time: the largest of the ranks' medians."]
    return "\n".join(lines)


def main(args, argv) -> int:
    """``python -m benchmarks fused --sharded-ranks W``: the three cases, then the table."""
    if args.load:
        harness.show_saved(args, lambda saved: format_table(saved["results"], saved["meta"]))
        return 0
    t_start = time.perf_counter()
    load_start = harness.loadavg()
    results = harness.run_cases(
        DESIGNS, lambda design: f"{design} ({args.loss[0]})",
        lambda design: {"design": design, "ranks": 1 if design == "one process" else
                        args.sharded_ranks,
                        **harness.run_child("benchmarks.sharded:run_case", vars(args), design,
                                            timeout=args.timeout + 60)},
        lambda r: (f"peak {r['peak_bytes'] / MiB:,.0f} MiB excl. grads, raw "
                   f"{r['raw_peak_bytes'] / MiB:,.0f} MiB, {r['median_s']:.2f} s"))
    import torch

    meta = {"ranks": args.sharded_ranks, "tokens": args.tokens, "hidden": args.hidden,
            "vocab": args.vocab, "teacher_hidden": args.teacher_hidden, "k": args.k,
            "loss": args.loss[0], "dtype": args.dtype, "reduction": args.reduction,
            "impl": args.kernels[0], "torch": torch.__version__, "threads": args.threads or 1,
            "repeats": args.repeats,
            **harness.run_meta("fused", argv, t_start, load_start)}
    harness.emit(args, {"meta": meta, "results": results},
                 lambda saved: format_table(saved["results"], saved["meta"]))
    print("", file=sys.stderr)
    return 0 if all(r["status"] == "ok" for r in results) else 1
