"""Benchmark, fused LM-head section: ``python -m benchmarks fused`` (or ``--fused``).

The student's logits are ``F.linear(hidden, weight)``; the fused losses take ``hidden`` and
``weight`` and never hold those logits whole. Cases, each in its own fresh, memory-capped
process (:mod:`benchmarks.harness`):

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
* ``jsd``: the generalized JSD at ``beta = 0.5`` (mixture ``M = beta q + (1 - beta) p``,
  ``beta KL(q || M) + (1 - beta) KL(p || M)``), the same teacher ``(hidden, weight)``:
  ``fused`` is ``topkd.fused_kl_loss(..., divergence=topkd.JSD(beta=0.5))``, ``unfused``
  ``topkd.kl_loss`` on both ``F.linear`` logits with that divergence, ``liger``
  ``LigerFusedLinearJSDLoss(beta=0.5)`` as above, and ``trl`` TRL's
  ``trl.trainer.distillation_trainer._chunked_divergence_loss(hidden[None],
  teacher_hidden[None], weight, teacher_weight, mask, beta=0.5, temperature=T)`` (its
  ``ChunkedDivergenceFunction``: Triton on GPU, a plain-PyTorch fallback on CPU; the mean over
  the rows of the mask, all of them here). Imported only in its own case (``trl``).

Per case:

* **peak above inputs excl. grads**: one forward + backward under ``torch.profiler`` with
  ``profile_memory=True``; the allocations (with their addresses) walked in time order. The
  gradients returned to ``hidden`` and ``weight`` (identified by the address of ``.grad``
  after the step: the allocation at that address still alive at the end) and, for topkd's
  fused losses with a bf16/fp16 weight and for TRL, their float32 accumulator of the weight's
  shape (the first allocation of exactly its bytes made inside ``aten::zeros``; the unfused
  path and Liger accumulate in the weight's dtype and have none) are not counted while alive:
  the peak is ``max_t (allocated(t) - excluded alive(t))``. The raw peak (everything, as in
  the core section) and the excluded bytes are reported too.
* **x logits**: that peak over the bytes the student logits would take (``N x V x`` the
  element size).
* **fwd+bwd s**: median of ``--repeats`` runs after one warm-up (the warm-up also runs before
  the memory run, so Liger's ``torch.compile`` is not in it).
* **errors**: the implementation is run again on the problem of ``--sample-rows`` rows alone
  (their hidden states and teacher, the whole weight; Liger with its chunk size scaled so that
  it accumulates over as many chunks as in the full run) and compared with float64 (the
  test suite's reference, ``tests/reference.py``): the student logits ``F.linear(hidden,
  weight)`` as every implementation computes them, in the input dtype, upcast exactly (the
  teacher's likewise), the loss in float64, ``dz64`` its gradient, and the chain rule ``dz64
  @ W64`` and ``dz64.T @ h64``. loss rel err = ``|L - L64| / |L64|``; grad err = ``max |g -
  g64| / max |g64|``, in brackets the floor (``g64`` rounded to the input dtype). The loss
  error against float64 of the *exact* products (``h64 @ W64.T``, no rounding of the logits)
  is given too: it is dominated by the rounding of the logits to the input dtype, which every
  implementation shares.

A small agreement check (``--no-verify`` skips it) runs the three ``kl`` implementations on a
small problem in float32 and bf16 and prints their relative differences, Liger's ``beta=1``
against topkd's ``reverse=True``, and the ``jsd`` implementations against each other.

``--device cuda``: the inputs are made on the GPU (the same values as on the CPU: drawn there,
then moved), every timed call is between two ``torch.cuda.synchronize()``, and the raw peak
is ``torch.cuda.max_memory_allocated`` above the allocation before the step
(:func:`benchmarks.harness.profile_peak`); the peak excluding the gradients comes from the
same step's profiler allocations, those of the CUDA allocator alone, and the address-space cap
is not applied (the CUDA driver reserves address space of its own). The float64 reference runs
on the CPU (the sampled rows' logits and their gradient move there and back). TRL's kernels
are its Triton ones there, Liger's its chunks under ``torch.compile`` as on the CPU.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

import reference  # the float64 reference, tests/reference.py (benchmarks/__init__.py)

from . import harness
from .harness import MiB

IMPLS = ("fused", "unfused", "liger", "trl")
LOSSES = ("topk", "kl", "jsd")
CASES = (("fused", "topk"), ("unfused", "topk"), ("fused", "kl"), ("unfused", "kl"),
         ("liger", "kl"), ("fused", "jsd"), ("unfused", "jsd"), ("liger", "jsd"),
         ("trl", "jsd"))
IMPL_LABELS = {"fused": "topkd fused", "unfused": "topkd unfused", "liger": "Liger",
               "trl": "TRL"}
BETA = harness.JSD_BETA
LOSS_LABELS = {
    ("fused", "topk"): "fused_topk_kl_loss",
    ("unfused", "topk"): "F.linear + topk_kl_loss",
    ("fused", "kl"): "fused_kl_loss",
    ("unfused", "kl"): "F.linear x2 + kl_loss",
    ("liger", "kl"): "LigerFusedLinearJSDLoss(beta=0)",
    ("fused", "jsd"): f"fused_kl_loss(divergence=JSD({BETA:g}))",
    ("unfused", "jsd"): f"F.linear x2 + kl_loss(divergence=JSD({BETA:g}))",
    ("liger", "jsd"): f"LigerFusedLinearJSDLoss(beta={BETA:g})",
    ("trl", "jsd"): f"TRL _chunked_divergence_loss(beta={BETA:g})",
}
# the other side of a ratio "fused / other" in the ratio table
RATIO_LABELS = {"unfused": "unfused", ("liger", "kl"): "Liger beta=0",
                ("liger", "jsd"): f"Liger beta={BETA:g}", ("trl", "jsd"): f"TRL beta={BETA:g}"}
TEACHER_LABELS = {"topk": "logits [N, V]", "kl": "(hidden, weight)", "jsd": "(hidden, weight)"}


# --------------------------------------------------------------------------------------------
# Inputs and the implementations' steps
# --------------------------------------------------------------------------------------------


def make_inputs(args, loss_kind, device="cpu"):
    """hidden ~ N(0, 1) [N, H]; weight ~ N(0, (2/sqrt(H))^2) [V, H] (student logits std ~2).
    Top-K case: teacher logits = 0.8 z + 1.2 N(0, 1) in the input dtype, z the student's logits
    (made in row chunks, never whole in float32). KL and JSD cases: teacher_hidden = hidden
    when H_t == H (else N(0, 1)), teacher_weight = 0.8 weight + 1.2 N(0, 1/H_t) (else N(0,
    (2/sqrt(H_t))^2)): teacher logits std ~2, correlated with the student's."""
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

        options = {"temperature": temperature, "reduction": reduction, "chunk_bytes": chunk_bytes,
                   "impl": getattr(args, "case_kernels", "auto")}
        if loss_kind == "jsd":
            options["divergence"] = topkd.JSD(beta=BETA)
        if (impl, loss_kind) == ("fused", "topk"):
            return lambda d: topkd.fused_topk_kl_loss(
                d["hidden"], d["weight"], d["teacher_logits"], k, **options)
        if (impl, loss_kind) == ("unfused", "topk"):
            return lambda d: topkd.topk_kl_loss(
                F.linear(d["hidden"], d["weight"]), d["teacher_logits"], k, **options)
        if impl == "fused":
            return lambda d: topkd.fused_kl_loss(
                d["hidden"], d["weight"], (d["teacher_hidden"], d["teacher_weight"]), **options)
        return lambda d: topkd.kl_loss(
            F.linear(d["hidden"], d["weight"]), F.linear(d["teacher_hidden"], d["teacher_weight"]),
            **options)
    if impl in ("liger", "trl") and reduction == "none":
        raise ValueError(f"{IMPL_LABELS[impl]} returns a scalar (the mean over rows) only")
    if impl == "liger":
        if loss_kind == "topk":
            raise ValueError("Liger-Kernel has no Top-K loss")
        from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss

        module = LigerFusedLinearJSDLoss(
            weight_hard_loss=0.0, weight_soft_loss=1.0, beta=BETA if loss_kind == "jsd" else 0.0,
            temperature=temperature, compiled=args.liger_compiled,
            chunk_size=chunk_size or args.liger_chunk_size)

        def fn(d):
            out = module(d["hidden"], d["weight"], d["teacher_hidden"], d["teacher_weight"],
                         d["labels"])
            return out * d["hidden"].shape[0] if reduction == "sum" else out

        return fn
    if impl == "trl":
        if loss_kind != "jsd":
            raise ValueError("the TRL case is the generalized JSD only")
        import torch
        from trl.trainer.distillation_trainer import _chunked_divergence_loss

        def fn(d):
            hidden = d["hidden"]
            mask = torch.ones(1, hidden.shape[0], dtype=torch.long, device=hidden.device)
            out = _chunked_divergence_loss(hidden[None], d["teacher_hidden"][None], d["weight"],
                                           d["teacher_weight"], mask, BETA,
                                           temperature=temperature)[0]
            return out * hidden.shape[0] if reduction == "sum" else out

        return fn
    raise ValueError(f"unknown implementation {impl!r}")


# --------------------------------------------------------------------------------------------
# float64 reference on the sampled rows' problem
# --------------------------------------------------------------------------------------------


def _reference(loss_kind, z, t, args):
    """float64 loss (reduced as ``args.reduction``; ``none`` -> the sum, as the step's
    backward) and dz64."""
    reduction = "mean" if args.reduction == "mean" else "sum"
    if loss_kind == "topk":
        return reference.loss_and_grad(reference.topk_loss, z, t, args.k,
                                       temperature=args.temperature, reduction=reduction)
    return reference.loss_and_grad(reference.full_loss, z, t, temperature=args.temperature,
                                   divergence=harness.reference_divergence(loss_kind),
                                   reduction=reduction)


def accuracy(impl, loss_kind, args, inputs, full_chunks):
    import torch
    import torch.nn.functional as F

    dtype = getattr(torch, args.dtype)
    sample = harness.sample_rows(args.tokens, args.sample_rows)
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
    got = (got.sum() if got.dim() else got).item()
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
    res = {"sample_rows": sample, "loss_sample": got}
    # the float64 reference runs on the CPU (no-ops there); the chain rule on the device
    device = weight.device
    l64, dz64 = _reference(loss_kind, z_low.cpu(), t_low.cpu(), args)
    dz64 = dz64.to(device)
    res["loss_f64"] = l64.item()
    res["loss_rel_err"] = harness.rel_err(got, l64.item())
    with torch.no_grad():
        for name, g, g64 in (("hidden", gh, dz64 @ w64), ("weight", gw, dz64.T @ h64)):
            res[f"grad_{name}_err"], res[f"grad_{name}_floor"] = harness.grad_err(g, g64, dtype)
            del g64
    l64e, dz64e = _reference(loss_kind, z_exact.cpu(), t_exact.cpu(), args)
    dz64e = dz64e.to(device)
    res["loss_f64_exact"] = l64e.item()
    res["loss_rel_err_exact"] = harness.rel_err(got, l64e.item())
    with torch.no_grad():
        for name, g, g64e in (("hidden", gh, dz64e @ w64), ("weight", gw, dz64e.T @ h64)):
            res[f"grad_{name}_err_exact"] = harness.grad_err(g, g64e, dtype)[0]
    return res


# --------------------------------------------------------------------------------------------
# Child process: one case, or the small agreement check
# --------------------------------------------------------------------------------------------


def _version(impl):
    """``(result key, version)`` of the third-party implementation ``impl``, imported."""
    from importlib.metadata import version

    if impl == "liger":
        import liger_kernel  # noqa: F401

        return "liger_version", version("liger-kernel")
    import trl  # noqa: F401

    return "trl_version", version("trl")


def run_case(args, impl, loss_kind, kernels="-") -> dict:
    """One case, in the child process: memory, time, and errors against float64."""
    result = {"impl": impl, "loss": loss_kind, "kernels": kernels, "status": "error",
              "mem_limit_gib": args.mem_limit_gib}
    args.case_kernels = kernels
    on_cuda = args.device.startswith("cuda")
    with harness.stages(result) as stage:
        stage("import torch")
        torch = harness.child_torch(args, result)
        stage(harness.IMPORT_STAGE)
        if impl in ("liger", "trl"):
            key, value = _version(impl)
            result[key] = value
        fn = loss_function(impl, loss_kind, args)
        if not on_cuda:  # after the imports (triton's, dynamo's); not on CUDA (its driver's)
            harness.cap_address_space(args.mem_limit_gib)
        stage("make inputs")
        inputs = make_inputs(args, loss_kind, args.device)
        hidden, weight = inputs["hidden"], inputs["weight"]
        logits_bytes = args.tokens * args.vocab * weight.element_size()
        result["logits_bytes"] = logits_bytes
        sync = torch.cuda.synchronize if on_cuda else None
        last = {}

        def step():
            hidden.grad = weight.grad = None
            out = fn(inputs)
            (out.sum() if out.dim() else out).backward()
            last["loss"] = float(out.detach().double().sum() if out.dim() else out.item())

        stage("forward + backward (first call)")
        result["first_call_s"] = harness.first_call(step, sync)
        hidden.grad = weight.grad = None

        stage("forward + backward (memory run)")
        from torch.profiler import ProfilerActivity, profile

        if on_cuda:
            # the raw peak from the CUDA allocator; the exclusions from the same step's
            # profiler allocations on the device
            held = {}

            def profiled():
                with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as p:
                    step()
                held["prof"] = p

            cuda_raw = harness.profile_peak(profiled, args.device)[0]
            prof = held.pop("prof")
        else:
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                step()
        allocs = harness.allocations(prof, "cuda" if on_cuda else None)
        grad_ptrs = {name: t.grad.untyped_storage().data_ptr()
                     for name, t in (("hidden", hidden), ("weight", weight))
                     if t.grad is not None}
        # topkd's fused losses accumulate the weight's gradient in float32 when the weight is
        # narrower, TRL always (the unfused path's and Liger's are in the weight's dtype)
        acc = None
        if (impl == "fused" and weight.element_size() < 4) or impl == "trl":
            acc = weight.numel() * 4
        peak, raw, excluded, notes = harness.peak_excluding(allocs, grad_ptrs, acc)
        if on_cuda:
            result["profiler_raw_peak_bytes"] = raw
            if not allocs:
                peak = cuda_raw
                notes.append("the profiler recorded no CUDA allocation: the peak is the raw one")
            raw = cuda_raw
        else:
            result["kineto_raw_peak_bytes"] = harness.kineto_peak(prof)[0]
        result.update(peak_bytes=peak, raw_peak_bytes=raw, excluded_bytes=excluded,
                      excluded=notes, x_logits=peak / logits_bytes,
                      grad_bytes=sum(t.grad.numel() * t.grad.element_size()
                                     for t in (hidden, weight) if t.grad is not None))
        del prof, allocs
        hidden.grad = weight.grad = None

        stage("forward + backward (timing)")
        result["times_s"] = harness.timed(step, args.repeats, sync)
        result["median_s"] = statistics.median(result["times_s"])
        result["loss_value"] = last["loss"]
        hidden.grad = weight.grad = None

        stage("float64 reference")
        full_chunks = max(1, args.tokens // args.liger_chunk_size)
        result.update(accuracy(impl, loss_kind, args, inputs, full_chunks))
    return result


def _agreement(res, f64):
    """Relative differences of ``{name: (loss, hidden grad, weight grad)}`` to ``res``'s first
    entry, and of each loss to the float64 loss ``f64``."""

    def rel(a, b):
        return abs(a[0] - b[0]) / abs(b[0])

    def gerr(a, b, i):
        return ((a[i] - b[i]).abs().max() / b[i].abs().max()).item()

    (first, ref), *others = res.items()
    out = {f"loss {' / '.join(res)} / float64": [r[0] for r in res.values()] + [f64]}
    for name, r in others:
        out[f"rel diff {name} vs {first}"] = rel(r, ref)
        out[f"grad diff {name} vs {first} (hidden, weight)"] = [gerr(r, ref, 1), gerr(r, ref, 2)]
    out[f"rel diff {' / '.join(res)} vs float64"] = [abs(r[0] - f64) / abs(f64)
                                                      for r in res.values()]
    return out


def run_verify(args) -> dict:
    """The three kl implementations (and Liger beta=1 vs topkd reverse), and the jsd ones, on a
    small problem in float32 and bf16, at T = 1 and 2, on ``--device`` (drawn on the CPU)."""
    out = {"shape": "N=64, H=128, H_t=96, V=1000, Liger chunk_size=16 (4 chunks)",
           "status": "error"}
    try:
        from importlib.metadata import version

        import torch

        out["liger_version"] = version("liger-kernel")
        g = torch.Generator().manual_seed(1)
        n, h, ht, v = 64, 128, 96, 1000
        device = getattr(args, "device", "cpu")
        for dt in ("float32", "bfloat16"):
            dtype = getattr(torch, dt)
            problem = _Problem(
                torch.randn(n, h, generator=g).to(device, dtype).requires_grad_(True),
                (torch.randn(v, h, generator=g) * 2 / h ** 0.5).to(device, dtype)
                .requires_grad_(True),
                torch.randn(n, ht, generator=g).to(device, dtype),
                (torch.randn(v, ht, generator=g) * 2 / ht ** 0.5).to(device, dtype),
                args.liger_compiled)
            for temperature in (1.0, 2.0):
                out[f"{dt} T={temperature:g}"] = problem.kl(temperature)
                out[f"{dt} T={temperature:g} JSD({BETA:g})"] = problem.jsd(temperature)
        out["status"] = "ok"
    except Exception as exc:  # noqa: BLE001
        out["message"] = f"{type(exc).__name__}: {str(exc).strip()[:400]}"
    return out


class _Problem:
    """One small problem of the agreement check; each method compares the implementations."""

    def __init__(self, hidden, weight, teacher_hidden, teacher_weight, liger_compiled):
        self.h, self.w, self.th, self.tw = hidden, weight, teacher_hidden, teacher_weight
        self.liger_compiled = liger_compiled

    def _run(self, fn):
        """``(loss, hidden grad, weight grad)`` in float64 of ``fn()``'s loss."""
        self.h.grad = self.w.grad = None
        loss = fn()
        loss.backward()
        return loss.item(), self.h.grad.double(), self.w.grad.double()

    def _logits(self):
        import torch.nn.functional as F

        return F.linear(self.h, self.w), F.linear(self.th, self.tw)

    def _topkd(self, fused, temperature, **options):
        import topkd

        options.update(temperature=temperature, reduction="mean")
        if fused:
            return self._run(lambda: topkd.fused_kl_loss(self.h, self.w, (self.th, self.tw),
                                                         **options))
        return self._run(lambda: topkd.kl_loss(*self._logits(), **options))

    def _liger(self, beta, temperature):
        import torch
        from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss

        m = LigerFusedLinearJSDLoss(weight_hard_loss=0.0, weight_soft_loss=1.0, beta=beta,
                                    temperature=temperature, compiled=self.liger_compiled,
                                    chunk_size=16)
        labels = torch.zeros(self.h.shape[0], dtype=torch.long, device=self.h.device)
        return self._run(lambda: m(self.h, self.w, self.th, self.tw, labels))

    def _f64(self, temperature, divergence="kl", reverse=False):
        import torch

        with torch.no_grad():
            z, t = (x.cpu() for x in self._logits())  # the reference runs on the CPU
            return reference.full_loss(z, t, temperature=temperature, reverse=reverse,
                                       divergence=harness.reference_divergence(divergence),
                                       reduction="mean").item()

    def kl(self, temperature) -> dict:
        res = {"fused": self._topkd(True, temperature),
               "unfused": self._topkd(False, temperature),
               "Liger beta=0": self._liger(0.0, temperature)}
        checks = _agreement(res, self._f64(temperature))
        rev64 = self._f64(temperature, reverse=True)
        checks["rel diff Liger beta=0 vs float64 reverse KL"] = (
            abs(res["Liger beta=0"][0] - rev64) / rev64)
        reverse, liger_reverse = (self._topkd(True, temperature, reverse=True),
                                  self._liger(1.0, temperature))
        checks["rel diff Liger beta=1 vs topkd reverse=True"] = (
            abs(liger_reverse[0] - reverse[0]) / abs(reverse[0]))
        return checks

    def jsd(self, temperature) -> dict:
        """fused vs unfused vs Liger vs TRL at JSD(beta); a failure (topkd without
        ``divergence=``) is reported in place of the numbers."""
        try:
            import torch

            import topkd

            res = {name: self._topkd(fused, temperature, divergence=topkd.JSD(beta=BETA))
                   for name, fused in (("fused", True), ("unfused", False))}
            res["Liger"] = self._liger(BETA, temperature)
            try:
                from trl.trainer.distillation_trainer import _chunked_divergence_loss
            except ImportError:  # TRL is optional
                _chunked_divergence_loss = None
            if _chunked_divergence_loss is not None:
                mask = torch.ones(1, self.h.shape[0], dtype=torch.long, device=self.h.device)
                res["TRL"] = self._run(lambda: _chunked_divergence_loss(
                    self.h[None], self.th[None], self.w, self.tw, mask, BETA,
                    temperature=temperature)[0])
            return _agreement(res, self._f64(temperature, "jsd"))
        except Exception as exc:  # noqa: BLE001
            return {"failed": f"{type(exc).__name__}: {str(exc).strip()[:300]}"}


# --------------------------------------------------------------------------------------------
# Parent
# --------------------------------------------------------------------------------------------


def _run_case(args, impl, loss, kernels) -> dict:
    limit = harness.memory_limit(args.mem_limit_gib) if args.device == "cpu" else \
        args.mem_limit_gib
    result = {"impl": impl, "loss": loss, "kernels": kernels, "mem_limit_gib": limit}
    result.update(harness.run_child("benchmarks.fused:run_case",
                                    {**vars(args), "mem_limit_gib": limit}, impl, loss,
                                    kernels, timeout=args.timeout))
    return result


def _ok(r):
    return r is not None and r.get("status") == "ok"


def _find(results, impl, loss, kernels="-"):
    for r in results:
        if r["impl"] == impl and r["loss"] == loss and r.get("kernels", "-") in (kernels, "-"):
            return r
    return None


def _fmt_time(r) -> str:
    """Seconds with their spread, or milliseconds below 0.1 s (the small shapes)."""
    times = r.get("times_s") or []
    if r["median_s"] >= 0.1:
        return f"{r['median_s']:.2f}{harness.spread(times)}"
    ms = [1e3 * t for t in times]
    return f"{1e3 * r['median_s']:.1f} ms" + (f" [{min(ms):.1f}-{max(ms):.1f}]" if ms else "")


def _label(r) -> str:
    kernels = r.get("kernels", "-")
    return IMPL_LABELS[r["impl"]] + ("" if kernels == "-" else f" ({kernels})")


def _device_text(meta) -> str:
    device = meta.get("device", "cpu")  # results saved before --device were on the CPU
    return f"{device} ({meta['device_name']})" if meta.get("device_name") else device


def format_table(results, meta) -> str:
    f = harness.fmt_err
    has_trl = any(r["impl"] == "trl" for r in results)
    lines = [
        f"Fused LM head: N = {meta['tokens']:,} tokens, H = {meta['hidden']:,}, "
        f"V = {meta['vocab']:,}, H_t = {meta['teacher_hidden']:,}, K = {meta['k']:,}, "
        f"{meta['dtype']} hidden and weight, T = {meta['temperature']:g}, "
        f"reduction = {meta['reduction']!r}, device {_device_text(meta)}, "
        f"torch {meta['torch']}, {meta['threads']} threads, chunk_bytes = {meta['chunk_bytes']}, "
        f"repeats = {meta['repeats']}"
        + (f", memory cap {meta['mem_limit_gib']:g} GiB per case"
           if meta.get("device", "cpu") == "cpu" else "")
        + (f", Liger-Kernel {meta['liger_version']} (chunk_size {meta['liger_chunk_size']}, "
           f"compiled={meta['liger_compiled']})" if meta.get("liger_version") else "")
        + (f", TRL {meta['trl_version']}" if meta.get("trl_version") else ""),
    ]
    load = harness.load_line(meta)
    if load:
        lines += ["", f"{load} Student logits would take {meta['logits_bytes'] / MiB:,.0f} MiB."]
    lines += ["",
              "| impl | kernels | loss | teacher | peak above inputs excl. grads (MiB) "
              "| x logits | raw peak (MiB) | excluded (MiB) | fwd+bwd s (median [min-max]) "
              "| first call s | loss rel err | loss rel err, exact products "
              "| hidden grad err (floor) | weight grad err (floor) |",
              "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        label = IMPL_LABELS[r["impl"]]
        kernels = r.get("kernels", "-")
        what = LOSS_LABELS[(r["impl"], r["loss"])]
        teacher = TEACHER_LABELS[r["loss"]]
        if r["status"] != "ok":
            lines.append(f"| {label} | {kernels} | {what} | {teacher} | "
                         f"{harness.status_text(r)} | - | - | - | - | - | - | - | - | - |")
            continue
        first = r.get("first_call_s", r.get("warmup_s"))
        lines.append(
            f"| {label} | {kernels} | {what} | {teacher} | {r['peak_bytes'] / MiB:,.0f} "
            f"| {r['x_logits']:.3f} | {r['raw_peak_bytes'] / MiB:,.0f} "
            f"| {r['excluded_bytes'] / MiB:,.0f} | {_fmt_time(r)} "
            f"| {'-' if first is None else f'{first:.2f}'} "
            f"| {f(r.get('loss_rel_err'))} | {f(r.get('loss_rel_err_exact'))} "
            f"| {f(r.get('grad_hidden_err'))} ({f(r.get('grad_hidden_floor'))}) "
            f"| {f(r.get('grad_weight_err'))} ({f(r.get('grad_weight_floor'))}) |")
    lines += [
        "",
        "peak above inputs excl. grads = max over time of (bytes allocated during one forward + "
        "backward - the bytes of the returned hidden/weight gradients and, topkd fused "
        + ("and TRL" if has_trl else "only")
        + ", of its float32 accumulator of the weight's shape while they are alive; the others "
        "accumulate in the weight's dtype), from the profiler's "
        + ("CUDA " if meta.get("device", "cpu") != "cpu" else "")
        + "allocations matched by address; raw peak counts everything"
        + (" (torch.cuda.max_memory_allocated above the allocation before the step)"
           if meta.get("device", "cpu") != "cpu" else "")
        + "; excluded = the bytes not counted. x logits = peak / (N x V x element size). Errors on "
        f"{meta['sample_rows']} sampled rows (the implementation run on those rows' problem) "
        "vs float64 on the logits as computed in the input dtype (upcast exactly); "
        "'exact products' = vs float64 of h64 @ W64.T (the logits' own rounding included). "
        "grad err = max |g - g64| / max |g64| of the chain rule dz64 @ W64, dz64.T @ h64; "
        "in brackets the floor (g64 rounded to the input dtype).",
    ]
    pairs = []
    for loss in LOSSES:
        for fu in (r for r in results if r["impl"] == "fused" and r["loss"] == loss):
            kernels = fu.get("kernels", "-")
            tag = "" if kernels == "-" else f" ({kernels})"
            for other in ("unfused", "liger", "trl"):
                o = _find(results, other, loss, kernels)
                if o is not None:
                    name = RATIO_LABELS["unfused" if other == "unfused" else (other, loss)]
                    pairs.append((f"{LOSS_LABELS[('fused', loss)]}{tag} / {name}"
                                  f"{tag if other == 'unfused' else ''}", fu, o))
            eager = _find(results, "fused", loss, "eager")
            if kernels not in ("eager", "-") and eager is not None and eager is not fu:
                pairs.append((f"{LOSS_LABELS[('fused', loss)]}{tag} / (eager)", fu, eager))
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
                lines.append(f"| {name} | {_label(bad)}: {bad['status']} | - | - "
                             "| - | - |")
    full = [r for r in results if _ok(r)]
    if full:
        lines += ["", "Full-run loss values: " + "; ".join(
            f"{_label(r)} {r['loss']} {r['loss_value']:.7g}" for r in full)]
    notes = [r for r in results if r["status"] != "ok" and r.get("message")]
    if notes:
        lines.append("")
        for r in notes:
            lines.append(f"- {_label(r)} {r['loss']}: {r['message'][:600]}")
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
        prog="python -m benchmarks fused",
        description="Fused LM-head section: topkd's fused losses vs the unfused path (F.linear "
                    "then the logits loss), Liger-Kernel's LigerFusedLinearJSDLoss (beta=0: "
                    f"forward KL; beta={BETA:g}: JSD) and TRL's chunked JSD: peak memory above "
                    "the inputs excluding the returned gradients, forward + backward time, error "
                    "vs float64. Every case runs in its own capped process.")
    p.add_argument("--tokens", type=int, default=2048, help="rows N (2048)")
    p.add_argument("--hidden", type=int, default=1024, help="student hidden width H (1024)")
    p.add_argument("--vocab", type=int, default=151_936, help="vocabulary V (151936)")
    p.add_argument("--teacher-hidden", type=int, default=1024,
                   help="teacher hidden width H_t of the kl and jsd cases (1024)")
    p.add_argument("--k", type=int, default=4096, help="Top-K (4096)")
    p.add_argument("--dtype", choices=harness.DTYPES, default="bfloat16",
                   help="hidden states and weights dtype (bfloat16)")
    p.add_argument("--temperature", type=float, default=1.0, help="temperature T (1.0)")
    p.add_argument("--reduction", choices=("mean", "sum", "none"), default="mean",
                   help="reduction (mean; 'none' runs loss.sum().backward(), Liger and TRL n/a)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs after a warm-up (3)")
    p.add_argument("--impl", nargs="+", choices=IMPLS, default=list(IMPLS),
                   help="implementations (default: fused unfused liger trl)")
    p.add_argument("--loss", nargs="+", choices=LOSSES, default=list(LOSSES),
                   help="topk (fused_topk_kl_loss), kl (fused_kl_loss) and/or jsd "
                        f"(fused_kl_loss with JSD(beta={BETA:g})) (default all)")
    p.add_argument("--chunk-bytes", type=harness.int_bytes, default=None,
                   help="chunk_bytes passed to topkd (default: the library's)")
    p.add_argument("--liger-chunk-size", type=int, default=1024,
                   help="LigerFusedLinearJSDLoss chunk_size (its default 1024)")
    p.add_argument("--liger-no-compile", dest="liger_compiled", action="store_false",
                   help="Liger with compiled=False (default: its default compiled=True)")
    harness.add_kernel_options(p)
    harness.add_process_options(p)
    p.add_argument("--sample-rows", type=int, default=8, help="rows for the float64 check (8)")
    p.add_argument("--seed", type=int, default=0, help="torch.manual_seed for the inputs (0)")
    p.add_argument("--device", default="cpu",
                   help="cpu (default) or cuda: inputs on the GPU, CUDA-synchronized times, the "
                        "raw peak from torch.cuda.max_memory_allocated")
    p.add_argument("--sharded-ranks", type=int, default=None, metavar="W",
                   help="instead: a head sharded by vocabulary rows (FSDP2's DTensor) over W "
                        "gloo ranks, sharded_head='vocab_parallel' and 'gather' against one "
                        "process with the same per-rank batch (the first --loss, kl or topk; "
                        "the first --kernels; per-rank peak memory and time; "
                        "benchmarks/sharded.py)")
    p.add_argument("--no-verify", dest="verify", action="store_false",
                   help="skip the small agreement check of the kl and jsd implementations")
    harness.add_output_options(p)
    return p


def _show(saved) -> str:
    return format_table(saved["results"], saved["meta"])


def _is_sharded(path) -> bool:
    """Whether a saved run is a ``--sharded-ranks`` one."""
    import json

    with open(path) as f:
        return "ranks" in json.load(f).get("meta", {})


def main(argv) -> int:
    args = build_parser().parse_args(argv)
    if args.sharded_ranks or (args.load and _is_sharded(args.load)):
        from . import sharded

        return sharded.main(args, argv)
    if args.load:
        harness.show_saved(args, _show)
        return 0

    cases = [(i, lo, kernels) for i, lo in CASES if i in args.impl and lo in args.loss
             for kernels in (args.kernels if i in ("fused", "unfused") else ["-"])]
    t_start = time.perf_counter()
    load_start = harness.loadavg()

    def summarize(r):
        return (f"peak {r['peak_bytes'] / MiB:,.0f} MiB excl. grads "
                f"({r['x_logits']:.3f}x logits), raw {r['raw_peak_bytes'] / MiB:,.0f} "
                f"MiB, {r['median_s']:.2f} s, loss err {harness.fmt_err(r['loss_rel_err'])}")

    results = harness.run_cases(
        cases, lambda case: f"{_label({'impl': case[0], 'kernels': case[2]})} "
                            f"{LOSS_LABELS[case[:2]]}",
        lambda case: _run_case(args, *case), summarize)
    verify = None
    if args.verify and "liger" in args.impl:
        print("agreement check (small shape) ...", file=sys.stderr, flush=True)
        verify = harness.run_child("benchmarks.fused:run_verify", vars(args),
                                   timeout=args.timeout)

    import torch

    def first(key):
        return next((r[key] for r in results if r.get(key)), (verify or {}).get(key))

    meta = {
        "tokens": args.tokens, "hidden": args.hidden, "vocab": args.vocab,
        "teacher_hidden": args.teacher_hidden, "k": args.k, "dtype": args.dtype,
        "temperature": args.temperature, "reduction": args.reduction, "torch": torch.__version__,
        "threads": harness.threads_of(results, args.threads), "repeats": args.repeats,
        "mem_limit_gib": args.mem_limit_gib,
        "chunk_bytes": args.chunk_bytes if args.chunk_bytes is not None else "default",
        "sample_rows": args.sample_rows, "liger_version": first("liger_version"),
        "liger_chunk_size": args.liger_chunk_size, "liger_compiled": args.liger_compiled,
        "trl_version": first("trl_version"), "kernels": args.kernels,
        "device": args.device, "device_name": first("device_name"),
        "logits_bytes": args.tokens * args.vocab * harness.DTYPE_BYTES[args.dtype],
        **harness.run_meta("fused", argv, t_start, load_start), "verify": verify,
    }
    harness.emit(args, {"meta": meta, "results": results}, _show)
    return 0 if all(r["status"] in ("ok", "unavailable") for r in results) else 1
