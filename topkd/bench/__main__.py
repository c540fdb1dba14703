"""Benchmark: topkd's losses against the plain float32 implementation they replace.

``python -m topkd.bench`` (or ``topkd-bench``) runs every case, one case being
(implementation, loss, rows), in its own fresh Python process whose address space is capped,
so a case that runs out of memory shows as "out of memory at N GiB" in the table instead of
taking the machine down. Per case it reports:

* **peak above inputs**: the peak of bytes allocated during one forward + backward, above
  what was allocated before it (the logits), by the method of SPEC section 4: a
  ``torch.profiler.profile(profile_memory=True)`` around the step, the allocator events
  (``[memory]``, signed ``nbytes()``) walked in time order, running maximum. It includes the
  student gradient itself (1.0x the student logits' bytes). On CUDA it is
  ``torch.cuda.max_memory_allocated`` above the allocation before the step.
* **x logits**: that peak as a multiple of the student logits' bytes.
* **fwd+bwd s**: median wall time of ``--repeats`` forward + backward runs (``loss.sum()
  .backward()``, ``reduction="none"``) after one warm-up, measured without the profiler.
* **loss rel err**: max over ``--sample-rows`` rows of ``|L - L64| / |L64|``, with ``L64``
  the same loss definition computed in float64 on those rows (SPEC section 1: teacher ties at
  the K-th value go to the lower index, ghost bucket by a log-sum-exp over the complement).
* **grad err**: ``max |g - g64| / max |g64|`` over the sampled rows, with ``g64`` the float64
  autograd gradient. The table's footnote gives the floor that rounding ``g64`` to the logits'
  dtype alone produces.

Implementations (``--impl``):

* ``topkd``: ``topkd.topk_kl_loss`` and ``topkd.kl_loss``.
* ``naive``: **the plain float32 implementation as it was before topkd**, written here as the
  usual code does it: upcast student and teacher to float32, divide by T, ``log_softmax``
  over the full vocabulary for both, the teacher's top-K by ``torch.topk``, gather, the ghost
  bucket by ``log1p(-sum of the selected probabilities)``, forward KL over the K + 1 buckets;
  and for ``kl_loss`` ``log_softmax`` of both and ``F.kl_div(..., log_target=True)``. Its
  loss error is measured against float64 on *its own* selection (``torch.topk`` breaks ties
  arbitrarily, and bf16 logits have many ties at the K-th value), so it shows the float32 and
  ``log1p`` error alone.
* ``prefix`` (opt-in): a reconstruction of the pre-fix Model-Optimizer style Top-K loss, whose
  normalizers are computed as ``max``/``exp``/``sum`` on float32 copies of the whole logits
  (about five float32 copies alive at the backward peak). Top-K loss only.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

GiB = 2**30
MiB = 2**20

IMPLS = ("topkd", "naive", "prefix")
DEFAULT_IMPLS = ("topkd", "naive")
LOSSES = ("topk", "kl")
LOSS_NAMES = {"topk": "topk_kl_loss", "kl": "kl_loss"}
IMPL_LABELS = {"topkd": "topkd", "naive": "naive fp32", "prefix": "pre-fix style fp32"}
DTYPES = ("bfloat16", "float16", "float32")
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}

# Peak above the inputs, for the memory estimate made before a case is started: float32
# copies of [rows, V], plus multiples of the student logits' bytes (the gradient). Measured on
# this benchmark's defaults and rounded up; an estimate only decides whether to start a case,
# the address-space cap in the child is what actually stops it.
_ESTIMATE = {
    # impl, loss: (float32 copies, logits copies)
    ("naive", "topk"): (4.2, 0.0),  # measured 8.26x the bf16 logits = 4.13 float32 copies
    ("naive", "kl"): (5.05, 0.0),  # 10.0x
    ("prefix", "topk"): (5.2, 0.0),  # 10.3x
    ("topkd", "topk"): (0.0, 1.5),  # bound 1.25x
    ("topkd", "kl"): (0.0, 1.5),
}
_BASE_BYTES = 0.5 * GiB  # input generation, float64 reference rows, slack (torch is not counted)


# --------------------------------------------------------------------------------------------
# Implementations written in the benchmark
# --------------------------------------------------------------------------------------------

_LAST_SELECTION = {}


def naive_topk_kl_loss(student_logits, teacher_logits, k, temperature=1.0):
    """Plain float32 Top-K KD loss, as it was before topkd (the reference to beat).

    The usual code: upcast both logits to float32, divide by T, log_softmax over the full
    vocabulary, teacher's top-K by torch.topk, gather, ghost bucket by log1p(-sum), forward
    KL over K + 1 buckets. Returns the per-row loss (float32, shape [rows]).
    """
    import torch

    student = student_logits.float() / temperature
    student_logprobs = torch.log_softmax(student, dim=-1)
    with torch.no_grad():
        teacher = teacher_logits.float() / temperature
        teacher_logprobs = torch.log_softmax(teacher, dim=-1)
        teacher_top, indices = torch.topk(teacher_logprobs, k, dim=-1)
    _LAST_SELECTION["indices"] = indices
    student_top = student_logprobs.gather(-1, indices)
    teacher_probs = teacher_top.exp()
    student_probs = student_top.exp()
    # ghost bucket: the mass outside the top-K, as one (clamped, so that log1p stays finite)
    eps = 1e-7
    teacher_ghost = torch.log1p(-teacher_probs.sum(-1).clamp(max=1.0 - eps))
    student_ghost = torch.log1p(-student_probs.sum(-1).clamp(max=1.0 - eps))
    loss = (teacher_probs * (teacher_top - student_top)).sum(-1)
    loss = loss + teacher_ghost.exp() * (teacher_ghost - student_ghost)
    return loss


def naive_kl_loss(student_logits, teacher_logits, temperature=1.0):
    """Plain float32 full-vocabulary KD loss: log_softmax both, KL(teacher || student)."""
    import torch
    import torch.nn.functional as F

    student_logprobs = torch.log_softmax(student_logits.float() / temperature, dim=-1)
    with torch.no_grad():
        teacher_logprobs = torch.log_softmax(teacher_logits.float() / temperature, dim=-1)
    return F.kl_div(student_logprobs, teacher_logprobs, reduction="none", log_target=True).sum(-1)


def prefix_topk_kl_loss(student_logits, teacher_logits, k, temperature=1.0):
    """Reconstruction of the pre-fix style Top-K KD loss (normalizers on float32 copies).

    Like Model-Optimizer's TopLogitsKLLoss before its memory fix: the full-vocabulary
    normalizers are computed as max / exp / sum over float32 copies of the whole logits (the
    tensor-parallel-friendly form), the top-K values are renormalized by them, and the ghost
    bucket is 1 - sum. A reconstruction for comparison, not the original code.
    """
    import torch

    student = student_logits.float() / temperature
    with torch.no_grad():
        teacher = teacher_logits.float() / temperature
        teacher_max = teacher.max(dim=-1, keepdim=True).values
        teacher_shifted = teacher - teacher_max
        teacher_sum = torch.exp(teacher_shifted).sum(dim=-1, keepdim=True)
        teacher_lse = teacher_max + torch.log(teacher_sum)
        teacher_top, indices = torch.topk(teacher, k, dim=-1)
    _LAST_SELECTION["indices"] = indices
    student_max = student.max(dim=-1, keepdim=True).values.detach()
    student_shifted = student - student_max
    student_sum = torch.exp(student_shifted).sum(dim=-1, keepdim=True)
    student_lse = student_max + torch.log(student_sum)
    teacher_top_logprobs = teacher_top - teacher_lse
    student_top_logprobs = student.gather(-1, indices) - student_lse
    teacher_probs = teacher_top_logprobs.exp()
    student_probs = student_top_logprobs.exp()
    teacher_rest = (1.0 - teacher_probs.sum(-1)).clamp(min=1e-20)
    student_rest = (1.0 - student_probs.sum(-1)).clamp(min=1e-20)
    loss = (teacher_probs * (teacher_top_logprobs - student_top_logprobs)).sum(-1)
    loss = loss + teacher_rest * (torch.log(teacher_rest) - torch.log(student_rest))
    return loss


# --------------------------------------------------------------------------------------------
# float64 references (SPEC section 1), on a few rows
# --------------------------------------------------------------------------------------------


def reference_topk_f64(student, teacher, k, temperature, indices=None):
    """Forward Top-K KL with exact ghost bucket, float64. ``indices`` defaults to SPEC's
    selection (largest teacher values, ties to the lower vocabulary index)."""
    import torch

    a = student.double() / temperature
    b = teacher.double() / temperature
    lse_a = torch.logsumexp(a, dim=-1, keepdim=True)
    lse_b = torch.logsumexp(b, dim=-1, keepdim=True)
    if indices is None:
        indices = torch.sort(b, dim=-1, descending=True, stable=True).indices[:, :k]
    logq = b.gather(-1, indices) - lse_b
    logp = a.gather(-1, indices) - lse_a
    loss = (logq.exp() * (logq - logp)).sum(-1)
    if indices.shape[-1] < a.shape[-1]:
        selected = torch.zeros_like(b, dtype=torch.bool).scatter_(-1, indices, True)
        logq_g = torch.logsumexp(b.masked_fill(selected, -math.inf), dim=-1) - lse_b[:, 0]
        logp_g = torch.logsumexp(a.masked_fill(selected, -math.inf), dim=-1) - lse_a[:, 0]
        q_g = logq_g.exp()
        ghost = torch.where(q_g > 0, q_g * (logq_g - logp_g), torch.zeros_like(q_g))
        loss = loss + ghost
    return loss


def reference_kl_f64(student, teacher, temperature):
    import torch

    logp = torch.log_softmax(student.double() / temperature, dim=-1)
    logq = torch.log_softmax(teacher.double() / temperature, dim=-1)
    return (logq.exp() * (logq - logp)).sum(-1)


# --------------------------------------------------------------------------------------------
# Child process: one case
# --------------------------------------------------------------------------------------------


def _vm_size_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _is_oom(exc: BaseException) -> bool:
    if isinstance(exc, MemoryError):
        return True
    text = str(exc).lower()
    return any(
        s in text
        for s in ("can't allocate memory", "cannot allocate memory", "out of memory",
                  "not enough memory", "std::bad_alloc", "failed to allocate")
    )


def _loss_function(impl, loss, k, temperature, chunk_bytes):
    if impl == "topkd":
        import topkd

        if loss == "topk":
            topk_kl_loss = topkd.topk_kl_loss
            return lambda s, t: topk_kl_loss(
                s, t, k, temperature=temperature, chunk_bytes=chunk_bytes
            )
        kl_loss = topkd.kl_loss
        return lambda s, t: kl_loss(s, t, temperature=temperature, chunk_bytes=chunk_bytes)
    if impl == "naive":
        if loss == "topk":
            return lambda s, t: naive_topk_kl_loss(s, t, k, temperature)
        return lambda s, t: naive_kl_loss(s, t, temperature)
    if impl == "prefix":
        if loss == "topk":
            return lambda s, t: prefix_topk_kl_loss(s, t, k, temperature)
        raise ValueError("the pre-fix style reference has only the Top-K loss")
    raise ValueError(f"unknown implementation {impl!r}")


def _make_inputs(rows, vocab, dtype, seed, device):
    """Teacher ~ 2 N(0, 1); student = 0.8 teacher + 1.2 N(0, 1) (std 2, correlated), made in
    row chunks so that no full float32 copy is ever needed."""
    import torch

    torch.manual_seed(seed)
    teacher = torch.empty(rows, vocab, dtype=dtype, device=device)
    student = torch.empty(rows, vocab, dtype=dtype, device=device)
    step = max(1, (64 * MiB) // (4 * max(vocab, 1)))
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        t = torch.randn(stop - start, vocab) * 2.0
        teacher[start:stop] = t.to(device)
        student[start:stop] = (0.8 * t + 1.2 * torch.randn(stop - start, vocab)).to(device)
        del t
    return student.requires_grad_(True), teacher


def _profile_peak(step, device):
    """Peak bytes allocated above the start during ``step()`` (SPEC section 4)."""
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base, torch.cuda.memory_allocated() - base, None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())  # stable: ties keep the recorded order
    current = peak = 0
    for e in events:
        current += e.nbytes()
        peak = max(peak, current)
    return peak, current, prof


def run_child(args) -> dict:
    impl, loss_kind, rows = args.child[0], args.child[1], int(args.child[2])
    result = {
        "impl": impl, "loss": LOSS_NAMES[loss_kind], "rows": rows, "vocab": args.vocab,
        "k": args.k, "dtype": args.dtype, "temperature": args.temperature,
        "chunk_bytes": args.chunk_bytes, "device": args.device, "status": "error",
        "mem_limit_gib": args.mem_limit_gib,
    }
    stage = "import torch"
    try:
        import resource

        import torch

        if args.threads:
            torch.set_num_threads(args.threads)
        result["threads"] = torch.get_num_threads()
        result["torch"] = torch.__version__
        # cap the address space at what the process has now plus the limit
        # (not on CUDA, whose driver reserves a large address space)
        if args.mem_limit_gib and args.mem_limit_gib > 0 and args.device == "cpu":
            cap = _vm_size_bytes() + int(args.mem_limit_gib * GiB)
            resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
        dtype = getattr(torch, args.dtype)
        stage = "import implementation"
        fn = _loss_function(impl, loss_kind, args.k, args.temperature, args.chunk_bytes)
        stage = "make inputs"
        student, teacher = _make_inputs(rows, args.vocab, dtype, args.seed, args.device)
        logits_bytes = student.numel() * student.element_size()
        result["logits_bytes"] = logits_bytes
        sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
        last = {}

        def step():
            student.grad = None
            out = fn(student, teacher)
            out.sum().backward()
            last["loss"] = out.detach()

        # memory: one forward + backward under the profiler, inputs allocated before it
        stage = "forward + backward (memory run)"
        last.clear()
        peak, after, prof = _profile_peak(step, args.device)
        result["peak_bytes"] = peak
        result["x_logits"] = peak / logits_bytes if logits_bytes else float("nan")
        result["retained_bytes"] = after
        if args.breakdown and prof is not None:
            result["breakdown"] = prof.key_averages().table(
                sort_by="self_cpu_time_total", row_limit=args.breakdown
            )
        del prof
        last.clear()
        student.grad = None

        # time: one warm-up, then the median of --repeats runs
        stage = "forward + backward (timing)"
        step()
        sync()
        times = []
        for _ in range(args.repeats):
            last.clear()
            sync()
            t0 = time.perf_counter()
            step()
            sync()
            times.append(time.perf_counter() - t0)
        result["times_s"] = times
        result["median_s"] = statistics.median(times)

        # accuracy on a few rows against float64
        stage = "float64 reference"
        n = min(args.sample_rows, rows)
        sample = sorted({round(i * (rows - 1) / max(n - 1, 1)) for i in range(n)}) if rows else []
        result["sample_rows"] = sample
        if sample:
            idx = torch.tensor(sample, device=args.device)
            got_loss = last["loss"][idx].double().cpu()
            got_grad = student.grad[idx].double().cpu()
            z = student.detach()[idx].cpu().double().requires_grad_(True)
            t = teacher[idx].cpu().double()
            own = None
            if loss_kind == "topk":
                if impl != "topkd" and "indices" in _LAST_SELECTION:
                    own = _LAST_SELECTION["indices"][idx].cpu()
                ref = reference_topk_f64(z, t, args.k, args.temperature, indices=own)
            else:
                ref = reference_kl_f64(z, t, args.temperature)
            ref.sum().backward()
            g64 = z.grad
            rel = ((got_loss - ref.detach()).abs() / ref.detach().abs()).max().item()
            result["loss_rel_err"] = rel
            scale = g64.abs().max().item()
            result["grad_err"] = (got_grad - g64).abs().max().item() / scale
            result["grad_floor"] = (
                (g64.to(dtype).double() - g64).abs().max().item() / scale
            )
            if own is not None:  # also against SPEC's selection (ties to the lower index)
                spec_ref = reference_topk_f64(z.detach(), t, args.k, args.temperature)
                result["loss_rel_err_spec_selection"] = (
                    (got_loss - spec_ref).abs() / spec_ref.abs()
                ).max().item()
            result["loss_sample_mean"] = ref.detach().mean().item()
        result["status"] = "ok"
    except (RuntimeError, MemoryError, ImportError, AttributeError, ValueError, TypeError) as exc:
        if _is_oom(exc):
            result["status"] = "oom"
        elif isinstance(exc, (ImportError, AttributeError)) and stage == "import implementation":
            result["status"] = "unavailable"
        result["message"] = f"{stage}: {type(exc).__name__}: {str(exc).strip()[:400]}"
    try:
        import resource

        result["maxrss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    except Exception:  # noqa: BLE001
        pass
    return result


# --------------------------------------------------------------------------------------------
# Parent: run the cases, print the table
# --------------------------------------------------------------------------------------------


def _mem_available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _estimate_bytes(impl, loss, rows, vocab, dtype) -> float:
    f32_copies, logits_copies = _ESTIMATE[(impl, loss)]
    logits = rows * vocab * DTYPE_BYTES[dtype]
    return 2 * logits + f32_copies * rows * vocab * 4 + logits_copies * logits + _BASE_BYTES


def _child_command(args, impl, loss, rows, out_path, limit_gib):
    cmd = [
        sys.executable, "-m", "topkd.bench", "--child", impl, loss, str(rows),
        "--child-out", out_path,
        "--vocab", str(args.vocab), "--k", str(args.k), "--dtype", args.dtype,
        "--repeats", str(args.repeats), "--temperature", repr(args.temperature),
        "--seed", str(args.seed), "--sample-rows", str(args.sample_rows),
        "--mem-limit-gib", repr(limit_gib), "--device", args.device,
        "--threads", str(args.threads), "--breakdown", str(args.breakdown),
    ]
    if args.chunk_bytes is not None:
        cmd += ["--chunk-bytes", str(args.chunk_bytes)]
    return cmd


def _run_case(args, impl, loss, rows) -> dict:
    base = {
        "impl": impl, "loss": LOSS_NAMES[loss], "rows": rows, "vocab": args.vocab, "k": args.k,
        "dtype": args.dtype, "temperature": args.temperature, "chunk_bytes": args.chunk_bytes,
        "device": args.device,
    }
    limit = args.mem_limit_gib
    available = _mem_available_bytes()
    if limit and available is not None and args.device == "cpu":
        # never let a child take the machine down: leave 1 GiB to everything else
        limit = min(limit, max(0.5, math.floor((available - GiB) / GiB * 10) / 10))
    base["mem_limit_gib"] = limit
    if limit and args.estimate and args.device == "cpu":
        need = _estimate_bytes(impl, loss, rows, args.vocab, args.dtype)
        base["estimate_bytes"] = need
        if need > limit * GiB:
            base.update(status="oom", estimated_only=True,
                        message=f"estimated {need / GiB:.1f} GiB > limit {limit:g} GiB; not run "
                                f"(--no-estimate runs it against the address-space cap)")
            return base
    with tempfile.TemporaryDirectory(prefix="topkd-bench-") as tmp:
        out_path = os.path.join(tmp, "result.json")
        err_path = os.path.join(tmp, "stderr.txt")
        cmd = _child_command(args, impl, loss, rows, out_path, limit)
        env = dict(os.environ)
        try:
            with open(err_path, "w") as err:
                proc = subprocess.run(cmd, stdout=err, stderr=err, env=env,
                                      timeout=args.timeout or None)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            base.update(status="timeout", message=f"no result after {args.timeout} s")
            return base
        if os.path.exists(out_path):
            with open(out_path) as f:
                res = json.load(f)
            base.update(res)
            return base
        tail = ""
        if os.path.exists(err_path):
            with open(err_path, errors="replace") as f:
                tail = f.read()[-1500:]
        if rc < 0:
            import signal

            name = signal.Signals(-rc).name if -rc in signal.Signals._value2member_map_ else rc
            base.update(status="oom" if -rc == 9 else "crashed",
                        message=f"child killed by {name}: {tail.strip()[-600:]}")
        else:
            base.update(status="crashed", message=f"child exited {rc}: {tail.strip()[-600:]}")
        return base


def _loadavg():
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _spread(r):
    times = r.get("times_s") or []
    if len(times) < 2:
        return ""
    return f" [{min(times):.2f}-{max(times):.2f}]"


def _fmt_err(x):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.1e}"


def _status_text(r, short=False):
    if r["status"] == "oom":
        lim = r.get("mem_limit_gib")
        text = f"out of memory at {lim:g} GiB" if lim else "out of memory"
        if r.get("estimated_only") and not short:
            text += f" (estimated need {r['estimate_bytes'] / GiB:.1f} GiB, not run)"
        return text
    if r["status"] == "unavailable":
        return "unavailable"
    return r["status"]


def _naive_of(results, r):
    for o in results:
        if o["impl"] == "naive" and o["loss"] == r["loss"] and o["rows"] == r["rows"]:
            return o
    return None


def format_table(results, meta) -> str:
    lines = []
    lines.append(
        f"V = {meta['vocab']:,}, K = {meta['k']:,}, {meta['dtype']}, T = {meta['temperature']:g}, "
        f"device {meta['device']}, torch {meta['torch']}, {meta['threads']} threads, "
        f"chunk_bytes = {meta['chunk_bytes']}, repeats = {meta['repeats']}, "
        f"memory cap {meta['mem_limit_gib']:g} GiB per case"
    )
    if meta.get("loadavg_start") and meta.get("loadavg_end"):
        lines.append("")
        lines.append(
            f"{meta['cpus']} CPUs; load average (1 min) {meta['loadavg_start'][0]:.2f} at the "
            f"start, {meta['loadavg_end'][0]:.2f} at the end; total {meta['total_s']:.0f} s."
        )
    lines.append("")
    lines.append("| impl | loss | rows | peak above inputs (MiB) | x logits "
                 "| fwd+bwd s (median [min-max]) "
                 "| vs naive | loss rel err | grad err (floor) |")
    lines.append("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    floors = []
    for r in results:
        label = IMPL_LABELS.get(r["impl"], r["impl"])
        if r["status"] != "ok":
            lines.append(f"| {label} | {r['loss']} | {r['rows']:,} | {_status_text(r)} "
                         f"| - | - | - | - | - |")
            continue
        naive = _naive_of(results, r)
        vs = "-"
        if naive is not None and naive["status"] == "ok" and naive is not r:
            vs = f"{r['median_s'] / naive['median_s']:.2f}x"
        elif naive is r:
            vs = "1.00x"
        if r.get("grad_floor") is not None:
            floors.append(r["grad_floor"])
        lines.append(
            f"| {label} | {r['loss']} | {r['rows']:,} | {r['peak_bytes'] / MiB:,.0f} "
            f"| {r['x_logits']:.2f} | {r['median_s']:.2f}{_spread(r)} | {vs} "
            f"| {_fmt_err(r.get('loss_rel_err'))} | {_fmt_err(r.get('grad_err'))} "
            f"({_fmt_err(r.get('grad_floor'))}) |"
        )
    lines.append("")
    lines.append(
        "naive fp32 = the plain float32 implementation as it was before topkd, written in the "
        "benchmark (upcast, log_softmax of the full logits, torch.topk, gather, ghost by log1p; "
        "kl_loss: log_softmax + kl_div). Its loss error is against float64 on its own "
        "torch.topk selection."
        + (" pre-fix style fp32 = a reconstruction of the pre-fix Model-Optimizer loss "
           "(normalizers by max/exp/sum on float32 copies)." if any(r["impl"] == "prefix"
                                                                   for r in results) else "")
    )
    if floors:
        lines.append(
            f"Errors on {meta['sample_rows']} sampled rows vs float64: loss rel err = "
            f"max |L - L64| / |L64|; grad err = max |g - g64| / max |g64|, and in brackets "
            f"the floor: the same for g64 rounded to {meta['dtype']} (a correctly rounded "
            f"gradient in {meta['dtype']} cannot do better)."
        )
    # ratios topkd / naive
    pairs = []
    for r in results:
        if r["impl"] != "topkd":
            continue
        naive = _naive_of(results, r)
        if naive is None:
            continue
        pairs.append((r, naive))
    if pairs:
        lines.append("")
        lines.append("topkd / naive fp32:")
        lines.append("")
        lines.append("| loss | rows | memory (peak above inputs) | time (fwd+bwd) |")
        lines.append("|---|---:|---:|---:|")
        for r, naive in pairs:
            if r["status"] == "ok" and naive["status"] == "ok":
                mem = f"{r['peak_bytes'] / naive['peak_bytes']:.3f}"
                tim = f"{r['median_s'] / naive['median_s']:.2f}"
            elif r["status"] == "ok":
                mem = tim = f"naive: {_status_text(naive, short=True)}"
            else:
                mem = tim = f"topkd: {_status_text(r, short=True)}"
            lines.append(f"| {r['loss']} | {r['rows']:,} | {mem} | {tim} |")
    notes = [r for r in results if r["status"] != "ok" and r.get("message")]
    if notes:
        lines.append("")
        for r in notes:
            lines.append(f"- {IMPL_LABELS.get(r['impl'], r['impl'])} {r['loss']} rows={r['rows']}: "
                         f"{r['message'][:300]}")
    breakdowns = [r for r in results if r.get("breakdown")]
    for r in breakdowns:
        lines.append("")
        lines.append(f"Profile of {IMPL_LABELS.get(r['impl'], r['impl'])} {r['loss']} "
                     f"rows={r['rows']} (memory run, profiler overhead included):")
        lines.append("```")
        lines.append(r["breakdown"].rstrip())
        lines.append("```")
    return "\n".join(lines)


def _parse_rows(text):
    out = []
    for part in text.replace(",", " ").split():
        out.append(int(part.replace("_", "")))
    if any(r < 0 for r in out):
        raise argparse.ArgumentTypeError("rows must be >= 0")
    return out


def _int_bytes(text):
    text = text.strip().lower().replace("_", "")
    mult = 1
    for suffix, m in (("gib", GiB), ("mib", MiB), ("kib", 1024), ("g", GiB), ("m", MiB),
                      ("k", 1024)):
        if text.endswith(suffix):
            text, mult = text[: -len(suffix)], m
            break
    return int(float(text) * mult)


def build_parser():
    p = argparse.ArgumentParser(
        prog="topkd-bench",
        description="Benchmark topkd's KD losses against the plain float32 implementation: peak "
                    "memory above the inputs (profiler method), forward + backward time, error "
                    "vs float64. Every case runs in its own memory-capped process.",
        epilog="Fused LM-head section (fused_topk_kl_loss / fused_kl_loss vs F.linear + the "
               "loss and Liger-Kernel): 'topkd-bench fused --help'.",
    )
    p.add_argument("--rows", type=_parse_rows, nargs="+", default=[[256, 1024, 4096]],
                   help="sequence lengths (rows of logits), e.g. '256 1024' or 256,1024 "
                        "(default 256,1024,4096; the naive float32 implementation "
                        "does not fit 4096 rows under the default 20 GiB cap)")
    p.add_argument("--vocab", type=int, default=248_320, help="vocabulary size V (248320)")
    p.add_argument("--k", type=int, default=4096, help="Top-K (4096)")
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="logits dtype (bfloat16)")
    p.add_argument("--temperature", type=float, default=1.0, help="temperature T (1.0)")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed forward + backward runs after one warm-up; median reported (3)")
    p.add_argument("--impl", nargs="+", choices=IMPLS, default=list(DEFAULT_IMPLS),
                   help="implementations (default: topkd naive; 'prefix' is opt-in)")
    p.add_argument("--loss", nargs="+", choices=LOSSES, default=list(LOSSES),
                   help="losses: topk (topk_kl_loss) and/or kl (kl_loss) (default both)")
    p.add_argument("--chunk-bytes", type=_int_bytes, default=None,
                   help="chunk_bytes passed to topkd (e.g. 64MiB; default: the library's)")
    p.add_argument("--mem-limit-gib", type=float, default=20.0,
                   help="address-space cap per case, GiB above the process's size after "
                        "importing torch; lowered to MemAvailable - 1 GiB if that is less; "
                        "0 = no cap (20)")
    p.add_argument("--no-estimate", dest="estimate", action="store_false",
                   help="start every case even when the memory estimate exceeds the cap")
    p.add_argument("--sample-rows", type=int, default=8,
                   help="rows compared against the float64 reference (8)")
    p.add_argument("--seed", type=int, default=0, help="torch.manual_seed for the inputs (0)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads (default 0: torch's default for the machine)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per case (1800)")
    p.add_argument("--breakdown", type=int, default=0, metavar="N",
                   help="also print the top N ops by self CPU time of each case's profiled run")
    p.add_argument("--json", action="store_true", help="print JSON results instead of the table")
    p.add_argument("--save", metavar="FILE", help="also write the JSON results to FILE")
    p.add_argument("--load", metavar="FILE",
                   help="print the table (or --json) of results saved with --save; runs nothing")
    p.add_argument("--child", nargs=3, metavar=("IMPL", "LOSS", "ROWS"), help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    return p


def child_or_load(args, child, show) -> bool:
    """The two modes every benchmark section shares: ``child`` (one case in a fresh process:
    its result as JSON to ``--child-out``) and ``--load`` (saved results printed by ``show``,
    or as JSON with ``--json``). True when one of them ran."""
    if child is not None:
        with open(args.child_out, "w") as f:
            json.dump(child(args), f)
        return True
    if args.load:
        with open(args.load) as f:
            saved = json.load(f)
        print(json.dumps(saved, indent=2) if args.json else show(saved))
        return True
    return False


def main(argv=None) -> int:
    rest = sys.argv[1:] if argv is None else list(argv)
    if rest and rest[0] in ("fused", "--fused"):  # the fused LM-head section: bench/fused.py
        from topkd.bench import fused

        return fused.main(rest[1:])
    if rest and rest[0] == "store":  # the teacher store section: bench/store.py
        from topkd.bench import store

        return store.main(rest[1:])
    args = build_parser().parse_args(argv)
    args.rows = [r for group in args.rows for r in group]
    if child_or_load(args, run_child if args.child else None,
                     lambda saved: format_table(saved["results"], saved["meta"])):
        return 0

    cases = [(impl, loss, rows) for loss in LOSSES if loss in args.loss
             for rows in args.rows for impl in IMPLS if impl in args.impl
             if not (impl == "prefix" and loss != "topk")]
    results = []
    t_start = time.perf_counter()
    load_start = _loadavg()
    for i, (impl, loss, rows) in enumerate(cases, 1):
        print(f"[{i}/{len(cases)}] {IMPL_LABELS[impl]} {LOSS_NAMES[loss]} rows={rows} ...",
              file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        r = _run_case(args, impl, loss, rows)
        dt = time.perf_counter() - t0
        if r["status"] == "ok":
            summary = (f"peak {r['peak_bytes'] / MiB:,.0f} MiB ({r['x_logits']:.2f}x logits), "
                       f"{r['median_s']:.2f} s, loss err {_fmt_err(r.get('loss_rel_err'))}")
        else:
            summary = _status_text(r) + (f": {r['message'][:200]}" if r.get("message") else "")
        print(f"[{i}/{len(cases)}]   {summary} ({dt:.0f} s)", file=sys.stderr, flush=True)
        results.append(r)

    import torch  # only for the header

    threads = args.threads or torch.get_num_threads()
    for r in results:
        if r.get("threads"):
            threads = r["threads"]
            break
    meta = {
        "vocab": args.vocab, "k": args.k, "dtype": args.dtype, "temperature": args.temperature,
        "device": args.device, "torch": torch.__version__, "threads": threads,
        "chunk_bytes": args.chunk_bytes if args.chunk_bytes is not None else "default",
        "repeats": args.repeats, "mem_limit_gib": args.mem_limit_gib,
        "sample_rows": args.sample_rows, "python": platform.python_version(),
        "machine": platform.machine(), "cpus": os.cpu_count(),
        "command": "python -m topkd.bench " + " ".join(sys.argv[1:] if argv is None else argv),
        "total_s": time.perf_counter() - t_start,
        "loadavg_start": load_start, "loadavg_end": _loadavg(),
    }
    if args.save:
        with open(args.save, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=2)
    if args.json:
        print(json.dumps({"meta": meta, "results": results}, indent=2))
    else:
        print(format_table(results, meta))
    return 0 if all(r["status"] in ("ok", "oom") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
