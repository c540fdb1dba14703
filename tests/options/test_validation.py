"""Every bad input raises ValueError / TypeError naming the argument, before any work."""

import math
import re

import pytest
import torch

import topkd

V = 96
ERR = (ValueError, TypeError)


def _st():
    return torch.randn(4, V), torch.randn(4, V)


def _calls(s, t, **kw):
    """Every public entry point that takes (student, teacher) logits, with the same options."""
    k = kw.pop("k", 8)
    topk_kw = kw
    yield "topk_kl_loss", lambda: topkd.topk_kl_loss(s, t, k, **topk_kw)
    yield "TopKLogitsKLLoss", lambda: topkd.TopKLogitsKLLoss(k, **topk_kw)(s, t)


# ---------------------------------------------------------------- vocabulary widths


def test_width_mismatch_names_both_widths():
    s = torch.randn(3, 96)
    t = torch.randn(3, 128)
    for f in (lambda: topkd.topk_kl_loss(s, t, 4), lambda: topkd.kl_loss(s, t),
              lambda: topkd.topk_kl_loss(t, s, 4), lambda: topkd.kl_loss(t, s),
              lambda: topkd.TopKLogitsKLLoss(4)(s, t), lambda: topkd.LogitsKLLoss()(s, t)):
        with pytest.raises(ValueError) as e:
            f()
        assert "96" in str(e.value) and "128" in str(e.value), str(e.value)


def test_width_mismatch_vocab_size_must_fit_inside_both():
    s = torch.randn(3, 96)
    t = torch.randn(3, 128)
    # fits inside both: fine
    topkd.topk_kl_loss(s, t, 4, vocab_size=90)
    topkd.kl_loss(s, t, vocab_size=96)
    # does not fit inside the student
    with pytest.raises(ValueError, match="vocab_size"):
        topkd.topk_kl_loss(s, t, 4, vocab_size=100)
    with pytest.raises(ValueError, match="vocab_size"):
        topkd.kl_loss(s, t, vocab_size=128)


@pytest.mark.parametrize("bad", [0, -1, V + 1])
def test_vocab_size_out_of_range(bad):
    s, t = _st()
    with pytest.raises(ERR, match="vocab_size"):
        topkd.topk_kl_loss(s, t, 1, vocab_size=bad)
    with pytest.raises(ERR, match="vocab_size"):
        topkd.kl_loss(s, t, vocab_size=bad)
    with pytest.raises(ERR, match="vocab_size"):
        topkd.select_topk(t, 1, vocab_size=bad)


def test_sparse_teacher_vocab_mismatch():
    st = topkd.select_topk(torch.randn(3, 128), 4)
    assert st.vocab_size == 128
    with pytest.raises(ValueError) as e:
        topkd.sparse_kl_loss(torch.randn(3, 96), st)
    assert "96" in str(e.value) and "128" in str(e.value), str(e.value)
    with pytest.raises(ValueError, match="vocab_size"):
        topkd.sparse_kl_loss(torch.randn(3, 128), st, vocab_size=120)
    # a padded student with vocab_size equal to the teacher's is fine
    topkd.sparse_kl_loss(torch.randn(3, 136), st, vocab_size=128)
    st2 = topkd.select_topk(torch.randn(3, 128), 4, vocab_size=100)
    assert st2.vocab_size == 100
    with pytest.raises(ValueError):
        topkd.sparse_kl_loss(torch.randn(3, 128), st2)  # student width 128 != 100
    topkd.sparse_kl_loss(torch.randn(3, 128), st2, vocab_size=100)


def test_sparse_teacher_leading_shape_mismatch():
    st = topkd.select_topk(torch.randn(3, 4, V), 4)
    with pytest.raises(ValueError, match="(?i)shape"):
        topkd.sparse_kl_loss(torch.randn(4, 3, V), st)


def _teacher(rows=3, k=4, **change):
    """A valid SparseTeacher of ``rows`` x ``V`` (from select_topk's tensors, copied so the
    teacher is a user's, not one select_topk marked checked), with fields replaced."""
    st = topkd.select_topk(torch.randn(rows, V), k)
    fields = dict(indices=st.indices.clone(), logprobs=st.logprobs.clone(),
                  rest_logprob=st.rest_logprob.clone(), temperature=1.0, vocab_size=V)
    fields.update(change)
    return topkd.SparseTeacher(**fields)


def _set(t, row, slot, value):
    t = t.clone()
    t[row, slot] = value
    return t


def _bad_teachers():
    ok = _teacher()
    i, q = ok.indices, ok.logprobs
    yield "float indices", _teacher(indices=i.float()), TypeError, "indices must be an integer"
    yield "bool indices", _teacher(indices=i > 0), TypeError, "indices must be an integer"
    yield "int logprobs", _teacher(logprobs=q.long()), TypeError, "logprobs must be a floating"
    yield "int rest", _teacher(rest_logprob=ok.rest_logprob.long()), TypeError, "rest_logprob"
    yield "short logprobs", _teacher(logprobs=q[:, :3]), ValueError, r"\(3, 4\), got \(3, 3\)"
    yield "rest [n, 1]", _teacher(rest_logprob=ok.rest_logprob[:, None]), ValueError, \
        r"leading shape \(3,\), got \(3, 1\)"
    yield "index past vocab", _teacher(indices=_set(i, 1, 2, V + 3)), ValueError, \
        rf"\[-1, vocab_size={V}\).*row \(1,\) holds {V + 3}"
    yield "index -5", _teacher(indices=_set(i, 2, 0, -5)), ValueError, r"row \(2,\) holds -5"
    yield "index twice", _teacher(indices=_set(i, 0, 3, int(i[0, 1]))), ValueError, \
        rf"at most once per row; row \(0,\) holds {int(i[0, 1])} more than once"
    yield "unused slot with mass", _teacher(indices=_set(i, 1, 3, -1)), ValueError, \
        r"-inf at the unused slots.*row \(1,\) has -?\d.* at slot 3"
    for t in (0.0, -1.0, math.nan, 1e39):  # (0: a NaN loss, before)
        yield f"temperature {t}", _teacher(temperature=t), ValueError, \
            rf"SparseTeacher.temperature must be finite and > 0.*got {re.escape(str(t))}"
    yield "temperature None", _teacher(temperature=None), TypeError, "SparseTeacher.temperature"
    # masses past 1: raw logits given as log-probs (a loss of 100s before), a kept log-prob > 0
    same = dict(indices=i, logprobs=q, rest_logprob=ok.rest_logprob)
    raw = torch.randn(3, 4) * 3 + 5
    yield "raw logits", _teacher(**{**same, "logprobs": raw}), ValueError, \
        r"at most the whole mass.*row \(0,\)"
    yield "log-prob 0.7", _teacher(**{**same, "logprobs": _set(q, 2, 1, 0.7)}), ValueError, \
        r"at most the whole mass.*row \(2,\) sums to"
    rest = ok.rest_logprob.clone()
    rest[1] = 0.0
    yield "rest 0", _teacher(**{**same, "rest_logprob": rest}), ValueError, \
        r"at most the whole mass.*row \(1,\)"
    yield "K = 0", _teacher(indices=i[:, :0], logprobs=q[:, :0]), ValueError, "K >= 1"
    yield "list indices", _teacher(indices=i.tolist()), TypeError, "indices must be an integer"


@pytest.mark.parametrize("name,teacher,error,match", list(_bad_teachers()),
                         ids=[case[0] for case in _bad_teachers()])
def test_bad_sparse_teacher(name, teacher, error, match):
    # (before these checks: a wrong number for an index twice, inf for one out of range or
    # an unused slot with mass, a bare RuntimeError for the shapes and a float index)
    s = torch.randn(3, V, requires_grad=True)
    with pytest.raises(error, match=match):
        topkd.sparse_kl_loss(s, teacher)
    hidden, weight = torch.randn(3, 16, requires_grad=True), torch.randn(V, 16)
    with pytest.raises(error, match=match):
        topkd.fused_topk_kl_loss(hidden, weight, teacher)
    from topkd.entry import check_inputs  # the sharded head's checks, before its collectives
    with pytest.raises(error, match=match):
        check_inputs((hidden, weight), teacher, topkd.KDOptions(), None, None)
    assert s.grad is None and hidden.grad is None


def test_sparse_teacher_mass_within_rounding():
    """A row whose masses sum to 1 within a rounded store's error (+3%), or to less (its rest
    left out), is taken; under normalize="topk", which renormalizes the kept log-probs, so is
    one of any mass (top-K logits given as log-probs: the normalized teacher's loss)."""
    ok = _teacher()
    s = torch.randn(3, V)
    same = dict(indices=ok.indices, logprobs=ok.logprobs, rest_logprob=ok.rest_logprob)
    over = _teacher(**{**same, "logprobs": ok.logprobs + math.log1p(3e-2)})
    short = _teacher(**{**same, "rest_logprob": torch.full((3,), -math.inf)})
    for teacher in (over, short):
        assert torch.isfinite(topkd.sparse_kl_loss(s, teacher)).all()
    raw = _teacher(**{**same, "logprobs": ok.logprobs + 7.0,
                      "rest_logprob": torch.full((3,), -math.inf)})
    torch.testing.assert_close(topkd.sparse_kl_loss(s, raw, normalize="topk"),
                               topkd.sparse_kl_loss(s, ok, normalize="topk"))
    with pytest.raises(ValueError, match="at most the whole mass"):  # checked once "full"
        topkd.sparse_kl_loss(s, raw)


def test_sparse_teacher_narrow_and_wide_dtypes():
    """int8/int16 indices (gather takes int32/int64 only: a bare RuntimeError before) and
    float64 log-probs (a float64 loss before) give the float32 loss of the int64 / float32
    teacher."""
    ok = _teacher(k=4)
    s = torch.randn(3, V)
    ref = topkd.sparse_kl_loss(s, ok)
    for change in (dict(indices=ok.indices.to(torch.int16)),
                   dict(logprobs=ok.logprobs.double(), rest_logprob=ok.rest_logprob.double())):
        fields = dict(indices=ok.indices, logprobs=ok.logprobs, rest_logprob=ok.rest_logprob,
                      temperature=1.0, vocab_size=V)
        got = topkd.sparse_kl_loss(s, topkd.SparseTeacher(**{**fields, **change}))
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7)


def test_teacher_transform_refused_next_to_rows():
    """teacher_logit_scale / teacher_softcap transform logits; a SparseTeacher or
    SampledTeacher holds log-probs (the options were ignored before)."""
    s = torch.randn(3, V)
    for teacher in (_teacher(), topkd.sample_teacher(torch.randn(3, V), 4)):
        for opts in (topkd.KDOptions(teacher_softcap=30.0),
                     topkd.KDOptions(teacher_logit_scale=2.0)):
            with pytest.raises(ValueError, match="teacher_logit_scale=.* teacher_softcap="):
                topkd.distill_loss(s, teacher, opts)


def test_sparse_teacher_values_checked_on_kept_rows_only():
    ok = _teacher()
    junk = _set(_set(ok.indices, 1, 0, V + 7), 1, 1, 5)
    junk[1, 2] = 5  # row 1: out of range and 5 twice
    fields = dict(logprobs=ok.logprobs, rest_logprob=ok.rest_logprob)
    s = torch.randn(3, V)
    mask = torch.tensor([True, False, True])
    ref = topkd.sparse_kl_loss(s, ok, mask=mask)
    assert ref[1] == 0 and torch.isfinite(ref).all()
    got = topkd.sparse_kl_loss(s, _teacher(indices=junk, **fields), mask=mask)  # loss's mask
    assert torch.equal(got, ref)
    dropped = _teacher(indices=junk, mask=mask, **fields)  # the teacher's own padding mask
    assert torch.equal(topkd.sparse_kl_loss(s, dropped), ref)
    with pytest.raises(ValueError, match=r"row \(1,\)"):
        topkd.sparse_kl_loss(s, _teacher(indices=junk, **fields))


def test_sparse_teacher_checked_once_while_unchanged():
    from topkd import _checks

    st = topkd.select_topk(torch.randn(2, 3, V), 4)
    assert _checks._checked(st, None)  # valid by construction
    s = torch.randn(2, 3, V)
    topkd.sparse_kl_loss(s, st)
    st.indices[1, 2, 3] = st.indices[1, 2, 0]  # changed in place: read again
    assert not _checks._checked(st, None)
    with pytest.raises(ValueError, match=r"row \(1, 2\) holds"):
        topkd.sparse_kl_loss(s, st)
    mine = _teacher()
    assert not _checks._checked(mine, None)
    topkd.sparse_kl_loss(torch.randn(3, V), mine)
    assert _checks._checked(mine, None)
    mine.logprobs[0, 3] = float("-inf")  # any in-place change
    assert not _checks._checked(mine, None)
    with torch.inference_mode():  # no version counters: read on every call, still checked
        frozen = topkd.select_topk(torch.randn(3, V), 4)
    assert not _checks._checked(frozen, None)
    _checks.sparse_teacher(frozen)
    bad = topkd.SparseTeacher(frozen.indices.clone(), frozen.logprobs, frozen.rest_logprob,
                              1.0, V)
    with torch.inference_mode():
        bad.indices[0, 0] = V
    with pytest.raises(ValueError, match=f"holds {V}"):
        _checks.sparse_teacher(bad)


def test_sparse_teacher_checked_once_under_new_masks():
    """A loss combines its mask with the teacher's into a new tensor on every call: a teacher
    valid on every row is not read again for any of them; one valid on the kept rows only is
    read again under another mask tensor, and refused where that keeps a bad row."""
    from topkd import _checks

    s = torch.randn(3, V)
    ok = _teacher(mask=torch.tensor([True, True, False]))
    topkd.sparse_kl_loss(s, ok, mask=torch.tensor([True, False, True]))
    assert _checks._checked(ok, torch.tensor([False, True, True]))
    ok.indices[2, 0] = V  # a change, even on a row no mask keeps: read again
    assert not _checks._checked(ok, torch.tensor([True, True, False]))
    junk = _teacher()
    junk.indices[1, 0] = V
    mask = torch.tensor([True, False, True])
    topkd.sparse_kl_loss(s, junk, mask=mask)
    assert _checks._checked(junk, mask)
    assert not _checks._checked(junk, mask.clone())
    assert not _checks._checked(junk, None)
    with pytest.raises(ValueError, match=r"row \(1,\) holds"):
        topkd.sparse_kl_loss(s, junk, mask=torch.tensor([True, True, True]))


# ---------------------------------------------------------------- k, top_p, top_p_min_k


@pytest.mark.parametrize("k", [0, -3, V + 1])
def test_k_out_of_range(k):
    s, t = _st()
    for f in (lambda: topkd.topk_kl_loss(s, t, k), lambda: topkd.select_topk(t, k),
              lambda: topkd.TopKLogitsKLLoss(k)(s, t)):
        with pytest.raises(ValueError, match=r"\bk\b"):
            f()


def test_k_past_vocab_size():
    s, t = _st()
    with pytest.raises(ValueError, match=r"\bk\b"):
        topkd.topk_kl_loss(s, t, 91, vocab_size=90)
    with pytest.raises(ValueError, match=r"\bk\b"):
        topkd.select_topk(t, 91, vocab_size=90)
    topkd.topk_kl_loss(s, t, 90, vocab_size=90)


@pytest.mark.parametrize("k", [2.0, "3", None, True])
def test_k_wrong_type(k):
    s, t = _st()
    with pytest.raises(ERR, match=r"\bk\b"):
        topkd.topk_kl_loss(s, t, k)


@pytest.mark.parametrize("top_p", [0.0, -0.1, 1.0001, 2.0, math.nan, math.inf])
def test_top_p_out_of_range(top_p):
    s, t = _st()
    for f in (lambda: topkd.topk_kl_loss(s, t, 4, top_p=top_p),
              lambda: topkd.select_topk(t, 4, top_p=top_p),
              lambda: topkd.TopKLogitsKLLoss(4, top_p=top_p)(s, t)):
        with pytest.raises(ValueError, match="top_p"):
            f()


def test_top_p_edges_accepted():
    s, t = _st()
    assert torch.isfinite(topkd.topk_kl_loss(s, t, 4, top_p=1.0)).all()
    assert torch.isfinite(topkd.topk_kl_loss(s, t, 4, top_p=1e-9)).all()


@pytest.mark.parametrize("min_k", [0, -1])
def test_top_p_min_k_below_one(min_k):
    s, t = _st()
    for f in (lambda: topkd.topk_kl_loss(s, t, 4, top_p=0.5, top_p_min_k=min_k),
              lambda: topkd.select_topk(t, 4, top_p=0.5, top_p_min_k=min_k)):
        with pytest.raises(ValueError, match="top_p_min_k"):
            f()


# ---------------------------------------------------------------- temperature


@pytest.mark.parametrize("temperature", [0.0, -1.0, math.nan, math.inf, -math.inf, 1e39, 1e-39])
def test_bad_temperature(temperature):
    s, t = _st()
    for f in (lambda: topkd.topk_kl_loss(s, t, 4, temperature=temperature),
              lambda: topkd.kl_loss(s, t, temperature=temperature),
              lambda: topkd.select_topk(t, 4, temperature=temperature),
              lambda: topkd.LogitsKLLoss(temperature=temperature)(s, t),
              lambda: topkd.TopKLogitsKLLoss(4, temperature=temperature)(s, t)):
        with pytest.raises(ValueError, match="temperature"):
            f()


@pytest.mark.parametrize("group", ["world", 0, object()])
def test_bad_process_group(group):
    """(A bare AttributeError from inside torch.distributed before.)"""
    s, t = _st()
    for f in (lambda: topkd.topk_kl_loss(s, t, 4, process_group=group),
              lambda: topkd.kl_loss(s, t, process_group=group),
              lambda: topkd.select_topk(t, 4, process_group=group),
              lambda: topkd.KDOptions(process_group=group)):
        with pytest.raises(TypeError, match="process_group must be a torch.distributed"):
            f()


# ---------------------------------------------------------------- shapes and dtypes


def test_leading_shape_mismatch():
    s = torch.randn(2, 3, V)
    for t in (torch.randn(3, 2, V), torch.randn(6, V), torch.randn(2, 4, V)):
        with pytest.raises(ValueError, match="(?i)shape"):
            topkd.topk_kl_loss(s, t, 4)
        with pytest.raises(ValueError, match="(?i)shape"):
            topkd.kl_loss(s, t)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.float64])
def test_bad_logits_dtype(dtype):
    good = torch.randn(3, V)
    bad = (torch.randn(3, V) * 5).to(dtype)
    for f in (lambda: topkd.topk_kl_loss(bad, good, 4), lambda: topkd.topk_kl_loss(good, bad, 4),
              lambda: topkd.kl_loss(bad, good), lambda: topkd.kl_loss(good, bad),
              lambda: topkd.select_topk(bad, 4)):
        with pytest.raises(ERR, match="(?i)dtype|float|logits"):
            f()


def test_not_a_tensor():
    s, t = _st()
    with pytest.raises(TypeError):
        topkd.topk_kl_loss(s.tolist(), t, 4)
    with pytest.raises(TypeError):
        topkd.kl_loss(s, t.numpy())
    with pytest.raises(TypeError):
        topkd.sparse_kl_loss(s, t)  # a tensor is not a SparseTeacher


@pytest.mark.parametrize("shape", [(4,), (4, 1), (5,), (2, 2), ()])
def test_mask_wrong_shape(shape):
    s, t = _st()
    mask = torch.ones(shape, dtype=torch.bool)
    for f in (lambda: topkd.topk_kl_loss(s, t, 4, mask=mask),
              lambda: topkd.kl_loss(s, t, mask=mask),
              lambda: topkd.sparse_kl_loss(s, topkd.select_topk(t, 4), mask=mask)):
        if shape == (4,):
            f()  # the right shape
            continue
        with pytest.raises(ValueError, match="mask"):
            f()


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.uint8])
def test_mask_not_bool(dtype):
    s, t = _st()
    mask = torch.ones(4, dtype=dtype)
    for f in (lambda: topkd.topk_kl_loss(s, t, 4, mask=mask),
              lambda: topkd.kl_loss(s, t, mask=mask)):
        with pytest.raises(ERR, match="mask"):
            f()


@pytest.mark.parametrize("reduction", ["avg", "MEAN", "", None, "batchmean"])
def test_bad_reduction(reduction):
    s, t = _st()
    for f in (lambda: topkd.topk_kl_loss(s, t, 4, reduction=reduction),
              lambda: topkd.kl_loss(s, t, reduction=reduction)):
        with pytest.raises(ERR, match="reduction"):
            f()


@pytest.mark.parametrize("normalize", ["none", "Full", "", None, "renorm"])
def test_bad_normalize(normalize):
    s, t = _st()
    with pytest.raises(ERR, match="normalize"):
        topkd.topk_kl_loss(s, t, 4, normalize=normalize)
    with pytest.raises(ERR, match="normalize"):
        topkd.sparse_kl_loss(s, topkd.select_topk(t, 4), normalize=normalize)


@pytest.mark.parametrize("chunk_bytes", [0, -5, 1.5, "1M"])
def test_bad_chunk_bytes(chunk_bytes):
    s, t = _st()
    with pytest.raises(ERR, match="chunk_bytes"):
        topkd.kl_loss(s, t, chunk_bytes=chunk_bytes)


def test_checks_happen_before_any_work():
    # A bad option must fail even on inputs that would be costly or that would fail later
    # (no partial work, no collective): the student is not touched by autograd.
    s = torch.randn(4, V, requires_grad=True)
    t = torch.randn(4, V)
    with pytest.raises(ValueError):
        topkd.topk_kl_loss(s, t, 4, reduction="bogus")
    with pytest.raises(ValueError):
        topkd.topk_kl_loss(s, t, 4, temperature=0.0)
    assert s.grad is None
