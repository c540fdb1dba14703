"""The divergence family, the hard-label term and the fused logit transforms .

Every check compares forward and gradient with the independent float64 reference
(``reference.py``): the six divergences (with non-default beta/alpha) on every loss path, the
exact endpoints, the CE term (labels, ignore_index, mask, weights, components), softcap and
logit scale in the fused path, a second backward, mixed-dtype fused inputs, bad inputs, and a
user-defined divergence.
"""

from __future__ import annotations

import math

import pytest
import reference as ref
import torch
import torch.nn.functional as F
from helpers import (
    LOSS_RTOL,
    WorkRecorder,
    assert_grad_close,
    assert_loss_close,
    grad_err,
    kd_inputs,
)
from helpers import backward as _backward
from helpers import leaves as _leaves

import topkd

LEAD = (3, 5)  # 15 rows
V = 64
K = 6
K_P, TOP_P = 12, 0.8  # top-p cases
H, H_T = 16, 12  # student / teacher hidden widths
BF16, F32 = torch.bfloat16, torch.float32


def _data(dtype=F32, seed=0):
    return kd_inputs(dtype, seed, lead=LEAD, v=V, hidden=H, teacher_hidden=H_T)


def _pair_logits(d, bias=True):
    """The (hidden, weight[, bias]) teacher's logits, made in its dtype as topkd makes them."""
    return F.linear(d["th"], d["tW"], d["tb"] if bias else None)


# ------------------------------------------------------------------- paths and references

LOGITS_PATHS = ["sparse_full", "sparse_topk", "topk", "topk_top_p", "kl"]
FUSED_PATHS = ["fused_topk_logits", "fused_topk_sparse", "fused_topk_pair", "fused_kl_logits",
               "fused_kl_pair"]
PATHS = LOGITS_PATHS + FUSED_PATHS


def _path(path, d, div, T, **opts):
    """``(call, ref_fn)``: ``call(*leaves)`` runs topkd (leaves: ``[s]`` or ``[h, W, b]``);
    ``ref_fn(z)`` is the float64 reference loss of student logits ``z``."""
    rdiv = div
    t = d["t"]
    if path.startswith("sparse") or path == "fused_topk_sparse":
        st = topkd.select_topk(t, K, temperature=T)
        sel = ref.select(t, K, temperature=T)
        norm = "topk" if path == "sparse_topk" else "full"

        def rfn(z):
            return ref.sparse_loss(z, sel, temperature=T, divergence=rdiv, normalize=norm,
                                   **opts)
        if path == "fused_topk_sparse":
            return (lambda h, w, b: topkd.fused_topk_kl_loss(h, w, st, bias=b, divergence=div,
                                                             **opts)), rfn
        return (lambda s: topkd.sparse_kl_loss(s, st, divergence=div, normalize=norm,
                                               **opts)), rfn
    if path in ("topk", "topk_top_p"):
        k, top_p = (K_P, TOP_P) if path == "topk_top_p" else (K, None)
        if top_p is not None:
            sel = ref.select(t, k, top_p=top_p, temperature=T)
            assert ref.top_p_margin(sel, top_p) > 1e-5, "input too close to a top-p boundary"
        return (lambda s: topkd.topk_kl_loss(s, t, k, top_p=top_p, temperature=T,
                                             divergence=div, **opts),
                lambda z: ref.topk_loss(z, t, k, top_p=top_p, temperature=T, divergence=rdiv,
                                        **opts))
    if path == "kl":
        return (lambda s: topkd.kl_loss(s, t, temperature=T, divergence=div, **opts),
                lambda z: ref.full_loss(z, t, temperature=T, divergence=rdiv, **opts))
    teacher, tlog = {"fused_topk_logits": (t, t), "fused_kl_logits": (t, t),
                     "fused_topk_pair": ((d["th"], d["tW"], d["tb"]), _pair_logits(d)),
                     "fused_kl_pair": ((d["th"], d["tW"]), _pair_logits(d, bias=False))}[path]
    if path.startswith("fused_topk"):
        return (lambda h, w, b: topkd.fused_topk_kl_loss(h, w, teacher, K, bias=b, temperature=T,
                                                         divergence=div, **opts),
                lambda z: ref.topk_loss(z, tlog, K, temperature=T, divergence=rdiv, **opts))
    return (lambda h, w, b: topkd.fused_kl_loss(h, w, teacher, bias=b, temperature=T,
                                                divergence=div, **opts),
            lambda z: ref.full_loss(z, tlog, temperature=T, divergence=rdiv, **opts))


def _fused_reference(rfn, h, w, b, go):
    """Float64 loss and chain-rule gradients of ``rfn(F.linear(h, w, b))``.

    float32: the logits in float64 from the float32 inputs (``ref.linear_loss_and_grads``).
    bf16: the logits as the bf16 product makes them (as the fused path does), ``dz`` in float64,
    then ``dz @ W``, ``dz^T @ h``, ``sum dz`` in float64. Also returns, for bf16, the gradients
    PyTorch's unfused path reaches with that exact ``dz`` (F.linear's bf16 backward), the
    precision the fused path promises to match."""
    if h.dtype == F32:
        l64, *grads = ref.linear_loss_and_grads(rfn, h, w, bias=b, grad_output=go)
        return l64, grads, None
    z = F.linear(h, w, b)
    l64, dz = ref.loss_and_grad(rfn, z, grad_output=go)
    dz2 = dz.reshape(-1, w.shape[0])
    h64 = h.double().reshape(-1, h.shape[-1])
    grads = [(dz2 @ w.double()).reshape(h.shape), dz2.T @ h64, dz2.sum(0)]
    hl, wl, bl = _leaves(h, w, b)
    out = rfn(F.linear(hl, wl, bl).double())
    if out.requires_grad:  # (not for a divergence that is constant, e.g. SkewKL(alpha=1))
        out.backward(go.double() if out.dim() else None)
    return l64, grads, [torch.zeros_like(x) if x.grad is None else x.grad for x in (hl, wl, bl)]


def _check_fused_grads(grads, rgrads, unfused, what):
    for name, g, r, u in zip(("hidden", "weight", "bias"), grads, rgrads,
                             unfused or (None,) * 3, strict=True):
        if u is None:
            assert_grad_close(g, r, F32, what=f"{what} {name}")
        else:
            assert g.dtype == u.dtype and torch.isfinite(g).all(), (name, g.dtype)
            e, eu = grad_err(g, r), grad_err(u, r)
            assert e <= 1.25 * eu + 1e-5, (
                f"{what} {name}: max err / max|ref| {e:.2e} vs PyTorch unfused {eu:.2e}")


def _check(path, d, div, T, dtype, go, **opts):
    """Run one path with topkd and the reference; compare loss and every gradient."""
    call, rfn = _path(path, d, div, T, **opts)
    what = f"{path} {div!r} T={T} {dtype} {opts.get('reduction', 'none')}"
    if path in LOGITS_PATHS:
        (s,) = _leaves(d["s"])
        loss = call(s)
        _backward(loss, go)
        l64, g64 = ref.loss_and_grad(rfn, d["s"], grad_output=go)
        assert_loss_close(loss.detach(), l64, what=what)
        assert_grad_close(s.grad, g64, dtype, what=what)
        return loss
    h, w, b = _leaves(d["h"], d["W"], d["b"])
    loss = call(h, w, b)
    _backward(loss, go)
    l64, rgrads, unfused = _fused_reference(rfn, d["h"], d["W"], d["b"], go)
    assert_loss_close(loss.detach(), l64, what=what)
    _check_fused_grads([h.grad, w.grad, b.grad], rgrads, unfused, what)
    return loss


# ------------------------------------------------- 1. every divergence on every path

DIVS = [topkd.KL(), topkd.ReverseKL(), topkd.JSD(0.0), topkd.JSD(0.1), topkd.JSD(0.5),
        topkd.JSD(0.9), topkd.JSD(1.0), topkd.SkewKL(0.0), topkd.SkewKL(0.1),
        topkd.SkewKL(1.0), topkd.SkewReverseKL(0.0), topkd.SkewReverseKL(0.1),
        topkd.SkewReverseKL(1.0), topkd.TVD()]
_DEFAULT_NAMES = {repr(cls()): cls.name for cls in (topkd.KL, topkd.ReverseKL, topkd.JSD,
                                                   topkd.SkewKL, topkd.SkewReverseKL,
                                                   topkd.TVD)}


def _matrix():
    """Each (divergence, path) once; dtype x T x reduction rotate with ``(3 i + j) % 8`` so
    every path sees all 8 settings across the divergences and every divergence all 8 across
    the paths. Default-parameter divergences go by name on half the cases."""
    cases = []
    for i, div in enumerate(DIVS):
        for j, path in enumerate(PATHS):
            c = (3 * i + j) % 8
            spec = div
            if (i + j) % 2 == 0 and repr(div) in _DEFAULT_NAMES:
                spec = _DEFAULT_NAMES[repr(div)]
            setting = (BF16 if c & 1 else F32, 2.0 if c & 2 else 1.0,
                       "mean" if c & 4 else "none")
            cases.append(pytest.param(path, spec, *setting, id=(
                f"{path}-{spec if isinstance(spec, str) else repr(spec).replace(' ', '')}-"
                f"{'bf16' if c & 1 else 'fp32'}-T{int(setting[1])}-{setting[2]}")))
    return cases


@pytest.mark.parametrize("path,div,dtype,T,reduction", _matrix())
def test_divergence_matches_reference(path, div, dtype, T, reduction):
    d = _data(dtype, seed=1)
    mean = reduction == "mean"
    _check(path, d, div, T, dtype, None if mean else d["go"], reduction=reduction,
           mask=d["mask"] if mean else None)


# ------------------------------------------------------------------- 2. endpoints

def _all_results(d, div):
    """Loss and gradients of every path (fp32) for one divergence."""
    out = {}
    for path in PATHS:
        call, _ = _path(path, d, div, 1.5, reduction="none")
        leaves = _leaves(d["s"]) if path in LOGITS_PATHS else _leaves(d["h"], d["W"], d["b"])
        loss = call(*leaves)
        _backward(loss, d["go"])
        out[path] = (loss.detach(), [x.grad for x in leaves])
        mean_call, _ = _path(path, d, div, 1.5, reduction="mean", mask=d["mask"])
        leaves = _leaves(*leaves)
        loss = mean_call(*leaves)  # fused: the one-pass path
        loss.backward()
        out[path + "-mean"] = (loss.detach(), [x.grad for x in leaves])
    return out


@pytest.mark.parametrize("div,same_as", [
    (topkd.JSD(0.0), "kl"), (topkd.JSD(beta=1.0), "reverse_kl"),
])
def test_jsd_endpoints_are_exactly_kl(div, same_as):
    d = _data(seed=2)
    got, want = _all_results(d, div), _all_results(d, same_as)
    for key, (loss, grads) in got.items():
        assert torch.equal(loss, want[key][0]), f"{key}: {div!r} loss differs from {same_as}"
        for g, w in zip(grads, want[key][1], strict=True):
            assert torch.equal(g, w), f"{key}: {div!r} gradient differs from {same_as}"


@pytest.mark.parametrize("div,same_as", [
    (topkd.SkewKL(0.0), "kl"), (topkd.SkewReverseKL(alpha=0), "reverse_kl"),
])
def test_skew_at_zero_is_kl(div, same_as):
    """alpha = 0: the skew divergences are KL(q||p) / KL(p||q) (float32-close on the
    full-vocabulary path, exact where the buckets are differentiated by autograd)."""
    d = _data(seed=3)
    got, want = _all_results(d, div), _all_results(d, same_as)
    for key, (loss, grads) in got.items():
        assert_loss_close(loss, want[key][0].double(), rtol=1e-6, what=f"{key} {div!r}")
        for g, w in zip(grads, want[key][1], strict=True):
            assert grad_err(g, w.double()) <= 1e-6, f"{key}: {div!r} gradient"


@pytest.mark.parametrize("div,same_as", [
    (topkd.SkewKL(0.0), "kl"), (topkd.SkewReverseKL(0.0), "reverse_kl"),
])
@pytest.mark.parametrize("path", ["kl", "topk"])
def test_skew_at_zero_with_underflowing_probability(path, div, same_as):
    """One student (KL) / teacher (reverse KL) probability underflows float32 where the other
    side has mass: the divergence is large but finite, and alpha = 0 still equals KL."""
    s, t = _data(seed=4)["s"], _data(seed=4)["t"]
    s, t = s.clone(), t.clone()
    small, big = (s, t) if same_as == "kl" else (t, s)
    small[0, 0, 3], big[0, 0, 3] = -300.0, 12.0
    fn = {"kl": lambda s_, div_: topkd.kl_loss(s_, t, divergence=div_),
          "topk": lambda s_, div_: topkd.topk_kl_loss(s_, t, K, divergence=div_)}[path]
    want = fn(s, same_as)
    got = fn(s, div)
    assert torch.isfinite(want).all()
    assert torch.isfinite(got).all(), f"{path} {div!r}: {got[0, 0]} (KL: {want[0, 0]})"
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    l64, _ = ref.loss_and_grad(
        (lambda z: ref.full_loss(z, t, divergence=same_as)) if path == "kl" else
        (lambda z: ref.topk_loss(z, t, K, divergence=same_as)), s)
    assert_loss_close(got, l64)


@pytest.mark.parametrize("path", PATHS)
def test_skew_kl_at_one_is_zero(path):
    """SkewKL(1) = KL(q || q) = 0 exactly, with zero gradient, on every path."""
    d = _data(seed=5)
    for reduction in ("none", "mean"):
        call, _ = _path(path, d, topkd.SkewKL(alpha=1.0), 1.0, reduction=reduction)
        leaves = _leaves(d["s"]) if path in LOGITS_PATHS else _leaves(d["h"], d["W"], d["b"])
        loss = call(*leaves)
        _backward(loss, d["go"])
        assert torch.all(loss.detach() == 0), f"{reduction}: {loss.detach()}"
        for x in leaves:
            assert x.grad is None or torch.all(x.grad == 0), f"{reduction}: nonzero gradient"


# ------------------------------------------------------------------- 3. hard-label term

CE_PATHS = ["kl", "topk", "sparse_full", "fused_topk_logits", "fused_topk_pair",
            "fused_kl_pair"]


@pytest.mark.parametrize("reduction", ["none", "mean"])
@pytest.mark.parametrize("path", CE_PATHS)
def test_ce_term_and_components(path, reduction):
    """kd_weight * KD + ce_weight * CE with labels (some ignore_index) and a mask; "mean"
    averages KD over kept rows and CE over kept rows with a label; the components."""
    d = _data(seed=6)
    T = 1.7 if path != "sparse_full" else 1.0
    go = d["go"] if reduction == "none" else None
    opts = dict(labels=d["labels"], kd_weight=0.6, ce_weight=0.4, mask=d["mask"],
                reduction=reduction)
    loss = _check(path, d, topkd.JSD(0.3), T, F32, go, **opts)
    assert loss.requires_grad
    # the components, against the reference's
    call, rfn = _path(path, d, topkd.JSD(0.3), T, return_components=True, **opts)
    leaves = _leaves(d["s"]) if path in LOGITS_PATHS else _leaves(d["h"], d["W"], d["b"])
    parts = call(*leaves)
    assert isinstance(parts, topkd.LossParts)
    z = d["s"] if path in LOGITS_PATHS else ref.linear_logits(d["h"], d["W"], d["b"])
    rl, rkd, rce = rfn(z.double())
    for name, got, want in zip(("loss", "kd", "ce"), parts, (rl, rkd, rce), strict=True):
        assert_loss_close(got.detach(), want, what=name)
    for part in (parts.kd, parts.ce):
        assert part.dtype == F32 and not part.requires_grad
    torch.testing.assert_close(parts.loss.detach(), 0.6 * parts.kd + 0.4 * parts.ce,
                               rtol=1e-6, atol=1e-7)
    # "mean" takes each part over its own rows: here the two counts differ
    kept_ce = d["mask"] & (d["labels"] != -100)
    assert 0 < int(kept_ce.sum()) < int(d["mask"].sum())


@pytest.mark.parametrize("reduction", ["none", "mean"])
@pytest.mark.parametrize("path", CE_PATHS)
def test_all_labels_ignored(path, reduction):
    """No row has a label: CE is 0, and with kd_weight=0 the loss and gradients are 0."""
    d = _data(seed=7)
    d["labels"] = torch.full(LEAD, -100)
    call, _ = _path(path, d, "kl", 1.0, labels=d["labels"], kd_weight=0.0, ce_weight=1.0,
                    reduction=reduction, return_components=True)
    leaves = _leaves(d["s"]) if path in LOGITS_PATHS else _leaves(d["h"], d["W"], d["b"])
    loss, kd, ce = call(*leaves)
    assert torch.all(ce == 0) and torch.all(loss.detach() == 0)
    assert torch.all(kd > 0) if reduction == "none" else float(kd) > 0
    _backward(loss, d["go"])
    for x in leaves:
        assert x.grad is None or torch.all(x.grad == 0), "gradient without any label"


def _torch_ce(z, labels, ignore_index=-100):
    return F.cross_entropy(z.reshape(-1, V).float(), labels.reshape(-1),
                           ignore_index=ignore_index, reduction="mean")


@pytest.mark.parametrize("T", [1.0, 2.5])
@pytest.mark.parametrize("path", CE_PATHS)
def test_ce_equals_torch_cross_entropy(path, T):
    """kd_weight=0: the loss is F.cross_entropy at temperature 1, whatever the KD
    temperature (a SparseTeacher made at T too)."""
    d = _data(seed=8)
    if path == "sparse_full":
        path = "fused_topk_sparse" if T == 1.0 else path
    call, _ = _path(path, d, "kl", T, labels=d["labels"], kd_weight=0.0, ce_weight=1.0,
                    reduction="mean")
    if path in LOGITS_PATHS:
        (s,) = leaves = _leaves(d["s"])
        (s2,) = ref_leaves = _leaves(d["s"])
        want = _torch_ce(s2, d["labels"])
    else:
        leaves = _leaves(d["h"], d["W"], d["b"])
        ref_leaves = _leaves(d["h"], d["W"], d["b"])
        want = _torch_ce(F.linear(*ref_leaves), d["labels"])
    loss = call(*leaves)
    loss.backward()
    want.backward()
    assert_loss_close(loss.detach(), want.detach().double(), rtol=2e-6)
    for x, y in zip(leaves, ref_leaves, strict=True):
        assert_grad_close(x.grad, y.grad.double(), F32, tol=2e-6)


@pytest.mark.parametrize("ignore_index", [-1, 7])
@pytest.mark.parametrize("path", ["kl", "topk", "fused_topk_logits", "fused_kl_pair"])
def test_custom_ignore_index(path, ignore_index):
    d = _data(seed=9)
    labels = d["labels"].clone()
    labels[labels == -100] = ignore_index
    labels[2, 2] = ignore_index
    d["labels"] = labels
    for reduction in ("mean", "none"):
        go = None if reduction == "mean" else d["go"]
        _check(path, d, "kl", 1.0, F32, go, labels=labels, ignore_index=ignore_index,
               kd_weight=0.5, ce_weight=2.0, reduction=reduction)
    call, _ = _path(path, d, "kl", 1.0, labels=labels, ignore_index=ignore_index,
                    kd_weight=0.0, ce_weight=1.0, reduction="mean")
    leaves = _leaves(d["s"]) if path in LOGITS_PATHS else _leaves(d["h"], d["W"], d["b"])
    z = leaves[0] if path in LOGITS_PATHS else F.linear(*leaves)
    torch.testing.assert_close(call(*leaves), _torch_ce(z, labels, ignore_index),
                               rtol=2e-6, atol=0)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_one_hot_sparse_teacher_equals_labels_ce(reduction):
    """The "new user" trick: KL to a one-hot SparseTeacher (one index, ghost -inf) through
    fused_topk_kl_loss is the labels= cross entropy, loss and gradients."""
    d = _data(seed=10)
    labels, mask = d["labels"], d["labels"] != -100
    onehot = topkd.SparseTeacher(indices=labels.clamp_min(0)[..., None],
                                 logprobs=torch.zeros(*LEAD, 1),
                                 rest_logprob=torch.full(LEAD, -math.inf), temperature=1.0,
                                 vocab_size=V)
    go = None if reduction == "mean" else d["go"]
    a = _leaves(d["h"], d["W"], d["b"])
    kd = topkd.fused_topk_kl_loss(a[0], a[1], onehot, bias=a[2], mask=mask, reduction=reduction)
    _backward(kd, go)
    b = _leaves(d["h"], d["W"], d["b"])
    ce = topkd.fused_topk_kl_loss(b[0], b[1], onehot, bias=b[2], labels=labels, kd_weight=0.0,
                                  ce_weight=1.0, reduction=reduction)
    _backward(ce, go)
    c = _leaves(d["h"], d["W"], d["b"])
    want = F.cross_entropy(F.linear(*c).reshape(-1, V), labels.reshape(-1),
                           reduction="mean" if reduction == "mean" else "none")
    _backward(want if reduction == "mean" else want.reshape(LEAD), go)
    torch.testing.assert_close(kd, ce, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(kd.detach(), want.detach().reshape(kd.shape), rtol=2e-6,
                               atol=1e-7)
    for x, y, z in zip(a, b, c, strict=True):
        torch.testing.assert_close(x.grad, y.grad, rtol=1e-5, atol=1e-7)
        assert_grad_close(x.grad, z.grad.double(), F32, tol=2e-6)


def test_modules_take_labels_per_call():
    d = _data(seed=11)
    opts = dict(divergence=topkd.SkewKL(0.2), kd_weight=0.5, ce_weight=1.5, reduction="mean",
                return_components=True)
    s, t, h, w, b, lab = d["s"], d["t"], d["h"], d["W"], d["b"], d["labels"]
    pairs = [
        (topkd.TopKLogitsKLLoss(K, **opts)(s, t, d["mask"], lab),
         topkd.topk_kl_loss(s, t, K, mask=d["mask"], labels=lab, **opts)),
        (topkd.LogitsKLLoss(**opts)(s, t, labels=lab),
         topkd.kl_loss(s, t, labels=lab, **opts)),
        (topkd.FusedTopKLogitsKLLoss(K, **opts)(h, w, t, b, d["mask"], lab),
         topkd.fused_topk_kl_loss(h, w, t, K, bias=b, mask=d["mask"], labels=lab, **opts)),
        (topkd.FusedLogitsKLLoss(softcap=3.0, **opts)(h, w, (d["th"], d["tW"]), labels=lab),
         topkd.fused_kl_loss(h, w, (d["th"], d["tW"]), labels=lab, softcap=3.0, **opts)),
    ]
    for got, want in pairs:
        assert isinstance(got, topkd.LossParts)
        for x, y in zip(got, want, strict=True):
            assert torch.equal(x, y)


# ------------------------------------------------------- 4. softcap and logit scale (fused)

@pytest.mark.parametrize("reduction", ["none", "mean"])
@pytest.mark.parametrize("path,transforms", [
    ("fused_topk_pair", dict(logit_scale=0.6, softcap=4.0, teacher_logit_scale=1.5,
                             teacher_softcap=6.0)),
    ("fused_topk_logits", dict(logit_scale=-0.8, softcap=None, teacher_logit_scale=0.5)),
    ("fused_kl_pair", dict(logit_scale=1.7, softcap=5.0, teacher_softcap=3.0)),
    ("fused_kl_logits", dict(softcap=2.5)),
], ids=["topk-pair-both", "topk-logits-scale", "kl-pair-both", "kl-logits-softcap"])
@pytest.mark.parametrize("weights", [(1.0, 0.5), (0.0, 1.0)], ids=["kd+ce", "ce_only"])
def test_fused_transforms_match_reference(path, transforms, reduction, weights):
    d = _data(seed=12)
    student = {n: transforms[n] for n in ("logit_scale", "softcap") if n in transforms}
    go = d["go"] if reduction == "none" else None
    div = topkd.JSD(0.3)
    kw = dict(labels=d["labels"], kd_weight=weights[0], ce_weight=weights[1],
              reduction=reduction, mask=d["mask"] if reduction == "mean" else None)
    teacher_t = {n: transforms[n] for n in ("teacher_logit_scale", "teacher_softcap")
                 if n in transforms}
    call, _ = _path(path, d, div, 1.3, **kw, **transforms)
    _, rfn = _path(path, d, div, 1.3, **kw, **student, **teacher_t)  # same names in ref
    h, w, b = _leaves(d["h"], d["W"], d["b"])
    loss = call(h, w, b)
    _backward(loss, go)
    l64, rgrads, _ = _fused_reference(rfn, d["h"], d["W"], d["b"], go)
    assert_loss_close(loss.detach(), l64)
    _check_fused_grads([h.grad, w.grad, b.grad], rgrads, None, f"{path} {transforms}")
    if weights[0] == 0.0:  # CE alone: torch's cross entropy of the transformed logits
        z = F.linear(d["h"], d["W"], d["b"]) * transforms.get("logit_scale", 1.0)
        if transforms.get("softcap") is not None:
            z = transforms["softcap"] * torch.tanh(z / transforms["softcap"])
        ce = F.cross_entropy(z.reshape(-1, V), d["labels"].reshape(-1), reduction="none")
        keep = (d["labels"] != -100) & (d["mask"] if reduction == "mean" else True)
        ce = ce.reshape(LEAD) * keep
        want = ce.sum() / keep.sum() if reduction == "mean" else ce
        torch.testing.assert_close(loss.detach(), want, rtol=2e-6, atol=1e-6)


# ------------------------------------------------------------------ 5. second backward

def _second_backward_cases():
    d = _data(seed=13)
    t, lab = d["t"], d["labels"]
    opts = dict(labels=lab, ce_weight=0.5, divergence=topkd.JSD(0.4))
    return {
        "kl_logits_none": (lambda s: topkd.kl_loss(s, t, **opts), ["s"], "none"),
        "topk_logits_mean": (lambda s: topkd.topk_kl_loss(s, t, K, reduction="mean", **opts),
                             ["s"], "mean"),
        "fused_topk_one_pass_mean": (lambda h, w, b: topkd.fused_topk_kl_loss(
            h, w, t, K, bias=b, reduction="mean", **opts), ["h", "W", "b"], "mean"),
        "fused_kl_one_pass_sum": (lambda h, w, b: topkd.fused_kl_loss(
            h, w, (d["th"], d["tW"]), bias=b, reduction="sum", **opts), ["h", "W", "b"], "sum"),
        "fused_kl_two_pass_none": (lambda h, w, b: topkd.fused_kl_loss(
            h, w, t, bias=b, **opts), ["h", "W", "b"], "none"),
        "fused_topk_two_pass_none": (lambda h, w, b: topkd.fused_topk_kl_loss(
            h, w, (d["th"], d["tW"], d["tb"]), K, bias=b, **opts), ["h", "W", "b"], "none"),
    }, d


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("case", list(_second_backward_cases()[0]))
def test_second_backward(case, dtype):
    cases, d = _second_backward_cases()
    fn, names, reduction = cases[case]
    inputs = _leaves(*(d[n].to(dtype) for n in names))
    loss = fn(*inputs)
    go = d["go"] if reduction == "none" else torch.ones(())
    # .backward twice accumulates exactly twice the gradient
    loss.backward(go, retain_graph=True)
    first = [x.grad.clone() for x in inputs]
    loss.backward(go, retain_graph=True)
    for x, g in zip(inputs, first, strict=True):
        assert torch.equal(x.grad, g + g), f"{case}: second backward differs"
    # autograd.grad twice: equal results that share no memory
    g1 = torch.autograd.grad(loss, inputs, go, retain_graph=True)
    snapshot = [g.clone() for g in g1]
    for g, x in zip(g1, first, strict=True):
        assert torch.equal(g, x)
        g.mul_(-3.0).add_(1.0)  # the caller owns what it got
    g2 = torch.autograd.grad(loss, inputs, go)
    for a, b, s in zip(g1, g2, snapshot, strict=True):
        assert torch.equal(b, s), f"{case}: second gradient changed by editing the first"
        assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    ptrs = [g.untyped_storage().data_ptr() for g in g2] + [
        x.grad.untyped_storage().data_ptr() for x in inputs]
    assert len(set(ptrs)) == len(ptrs), f"{case}: gradients share storage"


# ------------------------------------------------------------ 6. mixed dtypes (fused)

@pytest.mark.parametrize("reduction", ["none", "mean"])
@pytest.mark.parametrize("loss_name", ["topk", "kl"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_bf16_hidden_fp32_weight(loss_name, reduction, bias):
    """Autocast's mix: bf16 hidden, fp32 weight (and bias). The products run in bf16, the
    loss is the unfused loss of F.linear(hidden, weight.bfloat16(), bias.bfloat16()), the
    hidden gradient is bf16 and the weight's (bias's) float32, at least as accurate as
    PyTorch's unfused autocast chain rule."""
    d = _data(seed=14)
    hb = d["h"].bfloat16()
    t = d["t"]
    go = d["go"] if reduction == "none" else None
    opts = dict(reduction=reduction, divergence=topkd.JSD(0.7), labels=d["labels"],
                ce_weight=0.3)
    h, w, b = _leaves(hb, d["W"], d["b"] if bias else None)
    if loss_name == "topk":
        out = topkd.fused_topk_kl_loss(h, w, t, K, bias=b, **opts)
        rfn = lambda z: ref.topk_loss(z, t, K, **opts)  # noqa: E731
        unfused_fn = lambda z: topkd.topk_kl_loss(z, t, K, **opts)  # noqa: E731
    else:
        out = topkd.fused_kl_loss(h, w, t, bias=b, **opts)
        rfn = lambda z: ref.full_loss(z, t, **opts)  # noqa: E731
        unfused_fn = lambda z: topkd.kl_loss(z, t, **opts)  # noqa: E731
    _backward(out, go)
    assert h.grad.dtype == BF16 and w.grad.dtype == F32
    assert b is None or b.grad.dtype == F32
    # vs the unfused topkd loss on the bf16 logits
    lb = b.detach().bfloat16() if bias else None
    zb = F.linear(hb, d["W"].bfloat16(), lb)
    unfused = unfused_fn(zb)
    assert_loss_close(out.detach(), unfused.detach().double(),
                      atol=LOSS_RTOL * float(unfused.abs().mean()))
    # vs the float64 chain rule through those bf16 logits
    l64, dz = ref.loss_and_grad(rfn, zb, grad_output=go)
    assert_loss_close(out.detach(), l64)
    dz2 = dz.reshape(-1, V)
    want = [(dz2 @ d["W"].bfloat16().double()).reshape(hb.shape),
            dz2.T @ hb.double().reshape(-1, H), dz2.sum(0)]
    # PyTorch's autocast path: fp32 leaves, bf16 casts, bf16 products, exact dz
    ah, aw, ab = _leaves(hb, d["W"], d["b"] if bias else None)
    z = F.linear(ah, aw.bfloat16(), None if ab is None else ab.bfloat16())
    r = rfn(z.double())
    r.backward(go.double() if r.dim() else None)
    got = (h.grad, w.grad, None if b is None else b.grad)
    for name, g, wnt, u in zip(("hidden", "weight", "bias"), got, want,
                               (ah.grad, aw.grad, None if ab is None else ab.grad),
                               strict=True):
        if u is None:
            continue
        e, eu = grad_err(g, wnt), grad_err(u, wnt)
        assert e <= 1.25 * eu + 1e-5, f"{name}: {e:.2e} vs autocast unfused {eu:.2e}"


@pytest.mark.parametrize("hd,wd", [(BF16, torch.float16), (torch.float16, BF16)])
def test_bf16_with_fp16_is_a_type_error(hd, wd):
    d = _data(seed=15)
    for call in (lambda: topkd.fused_topk_kl_loss(d["h"].to(hd), d["W"].to(wd), d["t"], K),
                 lambda: topkd.fused_kl_loss(d["h"].to(hd), d["W"].to(wd), d["t"])):
        with pytest.raises(TypeError, match=r"weight\.to\(hidden\.dtype\)"):
            call()


# --------------------------------------------------------------------- 7. bad inputs

ERR = (ValueError, TypeError)
def _entries(d, st):
    s, t, h, w = d["s"], d["t"], d["h"], d["W"]
    pair = (d["th"], d["tW"])
    return {
        "sparse_kl_loss": lambda **kw: topkd.sparse_kl_loss(s, st, **kw),
        "topk_kl_loss": lambda **kw: topkd.topk_kl_loss(s, t, K, **kw),
        "kl_loss": lambda **kw: topkd.kl_loss(s, t, **kw),
        "fused_topk_kl_loss": lambda **kw: topkd.fused_topk_kl_loss(h, w, t, K, **kw),
        "fused_topk_sparse": lambda **kw: topkd.fused_topk_kl_loss(h, w, st, **kw),
        "fused_kl_loss": lambda **kw: topkd.fused_kl_loss(h, w, pair, **kw),
        "TopKLogitsKLLoss": lambda **kw: _module(topkd.TopKLogitsKLLoss, (K,), kw)(s, t),
        "FusedLogitsKLLoss": lambda **kw: _module(topkd.FusedLogitsKLLoss, (), kw)(h, w, pair),
    }


def _module(cls, args, kw):
    """Options to the constructor, labels/mask to the call (so errors may come from either)."""
    per_call = {n: kw.pop(n) for n in ("labels", "mask") if n in kw}
    m = cls(*args, **kw)
    return lambda *inputs: m(*inputs, **per_call)


_labels_bad = torch.zeros(LEAD, dtype=torch.long)
_labels_bad[1, 1] = V
_labels_neg = torch.zeros(LEAD, dtype=torch.long)
_labels_neg[2, 4] = -5
_labels_m100 = torch.full(LEAD, -100)

BAD = {  # name: (exception, regex naming the argument and value, options, entries or None=all)
    "divergence_name": (ValueError, r"divergence.*'jensen'", dict(divergence="jensen"), None),
    "divergence_type": (TypeError, r"divergence.*KLDivLoss",
                        dict(divergence=torch.nn.KLDivLoss()), None),
    "divergence_class": (TypeError, r"divergence.*type", dict(divergence=topkd.JSD), None),
    "reverse_jsd": (ValueError, r"reverse=True.*JSD", dict(divergence="jsd", reverse=True),
                    None),
    "reverse_tvd": (ValueError, r"reverse=True.*TVD", dict(divergence=topkd.TVD(),
                                                           reverse=True), None),
    "labels_shape": (ValueError, r"labels.*\(3,\)", dict(labels=torch.zeros(3, dtype=torch.long)),
                     None),
    "labels_float": (TypeError, r"labels.*float32", dict(labels=torch.zeros(LEAD)), None),
    "labels_bool": (TypeError, r"labels.*bool", dict(labels=torch.zeros(LEAD, dtype=torch.bool)),
                    None),
    "labels_V": (ValueError, rf"labels.*\[{V}\]", dict(labels=_labels_bad), None),
    "labels_negative": (ValueError, r"labels.*\[-5\]", dict(labels=_labels_neg), None),
    "labels_other_ignore": (ValueError, r"labels.*ignore_index=-1.*-100",
                            dict(labels=_labels_m100, ignore_index=-1), None),
    "ce_without_labels": (ValueError, r"ce_weight=0\.5.*labels", dict(ce_weight=0.5), None),
    "kd_weight_negative": (ValueError, r"kd_weight.*-1\.0", dict(kd_weight=-1.0), None),
    "ce_weight_nan": (ValueError, r"ce_weight.*nan",
                      dict(ce_weight=float("nan"), labels=_labels_m100), None),
    "kd_weight_str": (TypeError, r"kd_weight.*'1'", dict(kd_weight="1"), None),
    "ignore_index_float": (TypeError, r"ignore_index.*1\.5", dict(ignore_index=1.5), None),
    "softcap_zero": (ValueError, r"softcap.*0\.0", dict(softcap=0.0), "fused"),
    "softcap_negative": (ValueError, r"softcap.*-1\.0", dict(softcap=-1.0), "fused"),
    "teacher_softcap": (ValueError, r"teacher_softcap.*-2\.0", dict(teacher_softcap=-2.0),
                        "fused"),
    "logit_scale_zero": (ValueError, r"logit_scale.*0\.0", dict(logit_scale=0), "fused"),
    "teacher_logit_scale_inf": (ValueError, r"teacher_logit_scale.*inf",
                                dict(teacher_logit_scale=math.inf), "fused"),
    "temperature_vs_sparse": (ValueError, r"temperature=2\.0.*1\.0", dict(temperature=2.0),
                              "sparse"),
}
_GROUPS = {"fused": ["fused_topk_kl_loss", "fused_topk_sparse", "fused_kl_loss",
                     "FusedLogitsKLLoss"],
           "sparse": ["sparse_kl_loss", "fused_topk_sparse"]}
ENTRY_NAMES = list(_entries(_data(), None))


def _bad_cases():
    for name, (_, _, _, group) in BAD.items():
        for entry in (ENTRY_NAMES if group is None else _GROUPS[group]):
            yield pytest.param(name, entry, id=f"{name}-{entry}")


@pytest.mark.parametrize("name,entry", list(_bad_cases()))
def test_bad_input_raises_before_work(name, entry):
    exc, match, opts, _ = BAD[name]
    d = _data(seed=16)
    for n in ("s", "h", "W"):
        d[n] = d[n].clone().requires_grad_(True)
    st = topkd.select_topk(d["t"], K)
    call = _entries(d, st)[entry]
    rec = WorkRecorder()
    with rec, pytest.raises(exc, match=match) as e:
        call(**dict(opts))
    assert not rec.calls, f"work done before {e.value!r}: {rec.calls}"
    assert all(d[n].grad is None for n in ("s", "h", "W"))


@pytest.mark.parametrize("make,match", [
    (lambda: topkd.JSD(beta=1.5), r"beta.*1\.5"),
    (lambda: topkd.JSD(-0.5), r"beta.*-0\.5"),
    (lambda: topkd.SkewKL(alpha=-0.1), r"alpha.*-0\.1"),
    (lambda: topkd.SkewReverseKL(alpha=2), r"alpha.*2"),
    (lambda: topkd.SkewKL(alpha=math.nan), r"alpha.*nan"),
    (lambda: topkd.JSD(beta="0.5"), r"beta.*'0\.5'"),
    (lambda: topkd.SkewReverseKL(alpha=True), r"alpha.*True"),
], ids=["jsd1.5", "jsd-0.5", "skew-0.1", "skewrev2", "skew_nan", "jsd_str", "skewrev_bool"])
def test_bad_divergence_parameters(make, match):
    with pytest.raises(ERR, match=match):
        make()


@pytest.mark.parametrize("make,exc,match", [
    (lambda: topkd.TopKLogitsKLLoss(K, divergence="nope"), ValueError, r"divergence.*'nope'"),
    (lambda: topkd.LogitsKLLoss(divergence=3), TypeError, r"divergence.*int"),
    (lambda: topkd.FusedTopKLogitsKLLoss(K, divergence="jsd", reverse=True), ValueError,
     r"reverse"),
    (lambda: topkd.FusedLogitsKLLoss(divergence=topkd.KL), TypeError, r"divergence"),
    (lambda: topkd.LogitsKLLoss(kd_weight=-2), ValueError, r"kd_weight.*-2"),
    (lambda: topkd.FusedTopKLogitsKLLoss(K, softcap=0.0), ValueError, r"softcap.*0\.0"),
    (lambda: topkd.FusedLogitsKLLoss(logit_scale=0), ValueError, r"logit_scale.*0"),
], ids=["topk_name", "logits_int", "fused_reverse_jsd", "fused_class", "kd_weight",
        "fused_softcap", "fused_logit_scale"])
def test_module_construction_rejects_bad_options(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


# ------------------------------------------------------------- 8. a user's divergence

class SquaredHellinger(topkd.Divergence):
    """``sum (sqrt(q) - sqrt(p))^2``: only ``pointwise``, nothing else."""

    name = "squared_hellinger"

    def pointwise(self, logp, logq):
        return (torch.exp(0.5 * logq) - torch.exp(0.5 * logp)) ** 2


def _hellinger_ref(z, t, k, T, mask, reduction):
    """By hand, float64: log-softmax at T; for Top-K the K teacher-largest entries (ties to
    the lower index) plus one ghost bucket of everything else, for both distributions."""
    lp = torch.log_softmax(z.double() / T, -1).reshape(-1, V)
    lq = torch.log_softmax(t.double() / T, -1).reshape(-1, V)
    if k is not None:
        order = torch.sort(-t.double().reshape(-1, V), dim=-1, stable=True).indices
        kept = torch.zeros_like(lq, dtype=torch.bool).scatter_(-1, order[:, :k], True)
        neg = torch.full_like(lq, -math.inf)
        lp = torch.cat([torch.where(kept, lp, neg),
                        torch.logsumexp(torch.where(kept, neg, lp), -1, keepdim=True)], -1)
        lq = torch.cat([torch.where(kept, lq, neg),
                        torch.logsumexp(torch.where(kept, neg, lq), -1, keepdim=True)], -1)
    rows = ((lq / 2).exp() - (lp / 2).exp()).pow(2).sum(-1).reshape(LEAD)
    if mask is not None:
        rows = rows * mask
    if reduction == "none":
        return rows
    return rows.sum() / (rows.numel() if mask is None else mask.sum())


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("reduction", ["none", "mean"])
@pytest.mark.parametrize("path", ["kl", "topk", "fused_kl_logits", "fused_topk_logits"])
def test_custom_divergence_is_one_class(path, reduction, dtype):
    d = _data(dtype, seed=17)
    T = 1.5
    mask = d["mask"] if reduction == "mean" else None
    go = d["go"] if reduction == "none" else None
    k = K if "topk" in path else None
    div = SquaredHellinger()
    opts = dict(divergence=div, temperature=T, mask=mask, reduction=reduction)
    t = d["t"]
    rfn = lambda z: _hellinger_ref(z, t, k, T, mask, reduction)  # noqa: E731
    if path in ("kl", "topk"):
        (s,) = _leaves(d["s"])
        loss = (topkd.kl_loss(s, t, **opts) if k is None else
                topkd.topk_kl_loss(s, t, k, **opts))
        _backward(loss, go)
        l64, g64 = ref.loss_and_grad(rfn, d["s"], grad_output=go)
        assert_loss_close(loss.detach(), l64)
        assert_grad_close(s.grad, g64, dtype)
        assert float(loss.detach().abs().max()) > 0.01  # not vacuous
        # the module form too
        mod_opts = {n: v for n, v in opts.items() if n != "mask"}
        mod = (topkd.LogitsKLLoss(**mod_opts) if k is None else
               topkd.TopKLogitsKLLoss(k, **mod_opts))
        assert torch.equal(mod(d["s"], t, mask), loss.detach())
    else:
        h, w, b = _leaves(d["h"], d["W"], d["b"])
        loss = (topkd.fused_kl_loss(h, w, t, bias=b, **opts) if k is None else
                topkd.fused_topk_kl_loss(h, w, t, k, bias=b, **opts))
        _backward(loss, go)
        l64, rgrads, unfused = _fused_reference(rfn, d["h"], d["W"], d["b"], go)
        assert_loss_close(loss.detach(), l64)
        _check_fused_grads([h.grad, w.grad, b.grad], rgrads, unfused, f"{path} hellinger")

