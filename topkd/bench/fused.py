"""Benchmark, fused LM-head section: ``python -m topkd.bench fused`` (or ``--fused``).

The student's logits are ``F.linear(hidden, weight)``; the fused losses take ``hidden`` and
``weight`` and never hold those logits whole. Cases, each in its own fresh, memory-capped
process like the default section's:

* ``fused`` ``topk``: ``topkd.fused_topk_kl_loss(hidden, weight, teacher_logits, K)``.
* ``unfused`` ``topk``: ``z = F.linear(hidden, weight)``, ``topkd.topk_kl_loss(z,
  teacher_logits, K)``. The teacher of both is logits ``[N, V]`` in the input dtype, made
  before the step (an input).
* ``fused`` ``kl``: ``topkd.fused_kl_loss(hidden, weight, (teacher_hidden, teacher_weight))``.
* ``unfused`` ``kl``: ``topkd.kl_loss(F.linear(hidden, weight), F.linear(teacher_hidden,
  teacher_weight))`` (both logits are made inside the step and counted).
* ``liger`` ``kl``: Liger-Kernel's ``LigerFusedLinearJSDLoss(weight_hard_loss=0,
  weight_soft_loss=1, beta=0, temperature=T)`` on ``(hidden, weight, teacher_hidden,
  teacher_weight, labels)``. Liger's ``beta=0`` branch is ``F.kl_div(student_logprobs,
  teacher_logprobs, log_target=True)``, i.e. the forward KL(teacher || student) over the full
  vocabulary (``beta=1`` is the reverse KL); it divides both logits by T and has no ``T**2``
  factor, and with ``weight_hard_loss=0`` it skips the cross-entropy and returns the sum of the
  rows' KL divided by the number of labels not equal to ``ignore_index`` (all of them here):
  the same quantity as topkd's ``reduction="mean"``. Imported only in its own case (optional
  extra ``liger-kernel``).

Per case:

* **peak above inputs excl. grads**: one forward + backward under ``torch.profiler`` with
  ``profile_memory=True``; the allocations (with their addresses) walked in time order. The
  gradients returned to ``hidden`` and ``weight`` (identified by the address of ``.grad``
  after the step: the allocation at that address still alive at the end) and, for topkd's
  fused losses with a bf16/fp16 weight, their float32 accumulator of the weight's shape (the
  first allocation of exactly its bytes made inside ``aten::zeros``; the unfused path and
  Liger accumulate in the weight's dtype and have none) are not counted while alive: the
  peak is ``max_t (allocated(t) - excluded alive(t))``. The raw peak (everything, as in the
  default section) and the excluded bytes are reported too.
* **x logits**: that peak over the bytes the student logits would take (``N x V x`` the
  element size).
* **fwd+bwd s**: median of ``--repeats`` runs after one warm-up (the warm-up also runs before
  the memory run, so Liger's ``torch.compile`` is not in it).
* **errors**: the implementation is run again on the problem of ``--sample-rows`` rows alone
  (their hidden states and teacher, the whole weight; Liger with its chunk size scaled so that
  it accumulates over as many chunks as in the full run) and compared with float64: the
  student logits ``F.linear(hidden, weight)`` as every implementation computes them, in the
  input dtype, upcast exactly (the teacher's likewise), the loss by SPEC section 1 in float64,
  ``dz64`` its gradient, and the chain rule ``dz64 @ W64`` and ``dz64.T @ h64``. loss rel err
  = ``|L - L64| / |L64|``; grad err = ``max |g - g64| / max |g64|``, in brackets the floor
  (``g64`` rounded to the input dtype). The loss error against float64 of the *exact* products
  (``h64 @ W64.T``, no rounding of the logits) is given too: it is dominated by the rounding of
  the logits to the input dtype, which every implementation shares.

A small agreement check (``--no-verify`` skips it) runs the three ``kl`` implementations on a
small problem in float32 and bf16 and prints their relative differences, and Liger's
``beta=1`` against topkd's ``reverse=True``.
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

from . import __main__ as base

GiB, MiB = base.GiB, base.MiB

IMPLS = ("fused", "unfused", "liger")
LOSSES = ("topk", "kl")
CASES = (("fused", "topk"), ("unfused", "topk"), ("fused", "kl"), ("unfused", "kl"),
         ("liger", "kl"))
IMPL_LABELS = {"fused": "topkd fused", "unfused": "topkd unfused", "liger": "Liger"}
LOSS_LABELS = {
    ("fused", "topk"): "fused_topk_kl_loss",
    ("unfused", "topk"): "F.linear + topk_kl_loss",
    ("fused", "kl"): "fused_kl_loss",
    ("unfused", "kl"): "F.linear x2 + kl_loss",
    ("liger", "kl"): "LigerFusedLinearJSDLoss(beta=0)",
}
TEACHER_LABELS = {"topk": "logits [N, V]", "kl": "(hidden, weight)"}


# --------------------------------------------------------------------------------------------
# Inputs and the implementations' steps
# --------------------------------------------------------------------------------------------


def make_inputs(args, loss_kind, device="cpu"):
    """hidden ~ N(0, 1) [N, H]; weight ~ N(0, (2/sqrt(H))^2) [V, H] (student logits std ~2).
    Top-K case: teacher logits = 0.8 z + 1.2 N(0, 1) in the input dtype, z the student's logits
    (made in row chunks, never whole in float32). KL case: teacher_hidden = hidden when H_t == H
    (else N(0, 1)), teacher_weight = 0.8 weight + 1.2 N(0, 1/H_t) (else N(0, (2/sqrt(H_t))^2)):
    teacher logits std ~2, correlated with the student's."""
    import torch
    import torch.nn.functional as F

    dtype = getattr(torch, args.dtype)
    torch.manual_seed(args.seed)
    n, h, v, ht = args.tokens, args.hidden, args.vocab, args.teacher_hidden
    hidden = torch.randn(n, h).to(device=device, dtype=dtype)
    weight = torch.empty(v, h, dtype=dtype, device=device)
    step = 16384
    for lo in range(0, v, step):
        hi = min(v, lo + step)
        weight[lo:hi] = (torch.randn(hi - lo, h) * (2.0 / math.sqrt(h))).to(device, dtype)
    inputs = {"hidden": hidden, "weight": weight,
              "labels": torch.zeros(n, dtype=torch.long, device=device)}
    with torch.no_grad():
        if loss_kind == "topk":
            teacher = torch.empty(n, v, dtype=dtype, device=device)
            rows = max(1, (64 * MiB) // (4 * v))
            for lo in range(0, n, rows):
                hi = min(n, lo + rows)
                z = F.linear(hidden[lo:hi], weight).float()
                teacher[lo:hi] = (0.8 * z + 1.2 * torch.randn(hi - lo, v).to(device)).to(dtype)
                del z
            inputs["teacher_logits"] = teacher
        else:
            if ht == h:
                th = hidden.clone()
            else:
                th = torch.randn(n, ht).to(device=device, dtype=dtype)
            tw = torch.empty(v, ht, dtype=dtype, device=device)
            for lo in range(0, v, step):
                hi = min(v, lo + step)
                if ht == h:
                    tw[lo:hi] = (0.8 * weight[lo:hi].float()
                                 + torch.randn(hi - lo, ht).to(device) * (1.2 / math.sqrt(ht))
                                 ).to(dtype)
                else:
                    tw[lo:hi] = (torch.randn(hi - lo, ht) * (2.0 / math.sqrt(ht))).to(device,
                                                                                     dtype)
            inputs["teacher_hidden"], inputs["teacher_weight"] = th, tw
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    return inputs


def loss_function(impl, loss_kind, args, chunk_size=None):
    """``fn(inputs) -> loss`` (scalar for sum/mean; per row for none)."""
    import torch.nn.functional as F

    k, temperature, reduction, chunk_bytes = args.k, args.temperature, args.reduction, \
        args.chunk_bytes
    if impl in ("fused", "unfused"):
        import topkd

        if (impl, loss_kind) == ("fused", "topk"):
            return lambda d: topkd.fused_topk_kl_loss(
                d["hidden"], d["weight"], d["teacher_logits"], k, temperature=temperature,
                reduction=reduction, chunk_bytes=chunk_bytes)
        if (impl, loss_kind) == ("unfused", "topk"):
            return lambda d: topkd.topk_kl_loss(
                F.linear(d["hidden"], d["weight"]), d["teacher_logits"], k,
                temperature=temperature, reduction=reduction, chunk_bytes=chunk_bytes)
        if (impl, loss_kind) == ("fused", "kl"):
            return lambda d: topkd.fused_kl_loss(
                d["hidden"], d["weight"], (d["teacher_hidden"], d["teacher_weight"]),
                temperature=temperature, reduction=reduction, chunk_bytes=chunk_bytes)
        return lambda d: topkd.kl_loss(
            F.linear(d["hidden"], d["weight"]), F.linear(d["teacher_hidden"], d["teacher_weight"]),
            temperature=temperature, reduction=reduction, chunk_bytes=chunk_bytes)
    if impl == "liger":
        if loss_kind != "kl":
            raise ValueError("Liger-Kernel has no Top-K loss")
        if reduction == "none":
            raise ValueError("LigerFusedLinearJSDLoss returns a scalar (the mean over rows) only")
        from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss

        module = LigerFusedLinearJSDLoss(
            weight_hard_loss=0.0, weight_soft_loss=1.0, beta=0.0, temperature=temperature,
            compiled=args.liger_compiled, chunk_size=chunk_size or args.liger_chunk_size)

        def fn(d):
            out = module(d["hidden"], d["weight"], d["teacher_hidden"], d["teacher_weight"],
                         d["labels"])
            return out * d["hidden"].shape[0] if reduction == "sum" else out

        return fn
    raise ValueError(f"unknown implementation {impl!r}")


# --------------------------------------------------------------------------------------------
# Memory: the profiler's allocations, with addresses, in time order
# --------------------------------------------------------------------------------------------


def _allocations(prof):
    """``[(time_ns, order, ptr, signed bytes, enclosing op names)]`` of the profiler's
    allocator events."""
    from torch._C._profiler import _EventType

    out = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            ef = node.extra_fields
            ops, parent = [], node.parent
            while parent is not None:
                ops.append(parent.name)
                parent = parent.parent
            out.append((node.start_time_ns, len(out), ef.ptr, ef.alloc_size, tuple(ops)))
        stack.extend(node.children)
    out.sort()
    return out


def _kineto_peak(prof):
    """The default section's method (signed nbytes of the [memory] events), as a check."""
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    current = peak = 0
    for e in events:
        current += e.nbytes()
        peak = max(peak, current)
    return peak


def peak_excluding(allocs, grad_ptrs, accumulator_bytes):
    """``(peak, raw_peak, excluded_bytes, notes)``: the running maximum of allocated bytes
    minus the bytes of the excluded allocations alive at that time. Excluded: the last
    allocation at each address in ``grad_ptrs`` if it is never freed (the returned
    gradients), and the first allocation of exactly ``accumulator_bytes`` (if not None)."""
    last_alloc = {}
    freed_after = set()
    for i, (_, _, ptr, size, _) in enumerate(allocs):
        if size > 0:
            last_alloc[ptr] = i
        elif size < 0 and ptr in last_alloc:
            freed_after.add(last_alloc[ptr])
    excluded = set()
    notes = []
    for name, ptr in grad_ptrs.items():
        i = last_alloc.get(ptr)
        if i is not None and i not in freed_after:
            excluded.add(i)
            notes.append(f"{name} grad {allocs[i][3]} B")
        else:
            notes.append(f"{name} grad not allocated in the step")
    if accumulator_bytes:
        # made by torch.zeros (the size alone is ambiguous: N x V x 2 == V x H x 4 when N = 2H)
        for i, (_, _, _, size, ops) in enumerate(allocs):
            if size == accumulator_bytes and i not in excluded and "aten::zeros" in ops:
                excluded.add(i)
                notes.append(f"float32 accumulator {size} B (in {' < '.join(ops)})")
                break
        else:
            notes.append("no float32 accumulator found")
    current = current_ex = peak = raw = 0
    live_excluded = {}
    excluded_bytes = 0
    for i, (_, _, ptr, size, _) in enumerate(allocs):
        current += size
        if size > 0 and i in excluded:
            live_excluded[ptr] = size
            current_ex += size
            excluded_bytes += size
        elif size < 0 and ptr in live_excluded:
            current_ex -= live_excluded.pop(ptr)
        raw = max(raw, current)
        peak = max(peak, current - current_ex)
    return peak, raw, excluded_bytes, notes


# --------------------------------------------------------------------------------------------
# float64 reference on the sampled rows' problem
# --------------------------------------------------------------------------------------------


def _reference(loss_kind, z, t, args, rows):
    """float64 loss (reduced as ``args.reduction``; ``none`` -> the sum, as the step's
    backward) and dz64."""
    z = z.detach().double().requires_grad_(True)
    if loss_kind == "topk":
        per_row = base.reference_topk_f64(z, t, args.k, args.temperature)
    else:
        per_row = base.reference_kl_f64(z, t, args.temperature)
    loss = per_row.mean() if args.reduction == "mean" else per_row.sum()
    loss.backward()
    return loss.detach(), z.grad, per_row.detach()


def accuracy(impl, loss_kind, args, inputs, full_chunks):
    import torch
    import torch.nn.functional as F

    dtype = getattr(torch, args.dtype)
    n = min(args.sample_rows, args.tokens)
    sample = sorted({round(i * (args.tokens - 1) / max(n - 1, 1)) for i in range(n)})
    idx = torch.tensor(sample)
    weight = inputs["weight"]
    small = {"hidden": inputs["hidden"].detach()[idx].clone().requires_grad_(True),
             "weight": weight, "labels": inputs["labels"][idx]}
    if loss_kind == "topk":
        small["teacher_logits"] = inputs["teacher_logits"][idx]
    else:
        small["teacher_hidden"] = inputs["teacher_hidden"][idx]
        small["teacher_weight"] = inputs["teacher_weight"]
    chunk_size = max(1, len(sample) // full_chunks) if impl == "liger" else None
    fn = loss_function(impl, loss_kind, args, chunk_size=chunk_size)
    weight.grad = None
    out = fn(small)
    (out.sum() if out.dim() else out).backward()
    got = out.detach().double()
    got = got.sum() if got.dim() else got
    gh, gw = small["hidden"].grad.double(), weight.grad.double()
    weight.grad = None

    with torch.no_grad():
        h64, w64 = small["hidden"].detach().double(), weight.detach().double()
        z_low = F.linear(small["hidden"].detach(), weight.detach()).double()
        z_exact = h64 @ w64.T
        if loss_kind == "topk":
            t_low = t_exact = small["teacher_logits"].double()
        else:
            th, tw = small["teacher_hidden"], small["teacher_weight"]
            t_low = F.linear(th, tw).double()
            t_exact = th.double() @ tw.double().T
    res = {"sample_rows": sample, "loss_sample": got.item()}
    l64, dz64, _ = _reference(loss_kind, z_low, t_low, args, len(sample))
    res["loss_f64"] = l64.item()
    res["loss_rel_err"] = abs(got.item() - l64.item()) / abs(l64.item())
    with torch.no_grad():
        g64 = {"hidden": dz64 @ w64, "weight": dz64.T @ h64}
        for name, g in (("hidden", gh), ("weight", gw)):
            scale = g64[name].abs().max().item()
            res[f"grad_{name}_err"] = (g - g64[name]).abs().max().item() / scale
            res[f"grad_{name}_floor"] = (
                (g64[name].to(dtype).double() - g64[name]).abs().max().item() / scale)
        del g64
    l64e, dz64e, _ = _reference(loss_kind, z_exact, t_exact, args, len(sample))
    res["loss_f64_exact"] = l64e.item()
    res["loss_rel_err_exact"] = abs(got.item() - l64e.item()) / abs(l64e.item())
    with torch.no_grad():
        for name, g, g64e in (("hidden", gh, dz64e @ w64), ("weight", gw, dz64e.T @ h64)):
            scale = g64e.abs().max().item()
            res[f"grad_{name}_err_exact"] = (g - g64e).abs().max().item() / scale
    return res


# --------------------------------------------------------------------------------------------
# Child process: one case, or the small agreement check
# --------------------------------------------------------------------------------------------


def _cap(args):
    import resource

    if args.mem_limit_gib and args.mem_limit_gib > 0:
        cap = base._vm_size_bytes() + int(args.mem_limit_gib * GiB)
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))


def run_child(args) -> dict:
    impl, loss_kind = args.child
    result = {"impl": impl, "loss": loss_kind, "status": "error",
              "mem_limit_gib": args.mem_limit_gib}
    stage = "import torch"
    try:
        import torch

        if args.threads:
            torch.set_num_threads(args.threads)
        result["threads"] = torch.get_num_threads()
        result["torch"] = torch.__version__
        stage = "import implementation"
        if impl == "liger":
            from importlib.metadata import version

            import liger_kernel  # noqa: F401

            result["liger_version"] = version("liger-kernel")
        fn = loss_function(impl, loss_kind, args)
        _cap(args)  # after the imports (triton's and torch.compile's address space)
        stage = "make inputs"
        inputs = make_inputs(args, loss_kind)
        hidden, weight = inputs["hidden"], inputs["weight"]
        logits_bytes = args.tokens * args.vocab * weight.element_size()
        result["logits_bytes"] = logits_bytes
        last = {}

        def step():
            hidden.grad = weight.grad = None
            out = fn(inputs)
            (out.sum() if out.dim() else out).backward()
            last["loss"] = float(out.detach().double().sum() if out.dim() else out.item())

        stage = "forward + backward (warm-up)"
        t0 = time.perf_counter()
        step()
        result["warmup_s"] = time.perf_counter() - t0
        hidden.grad = weight.grad = None

        stage = "forward + backward (memory run)"
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            step()
        allocs = _allocations(prof)
        grad_ptrs = {name: t.grad.untyped_storage().data_ptr()
                     for name, t in (("hidden", hidden), ("weight", weight))
                     if t.grad is not None}
        # only topkd's fused losses accumulate the weight's gradient in float32 (the unfused
        # path's and Liger's are in the weight's dtype)
        acc = weight.numel() * 4 if weight.element_size() < 4 and impl == "fused" else None
        peak, raw, excluded, notes = peak_excluding(allocs, grad_ptrs, acc)
        result.update(peak_bytes=peak, raw_peak_bytes=raw, excluded_bytes=excluded,
                      excluded=notes, x_logits=peak / logits_bytes,
                      kineto_raw_peak_bytes=_kineto_peak(prof),
                      grad_bytes=sum(t.grad.numel() * t.grad.element_size()
                                     for t in (hidden, weight) if t.grad is not None))
        del prof, allocs
        hidden.grad = weight.grad = None

        stage = "forward + backward (timing)"
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        result["times_s"] = times
        result["median_s"] = statistics.median(times)
        result["loss_value"] = last["loss"]
        hidden.grad = weight.grad = None

        stage = "float64 reference"
        full_chunks = max(1, args.tokens // args.liger_chunk_size)
        result.update(accuracy(impl, loss_kind, args, inputs, full_chunks))
        result["status"] = "ok"
    except (RuntimeError, MemoryError, ImportError, AttributeError, ValueError, TypeError,
            AssertionError) as exc:
        if base._is_oom(exc):
            result["status"] = "oom"
        elif stage == "import implementation":
            result["status"] = "unavailable"
        result["message"] = f"{stage}: {type(exc).__name__}: {str(exc).strip()[:400]}"
    except Exception as exc:  # noqa: BLE001  (e.g. torch._dynamo / inductor errors)
        result["status"] = "unavailable" if impl == "liger" else "error"
        result["message"] = f"{stage}: {type(exc).__name__}: {str(exc).strip()[:400]}"
    try:
        import resource

        result["maxrss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    except Exception:  # noqa: BLE001
        pass
    return result


def run_verify(args) -> dict:
    """The three kl implementations (and Liger beta=1 vs topkd reverse) on a small problem."""
    out = {"shape": "N=64, H=128, H_t=96, V=1000, Liger chunk_size=16 (4 chunks)",
           "status": "error"}
    try:
        from importlib.metadata import version

        import torch
        import torch.nn.functional as F
        from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss

        import topkd

        out["liger_version"] = version("liger-kernel")
        g = torch.Generator().manual_seed(1)
        n, h, ht, v = 64, 128, 96, 1000
        labels = torch.zeros(n, dtype=torch.long)
        for dt in ("float32", "bfloat16"):
            dtype = getattr(torch, dt)
            hid = torch.randn(n, h, generator=g).to(dtype).requires_grad_(True)
            w = (torch.randn(v, h, generator=g) * 2 / h ** 0.5).to(dtype).requires_grad_(True)
            th = torch.randn(n, ht, generator=g).to(dtype)
            tw = (torch.randn(v, ht, generator=g) * 2 / ht ** 0.5).to(dtype)
            for temperature in (1.0, 2.0):
                res = {}
                for beta in (0.0, 1.0):
                    m = LigerFusedLinearJSDLoss(weight_hard_loss=0.0, weight_soft_loss=1.0,
                                                beta=beta, temperature=temperature,
                                                compiled=args.liger_compiled, chunk_size=16)
                    hid.grad = w.grad = None
                    loss = m(hid, w, th, tw, labels)
                    loss.backward()
                    res[f"liger_beta{beta:g}"] = (loss.item(), hid.grad.double(),
                                                  w.grad.double())
                for reverse in (False, True):
                    hid.grad = w.grad = None
                    loss = topkd.fused_kl_loss(hid, w, (th, tw), temperature=temperature,
                                               reverse=reverse, reduction="mean")
                    loss.backward()
                    res[f"fused_rev{int(reverse)}"] = (loss.item(), hid.grad.double(),
                                                       w.grad.double())
                    hid.grad = w.grad = None
                    loss = topkd.kl_loss(F.linear(hid, w), F.linear(th, tw),
                                         temperature=temperature, reverse=reverse,
                                         reduction="mean")
                    loss.backward()
                    res[f"unfused_rev{int(reverse)}"] = (loss.item(), hid.grad.double(),
                                                         w.grad.double())
                with torch.no_grad():
                    z = F.linear(hid, w).double() / temperature
                    t = F.linear(th, tw).double() / temperature
                    lp, lq = torch.log_softmax(z, -1), torch.log_softmax(t, -1)
                    fwd64 = (lq.exp() * (lq - lp)).sum(-1).mean().item()
                    rev64 = (lp.exp() * (lp - lq)).sum(-1).mean().item()

                def rel(a, b):
                    return abs(a[0] - b[0]) / abs(b[0])

                def gerr(a, b, i):
                    return ((a[i] - b[i]).abs().max() / b[i].abs().max()).item()

                f, u, lg = res["fused_rev0"], res["unfused_rev0"], res["liger_beta0"]
                out[f"{dt} T={temperature:g}"] = {
                    "loss fused / unfused / Liger beta=0 / float64 forward KL":
                        [f[0], u[0], lg[0], fwd64],
                    "rel diff fused vs unfused": rel(f, u),
                    "rel diff Liger beta=0 vs fused": rel(lg, f),
                    "rel diff Liger beta=0 vs float64 forward KL": abs(lg[0] - fwd64) / fwd64,
                    "rel diff Liger beta=0 vs float64 reverse KL": abs(lg[0] - rev64) / rev64,
                    "grad diff Liger vs fused (hidden, weight)": [gerr(lg, f, 1),
                                                                  gerr(lg, f, 2)],
                    "rel diff Liger beta=1 vs topkd reverse=True":
                        rel(res["liger_beta1"], res["fused_rev1"]),
                }
        out["status"] = "ok"
    except Exception as exc:  # noqa: BLE001
        out["message"] = f"{type(exc).__name__}: {str(exc).strip()[:400]}"
    return out


# --------------------------------------------------------------------------------------------
# Parent
# --------------------------------------------------------------------------------------------


def _child_command(args, extra, out_path, limit):
    cmd = [sys.executable, "-m", "topkd.bench", "fused", *extra, "--child-out", out_path,
           "--tokens", str(args.tokens), "--hidden", str(args.hidden),
           "--vocab", str(args.vocab), "--teacher-hidden", str(args.teacher_hidden),
           "--k", str(args.k), "--dtype", args.dtype, "--temperature", repr(args.temperature),
           "--reduction", args.reduction, "--repeats", str(args.repeats),
           "--sample-rows", str(args.sample_rows), "--seed", str(args.seed),
           "--threads", str(args.threads), "--mem-limit-gib", repr(limit),
           "--liger-chunk-size", str(args.liger_chunk_size)]
    if not args.liger_compiled:
        cmd.append("--liger-no-compile")
    if args.chunk_bytes is not None:
        cmd += ["--chunk-bytes", str(args.chunk_bytes)]
    return cmd


def _run_child(args, extra, base_result):
    limit = args.mem_limit_gib
    available = base._mem_available_bytes()
    if limit and available is not None:
        limit = min(limit, max(0.5, math.floor((available - GiB) / GiB * 10) / 10))
    base_result["mem_limit_gib"] = limit
    with tempfile.TemporaryDirectory(prefix="topkd-bench-fused-") as tmp:
        out_path = os.path.join(tmp, "result.json")
        err_path = os.path.join(tmp, "stderr.txt")
        try:
            with open(err_path, "w") as err:
                proc = subprocess.run(_child_command(args, extra, out_path, limit),
                                      stdout=err, stderr=err, timeout=args.timeout or None)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            base_result.update(status="timeout", message=f"no result after {args.timeout} s")
            return base_result
        if os.path.exists(out_path):
            with open(out_path) as f:
                base_result.update(json.load(f))
            return base_result
        tail = ""
        if os.path.exists(err_path):
            with open(err_path, errors="replace") as f:
                tail = f.read()[-1500:]
        base_result.update(status="oom" if rc == -9 else "crashed",
                           message=f"child exited {rc}: {tail.strip()[-600:]}")
        return base_result


def _ok(r):
    return r is not None and r.get("status") == "ok"


def _find(results, impl, loss):
    for r in results:
        if r["impl"] == impl and r["loss"] == loss:
            return r
    return None


def _status_text(r):
    if r["status"] == "unavailable":
        return "not available: " + r.get("message", "")[:160]
    if r["status"] == "oom":
        return f"out of memory at {r.get('mem_limit_gib', 0):g} GiB"
    return f"{r['status']}: " + r.get("message", "")[:160]


def format_table(results, meta) -> str:
    f = base._fmt_err
    lines = [
        f"Fused LM head: N = {meta['tokens']:,} tokens, H = {meta['hidden']:,}, "
        f"V = {meta['vocab']:,}, H_t = {meta['teacher_hidden']:,}, K = {meta['k']:,}, "
        f"{meta['dtype']} hidden and weight, T = {meta['temperature']:g}, "
        f"reduction = {meta['reduction']!r}, device cpu, torch {meta['torch']}, "
        f"{meta['threads']} threads, chunk_bytes = {meta['chunk_bytes']}, "
        f"repeats = {meta['repeats']}, memory cap {meta['mem_limit_gib']:g} GiB per case"
        + (f", Liger-Kernel {meta['liger_version']} (chunk_size {meta['liger_chunk_size']}, "
           f"compiled={meta['liger_compiled']})" if meta.get("liger_version") else ""),
    ]
    if meta.get("loadavg_start") and meta.get("loadavg_end"):
        lines += ["", f"{meta['cpus']} CPUs; load average (1 min) {meta['loadavg_start'][0]:.2f} "
                      f"at the start, {meta['loadavg_end'][0]:.2f} at the end; total "
                      f"{meta['total_s']:.0f} s. Student logits would take "
                      f"{meta['logits_bytes'] / MiB:,.0f} MiB."]
    lines += ["",
              "| impl | loss | teacher | peak above inputs excl. grads (MiB) | x logits "
              "| raw peak (MiB) | excluded (MiB) | fwd+bwd s (median [min-max]) "
              "| loss rel err | loss rel err, exact products | hidden grad err (floor) "
              "| weight grad err (floor) |",
              "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        label = IMPL_LABELS[r["impl"]]
        what = LOSS_LABELS[(r["impl"], r["loss"])]
        teacher = TEACHER_LABELS[r["loss"]]
        if r["status"] != "ok":
            lines.append(f"| {label} | {what} | {teacher} | {_status_text(r)} "
                         "| - | - | - | - | - | - | - | - |")
            continue
        lines.append(
            f"| {label} | {what} | {teacher} | {r['peak_bytes'] / MiB:,.0f} "
            f"| {r['x_logits']:.3f} | {r['raw_peak_bytes'] / MiB:,.0f} "
            f"| {r['excluded_bytes'] / MiB:,.0f} | {r['median_s']:.2f}{base._spread(r)} "
            f"| {f(r.get('loss_rel_err'))} | {f(r.get('loss_rel_err_exact'))} "
            f"| {f(r.get('grad_hidden_err'))} ({f(r.get('grad_hidden_floor'))}) "
            f"| {f(r.get('grad_weight_err'))} ({f(r.get('grad_weight_floor'))}) |")
    lines += [
        "",
        "peak above inputs excl. grads = max over time of (bytes allocated during one forward + "
        "backward - the bytes of the returned hidden/weight gradients and, topkd fused only, of "
        "its float32 accumulator of the weight's shape while they are alive; the others "
        "accumulate in the weight's dtype), from the profiler's "
        "allocations matched by address; raw peak counts everything; excluded = the bytes not "
        "counted. x logits = peak / (N x V x element size). Errors on "
        f"{meta['sample_rows']} sampled rows (the implementation run on those rows' problem) "
        "vs float64 on the logits as computed in the input dtype (upcast exactly); "
        "'exact products' = vs float64 of h64 @ W64.T (the logits' own rounding included). "
        "grad err = max |g - g64| / max |g64| of the chain rule dz64 @ W64, dz64.T @ h64; "
        "in brackets the floor (g64 rounded to the input dtype).",
    ]
    pairs = []
    for loss in LOSSES:
        fu, un = _find(results, "fused", loss), _find(results, "unfused", loss)
        if fu is not None and un is not None:
            pairs.append((f"{LOSS_LABELS[('fused', loss)]} / unfused", fu, un))
    fu, lg = _find(results, "fused", "kl"), _find(results, "liger", "kl")
    if fu is not None and lg is not None:
        pairs.append(("fused_kl_loss / Liger beta=0", fu, lg))
    if pairs:
        lines += ["", "| ratio | memory (peak excl. grads) | memory (raw peak) | time (fwd+bwd) "
                      "| hidden grad err | weight grad err |", "|---|---:|---:|---:|---:|---:|"]
        for name, a, b in pairs:
            if _ok(a) and _ok(b):
                lines.append(
                    f"| {name} | {a['peak_bytes'] / b['peak_bytes']:.3f} "
                    f"| {a['raw_peak_bytes'] / b['raw_peak_bytes']:.3f} "
                    f"| {a['median_s'] / b['median_s']:.2f} "
                    f"| {a['grad_hidden_err'] / b['grad_hidden_err']:.3g} "
                    f"| {a['grad_weight_err'] / b['grad_weight_err']:.3g} |")
            else:
                bad = a if not _ok(a) else b
                lines.append(f"| {name} | {IMPL_LABELS[bad['impl']]}: {bad['status']} | - | - "
                             "| - | - |")
    full = [r for r in results if _ok(r)]
    if full:
        lines += ["", "Full-run loss values: " + "; ".join(
            f"{IMPL_LABELS[r['impl']]} {r['loss']} {r['loss_value']:.7g}" for r in full)]
    notes = [r for r in results if r["status"] != "ok" and r.get("message")]
    if notes:
        lines.append("")
        for r in notes:
            lines.append(f"- {IMPL_LABELS[r['impl']]} {r['loss']}: {r['message'][:600]}")
    v = meta.get("verify")
    if v:
        lines += ["", f"Agreement check ({v.get('shape')}): "
                      + ("ok" if v.get("status") == "ok" else v.get("message", "failed"))]
        for key, val in v.items():
            if isinstance(val, dict):
                lines.append(f"- {key}: " + "; ".join(
                    f"{k2} {_fmt_val(x)}" for k2, x in val.items()))
    return "\n".join(lines)


def _fmt_val(x):
    if isinstance(x, list):
        return "[" + ", ".join(_fmt_val(y) for y in x) + "]"
    if isinstance(x, float):
        return f"{x:.3g}" if abs(x) < 1e-2 else f"{x:.7g}"
    return str(x)


def build_parser():
    p = argparse.ArgumentParser(
        prog="topkd-bench fused",
        description="Fused LM-head section: topkd's fused losses vs the unfused path (F.linear "
                    "then the logits loss) and Liger-Kernel's LigerFusedLinearJSDLoss(beta=0): "
                    "peak memory above the inputs excluding the returned gradients, forward + "
                    "backward time, error vs float64. Every case runs in its own capped "
                    "process.")
    p.add_argument("--tokens", type=int, default=2048, help="rows N (2048)")
    p.add_argument("--hidden", type=int, default=1024, help="student hidden width H (1024)")
    p.add_argument("--vocab", type=int, default=151_936, help="vocabulary V (151936)")
    p.add_argument("--teacher-hidden", type=int, default=1024,
                   help="teacher hidden width H_t of the kl cases (1024)")
    p.add_argument("--k", type=int, default=4096, help="Top-K (4096)")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16",
                   help="hidden states and weights dtype (bfloat16)")
    p.add_argument("--temperature", type=float, default=1.0, help="temperature T (1.0)")
    p.add_argument("--reduction", choices=("mean", "sum", "none"), default="mean",
                   help="reduction (mean; 'none' runs loss.sum().backward(), Liger n/a)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs after a warm-up (3)")
    p.add_argument("--impl", nargs="+", choices=IMPLS, default=list(IMPLS),
                   help="implementations (default: fused unfused liger)")
    p.add_argument("--loss", nargs="+", choices=LOSSES, default=list(LOSSES),
                   help="topk (fused_topk_kl_loss) and/or kl (fused_kl_loss) (default both)")
    p.add_argument("--chunk-bytes", type=base._int_bytes, default=None,
                   help="chunk_bytes passed to topkd (default: the library's)")
    p.add_argument("--liger-chunk-size", type=int, default=1024,
                   help="LigerFusedLinearJSDLoss chunk_size (its default 1024)")
    p.add_argument("--liger-no-compile", dest="liger_compiled", action="store_false",
                   help="Liger with compiled=False (default: its default compiled=True)")
    p.add_argument("--mem-limit-gib", type=float, default=20.0,
                   help="address-space cap per case above the size after the imports; lowered "
                        "to MemAvailable - 1 GiB if less; 0 = none (20)")
    p.add_argument("--sample-rows", type=int, default=8, help="rows for the float64 check (8)")
    p.add_argument("--seed", type=int, default=0, help="torch.manual_seed for the inputs (0)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per case (1800)")
    p.add_argument("--no-verify", dest="verify", action="store_false",
                   help="skip the small agreement check of the three kl implementations")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--save", metavar="FILE", help="also write the JSON results to FILE")
    p.add_argument("--load", metavar="FILE", help="print the table of saved results; runs nothing")
    p.add_argument("--child", nargs=2, metavar=("IMPL", "LOSS"), help=argparse.SUPPRESS)
    p.add_argument("--child-verify", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    child = run_verify if args.child_verify else run_child if args.child else None
    if base.child_or_load(args, child, lambda saved: format_table(saved["results"], saved["meta"])):
        return 0

    cases = [(i, lo) for i, lo in CASES if i in args.impl and lo in args.loss]
    results = []
    t_start = time.perf_counter()
    load_start = base._loadavg()
    for n, (impl, loss) in enumerate(cases, 1):
        print(f"[{n}/{len(cases)}] {IMPL_LABELS[impl]} {LOSS_LABELS[(impl, loss)]} ...",
              file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        r = _run_child(args, ["--child", impl, loss], {"impl": impl, "loss": loss})
        if r["status"] == "ok":
            summary = (f"peak {r['peak_bytes'] / MiB:,.0f} MiB excl. grads "
                       f"({r['x_logits']:.3f}x logits), raw {r['raw_peak_bytes'] / MiB:,.0f} "
                       f"MiB, {r['median_s']:.2f} s, loss err {base._fmt_err(r['loss_rel_err'])}")
        else:
            summary = _status_text(r)
        print(f"[{n}/{len(cases)}]   {summary} ({time.perf_counter() - t0:.0f} s)",
              file=sys.stderr, flush=True)
        results.append(r)
    verify = None
    if args.verify and "liger" in args.impl:
        print("agreement check (small shape) ...", file=sys.stderr, flush=True)
        verify = _run_child(args, ["--child-verify"], {})

    import torch

    threads = next((r["threads"] for r in results if r.get("threads")),
                   args.threads or torch.get_num_threads())
    liger_version = next((r["liger_version"] for r in results if r.get("liger_version")),
                         (verify or {}).get("liger_version"))
    meta = {
        "tokens": args.tokens, "hidden": args.hidden, "vocab": args.vocab,
        "teacher_hidden": args.teacher_hidden, "k": args.k, "dtype": args.dtype,
        "temperature": args.temperature, "reduction": args.reduction, "torch": torch.__version__,
        "threads": threads, "repeats": args.repeats, "mem_limit_gib": args.mem_limit_gib,
        "chunk_bytes": args.chunk_bytes if args.chunk_bytes is not None else "default",
        "sample_rows": args.sample_rows, "liger_version": liger_version,
        "liger_chunk_size": args.liger_chunk_size, "liger_compiled": args.liger_compiled,
        "logits_bytes": args.tokens * args.vocab * base.DTYPE_BYTES[args.dtype],
        "python": platform.python_version(), "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "command": "python -m topkd.bench fused " + " ".join(
            sys.argv[2:] if argv is None else argv),
        "total_s": time.perf_counter() - t_start, "loadavg_start": load_start,
        "loadavg_end": base._loadavg(), "verify": verify,
    }
    if args.save:
        with open(args.save, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=2)
    print(json.dumps({"meta": meta, "results": results}, indent=2) if args.json
          else format_table(results, meta))
    return 0 if all(r["status"] in ("ok", "unavailable") for r in results) else 1
