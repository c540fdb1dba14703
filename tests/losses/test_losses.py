"""topk_kl_loss / sparse_kl_loss / kl_loss against the float64 reference: loss and gradient."""

import pytest
import reference as ref
import torch
from helpers import assert_grad_close, assert_loss_close, logits, run, run_view

import topkd

V = 512
LEAD = (3, 4)

TOPK_CASES = [
    # (k, options)
    (1, {}),
    (5, {}),
    (200, {}),
    (V, {}),
    (1, {"reverse": True}),
    (5, {"reverse": True}),
    (200, {"reverse": True}),
    (V, {"reverse": True}),
    (37, {"temperature": 0.5}),
    (37, {"temperature": 2.0}),
    (37, {"temperature": 0.7, "reverse": True}),
    (64, {"top_p": 0.6}),
    (64, {"top_p": 0.6, "top_p_min_k": 8}),
    (64, {"top_p": 0.05, "top_p_min_k": 3}),
    (64, {"top_p": 0.8, "reverse": True, "temperature": 0.7}),
    (64, {"top_p": 1.0}),
    (1, {"normalize": "topk"}),
    (20, {"normalize": "topk"}),
    (20, {"normalize": "topk", "reverse": True, "temperature": 1.3}),
    (64, {"normalize": "topk", "top_p": 0.6, "top_p_min_k": 2}),
]


def _ids(case):
    k, opts = case
    return f"k{k}-" + "-".join(f"{a}={b}" for a, b in opts.items())


def _inputs(dtype=torch.float32, seed=0, lead=LEAD, v=V):
    s = logits(*lead, v, scale=2.0, dtype=dtype, seed=seed)
    t = logits(*lead, v, scale=2.5, dtype=dtype, seed=seed + 100)
    g = torch.randn(*lead, generator=torch.Generator().manual_seed(seed + 7))
    return s, t, g


def _check_top_p_margin(t, k, opts):
    if opts.get("top_p") is None:
        return
    sel = ref.select(t, k, top_p=opts["top_p"], top_p_min_k=opts.get("top_p_min_k", 1),
                     temperature=opts.get("temperature", 1.0), vocab_size=opts.get("vocab_size"))
    m = ref.top_p_margin(sel, opts["top_p"], opts.get("top_p_min_k", 1))
    assert m > 1e-5, f"test input too close to a top-p boundary ({m})"


@pytest.mark.parametrize("case", TOPK_CASES, ids=_ids)
def test_topk_kl_loss_matches_reference(case):
    k, opts = case
    s, t, g = _inputs()
    if opts.get("top_p") not in (None, 1.0):
        _check_top_p_margin(t, k, opts)
    loss, grad = run(topkd.topk_kl_loss, s, t, k, grad_output=g, **opts)
    rl, rg = ref.loss_and_grad(ref.topk_loss, s, t, k, grad_output=g, **opts)
    assert_loss_close(loss, rl)
    assert_grad_close(grad, rg, torch.float32)


@pytest.mark.parametrize("case", TOPK_CASES[::2], ids=_ids)
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_topk_kl_loss_reductions_match_reference(case, reduction):
    k, opts = case
    s, t, _ = _inputs(seed=3)
    loss, grad = run(topkd.topk_kl_loss, s, t, k, reduction=reduction, **opts)
    rl, rg = ref.loss_and_grad(ref.topk_loss, s, t, k, reduction=reduction, **opts)
    assert loss.dim() == 0
    assert_loss_close(loss, rl)
    assert_grad_close(grad, rg, torch.float32)


@pytest.mark.parametrize("case", TOPK_CASES, ids=_ids)
def test_sparse_kl_loss_is_topk_kl_loss_of_select_topk(case):
    k, opts = case
    s, t, g = _inputs(seed=1)
    sel_opts = {a: opts[a] for a in ("top_p", "top_p_min_k", "temperature") if a in opts}
    loss_opts = {a: opts[a] for a in ("reverse", "normalize") if a in opts}
    teacher = topkd.select_topk(t, k, **sel_opts)
    l1, g1 = run(topkd.sparse_kl_loss, s, teacher, grad_output=g, **loss_opts)
    l2, g2 = run(topkd.topk_kl_loss, s, t, k, grad_output=g, **opts)
    # topk_kl_loss(s, t, k, ...) *is* sparse_kl_loss(s, select_topk(t, k, ...), ...)
    assert torch.equal(l1, l2)
    assert torch.equal(g1, g2)
    # and the offline path against the reference too
    r = ref.select(t, k, **sel_opts)
    rl, rg = ref.loss_and_grad(ref.sparse_loss, s, r, grad_output=g,
                               temperature=opts.get("temperature", 1.0), **loss_opts)
    assert_loss_close(l1, rl)
    assert_grad_close(g1, rg, torch.float32)


@pytest.mark.parametrize("temperature", [1.0, 0.6, 2.5])
@pytest.mark.parametrize("reverse", [False, True])
def test_kl_loss_matches_reference(temperature, reverse):
    s, t, g = _inputs(seed=2)
    loss, grad = run(topkd.kl_loss, s, t, grad_output=g, temperature=temperature,
                     reverse=reverse)
    rl, rg = ref.loss_and_grad(ref.full_loss, s, t, grad_output=g, temperature=temperature,
                               reverse=reverse)
    assert_loss_close(loss, rl)
    assert_grad_close(grad, rg, torch.float32)


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.8])
def test_k_equals_v_is_kl_loss(reverse, temperature):
    s, t, g = _inputs(seed=4)
    l1, g1 = run(topkd.topk_kl_loss, s, t, V, grad_output=g, reverse=reverse,
                 temperature=temperature)
    l2, g2 = run(topkd.kl_loss, s, t, grad_output=g, reverse=reverse, temperature=temperature)
    torch.testing.assert_close(l1, l2, rtol=2e-6, atol=1e-7)
    ge = float((g1 - g2).abs().max() / g2.abs().max())
    assert ge <= 2e-6, ge


@pytest.mark.parametrize("fn", ["topk", "kl"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("reverse", [False, True])
def test_low_precision_inputs(fn, dtype, reverse):
    s, t, g = _inputs(dtype=dtype, seed=5)
    if fn == "topk":
        opts = dict(top_p=0.85, top_p_min_k=4, temperature=0.9, reverse=reverse)
        _check_top_p_margin(t, 100, opts)
        loss, grad = run(topkd.topk_kl_loss, s, t, 100, grad_output=g, **opts)
        rl, rg = ref.loss_and_grad(ref.topk_loss, s, t, 100, grad_output=g, **opts)
    else:
        loss, grad = run(topkd.kl_loss, s, t, grad_output=g, reverse=reverse)
        rl, rg = ref.loss_and_grad(ref.full_loss, s, t, grad_output=g, reverse=reverse)
    assert_loss_close(loss, rl)
    assert_grad_close(grad, rg, dtype)


@pytest.mark.parametrize("fn", ["topk", "kl"])
def test_mixed_dtypes(fn):
    s, _, g = _inputs(dtype=torch.bfloat16, seed=6)
    _, t, _ = _inputs(dtype=torch.float32, seed=6)
    if fn == "topk":
        loss, grad = run(topkd.topk_kl_loss, s, t, 50, grad_output=g)
        rl, rg = ref.loss_and_grad(ref.topk_loss, s, t, 50, grad_output=g)
    else:
        loss, grad = run(topkd.kl_loss, s, t, grad_output=g)
        rl, rg = ref.loss_and_grad(ref.full_loss, s, t, grad_output=g)
    assert_loss_close(loss, rl)
    assert_grad_close(grad, rg, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fn", ["topk", "kl", "sparse"])
def test_noncontiguous_sbv_view(dtype, fn):
    # Megatron layout: a transposed [S, B, V] view of [B, S, V] storage.
    b_, s_ = 3, 5
    sb = logits(b_, s_, V, dtype=dtype, seed=8)
    tb = logits(b_, s_, V, dtype=dtype, seed=9, scale=2.5)
    t = tb.transpose(0, 1)
    assert not t.is_contiguous()
    g = torch.randn(s_, b_)
    view = lambda x: x.transpose(0, 1)  # noqa: E731
    opts = dict(temperature=1.1, top_p=0.95)
    if fn == "topk":
        loss, grad = run_view(topkd.topk_kl_loss, sb, view, t, 33, grad_output=g, **opts)
    elif fn == "sparse":
        teacher = topkd.select_topk(t, 33, **opts)
        loss, grad = run_view(topkd.sparse_kl_loss, sb, view, teacher, grad_output=g)
    else:
        loss, grad = run_view(topkd.kl_loss, sb, view, t, grad_output=g, temperature=1.1)
    assert loss.shape == (s_, b_)
    # reference on the same (transposed) values
    if fn == "kl":
        rl, rg = ref.loss_and_grad(ref.full_loss, sb.transpose(0, 1), t, grad_output=g,
                                   temperature=1.1)
    else:
        _check_top_p_margin(t, 33, opts)
        rl, rg = ref.loss_and_grad(ref.topk_loss, sb.transpose(0, 1), t, 33, grad_output=g, **opts)
    rg = rg.transpose(0, 1)  # back to the leaf's [B, S, V] layout
    assert_loss_close(loss, rl)
    assert_grad_close(grad, rg, dtype)


def test_noncontiguous_vocab_stride():
    # a view whose last dimension is strided
    s_full = logits(6, 2 * V, seed=10)
    t = logits(6, 2 * V, seed=11, scale=2.5)[:, ::2]
    view = lambda x: x[:, ::2]  # noqa: E731
    loss, grad = run_view(topkd.topk_kl_loss, s_full, view, t, 40)
    rl, rg = ref.loss_and_grad(ref.topk_loss, s_full[:, ::2], t, 40)
    assert_loss_close(loss, rl)
    assert grad.shape == s_full.shape
    assert torch.all(grad[:, 1::2] == 0)
    assert_grad_close(grad[:, ::2].contiguous(), rg, torch.float32)


@pytest.mark.parametrize("fn", ["topk", "kl", "sparse"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vocab_size_padding(fn, dtype):
    w, v = 640, 600
    s, t, g = _inputs(dtype=dtype, seed=12, v=w)
    # padding columns hold values that would dominate if they were looked at
    s[..., v:] = 30.0
    t[..., v:] = 30.0
    if fn == "topk":
        opts = dict(top_p=0.9, reverse=True)
        _check_top_p_margin(t, 64, dict(opts, vocab_size=v))
        loss, grad = run(topkd.topk_kl_loss, s, t, 64, grad_output=g, vocab_size=v, **opts)
        rl, rg = ref.loss_and_grad(ref.topk_loss, s, t, 64, grad_output=g, vocab_size=v, **opts)
    elif fn == "sparse":
        teacher = topkd.select_topk(t, 64, vocab_size=v)
        assert teacher.vocab_size == v
        loss, grad = run(topkd.sparse_kl_loss, s, teacher, grad_output=g, vocab_size=v)
        rl, rg = ref.loss_and_grad(ref.topk_loss, s, t, 64, grad_output=g, vocab_size=v)
    else:
        loss, grad = run(topkd.kl_loss, s, t, grad_output=g, vocab_size=v)
        rl, rg = ref.loss_and_grad(ref.full_loss, s, t, grad_output=g, vocab_size=v)
    assert_loss_close(loss, rl)
    assert grad.shape == s.shape
    assert torch.all(grad[..., v:] == 0), "gradient past vocab_size must be exactly zero"
    assert_grad_close(grad, rg, dtype)


@pytest.mark.parametrize("fn", ["topk", "kl"])
def test_different_widths_with_vocab_size_inside_both(fn):
    # e.g. 151,936 vs 152,064 in the wild; vocab_size fits inside both widths
    s = logits(5, 136, seed=13)
    t = logits(5, 128, seed=14, scale=2.5)
    v = 120
    if fn == "topk":
        loss, grad = run(topkd.topk_kl_loss, s, t, 9, vocab_size=v)
        rl, rg = ref.loss_and_grad(ref.topk_loss, s, t[:, :v], 9, vocab_size=v)
    else:
        loss, grad = run(topkd.kl_loss, s, t, vocab_size=v)
        rl, rg = ref.loss_and_grad(ref.full_loss, s, t[:, :v], vocab_size=v)
    assert_loss_close(loss, rl)
    assert torch.all(grad[:, v:] == 0)
    assert_grad_close(grad, rg, torch.float32)


def test_teacher_gets_no_gradient():
    s, t, _ = _inputs(seed=15)
    t = t.clone().requires_grad_(True)
    for fn in (lambda a, b: topkd.topk_kl_loss(a, b, 10, reduction="sum"),
               lambda a, b: topkd.kl_loss(a, b, reduction="sum")):
        sl = s.clone().requires_grad_(True)
        loss = fn(sl, t)
        loss.backward()
        assert t.grad is None or torch.all(t.grad == 0)
        assert sl.grad is not None


def test_sparse_teacher_carries_temperature():
    # the student is scaled by the SparseTeacher's temperature
    s, t, g = _inputs(seed=16)
    teacher = topkd.select_topk(t, 30, temperature=0.6)
    loss, grad = run(topkd.sparse_kl_loss, s, teacher, grad_output=g)
    rl, rg = ref.loss_and_grad(ref.topk_loss, s, t, 30, grad_output=g, temperature=0.6)
    assert_loss_close(loss, rl)
    assert_grad_close(grad, rg, torch.float32)


def test_loss_shapes_and_dtypes():
    for lead in [(7,), (2, 3), (2, 1, 3)]:
        s, t, _ = _inputs(lead=lead, seed=17, dtype=torch.bfloat16)
        for fn in (lambda a, b, **kw: topkd.topk_kl_loss(a, b, 5, **kw), topkd.kl_loss):
            assert fn(s, t).shape == lead
            assert fn(s, t).dtype == torch.float32
            assert fn(s, t, reduction="sum").shape == ()
            assert fn(s, t, reduction="mean").shape == ()
            assert fn(s, t, reduction="mean").dtype == torch.float32


@pytest.mark.parametrize("opts", [dict(), dict(top_p=0.862, reverse=True, temperature=1.2)],
                         ids=["plain", "top_p-reverse-T"])
def test_larger_shape_many_chunks(opts):
    # a few thousand columns, K in the thousands, many chunks (top_p picked so that no prefix
    # sum of the 40 x 1024 selected entries lies within 1e-5 of it)
    n, v, k = 40, 3000, 1024
    s = logits(n, v, dtype=torch.bfloat16, seed=20)
    t = logits(n, v, dtype=torch.bfloat16, seed=21, scale=3.0)
    gout = torch.randn(n)
    if "top_p" in opts:
        _check_top_p_margin(t, k, opts)
    loss, grad = run(topkd.topk_kl_loss, s, t, k, grad_output=gout, chunk_bytes=50_000, **opts)
    rl, rg = ref.loss_and_grad(ref.topk_loss, s, t, k, grad_output=gout, **opts)
    assert_loss_close(loss, rl)
    assert_grad_close(grad, rg, torch.bfloat16)
