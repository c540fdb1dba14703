"""The hard numerical cases: exact ghost for a peaky teacher, invariance to a 2**20 offset,
bit-identical results under ties for any chunk_bytes, teacher -inf entries."""

import pytest
import reference as ref
import torch
from helpers import assert_grad_close, assert_loss_close, logits, run

import topkd

# ---------------------------------------------------------------- peaky teacher, exact ghost


def _peaky(n=8, v=1000, k=16, seed=0):
    """Teacher whose top-k hold all but ~1e-13 of the mass (log q_g ~ -30)."""
    g = torch.Generator().manual_seed(seed)
    t = torch.full((n, v), -34.0)
    t[:, :k] = torch.rand(n, k, generator=g)
    t[:, k:] += torch.rand(n, v - k, generator=g)
    perm = torch.randperm(v, generator=g)
    return t[:, perm].contiguous()


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("normalize", ["full"])
def test_peaky_teacher_ghost_is_exact(reverse, normalize):
    n, v, k = 8, 1000, 16
    t = _peaky(n, v, k)
    s = logits(n, v, seed=1)
    r = ref.select(t, k)
    assert float(r["rest_logprob"].max()) < -25
    st = topkd.select_topk(t, k)
    # log q_g ~ -30 to float32 accuracy; log1p(-sum q) in float32 gives ~-16 or -inf
    torch.testing.assert_close(st.rest_logprob.double(), r["rest_logprob"], rtol=1e-6, atol=0)
    gout = torch.randn(n)
    loss, grad = run(topkd.topk_kl_loss, s, t, k, grad_output=gout, reverse=reverse)
    rl, rg = ref.loss_and_grad(ref.topk_loss, s, t, k, grad_output=gout, reverse=reverse)
    # Reverse KL weights log q_g by the student's O(1) ghost mass p_g: any error in log q_g
    # shows up directly in the loss.
    assert_loss_close(loss, rl, rtol=1e-5)
    assert_grad_close(grad, rg, torch.float32)
    loss2, _ = run(topkd.sparse_kl_loss, s, st, grad_output=gout, reverse=reverse)
    assert_loss_close(loss2, rl, rtol=1e-5)


def test_peaky_teacher_ghost_is_exact_with_top_p():
    # top-p drops the last entries of a peaky selection; the ghost is then a mix of
    # the dropped (moderate) and the tail (tiny) masses, still exact.
    n, v, k = 8, 1000, 16
    t = _peaky(n, v, k, seed=3)
    s = logits(n, v, seed=4)
    opts = dict(top_p=0.9, top_p_min_k=1)
    r = ref.select(t, k, **opts)
    assert ref.top_p_margin(r, 0.9) > 1e-5
    assert (r["indices"] == -1).any()
    loss, grad = run(topkd.topk_kl_loss, s, t, k, reverse=True, **opts)
    rl, rg = ref.loss_and_grad(ref.topk_loss, s, t, k, reverse=True, **opts)
    assert_loss_close(loss, rl)
    assert_grad_close(grad, rg, torch.float32)


# ---------------------------------------------------------------- common offset of 2**20

OFFSET = 2.0 ** 20


def _eighths(n, v, seed):
    # multiples of 1/8 in [-8, 8]: x + 2**20 is exactly representable in float32
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-64, 65, (n, v), generator=g).float() / 8


OFFSET_CASES = [
    ("topk", dict(k=40)),
    ("topk", dict(k=40, reverse=True)),
    ("topk", dict(k=40, top_p=0.9, top_p_min_k=2)),
    ("topk", dict(k=40, normalize="topk")),
    ("topk", dict(k=300)),
    ("kl", dict()),
    ("kl", dict(reverse=True)),
    ("kl", dict(temperature=2.0)),
    ("topk", dict(k=40, temperature=0.5)),
]


@pytest.mark.parametrize("which", ["student", "teacher", "both"])
@pytest.mark.parametrize("case", OFFSET_CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def test_offset_2_20_changes_nothing(which, case):
    fn_name, opts = case
    n, v = 10, 300
    s = _eighths(n, v, 1)
    t = _eighths(n, v, 2)
    s_off = s + OFFSET if which in ("student", "both") else s
    t_off = t + OFFSET if which in ("teacher", "both") else t
    assert torch.equal(s_off - (s_off - s), s)  # exactly representable
    gout = torch.randn(n)
    if fn_name == "topk":
        opts = dict(opts)
        k = opts.pop("k")
        f = lambda a, b: topkd.topk_kl_loss(a, b, k, **opts)  # noqa: E731
        fr = lambda a, b: ref.topk_loss(a, b, k, **opts)  # noqa: E731
    else:
        f = lambda a, b: topkd.kl_loss(a, b, **opts)  # noqa: E731
        fr = lambda a, b: ref.full_loss(a, b, **opts)  # noqa: E731
    l0, g0 = run(f, s, t, grad_output=gout)
    l1, g1 = run(f, s_off, t_off, grad_output=gout)
    # loss and gradient unchanged to 1e-6
    assert float((l1 - l0).abs().max() / l0.abs().max()) <= 1e-6, (l0, l1)
    assert float((g1 - g0).abs().max()) <= 1e-6, float((g1 - g0).abs().max())
    # and both right
    rl, rg = ref.loss_and_grad(fr, s, t, grad_output=gout)
    assert_loss_close(l1, rl)
    assert_grad_close(g1, rg, torch.float32)


# ---------------------------------------------------------------- ties and chunk_bytes

CHUNKS = [1, 3000, 20000, None]  # 1 byte: one row per chunk; a few rows; the default


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("opts", [dict(k=7), dict(k=50, top_p=0.8, top_p_min_k=3),
                                  dict(k=50, reverse=True, temperature=0.75),
                                  dict(k=50, normalize="topk")],
                         ids=lambda o: "-".join(f"{a}={b}" for a, b in o.items()))
def test_ties_bitwise_identical_for_any_chunk_bytes(dtype, opts):
    n, v = 24, 200
    g = torch.Generator().manual_seed(5)
    # integer-valued logits in a small range: many exact ties, including at the K-th value
    s = torch.randint(-4, 5, (n, v), generator=g).to(dtype)
    t = torch.randint(-4, 5, (n, v), generator=g).to(dtype)
    opts = dict(opts)
    k = opts.pop("k")
    sel_opts = {a: opts[a] for a in ("top_p", "top_p_min_k", "temperature") if a in opts}
    gout = torch.randn(n)
    st = topkd.select_topk(t, k, **sel_opts)
    r = ref.select(t, k, **sel_opts)
    if "top_p" in sel_opts:
        assert ref.top_p_margin(r, sel_opts["top_p"], sel_opts["top_p_min_k"]) > 1e-5
    assert torch.equal(st.indices, r["indices"]), "tie rule: lower vocabulary index first"
    results = []
    for cb in CHUNKS:
        results.append(run(topkd.topk_kl_loss, s, t, k, chunk_bytes=cb, grad_output=gout,
                           **opts))
        loss_opts = {a: opts[a] for a in ("reverse", "normalize") if a in opts}
        results.append(run(topkd.sparse_kl_loss, s, st, chunk_bytes=cb, grad_output=gout,
                           **loss_opts))
    l0, g0 = results[0]
    for i, (l1, g1) in enumerate(results[1:], 1):
        assert torch.equal(l0, l1), f"loss differs for case {i}: {(l0 - l1).abs().max()}"
        assert torch.equal(g0, g1), f"gradient differs for case {i}: {(g0 - g1).abs().max()}"
    rl, rg = ref.loss_and_grad(ref.topk_loss, s, t, k, grad_output=gout, **opts)
    assert_loss_close(l0, rl)
    assert_grad_close(g0, rg, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kl_loss_bitwise_identical_for_any_chunk_bytes(dtype):
    n, v = 24, 200
    s = logits(n, v, dtype=dtype, seed=6)
    t = logits(n, v, dtype=dtype, seed=7)
    gout = torch.randn(n)
    res = [run(topkd.kl_loss, s, t, chunk_bytes=cb, grad_output=gout, reverse=True)
           for cb in CHUNKS]
    for l1, g1 in res[1:]:
        assert torch.equal(res[0][0], l1)
        assert torch.equal(res[0][1], g1)


def test_chunk_bytes_does_not_change_random_inputs():
    # the same for ordinary random inputs, many rows (several chunks at the default too)
    n, v = 300, 1000
    s = logits(n, v, dtype=torch.bfloat16, seed=8)
    t = logits(n, v, dtype=torch.bfloat16, seed=9)
    gout = torch.randn(n)
    res = [run(topkd.topk_kl_loss, s, t, 64, chunk_bytes=cb, grad_output=gout, top_p=0.9)
           for cb in (1, 4096 * 3, 1 << 20, None)]
    for l1, g1 in res[1:]:
        assert torch.equal(res[0][0], l1)
        assert torch.equal(res[0][1], g1)


# ---------------------------------------------------------------- teacher -inf entries


@pytest.mark.parametrize("k", [10, 20, 25, 64])
@pytest.mark.parametrize("opts", [dict(), dict(temperature=0.7), dict(top_p=0.9),
                                  dict(normalize="topk")],
                         ids=lambda o: "-".join(f"{a}={b}" for a, b in o.items()) or "plain")
def test_teacher_neg_inf_with_k_past_them(k, opts):
    n, v = 6, 64
    s = logits(n, v, seed=10)
    t = logits(n, v, seed=11, scale=2.5)
    t[:, 20:] = float("-inf")  # 20 finite entries per row; K goes past them for k > 20
    t[1, :] = float("-inf")
    t[1, 5] = 0.0  # a one-hot teacher
    t[2, ::3] = float("-inf")
    gout = torch.randn(n)
    if "top_p" in opts:
        r = ref.select(t, k, top_p=opts["top_p"])
        assert ref.top_p_margin(r, opts["top_p"]) > 1e-6
    loss, grad = run(topkd.topk_kl_loss, s, t, k, grad_output=gout, **opts)
    rl, rg = ref.loss_and_grad(ref.topk_loss, s, t, k, grad_output=gout, **opts)
    assert torch.isfinite(loss).all(), loss
    assert torch.isfinite(grad).all()
    assert_loss_close(loss, rl)
    assert_grad_close(grad, rg, torch.float32)


def test_kl_loss_teacher_neg_inf():
    n, v = 6, 64
    s = logits(n, v, seed=12)
    t = logits(n, v, seed=13)
    t[:, 30:] = float("-inf")
    t[0, :] = float("-inf")
    t[0, 0] = 2.0
    loss, grad = run(topkd.kl_loss, s, t)
    rl, rg = ref.loss_and_grad(ref.full_loss, s, t)
    assert torch.isfinite(loss).all()
    assert_loss_close(loss, rl)
    assert_grad_close(grad, rg, torch.float32)


def test_identical_student_and_teacher_give_zero():
    t = logits(5, 300, seed=14)
    for f in (lambda a, b: topkd.topk_kl_loss(a, b, 20), topkd.kl_loss,
              lambda a, b: topkd.topk_kl_loss(a, b, 20, reverse=True, normalize="topk")):
        loss, grad = run(f, t, t)
        assert float(loss.abs().max()) <= 1e-6
        assert float(grad.abs().max()) <= 1e-6


@pytest.mark.parametrize("fn", ["topk", "kl"])
def test_student_and_teacher_neg_inf_on_same_columns(fn):
    # e.g. a vocabulary mask applied to both models as a -inf bias: forward KL is finite,
    # the masked columns get zero gradient, nothing is NaN.
    n, v = 5, 80
    s = logits(n, v, seed=15)
    t = logits(n, v, seed=16, scale=2.5)
    s[:, 60:] = float("-inf")
    t[:, 60:] = float("-inf")
    if fn == "topk":
        loss, grad = run(topkd.topk_kl_loss, s, t, 70)
        rl, rg = ref.loss_and_grad(ref.topk_loss, s, t, 70)
    else:
        loss, grad = run(topkd.kl_loss, s, t)
        rl, rg = ref.loss_and_grad(ref.full_loss, s, t)
    assert torch.isfinite(loss).all(), loss
    assert not torch.isnan(grad).any()
    assert_loss_close(loss, rl)
    assert torch.all(grad[:, 60:] == 0)
    assert_grad_close(grad, rg, torch.float32)
