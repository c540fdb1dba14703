"""Fused LM-head losses: fused_topk_kl_loss, fused_kl_loss and their modules.

The fused losses take the student's hidden states and LM head instead of its logits. They must
equal the unfused losses on ``F.linear(hidden, weight, bias)`` (loss and the gradients of
hidden, weight and bias) to float32 rounding, for every teacher kind (logits, SparseTeacher,
``(teacher_hidden, teacher_weight[, teacher_bias])``) and option; in bf16 they are compared
with a float64 chain-rule reference. Also: non-contiguous hidden states, frozen parameters,
the modules, the memory bound, and the input checks.
"""

from __future__ import annotations

import os
import subprocess
import sys
from unittest import mock

import helpers
import pytest
import reference as ref
import torch
import torch.nn.functional as F
from helpers import (
    LOSS_RTOL,
    WorkRecorder,
    assert_loss_close,
    grad_err,
    machine_threads,
    memory_events,
)

import topkd
from topkd import memory

HERE = os.path.dirname(os.path.abspath(__file__))  # this file's folder, for its subprocess
LEAD = (3, 5)  # 15 rows
H = 32  # student hidden width
H_T = 24  # teacher hidden width (differs from the student's on purpose)
V = 96
K = 5

# float32, fused vs unfused: the same float32 math in another chunking/summation order, on
# logits that differ by float32 rounding (a one-row product is not bit-identical to the whole
# matrix's). Each path is within ~1.6e-6 of max|g| of float64 for reverse KL (rounding of the
# log terms), so they differ by up to twice that; a real error is O(1e-2) or more.
F32_LOSS_RTOL = 2e-6
F32_GRAD_TOL = 5e-6  # max |fused - unfused| / max |unfused|, per gradient

TEACHERS = ["logits", "sparse", "pair", "pair_bias"]


# ----------------------------------------------------------------------------- inputs


def _data(dtype=torch.float32, seed=0, lead=LEAD, v=V, bias=True):
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * scale

    d = {
        "h": rnd(*lead, H),
        "W": rnd(v, H, scale=2.0 / H ** 0.5),  # student logits ~ N(0, 4)
        "b": rnd(v, scale=0.5) if bias else None,
        "t": rnd(*lead, v, scale=2.5),  # teacher logits (the "logits" teacher)
        "th": rnd(*lead, H_T),
        "tW": rnd(v, H_T, scale=2.5 / H_T ** 0.5),
        "tb": rnd(v, scale=0.5),
    }
    d = {n: None if x is None else x.to(dtype) for n, x in d.items()}
    d["go"] = rnd(*lead).float()  # non-uniform upstream gradient for reduction="none"
    return d


def _teacher_logits(d, teacher):
    """The teacher's logits as the unfused loss sees them (F.linear in the teacher's dtype)."""
    if teacher in ("logits", "sparse"):
        return d["t"]
    return F.linear(d["th"], d["tW"], d["tb"] if teacher == "pair_bias" else None)


def _fused_teacher(d, teacher):
    if teacher in ("logits", "sparse"):
        return d["t"]
    if teacher == "pair":
        return (d["th"], d["tW"])
    return (d["th"], d["tW"], d["tb"])


def _leaf(x, requires=True):
    return None if x is None else x.detach().clone().requires_grad_(requires)


def _backward(loss, go):
    loss.backward(go if loss.dim() else None)


def run_pair(d, loss, teacher, opts, *, view=None, requires=(True, True, True), mask=None):
    """Run the fused loss and its unfused equivalent on fresh leaves of the same inputs.

    ``loss`` is "topk" or "kl"; ``teacher`` one of TEACHERS; ``opts`` the options (k included
    for "topk"). Returns ``(fused, unfused)``, each ``(loss, grad_h, grad_W, grad_b)``.
    """
    opts = dict(opts)
    if mask is not None:
        opts["mask"] = mask
    view = view or (lambda x: x)
    k = opts.pop("k", None)
    results = []
    for fused in (True, False):
        h, w, b = (_leaf(d[n], r) for n, r in zip("hWb", requires, strict=True))
        hv = view(h)
        if fused:
            if teacher == "sparse":
                st = topkd.select_topk(view(d["t"]), k, top_p=opts.get("top_p"),
                                       top_p_min_k=opts.get("top_p_min_k", 1),
                                       temperature=opts.get("temperature", 1.0),
                                       vocab_size=opts.get("vocab_size"))
                o = {n: x for n, x in opts.items() if n not in ("top_p", "top_p_min_k")}
                out = topkd.fused_topk_kl_loss(hv, w, st, bias=b, **o)
            elif loss == "topk":
                out = topkd.fused_topk_kl_loss(hv, w, _view_all(_fused_teacher(d, teacher), view),
                                               k, bias=b, **opts)
            else:
                out = topkd.fused_kl_loss(hv, w, _view_all(_fused_teacher(d, teacher), view),
                                          bias=b, **opts)
        else:
            # F.linear on the leaf, then the view: on a non-contiguous 3-D input F.linear may
            # round the product and the bias add separately in bf16 (torch CPU); the fused
            # path computes a contiguous row block with one rounding, like the leaf's layout.
            z = view(F.linear(h, w, b))
            t = view(_teacher_logits(d, teacher))
            if teacher == "sparse":
                st = topkd.select_topk(t, k, top_p=opts.get("top_p"),
                                       top_p_min_k=opts.get("top_p_min_k", 1),
                                       temperature=opts.get("temperature", 1.0),
                                       vocab_size=opts.get("vocab_size"))
                o = {n: x for n, x in opts.items()
                     if n not in ("top_p", "top_p_min_k", "temperature")}
                out = topkd.sparse_kl_loss(z, st, **o)
            elif loss == "topk":
                out = topkd.topk_kl_loss(z, t, k, **opts)
            else:
                out = topkd.kl_loss(z, t, **opts)
        if out.requires_grad:
            _backward(out, view(d["go"]))
        results.append((out.detach(), h.grad, w.grad, None if b is None else b.grad))
    return results


def _view_all(teacher, view):
    if isinstance(teacher, tuple):
        return (view(teacher[0]), *teacher[1:])
    return view(teacher)


def assert_fused_equals_unfused(fused, unfused, dtype, what=""):
    lf, *gf = fused
    lu, *gu = unfused
    assert lf.dtype == torch.float32, lf.dtype
    # Per row, relative to the batch's loss scale (as tp_worker._compare): a row whose KL is
    # small is a sum of O(1) terms, and the fused and unfused logits themselves differ by
    # float32 rounding (a one-row product is not bit-identical to the whole matrix's).
    rtol = F32_LOSS_RTOL if dtype == torch.float32 else LOSS_RTOL
    assert_loss_close(lf, lu.to(torch.float64), rtol=rtol,
                      atol=rtol * float(lu.abs().mean()) + 1e-12, what=f"{what} loss")
    errors = []
    for name, a, b in zip(("hidden", "weight", "bias"), gf, gu, strict=True):
        if b is None:
            assert a is None, f"{what} {name}: fused gave a gradient, unfused none"
            continue
        assert a is not None, f"{what} {name}: no fused gradient"
        assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, a.shape, b.shape)
        assert torch.isfinite(a).all(), f"{what} {name} gradient not finite"
        e = grad_err(a, b.to(torch.float64))
        if e > F32_GRAD_TOL:
            errors.append(f"{name}: max err / max|unfused| = {e:.3e} > {F32_GRAD_TOL}")
    assert not errors, f"{what}: " + "; ".join(errors)


# ----------------------------------------------------------------------------- cases

TOPK_CASES = [
    ("k5", dict(k=K)),
    ("k1", dict(k=1)),
    ("kV", dict(k=V)),
    ("reverse", dict(k=K, reverse=True)),
    ("T0.7", dict(k=K, temperature=0.7)),
    ("top_p", dict(k=12, top_p=0.7, top_p_min_k=2)),
    ("top_p-reverse-T1.3", dict(k=12, top_p=0.8, reverse=True, temperature=1.3)),
    ("normalize_topk", dict(k=K, normalize="topk")),
    ("normalize_topk-reverse-top_p", dict(k=12, normalize="topk", reverse=True, top_p=0.6)),
]
KL_CASES = [
    ("kl", dict()),
    ("kl-reverse-T0.8", dict(reverse=True, temperature=0.8)),
]


def _top_p_ok(d, teacher, opts):
    """The float32 and float64 top-p decisions agree on these inputs (not at a boundary)."""
    if opts.get("top_p") is None:
        return
    t = _teacher_logits(d, teacher)
    sel = ref.select(t, opts["k"], top_p=opts["top_p"], top_p_min_k=opts.get("top_p_min_k", 1),
                     temperature=opts.get("temperature", 1.0))
    m = ref.top_p_margin(sel, opts["top_p"], opts.get("top_p_min_k", 1))
    assert m > 1e-5, f"test input too close to a top-p boundary ({m})"


@pytest.mark.parametrize("chunk_bytes", [1, 3000, None],
                         ids=["chunk1row", "chunk3000B", "chunkDefault"])
@pytest.mark.parametrize("teacher", TEACHERS)
@pytest.mark.parametrize("case", TOPK_CASES, ids=[c[0] for c in TOPK_CASES])
def test_topk_fp32_equals_unfused(case, teacher, chunk_bytes):
    name, opts = case
    # bias and no bias across the matrix (every case has both, with some teacher)
    bias = TOPK_CASES.index(case) % 2 == TEACHERS.index(teacher) % 2
    d = _data(seed=1, bias=bias)
    _top_p_ok(d, teacher, opts)
    fused, unfused = run_pair(d, "topk", teacher, dict(opts, chunk_bytes=chunk_bytes))
    assert_fused_equals_unfused(fused, unfused, torch.float32, f"{name} {teacher}")


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("chunk_bytes", [1, None], ids=["chunk1row", "chunkDefault"])
@pytest.mark.parametrize("teacher", ["logits", "pair", "pair_bias"])
@pytest.mark.parametrize("case", KL_CASES, ids=[c[0] for c in KL_CASES])
def test_kl_fp32_equals_unfused(case, teacher, chunk_bytes, bias):
    name, opts = case
    d = _data(seed=2, bias=bias)
    fused, unfused = run_pair(d, "kl", teacher, dict(opts, chunk_bytes=chunk_bytes))
    assert_fused_equals_unfused(fused, unfused, torch.float32, f"{name} {teacher}")


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("loss,teacher,opts", [
    ("topk", "logits", dict(k=K)),
    ("topk", "sparse", dict(k=K, temperature=1.5, reverse=True)),
    ("topk", "pair_bias", dict(k=12, top_p=0.8)),
    ("kl", "logits", dict()),
    ("kl", "pair", dict(reverse=True)),
], ids=["topk-logits", "topk-sparse", "topk-pair_bias-top_p", "kl-logits", "kl-pair"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_mask_and_reductions_equal_unfused(loss, teacher, opts, reduction, dtype):
    d = _data(dtype, seed=3)
    mask = torch.rand(LEAD, generator=torch.Generator().manual_seed(5)) < 0.6
    assert mask.any() and not mask.all()
    fused, unfused = run_pair(d, loss, teacher, dict(opts, reduction=reduction, chunk_bytes=1),
                              mask=mask)
    assert (fused[0].dim() == 0) == (reduction != "none")
    if dtype == torch.float32:
        assert_fused_equals_unfused(fused, unfused, dtype, f"{loss} {teacher} {reduction}")
    else:
        assert_loss_close(fused[0], unfused[0].double(), rtol=LOSS_RTOL,
                          atol=LOSS_RTOL * float(unfused[0].abs().mean()))
    # masked rows: zero loss, zero hidden gradient
    if reduction == "none":
        assert torch.all(fused[0][~mask] == 0)
    assert torch.all(fused[1][~mask] == 0), "masked rows got a hidden gradient"
    assert fused[1][mask].abs().amax() > 0


@pytest.mark.parametrize("loss,teacher,opts", [
    ("topk", "logits", dict(k=K)),
    ("topk", "pair_bias", dict(k=12, top_p=0.8, reverse=True)),
    ("topk", "sparse", dict(k=K)),
    ("kl", "pair", dict()),
], ids=["topk-logits", "topk-pair_bias", "topk-sparse", "kl-pair"])
def test_padded_vocabulary(loss, teacher, opts):
    """vocab_size below the weight's rows (Megatron's padding): equal to the unfused loss with
    the same vocab_size, and the padding rows of the weight and bias get zero gradient."""
    d = _data(seed=16, v=V + 4)
    fused, unfused = run_pair(d, loss, teacher, dict(opts, vocab_size=V, chunk_bytes=1))
    assert_fused_equals_unfused(fused, unfused, torch.float32, f"vocab_size {loss} {teacher}")
    assert torch.all(fused[2][V:] == 0) and torch.all(fused[3][V:] == 0)
    assert fused[2][:V].abs().amax() > 0


@pytest.mark.parametrize("loss", ["topk", "kl"])
def test_mean_with_no_kept_row_is_zero_with_zero_gradients(loss):
    d = _data(seed=4)
    mask = torch.zeros(LEAD, dtype=torch.bool)
    opts = dict(k=K) if loss == "topk" else {}
    fused, _ = run_pair(d, loss, "pair_bias", dict(opts, reduction="mean"), mask=mask)
    assert float(fused[0]) == 0.0
    for g in fused[1:]:
        assert g is not None and torch.all(g == 0)


@pytest.mark.parametrize("loss", ["topk", "kl"])
def test_zero_rows_default_budget(loss):
    """No rows, the default budget (where a small problem runs as one block): a zero loss."""
    d = _data(seed=5, lead=(0,))
    opts = dict(k=K) if loss == "topk" else {}
    fused, _ = run_pair(d, loss, "pair_bias", dict(opts, reduction="sum"))
    assert float(fused[0]) == 0.0
    assert torch.all(fused[2] == 0) and torch.all(fused[3] == 0)


@pytest.mark.parametrize("teacher", ["logits", "pair_bias"])
def test_one_pass_selection_in_spans_of_chunks(monkeypatch, teacher):
    """A one-pass fused Top-K loss selects the teacher a span of several work chunks at a
    time (here 15 rows in spans of 6 over 2-row chunks): the spans cover every row once and
    the loss and gradients are the unfused ones."""
    spans, selected = [], []
    fused_select, select_rows = topkd.memory.fused_select, topkd.entry.select_rows

    def spy_span(cfg, *args):
        out = fused_select(cfg, *args)
        spans.append((cfg.rows_per_chunk, out[0]))
        return out

    def spy_select(rows, *args, **kwargs):
        selected.append(rows.count)
        return select_rows(rows, *args, **kwargs)

    monkeypatch.setattr(topkd.memory, "fused_select", spy_span)
    monkeypatch.setattr(topkd.entry, "select_rows", spy_select)
    d = _data(seed=6)
    opts = dict(k=K, chunk_bytes=15000, reduction="mean")
    fused, unfused = run_pair(d, "topk", teacher, opts)
    assert_fused_equals_unfused(fused, unfused, torch.float32, f"spans {teacher}")
    (per, span), = spans
    assert per < span < 15 and span % per == 0, spans
    *spanned, whole = selected  # the fused call's spans, then the unfused call's selection
    assert whole == 15 and sum(spanned) == 15, selected
    assert len(spanned) == -(-15 // span) and max(spanned) == span, selected


# --------------------------------------------------------------- float64 reference, bf16


def _reference(d, loss, teacher, opts, *, view=None, mask=None, go=None):
    """Float64 loss and chain-rule gradients: dz64 = d loss / d z at the student logits
    z = F.linear(hidden, weight, bias) as computed in their dtype (upcast exactly), then
    grad_h = dz64 @ W64, grad_W = dz64^T @ h64, grad_b = sum of dz64 over rows."""
    view = view or (lambda x: x)
    h, w, b = d["h"], d["W"], d["b"]
    z = view(F.linear(h, w, b))  # see run_pair
    t = view(_teacher_logits(d, teacher))
    opts = dict(opts)
    opts.pop("chunk_bytes", None)
    if mask is not None:
        opts["mask"] = mask
    if loss == "topk":
        k = opts.pop("k")
        fn, args = ref.topk_loss, (t, k)
    else:
        fn, args = ref.full_loss, (t,)
    red = opts.get("reduction", "none")
    l64, dz = ref.loss_and_grad(fn, z, *args, grad_output=go if red == "none" else None, **opts)
    # back through the view to the leaf's layout
    zs = torch.zeros(*h.shape[:-1], w.shape[0], dtype=torch.float64)
    view(zs).copy_(dz)
    dz2 = zs.reshape(-1, w.shape[0])
    h64 = h.to(torch.float64).reshape(-1, h.shape[-1])
    gh = (dz2 @ w.to(torch.float64)).reshape(h.shape)
    gw = dz2.T @ h64
    gb = None if b is None else dz2.sum(0)
    return l64, gh, gw, gb


def _assert_f32_close_to_reference(result, refr, what):
    loss, *grads = result
    l64, *rgrads = refr
    assert_loss_close(loss, l64, what=f"{what} loss")
    for name, g, r in zip(("hidden", "weight", "bias"), grads, rgrads, strict=True):
        if r is None:
            continue
        e = grad_err(g, r)
        assert e <= 1e-5, f"{what} {name}: max err / max|ref| = {e:.3e} > 1e-5"


def _assert_bf16_close_to_reference(result, refr, what, unfused):
    """bf16: loss within 1e-5 relative of float64. Gradients: no further from the
    float64 chain-rule gradient than the unfused PyTorch path (F.linear, then the logits loss,
    then autograd), which rounds the logits gradient to bf16 before the two products; the
    fused path does the same for the hidden states' product and accumulates the weight's in
    float32. (One bf16 ulp of float64 would need float32 products, about twice the matrix
    time on CPU: see the README.) All gradients are checked before failing."""
    loss, *grads = result
    l64, *rgrads = refr
    assert_loss_close(loss, l64, what=f"{what} loss")
    errors = []
    for name, g, u, r in zip(("hidden", "weight", "bias"), grads, unfused[1:], rgrads,
                             strict=True):
        if r is None:
            continue
        assert g.dtype == torch.bfloat16
        fused_err, unfused_err = grad_err(g, r), grad_err(u, r)
        if fused_err > 1.25 * unfused_err + 1e-5:
            errors.append(f"{name} gradient: max err / max|ref| = {fused_err:.2e}, unfused "
                          f"{unfused_err:.2e}")
    assert not errors, f"{what}:\n" + "\n".join(errors)


REF_CASES = [
    ("topk", "logits", dict(k=K)),
    ("topk", "pair_bias", dict(k=12, top_p=0.8, reverse=True, temperature=1.3)),
    ("topk", "sparse", dict(k=K, normalize="topk")),
    ("kl", "pair", dict(temperature=0.8)),
]
REF_IDS = ["topk-logits", "topk-pair_bias-top_p-reverse-T", "topk-sparse-normtopk", "kl-pair"]


@pytest.mark.parametrize("chunk_bytes", [1, None], ids=["chunk1row", "chunkDefault"])
@pytest.mark.parametrize("loss,teacher,opts", REF_CASES, ids=REF_IDS)
def test_fp32_matches_float64_reference(loss, teacher, opts, chunk_bytes):
    d = _data(seed=6)
    if loss == "topk":
        _top_p_ok(d, teacher, opts)
    fused, _ = run_pair(d, loss, teacher, dict(opts, chunk_bytes=chunk_bytes))
    _assert_f32_close_to_reference(fused, _reference(d, loss, teacher, opts, go=d["go"]),
                                   f"{loss} {teacher}")


@pytest.mark.parametrize("reduction", ["none", "mean"])
@pytest.mark.parametrize("chunk_bytes", [1, None], ids=["chunk1row", "chunkDefault"])
@pytest.mark.parametrize("loss,teacher,opts", REF_CASES, ids=REF_IDS)
def test_bf16_matches_float64_reference(loss, teacher, opts, chunk_bytes, reduction):
    d = _data(torch.bfloat16, seed=7, lead=(4, 16), v=300)
    if loss == "topk":
        _top_p_ok(d, teacher, opts)
    opts = dict(opts, reduction=reduction)
    fused, unfused = run_pair(d, loss, teacher, dict(opts, chunk_bytes=chunk_bytes))
    # the loss also equals the unfused loss
    assert_loss_close(fused[0], unfused[0].double(), rtol=LOSS_RTOL,
                      atol=LOSS_RTOL * float(unfused[0].abs().mean()), what="vs unfused")
    _assert_bf16_close_to_reference(fused, _reference(d, loss, teacher, opts, go=d["go"]),
                                    f"{loss} {teacher} {reduction}", unfused)


# --------------------------------------------------------------- layout, frozen parameters


@pytest.mark.parametrize("loss,teacher,opts", [
    ("topk", "logits", dict(k=K, top_p=0.8, reverse=True)),
    ("topk", "sparse", dict(k=K)),
    ("topk", "pair_bias", dict(k=K, temperature=0.9)),
    ("kl", "pair", dict()),
], ids=["topk-logits", "topk-sparse", "topk-pair_bias", "kl-pair"])
@pytest.mark.parametrize("chunk_bytes", [1, None], ids=["chunk1row", "chunkDefault"])
def test_noncontiguous_hidden(loss, teacher, opts, chunk_bytes):
    """hidden is the [S, B, H] transposed view of a [B, S, H] tensor (Megatron's layout); the
    teacher (logits or hidden states) and the mask are the same kind of view."""
    d = _data(seed=8)
    view = lambda x: x.transpose(0, 1)  # noqa: E731
    assert not view(d["h"]).is_contiguous()
    mask = view(torch.rand(LEAD, generator=torch.Generator().manual_seed(9)) < 0.7)
    fused, unfused = run_pair(d, loss, teacher, dict(opts, chunk_bytes=chunk_bytes), view=view,
                              mask=mask)
    assert fused[0].shape == (LEAD[1], LEAD[0])
    assert fused[1].shape == d["h"].shape
    assert_fused_equals_unfused(fused, unfused, torch.float32, "[S,B,H] view")
    if loss == "topk" and teacher != "sparse":
        _assert_f32_close_to_reference(
            fused, _reference(d, loss, teacher, opts, view=view, mask=mask, go=view(d["go"])),
            "[S,B,H] view vs float64")


def test_noncontiguous_hidden_bf16():
    d = _data(torch.bfloat16, seed=10, lead=(4, 16), v=300)
    view = lambda x: x.transpose(0, 1)  # noqa: E731
    fused, unfused = run_pair(d, "topk", "pair", dict(k=8, chunk_bytes=1), view=view)
    assert_loss_close(fused[0], unfused[0].double(), rtol=LOSS_RTOL)
    _assert_bf16_close_to_reference(fused, _reference(d, "topk", "pair", dict(k=8), view=view,
                                                      go=view(d["go"])), "bf16 [S,B,H] view",
                                    unfused)


REQUIRES = [(True, False, True), (False, True, True), (True, True, False), (True, False, False),
            (False, False, True), (False, True, False)]


@pytest.mark.parametrize("requires", REQUIRES,
                         ids=["frozen_weight", "frozen_hidden", "frozen_bias", "hidden_only",
                              "bias_only", "weight_only"])
@pytest.mark.parametrize("loss,teacher,opts", [
    ("topk", "logits", dict(k=K)),
    ("kl", "pair_bias", dict(reverse=True)),
], ids=["topk", "kl"])
def test_frozen_parameters(requires, loss, teacher, opts):
    """Gradients go to exactly the inputs that require grad (e.g. a frozen LM head)."""
    d = _data(seed=11)
    fused, unfused = run_pair(d, loss, teacher, dict(opts, chunk_bytes=1), requires=requires)
    for name, r, g in zip(("hidden", "weight", "bias"), requires, fused[1:], strict=True):
        assert (g is not None) == r, f"{name}: requires_grad={r} but grad is {g}"
    assert_fused_equals_unfused(fused, unfused, torch.float32, f"requires={requires}")


def test_nothing_requires_grad():
    d = _data(seed=12)
    loss = topkd.fused_topk_kl_loss(d["h"], d["W"], d["t"], K, bias=d["b"])
    assert not loss.requires_grad
    z = F.linear(d["h"], d["W"], d["b"])
    torch.testing.assert_close(loss, topkd.topk_kl_loss(z, d["t"], K), rtol=2e-6, atol=1e-7)


def test_no_grad_mode():
    d = _data(seed=12)
    h = d["h"].clone().requires_grad_(True)
    with torch.no_grad():
        loss = topkd.fused_kl_loss(h, d["W"], d["t"])
    assert not loss.requires_grad and loss.shape == LEAD


# ----------------------------------------------------------------------------- modules


def _module_and_function_grads(call, d):
    h, w, b = (_leaf(d[n]) for n in "hWb")
    loss = call(h, w, b)
    loss.backward()
    return loss.detach(), h.grad, w.grad, b.grad


@pytest.mark.parametrize("teacher", ["logits", "pair_bias"])
def test_modules_equal_functions(teacher):
    d = _data(seed=13)
    tt = _fused_teacher(d, teacher)
    mask = torch.rand(LEAD, generator=torch.Generator().manual_seed(1)) < 0.5
    opts = dict(top_p=0.9, temperature=0.8, reverse=True, reduction="mean", chunk_bytes=4096)
    mod = topkd.FusedTopKLogitsKLLoss(8, **opts)
    assert isinstance(mod, torch.nn.Module)
    a = _module_and_function_grads(lambda h, w, b: mod(h, w, tt, bias=b, mask=mask), d)
    f = _module_and_function_grads(lambda h, w, b: topkd.fused_topk_kl_loss(
        h, w, tt, 8, bias=b, mask=mask, **opts), d)
    for x, y in zip(a, f, strict=True):
        assert torch.equal(x, y)
    mod = topkd.FusedLogitsKLLoss(temperature=1.2, reduction="sum")
    assert isinstance(mod, torch.nn.Module)
    a = _module_and_function_grads(lambda h, w, b: mod(h, w, tt, bias=b, mask=mask), d)
    f = _module_and_function_grads(lambda h, w, b: topkd.fused_kl_loss(
        h, w, tt, bias=b, mask=mask, temperature=1.2, reduction="sum"), d)
    for x, y in zip(a, f, strict=True):
        assert torch.equal(x, y)


def test_sparse_teacher_module_takes_k_from_teacher():
    d = _data(seed=14)
    st = topkd.select_topk(d["t"], 7, temperature=2.0)
    a = topkd.FusedTopKLogitsKLLoss(temperature=2.0)(d["h"], d["W"], st, bias=d["b"])
    b = topkd.sparse_kl_loss(F.linear(d["h"], d["W"], d["b"]), st)
    torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-7)
    # the same k as the teacher's is accepted
    c = topkd.fused_topk_kl_loss(d["h"], d["W"], st, 7, bias=d["b"], temperature=2.0)
    assert torch.equal(a, c)


# ----------------------------------------------------------------------------- memory

MEM_ROWS, MEM_H, MEM_V, MEM_K = 512, 64, 32000, 512  # H small: the products are not what is bounded
MEM_BOUND = 0.25  # x the bytes of the student logits [rows, V] in bf16


def _memory_inputs(teacher, rows=MEM_ROWS):
    g = torch.Generator().manual_seed(0)

    def bf16(*shape, scale):
        return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)

    h = bf16(rows, MEM_H, scale=1.0).requires_grad_(True)
    w = bf16(MEM_V, MEM_H, scale=2.0 / MEM_H ** 0.5).requires_grad_(True)
    b = bf16(MEM_V, scale=0.5).requires_grad_(True)
    if teacher == "logits":
        t = bf16(rows, MEM_V, scale=2.5)
    elif teacher == "transposed":  # [s, b, V] that cannot be viewed as rows
        t = bf16(2, rows // 2, MEM_V, scale=2.5).transpose(0, 1)
    else:
        t = (bf16(rows, MEM_H, scale=1.0), bf16(MEM_V, MEM_H, scale=2.5 / MEM_H ** 0.5))
    return h, w, b, t


def _peak_not_counting(fn, allowed):
    """The profiler method (as test_memory._peak_above_start): the running sum of the
    allocator's signed bytes in time order, bytes above what was allocated when
    profiling began. ``allowed`` maps an allocation size in bytes to how many live blocks of
    that size are not counted (the returned gradients, the float32 weight accumulator) while
    they are live. Returns ``(peak not counting them, raw peak)``."""
    live = dict.fromkeys(allowed, 0)
    cur = peak = raw = 0
    for n in memory_events(fn):
        cur += n
        if abs(n) in live:
            live[abs(n)] += 1 if n > 0 else -1
        exempt = sum(size * min(max(live[size], 0), count) for size, count in allowed.items())
        peak = max(peak, cur - exempt)
        raw = max(raw, cur)
    return peak, raw


@pytest.fixture(params=["native", "onednn"])
def gemm(request, monkeypatch):
    """The matrix products as this CPU runs them, or as oneDNN runs bf16 products on AVX512 /
    AMX CPUs: a scratchpad of :func:`topkd.memory.gemm_workspace` bytes allocated through
    PyTorch's allocator for the length of every product (emulated, so the bound is checked
    for both kinds of CPU on either), for as many threads as one process gets here. Where
    this CPU's bf16 products already run oneDNN's, "native" is that case with the real
    scratchpad, and an emulated one on top would count two."""
    if request.param == "onednn":
        from topkd import memory, sources

        if memory.gemm_workspace(torch.bfloat16, torch.device("cpu")):
            pytest.skip("this CPU's bf16 products run oneDNN's: the 'native' case is that one")
        workspace = machine_threads() * memory.ONEDNN_WORKSPACE_PER_THREAD
        product = sources.matmul

        def with_scratchpad(*args, **kwargs):
            scratchpad = torch.empty(workspace, dtype=torch.uint8)
            out = product(*args, **kwargs)
            del scratchpad
            return out

        monkeypatch.setattr(sources, "matmul", with_scratchpad)
        monkeypatch.setattr(memory, "gemm_workspace",
                            lambda dtype, device: 0 if dtype == torch.float32 else workspace)
    return request.param


MEMORY_CASES = {
    "topk-logits": ("topk", "logits", MEM_ROWS, None, {}),
    "topk-pair-chunk1MiB": ("topk", "pair", MEM_ROWS, 1 << 20, {}),
    # small batches: blocks of fewer than 64 rows take the float32 weight-product path
    "topk-logits-128": ("topk", "logits", 128, None, {}),
    "topk-pair-128": ("topk", "pair", 128, None, {}),
    "kl-pair-128": ("kl", "pair", 128, None, {}),
    "kl-pair": ("kl", "pair", MEM_ROWS, None, {}),
    "kl-transposed-256": ("kl", "transposed", 256, None, {}),
    # the divergence family and the CE term (at T != 1 its own normalizer), with a softcap
    "jsd-ce-softcap-pair": ("kl", "pair", MEM_ROWS, None, {
        "divergence": "jsd", "ce_weight": 0.5, "temperature": 2.0, "softcap": 30.0}),
    "tvd-pair": ("kl", "pair", MEM_ROWS, None, {"divergence": "tvd"}),
    "skew_reverse_kl-ce-logits": ("topk", "logits", MEM_ROWS, None, {
        "divergence": "skew_reverse_kl", "ce_weight": 1.0}),
}


def peak_ratio(case: str, impl: str = "eager", floor: int = memory.MIN_CHUNK_BYTES) -> float:
    """Peak bytes above the inputs during forward + backward of a :data:`MEMORY_CASES` case,
    not counting the returned gradients and one float32 accumulator of the weight's shape,
    over the bytes of the student logits [rows, V] in bf16.

    ``floor`` replaces the fused budget's floor (:data:`topkd.memory.FUSED_MIN_BYTES`): these
    logits (31 MiB) are far below the 320 MiB from which the default budget is a fifth of the
    logits, so the tests lower the floor to check that rule at a shape they can afford;
    :func:`test_peak_memory_of_small_logits_at_the_floor` checks the floor itself."""
    with mock.patch.object(memory, "FUSED_MIN_BYTES", floor):
        return _peak_ratio(case, impl)


def _peak_ratio(case: str, impl: str) -> float:
    loss, teacher, rows, chunk_bytes, options = MEMORY_CASES[case]
    h, w, b, t = _memory_inputs(teacher, rows)
    hidden = h.view(t.shape[0], t.shape[1], MEM_H) if teacher == "transposed" else h
    options = dict(options, impl=impl)
    if "ce_weight" in options:
        options["labels"] = torch.randint(0, MEM_V, hidden.shape[:-1],
                                          generator=torch.Generator().manual_seed(2))

    def step():
        if loss == "topk":
            out = topkd.fused_topk_kl_loss(hidden, w, t, MEM_K, bias=b,
                                           chunk_bytes=chunk_bytes, reduction="mean",
                                           **options)
        else:
            out = topkd.fused_kl_loss(hidden, w, t, bias=b, chunk_bytes=chunk_bytes,
                                      reduction="mean", **options)
        out.backward()

    sizes = [h.numel() * 2, w.numel() * 2, b.numel() * 2]  # the returned bf16 gradients
    allowed = {}
    for size in sizes + [w.numel() * 4]:  # + one float32 accumulator of the weight's shape
        allowed[size] = allowed.get(size, 0) + 1
    peak, raw = _peak_not_counting(step, allowed)
    for x in (h, w, b):
        assert x.grad is not None and x.grad.dtype == torch.bfloat16
    # the measurement is not vacuous: it sees the returned gradients themselves
    assert raw >= sum(sizes), f"raw peak {raw} below the returned gradients' {sum(sizes)} bytes"
    return peak / (rows * MEM_V * 2)


# The compiled paths' chunks differ from the eager ones' (one float32 buffer counted per
# chunk): one case per path runs compiled too, the one with that path's highest compiled
# peak when every case ran compiled (Top-K with the teacher's selection; the full vocabulary
# with the CE term's own normalizer and a softcap). The products, and so the oneDNN
# workspace, are the same for either kernel implementation.
MEMORY_COMPILED = ("topk-logits", "jsd-ce-softcap-pair")


@pytest.mark.parametrize("case,impl,gemm", [
    *((case, "eager", gemm) for case in MEMORY_CASES for gemm in ("native", "onednn")),
    *((case, "compile", "native") for case in MEMORY_COMPILED),
], indirect=["gemm"])
def test_peak_memory_bound(case, impl, gemm):
    """The fused losses' peak <= 0.25 x the student logits' bytes (K / V as at the benchmarks'
    shape, 4,096 / 248,320), for both kernel implementations and both kinds of matrix
    product (the workspace of oneDNN's is counted in the fused budget)."""
    ratio = peak_ratio(case, impl)
    print(f"fused {case} {impl} {gemm}: {ratio:.3f} x logits")
    assert ratio <= MEM_BOUND, f"peak = {ratio:.3f} x the student logits"


@pytest.mark.parametrize("case", ["topk-logits", "kl-pair"])
def test_peak_memory_of_small_logits_at_the_floor(case, monkeypatch):
    """By default a fused loss whose logits are under 320 MiB has the 64 MiB floor as its
    budget, not a fifth of the logits (6 MiB here): its work chunks are 32 rows or more (not
    two, whose fixed cost made these shapes 2.4-2.9x the unfused loss's time) and one block
    holds every row; its peak stays within the floor."""
    chunking = []

    def spy(*args, **kwargs):
        chunking.append(rows_of(*args, **kwargs))
        return chunking[-1]

    rows_of = memory.fused_rows
    monkeypatch.setattr(memory, "fused_rows", spy)
    ratio = peak_ratio(case, floor=memory.FUSED_MIN_BYTES)
    per, block, teacher_block = chunking[-1]
    assert per >= 32 and block >= MEM_ROWS, chunking
    assert teacher_block == (block // 4 if case == "kl-pair" else 0), chunking
    assert memory.FUSED_MIN_BYTES == 64 * 2**20
    assert ratio * MEM_ROWS * MEM_V * 2 <= memory.FUSED_MIN_BYTES, ratio
    assert ratio > MEM_BOUND, "the floor was not taken"  # it can fail: the rule is in force


def test_peak_memory_bound_with_the_cpu_capped_at_avx2(tmp_path):
    """The same bound with the instruction sets capped at AVX2 (ATen's kernels, oneDNN, MKL),
    in a fresh process: on an AVX512 / AMX CPU this runs the products without oneDNN, which
    the in-process tests then run with it; on an AVX2 CPU both are the same path."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
           "MKL_ENABLE_INSTRUCTIONS": "AVX2", "TOPKD_IMPL": "eager",
           "PYTHONPATH": os.pathsep.join([HERE, helpers.TESTS, helpers.ROOT])}
    code = ("import torch, test_fused as t; from topkd import memory\n"
            "assert torch.backends.cpu.get_cpu_capability() in ('AVX2', 'DEFAULT')\n"
            "assert memory.gemm_workspace(torch.bfloat16, torch.device('cpu')) == 0\n"
            "print([round(t.peak_ratio(c), 3) for c in ('topk-logits-128', 'kl-pair-128')])")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=env, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    ratios = eval(result.stdout.strip().splitlines()[-1])
    assert max(ratios) <= MEM_BOUND, ratios


# ----------------------------------------------------------------------------- bad inputs

ERR = (ValueError, TypeError)
def _raises_before_work(exc, match, fn):
    rec = WorkRecorder()
    with rec, pytest.raises(exc, match=match) as e:
        fn()
    assert not rec.calls, f"work done before the error {e.value!r}: {rec.calls}"
    return e


def _bad():
    d = _data(seed=15)
    return d["h"], d["W"], d["b"], d["t"]


BAD = {
    # name: (exception, match, callable(h, W, b, t))
    "width_mismatch": (ValueError, "weight", lambda h, w, b, t: topkd.fused_topk_kl_loss(
        h[..., :-1], w, t, K, bias=b)),
    "width_mismatch_kl": (ValueError, "weight", lambda h, w, b, t: topkd.fused_kl_loss(
        h, w[:, :-1], t, bias=b)),
    "weight_1d": (ValueError, "weight", lambda h, w, b, t: topkd.fused_topk_kl_loss(
        h, w[0], t, K)),
    "weight_3d": (ValueError, "weight", lambda h, w, b, t: topkd.fused_kl_loss(
        h, w[None], t)),
    "weight_not_tensor": (ERR, "weight", lambda h, w, b, t: topkd.fused_kl_loss(
        h, w.tolist(), t)),
    "bias_wrong_shape": (ValueError, "bias", lambda h, w, b, t: topkd.fused_topk_kl_loss(
        h, w, t, K, bias=b[:-1])),
    "bias_2d": (ValueError, "bias", lambda h, w, b, t: topkd.fused_kl_loss(
        h, w, t, bias=b[None])),
    # bf16 with fp32 is autocast's mix and runs in bf16; bf16 with fp16 has no product dtype
    "hidden_weight_dtypes": (TypeError, "weight.to", lambda h, w, b, t: topkd.fused_topk_kl_loss(
        h.bfloat16(), w.half(), t, K)),
    "bias_dtype": (TypeError, "bias", lambda h, w, b, t: topkd.fused_kl_loss(
        h.bfloat16(), w, t, bias=b.half())),
    "teacher_pair_dtypes": (TypeError, "teacher", lambda h, w, b, t: topkd.fused_kl_loss(
        h, w, (h.bfloat16(), w.half()))),
    "hidden_not_tensor": (TypeError, "hidden", lambda h, w, b, t: topkd.fused_kl_loss(
        h.tolist(), w, t)),
    "hidden_int": (TypeError, "hidden", lambda h, w, b, t: topkd.fused_topk_kl_loss(
        h.long(), w, t, K)),
    "teacher_list": (TypeError, "teacher", lambda h, w, b, t: topkd.fused_topk_kl_loss(
        h, w, [h, w], K)),
    "teacher_4_tuple": (TypeError, "teacher", lambda h, w, b, t: topkd.fused_kl_loss(
        h, w, (h, w, b, b))),
    "teacher_1_tuple": (TypeError, "teacher", lambda h, w, b, t: topkd.fused_kl_loss(
        h, w, (h,))),
    "teacher_leading_shape": (ValueError, "teacher", lambda h, w, b, t: topkd.fused_topk_kl_loss(
        h, w, t[:2], K)),
    "teacher_pair_leading_shape": (ValueError, "teacher", lambda h, w, b, t: topkd.fused_kl_loss(
        h, w, (h[:2], w))),
    "teacher_pair_width": (ValueError, "teacher", lambda h, w, b, t: topkd.fused_topk_kl_loss(
        h, w, (h, w[:, :-1]), K)),
    "teacher_pair_bias": (ValueError, "teacher", lambda h, w, b, t: topkd.fused_kl_loss(
        h, w, (h, w, b[:-1]))),
    "teacher_vocab_width": (ValueError, str(V + 4), lambda h, w, b, t: topkd.fused_topk_kl_loss(
        h, w, torch.cat([t, t[..., :4]], -1), K)),
    "k_missing_logits": (ValueError, r"\bk\b", lambda h, w, b, t: topkd.fused_topk_kl_loss(
        h, w, t)),
    "k_missing_pair": (ValueError, r"\bk\b", lambda h, w, b, t: topkd.fused_topk_kl_loss(
        h, w, (h, w, b))),
    "k_too_large": (ValueError, r"\bk\b", lambda h, w, b, t: topkd.fused_topk_kl_loss(
        h, w, t, V + 1)),
    "k_zero": (ValueError, r"\bk\b", lambda h, w, b, t: topkd.fused_topk_kl_loss(h, w, t, 0)),
    "mask_shape": (ValueError, "mask", lambda h, w, b, t: topkd.fused_topk_kl_loss(
        h, w, t, K, mask=torch.ones(LEAD[0], dtype=torch.bool))),
    "reduction": (ValueError, "reduction", lambda h, w, b, t: topkd.fused_kl_loss(
        h, w, t, reduction="avg")),
    "temperature": (ValueError, "temperature", lambda h, w, b, t: topkd.fused_topk_kl_loss(
        h, w, t, K, temperature=0.0)),
    "top_p": (ValueError, "top_p", lambda h, w, b, t: topkd.fused_topk_kl_loss(
        h, w, t, K, top_p=1.5)),
    "normalize": (ValueError, "normalize", lambda h, w, b, t: topkd.fused_topk_kl_loss(
        h, w, t, K, normalize="sparse")),
    "chunk_bytes": (ERR, "chunk_bytes", lambda h, w, b, t: topkd.fused_kl_loss(
        h, w, t, chunk_bytes=0)),
    "vocab_size": (ValueError, "vocab_size", lambda h, w, b, t: topkd.fused_kl_loss(
        h, w, t, vocab_size=V + 1)),
}


def test_work_recorder_sees_work():
    """The recorder used below is not vacuous: a valid call is seen doing work."""
    h, w, b, t = _bad()
    for call in (lambda: topkd.fused_topk_kl_loss(h, w, t, K, bias=b),
                 lambda: topkd.fused_kl_loss(h, w, (h, w), bias=b)):
        rec = WorkRecorder()
        with rec:
            call()
        assert {"linear", "mm", "addmm"} & set(rec.calls), rec.calls  # a matrix product


@pytest.mark.parametrize("name", list(BAD))
def test_bad_inputs_raise_before_any_work(name):
    exc, match, fn = BAD[name]
    h, w, b, t = _bad()
    h.requires_grad_(True)
    w.requires_grad_(True)
    _raises_before_work(exc, match, lambda: fn(h, w, b, t))
    assert h.grad is None and w.grad is None


@pytest.mark.parametrize("bad,match", [
    (dict(k=K + 1), r"\bk\b"),
    (dict(k=K, top_p=0.9), "top_p"),
    (dict(k=K, temperature=1.0), "temperature"),
    (dict(temperature=2.5), "temperature"),
], ids=["k", "top_p", "temperature_default", "temperature"])
def test_sparse_teacher_option_conflicts(bad, match):
    h, w, b, t = _bad()
    st = topkd.select_topk(t, K, temperature=2.0)
    bad = dict(bad)
    k = bad.pop("k", None)
    _raises_before_work(ValueError, match,
                        lambda: topkd.fused_topk_kl_loss(h, w, st, k, bias=b, **bad))
    # module form
    _raises_before_work(ValueError, match,
                        lambda: topkd.FusedTopKLogitsKLLoss(k, **bad)(h, w, st, bias=b))


def test_sparse_teacher_shape_and_vocab_mismatch():
    h, w, b, t = _bad()
    st = topkd.select_topk(t[:2], K)
    _raises_before_work(ValueError, "teacher", lambda: topkd.fused_topk_kl_loss(h, w, st))
    st = topkd.select_topk(t[..., :-1], K)  # normalized over V - 1
    _raises_before_work(ValueError, "vocab_size", lambda: topkd.fused_topk_kl_loss(h, w, st))


def test_fused_kl_loss_refuses_sparse_teacher():
    h, w, b, t = _bad()
    st = topkd.select_topk(t, K)
    _raises_before_work(TypeError, "SparseTeacher", lambda: topkd.fused_kl_loss(h, w, st))
    _raises_before_work(TypeError, "SparseTeacher",
                        lambda: topkd.FusedLogitsKLLoss()(h, w, st, bias=b))


def test_module_bad_options():
    with pytest.raises(ERR, match=r"\bk\b"):
        topkd.FusedTopKLogitsKLLoss(0)
    with pytest.raises(ERR, match="bogus"):
        topkd.FusedTopKLogitsKLLoss(4, bogus=1)
    with pytest.raises(ERR, match="top_p"):
        topkd.FusedLogitsKLLoss(top_p=0.9)  # no top_p for the full-vocabulary loss
