"""Benchmark, core section: topkd's losses against the plain float32 implementation they replace.

``python -m benchmarks`` (from the repository root) runs every case, one case being
(implementation, loss, divergence, rows), in its own fresh Python process whose address space
is capped (:mod:`benchmarks.harness`), so a case that runs out of memory shows as "out of
memory at N GiB" in the table instead of taking the machine down. Per case it reports:

* **peak above inputs**: the peak of bytes allocated during one forward + backward, above
  what was allocated before it (the logits), by the method the memory tests use: a
  ``torch.profiler.profile(profile_memory=True)`` around the step, the allocator events
  (``[memory]``, signed ``nbytes()``) walked in time order, running maximum. It includes the
  student gradient itself (1.0x the student logits' bytes). On CUDA it is
  ``torch.cuda.max_memory_allocated`` above the allocation before the step.
* **x logits**: that peak as a multiple of the student logits' bytes.
* **fwd+bwd s**: median wall time of ``--repeats`` forward + backward runs (``loss.sum()
  .backward()``, ``reduction="none"``) after one warm-up, measured without the profiler;
  with ``--processes N``, each case runs in N fresh processes (all cases once, then again,
  N rounds) and its time is the median of the N processes' medians, the peak and the errors
  the largest of theirs.
* **loss rel err**: max over ``--sample-rows`` rows of ``|L - L64| / |L64|``, with ``L64``
  the same loss definition computed in float64 on those rows by the test suite's reference
  (``tests/reference.py``).
* **grad err**: ``max |g - g64| / max |g64|`` over the sampled rows, with ``g64`` the float64
  autograd gradient. The table's footnote gives the floor that rounding ``g64`` to the logits'
  dtype alone produces.

Implementations (``--impl``):

* ``topkd``: ``topkd.topk_kl_loss`` and ``topkd.kl_loss`` (``divergence=`` for ``--divergence``
  jsd and tvd), one case per ``--kernels`` value (``impl=``: compile, eager, auto); the
  **first call s** column is the process's first forward + backward, compiling (or loading
  from inductor's on-disk cache) included.
* ``naive``: **the plain float32 implementation as it was before topkd**, written here as the
  usual code does it: upcast student and teacher to float32, divide by T, ``log_softmax``
  over the full vocabulary for both, the teacher's top-K by ``torch.topk``, gather, the ghost
  bucket by ``log1p(-sum of the selected probabilities)``, the divergence over the K + 1
  buckets; and for ``kl_loss`` ``log_softmax`` of both and the divergence over the whole
  vocabulary. KL is ``F.kl_div(..., log_target=True)``; JSD and TVD are written as TRL writes
  them (JSD: the mixture by ``logsumexp`` of the stacked ``[student_logp + log(1 - beta),
  teacher_logp + log(beta)]``, two ``F.kl_div(..., log_target=True)``, beta-weighted sum; TVD:
  ``0.5 * |p - q|`` summed, from ``softmax`` of both over the whole vocabulary). Its loss error
  is measured against float64 on *its own* selection (``torch.topk`` breaks ties arbitrarily,
  and bf16 logits have many ties at the K-th value), so it shows the float32 and ``log1p``
  error alone (``loss_rel_err``; ``loss_rel_err_reference_selection`` in the saved results is
  the same against float64 on the reference's selection, ties to the lower index; results
  saved before it was renamed call it ``loss_rel_err_spec_selection``).
* ``prefix`` (opt-in): a reconstruction of the pre-fix Model-Optimizer style Top-K loss, whose
  normalizers are computed as ``max``/``exp``/``sum`` on float32 copies of the whole logits
  (about five float32 copies alive at the backward peak). Top-K KL only.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import reference  # the float64 reference, tests/reference.py (benchmarks/__init__.py)

from topkd._args import int_at_least

from . import harness
from .harness import JSD_BETA, GiB, MiB

IMPLS = ("topkd", "naive", "prefix")
DEFAULT_IMPLS = ("topkd", "naive")
LOSSES = ("topk", "kl")
LOSS_NAMES = {"topk": "topk_kl_loss", "kl": "kl_loss"}
IMPL_LABELS = {"topkd": "topkd", "naive": "naive fp32", "prefix": "pre-fix style fp32"}
DIVERGENCE_LABELS = {"kl": "KL", "jsd": f"JSD({JSD_BETA:g})", "tvd": "TVD"}

# Peak above the inputs, for the memory estimate made before a case is started: float32
# copies of [rows, V], plus multiples of the student logits' bytes (the gradient). From the
# x logits this benchmark measures for each case (x logits / 2 float32 copies for bf16
# logits), rounded up; an estimate only decides whether to start a case, the address-space cap
# in the child is what actually stops it.
_ESTIMATE = {
    # impl, loss, divergence: (float32 copies, logits copies)
    ("naive", "topk", "kl"): (4.2, 0.0),  # 8.26x the bf16 logits
    ("naive", "topk", "jsd"): (4.35, 0.0),  # 8.60x
    ("naive", "topk", "tvd"): (4.2, 0.0),  # 8.35x
    ("naive", "kl", "kl"): (5.05, 0.0),  # 10.0x
    ("naive", "kl", "jsd"): (13.05, 0.0),  # 26.0x
    ("naive", "kl", "tvd"): (4.05, 0.0),  # 8.0x
    ("prefix", "topk", "kl"): (5.2, 0.0),  # 10.3x
}
_TOPKD_ESTIMATE = (0.0, 1.5)  # bound 1.25x
_BASE_BYTES = 0.5 * GiB  # input generation, float64 reference rows, slack (torch is not counted)


# --------------------------------------------------------------------------------------------
# Implementations written in the benchmark
# --------------------------------------------------------------------------------------------

_LAST_SELECTION = {}


def naive_divergence(student_logprobs, teacher_logprobs, divergence="kl"):
    """Per-row divergence of float32 log-probabilities over the last dimension, written the way
    the plain code writes it: ``F.kl_div`` for KL; TRL's generalized JSD (mixture by
    ``logsumexp`` of the stacked, shifted log-probabilities, two ``F.kl_div``); TVD as
    ``0.5 * |p - q|``."""
    import torch
    import torch.nn.functional as F

    if divergence == "kl":
        return F.kl_div(student_logprobs, teacher_logprobs, reduction="none",
                        log_target=True).sum(-1)
    if divergence == "jsd":
        beta = JSD_BETA
        mixture = torch.logsumexp(torch.stack([student_logprobs + math.log(1 - beta),
                                               teacher_logprobs + math.log(beta)]), dim=0)
        kl_teacher = F.kl_div(mixture, teacher_logprobs, reduction="none", log_target=True)
        kl_student = F.kl_div(mixture, student_logprobs, reduction="none", log_target=True)
        return (beta * kl_teacher + (1 - beta) * kl_student).sum(-1)
    if divergence == "tvd":
        return 0.5 * (student_logprobs.exp() - teacher_logprobs.exp()).abs().sum(-1)
    raise ValueError(f"unknown divergence {divergence!r}")


def naive_topk_kl_loss(student_logits, teacher_logits, k, temperature=1.0, divergence="kl"):
    """Plain float32 Top-K KD loss, as it was before topkd (the reference to beat).

    The usual code: upcast both logits to float32, divide by T, log_softmax over the full
    vocabulary, teacher's top-K by torch.topk, gather, ghost bucket by log1p(-sum), the
    divergence over K + 1 buckets. Returns the per-row loss (float32, shape [rows]).
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
    if divergence != "kl":
        return naive_divergence(torch.cat([student_top, student_ghost[:, None]], -1),
                                torch.cat([teacher_top, teacher_ghost[:, None]], -1),
                                divergence)
    loss = (teacher_probs * (teacher_top - student_top)).sum(-1)
    loss = loss + teacher_ghost.exp() * (teacher_ghost - student_ghost)
    return loss


def naive_kl_loss(student_logits, teacher_logits, temperature=1.0, divergence="kl"):
    """Plain float32 full-vocabulary KD loss: log_softmax both (TVD: softmax both), the
    divergence over the whole vocabulary."""
    import torch

    normalize = torch.softmax if divergence == "tvd" else torch.log_softmax
    student = normalize(student_logits.float() / temperature, dim=-1)
    with torch.no_grad():
        teacher = normalize(teacher_logits.float() / temperature, dim=-1)
    if divergence == "tvd":
        return 0.5 * (student - teacher).abs().sum(-1)
    return naive_divergence(student, teacher, divergence)


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


def loss_function(impl, loss, divergence, k, temperature, chunk_bytes, kernels="auto"):
    """``fn(student_logits, teacher_logits) -> per-row loss`` of one case."""
    if impl == "topkd":
        import topkd

        options = {"temperature": temperature, "chunk_bytes": chunk_bytes, "impl": kernels}
        if divergence == "jsd":
            options["divergence"] = topkd.JSD(beta=JSD_BETA)
        elif divergence == "tvd":
            options["divergence"] = topkd.TVD()
        if loss == "topk":
            topk_kl_loss = topkd.topk_kl_loss
            return lambda s, t: topk_kl_loss(s, t, k, **options)
        kl_loss = topkd.kl_loss
        return lambda s, t: kl_loss(s, t, **options)
    if impl == "naive":
        if loss == "topk":
            return lambda s, t: naive_topk_kl_loss(s, t, k, temperature, divergence)
        return lambda s, t: naive_kl_loss(s, t, temperature, divergence)
    if impl == "prefix":
        if loss == "topk" and divergence == "kl":
            return lambda s, t: prefix_topk_kl_loss(s, t, k, temperature)
        raise ValueError("the pre-fix style reference has only the Top-K KL loss")
    raise ValueError(f"unknown implementation {impl!r}")


# --------------------------------------------------------------------------------------------
# Child process: one case
# --------------------------------------------------------------------------------------------


def make_inputs(rows, vocab, dtype, seed, device):
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


def run_case(args, impl, loss_kind, divergence, rows, kernels="-") -> dict:
    """One case, in the child process: memory, time, and errors against float64."""
    result = {"mem_limit_gib": args.mem_limit_gib, "status": "error"}
    with harness.stages(result) as stage:
        stage("import torch")
        torch = harness.child_torch(args, result)
        # not on CUDA, whose driver reserves a large address space
        if args.device == "cpu":
            harness.cap_address_space(args.mem_limit_gib)
        dtype = getattr(torch, args.dtype)
        stage(harness.IMPORT_STAGE)
        fn = loss_function(impl, loss_kind, divergence, args.k, args.temperature,
                           args.chunk_bytes, kernels)
        stage("make inputs")
        student, teacher = make_inputs(rows, args.vocab, dtype, args.seed, args.device)
        logits_bytes = student.numel() * student.element_size()
        result["logits_bytes"] = logits_bytes
        sync = torch.cuda.synchronize if args.device.startswith("cuda") else None
        last = {}

        def step():
            student.grad = None
            out = fn(student, teacher)
            out.sum().backward()
            last["loss"] = out.detach()

        # the process's first call: compiled kernels are built (or loaded) here
        stage("forward + backward (first call)")
        result["first_call_s"] = harness.first_call(step, sync)
        student.grad = None

        # memory: one forward + backward under the profiler, inputs allocated before it
        stage("forward + backward (memory run)")
        peak, after, prof = harness.profile_peak(step, args.device)
        result["peak_bytes"] = peak
        result["x_logits"] = peak / logits_bytes if logits_bytes else float("nan")
        result["retained_bytes"] = after
        if args.breakdown and prof is not None:
            result["breakdown"] = prof.key_averages().table(
                sort_by="self_cpu_time_total", row_limit=args.breakdown
            )
        del prof
        student.grad = None

        # time: one warm-up, then the median of --repeats runs
        stage("forward + backward (timing)")
        harness.timed(step, 1, sync)
        result["times_s"] = harness.timed(step, args.repeats, sync)
        result["median_s"] = statistics.median(result["times_s"])

        # accuracy on a few rows against float64
        stage("float64 reference")
        sample = harness.sample_rows(rows, args.sample_rows)
        result["sample_rows"] = sample
        if sample:
            idx = torch.tensor(sample, device=args.device)
            got_loss = last["loss"][idx].double().cpu()
            z = student.detach()[idx].cpu()
            t = teacher[idx].cpu()
            options = {"temperature": args.temperature,
                       "divergence": harness.reference_divergence(divergence)}
            own = None
            if loss_kind == "topk":
                if impl != "topkd" and "indices" in _LAST_SELECTION:
                    own = _LAST_SELECTION["indices"][idx].cpu()
                ref, g64 = reference.loss_and_grad(reference.topk_loss, z, t, args.k,
                                                   indices=own, **options)
            else:
                ref, g64 = reference.loss_and_grad(reference.full_loss, z, t, **options)
            result["loss_rel_err"] = harness.rel_err(got_loss, ref)
            result["grad_err"], result["grad_floor"] = harness.grad_err(
                student.grad[idx].cpu(), g64, dtype)
            if own is not None:  # also on the reference's selection (ties to the lower index)
                ref_lower = reference.topk_loss(z, t, args.k, **options)
                result["loss_rel_err_reference_selection"] = harness.rel_err(got_loss, ref_lower)
            result["loss_sample_mean"] = ref.mean().item()
    return result


# --------------------------------------------------------------------------------------------
# Parent: run the cases, print the table
# --------------------------------------------------------------------------------------------


def _estimate_bytes(impl, loss, divergence, rows, vocab, dtype) -> float:
    f32_copies, logits_copies = (_TOPKD_ESTIMATE if impl == "topkd"
                                 else _ESTIMATE[(impl, loss, divergence)])
    logits = rows * vocab * harness.DTYPE_BYTES[dtype]
    return 2 * logits + f32_copies * rows * vocab * 4 + logits_copies * logits + _BASE_BYTES


def _run_case(args, impl, loss, divergence, rows, kernels) -> dict:
    base = {
        "impl": impl, "kernels": kernels, "loss": LOSS_NAMES[loss], "divergence": divergence,
        "rows": rows,
        "vocab": args.vocab, "k": args.k, "dtype": args.dtype, "temperature": args.temperature,
        "chunk_bytes": args.chunk_bytes, "device": args.device,
    }
    limit = harness.memory_limit(args.mem_limit_gib) if args.device == "cpu" else \
        args.mem_limit_gib
    base["mem_limit_gib"] = limit
    if limit and args.estimate and args.device == "cpu":
        need = _estimate_bytes(impl, loss, divergence, rows, args.vocab, args.dtype)
        base["estimate_bytes"] = need
        if need > limit * GiB:
            base.update(status="oom", estimated_only=True,
                        message=f"estimated {need / GiB:.1f} GiB > limit {limit:g} GiB; not run "
                                f"(--no-estimate runs it against the address-space cap)")
            return base
    settings = {**vars(args), "mem_limit_gib": limit}
    base.update(harness.run_child("benchmarks.core:run_case", settings, impl, loss, divergence,
                                  rows, kernels, timeout=args.timeout))
    return base


def _loss_label(r) -> str:
    divergence = r.get("divergence", "kl")
    return r["loss"] if divergence == "kl" else f"{r['loss']} {DIVERGENCE_LABELS[divergence]}"


def _fmt_first(r) -> str:
    first = r.get("first_call_s")
    return "-" if first is None else f"{first:.2f}"


def _eager_of(results, r):
    for o in results:
        if (o["impl"] == "topkd" and o.get("kernels") == "eager" and o["loss"] == r["loss"]
                and o["rows"] == r["rows"]
                and o.get("divergence", "kl") == r.get("divergence", "kl")):
            return o
    return None


def _naive_of(results, r):
    for o in results:
        if (o["impl"] == "naive" and o["loss"] == r["loss"] and o["rows"] == r["rows"]
                and o.get("divergence", "kl") == r.get("divergence", "kl")):
            return o
    return None


def format_table(results, meta) -> str:
    fmt_err = harness.fmt_err
    lines = []
    lines.append(
        f"V = {meta['vocab']:,}, K = {meta['k']:,}, {meta['dtype']}, T = {meta['temperature']:g}, "
        f"device {meta['device']}"
        + (f" ({meta['device_name']})" if meta.get("device_name") else "")
        + f", torch {meta['torch']}, {meta['threads']} threads, "
        f"chunk_bytes = {meta['chunk_bytes']}, repeats = {meta['repeats']}"
        + (f" in each of {meta['processes']} processes per case (time: the median of their "
           f"medians; [min-max] over every repeat)" if meta.get("processes", 1) > 1 else "")
        + (f", memory cap {meta['mem_limit_gib']:g} GiB per case" if meta["device"] == "cpu"
           else "")
    )
    load = harness.load_line(meta)
    if load:
        lines += ["", load]
    lines.append("")
    lines.append("| impl | kernels | loss | rows | peak above inputs (MiB) | x logits "
                 "| fwd+bwd s (median [min-max]) | first call s "
                 "| vs naive | loss rel err | grad err (floor) |")
    lines.append("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    floors = []
    for r in results:
        label = IMPL_LABELS.get(r["impl"], r["impl"])
        if r["status"] != "ok":
            lines.append(f"| {label} | {r.get('kernels', '-')} | {_loss_label(r)} "
                         f"| {r['rows']:,} | {harness.status_text(r)} | - | - | - | - | - | - |")
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
            f"| {label} | {r.get('kernels', '-')} | {_loss_label(r)} | {r['rows']:,} "
            f"| {r['peak_bytes'] / MiB:,.0f} | {r['x_logits']:.2f} "
            f"| {r['median_s']:.2f}{harness.spread(r.get('times_s'))} "
            f"| {_fmt_first(r)} | {vs} | {fmt_err(r.get('loss_rel_err'))} "
            f"| {fmt_err(r.get('grad_err'))} ({fmt_err(r.get('grad_floor'))}) |"
        )
    lines.append("")
    lines.append(
        "naive fp32 = the plain float32 implementation as it was before topkd, written in the "
        "benchmark (upcast, log_softmax of the full logits, torch.topk, gather, ghost by log1p; "
        "kl_loss: log_softmax + kl_div). Its loss error is against float64 on its own "
        "torch.topk selection."
        + (" JSD and TVD as TRL writes them: JSD by the logsumexp of the stacked shifted "
           "log-probabilities and two kl_div, TVD as 0.5 |p - q| summed (over the K + 1 "
           "buckets for topk_kl_loss)." if any(r.get("divergence", "kl") != "kl"
                                               for r in results) else "")
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
    pairs = [(r, _naive_of(results, r)) for r in results if r["impl"] == "topkd"]
    pairs = [(r, naive) for r, naive in pairs if naive is not None]
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
                mem = tim = f"naive: {harness.status_text(naive, short=True)}"
            else:
                mem = tim = f"topkd: {harness.status_text(r, short=True)}"
            lines.append(f"| {_loss_label(r)} | {r['rows']:,} | {mem} | {tim} |")
    pairs = [(r, _eager_of(results, r)) for r in results
             if r["impl"] == "topkd" and r.get("kernels") not in ("eager", None)]
    pairs = [(r, eager) for r, eager in pairs if eager is not None]
    if pairs:
        lines.append("")
        lines.append("topkd compiled / eager kernels (steady state):")
        lines.append("")
        lines.append("| kernels | loss | rows | memory (peak above inputs) | time (fwd+bwd) |")
        lines.append("|---|---|---:|---:|---:|")
        for r, eager in pairs:
            if r["status"] == "ok" and eager["status"] == "ok":
                lines.append(f"| {r['kernels']} | {_loss_label(r)} | {r['rows']:,} "
                             f"| {r['peak_bytes'] / eager['peak_bytes']:.3f} "
                             f"| {r['median_s'] / eager['median_s']:.2f} |")
    notes = [r for r in results if r["status"] != "ok" and r.get("message")]
    if notes:
        lines.append("")
        for r in notes:
            lines.append(f"- {IMPL_LABELS.get(r['impl'], r['impl'])} {_loss_label(r)} "
                         f"rows={r['rows']}: {r['message'][:300]}")
    breakdowns = [r for r in results if r.get("breakdown")]
    for r in breakdowns:
        lines.append("")
        lines.append(f"Profile of {IMPL_LABELS.get(r['impl'], r['impl'])} {_loss_label(r)} "
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


def build_parser():
    p = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Benchmark topkd's KD losses against the plain float32 implementation: peak "
                    "memory above the inputs (profiler method), forward + backward time, error "
                    "vs float64. Every case runs in its own memory-capped process.",
        epilog="Fused LM-head section (fused_topk_kl_loss / fused_kl_loss vs F.linear + the "
               "loss, Liger-Kernel and TRL): 'python -m benchmarks fused --help'. Teacher store "
               "section: 'python -m benchmarks store --help'.",
    )
    p.add_argument("--rows", type=_parse_rows, nargs="+", default=[[256, 1024, 4096]],
                   help="sequence lengths (rows of logits), e.g. '256 1024' or 256,1024 "
                        "(default 256,1024,4096; the naive float32 implementation "
                        "does not fit 4096 rows under the default 20 GiB cap)")
    p.add_argument("--vocab", type=int, default=248_320, help="vocabulary size V (248320)")
    p.add_argument("--k", type=int, default=4096, help="Top-K (4096)")
    p.add_argument("--dtype", choices=harness.DTYPES, default="bfloat16",
                   help="logits dtype (bfloat16)")
    p.add_argument("--temperature", type=float, default=1.0, help="temperature T (1.0)")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed forward + backward runs after one warm-up; median reported (3)")
    p.add_argument("--processes", type=int_at_least(1), default=1,
                   help="fresh processes per case, the cases in turn (rounds); a case's time "
                        "is the median of its processes' medians (1)")
    p.add_argument("--impl", nargs="+", choices=IMPLS, default=list(DEFAULT_IMPLS),
                   help="implementations (default: topkd naive; 'prefix' is opt-in)")
    p.add_argument("--loss", nargs="+", choices=LOSSES, default=list(LOSSES),
                   help="losses: topk (topk_kl_loss) and/or kl (kl_loss) (default both)")
    p.add_argument("--divergence", nargs="+", choices=harness.DIVERGENCES, default=["kl"],
                   help=f"divergences: kl, jsd (JSD(beta={JSD_BETA:g})), tvd "
                        "(default kl)")
    p.add_argument("--chunk-bytes", type=harness.int_bytes, default=None,
                   help="chunk_bytes passed to topkd (e.g. 64MiB; default: the library's)")
    harness.add_kernel_options(p)
    harness.add_process_options(p)
    p.add_argument("--no-estimate", dest="estimate", action="store_false",
                   help="start every case even when the memory estimate exceeds the cap")
    p.add_argument("--sample-rows", type=int, default=8,
                   help="rows compared against the float64 reference (8)")
    p.add_argument("--seed", type=int, default=0, help="torch.manual_seed for the inputs (0)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--breakdown", type=int, default=0, metavar="N",
                   help="also print the top N ops by self CPU time of each case's profiled run")
    harness.add_output_options(p)
    return p


def _show(saved) -> str:
    return format_table(saved["results"], saved["meta"])


def main(argv) -> int:
    args = build_parser().parse_args(argv)
    if args.load:
        harness.show_saved(args, _show)
        return 0
    args.rows = [r for group in args.rows for r in group]
    cases = [(impl, loss, divergence, rows, kernels) for loss in LOSSES if loss in args.loss
             for divergence in harness.DIVERGENCES if divergence in args.divergence
             for rows in args.rows for impl in IMPLS if impl in args.impl
             for kernels in (args.kernels if impl == "topkd" else ["-"])
             if not (impl == "prefix" and (loss, divergence) != ("topk", "kl"))]
    t_start = time.perf_counter()
    load_start = harness.loadavg()

    def describe(case):
        impl, loss, divergence, rows, kernels = case
        return (f"{IMPL_LABELS[impl]}{'' if kernels == '-' else f' ({kernels})'} "
                f"{_loss_label({'loss': LOSS_NAMES[loss], 'divergence': divergence})} "
                f"rows={rows}")

    def summarize(r):
        return (f"peak {r['peak_bytes'] / MiB:,.0f} MiB ({r['x_logits']:.2f}x logits), "
                f"{r['median_s']:.2f} s, loss err {harness.fmt_err(r.get('loss_rel_err'))}")

    results = harness.run_rounds(cases, args.processes, describe,
                                 lambda case: _run_case(args, *case), summarize)

    import torch  # only for the header

    meta = {
        "vocab": args.vocab, "k": args.k, "dtype": args.dtype, "temperature": args.temperature,
        "device": args.device, "torch": torch.__version__,
        "device_name": next((r["device_name"] for r in results if r.get("device_name")), None),
        "threads": harness.threads_of(results, args.threads),
        "chunk_bytes": args.chunk_bytes if args.chunk_bytes is not None else "default",
        "repeats": args.repeats, "processes": args.processes,
        "mem_limit_gib": args.mem_limit_gib, "sample_rows": args.sample_rows,
        "divergences": args.divergence, "kernels": args.kernels,
        **harness.run_meta("", argv, t_start, load_start),
    }
    harness.emit(args, {"meta": meta, "results": results}, _show)
    return 0 if all(r["status"] in ("ok", "oom") for r in results) else 1
