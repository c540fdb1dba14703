"""topkd's divergences against the public implementations they claim to match (the JSD
follows TRL's and Liger's convention).

Peers, as installed (TRL 1.16.0, Liger-Kernel 0.8.5); what their source does, and therefore
what each comparison converts:

* TRL ``GKDTrainer.generalized_jsd_loss`` (trl/experimental/gkd/gkd_trainer.py; GOLD has a
  copy): inputs are *logits* ``[..., V]``, both divided by ``temperature`` (no T^2), then
  log_softmax. beta = 0: ``F.kl_div(log p_s, log p_t)`` = KL(teacher || student); beta = 1:
  KL(student || teacher); else the mixture ``log M = logsumexp(log p_s + log(1 - beta),
  log p_t + log(beta))``, i.e. ``M = beta * teacher + (1 - beta) * student``, and
  ``beta * KL(teacher || M) + (1 - beta) * KL(student || M)``. The loss is elementwise over
  the vocabulary until the reduction: ``labels`` (-100 = ignore) select rows ``jsd[mask]``;
  ``"batchmean"`` = total sum / ``mask.sum()`` with labels, but / ``jsd.size(0)`` without
  them, which for a 3-D ``[B, S, V]`` input is the *batch size B*, not the token count;
  ``"mean"`` = ``jsd.mean()``, a mean over rows x V elements; ``"sum"`` = total sum; any
  other value (e.g. ``"none"``) returns the unreduced ``[..., V]`` elementwise tensor.
* TRL ``trl.trainer.distillation_trainer._chunked_divergence_loss`` (the DistillationTrainer's
  fused-LM-head path; kernels in trl/kernels/chunked_divergence.py): hidden states
  ``[B, S, H]`` and LM-head weights/biases; logits = ``softcap * tanh(logit_scale * z /
  softcap)`` then ``/ temperature``; the same beta convention (mixture
  ``(1 - beta) p_student + beta p_teacher``); per-token divergence summed over the vocabulary,
  masked by ``completion_mask``, loss = sum / number of valid tokens (or / num_items_in_batch).
  On CPU it runs the torch fallbacks (``_stats_tile``/``_jsd_tile``/``_backward_tile``),
  since ``_use_triton`` is true only for cuda/xpu devices.
* Liger ``LigerFusedLinearJSDLoss`` (liger_kernel/chunked_loss/jsd_loss.py on
  fused_linear_distillation.py): hidden ``[BT, H]``; student logits = ``x @ W.T (+ b)``; the
  hard loss is CE of the raw logits (temperature 1), summed over labels != ignore_index; then
  both logits are divided by the temperature (no T^2) and the JSD is computed with the same
  convention as TRL (mixture ``beta * teacher + (1 - beta) * student``; beta = 0 forward KL,
  beta = 1 reverse KL), summed over the vocabulary, rows whose *label* is ignore_index
  zeroed. Both parts are divided by the number of labels != ignore_index over the whole
  batch: loss = weight_hard * CE_mean + weight_soft * JSD_mean (defaults 0.5 / 0.5). The
  chunks are plain torch (``compiled=True`` wraps them in torch.compile, which works on CPU
  but costs seconds of compile time, so these tests use ``compiled=False``). Gradients are
  computed in the forward and returned by backward.

Every comparison is float32 on both sides, small shapes, loss to 1e-5 relative and gradients
to 1e-5 of their largest magnitude.
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers import grad_err

import topkd

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
pytest.importorskip("trl")
pytest.importorskip("liger_kernel")

BETAS = [0.0, 0.1, 0.5, 0.9, 1.0]
N, V, H = 16, 257, 32
RTOL = 1e-5
GTOL = 1e-5


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _randn(*shape, seed, scale=1.0):
    return torch.randn(*shape, generator=_gen(seed), dtype=torch.float32) * scale


def _assert_loss(got, want, what):
    got, want = float(got.detach()), float(want.detach())
    assert abs(got - want) <= RTOL * abs(want) + 1e-8, (
        f"{what}: topkd {got!r} vs peer {want!r} (rel {abs(got - want) / abs(want):.2e})")


def _assert_grad(got, want, what):
    assert got is not None and want is not None, what
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape)
    e = grad_err(got, want.to(torch.float64))
    assert e <= GTOL, f"{what}: max err / max |peer| = {e:.2e}"


def _leaf(x):
    return x.detach().clone().requires_grad_(True)


def _labels(shape, seed, ignored):
    lab = torch.randint(0, V, shape, generator=_gen(seed))
    flat = lab.view(-1)
    flat[list(ignored)] = -100
    return lab


# ------------------------------------------------------------------------------------------
# TRL generalized_jsd_loss (logits in, elementwise until the reduction)
# ------------------------------------------------------------------------------------------


def _trl_jsd():
    gkd = pytest.importorskip("trl.experimental.gkd.gkd_trainer")
    return gkd.GKDTrainer.generalized_jsd_loss


@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("beta", BETAS)
def test_trl_generalized_jsd_batchmean(beta, temperature):
    jsd = _trl_jsd()
    z, t = _randn(N, V, seed=1, scale=2.0), _randn(N, V, seed=2, scale=2.0)

    # 2-D [N, V], no labels: TRL "batchmean" = total sum / jsd.size(0) = sum / N,
    # topkd "mean" over all rows.
    zp, zk = _leaf(z), _leaf(z)
    want = jsd(zp, t, beta=beta, temperature=temperature, reduction="batchmean")
    got = topkd.kl_loss(zk, t, divergence=topkd.JSD(beta=beta), temperature=temperature,
                        reduction="mean")
    _assert_loss(got, want, "2-D batchmean")
    want.backward()
    got.backward()
    _assert_grad(zk.grad, zp.grad, "2-D batchmean gradient")

    # 3-D [2, 8, V] with labels: TRL keeps rows jsd[labels != -100] and divides by their
    # number (mask.sum()), which is topkd's "mean" with mask = labels != -100.
    z3, t3 = z.view(2, 8, V), t.view(2, 8, V)
    labels = _labels((2, 8), 3, ignored=(0, 5, 6, 13))
    zp, zk = _leaf(z3), _leaf(z3)
    want = jsd(zp, t3, labels=labels, beta=beta, temperature=temperature)
    got = topkd.kl_loss(zk, t3, divergence=topkd.JSD(beta=beta), temperature=temperature,
                        mask=labels != -100, reduction="mean")
    _assert_loss(got, want, "3-D batchmean with labels")
    want.backward()
    got.backward()
    _assert_grad(zk.grad, zp.grad, "3-D batchmean gradient")

    # "sum": TRL sums the kept rows' elements; topkd "sum" with the same mask.
    want = jsd(z3, t3, labels=labels, beta=beta, temperature=temperature, reduction="sum")
    got = topkd.kl_loss(z3, t3, divergence=topkd.JSD(beta=beta), temperature=temperature,
                        mask=labels != -100, reduction="sum")
    _assert_loss(got, want, "sum")


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_trl_generalized_jsd_other_reductions(beta):
    """TRL's less obvious normalizations, converted explicitly."""
    jsd = _trl_jsd()
    z, t = _randn(2, 8, V, seed=4, scale=2.0), _randn(2, 8, V, seed=5, scale=2.0)
    div = topkd.JSD(beta=beta)
    per_row = topkd.kl_loss(z, t, divergence=div, temperature=1.5, reduction="none")
    assert per_row.shape == (2, 8)
    # reduction="none" (not handled by TRL: falls to `return jsd`) is elementwise [.., V];
    # its sum over the vocabulary is the per-row divergence.
    elem = jsd(z, t, beta=beta, temperature=1.5, reduction="none")
    assert elem.shape == (2, 8, V)
    for i in range(2):
        for j in range(8):
            _assert_loss(per_row[i, j], elem[i, j].sum(), f"none row ({i}, {j})")
    # 3-D without labels, "batchmean" divides by jsd.size(0) = B = 2 (the batch size), not by
    # the 16 tokens: that is topkd's "sum" / B.
    want = jsd(z, t, beta=beta, temperature=1.5, reduction="batchmean")
    got = topkd.kl_loss(z, t, divergence=div, temperature=1.5, reduction="sum") / 2
    _assert_loss(got, want, "3-D batchmean without labels (/ batch size)")
    # "mean" is jsd.mean() over rows x V elements: topkd "mean" / V.
    want = jsd(z, t, beta=beta, temperature=1.5, reduction="mean")
    got = topkd.kl_loss(z, t, divergence=div, temperature=1.5, reduction="mean") / V
    _assert_loss(got, want, "mean over elements (/ V)")


def test_jsd_string_and_default_beta_match_trl():
    # divergence="jsd" is JSD(beta=0.5), TRL's default beta.
    jsd = _trl_jsd()
    z, t = _randn(N, V, seed=6, scale=2.0), _randn(N, V, seed=7, scale=2.0)
    want = jsd(z, t)
    _assert_loss(topkd.kl_loss(z, t, divergence="jsd", reduction="mean"), want, '"jsd"')
    _assert_loss(topkd.kl_loss(z, t, divergence=topkd.JSD(), reduction="mean"), want, "JSD()")


# ------------------------------------------------------------------------------------------
# TRL _chunked_divergence_loss (fused LM head, scale / softcap, runs on CPU via torch tiles)
# ------------------------------------------------------------------------------------------


def _trl_chunked():
    mod = pytest.importorskip("trl.trainer.distillation_trainer")
    return mod._chunked_divergence_loss


CHUNKED_CASES = {
    "plain": dict(bias=False, scale=1.0, softcap=None, t_scale=1.0, t_softcap=None, T=1.0),
    "bias_scale_softcap": dict(bias=True, scale=0.8, softcap=4.0, t_scale=1.25, t_softcap=6.0,
                               T=1.7),
}


@pytest.mark.parametrize("case", sorted(CHUNKED_CASES))
@pytest.mark.parametrize("beta", BETAS)
def test_trl_chunked_divergence_matches_fused_kl_loss(beta, case):
    fn = _trl_chunked()
    c = CHUNKED_CASES[case]
    hs, ht = _randn(2, 8, H, seed=10), _randn(2, 8, H, seed=11)
    ws, wt = _randn(V, H, seed=12, scale=0.5), _randn(V, H, seed=13, scale=0.5)
    bs = _randn(V, seed=14) if c["bias"] else None
    bt = _randn(V, seed=15) if c["bias"] else None
    completion = torch.ones(2, 8, dtype=torch.long)
    completion[0, :3] = 0
    completion[1, 7] = 0

    hp, wp = _leaf(hs), _leaf(ws)
    bp = None if bs is None else _leaf(bs)
    # TRL: (sum over valid tokens of the per-token divergence) / number of valid tokens
    want, _entropy, n_valid = fn(
        hp, ht, wp, wt, completion, beta, student_lm_head_bias=bp, teacher_lm_head_bias=bt,
        student_logit_scale=c["scale"], teacher_logit_scale=c["t_scale"],
        student_final_logit_softcapping=c["softcap"],
        teacher_final_logit_softcapping=c["t_softcap"], temperature=c["T"])
    assert int(n_valid) == 12
    hk, wk = _leaf(hs), _leaf(ws)
    bk = None if bs is None else _leaf(bs)
    teacher = (ht, wt) if bt is None else (ht, wt, bt)
    got = topkd.fused_kl_loss(
        hk, wk, teacher, bias=bk, divergence=topkd.JSD(beta=beta), temperature=c["T"],
        logit_scale=c["scale"], softcap=c["softcap"], teacher_logit_scale=c["t_scale"],
        teacher_softcap=c["t_softcap"], mask=completion.bool(), reduction="mean")
    _assert_loss(got, want, f"chunked {case}")
    want.backward()
    got.backward()
    _assert_grad(hk.grad, hp.grad, "hidden gradient")
    _assert_grad(wk.grad, wp.grad, "weight gradient")
    if bs is not None:
        _assert_grad(bk.grad, bp.grad, "bias gradient")


def test_trl_chunked_divergence_num_items_in_batch():
    # with num_items_in_batch, TRL divides the masked sum by it: topkd "sum" / num_items.
    fn = _trl_chunked()
    hs, ht = _randn(2, 8, H, seed=20), _randn(2, 8, H, seed=21)
    ws, wt = _randn(V, H, seed=22, scale=0.5), _randn(V, H, seed=23, scale=0.5)
    completion = torch.ones(2, 8, dtype=torch.long)
    completion[1, :5] = 0
    want, _, _ = fn(hs, ht, ws, wt, completion, 0.5, num_items_in_batch=40, temperature=2.0)
    got = topkd.fused_kl_loss(hs, ws, (ht, wt), divergence=topkd.JSD(beta=0.5), temperature=2.0,
                              mask=completion.bool(), reduction="sum") / 40
    _assert_loss(got, want, "num_items_in_batch")


# ------------------------------------------------------------------------------------------
# Liger LigerFusedLinearJSDLoss (chunked torch, labels mask the KD rows, KD + CE)
# ------------------------------------------------------------------------------------------


def _liger_loss(**kw):
    mod = pytest.importorskip("liger_kernel.chunked_loss")
    kw.setdefault("compiled", False)
    return mod.LigerFusedLinearJSDLoss(**kw)


def _liger_inputs(seed, bias):
    hs, ht = _randn(N, H, seed=seed), _randn(N, H, seed=seed + 1)
    ws, wt = _randn(V, H, seed=seed + 2, scale=0.5), _randn(V, H, seed=seed + 3, scale=0.5)
    bs = _randn(V, seed=seed + 4) if bias else None
    bt = _randn(V, seed=seed + 5) if bias else None
    labels = _labels((N,), seed + 6, ignored=(1, 2, 9))
    return hs, ht, ws, wt, bs, bt, labels


@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("beta", BETAS)
def test_liger_fused_linear_jsd_kd_only(beta, temperature):
    hs, ht, ws, wt, _, _, labels = _liger_inputs(30, bias=False)
    # KD only (weight_hard_loss=0): Liger sums the JSD over rows whose label is not -100 and
    # divides by that count, i.e. topkd "mean" with mask = labels != -100 (not over all rows).
    # chunk_size=4 -> 4 chunks of 4 rows, each divided by the global count.
    liger = _liger_loss(weight_hard_loss=0.0, weight_soft_loss=1.0, beta=beta,
                        temperature=temperature, chunk_size=4)
    hp, wp = _leaf(hs), _leaf(ws)
    want = liger(hp, wp, ht, wt, labels)
    hk, wk = _leaf(hs), _leaf(ws)
    got = topkd.fused_kl_loss(hk, wk, (ht, wt), divergence=topkd.JSD(beta=beta),
                              temperature=temperature, mask=labels != -100, reduction="mean")
    _assert_loss(got, want, "Liger KD only")
    want.backward()
    got.backward()
    _assert_grad(hk.grad, hp.grad, "hidden gradient")
    _assert_grad(wk.grad, wp.grad, "weight gradient")


@pytest.mark.parametrize("beta", BETAS)
def test_liger_fused_linear_jsd_with_ce(beta):
    hs, ht, ws, wt, bs, bt, labels = _liger_inputs(40, bias=True)
    # loss = weight_hard * CE + weight_soft * JSD, CE on the raw logits (temperature 1, taken
    # before Liger divides the logits by the temperature), both / #(labels != -100):
    # topkd ce_weight / kd_weight, labels, and mask = labels != -100 for the KD rows.
    liger = _liger_loss(weight_hard_loss=0.25, weight_soft_loss=0.75, beta=beta,
                        temperature=2.0, return_soft_hard_loss=True)
    hp, wp, bp = _leaf(hs), _leaf(ws), _leaf(bs)
    want, soft, hard = liger(hp, wp, ht, wt, labels, bp, bt)
    hk, wk, bk = _leaf(hs), _leaf(ws), _leaf(bs)
    out = topkd.fused_kl_loss(hk, wk, (ht, wt, bt), bias=bk, divergence=topkd.JSD(beta=beta),
                              temperature=2.0, labels=labels, kd_weight=0.75, ce_weight=0.25,
                              mask=labels != -100, reduction="mean", return_components=True)
    loss, kd, ce = out
    assert out.loss is loss and out.kd is kd and out.ce is ce
    _assert_loss(loss, want, "Liger KD + CE")
    _assert_loss(kd, soft, "KD component vs Liger soft loss")
    _assert_loss(ce, hard, "CE component vs Liger hard loss")
    want.backward()
    loss.backward()
    _assert_grad(hk.grad, hp.grad, "hidden gradient")
    _assert_grad(wk.grad, wp.grad, "weight gradient")
    _assert_grad(bk.grad, bp.grad, "bias gradient")


@pytest.mark.skipif(os.environ.get("TOPKD_PEERS_COMPILED") != "1",
                    reason="torch.compile of Liger's chunk takes ~10 s on CPU; set "
                           "TOPKD_PEERS_COMPILED=1")
def test_liger_fused_linear_jsd_compiled():
    # Liger's default path (compiled=True: torch.compile of the chunk, inductor C++ on CPU).
    hs, ht, ws, wt, _, _, labels = _liger_inputs(50, bias=False)
    want = _liger_loss(weight_hard_loss=0.0, weight_soft_loss=1.0, beta=0.5, temperature=2.0,
                       compiled=True)(hs, ws, ht, wt, labels)
    got = topkd.fused_kl_loss(hs, ws, (ht, wt), divergence=topkd.JSD(beta=0.5), temperature=2.0,
                              mask=labels != -100, reduction="mean")
    _assert_loss(got, want, "Liger compiled")


# ------------------------------------------------------------------------------------------
# Triton-only peers (skipped without a GPU): LigerJSD, LigerTVDLoss, TRL's Triton kernels
# ------------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton kernels need a GPU")


@cuda
@pytest.mark.parametrize("beta", BETAS)
def test_liger_jsd_kernel(beta):
    from liger_kernel.transformers.jsd import LigerJSD

    # LigerJSD takes *log-probabilities* (student first, teacher second) and returns
    # sum / #(labels != -100) (or / BT without labels).
    z = _randn(N, V, seed=60, scale=2.0).cuda()
    t = _randn(N, V, seed=61, scale=2.0).cuda()
    labels = _labels((N,), 62, ignored=(0, 7)).cuda()
    T = 2.0
    zp, zk = _leaf(z), _leaf(z)
    want = LigerJSD(beta=beta)(torch.log_softmax(zp / T, -1), torch.log_softmax(t / T, -1),
                               labels)
    got = topkd.kl_loss(zk, t, divergence=topkd.JSD(beta=beta), temperature=T,
                        mask=labels != -100, reduction="mean")
    _assert_loss(got, want, "LigerJSD")
    want.backward()
    got.backward()
    _assert_grad(zk.grad.cpu(), zp.grad.cpu(), "LigerJSD gradient")


@cuda
def test_liger_tvd_kernel():
    from liger_kernel.transformers.tvd import LigerTVDLoss

    # LigerTVDLoss takes *probabilities* p, q; per row 0.5 * sum |p - q|; "batchmean" =
    # sum / #(labels != -100). Its gradient is 0.5 * sign(p - q) w.r.t. p (0 where equal),
    # chained here through the softmax by autograd.
    z = _randn(N, V, seed=70, scale=2.0).cuda()
    t = _randn(N, V, seed=71, scale=2.0).cuda()
    labels = _labels((N,), 72, ignored=(3,)).cuda()
    T = 1.5
    zp, zk = _leaf(z), _leaf(z)
    want = LigerTVDLoss(reduction="batchmean")(torch.softmax(zp / T, -1),
                                               torch.softmax(t / T, -1), labels)
    got = topkd.kl_loss(zk, t, divergence="tvd", temperature=T, mask=labels != -100,
                        reduction="mean")
    _assert_loss(got, want, "LigerTVDLoss")
    want.backward()
    got.backward()
    _assert_grad(zk.grad.cpu(), zp.grad.cpu(), "LigerTVDLoss gradient")


@cuda
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_trl_chunked_divergence_triton(beta):
    fn = _trl_chunked()
    hs, ht = _randn(2, 8, H, seed=80).cuda(), _randn(2, 8, H, seed=81).cuda()
    ws, wt = _randn(V, H, seed=82, scale=0.5).cuda(), _randn(V, H, seed=83, scale=0.5).cuda()
    completion = torch.ones(2, 8, dtype=torch.long, device="cuda")
    completion[0, :2] = 0
    hp, hk = _leaf(hs), _leaf(hs)
    want, _, _ = fn(hp, ht, ws, wt, completion, beta, temperature=2.0)
    got = topkd.fused_kl_loss(hk, ws, (ht, wt), divergence=topkd.JSD(beta=beta), temperature=2.0,
                              mask=completion.bool(), reduction="mean")
    _assert_loss(got, want, "TRL Triton")
    want.backward()
    got.backward()
    _assert_grad(hk.grad.cpu(), hp.grad.cpu(), "TRL Triton hidden gradient")
