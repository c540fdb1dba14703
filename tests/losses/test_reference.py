"""Checks of the float64 reference (reference.py) itself against textbook formulas: its KL,
reverse KL, selection, top-p, ghost bucket and gradients (no topkd). Its other divergences, CE
and reductions: test_reference_divergences.py."""

import reference as ref
import torch
import torch.nn.functional as F
from helpers import logits


def _direct_topk(z, t, k, T, reverse, normalize, given=None):
    """Probability-space formulas on a tiny example, written differently from reference.py.
    ``given``: per row, the selected vocabulary indices (default: the K largest teacher
    logits, ties to the lower index)."""
    p = torch.softmax(z / T, -1)
    q = torch.softmax(t / T, -1)
    out = []
    for i in range(z.shape[0]):
        if given is None:
            order = sorted(range(z.shape[1]), key=lambda j: (-float(t[i, j]), j))[:k]
        else:
            order = [int(j) for j in given[i]]
        pi, qi = p[i, order], q[i, order]
        if normalize == "topk":
            pi, qi = pi / pi.sum(), qi / qi.sum()
            pg = qg = None
        else:
            rest = [j for j in range(z.shape[1]) if j not in order]
            pg, qg = p[i, rest].sum(), q[i, rest].sum()
        w, v = (pi, qi) if reverse else (qi, pi)
        val = (w * (w.log() - v.log())).sum()
        if pg is not None and len(order) < z.shape[1]:
            wg, vg = (pg, qg) if reverse else (qg, pg)
            val = val + wg * (wg.log() - vg.log())
        out.append(val)
    return torch.stack(out)


def test_reference_matches_direct_formulas():
    z = logits(5, 13, dtype=torch.float64)
    t = logits(5, 13, dtype=torch.float64)
    for k in (1, 4, 13):
        for T in (1.0, 0.5, 3.0):
            for reverse in (False, True):
                for normalize in ("full", "topk"):
                    got = ref.topk_loss(z, t, k, temperature=T, reverse=reverse,
                                        normalize=normalize)
                    want = _direct_topk(z, t, k, T, reverse, normalize)
                    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


def test_reference_full_vocabulary_kl_is_kl_div_and_k_equals_v():
    z = logits(4, 3, 50, dtype=torch.float64)
    t = logits(4, 3, 50, dtype=torch.float64)
    want = F.kl_div(F.log_softmax(z, -1), F.log_softmax(t, -1), log_target=True,
                    reduction="none").sum(-1)
    torch.testing.assert_close(ref.full_loss(z, t), want, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(ref.topk_loss(z, t, 50), want, rtol=1e-12, atol=1e-14)


def test_reference_gradient_closed_form():
    # d/dz of forward full KL at temperature T is (p - q) / T.
    z = logits(6, 40, dtype=torch.float64)
    t = logits(6, 40, dtype=torch.float64)
    T = 1.7
    _, g = ref.loss_and_grad(ref.full_loss, z, t, temperature=T)
    want = (torch.softmax(z / T, -1) - torch.softmax(t / T, -1)) / T
    torch.testing.assert_close(g, want, rtol=1e-10, atol=1e-14)


def test_reference_top_p_and_ties():
    t = torch.tensor([[3.0, 1.0, 3.0, 2.0, 1.0, 0.0]], dtype=torch.float64)
    sel = ref.select(t, 4)
    assert sel["indices"].tolist() == [[0, 2, 3, 1]]
    q = torch.softmax(t, -1)[0]
    # entry r kept when sum of the r entries before it < top_p
    p0 = float(q[0]) + 1e-9  # keeps entries 0 and 1 only
    sel = ref.select(t, 4, top_p=p0)
    assert sel["indices"].tolist() == [[0, 2, -1, -1]]
    assert sel["logprobs"][0, 2:].eq(float("-inf")).all()
    sel = ref.select(t, 4, top_p=p0, top_p_min_k=3)
    assert sel["indices"].tolist() == [[0, 2, 3, -1]]
    rest = torch.log(q[[1, 4, 5]].sum())
    torch.testing.assert_close(sel["rest_logprob"][0], rest, rtol=1e-14, atol=0)


def test_reference_neg_inf_teacher_and_empty_ghost_give_no_nan():
    z = logits(3, 10, dtype=torch.float64)
    t = logits(3, 10, dtype=torch.float64)
    t[:, 4:] = float("-inf")
    for k in (4, 6, 10):
        for normalize in ("full", "topk"):
            loss, g = ref.loss_and_grad(ref.topk_loss, z, t, k, normalize=normalize)
            assert torch.isfinite(loss).all() and torch.isfinite(g).all()
    loss, g = ref.loss_and_grad(ref.topk_loss, z, t, 10)
    torch.testing.assert_close(loss, ref.full_loss(z, t))
    want = torch.softmax(z, -1) - torch.softmax(t, -1)
    torch.testing.assert_close(g, want, rtol=1e-10, atol=1e-14)


def test_reference_given_selection():
    # indices= replaces the K largest by another selection (a peer's torch.topk, whose ties can
    # fall to either entry): the buckets are that selection and the ghost the rest, by hand.
    t = torch.tensor([[3.0, 1.0, 3.0, 2.0, 1.0, 0.0],
                      [0.5, 2.0, 2.0, 2.0, -1.0, 1.0]], dtype=torch.float64)
    z = logits(2, 6, dtype=torch.float64)
    own = ref.select(t, 3)["indices"]
    assert own.tolist() == [[0, 2, 3], [1, 2, 3]]
    given = torch.tensor([[2, 0, 3], [3, 1, 5]])  # row 0: the same set; row 1: another one
    sel = ref.select(t, 3, indices=given)
    assert sel["indices"].tolist() == given.tolist()
    q = torch.softmax(t, -1)
    torch.testing.assert_close(sel["logprobs"], q.gather(-1, given).log(), rtol=1e-14, atol=0)
    rest = torch.stack([q[0, [1, 4, 5]].sum(), q[1, [0, 2, 4]].sum()]).log()
    torch.testing.assert_close(sel["rest_logprob"], rest, rtol=1e-14, atol=0)
    for reverse in (False, True):
        for normalize in ("full", "topk"):
            kw = dict(temperature=1.5, reverse=reverse, normalize=normalize)
            got = ref.topk_loss(z, t, 3, indices=given, **kw)
            want = _direct_topk(z, t, 3, 1.5, reverse, normalize, given=given.tolist())
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
            # the same set as the reference's own selection: the same loss
            torch.testing.assert_close(got[0], ref.topk_loss(z, t, 3, **kw)[0], rtol=1e-14,
                                       atol=0)
