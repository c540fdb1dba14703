"""Benchmark, Megatron section: ``python -m benchmarks megatron``.

The Model-Optimizer Megatron criteria on the same ``[s, b, V/TP]`` logits, tensor-parallel:
topkd's ``TopKLogitsKLLoss`` and ``LogitsKLLoss`` (:mod:`topkd.integrations.modelopt`, default
``normalize="full"``: the K kept entries plus the exact ghost bucket) against Model-Optimizer
0.47's classes of the same names (``modelopt.torch.distill.plugins.megatron``: the Top-K loss
renormalized over the K entries; the whole-vocabulary loss as partial sums with
``tp_reduce=True``). Both run in megatron-core's ``parallel_state`` with TP gloo ranks on this
machine (CPU), or with ``--device cuda`` on GPUs.

Each case runs in its own fresh process (:mod:`benchmarks.harness`), which starts the TP ranks;
every rank caps its own address space, makes its shard of the student logits (requiring grad)
and of the teacher logits in the input dtype (rank-seeded, in row chunks), then:

* **per-rank peak above inputs**: one forward + backward (``loss.sum().backward()``) under
  ``torch.profiler`` with ``profile_memory=True``, the allocator events walked in time order,
  running maximum, above what was allocated before (the two logits shards). It includes the
  returned student gradient (1.0x the local logits), as the core section does. The table gives
  the largest over the ranks.
* **x local logits**: that peak over the bytes of the rank's ``[s, b, V/TP]`` student logits.
  The bound asked of topkd's adapters is 1.25x.
* **fwd+bwd s**: median of ``--repeats`` runs after a warm-up, each between two barriers of the
  group (a step of a TP group ends when its slowest rank does).
* **KD loss per token**: the mean over tokens of the loss the criterion returns (Model-Optimizer's
  ``LogitsKLLoss`` partial sums all-reduced first, as Megatron's loss function does).

``--device cuda``: each rank's shards are made as on the CPU, then moved to its GPU; the peak is
``torch.cuda.max_memory_allocated`` above the allocation before the step (per process, so per
rank also when ranks share a GPU), the times are between ``torch.cuda.synchronize()`` and a
barrier, and no address-space cap is applied. ``--backend auto`` picks NCCL when there are at
least TP GPUs (rank r on GPU r) and else gloo with CUDA tensors, the ranks sharing the GPUs
round-robin: NCCL refuses two ranks on one GPU, while gloo all-reduces and all-gathers CUDA
tensors through host memory. With ranks sharing a GPU the peaks are each rank's own, but the
times include the other rank's kernels and gloo's copies through the host: they are not those
of TP on separate GPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

from . import harness
from .harness import GiB, MiB

IMPLS = ("topkd", "modelopt")
LOSSES = ("topk", "kl")
CLASS_NAMES = {"topk": "TopKLogitsKLLoss", "kl": "LogitsKLLoss"}
IMPL_LABELS = {"topkd": "topkd", "modelopt": "Model-Optimizer"}
BOUND = 1.25


# --------------------------------------------------------------------------------------------
# One rank
# --------------------------------------------------------------------------------------------


def _criterion(impl, loss, args, config):
    if impl == "topkd":
        from topkd.integrations import modelopt as tmo

        options = {"temperature": args.temperature, "impl": args.case_kernels}
        if loss == "topk":
            return tmo.TopKLogitsKLLoss(config, k=args.k, **options)
        return tmo.LogitsKLLoss(config, **options)
    from modelopt.torch.distill.plugins import megatron as mo

    if loss == "topk":
        return mo.TopKLogitsKLLoss(config, temperature=args.temperature, top_k=args.k)
    return mo.LogitsKLLoss(config, temperature=args.temperature)


def _inputs(args, rank, width, device="cpu"):
    """Student (requires grad) and teacher shards ``[s, b, width]``: teacher ~ 2 N(0, 1),
    student = 0.8 teacher + 1.2 N(0, 1), made in float32 a few rows at a time on the CPU, then
    moved to ``device``."""
    import torch

    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(args.seed * 1000 + rank)
    shape = (args.seq, args.batch, width)
    student, teacher = torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype)
    step = max(1, (64 * MiB) // (4 * width * args.batch))
    for lo in range(0, args.seq, step):
        hi = min(args.seq, lo + step)
        t = torch.randn(hi - lo, args.batch, width, generator=g) * 2.0
        teacher[lo:hi] = t
        student[lo:hi] = 0.8 * t + 1.2 * torch.randn(hi - lo, args.batch, width, generator=g)
        del t
    if str(device) != "cpu":
        student, teacher = student.to(device), teacher.to(device)
    return student.requires_grad_(True), teacher


def rank_main(rank, args_dict, impl, loss, port, out_dir):
    """One tensor-parallel rank of a case; writes ``rank<r>.json``."""
    from datetime import timedelta

    args = argparse.Namespace(**args_dict)
    result = {"rank": rank, "status": "error"}
    try:
        with harness.stages(result) as stage:
            stage("import torch")
            import torch
            import torch.distributed as dist

            torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // args.tp))
            result["threads"] = torch.get_num_threads()
            result["torch"] = torch.__version__
            on_cuda = args.device != "cpu"
            device = "cpu"
            if on_cuda:  # rank r on GPU r, round-robin when there are fewer GPUs than ranks
                device = torch.device("cuda", rank % torch.cuda.device_count())
                torch.cuda.set_device(device)
                result["device_name"] = torch.cuda.get_device_name(device)
            dist.init_process_group(args.backend, init_method=f"tcp://127.0.0.1:{port}",
                                    rank=rank, world_size=args.tp,
                                    timeout=timedelta(seconds=args.collective_timeout))
            stage(harness.IMPORT_STAGE)
            from importlib.metadata import version

            from megatron.core import parallel_state
            from megatron.core.transformer import TransformerConfig

            result["megatron_core_version"] = version("megatron-core")
            result["modelopt_version"] = version("nvidia-modelopt")
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tp)
            config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=args.tp,
                                       tensor_model_parallel_size=args.tp,
                                       use_cpu_initialization=True)
            crit = _criterion(impl, loss, args, config)
            if not on_cuda:  # the CUDA driver reserves address space of its own
                harness.cap_address_space(args.mem_limit_gib)
            stage("make inputs")
            width = args.vocab // args.tp
            student, teacher = _inputs(args, rank, width, device)
            result["logits_bytes"] = student.numel() * student.element_size()
            group = parallel_state.get_tensor_model_parallel_group()
            last = {}

            def step():
                student.grad = None
                out, tp_reduce, _ = crit(student, teacher)
                out.sum().backward()
                value = out.detach().double().sum()
                if tp_reduce:  # Model-Optimizer's partial sums, reduced by Megatron's loss_func
                    dist.all_reduce(value, group=group)
                last["loss"] = float(value) / out.numel()

            def sync():  # a step of the group ends when its slowest rank's kernels do
                if on_cuda:
                    torch.cuda.synchronize()
                dist.barrier()

            stage("forward + backward (first call)")
            sync()
            result["first_call_s"] = harness.first_call(step, sync)
            student.grad = None
            stage("forward + backward (memory run)")
            sync()
            peak, retained, prof = harness.profile_peak(step, "cuda" if on_cuda else "cpu")
            del prof
            result.update(peak_bytes=peak, retained_bytes=retained,
                          x_logits=peak / result["logits_bytes"])
            student.grad = None
            stage("forward + backward (timing)")
            harness.timed(step, 1, sync)
            result["times_s"] = harness.timed(step, args.repeats, sync)
            result["median_s"] = statistics.median(result["times_s"])
            result["loss_per_token"] = last["loss"]
            parallel_state.destroy_model_parallel()
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001, S110  (the result is written; nothing to add)
            pass


# --------------------------------------------------------------------------------------------
# The case's process: start the ranks, combine their results
# --------------------------------------------------------------------------------------------


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_case(args, impl, loss, kernels) -> dict:
    """One case: ``args.tp`` ranks, each in its own process; the largest peak and the ranks'
    times combined."""
    import torch.multiprocessing as mp

    settings = {**vars(args), "case_kernels": kernels}
    with tempfile.TemporaryDirectory(prefix="topkd-bench-megatron-") as out_dir:
        ctx = mp.start_processes(rank_main, args=(settings, impl, loss, _free_port(), out_dir),
                                 nprocs=args.tp, join=False, start_method="spawn")
        deadline = time.monotonic() + args.timeout
        try:
            while not ctx.join(timeout=2):
                if time.monotonic() > deadline:
                    break
        except Exception:  # noqa: BLE001  (a rank that died: its result file says why)
            pass
        finally:
            killed = [p for p in ctx.processes if p.is_alive()]
            for p in killed:
                p.kill()
                p.join(5)
        ranks = []
        for rank in range(args.tp):
            path = os.path.join(out_dir, f"rank{rank}.json")
            if os.path.exists(path):
                with open(path) as f:
                    ranks.append(json.load(f))
            else:
                code = ctx.processes[rank].exitcode
                ranks.append({"rank": rank, "status": "oom" if code == -9 else "crashed",
                              "message": f"rank {rank} left no result (exit code {code})"})
    bad = [r for r in ranks if r["status"] != "ok"]
    result = {"ranks": ranks}
    if bad:
        # a rank out of memory leaves the others waiting in a collective: report the cause
        first = next((r for r in bad if r["status"] == "oom"), bad[0])
        result.update(status=first["status"], message=first.get("message", ""))
        return result
    steps = list(zip(*(r["times_s"] for r in ranks), strict=True))
    result.update(
        status="ok", peak_bytes=max(r["peak_bytes"] for r in ranks),
        logits_bytes=ranks[0]["logits_bytes"],
        x_logits=max(r["x_logits"] for r in ranks), times_s=[max(t) for t in steps],
        first_call_s=max(r["first_call_s"] for r in ranks),
        loss_per_token=ranks[0]["loss_per_token"], threads=ranks[0]["threads"],
        megatron_core_version=ranks[0]["megatron_core_version"],
        modelopt_version=ranks[0]["modelopt_version"], torch=ranks[0]["torch"],
        device_name=ranks[0].get("device_name"))
    result["median_s"] = statistics.median(result["times_s"])
    return result


# --------------------------------------------------------------------------------------------
# Parent
# --------------------------------------------------------------------------------------------


def _label(r) -> str:
    kernels = r.get("kernels", "-")
    return IMPL_LABELS[r["impl"]] + ("" if kernels == "-" else f" ({kernels})")


def _where(meta) -> str:
    """Where the ranks ran (results saved before ``--device`` ran on the CPU over gloo)."""
    device, backend = meta.get("device", "cpu"), meta.get("backend", "gloo")
    if device == "cpu":
        return f"{backend} ranks on this CPU"
    gpus = meta.get("gpus") or 1
    name = f", {meta['device_name']}" if meta.get("device_name") else ""
    if gpus >= meta["tp"]:
        return f"{backend} ranks, one GPU each{name}"
    return f"{backend} ranks sharing {gpus} GPU{'s' if gpus > 1 else ''}{name}"


def format_table(results, meta) -> str:
    tokens = meta["seq"] * meta["batch"]
    on_cpu = meta.get("device", "cpu") == "cpu"
    lines = [
        f"Megatron criteria at TP = {meta['tp']} ({_where(meta)}, megatron-core "
        f"{meta.get('megatron_core_version')} parallel_state, Model-Optimizer "
        f"{meta.get('modelopt_version')}): [s, b, V/TP] = [{meta['seq']:,}, {meta['batch']}, "
        f"{meta['vocab'] // meta['tp']:,}] {meta['dtype']} student and teacher logits per rank "
        f"({tokens:,} tokens, V = {meta['vocab']:,}), K = {meta['k']:,}, "
        f"T = {meta['temperature']:g}; torch {meta.get('torch')}, {meta['threads']} threads per "
        f"rank, repeats = {meta['repeats']}"
        + (f", memory cap {meta['mem_limit_gib']:g} GiB per rank." if on_cpu else "."),
    ]
    load = harness.load_line(meta)
    if load:
        lines += ["", load + f" Local student logits: {meta['logits_bytes'] / MiB:,.0f} MiB per "
                             "rank."]
    lines += ["", "| impl | criterion | per-rank peak above inputs (MiB) | x local logits "
                  "| fwd+bwd s (median [min-max]) | first call s | KD loss per token |",
              "|---|---|---:|---:|---:|---:|---:|"]
    for r in results:
        name = CLASS_NAMES[r["loss"]]
        if r["status"] != "ok":
            lines.append(f"| {_label(r)} | {name} | {harness.status_text(r)} | - | - | - | - |")
            continue
        lines.append(
            f"| {_label(r)} | {name} | {r['peak_bytes'] / MiB:,.0f} | {r['x_logits']:.3f} "
            f"| {r['median_s']:.2f}{harness.spread(r['times_s'])} | {r['first_call_s']:.2f} "
            f"| {r['loss_per_token']:.6g} |")
    lines += ["", "Peak: one forward + backward, bytes allocated above the two input shards "
                  + ("(profiler allocator events, running maximum)" if on_cpu else
                     "(torch.cuda.max_memory_allocated, per rank)")
                  + ", the returned student gradient "
                  "(1.0x) included; the largest over the ranks. topkd's Top-K loss is "
                  "normalize=\"full\" (K entries + the exact ghost bucket), Model-Optimizer's "
                  "renormalizes over the K entries: their loss values differ by the ghost term."
                  + ("" if on_cpu or (meta.get("gpus") or 1) >= meta["tp"] else
                     " The ranks shared a GPU: each time includes the other rank's kernels and "
                     "gloo's copies through the host, so it is not the time of TP on separate "
                     "GPUs.")]
    pairs = []
    for loss in LOSSES:
        for r in (x for x in results if x["impl"] == "topkd" and x["loss"] == loss):
            other = next((x for x in results if x["impl"] == "modelopt" and x["loss"] == loss),
                         None)
            if r["status"] == "ok":
                verdict = "met" if r["x_logits"] <= BOUND else "NOT met"
                pairs.append(f"- {_label(r)} {CLASS_NAMES[loss]}: {r['x_logits']:.3f}x "
                             f"the local logits (bound {BOUND}x: {verdict})"
                             + (f"; {r['peak_bytes'] / other['peak_bytes']:.3f}x "
                                f"Model-Optimizer's peak, {r['median_s'] / other['median_s']:.2f}x"
                                f" its time" if other and other["status"] == "ok" else ""))
    if pairs:
        lines += [""] + pairs
    notes = [r for r in results if r["status"] != "ok" and r.get("message")]
    for r in notes:
        lines.append(f"- {_label(r)} {CLASS_NAMES[r['loss']]}: {r['message'][:500]}")
    return "\n".join(lines)


def build_parser():
    p = argparse.ArgumentParser(
        prog="python -m benchmarks megatron",
        description="Megatron section: topkd's Model-Optimizer criteria (TopKLogitsKLLoss, "
                    "LogitsKLLoss) against Model-Optimizer 0.47's on the same [s, b, V/TP] "
                    "logits, at TP gloo ranks on this CPU (or with --device cuda on GPUs): "
                    "per-rank peak memory and forward + backward time. Every case runs in its "
                    "own processes, each rank capped.")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks (2)")
    p.add_argument("--seq", type=int, default=512, help="sequence length s (512)")
    p.add_argument("--batch", type=int, default=2, help="micro-batch b (2)")
    p.add_argument("--vocab", type=int, default=248_320,
                   help="padded vocabulary V, a multiple of --tp (248320)")
    p.add_argument("--k", type=int, default=4096, help="Top-K (4096)")
    p.add_argument("--dtype", choices=harness.DTYPES, default="bfloat16",
                   help="logits dtype (bfloat16)")
    p.add_argument("--temperature", type=float, default=1.0, help="temperature T (1.0)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs after a warm-up (3)")
    p.add_argument("--impl", nargs="+", choices=IMPLS, default=list(IMPLS),
                   help="implementations (default: topkd modelopt)")
    p.add_argument("--loss", nargs="+", choices=LOSSES, default=list(LOSSES),
                   help="topk (TopKLogitsKLLoss) and/or kl (LogitsKLLoss) (default both)")
    p.add_argument("--kernels", nargs="+", choices=harness.KERNELS, default=["eager"],
                   help="topkd's impl= for its cases, one case each (default: eager; compiling "
                        "happens in every rank)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads per rank (default 0: the CPUs / TP)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per case (1800)")
    p.add_argument("--collective-timeout", type=float, default=300.0,
                   help="gloo timeout in seconds: a rank left waiting fails after it (300)")
    p.add_argument("--mem-limit-gib", type=float, default=20.0,
                   help="address-space cap per rank, GiB above its size after the imports; "
                        "lowered to (MemAvailable - 1 GiB) / TP if that is less; 0 = no cap (20)")
    p.add_argument("--seed", type=int, default=0, help="seed of the inputs (0)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu (default) or cuda: each rank's shards on a GPU, its peak from "
                        "torch.cuda.max_memory_allocated")
    p.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto",
                   help="process group backend (auto: gloo on the CPU; on CUDA NCCL when there "
                        "are at least --tp GPUs, else gloo with the ranks sharing them)")
    harness.add_output_options(p)
    return p


def _show(saved) -> str:
    return format_table(saved["results"], saved["meta"])


def main(argv) -> int:
    args = build_parser().parse_args(argv)
    if args.load:
        harness.show_saved(args, _show)
        return 0
    if args.vocab % args.tp:
        raise SystemExit(f"--vocab {args.vocab} is not a multiple of --tp {args.tp} (Megatron "
                         f"pads the vocabulary to one)")
    gpus = 0
    if args.device == "cuda":
        import torch

        gpus = torch.cuda.device_count()
        if not gpus:
            raise SystemExit("--device cuda: torch sees no CUDA device")
    if args.backend == "auto":
        args.backend = "nccl" if gpus >= args.tp else "gloo"
    if args.backend == "nccl" and gpus < args.tp:
        raise SystemExit(f"--backend nccl needs a GPU per rank ({args.tp}), {gpus} found: NCCL "
                         "refuses two ranks on one GPU (--backend gloo shares them)")
    available = harness.mem_available_bytes()
    if args.mem_limit_gib and available is not None:
        args.mem_limit_gib = min(args.mem_limit_gib,
                                 max(0.5, int((available - GiB) / args.tp / GiB * 10) / 10))
    cases = [(impl, loss, kernels) for loss in LOSSES if loss in args.loss
             for impl in IMPLS if impl in args.impl
             for kernels in (args.kernels if impl == "topkd" else ["-"])]
    t_start = time.perf_counter()
    load_start = harness.loadavg()

    def run(case):
        impl, loss, kernels = case
        r = {"impl": impl, "loss": loss, "kernels": kernels,
             "mem_limit_gib": args.mem_limit_gib}
        r.update(harness.run_child("benchmarks.megatron:run_case", vars(args), impl, loss,
                                   kernels, timeout=args.timeout + 120))
        return r

    def summarize(r):
        return (f"peak {r['peak_bytes'] / MiB:,.0f} MiB per rank ({r['x_logits']:.3f}x local "
                f"logits), {r['median_s']:.2f} s")

    results = harness.run_cases(
        cases, lambda c: f"{_label({'impl': c[0], 'kernels': c[2]})} {CLASS_NAMES[c[1]]}",
        run, summarize)

    def first(key):
        return next((r[key] for r in results if r.get(key)), None)

    meta = {"tp": args.tp, "device": args.device, "backend": args.backend, "gpus": gpus,
            "device_name": first("device_name"),
            "seq": args.seq, "batch": args.batch, "vocab": args.vocab,
            "k": args.k, "dtype": args.dtype, "temperature": args.temperature,
            "repeats": args.repeats, "mem_limit_gib": args.mem_limit_gib,
            "threads": first("threads") or args.threads, "torch": first("torch"),
            "megatron_core_version": first("megatron_core_version"),
            "modelopt_version": first("modelopt_version"),
            "logits_bytes": args.seq * args.batch * (args.vocab // args.tp)
            * harness.DTYPE_BYTES[args.dtype],
            **harness.run_meta("megatron", argv, t_start, load_start)}
    harness.emit(args, {"meta": meta, "results": results}, _show)
    return 0 if all(r["status"] == "ok" for r in results) else 1
