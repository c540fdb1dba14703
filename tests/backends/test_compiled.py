"""Compiled chunk kernels (``impl="compile"``): equal to ``impl="eager"`` for every kernel
variant, do not recompile when the row count changes, and fall back (or refuse) where the
platform cannot compile; ``$TOPKD_IMPL`` replaces the default.

The float64 reference matrix (test_losses, test_divergences, test_select, test_reductions,
test_numerics, test_fused) runs the eager kernels. Here the compiled ones are compared with
eager through the public functions, one case per kernel variant, to these tolerances:
loss 2e-6 relative, float32 gradients 1e-5 relative to their largest magnitude, bf16 / fp16
gradients within that bound plus one ulp of each other elementwise (``assert_agree``: the
float32 gradients agree to the bound and each is rounded once; where ``p`` and ``q`` agree to
5 digits, an entry of ``p - q`` carries float32 rounding of several bf16 ulps of itself, so
one ulp alone holds only where both round alike). The properties that
hold within one implementation (the same bits for any ``chunk_bytes``, a 2**20 offset changes
nothing, the selection against float64) are checked for the compiled kernels here too.

Kernel variants (``topkd.backends.compiled``'s kernels as the engine's paths, the selection and the
fused gradient call them) and the case that covers each (``CASES`` ids, ``*`` = one-pass
``sum``/``mean``, the others two-pass ``none``):

Top-K path (``sparse_statistics`` / ``sparse_gradient``)
  - no labels, T = 1 ........................ ``topk-plain``
  - labels, CE folded into the KD normalizer (T = 1): ``topk-labels_T1-reverse``,
    ``fused_topk-softcap-labels_T1*``
  - labels, CE with its own normalizer (T != 1): ``topk-labels_T2-tvd*`` (bf16),
    ``sparse-normalize_topk-labels_T1.5``, ``fused_topk-scale_softcap-labels_T1.5``
  - logit scale and softcap ................. ``fused_topk-scale_softcap-labels_T1.5``,
    ``fused_topk-softcap-labels_T1*``
  - normalize="topk", a SparseTeacher ....... ``sparse-normalize_topk-labels_T1.5``
  - top-p, teacher -inf entries ............. ``topk-top_p-jsd-neg_inf*``
  - float16 ................................. ``topk-fp16``
Full-vocabulary path (``dense_statistics`` / ``dense_terms`` / ``dense_gradient``), every
divergence with its own ``terms``:
  - KL ...................................... ``kl-labels_T2-neg_inf`` (labels, T != 1, -inf),
    ``kl-bf16*``; KL in either direction has its row sums from the statistics pass
    (``weighted``): ``test_centered_kl_rows_without_finite_sums``
  - reverse KL .............................. ``kl-reverse_kl-labels_T1*`` (bf16, labels at
    T = 1), ``kl-fp16-labels_T2`` (fp16, labels at T != 1)
  - JSD ..................................... ``kl-jsd-neg_inf*``,
    ``fused_kl-pair-scale_softcap-jsd`` (labels, T != 1)
  - skew KL ................................. ``kl-skew_kl-labels_T2``, ``kl-skew_kl-bf16``
  - skew reverse KL ......................... ``kl-skew_reverse_kl*`` (bf16),
    ``kl-skew_reverse_kl-labels_T2``
  - TVD ..................................... ``kl-tvd-labels_T2-neg_inf`` (labels, T != 1,
    -inf), ``kl-tvd-bf16*``
  - student and teacher scale and softcap ... ``fused_kl-pair-scale_softcap-jsd``,
    ``fused_kl-softcap-reverse_kl*``
  - a divergence without ``terms`` runs the eager path (``SquaredHellinger``)
Fused student head (the logits made per block, the gradients of hidden, weight and bias):
  every ``fused_*`` case; the weight's float32 accumulator (``accumulate_``: bf16 weight,
  staged blocks of 64 rows or more) ``fused_topk-bf16-80rows*``, ``fused_kl-pair-bf16-80rows``
Fused teacher head (the teacher's logits per block; its selection with a teacher scale and
softcap): ``fused_topk-pair_bias-teacher_softcap-top_p``, ``fused_topk-pair_bias-T2*``
  (the one-pass loss selects per chunk), ``fused_kl-pair-*``
Top-K selection (the sampled one, ``sample_threshold`` / ``threshold_scan`` /
``candidate_keys`` / ``sampled_finish``, where K is small next to the row; the exact one,
``read`` / ``log_sum_exp``, elsewhere and for rows the sample misleads): every ``topk*`` and
``fused_topk*`` case, and ``test_select_compiled`` (K = 1 / K < V / K = V, T != 1, top-p with
``top_p_min_k``, bf16 and fp16 ties, a peaky teacher's exact ghost, -inf entries, vocabulary
padding, rows the sample misleads among others in ``top_p-tiny-misled``) against eager and the
float64 reference
One row per kernel call (run as two), chunks of every height: ``test_no_recompiles_*``,
``test_compiled_chunk_bytes_change_no_bit``

Each kernel is compiled per configuration (its tensors' dtypes, which are None, the divergence,
the flags): every kernel meets every input and gradient dtype and every option that changes
its code, and every divergence meets each dtype and label setting. Their full cross product,
which the float64 matrix compiled when it also ran compiled, is not built: compiling is most
of what a compiled case costs.
"""

from __future__ import annotations

import warnings

import pytest
import reference as ref
import torch
from helpers import assert_teacher_matches, kd_inputs, leaves, misled_rows_
from torch._dynamo.utils import counters

import topkd
import topkd.backends
import topkd.backends.compiled

V, K, H, H_T = 96, 7, 16, 12
BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
NEG_INF = float("-inf")


def _data(dtype, lead=(4, 5), seed=0):
    return kd_inputs(dtype, seed, lead=lead, v=V, hidden=H, teacher_hidden=H_T)


def _with_neg_inf(d):
    """Teacher -inf entries: a row with its upper columns -inf (the student's too), a one-hot
    row, a row with every third column -inf."""
    d = dict(d)
    s, t = d["s"].clone(), d["t"].clone()
    s[0, 0, 60:] = t[0, 0, 60:] = NEG_INF
    t[0, 1, :] = NEG_INF
    t[0, 1, 5] = 0.0
    t[1, 0, ::3] = NEG_INF
    d["s"], d["t"] = s, t
    return d


def _call(loss, d, impl, **opts):
    """``(value, gradients)`` of one loss on fresh leaves."""
    fused = loss.startswith("fused")
    xs = leaves(*((d["h"], d["W"], d["b"]) if fused else (d["s"],)))
    t = d["t"]
    if loss == "sparse_kl_loss":
        select = {n: opts.pop(n) for n in ("temperature", "top_p", "top_p_min_k") if n in opts}
        teacher = topkd.select_topk(t, K, impl=impl, **select)
        out = topkd.sparse_kl_loss(xs[0], teacher, impl=impl, **opts)
    elif loss == "topk_kl_loss":
        out = topkd.topk_kl_loss(xs[0], t, K, impl=impl, **opts)
    elif loss == "kl_loss":
        out = topkd.kl_loss(xs[0], t, impl=impl, **opts)
    elif loss == "fused_topk_logits":
        out = topkd.fused_topk_kl_loss(*xs[:2], t, K, bias=xs[2], impl=impl, **opts)
    elif loss == "fused_topk_pair":  # a teacher LM head with a bias
        out = topkd.fused_topk_kl_loss(*xs[:2], (d["th"], d["tW"], d["tb"]), K, bias=xs[2],
                                       impl=impl, **opts)
    elif loss == "fused_kl_logits":
        out = topkd.fused_kl_loss(*xs[:2], t, bias=xs[2], impl=impl, **opts)
    else:
        assert loss == "fused_kl_pair"
        out = topkd.fused_kl_loss(*xs[:2], (d["th"], d["tW"]), bias=xs[2], impl=impl, **opts)
    out.backward(d["go"] if out.dim() else None)
    return out.detach(), [x.grad for x in xs]


def _ulp(x: torch.Tensor) -> torch.Tensor:
    """One ulp of ``x``'s dtype at each element (bf16: 8 significant bits; fp16: 11, and its
    subnormals' fixed spacing 2**-24)."""
    info = torch.finfo(x.dtype)
    bits = 8 if x.dtype == BF16 else 11
    e = torch.frexp(x.float().abs().clamp_min(info.tiny))[1]
    ulp = torch.ldexp(torch.ones_like(x, dtype=F32), e - bits)
    return ulp.clamp_min(info.smallest_normal * info.eps)


def assert_agree(eager, compiled, what):
    (le, ge), (lc, gc) = eager, compiled
    assert torch.equal(torch.isfinite(le), torch.isfinite(lc)), f"{what}: finite losses differ"
    le, lc = le[torch.isfinite(le)], lc[torch.isfinite(lc)]
    rel = ((lc.double() - le.double()).abs() / le.double().abs().clamp_min(1e-30)).max()
    assert rel <= 2e-6 or (lc - le).abs().max() <= 1e-7, f"{what}: loss rel diff {rel:.2e}"
    for a, b in zip(ge, gc, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.isfinite(a).all() and torch.isfinite(b).all(), f"{what}: gradient"
        scale = a.float().abs().max().clamp_min(1e-30)
        if a.dtype == F32:
            err = (a - b).abs().max() / scale
            assert err <= 1e-5, f"{what}: float32 gradient rel diff {err:.2e}"
        else:  # the float32 bound, then one rounding each: at most 1 ulp more
            ulp = torch.maximum(_ulp(a), _ulp(b))
            bad = (a.float() - b.float()).abs() > ulp + 1e-5 * scale
            assert not bad.any(), f"{what}: {int(bad.sum())} gradient entries > 1 ulp apart"


def _labels(ce_weight, **opts):
    return dict(opts, labels=True, ce_weight=ce_weight)


# id: (loss, dtype, reduction, options, rows [lead], -inf entries)
CASES = {
    # Top-K path
    "topk-plain": ("topk_kl_loss", F32, "none", {}, (4, 5), False),
    "topk-labels_T1-reverse": ("topk_kl_loss", F32, "none",
                               _labels(0.5, reverse=True), (4, 5), False),
    "topk-labels_T2-tvd": ("topk_kl_loss", BF16, "mean",
                           _labels(1.0, divergence="tvd", temperature=2.0), (4, 5), False),
    "topk-top_p-jsd-neg_inf": ("topk_kl_loss", F32, "sum",
                               dict(top_p=0.8, top_p_min_k=2, temperature=0.7,
                                    divergence=topkd.JSD(0.3)), (4, 5), True),
    "topk-fp16": ("topk_kl_loss", F16, "none", dict(top_p=0.9, reverse=True), (4, 5), False),
    "sparse-normalize_topk-labels_T1.5": ("sparse_kl_loss", F32, "none", _labels(
        0.3, normalize="topk", divergence=topkd.SkewReverseKL(0.2), temperature=1.5),
        (4, 5), False),
    "fused_topk-scale_softcap-labels_T1.5": ("fused_topk_logits", F32, "none", _labels(
        0.5, logit_scale=0.5, softcap=20.0, temperature=1.5, divergence="jsd"), (4, 5), False),
    "fused_topk-softcap-labels_T1": ("fused_topk_logits", BF16, "mean", _labels(
        1.0, softcap=8.0, divergence="reverse_kl"), (4, 5), False),
    # Full-vocabulary path: each divergence with its own terms
    "kl-labels_T2-neg_inf": ("kl_loss", F32, "none", _labels(0.5, temperature=2.0), (4, 5),
                             True),
    "kl-reverse_kl-labels_T1": ("kl_loss", BF16, "mean", _labels(1.0, divergence="reverse_kl"),
                                (4, 5), False),
    "kl-jsd-neg_inf": ("kl_loss", F32, "sum", dict(divergence=topkd.JSD(0.3), temperature=0.7),
                       (4, 5), True),
    "kl-skew_kl-labels_T2": ("kl_loss", F32, "none",
                             _labels(0.5, divergence=topkd.SkewKL(0.2), temperature=2.0),
                             (4, 5), True),
    "kl-skew_kl-bf16": ("kl_loss", BF16, "none", dict(divergence=topkd.SkewKL(0.6)), (4, 5),
                        False),
    "kl-skew_reverse_kl": ("kl_loss", BF16, "mean", dict(divergence=topkd.SkewReverseKL(0.2)),
                           (4, 5), False),
    "kl-skew_reverse_kl-labels_T2": ("kl_loss", F32, "none", _labels(
        0.5, divergence=topkd.SkewReverseKL(0.7), temperature=2.0), (4, 5), False),
    "kl-tvd-labels_T2-neg_inf": ("kl_loss", F32, "none",
                                 _labels(1.0, divergence="tvd", temperature=2.0), (4, 5), True),
    "kl-tvd-bf16": ("kl_loss", BF16, "sum", dict(divergence="tvd"), (4, 5), False),
    "kl-bf16": ("kl_loss", BF16, "mean", {}, (4, 5), False),
    "kl-fp16-labels_T2": ("kl_loss", F16, "none", _labels(0.5, reverse=True, temperature=2.0),
                          (4, 5), False),
    "fused_kl-pair-scale_softcap-jsd": ("fused_kl_pair", F32, "none", _labels(
        0.5, logit_scale=0.6, softcap=4.0, teacher_logit_scale=1.5, teacher_softcap=6.0,
        temperature=1.3, divergence=topkd.JSD(0.3)), (4, 5), False),
    "fused_kl-softcap-reverse_kl": ("fused_kl_logits", BF16, "mean", _labels(
        1.0, softcap=2.5, teacher_logit_scale=0.5, divergence="reverse_kl"), (4, 5), False),
    # Fused teacher head
    "fused_topk-pair_bias-teacher_softcap-top_p": ("fused_topk_pair", F32, "none", dict(
        teacher_logit_scale=0.5, teacher_softcap=6.0, top_p=0.9, divergence="skew_kl"),
        (4, 5), False),
    "fused_topk-pair_bias-T2": ("fused_topk_pair", BF16, "mean",
                                _labels(0.5, temperature=2.0, divergence="tvd"), (4, 5), False),
    # Fused student head with the weight's float32 accumulator (bf16, >= 64 staged rows)
    "fused_topk-bf16-80rows": ("fused_topk_logits", BF16, "mean", {}, (8, 10), False),
    "fused_topk-bf16-80rows-none": ("fused_topk_logits", BF16, "none",
                                    dict(temperature=2.0), (8, 10), False),
    "fused_kl-pair-bf16-80rows": ("fused_kl_pair", BF16, "none", dict(divergence="tvd"),
                                  (8, 10), False),
}


def case_inputs(case, device="cpu"):
    """``(loss, inputs on device, options)`` of a :data:`CASES` case."""
    loss, dtype, reduction, opts, lead, neg_inf = CASES[case]
    d = _data(dtype, lead)
    if neg_inf:
        d = _with_neg_inf(d)
    d = {name: x.to(device) for name, x in d.items()}
    opts = dict(opts, reduction=reduction)
    if opts.get("labels") is True:
        opts["labels"] = d["labels"]
    if reduction != "none":
        opts["mask"] = d["mask"]
    return loss, d, opts


@pytest.mark.parametrize("case", CASES)
def test_compile_equals_eager(case):
    loss, d, opts = case_inputs(case)
    assert_agree(_call(loss, d, "eager", **dict(opts)), _call(loss, d, "compile", **dict(opts)),
                 case)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_one_row_equals_eager(dtype):
    """A call of one row (each kernel runs on the row twice; the gradient kernels write the
    caller's rows in place, which must get the first row back) equals eager."""
    d = _data(dtype, lead=(1,), seed=3)
    for loss in ("topk_kl_loss", "kl_loss"):
        for reduction in ("none", "sum"):
            assert_agree(_call(loss, d, "eager", reduction=reduction),
                         _call(loss, d, "compile", reduction=reduction),
                         f"{loss}, one row, {reduction}")


@pytest.mark.parametrize("divergence", ["kl", "reverse_kl"])
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_centered_kl_rows_without_finite_sums(dtype, divergence, monkeypatch):
    """KL in either direction (its row sums from the statistics pass, as eager makes them,
    with no pass of ``dense_terms``) equals eager, NaN for NaN, on rows with infinities: a
    weight that underflows to 0 against a logit of -inf on the other side (``0 * inf``,
    counted 0), a -inf against the other side's mass (an infinite loss), both -inf, a teacher
    that is -inf everywhere, a student logit of +inf."""
    d = _data(dtype)
    s, t = d["s"].clone(), d["t"].clone()
    weights, other = (t, s) if divergence == "kl" else (s, t)
    weights[0, 0, 10] = weights[0, 0].max() - 300.0  # exp(-300) is 0 in float32
    other[0, 0, 10] = NEG_INF
    other[0, 1, 3] = NEG_INF
    s[1, 2, 7] = t[1, 2, 7] = NEG_INF
    t[1, 0] = NEG_INF
    s[1, 1, 5] = float("inf")
    d["s"], d["t"] = s, t

    def boom(*args):
        raise AssertionError("dense_terms ran")

    monkeypatch.setattr(topkd.backends.compiled, "dense_terms", boom)
    eager = _call("kl_loss", d, "eager", divergence=divergence)
    got = _call("kl_loss", d, "compile", divergence=divergence)
    (le, (ge,)), (lc, (gc,)) = eager, got
    for same in (torch.isnan, torch.isinf):
        assert torch.equal(same(le), same(lc)), (le, lc)
    assert torch.isfinite(lc[0, 0]) and torch.isinf(lc[0, 1]), lc
    assert torch.isfinite(lc[1, 2]) and torch.isnan(lc[1, :2]).all(), lc
    finite = torch.isfinite(le)  # a row whose loss is not finite has no gradient to agree on
    assert_agree((le[finite], [ge[finite]]), (lc[finite], [gc[finite]]),
                 f"{divergence}, {dtype}")


def test_agreement_check_can_fail():
    """The comparison above fails on a change above its tolerances (a check that could not
    fail would prove nothing)."""
    d = _data(F32)
    eager = _call("kl_loss", d, "eager")
    moved = (eager[0], [eager[1][0].clone()])
    moved[1][0][3, 4, 5] += 1e-3 * eager[1][0].abs().max()
    with pytest.raises(AssertionError, match="gradient"):
        assert_agree(eager, moved, "moved")
    with pytest.raises(AssertionError, match="loss"):
        assert_agree(eager, (eager[0] * (1 + 1e-5), eager[1]), "scaled")
    low = _call("kl_loss", _data(BF16), "eager")
    grad = low[1][0]
    for at in ((grad.abs() == grad.abs().max()).nonzero()[0],
               (1, 2, grad[1, 2].abs().argmax())):
        moved = grad.clone()  # the largest entry, another row's largest, 2 ulps up
        moved[tuple(at)] = moved[tuple(at)].float() * (1 + 2 ** -6)
        with pytest.raises(AssertionError, match="ulp"):
            assert_agree(low, (low[0], [moved]), "bf16 moved")


def test_divergence_without_terms_runs_eager(monkeypatch):
    """A user's divergence with only ``pointwise`` runs the eager full-vocabulary path under
    ``impl="compile"`` (its Top-K path, on the buckets, compiles): equal to eager."""

    class SquaredHellinger(topkd.Divergence):
        name = "squared_hellinger"

        def pointwise(self, logp, logq):
            return (torch.exp(0.5 * logq) - torch.exp(0.5 * logp)) ** 2

    d = _data(F32)
    for loss in ("kl_loss", "topk_kl_loss"):
        opts = dict(divergence=SquaredHellinger(), temperature=1.5)
        assert_agree(_call(loss, d, "eager", **opts), _call(loss, d, "compile", **opts),
                     f"{loss} SquaredHellinger")


# ------------------------------------------------------------------ Top-K selection


SELECT_CASES = {
    # id: (dtype, rows, width, k, options, teacher transform)
    "k1-T0.7": (F32, 15, 600, 1, dict(temperature=0.7), None),
    "k300-T2": (F32, 15, 600, 300, dict(temperature=2.0), None),
    "kV": (F32, 15, 600, 600, {}, None),
    "top_p-min_k": (F32, 16, 600, 40, dict(top_p=0.3, top_p_min_k=6), None),
    "top_p-tiny-misled": (F32, 16, 1000, 40, dict(top_p=1e-6, top_p_min_k=4), "misled"),
    "bf16-ties-top_p": (BF16, 12, 300, 64, dict(top_p=0.7, top_p_min_k=2), None),
    "fp16-ties-top_p": (F16, 12, 300, 64, dict(top_p=0.7, top_p_min_k=2), None),
    "peaky": (F32, 8, 1000, 16, {}, "peaky"),
    "neg_inf": (F32, 6, 64, 30, {}, "neg_inf"),
    "vocab_size": (F32, 4, 128, 10, dict(vocab_size=100), "padding"),
    # K large enough for the sample's threshold from pivots (compiled._pivot_ranks)
    "pivots-misled-T1.5": (F32, 8, 100_000, 2000, dict(temperature=1.5), "misled"),
    "pivots-bf16-ties": (BF16, 6, 100_000, 2000, {}, None),
}


def _select_teacher(dtype, rows, width, transform):
    g = torch.Generator().manual_seed(rows + width)
    if transform == "peaky":  # the top-K hold all but ~1e-13 of the mass: log q_g ~ -30
        t = torch.full((rows, width), -34.0)
        t[:, :16] = torch.rand(rows, 16, generator=g)
        t[:, 16:] += torch.rand(rows, width - 16, generator=g)
        return t
    if dtype != F32:  # many exact ties
        return (torch.randn(rows, width, generator=g) * 2).to(dtype)
    t = torch.randn(rows, width, generator=g) * 3
    if transform == "misled":  # rows the sampled selection leaves to the exact one
        misled_rows_(t, 40)
    elif transform == "neg_inf":
        t[:, 20:] = NEG_INF
        t[0, :] = NEG_INF
        t[0, 3] = 1.0
    elif transform == "padding":
        t[:, 100:] = 50.0  # would win every selection if they were looked at
    return t


def test_sample_threshold_is_the_highest_pivot_with_keep():
    """With pivots (a large ``keep``), the compiled sample threshold of each row is the highest
    pivot (sorted top values of every 4th entry, at the planned ranks) with at least ``keep``
    of the row at or above it, the last pivot where none has: rows of random values, a
    constant row, a row half -inf, a row whose largest values sit in the 4th entries."""
    from topkd.backends import compiled

    g = torch.Generator().manual_seed(11)
    sample = torch.randn(6, 8000, generator=g) * 3
    sample[3] = 0.5
    sample[4, :4000] = NEG_INF
    sample[5, ::4] += 20.0
    keep = 300
    pivots = compiled._pivot_ranks(sample.shape[1], keep)
    assert pivots is not None and compiled._pivot_ranks(sample.shape[1], 140) is None
    got = compiled.sample_threshold(sample, keep, pivots, 1.0, 1.0, None)
    lo, hi, step = pivots
    for row, t in zip(sample, got, strict=True):
        top = row[::4].sort(descending=True).values[lo:hi:step]
        enough = ((row[None, :] >= top[:, None]).sum(-1) >= keep).nonzero()[:, 0]
        want = top[enough[0]] if len(enough) else top[-1]
        assert t == want, (t, want)
    counts = (sample >= got[:, None]).sum(-1)
    assert (counts[:5] >= keep).all() and counts[3] == sample.shape[1]
    assert (counts[:3] < keep + 6 * 4 * pivots[2]).all(), counts


@pytest.mark.parametrize("rows, sync_free, float_count", [
    (1, False, True), (6, False, True), (8, False, True), (8, False, False),
    (1, True, True), (6, True, True)])
def test_scan_keys_are_the_eager_compactions(rows, sync_free, float_count, monkeypatch):
    """The compiled scan's candidate keys (the positions found by ``nonzero`` of words and
    bytes, whole words at 8 rows of 3,001, or ``nonzero_static`` as off a CPU, then placed,
    gathered and keyed in one kernel) and counts (the scan's float sum, or past its exact
    range the flags') are the eager compaction's bit for bit: rows of random values at T =
    1.5, a row with no entry at or above its threshold, a row over the capacity (kept to its
    first ``capacity + 1`` entries, or left out whole without a host sync), a row of -inf; one
    row (a doubled chunk); a chunk with no candidate at all (padded to two positions, so that
    it compiles no new graph)."""
    from topkd import topk
    from topkd.backends import compiled, eager

    monkeypatch.setattr(topk, "no_host_sync", lambda device: sync_free)
    if not float_count:
        monkeypatch.setattr(compiled, "_FLOAT_COUNT_COLUMNS", 0)
    g = torch.Generator().manual_seed(rows)
    low = (torch.randn(rows, 3001, generator=g) * 2).to(BF16)
    threshold = torch.full((rows,), 1.5)
    if rows > 1:
        threshold[1], threshold[2] = float("inf"), -10.0
        low[3] = NEG_INF
        threshold[3] = NEG_INF
    capacity, temperature, graphs = 400, 1.5, []
    for limits in (threshold, torch.full_like(threshold, float("inf"))):
        b = eager._read(low, temperature, 1.0, None, None)
        want_keys, want_count, _ = eager._Sampled.scan(b, limits / temperature, capacity)
        if rows > 1 and limits is threshold:  # the cases are there (without a host sync,
            # eager's compaction too leaves out a row over the capacity)
            full = 0 if sync_free else 3001
            assert want_count[1] == 0 and want_count[3] == full
            assert (want_count[2] > capacity) != sync_free
        sampled = compiled._Sampled(temperature, 1.0, None)
        keys, count, _ = sampled.scan(low, limits / temperature, capacity)
        assert torch.equal(count, want_count), (count, want_count)
        assert keys.shape == want_keys.shape == (rows, capacity + 1)
        assert torch.equal(keys, want_keys)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[1] == graphs[0], f"no candidate compiled a new graph: {graphs}"


@pytest.mark.parametrize("case", SELECT_CASES)
def test_select_compiled(case):
    """The compiled selection equals eager (indices and the kept and ghost log-probs) and the
    float64 reference, to test_select's tolerances."""
    dtype, rows, width, k, opts, transform = SELECT_CASES[case]
    t = _select_teacher(dtype, rows, width, transform)
    got = topkd.select_topk(t, k, impl="compile", **opts)
    eager = topkd.select_topk(t, k, impl="eager", **opts)
    assert torch.equal(got.indices, eager.indices)
    for a, b in ((got.logprobs, eager.logprobs), (got.rest_logprob, eager.rest_logprob)):
        assert torch.equal(torch.isfinite(a), torch.isfinite(b))
        torch.testing.assert_close(a[torch.isfinite(a)], b[torch.isfinite(b)], rtol=1e-6,
                                   atol=1e-6)
    r = ref.select(t, k, **{n: v for n, v in opts.items()
                            if n in ("top_p", "temperature", "vocab_size")},
                   top_p_min_k=opts.get("top_p_min_k", 1))
    if "top_p" in opts:
        assert ref.top_p_margin(r, opts["top_p"], opts.get("top_p_min_k", 1)) > 1e-5
    if transform == "peaky":
        assert float(r["rest_logprob"].max()) < -25
    assert_teacher_matches(got, r, k=k, vocab_size=opts.get("vocab_size", width),
                           temperature=opts.get("temperature", 1.0),
                           rest_rtol=1e-6 if transform == "peaky" else 1e-5)


# ----------------------------------------------- properties within the compiled kernels


CHUNKS = [1, 3000, 20000, None]  # 1 byte: the least rows per chunk; a few rows; the default


@pytest.mark.parametrize("loss,dtype", [("topk", BF16), ("kl", F32)])
def test_compiled_chunk_bytes_change_no_bit(loss, dtype):
    """As test_numerics' chunk tests: integer-valued logits (ties at the K-th value), the same
    bits for any chunk_bytes (a one-row kernel call runs as two rows for this), for the Top-K
    loss and the SparseTeacher loss; equal to eager."""
    n, v = 24, 200
    g = torch.Generator().manual_seed(5)
    s = torch.randint(-4, 5, (n, v), generator=g).to(dtype)
    t = torch.randint(-4, 5, (n, v), generator=g).to(dtype)
    d = {"s": s, "t": t, "go": torch.randn(n, generator=g)}
    results = []
    for cb in CHUNKS:
        if loss == "topk":
            opts = dict(top_p=0.8, top_p_min_k=3, chunk_bytes=cb)
            results.append(_call("topk_kl_loss", d, "compile", **opts))
            results.append(_call("sparse_kl_loss", d, "compile", **opts))
        else:
            results.append(_call("kl_loss", d, "compile", reverse=True, chunk_bytes=cb))
    for i, (loss_i, grads_i) in enumerate(results[1:], 1):
        assert torch.equal(results[0][0], loss_i), f"loss differs for case {i}"
        assert torch.equal(results[0][1][0], grads_i[0]), f"gradient differs for case {i}"
    if loss == "topk":
        eager = _call("topk_kl_loss", d, "eager", top_p=0.8, top_p_min_k=3)
    else:
        eager = _call("kl_loss", d, "eager", reverse=True)
    assert_agree(eager, results[0], f"{loss} compiled vs eager")


@pytest.mark.parametrize("loss,opts", [("topk", dict(top_p=0.9, top_p_min_k=2)),
                                       ("kl", dict(temperature=2.0))], ids=["topk", "kl"])
def test_compiled_offset_2_20_changes_nothing(loss, opts):
    """As test_numerics: a common offset of 2**20 on the student's and the teacher's logits
    changes the loss and gradient by at most 1e-6; equal to eager."""
    n, v = 10, 300
    g = torch.Generator().manual_seed(1)
    s = torch.randint(-64, 65, (n, v), generator=g).float() / 8  # exact with 2**20 added
    t = torch.randint(-64, 65, (n, v), generator=g).float() / 8
    go = torch.randn(n, generator=g)
    name = "topk_kl_loss" if loss == "topk" else "kl_loss"
    base = {"s": s, "t": t, "go": go}
    moved = {"s": s + 2.0 ** 20, "t": t + 2.0 ** 20, "go": go}
    l0, (g0,) = _call(name, base, "compile", **opts)
    l1, (g1,) = _call(name, moved, "compile", **opts)
    assert float((l1 - l0).abs().max() / l0.abs().max()) <= 1e-6, (l0, l1)
    assert float((g1 - g0).abs().max()) <= 1e-6, float((g1 - g0).abs().max())
    assert_agree(_call(name, base, "eager", **opts), (l1, [g1]), f"{loss} offset")


# ----------------------------------------------------------------------- no recompiles


@pytest.mark.parametrize("loss", ["topk_kl_loss", "kl_loss", "fused_kl_pair",
                                  "fused_topk_logits"])
def test_no_recompiles_across_row_counts(loss):
    """Eight calls with eight row counts (chunks of many heights, one row included): the
    compiled kernels are built by the first three calls and never again."""
    graphs = []
    for rows in (24, 37, 1, 64, 5, 50, 13, 2):
        d = _data(F32, lead=(rows,), seed=rows)
        for reduction in ("none", "mean"):
            _call(loss, d, "compile", reduction=reduction, chunk_bytes=3 * 4 * (V + 1) * 4)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[3:] == [graphs[2]] * 5, f"unique graphs after each call: {graphs}"


def test_candidate_positions_and_words_are_sized_apart():
    """The scan's word and position counts are equal in a chunk that is not whole words (one
    word per position) and differ in one that is: after a call with them equal, a call with
    them apart compiles no new graph (dynamo would otherwise take them for one size, and
    guard on it). The kernels' caches are reset first, so the first call compiles."""
    from topkd.backends import compiled

    torch._dynamo.reset()
    sampled, graphs = compiled._Sampled(1.0, 1.0, None), []
    for rows in (3, 8):  # 3 x 3,001 flags: not whole words; 8 x 3,001: whole words
        g = torch.Generator().manual_seed(rows)
        low = (torch.randn(rows, 3001, generator=g) * 2).to(BF16)
        words, at = compiled.topk.nonzero_words((low >= 1.0).view(torch.int8).view(-1))
        assert (words.shape[0] == at.shape[0]) == (rows == 3)
        sampled.scan(low, torch.full((rows,), 1.0), 2000)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[1] == graphs[0], f"unique graphs after each call: {graphs}"


def test_kernels_leave_torch_settings_as_found():
    """A kernel call raises dynamo's recompile limits (and, in a kernel whose sizes are apart,
    turns duck sizing off) only while it runs: nested, when the call raises, and after real
    kernel calls, one of them failing inside the compiled function, every value is back as
    found."""
    from torch.fx.experimental import _config as fx

    from topkd.backends import compiled

    dynamo = torch._dynamo.config
    name = "recompile_limit" if hasattr(dynamo, "recompile_limit") else "cache_size_limit"

    def current():
        return getattr(dynamo, name), getattr(dynamo, f"accumulated_{name}"), fx.use_duck_shape

    before, limits = current(), (compiled._RECOMPILE_LIMIT, 4 * compiled._RECOMPILE_LIMIT)
    assert before[:2] != limits
    seen = []
    with compiled._settings(True):
        seen.append(current())
        with compiled._settings(False):
            seen.append(current())
        seen.append(current())
    assert seen == [(*limits, before[2]), (*limits, False), (*limits, before[2])]
    assert current() == before
    with pytest.raises(RuntimeError, match="inside"), compiled._settings(False):
        raise RuntimeError("inside")
    assert current() == before
    low = torch.randn(4, 3001).to(BF16)
    compiled._Sampled(1.0, 1.0, None).scan(low, torch.full((4,), 1.0), 2000)
    assert current() == before
    with pytest.raises(Exception):  # noqa: B017 - whatever dynamo raises for a bad shape
        compiled.threshold_scan(low, torch.zeros(3), 1.0, 1.0, None)
    assert current() == before


@pytest.mark.parametrize("loss", ["topk_kl_loss", "kl_loss"])
def test_no_recompiles_at_default_chunks(loss):
    """A user's variable sequence lengths at the default chunk size: one chunk that is the
    whole logits tensor (a leaf that requires grad), chunks that are views of it, a last chunk
    of one row, a teacher selection whose ghost maximum is a column of its candidates. After
    the first call no row count compiles a new graph."""
    vocab, k = 5003, 40  # about 52 rows per chunk (the 1 MiB least budget)
    graphs = []
    for rows in (17, 64, 100, 129, 200, 231, 256, 299, 1, 2, 53):
        g = torch.Generator().manual_seed(rows)
        s = torch.randn(rows, vocab, generator=g).requires_grad_(True)
        t = torch.randn(rows, vocab, generator=g)
        if loss == "topk_kl_loss":
            out = topkd.topk_kl_loss(s, t, k, impl="compile", reduction="sum")
        else:
            out = topkd.kl_loss(s, t, impl="compile", reduction="sum")
        out.backward()
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[1:] == [graphs[0]] * (len(graphs) - 1), f"unique graphs after each: {graphs}"


def test_factor_of_one_is_left_out():
    """A kernel's temperature or logit scale of exactly 1 reaches it as None (its multiply or
    divide left out, as eager leaves it out); any other value, and a softcap of 1 (not a
    factor), reach it as given."""
    from topkd.backends.compiled import _compiled

    @_compiled
    def probe(x, temperature, logit_scale, softcap):
        seen = [temperature is None, logit_scale is None, softcap is None]
        return x + torch.tensor(seen, dtype=x.dtype)

    x = torch.zeros(2, 3)
    assert probe(x, 1.0, 1, 1.0)[0].tolist() == [1, 1, 0]
    assert probe(x, 2.0, 0.5, None)[0].tolist() == [0, 0, 1]
    assert probe(x, 1.0 + 2**-20, 1.0, 3.0)[0].tolist() == [0, 1, 0]


def test_recompile_counter_counts():
    """The counter above is live: a new dtype compiles new graphs."""
    before = counters["stats"]["unique_graphs"]
    _call("kl_loss", _data(torch.float16, lead=(9,)), "compile")
    assert counters["stats"]["unique_graphs"] > before


# ------------------------------------------------------------ choosing the implementation


@pytest.fixture
def no_compiler(monkeypatch):
    """A CPU without a usable C++ compiler, as inductor's own search sees it."""
    import torch._inductor.config as inductor_config

    monkeypatch.setattr(topkd.backends, "_warned", set())
    monkeypatch.delenv(topkd.backends.ENV, raising=False)
    with inductor_config.patch({"cpp.cxx": ("/nonexistent/c++",)}):
        assert topkd.backends.compiled.compiler_missing("cpu") is not None
        yield
    assert topkd.backends.compiled.compiler_missing("cpu") is None


def _forbid_compiled(monkeypatch):
    """Make every compiled kernel raise, so a call that uses one fails."""
    for name in ("sparse_statistics", "sparse_gradient", "dense_statistics", "dense_terms",
                 "dense_gradient", "read", "log_sum_exp", "sample_threshold", "threshold_scan",
                 "candidate_keys", "_kernel", "accumulate_"):
        def boom(*args, _name=name, **kwargs):
            raise AssertionError(f"compiled kernel {_name} ran")

        monkeypatch.setattr(topkd.backends.compiled, name, boom)


def test_auto_falls_back_with_one_warning(no_compiler, monkeypatch):
    d = _data(F32)
    expected = [_call(loss, d, "eager") for loss in ("topk_kl_loss", "kl_loss")]
    _forbid_compiled(monkeypatch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [_call(loss, d, "auto") for loss in ("topk_kl_loss", "kl_loss")]
        got.append(_call("topk_kl_loss", d, "auto"))
    ours = [w for w in caught if "topkd" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in ours]
    assert issubclass(ours[0].category, RuntimeWarning)
    assert "eager" in str(ours[0].message) and "compiler" in str(ours[0].message)
    for e, g in zip(expected, got[:2], strict=True):
        assert torch.equal(e[0], g[0]) and torch.equal(e[1][0], g[1][0])


def test_compile_without_compiler_is_an_error(no_compiler):
    d = _data(F32)
    with pytest.raises(RuntimeError, match="impl='compile'.*compiler"):
        _call("kl_loss", d, "compile")


def test_environment_variable_replaces_auto(monkeypatch):
    d = _data(F32)
    expected = _call("topk_kl_loss", d, "eager")
    monkeypatch.setenv("TOPKD_IMPL", "eager")
    _forbid_compiled(monkeypatch)
    got = _call("topk_kl_loss", d, "auto")  # would raise if a compiled kernel ran
    assert torch.equal(expected[0], got[0]) and torch.equal(expected[1][0], got[1][0])
    with pytest.raises(AssertionError, match="compiled kernel"):  # an explicit impl wins
        _call("topk_kl_loss", d, "compile")
    monkeypatch.setenv("TOPKD_IMPL", "fast")
    with pytest.raises(ValueError, match=r"TOPKD_IMPL.*'fast'"):
        _call("kl_loss", d, "auto")


def test_environment_compile_without_compiler_is_an_error(no_compiler, monkeypatch):
    monkeypatch.setenv("TOPKD_IMPL", "compile")
    with pytest.raises(RuntimeError, match="impl='compile'"):
        _call("kl_loss", _data(F32), "auto")


@pytest.mark.parametrize("call", [
    lambda d: topkd.kl_loss(d["s"], d["t"], impl="jit"),
    lambda d: topkd.topk_kl_loss(d["s"], d["t"], K, impl=None),
    lambda d: topkd.select_topk(d["t"], K, impl="Compile"),
    lambda d: topkd.fused_kl_loss(d["h"], d["W"], d["t"], impl=1),
    lambda d: topkd.LogitsKLLoss(impl="fast"),
    lambda d: topkd.FusedTopKLogitsKLLoss(K, impl="triton"),
], ids=["kl", "topk", "select", "fused", "module", "fused-module"])
def test_bad_impl_is_a_value_error(call):
    with pytest.raises(ValueError, match="impl must be one of"):
        call(_data(F32))


def test_modules_take_impl():
    d = _data(F32)
    for impl in ("eager", "compile"):
        loss = topkd.TopKLogitsKLLoss(K, impl=impl, reduction="sum")(d["s"], d["t"])
        fused = topkd.FusedLogitsKLLoss(impl=impl, reduction="sum")(d["h"], d["W"], d["t"])
        assert torch.isfinite(loss) and torch.isfinite(fused)
    assert "impl='compile'" in repr(topkd.TopKLogitsKLLoss(K, impl="compile"))


def test_inside_torch_compile_runs_eager_kernels(monkeypatch):
    """A loss traced by the user's own torch.compile runs the eager kernels (the outer
    compile fuses them) and equals eager."""
    d = _data(F32)
    _forbid_compiled(monkeypatch)
    fn = torch.compile(lambda s, t: topkd.kl_loss(s, t, reduction="sum"), backend="eager")
    got = fn(d["s"], d["t"])
    assert torch.allclose(got, topkd.kl_loss(d["s"], d["t"], reduction="sum", impl="eager"),
                          rtol=2e-6)


def test_compiled_gradient_chunk_is_not_float32_for_bf16(monkeypatch):
    """The compiled gradient of bf16 logits is written in bf16 (the sink's dtype), not as a
    float32 chunk converted afterwards."""
    seen = []
    real = topkd.backends.compiled.sparse_gradient

    def spy(*args):  # the kernel writes into its last argument and returns the kept entries
        columns, kept = real(*args)
        seen.extend((args[-1].dtype, kept.dtype))
        return columns, kept

    monkeypatch.setattr(topkd.backends.compiled, "sparse_gradient", spy)
    d = _data(BF16)
    _call("topk_kl_loss", d, "compile")
    assert seen and set(seen) == {BF16}


def test_compiling_says_so_once_per_configuration(caplog, monkeypatch):
    """The first call of a configuration stops for seconds: it is logged (a WARNING the first
    time in a process, shown by default, naming TOPKD_IMPL=eager; INFO for every kernel of a
    new configuration), and a second call of the same configuration logs nothing."""
    monkeypatch.setattr(topkd.backends.compiled, "_seen", set())  # as in a fresh process
    d = _data(F32)
    caplog.set_level("INFO", logger="topkd")
    topkd.kl_loss(d["s"], d["t"], impl="compile")
    warned = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and "TOPKD_IMPL=eager" in warned[0].getMessage()
    assert any(r.levelname == "INFO" and "compiling the" in r.getMessage()
               for r in caplog.records)
    caplog.clear()
    topkd.kl_loss(d["s"], d["t"], impl="compile")
    assert not caplog.records
    topkd.kl_loss(d["s"], d["t"], impl="eager")
    assert not caplog.records
    topkd.kl_loss(d["s"].bfloat16(), d["t"].bfloat16(), impl="compile")  # a new dtype
    assert caplog.records and all(r.levelname == "INFO" for r in caplog.records)
