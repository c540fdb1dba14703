"""mask with every reduction, "mean" over kept rows, zero rows."""

import pytest
import reference as ref
import torch
from helpers import assert_grad_close, assert_loss_close, logits, run

import topkd

V = 256


def _fns():
    return {
        "topk": (lambda s, t, **kw: topkd.topk_kl_loss(s, t, 16, top_p=0.95, **kw),
                 lambda s, t, **kw: ref.topk_loss(s, t, 16, top_p=0.95, **kw)),
        "topk_reverse": (lambda s, t, **kw: topkd.topk_kl_loss(s, t, 16, reverse=True, **kw),
                         lambda s, t, **kw: ref.topk_loss(s, t, 16, reverse=True, **kw)),
        "sparse": (lambda s, t, **kw: topkd.sparse_kl_loss(s, topkd.select_topk(t, 16), **kw),
                   lambda s, t, **kw: ref.topk_loss(s, t, 16, **kw)),
        "kl": (lambda s, t, **kw: topkd.kl_loss(s, t, **kw),
               lambda s, t, **kw: ref.full_loss(s, t, **kw)),
    }


FNS = list(_fns())


@pytest.mark.parametrize("name", FNS)
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mask_with_every_reduction(name, reduction, dtype):
    f, fr = _fns()[name]
    s = logits(4, 6, V, dtype=dtype, seed=1)
    t = logits(4, 6, V, dtype=dtype, seed=2, scale=2.5)
    mask = torch.rand(4, 6, generator=torch.Generator().manual_seed(3)) < 0.6
    mask[0, 0], mask[0, 1] = True, False
    gout = torch.randn(4, 6) if reduction == "none" else None
    loss, grad = run(f, s, t, mask=mask, reduction=reduction, grad_output=gout)
    rl, rg = ref.loss_and_grad(fr, s, t, mask=mask, reduction=reduction, grad_output=gout)
    assert_loss_close(loss, rl)
    if reduction == "none":
        assert torch.all(loss[~mask] == 0), "masked rows must be 0"
    # masked rows get exactly zero gradient
    assert torch.all(grad[~mask] == 0)
    assert_grad_close(grad, rg, dtype)


@pytest.mark.parametrize("name", FNS)
@pytest.mark.parametrize("reduction", ["none", "mean"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_masked_rows_may_hold_non_finite_values(name, reduction, bad):
    """A row the mask drops gets zero gradient whatever it holds (a teacher's padding rows may
    be NaN): the kept rows' loss and gradient are those of the same inputs with the dropped
    rows made finite, and the dropped rows' gradient is 0, not 0 times NaN."""
    f, fr = _fns()[name]
    s, t = logits(3, 4, V, seed=8), logits(3, 4, V, seed=9, scale=2.5)
    mask = torch.ones(3, 4, dtype=torch.bool)
    mask[0, 1] = mask[2, 3] = False
    t_bad, s_bad = t.clone(), s.clone()
    t_bad[0, 1] = bad
    t_bad[2, 3, 5:40] = bad
    s_bad[2, 3, 7] = bad
    gout = torch.randn(3, 4) if reduction == "none" else None
    loss, grad = run(f, s_bad, t_bad, mask=mask, reduction=reduction, grad_output=gout)
    rl, rg = ref.loss_and_grad(fr, s, t, mask=mask, reduction=reduction, grad_output=gout)
    assert_loss_close(loss, rl)
    assert torch.all(grad[~mask] == 0)
    assert_grad_close(grad, rg, torch.float32)


def test_masked_rows_may_hold_non_finite_values_fused():
    """Through a fused head a NaN gradient row would reach every entry of the weight's
    gradient: a teacher row the mask drops may hold NaN."""
    g = torch.Generator().manual_seed(10)
    h = torch.randn(6, 32, generator=g, dtype=torch.float64).float()
    w = torch.randn(V, 32, generator=g, dtype=torch.float64).float()
    t = logits(6, V, seed=11)
    mask = torch.tensor([True, False, True, True, False, True])
    t_bad = t.clone()
    t_bad[1], t_bad[4, :9] = float("nan"), float("inf")
    for loss_fn in (lambda hw, te, **kw: topkd.fused_topk_kl_loss(*hw, te, 16, **kw),
                    lambda hw, te, **kw: topkd.fused_kl_loss(*hw, te, **kw)):
        grads = []
        for teacher in (t, t_bad):
            hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
            loss_fn((hh, ww), teacher, mask=mask, reduction="mean").backward()
            grads.append((hh.grad, ww.grad))
        for mine, finite in zip(grads[1], grads[0], strict=True):
            assert torch.isfinite(mine).all()
            torch.testing.assert_close(mine, finite, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("name", FNS)
def test_mean_is_over_kept_rows(name):
    f, _ = _fns()[name]
    s = logits(10, V, seed=4)
    t = logits(10, V, seed=5)
    mask = torch.tensor([True, False] * 5)
    full = f(s, t)
    mean = f(s, t, mask=mask, reduction="mean")
    total = f(s, t, mask=mask, reduction="sum")
    torch.testing.assert_close(mean, full[mask].mean(), rtol=2e-6, atol=0)
    torch.testing.assert_close(total, full[mask].sum(), rtol=2e-6, atol=0)
    # all-True mask is the same as no mask
    assert torch.equal(f(s, t, mask=torch.ones(10, dtype=torch.bool)), full)


@pytest.mark.parametrize("name", FNS)
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_no_row_kept(name, reduction):
    f, _ = _fns()[name]
    s = logits(3, 5, V, seed=6)
    t = logits(3, 5, V, seed=7)
    mask = torch.zeros(3, 5, dtype=torch.bool)
    gout = torch.ones(3, 5) if reduction == "none" else None
    loss, grad = run(f, s, t, mask=mask, reduction=reduction, grad_output=gout)
    assert torch.all(loss == 0) and not torch.isnan(loss).any()
    assert grad.shape == s.shape and torch.all(grad == 0)


@pytest.mark.parametrize("name", FNS)
@pytest.mark.parametrize("lead", [(0,), (2, 0), (0, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_rows(name, lead, dtype):
    f, _ = _fns()[name]
    s = torch.randn(*lead, V).to(dtype)
    t = torch.randn(*lead, V).to(dtype)
    # "none": an empty loss with the leading shape
    sl = s.clone().requires_grad_(True)
    loss = f(sl, t)
    assert loss.shape == lead and loss.dtype == torch.float32
    loss.sum().backward()
    assert sl.grad.shape == s.shape and sl.grad.dtype == dtype
    for reduction in ("sum", "mean"):
        sl = s.clone().requires_grad_(True)
        loss = f(sl, t, reduction=reduction)
        assert loss.shape == () and loss.dtype == torch.float32
        assert float(loss.detach()) == 0.0
        loss.backward()
        assert sl.grad is not None and sl.grad.shape == s.shape
    # a zero-row mask too
    sl = s.clone().requires_grad_(True)
    loss = f(sl, t, mask=torch.zeros(lead, dtype=torch.bool), reduction="mean")
    assert float(loss.detach()) == 0.0
    loss.backward()


def test_zero_rows_select_topk():
    st = topkd.select_topk(torch.randn(0, V), 8, top_p=0.5)
    assert st.indices.shape == (0, 8) and st.indices.dtype == torch.int64
    assert st.logprobs.shape == (0, 8) and st.logprobs.dtype == torch.float32
    assert st.rest_logprob.shape == (0,)
    st = topkd.select_topk(torch.randn(2, 0, V).bfloat16(), 8)
    assert st.indices.shape == (2, 0, 8)
    assert st.rest_logprob.shape == (2, 0)


def test_single_row_no_leading_dims():
    # a plain [V] row: leading shape ()
    s = logits(V, seed=8)
    t = logits(V, seed=9)
    loss, grad = run(topkd.topk_kl_loss, s, t, 10)
    rl, rg = ref.loss_and_grad(ref.topk_loss, s, t, 10)
    assert loss.shape == ()
    assert_loss_close(loss, rl)
    assert_grad_close(grad, rg, torch.float32)
