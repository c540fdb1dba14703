"""Checks of the float64 reference's divergences, CE and combination (no topkd).

The expected values are computed by hand in plain Python floats (``math.log``) from each
divergence's formula (``_hand``), independently of the torch code in reference.py.
"""

import math

import pytest
import reference as ref
import torch
import torch.nn.functional as F
from helpers import logits

Q = [0.5, 0.3, 0.2]  # teacher
P = [0.2, 0.2, 0.6]  # student


def _kl(a, b):
    return sum(x * math.log(x / y) for x, y in zip(a, b, strict=True) if x > 0)


def _mix(c, a, b):
    return [c * x + (1 - c) * y for x, y in zip(a, b, strict=True)]


def _hand(name, c, q, p):
    """Each divergence's formula in Python floats (q teacher, p student)."""
    if name == "kl":
        return _kl(q, p)
    if name == "reverse_kl":
        return _kl(p, q)
    if name == "jsd":
        if c == 0:
            return _kl(q, p)
        if c == 1:
            return _kl(p, q)
        m = _mix(c, q, p)
        return c * _kl(q, m) + (1 - c) * _kl(p, m)
    if name == "skew_kl":
        return _kl(q, _mix(c, q, p))
    if name == "skew_reverse_kl":
        return _kl(p, _mix(c, p, q))
    assert name == "tvd"
    return 0.5 * sum(abs(x - y) for x, y in zip(q, p, strict=True))


def _as_logits(probs):
    return torch.tensor([math.log(x) for x in probs], dtype=torch.float64)


def _hand_rows(name, c, z, t, k, normalize, temperature=1.0):
    """``_hand`` per row of ``[..., V]`` logits over the Top-K buckets, formed by hand: the K
    largest teacher entries (ties to the lower index) plus the rest as one ghost bucket, or
    the K entries alone renormalized (``normalize="topk"``)."""
    v = z.shape[-1]
    p = torch.softmax(z / temperature, -1).reshape(-1, v).tolist()
    q = torch.softmax(t / temperature, -1).reshape(-1, v).tolist()
    tl = t.reshape(-1, v).tolist()
    out = []
    for pi, qi, ti in zip(p, q, tl, strict=True):
        top = sorted(range(v), key=lambda j: (-ti[j], j))[:k]
        rest = [j for j in range(v) if j not in top]
        qb, pb = [qi[j] for j in top], [pi[j] for j in top]
        if normalize == "topk":
            qb = [x / sum(qb) for x in qb]
            pb = [x / sum(pb) for x in pb]
        elif rest:
            qb.append(sum(qi[j] for j in rest))
            pb.append(sum(pi[j] for j in rest))
        out.append(_hand(name, c, qb, pb))
    return torch.tensor(out, dtype=torch.float64).reshape(z.shape[:-1])


SPECS = [("kl", None), ("reverse_kl", None), ("jsd", 0.0), ("jsd", 0.1), ("jsd", 0.5),
         ("jsd", 0.9), ("jsd", 1.0), ("skew_kl", 0.0), ("skew_kl", 0.1), ("skew_kl", 1.0),
         ("skew_reverse_kl", 0.1), ("skew_reverse_kl", 0.7), ("tvd", None)]


def _spec(name, c):
    return name if c is None else (name, c)


def test_jsd_half_by_hand():
    # M = (0.35, 0.25, 0.4); JSD = 0.5 KL(q||M) + 0.5 KL(p||M), all by hand.
    m = [0.35, 0.25, 0.4]
    want = 0.5 * (0.5 * math.log(0.5 / 0.35) + 0.3 * math.log(0.3 / 0.25)
                  + 0.2 * math.log(0.2 / 0.4)) + 0.5 * (
        0.2 * math.log(0.2 / 0.35) + 0.2 * math.log(0.2 / 0.25) + 0.6 * math.log(0.6 / 0.4))
    assert m == pytest.approx(_mix(0.5, Q, P), abs=1e-15)
    got = ref.full_loss(_as_logits(P), _as_logits(Q), divergence=("jsd", 0.5))
    assert float(got) == pytest.approx(want, rel=1e-13)
    assert 0 < want < math.log(2)


def test_tvd_by_hand():
    got = ref.full_loss(_as_logits(P), _as_logits(Q), divergence="tvd")
    assert float(got) == pytest.approx(0.5 * (0.3 + 0.1 + 0.4), rel=1e-13)


@pytest.mark.parametrize("name,c", SPECS)
def test_full_vocabulary_matches_hand_formula(name, c):
    got = ref.full_loss(_as_logits(P), _as_logits(Q), divergence=_spec(name, c))
    assert float(got) == pytest.approx(_hand(name, c, Q, P), rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("name,c", SPECS)
def test_topk_buckets_match_hand_formula(name, c):
    # V = 5, K = 2: buckets are the teacher's two largest entries plus one ghost bucket
    # holding the rest; normalize="topk" renormalizes the two entries alone.
    q = [0.05, 0.4, 0.1, 0.3, 0.15]
    p = [0.3, 0.1, 0.25, 0.2, 0.15]
    z, t = _as_logits(p), _as_logits(q)
    full = ref.topk_loss(z, t, 2, divergence=_spec(name, c))
    qb, pb = [0.4, 0.3, 0.05 + 0.1 + 0.15], [0.1, 0.2, 0.3 + 0.25 + 0.15]
    assert float(full) == pytest.approx(_hand(name, c, qb, pb), rel=1e-12, abs=1e-15)
    topk = ref.topk_loss(z, t, 2, divergence=_spec(name, c), normalize="topk")
    qr, pr = [0.4 / 0.7, 0.3 / 0.7], [0.1 / 0.3, 0.2 / 0.3]
    assert float(topk) == pytest.approx(_hand(name, c, qr, pr), rel=1e-12, abs=1e-15)


def test_endpoints_and_aliases_are_exact():
    z = logits(4, 3, 17, dtype=torch.float64)
    t = logits(4, 3, 17, dtype=torch.float64)
    for k, normalize in ((17, "full"), (5, "full"), (5, "topk")):
        kw = dict(normalize=normalize)
        kl = ref.topk_loss(z, t, k, **kw)
        rkl = ref.topk_loss(z, t, k, reverse=True, **kw)
        # KL and reverse KL over the buckets, formed by hand
        torch.testing.assert_close(kl, _hand_rows("kl", None, z, t, k, normalize),
                                   rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(rkl, _hand_rows("reverse_kl", None, z, t, k, normalize),
                                   rtol=1e-12, atol=1e-14)
        assert torch.equal(ref.topk_loss(z, t, k, divergence="reverse_kl", **kw), rkl)
        # JSD endpoints and SkewKL(alpha=0) are exactly (bitwise) KL / reverse KL
        assert torch.equal(ref.topk_loss(z, t, k, divergence=("jsd", 0.0), **kw), kl)
        assert torch.equal(ref.topk_loss(z, t, k, divergence=("jsd", 1.0), **kw), rkl)
        assert torch.equal(ref.topk_loss(z, t, k, divergence=("skew_kl", 0.0), **kw), kl)
        assert torch.equal(ref.topk_loss(z, t, k, divergence=("skew_reverse_kl", 0.0), **kw),
                           rkl)
        # alpha = 1: the target is the distribution itself
        assert ref.topk_loss(z, t, k, divergence=("skew_kl", 1.0), **kw).eq(0).all()
        # default parameters
        assert torch.equal(ref.topk_loss(z, t, k, divergence="jsd", **kw),
                           ref.topk_loss(z, t, k, divergence={"name": "jsd", "beta": 0.5}, **kw))
        assert torch.equal(ref.topk_loss(z, t, k, divergence="skew_kl", **kw),
                           ref.topk_loss(z, t, k, divergence=("skew_kl", 0.1), **kw))


@pytest.mark.parametrize("name,c", SPECS)
def test_k_equals_v_is_full_vocabulary(name, c):
    z = logits(3, 4, 23, dtype=torch.float64)
    t = logits(3, 4, 23, dtype=torch.float64)
    for temperature in (1.0, 2.5):
        full = ref.full_loss(z, t, divergence=_spec(name, c), temperature=temperature)
        topk = ref.topk_loss(z, t, 23, divergence=_spec(name, c), temperature=temperature)
        torch.testing.assert_close(topk, full, rtol=1e-13, atol=1e-15)
        # and both equal the direct probability-space formula row by row
        p = torch.softmax(z / temperature, -1).reshape(-1, 23)
        q = torch.softmax(t / temperature, -1).reshape(-1, 23)
        want = [_hand(name, c, q[i].tolist(), p[i].tolist()) for i in range(p.shape[0])]
        torch.testing.assert_close(full.reshape(-1), torch.tensor(want, dtype=torch.float64),
                                   rtol=1e-11, atol=1e-14)


@pytest.mark.parametrize("name,c", SPECS)
def test_identity_is_zero_and_jsd_symmetric(name, c):
    z = logits(5, 11, dtype=torch.float64)
    t = logits(5, 11, dtype=torch.float64)
    for k, normalize in ((11, "full"), (4, "full"), (4, "topk")):
        same = ref.topk_loss(z, z, k, divergence=_spec(name, c), normalize=normalize)
        torch.testing.assert_close(same, torch.zeros_like(same), rtol=0, atol=1e-14)
    if name == "jsd" and c == 0.5:
        torch.testing.assert_close(ref.full_loss(z, t, divergence="jsd"),
                                   ref.full_loss(t, z, divergence="jsd"), rtol=1e-13, atol=0)


def test_tvd_gradient_closed_form():
    # d/dz_j of 0.5 sum_i |p_i - q_i| = 0.5 p_j (s_j - sum_i p_i s_i) / T, s = sign(p - q)
    z = logits(6, 30, dtype=torch.float64)
    t = logits(6, 30, dtype=torch.float64)
    T = 1.7
    _, g = ref.loss_and_grad(ref.full_loss, z, t, divergence="tvd", temperature=T)
    p, q = torch.softmax(z / T, -1), torch.softmax(t / T, -1)
    s = torch.sign(p - q)
    want = 0.5 * p * (s - (p * s).sum(-1, keepdim=True)) / T
    torch.testing.assert_close(g, want, rtol=1e-10, atol=1e-15)


@pytest.mark.parametrize("name,c", [("jsd", 0.3), ("skew_kl", 0.2), ("skew_reverse_kl", 0.4)])
def test_gradcheck(name, c):
    z = logits(3, 9, dtype=torch.float64).requires_grad_(True)
    t = logits(3, 9, dtype=torch.float64)
    for k, normalize in ((9, "full"), (3, "full"), (3, "topk")):
        def fn(x, k=k, normalize=normalize):
            return ref.topk_loss(x, t, k, divergence=(name, c), normalize=normalize,
                                 temperature=1.3)

        torch.autograd.gradcheck(fn, (z,))


def _check_zero_mass(loss, g, reverse_like, what):
    assert not torch.isnan(loss).any(), what
    if not reverse_like:
        assert torch.isfinite(loss).all() and torch.isfinite(g).all(), what
    else:  # an infinite row has no meaningful gradient; every finite row has a finite one
        fin = torch.isfinite(loss.reshape(-1))
        assert torch.isfinite(g.reshape(fin.shape[0], -1)[fin]).all(), what


@pytest.mark.parametrize("name,c", SPECS)
def test_zero_mass_entries_give_finite_gradients(name, c):
    # -inf teacher logits (q = 0 exactly), an empty ghost (K = number of finite entries),
    # top-p dropped slots, and a student with -inf logits: value and gradient stay finite.
    z = logits(3, 10, dtype=torch.float64)
    t = logits(3, 10, dtype=torch.float64)
    t[:, 6:] = float("-inf")
    spec = _spec(name, c)
    # KL(p || q) is +inf when the student has mass on a bucket where q = 0 (an empty-of-q
    # ghost, or whole-vocabulary entries with q = 0): that is the right value, never NaN.
    reverse_like = name == "reverse_kl" or (name == "jsd" and c == 1.0)
    for k, normalize, top_p in ((6, "full", None), (10, "full", None), (4, "full", None),
                                (4, "topk", None), (6, "full", 0.5), (6, "topk", 0.5)):
        loss, g = ref.loss_and_grad(ref.topk_loss, z, t, k, divergence=spec,
                                    normalize=normalize, top_p=top_p)
        _check_zero_mass(loss, g, reverse_like, (k, normalize, top_p))
    loss, g = ref.loss_and_grad(ref.full_loss, z, t, divergence=spec)
    _check_zero_mass(loss, g, reverse_like, "full vocabulary")
    zi = z.clone()
    zi[:, :2] = float("-inf")  # p = 0 on entries where q > 0: KL(q||p) is +inf, others finite
    tf = logits(3, 10, dtype=torch.float64)
    loss = ref.full_loss(zi, tf, divergence=spec)
    if name == "kl" or (name in ("jsd", "skew_kl") and c == 0.0):
        assert torch.isinf(loss).all()
    else:
        _, g = ref.loss_and_grad(ref.full_loss, zi, tf, divergence=spec)
        assert torch.isfinite(loss).all() and torch.isfinite(g).all()


def test_cross_entropy_matches_torch_and_ignores():
    z = logits(4, 5, 37, dtype=torch.float64)
    labels = torch.randint(0, 37, (4, 5))
    labels[0, :3] = -100
    ce, has = ref.cross_entropy_rows(z, labels)
    want = F.cross_entropy(z.reshape(-1, 37), labels.reshape(-1), reduction="none")
    torch.testing.assert_close(ce, want, rtol=1e-14, atol=0)
    assert has.tolist() == (labels.reshape(-1) != -100).tolist()
    # vocab_size: the padded columns are outside the softmax
    zp = torch.cat([z, torch.full((4, 5, 3), 9.0, dtype=torch.float64)], -1)
    ce_p, _ = ref.cross_entropy_rows(zp, labels, vocab_size=37)
    torch.testing.assert_close(ce_p, want, rtol=1e-14, atol=0)
    lab2 = labels.clone()
    lab2[lab2 == -100] = 7
    ce2, has2 = ref.cross_entropy_rows(z, torch.where(labels == -100, 7, labels), ignore_index=7)
    assert has2.tolist() == (lab2.reshape(-1) != 7).tolist()


def test_transform_logits():
    x = torch.tensor([-50.0, -1.0, 0.0, 0.5, 30.0], dtype=torch.float64)
    torch.testing.assert_close(ref.transform_logits(x), x)
    torch.testing.assert_close(ref.transform_logits(x, 0.5), 0.5 * x)
    y = ref.transform_logits(x, 2.0, 10.0)
    want = torch.tensor([10.0 * math.tanh(2.0 * float(v) / 10.0) for v in x],
                        dtype=torch.float64)
    torch.testing.assert_close(y, want, rtol=1e-15, atol=0)
    assert float(y.abs().max()) < 10.0


def test_combination_reductions_by_hand():
    v = 13
    z = logits(2, 3, v, dtype=torch.float64)
    t = logits(2, 3, v, dtype=torch.float64)
    labels = torch.tensor([[1, -100, 4], [0, 12, -100]])
    mask = torch.tensor([[True, True, False], [True, False, True]])
    kd = ref.full_loss(z, t, divergence="jsd").reshape(-1)
    ce = F.cross_entropy(z.reshape(-1, v), labels.reshape(-1), reduction="none",
                         ignore_index=-100)
    m, lab = mask.reshape(-1), labels.reshape(-1)
    kd_keep = m
    ce_keep = m & (lab != -100)  # rows 0 and 3
    assert int(kd_keep.sum()) == 4 and int(ce_keep.sum()) == 2
    kw = dict(divergence="jsd", labels=labels, mask=mask, kd_weight=0.7, ce_weight=0.3,
              return_components=True)
    loss, kdr, cer = ref.full_loss(z, t, reduction="mean", **kw)
    want_kd = float(kd[kd_keep].sum()) / 4
    want_ce = float(ce[ce_keep].sum()) / 2
    assert float(kdr) == pytest.approx(want_kd, rel=1e-13)
    assert float(cer) == pytest.approx(want_ce, rel=1e-13)
    assert float(loss) == pytest.approx(0.7 * want_kd + 0.3 * want_ce, rel=1e-13)
    loss, kdr, cer = ref.full_loss(z, t, reduction="sum", **kw)
    assert float(loss) == pytest.approx(0.7 * float(kd[kd_keep].sum())
                                        + 0.3 * float(ce[ce_keep].sum()), rel=1e-13)
    loss, kdr, cer = ref.full_loss(z, t, reduction="none", **kw)
    assert loss.shape == (2, 3) and kdr.shape == (2, 3) and cer.shape == (2, 3)
    want_rows = 0.7 * torch.where(kd_keep, kd, 0.0) + 0.3 * torch.where(ce_keep, ce, 0.0)
    torch.testing.assert_close(loss.reshape(-1), want_rows, rtol=1e-13, atol=0)
    # no kept rows: "mean" is 0 with zero gradient; no CE rows: the CE part is 0
    none = torch.zeros(2, 3, dtype=torch.bool)
    l0, g0 = ref.loss_and_grad(ref.full_loss, z, t, divergence="jsd", labels=labels, mask=none,
                               ce_weight=1.0, reduction="mean")
    assert float(l0) == 0.0 and g0.eq(0).all()
    all_ignored = torch.full((2, 3), -100)
    loss, kdr, cer = ref.full_loss(z, t, divergence="jsd", reduction="mean",
                                   labels=all_ignored, ce_weight=1.0,
                                   return_components=True)
    assert float(cer) == 0.0 and float(loss) == pytest.approx(float(kd.mean()), rel=1e-13)


def test_zero_weights_are_exactly_zero():
    z = logits(3, 8, dtype=torch.float64)
    t = logits(3, 8, dtype=torch.float64)
    labels = torch.tensor([1, 2, 3])
    # KD alone: gradient is the KD gradient (the CE part is absent, not 0 * CE)
    _, g_kd = ref.loss_and_grad(ref.full_loss, z, t, divergence="tvd", labels=labels,
                                reduction="sum")
    _, g_only = ref.loss_and_grad(ref.full_loss, z, t, divergence="tvd", reduction="sum")
    assert torch.equal(g_kd, g_only)
    # CE alone: kd_weight = 0 gives exactly the CE, and its gradient softmax - onehot
    zi = z.clone()
    zi[0, 5] = float("-inf")  # makes KL(q || p) infinite; must not leak into a 0-weight KD
    loss, g = ref.loss_and_grad(ref.full_loss, zi, t, labels=labels, kd_weight=0.0,
                                ce_weight=1.0, reduction="sum")
    torch.testing.assert_close(loss, F.cross_entropy(zi, labels, reduction="sum"))
    want = torch.softmax(zi, -1) - F.one_hot(labels, 8)
    torch.testing.assert_close(g, want, rtol=1e-12, atol=1e-15)


def test_ce_after_transform_kd_after_temperature():
    z = logits(4, 19, dtype=torch.float64)
    t = logits(4, 19, dtype=torch.float64)
    labels = torch.tensor([3, 0, 18, 7])
    T, s, cap, ts, tcap = 2.0, 0.8, 3.0, 1.2, 4.0
    zt, tt = ref.transform_logits(z, s, cap), ref.transform_logits(t, ts, tcap)
    loss, kd, ce = ref.full_loss(z, t, divergence="skew_kl", temperature=T, labels=labels,
                                 ce_weight=0.5, reduction="sum", logit_scale=s, softcap=cap,
                                 teacher_logit_scale=ts, teacher_softcap=tcap,
                                 return_components=True)
    p, q = torch.softmax(zt / T, -1), torch.softmax(tt / T, -1)
    want_kd = sum(_hand("skew_kl", 0.1, q[i].tolist(), p[i].tolist()) for i in range(4))
    want_ce = float(F.cross_entropy(zt, labels, reduction="sum"))  # temperature 1
    assert float(kd) == pytest.approx(want_kd, rel=1e-12)
    assert float(ce) == pytest.approx(want_ce, rel=1e-13)
    assert float(loss) == pytest.approx(want_kd + 0.5 * want_ce, rel=1e-12)


def test_linear_loss_and_grads():
    h = logits(5, 6, dtype=torch.float64)
    w = logits(11, 6, scale=0.5, dtype=torch.float64)
    b = logits(11, dtype=torch.float64)
    t = logits(5, 11, dtype=torch.float64)
    loss, gh, gw, gb = ref.linear_loss_and_grads(ref.full_loss, h, w, t, bias=b,
                                                 divergence="jsd", reduction="sum")
    _, gz = ref.loss_and_grad(ref.full_loss, h @ w.T + b, t, divergence="jsd", reduction="sum")
    torch.testing.assert_close(gh, gz @ w, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(gw, gz.T @ h, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(gb, gz.sum(0), rtol=1e-12, atol=1e-15)
