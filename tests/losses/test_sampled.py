"""Sampled KD (RS-KD): sample_teacher's draws, and the losses against a SampledTeacher.

The gradient is tested for unbiasedness statistically: over many independent draws its mean
must come within a few standard errors of the full-vocabulary KL gradient (float64 reference),
and a deliberately biased estimator must fail the same test.
"""

import pytest
import reference as ref
import torch
from helpers import assert_grad_close, assert_loss_close, kd_inputs, logits

import topkd
from topkd import KDOptions, distill_loss, sample_teacher

N = 12


# -- the sampler -------------------------------------------------------------------------------


def test_sampler_rows():
    t = logits(3, 7, 80, scale=2.5, seed=0)
    st = sample_teacher(t, N, temperature=0.8, seed=3)
    assert isinstance(st, topkd.SampledTeacher)
    assert st.indices.shape == st.counts.shape == st.logprobs.shape == (3, 7, N)
    assert (st.samples, st.temperature, st.vocab_size) == (N, 0.8, 80)
    used = st.counts > 0
    assert torch.equal(st.counts.sum(-1), torch.full((3, 7), N, dtype=st.counts.dtype))
    # distinct ids ascending, then unused slots (-1, count 0, -inf)
    assert torch.equal(used, st.indices >= 0)
    assert torch.equal(used, torch.arange(N) < used.sum(-1, keepdim=True))
    ids = torch.where(used, st.indices, 10**6)
    assert bool((ids.diff(dim=-1)[used[..., 1:]] > 0).all())
    assert bool((st.logprobs[~used] == float("-inf")).all())
    # the teacher's log-probs of the ids drawn
    logq = torch.log_softmax(t.double() / 0.8, -1).gather(-1, st.indices.clamp_min(0))
    torch.testing.assert_close(st.logprobs[used].double(), logq[used], atol=2e-6, rtol=0)


def test_sampler_frequencies():
    """The histogram of many draws matches q (a chi-square bound far in the tail)."""
    t = logits(1, 30, scale=2.0, seed=1)
    draws = 20000
    st = sample_teacher(t.expand(draws // 100, 30), 100, seed=5)
    hist = torch.zeros(30, dtype=torch.float64).scatter_add_(
        0, st.indices.clamp_min(0).reshape(-1), st.counts.reshape(-1).double())
    expected = torch.softmax(t[0].double(), -1) * draws
    chi2 = float(((hist - expected) ** 2 / expected).sum())
    assert chi2 < 80, chi2  # 29 degrees of freedom: P(chi2 > 80) ~ 1e-6


def test_sampler_padding_and_zero_mass_never_drawn():
    t = logits(64, 40, seed=2)
    t[:, 5] = float("-inf")  # no mass
    st = sample_teacher(t, N, vocab_size=32, seed=0)
    ids = st.indices[st.counts > 0]
    assert bool((ids < 32).all()) and not bool((ids == 5).any())
    assert st.vocab_size == 32


def test_sampler_deterministic_per_seed_and_sample_id():
    t = logits(4, 9, 50, seed=3)
    a = sample_teacher(t, N, seed=7)
    assert torch.equal(a.indices, sample_teacher(t, N, seed=7).indices)
    assert not torch.equal(a.indices, sample_teacher(t, N, seed=8).indices)
    ids = [10, "x", 3, 11]
    full = sample_teacher(t, N, seed=7, sample_ids=ids)
    # each sequence's draws depend on (seed, its id) only: not on its batch or position
    part = sample_teacher(t[[2, 1]], N, seed=7, sample_ids=[3, "x"])
    assert torch.equal(full.indices[[2, 1]], part.indices)
    assert torch.equal(full.counts[[2, 1]], part.counts)
    # nor on the chunks
    small = sample_teacher(t, N, seed=7, sample_ids=ids, chunk_bytes=1)
    assert torch.equal(full.indices, small.indices)
    with pytest.raises(ValueError, match="sample_ids"):
        sample_teacher(t, N, sample_ids=[1, 2])


def test_sampler_checks():
    t = logits(2, 10)
    with pytest.raises(ValueError, match="samples"):
        sample_teacher(t, 0)
    with pytest.raises(ValueError, match="samples"):
        sample_teacher(t, 256)
    with pytest.raises(ValueError, match="temperature"):
        sample_teacher(t, N, temperature=0.0)
    with pytest.raises(TypeError, match="seed"):
        sample_teacher(t, N, seed=1.5)
    with pytest.raises(ValueError, match=r"seed must be in .*got 2361183241434822606848"):
        sample_teacher(t, N, seed=2**71)  # (a bare "Overflow when unpacking long" before)
    sample_teacher(t, N, seed=2**64 - 1)


# -- the loss against the float64 reference ----------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("reduction", ["none", "mean"])
@pytest.mark.parametrize("with_logq", [False, True])
def test_sampled_loss_matches_reference(temperature, reduction, with_logq):
    d = kd_inputs()
    st = sample_teacher(d["t"], N, temperature=temperature, seed=1)
    if not with_logq:
        st.logprobs = None
    kwargs = dict(mask=d["mask"], labels=d["labels"], ce_weight=0.3, reduction=reduction)
    go = d["go"] if reduction == "none" else None
    s = d["s"].clone().requires_grad_(True)
    loss = topkd.sparse_kl_loss(s, st, impl="eager", **kwargs)
    loss.backward(go if reduction == "none" else None)
    want, grad = ref.loss_and_grad(ref.sampled_loss, d["s"], st.indices, st.counts, N,
                                   temperature=temperature, grad_output=go,
                                   logq=st.logprobs, **kwargs)
    assert_loss_close(loss, want)
    assert_grad_close(s.grad, grad, torch.float32)


def test_sampled_loss_gradient_is_p_minus_weights():
    t, z = logits(5, 60, seed=4), logits(5, 60, seed=5)
    st = sample_teacher(t, N, temperature=1.5, seed=2)
    s = z.clone().requires_grad_(True)
    topkd.sparse_kl_loss(s, st, reduction="sum", impl="eager").backward()
    w = torch.zeros(5, 60).scatter_add_(-1, st.indices.clamp_min(0), st.weights())
    torch.testing.assert_close(s.grad, (torch.softmax(z / 1.5, -1) - w) / 1.5, atol=1e-6,
                               rtol=0)


def test_sampled_loss_chunks_and_components():
    d = kd_inputs(lead=(6, 9), v=300)
    st = sample_teacher(d["t"], N, seed=3)
    outs = []
    for chunk_bytes in (None, 4096):
        s = d["s"].clone().requires_grad_(True)
        parts = topkd.sparse_kl_loss(s, st, labels=d["labels"], ce_weight=0.5,
                                     reduction="mean", chunk_bytes=chunk_bytes,
                                     return_components=True, impl="eager")
        parts.loss.backward()
        outs.append((parts, s.grad))
    (a, ga), (b, gb) = outs
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ga, gb, atol=1e-7, rtol=0)
    torch.testing.assert_close(a.loss, a.kd + 0.5 * a.ce)


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_fused_sampled_matches_reference(reduction):
    d = kd_inputs(lead=(3, 5), v=64)
    st = sample_teacher(d["t"], N, seed=4, temperature=1.3)
    h, w = d["h"].clone().requires_grad_(True), d["W"].clone().requires_grad_(True)
    go = d["go"] if reduction == "none" else None
    loss = topkd.fused_topk_kl_loss(h, w, st, mask=d["mask"], reduction=reduction,
                                    impl="eager")
    loss.backward(go)
    want, gh, gw, _ = ref.linear_loss_and_grads(
        ref.sampled_loss, d["h"], d["W"], st.indices, st.counts, N, temperature=1.3,
        logq=st.logprobs, mask=d["mask"], reduction=reduction, grad_output=go)
    assert_loss_close(loss, want)
    assert_grad_close(h.grad, gh, torch.float32)
    assert_grad_close(w.grad, gw, torch.float32)


# -- unbiasedness ------------------------------------------------------------------------------

DRAWS = 4000
ROWS, V = 3, 40


def _mean_gradient(student, teacher_logits, temperature, seed):
    """The mean over DRAWS independent sampled teachers of the loss gradient w.r.t. the
    student's logits, and the mean loss value (the draws are rows of one batch)."""
    st = sample_teacher(teacher_logits.expand(DRAWS, ROWS, V), N, temperature=temperature,
                        seed=seed)
    return _mean_over_draws(student, st)


def _mean_over_draws(student, teacher):
    s = student.expand(DRAWS, ROWS, V).clone().requires_grad_(True)
    loss = topkd.sparse_kl_loss(s, teacher, reduction="none", impl="eager")
    loss.sum().backward()
    return s.grad.double().mean(0), loss.detach().double()


def _within_standard_errors(mean, true, se, z=5.0):
    return bool(((mean - true).abs() <= z * se + 1e-6).all())


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_sampled_gradient_is_unbiased(temperature):
    t, z = logits(ROWS, V, scale=2.5, seed=6), logits(ROWS, V, scale=2.0, seed=7)
    _, true = ref.loss_and_grad(ref.full_loss, z, t, temperature=temperature, reduction="sum")
    q = torch.softmax(t.double() / temperature, -1)
    # one draw's gradient entry is (p - c/N) / T with Var(c/N) = q (1 - q) / N
    se = (q * (1 - q) / (N * DRAWS)).sqrt() / temperature
    mean, values = _mean_gradient(z, t, temperature, seed=11)
    assert _within_standard_errors(mean, true, se), float(((mean - true).abs() / se).max())
    # the value with the teacher's log-probs estimates KL(q || p) without bias
    kl = ref.full_loss(z.double(), t, temperature=temperature)
    value_se = values.std(0) / DRAWS ** 0.5
    assert bool(((values.mean(0) - kl).abs() <= 5 * value_se).all())


def test_biased_estimators_fail_the_unbiasedness_test():
    """The test can fail: draws from the top-K renormalized teacher (the bias a top-K cache
    has), and the top-K renormalized loss itself, are rejected by the same check."""
    t, z = logits(ROWS, V, scale=2.5, seed=6), logits(ROWS, V, scale=2.0, seed=7)
    _, true = ref.loss_and_grad(ref.full_loss, z, t, reduction="sum")
    q = torch.softmax(t.double(), -1)
    se = (q * (1 - q) / (N * DRAWS)).sqrt()
    k = 8
    top = t.topk(k, -1).indices
    truncated = torch.full_like(t, float("-inf")).scatter(-1, top, t.gather(-1, top))
    mean, _ = _mean_gradient(z, truncated, 1.0, seed=11)
    assert not _within_standard_errors(mean, true, se)
    s = z.clone().requires_grad_(True)
    topkd.topk_kl_loss(s, t, k, normalize="topk", reduction="sum", impl="eager").backward()
    assert not _within_standard_errors(s.grad.double(), true, se)
    # and the check passes the unbiased estimator on the same inputs
    mean, _ = _mean_gradient(z, t, 1.0, seed=12)
    assert _within_standard_errors(mean, true, se)


# -- what cannot be estimated from samples is refused ------------------------------------------


@pytest.mark.parametrize("divergence", ["reverse_kl", "jsd", "tvd", "skew_kl",
                                        "skew_reverse_kl"])
def test_refuses_divergences_without_unbiased_estimate(divergence):
    d = kd_inputs()
    st = sample_teacher(d["t"], N)
    with pytest.raises(ValueError, match="divergence"):
        topkd.sparse_kl_loss(d["s"], st, divergence=divergence)
    with pytest.raises(ValueError, match="divergence"):
        topkd.fused_topk_kl_loss(d["h"], d["W"], st, divergence=divergence)


def test_refuses_top_k_options():
    d = kd_inputs()
    st = sample_teacher(d["t"], N)
    with pytest.raises(ValueError, match="normalize"):
        topkd.sparse_kl_loss(d["s"], st, normalize="topk")
    with pytest.raises(ValueError, match="top_p"):
        distill_loss(d["s"], st, KDOptions(top_p=0.9))
    with pytest.raises(ValueError, match="top_p"):
        topkd.fused_topk_kl_loss(d["h"], d["W"], st, top_p=0.9)
    with pytest.raises(ValueError, match="k=5"):
        distill_loss(d["s"], st, KDOptions(k=5))
    with pytest.raises(ValueError, match="temperature"):
        topkd.sparse_kl_loss(d["s"], st, temperature=2.0)
    with pytest.raises(TypeError, match="fused_kl_loss"):
        topkd.fused_kl_loss(d["h"], d["W"], st)


def test_refuses_malformed_sampled_teacher():
    d = kd_inputs()
    st = sample_teacher(d["t"], N)
    bad = st.map(lambda x: x.clone())
    bad.counts[0, 0, 0] += 1  # no longer sums to N
    with pytest.raises(ValueError, match="summing to samples"):
        topkd.sparse_kl_loss(d["s"], bad)
    dup = st.map(lambda x: x.clone())
    dup.indices[0, 0, 1] = dup.indices[0, 0, 0]
    dup.counts[0, 0, 1] = max(int(dup.counts[0, 0, 1]), 1)
    dup.counts[0, 0, 0] = N - int(dup.counts[0, 0, 1:].sum())
    with pytest.raises(ValueError, match="distinct"):
        topkd.sparse_kl_loss(d["s"], dup)
    # a padding row (mask False) may hold anything
    padded = bad.map(lambda x: x, mask=torch.ones(3, 5, dtype=torch.bool))
    padded.mask[0, 0] = False
    topkd.sparse_kl_loss(d["s"], padded)
    # so may a row the loss's own mask drops (refused before), and a bad kept row is named
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[0, 0] = False
    topkd.sparse_kl_loss(d["s"], bad, mask=mask)
    with pytest.raises(ValueError, match=r"row \(0, 0\) holds ids"):
        topkd.sparse_kl_loss(d["s"], bad)
    with pytest.raises(ValueError, match="vocab_size"):
        topkd.sparse_kl_loss(d["s"][..., :60], st)
    # its temperature (0: a NaN loss before) and its log-probs' dtype (ints: truncated before)
    with pytest.raises(ValueError, match="SampledTeacher.temperature"):
        topkd.sparse_kl_loss(d["s"], topkd.SampledTeacher(
            st.indices, st.counts, st.samples, 0.0, st.vocab_size, st.logprobs))
    with pytest.raises(TypeError, match="SampledTeacher.logprobs must be a floating"):
        topkd.sparse_kl_loss(d["s"], topkd.SampledTeacher(
            st.indices, st.counts, st.samples, st.temperature, st.vocab_size,
            st.logprobs.long()))


def test_compiled_kernels_equal_eager():
    """The sampled loss runs the Top-K path's compiled kernels (``impl="compile"``)."""
    d = kd_inputs(lead=(4, 6), v=200)
    st = sample_teacher(d["t"], N, seed=5, temperature=1.5)
    out = {}
    for impl in ("eager", "compile"):
        s = d["s"].clone().requires_grad_(True)
        loss = topkd.sparse_kl_loss(s, st, labels=d["labels"], ce_weight=0.5, impl=impl)
        loss.backward(d["go"])
        out[impl] = (loss.detach(), s.grad)
    torch.testing.assert_close(out["compile"][0], out["eager"][0], rtol=2e-6, atol=1e-6)
    torch.testing.assert_close(out["compile"][1], out["eager"][1], rtol=0, atol=1e-6)
