"""Shared test helpers: input generation and the accuracy tolerances."""

from __future__ import annotations

import os
import socket
import time

import torch

TESTS = os.path.dirname(os.path.abspath(__file__))  # this folder: the helpers and workers
ROOT = os.path.dirname(TESTS)  # the repository root

# accuracy against the float64 reference
LOSS_RTOL = 1e-5  # loss vs float64, relative
GRAD_TOL_F32 = 1e-5  # gradient max-abs error / max |reference gradient|, float32 inputs
GRAD_TOL_LOWP = 1e-3  # the same, bf16 / fp16 inputs


def kd_inputs(dtype=torch.float32, seed=0, lead=(3, 5), v=64, hidden=16, teacher_hidden=12):
    """The inputs of a KD loss call, drawn in a fixed order from ``seed`` (in float64, then
    cast to ``dtype``): student logits ``s`` and teacher logits ``t`` ``[*lead, v]``, a student
    LM head (``h`` ``[*lead, hidden]``, ``W``, ``b``), a teacher LM head (``th``, ``tW``,
    ``tb``), an upstream gradient ``go`` ``[*lead]`` (float32), a ``mask`` (about 70% kept)
    and ``labels`` with some rows at ``-100``, kept rows among them."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)

    d = {
        "s": rnd(*lead, v, scale=2.0),
        "t": rnd(*lead, v, scale=2.5),
        "h": rnd(*lead, hidden),
        "W": rnd(v, hidden, scale=2.0 / hidden ** 0.5),  # student logits ~ N(0, 4)
        "b": rnd(v, scale=0.5),
        "th": rnd(*lead, teacher_hidden),
        "tW": rnd(v, teacher_hidden, scale=2.5 / teacher_hidden ** 0.5),
        "tb": rnd(v, scale=0.5),
    }
    d["go"] = torch.randn(lead, generator=g, dtype=torch.float64).float()
    d["mask"] = torch.rand(lead, generator=g) < 0.7
    labels = torch.randint(0, v, lead, generator=g)
    rows = labels.numel()
    # a kept row and a masked one; rows without a label, kept (mask) ones among them
    d["mask"].view(-1)[[i for i in (0, 1) if i < rows]] = torch.tensor([True, False])[:rows]
    labels.view(-1)[[i for i in (2, 8, 10, 1) if i < rows]] = -100
    d["labels"] = labels
    return d


def leaves(*xs, requires=True):
    """Fresh leaf copies of ``xs`` (None stays None)."""
    return [None if x is None else x.detach().clone().requires_grad_(requires) for x in xs]


def backward(loss, grad_output):
    """``loss.backward``: with ``grad_output`` for a per-row loss, without for a scalar."""
    loss.backward(grad_output if loss.dim() else None)


def logits(*shape, scale=2.0, dtype=torch.float32, seed=None):
    g = None
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g, dtype=torch.float64) * scale
    return x.to(dtype)


def misled_rows_(t: torch.Tensor, k: int) -> torch.Tensor:
    """Make rows 1, 3 and 5 of float32 teacher logits ``t`` ``[n >= 6, V]`` ones whose strided
    sample misleads the sampled top-``k`` selection (``topkd.topk.sampled_plan``): a constant
    row (every entry ties the threshold: too many candidates), a row whose sampled columns
    hold its largest values (too few), a row of -inf but for a few entries. In place."""
    from topkd import topk

    v = t.shape[1]
    stride = topk.sampled_plan(v, k + 1)[0]
    t[1] = 0.25
    t[3, ::stride] = 60 - 0.25 * torch.arange(t[3, ::stride].numel(), dtype=t.dtype)
    t[5, :] = float("-inf")
    t[5, 7:v // 2:9] = torch.linspace(-2, 2, len(range(7, v // 2, 9)), dtype=t.dtype)
    return t


def run(fn, student, *args, grad_output=None, **kwargs):
    """Call a topkd loss on a fresh leaf copy of ``student``; return (loss, grad)."""
    s = student.detach().clone().requires_grad_(True)
    loss = fn(s, *args, **kwargs)
    g = torch.ones_like(loss) if grad_output is None else grad_output.to(loss.dtype)
    loss.backward(g)
    return loss.detach(), s.grad


def run_view(fn, student, make_view, *args, grad_output=None, **kwargs):
    """Like run(), but the loss sees ``make_view(leaf)`` (e.g. a non-contiguous view)."""
    s = student.detach().clone().requires_grad_(True)
    loss = fn(make_view(s), *args, **kwargs)
    g = torch.ones_like(loss) if grad_output is None else grad_output.to(loss.dtype)
    loss.backward(g)
    return loss.detach(), s.grad


def assert_loss_close(loss, ref, rtol=LOSS_RTOL, atol=1e-7, what="loss"):
    assert loss.dtype == torch.float32, f"{what} dtype {loss.dtype}, expected float32"
    assert tuple(loss.shape) == tuple(ref.shape), f"{what} shape {loss.shape} vs {ref.shape}"
    if loss.numel() == 0:
        return
    l64 = loss.to(torch.float64)
    assert torch.isfinite(l64).all() or torch.equal(torch.isinf(l64), torch.isinf(ref)), (
        f"{what} not finite: {loss}")
    err = (l64 - ref).abs()
    bound = rtol * ref.abs() + atol
    bad = err > bound
    assert not bad.any(), (
        f"{what}: max rel err {float((err / ref.abs().clamp_min(1e-30)).max()):.3e} "
        f"(rtol {rtol}), worst loss {loss[bad][:5].tolist() if loss.dim() else float(loss)} "
        f"vs ref {ref[bad][:5].tolist() if ref.dim() else float(ref)}")


def grad_err(grad, ref):
    """max |g - g_ref| / max |g_ref| (0 if the reference is all zero and so is g)."""
    scale = float(ref.abs().max()) if ref.numel() else 0.0
    err = float((grad.to(torch.float64) - ref).abs().max()) if ref.numel() else 0.0
    if scale == 0.0:
        return err
    return err / scale


def assert_grad_close(grad, ref, student_dtype, tol=None, what="gradient"):
    assert grad is not None, f"{what} is None"
    assert grad.dtype == student_dtype, f"{what} dtype {grad.dtype}, expected {student_dtype}"
    assert tuple(grad.shape) == tuple(ref.shape), f"{what} shape {grad.shape} vs {ref.shape}"
    assert torch.isfinite(grad).all(), f"{what} has non-finite values"
    if student_dtype == torch.bfloat16 and tol is None:
        assert_bf16_grad_close(grad, ref, what=what)
        return
    if tol is None:
        tol = GRAD_TOL_F32 if student_dtype == torch.float32 else GRAD_TOL_LOWP
    e = grad_err(grad, ref)
    assert e <= tol, f"{what}: max err / max|ref| = {e:.3e} > {tol}"


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """Spacing of bf16 numbers just above |x| (8 significant bits), in float64."""
    a = x.to(torch.float64).abs()
    _, e = torch.frexp(a)
    ulp = torch.ldexp(torch.ones_like(a), (e - 8).to(torch.int64))
    return torch.where(a > 0, ulp, torch.zeros_like(ulp))


def assert_bf16_grad_close(grad, ref, what="gradient"):
    """The tolerance is |g - g_ref| within 1e-3 of max|g_ref| at bf16. Rounding a float64 gradient
    to bf16 alone moves an element near the max by up to half a bf16 ulp = 2^-9 ~ 1.95e-3 of its
    value, so 1e-3 of the max magnitude is impossible for a bf16 gradient tensor. We therefore
    check the part of the bound that is achievable: every element is within one bf16 ulp (at the
    reference value) of the float64 reference rounded to bf16, i.e. the library rounds a float32
    result that is itself accurate, plus 1e-5 of the max magnitude for float32 noise on
    near-zero elements. For comparison we also require the overall error to be no larger than
    what rounding the reference itself costs (max err <= rounding err of ref + 1e-3 * max)."""
    g = grad.to(torch.float64)
    ref_r = ref.to(torch.bfloat16).to(torch.float64)
    scale = float(ref.abs().max()) if ref.numel() else 0.0
    allow = bf16_ulp(ref) + 1e-5 * scale
    err = (g - ref_r).abs()
    bad = err > allow
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} elements off by more than 1 bf16 ulp; worst "
        f"{float((err / allow).max()):.2f} ulps; e.g. got {g[bad][:4].tolist()} ref "
        f"{ref[bad][:4].tolist()}")
    rounding = float((ref_r - ref).abs().max())
    total = float((g - ref).abs().max())
    assert total <= rounding + 1e-3 * scale, (
        f"{what}: max err {total:.3e} > bf16 rounding of the reference {rounding:.3e} "
        f"+ 1e-3 * max {scale:.3e}")


def assert_teacher_matches(st, ref, *, k, vocab_size, temperature, lp_atol=2e-6, lp_rtol=1e-6,
                           rest_rtol=1e-5, rest_atol=2e-6, lenient_neg_inf=True):
    """Compare a topkd.SparseTeacher against reference.select()."""
    lead = tuple(ref["lead"])
    assert st.indices.dtype == torch.int64, st.indices.dtype
    assert st.logprobs.dtype == torch.float32, st.logprobs.dtype
    assert st.rest_logprob.dtype == torch.float32, st.rest_logprob.dtype
    assert tuple(st.indices.shape) == lead + (k,), st.indices.shape
    assert tuple(st.logprobs.shape) == lead + (k,), st.logprobs.shape
    assert tuple(st.rest_logprob.shape) == lead, st.rest_logprob.shape
    assert float(st.temperature) == float(temperature)
    assert int(st.vocab_size) == int(vocab_size)
    ri, rl = ref["indices"], ref["logprobs"]
    finite = rl > float("-inf")
    # Entries with non-zero teacher mass: exact indices, close log-probs.
    assert torch.equal(st.indices[finite], ri[finite]), (
        "indices differ:\n" + str(st.indices[(st.indices != ri).any(-1)][:3]) + "\nvs\n"
        + str(ri[(st.indices != ri).any(-1)][:3]))
    torch.testing.assert_close(st.logprobs[finite].to(torch.float64), rl[finite],
                               rtol=lp_rtol, atol=lp_atol)
    # Slots with zero teacher mass: -inf log-prob. Dropped by top-p: -1 index. Selected entries
    # whose teacher logit is -inf carry their vocabulary index by the loss's definition (S is
    # the K largest, ties to the lower index); -1 there is loss-equivalent for forward KL, so
    # we accept it unless lenient_neg_inf is False.
    assert torch.all(st.logprobs[~finite] == float("-inf")), st.logprobs[~finite]
    dropped = ri == -1
    assert torch.all(st.indices[dropped] == -1)
    zero_mass = ~finite & ~dropped
    if lenient_neg_inf:
        ok = (st.indices[zero_mass] == ri[zero_mass]) | (st.indices[zero_mass] == -1)
        assert ok.all()
    else:
        assert torch.equal(st.indices[zero_mass], ri[zero_mass])
    rr = ref["rest_logprob"]
    rfin = rr > float("-inf")
    assert torch.all(st.rest_logprob[~rfin] == float("-inf")), st.rest_logprob[~rfin]
    torch.testing.assert_close(st.rest_logprob[rfin].to(torch.float64), rr[rfin],
                               rtol=rest_rtol, atol=rest_atol)


def memory_events(fn):
    """Run fn() under the profiler with profile_memory=True; return the allocator's signed
    bytes in time order as the benchmarks count them (the profiler method:
    :func:`benchmarks.harness.counted`, which leaves out the free of a block allocated before
    profiling began, such as one an earlier test's profiled step left in a cache)."""
    from benchmarks import harness

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as prof:
        fn()
    events = harness.counted(harness.allocations(prof))
    assert events, "the profiler recorded no allocator events"
    return events


def machine_threads() -> int:
    """The threads PyTorch gives one process on this machine (under pytest-xdist each worker
    runs fewer: conftest.py)."""
    return int(os.environ.get("TOPKD_TESTS_MACHINE_THREADS", torch.get_num_threads()))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# What every spawned rank imports: the fork server imports it once per test process and each
# rank is forked from it (a fresh interpreter, not a copy of the test process: no threads, no
# process group, no CUDA), so a rank starts in a fraction of a second instead of importing
# torch (and transformers) again: most of a small multi-rank test's time.
# (A module missing here is skipped: the fork server ignores an ImportError.)
_RANK_IMPORTS = ("torch", "torch.distributed", "torch.multiprocessing", "numpy", "topkd",
                 "transformers", "transformers.modeling_utils", "megatron.core",
                 "megatron.core.parallel_state", "megatron.core.tensor_parallel")


def _preload_forkserver() -> None:
    import multiprocessing

    multiprocessing.get_context("forkserver").set_forkserver_preload(list(_RANK_IMPORTS))


def spawn_ranks(fn, world: int, args: tuple, result_dir, deadline_s: float = 300) -> None:
    """Run ``fn(rank, *args)`` in ``world`` spawned processes. Past ``deadline_s`` they are
    killed and the test fails (a hang in a collective must not hang the suite); then every
    rank's ``result_dir/rank<r>.txt`` must say ``OK`` (else it holds that rank's report)."""
    import pytest
    import torch.multiprocessing as mp

    _preload_forkserver()
    ctx = mp.start_processes(fn, args=args, nprocs=world, join=False,
                             start_method="forkserver")
    deadline = time.monotonic() + deadline_s
    try:
        while not ctx.join(timeout=5):
            if time.monotonic() > deadline:
                pytest.fail(f"{world} ranks of {fn.__name__} did not finish within "
                            f"{deadline_s} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)
    reports = []
    for rank in range(world):
        path = result_dir / f"rank{rank}.txt"
        assert path.exists(), f"rank {rank} wrote no result"
        text = path.read_text()
        if text != "OK":
            reports.append(f"--- rank {rank} ---\n{text}")
    assert not reports, "\n".join(reports)


# Heavy torch calls (products, exponentials, selection): a bad input must fail before any.
HEAVY_OPS = {"linear", "mm", "addmm", "matmul", "bmm", "topk", "sort", "logsumexp", "softmax",
             "log_softmax", "exp", "exp_", "log", "log_"}


class WorkRecorder(torch.overrides.TorchFunctionMode):
    """Records the heavy torch calls (``HEAVY_OPS``) made while active."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if name in HEAVY_OPS or name.strip("_") in HEAVY_OPS:
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


def half_tvd_class(name: str):
    """A user's divergence, ``pointwise`` only: half the total variation (so its loss is half of
    ``divergence="tvd"``'s). A class per ``name``, for a registry name of each test's own."""
    import topkd

    class HalfTVD(topkd.Divergence):
        def pointwise(self, logp, logq):
            return 0.25 * (logq.exp() - logp.exp()).abs()

    HalfTVD.name = name
    return HalfTVD


def record_options(monkeypatch, module) -> list:
    """Replace ``module.distill_loss`` with one that records each call's options and computes
    the loss unchanged; the list of recorded options."""
    seen = []
    real = module.distill_loss

    def spy(student, teacher, options, **kwargs):
        seen.append(options)
        return real(student, teacher, options, **kwargs)

    monkeypatch.setattr(module, "distill_loss", spy)
    return seen
