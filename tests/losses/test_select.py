"""select_topk: selection, tie rule, top-p, ghost mass, fields, against the float64 reference."""

import pytest
import reference as ref
import torch
from helpers import assert_teacher_matches, logits, misled_rows_

import topkd
import topkd.backends
from topkd import topk

V = 600


@pytest.mark.parametrize("k", [1, 8, 300, V])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.0])
def test_select_matches_reference(k, temperature):
    t = logits(3, 5, V, scale=3.0)
    st = topkd.select_topk(t, k, temperature=temperature)
    assert isinstance(st, topkd.SparseTeacher)
    r = ref.select(t, k, temperature=temperature)
    assert_teacher_matches(st, r, k=k, vocab_size=V, temperature=temperature)
    if k == V:
        # nothing left outside S: q_g = 0
        assert torch.all(st.rest_logprob == float("-inf"))


@pytest.mark.parametrize("top_p,min_k", [(0.5, 1), (0.9, 1), (0.3, 6), (1e-6, 1), (1e-6, 4)])
def test_select_top_p(top_p, min_k):
    k = 40
    t = logits(16, V, scale=2.5, seed=1)
    r = ref.select(t, k, top_p=top_p, top_p_min_k=min_k)
    assert ref.top_p_margin(r, top_p, min_k) > 1e-5, "test input too close to a boundary"
    kept = (r["indices"] >= 0).sum(-1)
    assert kept.min() >= min_k
    assert kept.max() < k or top_p >= 0.9, "top-p should drop entries in this case"
    st = topkd.select_topk(t, k, top_p=top_p, top_p_min_k=min_k)
    assert_teacher_matches(st, r, k=k, vocab_size=V, temperature=1.0)
    # kept entries form a prefix; dropped slots are -1 / -inf
    idx = st.indices
    for row in range(idx.shape[0]):
        n = int((idx[row] >= 0).sum())
        assert torch.all(idx[row, :n] >= 0) and torch.all(idx[row, n:] == -1)
        assert torch.all(st.logprobs[row, n:] == float("-inf"))


def test_select_top_p_mass_goes_to_ghost():
    t = logits(8, V, scale=4.0, seed=2)
    k = 30
    full = topkd.select_topk(t, k)
    tp = topkd.select_topk(t, k, top_p=0.5)
    # total mass is conserved: kept + ghost = 1 for both
    for st in (full, tp):
        lp = torch.cat([st.logprobs.double(), st.rest_logprob.double().unsqueeze(-1)], -1)
        torch.testing.assert_close(torch.logsumexp(lp, -1), torch.zeros(8, dtype=torch.float64),
                                   atol=2e-6, rtol=0)
    assert torch.all(tp.rest_logprob >= full.rest_logprob)


def test_select_order_and_ties_to_lower_index():
    # integer-valued logits: many exact ties
    t = torch.randint(-3, 4, (10, 50)).float()
    for k in (1, 5, 17, 50):
        st = topkd.select_topk(t, k)
        r = ref.select(t, k)
        assert torch.equal(st.indices, r["indices"])
        # descending log-probs, ties by ascending index
        lp = st.logprobs
        assert torch.all(lp[:, 1:] <= lp[:, :-1])
        same = lp[:, 1:] == lp[:, :-1]
        assert torch.all(st.indices[:, 1:][same] > st.indices[:, :-1][same])


# (width, k): the exact selection; the sampled one (k at most a sixteenth of the row)
WIDTH_K = [(300, 64), (1000, 40)]


@pytest.mark.parametrize("width, k", WIDTH_K)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_select_low_precision_with_ties(dtype, width, k):
    t = (torch.randn(12, width) * 2).to(dtype)  # bf16: many exact ties
    assert (topk.sampled_plan(width, k + 1) is None) == (width < 16 * (k + 1))
    st = topkd.select_topk(t, k, top_p=0.7, top_p_min_k=2)
    r = ref.select(t, k, top_p=0.7, top_p_min_k=2)
    assert ref.top_p_margin(r, 0.7, 2) > 1e-5
    assert_teacher_matches(st, r, k=k, vocab_size=width, temperature=1.0)


@pytest.mark.parametrize("width, k", [(257, 33), (1000, 40)])
def test_select_rows_are_independent_bitwise(width, k):
    # S depends on the row alone: same result whatever batch it sits in
    t = torch.randint(-20, 20, (9, width)).to(torch.bfloat16) / 4
    st = topkd.select_topk(t, k, top_p=0.8)
    for i in range(t.shape[0]):
        one = topkd.select_topk(t[i:i + 1], k, top_p=0.8)
        assert torch.equal(one.indices[0], st.indices[i])
        assert torch.equal(one.logprobs[0], st.logprobs[i])
        assert torch.equal(one.rest_logprob[0], st.rest_logprob[i])


def test_select_vocab_size_padding():
    w, v = 128, 100
    t = logits(4, w)
    t[:, v:] = 50.0  # padding columns would win every selection if they were looked at
    st = topkd.select_topk(t, 10, vocab_size=v)
    r = ref.select(t, 10, vocab_size=v)
    assert_teacher_matches(st, r, k=10, vocab_size=v, temperature=1.0)
    assert torch.all(st.indices < v)


def test_select_noncontiguous_and_leading_shape():
    base = logits(4, 3, V)
    t = base.transpose(0, 1)  # [3, 4, V], not contiguous
    assert not t.is_contiguous()
    st = topkd.select_topk(t, 7, temperature=1.5)
    r = ref.select(t, 7, temperature=1.5)
    assert_teacher_matches(st, r, k=7, vocab_size=V, temperature=1.5)
    st2 = topkd.select_topk(t.contiguous(), 7, temperature=1.5)
    assert torch.equal(st.indices, st2.indices)
    assert torch.equal(st.logprobs, st2.logprobs)


def test_select_no_grad():
    t = logits(3, V).requires_grad_(True)
    st = topkd.select_topk(t, 5)
    assert not st.logprobs.requires_grad
    assert not st.rest_logprob.requires_grad


def test_select_neg_inf_entries():
    t = logits(6, 64)
    t[:, 20:] = float("-inf")
    t[0, :] = float("-inf")
    t[0, 3] = 1.0  # a one-hot teacher row
    for k in (10, 20, 30, 64):
        st = topkd.select_topk(t, k)
        r = ref.select(t, k)
        assert_teacher_matches(st, r, k=k, vocab_size=64, temperature=1.0)
        assert not torch.isnan(st.logprobs).any() and not torch.isnan(st.rest_logprob).any()


def test_select_peaky_ghost_exact():
    # top-K hold all but ~1e-13 of the mass: log q_g ~ -30 must stay exact.
    # (1 - sum(q) in float32 is rounding noise, so log1p(-sum) gives ~-16 or -inf.)
    n, v, k = 8, 1000, 16
    t = torch.full((n, v), -34.0)
    t[:, :k] = torch.rand(n, k)  # the top-K, within [0, 1)
    t[:, k:] += torch.rand(n, v - k)  # the tail, ~1e-13 in total
    st = topkd.select_topk(t, k)
    r = ref.select(t, k)
    assert float(r["rest_logprob"].max()) < -25
    assert_teacher_matches(st, r, k=k, vocab_size=v, temperature=1.0, rest_rtol=1e-6)


def test_select_offset_invariant():
    # exactly representable: multiples of 1/8 in [-8, 8] plus 2**20
    t = torch.randint(-64, 65, (6, 200)).float() / 8
    a = topkd.select_topk(t, 12, top_p=0.95)
    b = topkd.select_topk(t + 2.0 ** 20, 12, top_p=0.95)
    assert torch.equal(a.indices, b.indices)
    torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-6)
    torch.testing.assert_close(a.rest_logprob, b.rest_logprob, rtol=0, atol=1e-6)


def test_select_rows_the_sample_misleads():
    """Rows where the sampled threshold fails take the exact selection; each row's result is
    its own (bitwise the same alone as in the batch) and matches the reference."""
    k = 40
    t = misled_rows_(logits(8, 1000, scale=3.0, seed=3), k)
    done = topkd.backends.EAGER.select(t, k, 1.0, 1.0, None)[-1]
    assert done.any() and not done.all(), done  # the test sees both ways
    st = topkd.select_topk(t, k)
    assert_teacher_matches(st, ref.select(t, k), k=k, vocab_size=t.shape[1], temperature=1.0)
    for i in range(t.shape[0]):
        one = topkd.select_topk(t[i:i + 1], k)
        for a, b in zip((one.indices, one.logprobs, one.rest_logprob),
                        (st.indices, st.logprobs, st.rest_logprob), strict=True):
            assert torch.equal(a[0], b[i])


@pytest.mark.parametrize("size", [0, 5, 8, 3000, 3001, 4099])
@pytest.mark.parametrize("density", [0.0, 0.02, 0.5, 1.0])
def test_flat_nonzero_matches_nonzero(size, density):
    """The compaction's word-at-a-time ``nonzero`` (sizes a multiple of 8) and its fallback
    (the others, and a view whose offset is not) give ``nonzero``'s positions, for bool and
    int8 flags."""
    g = torch.Generator().manual_seed(size)
    flags = torch.rand(size + 3, generator=g) < density
    for view in (flags[:size], flags[3:], flags[:size].to(torch.int8)):
        expected = view.nonzero()[:, 0]
        assert torch.equal(topk.flat_nonzero(view), expected), (size, view.dtype)
        # the parts a kernel puts together: words and bytes, the same either way
        words, at = topk.nonzero_words(view)
        assert torch.equal((words[at >> 3] << 3) | (at & 7), expected), (size, view.dtype)


def test_word_parts_of_padded_positions():
    """Flat positions with -1 padding (the GPU's ``nonzero_static``) as words and bytes: the
    real ones put back together, the padding's ``at`` -1."""
    flat = torch.tensor([3, 8, 17, 250, -1, -1])
    words, at = topk.word_parts(flat)
    assert torch.equal(at[4:], torch.tensor([-1, -1]))
    assert torch.equal((words[at[:4] >> 3] << 3) | (at[:4] & 7), flat[:4])


def test_compact_without_a_host_sync_agrees():
    """The candidates' compaction without a host sync (for GPUs) gives what the CPU's gives,
    but for a row with more than the capacity, which it leaves out whole."""
    g = torch.Generator().manual_seed(4)
    above = torch.rand(6, 500, generator=g) < 0.1
    above[2] = True  # over the capacity
    above[4] = False
    capacity = 80
    cpu, cpu_count = topk.compact(above.clone(), capacity, sync_free=False)
    free, free_count = topk.compact(above.clone(), capacity, sync_free=True)
    assert cpu.shape == free.shape == (6, capacity + 1)
    assert torch.equal(cpu_count, above.sum(-1))
    assert torch.equal(free_count, torch.where(above.sum(-1) <= capacity, above.sum(-1), 0))
    assert torch.equal(cpu[2], torch.arange(capacity + 1)) and (free[2] == -1).all()
    keep = torch.tensor([0, 1, 3, 4, 5])
    assert torch.equal(cpu[keep], free[keep])
    for i in keep:
        want = above[i].nonzero()[:, 0]
        assert torch.equal(cpu[i, :want.numel()], want) and (cpu[i, want.numel():] == -1).all()


def test_kth_last():
    """Each row's least key (its k-th of k) swapped into the last column, the others kept."""
    g = torch.Generator().manual_seed(6)
    keys = torch.randperm(10**6, generator=g)[:7 * 9].view(7, 9)
    keys[3] = keys[3].sort().values  # the least first
    keys[4] = keys[4].sort(descending=True).values  # the least already last
    out = topk.kth_last(keys.clone())
    assert torch.equal(out[:, -1], keys.amin(-1))
    assert torch.equal(out[:, :-1].sort(-1).values, keys.sort(-1).values[:, 1:])


@pytest.mark.parametrize("impl", ["eager", "compile"])
def test_select_unordered_is_the_same_selection(impl):
    """A backend's selection without the order (what each rank of a tensor-parallel group
    sends to the merge) keeps the same entries with the same values, rest and ``done``, bit for
    bit, as with it: rows of random bf16 values with ties, and rows the sample misleads."""
    k = 40
    t = misled_rows_(logits(8, 1000, scale=3.0, seed=7), k)
    t[6] = t[6].bfloat16().float()  # ties
    backend = topkd.backends.choose(impl, t.device)
    ordered = backend.select(t, k, 1.5, 1.0, None)
    loose = backend.select(t, k, 1.5, 1.0, None, ordered=False)
    assert not ordered[-1].all() and ordered[-1].any()
    for a, b in zip(ordered[2:], loose[2:], strict=True):
        assert torch.equal(a, b)
    done = ordered[-1]
    # (torch's unsorted top-k leaves them in another order here: the sets are compared)
    assert not torch.equal(loose[1][done], ordered[1][done])
    values, indices = topk.canonical_order(*loose[:2])
    assert torch.equal(values[done], ordered[0][done])
    assert torch.equal(indices[done], ordered[1][done])


def test_select_rows_cache_sized_on_a_cpu():
    """On a CPU a chunk of teacher logits is at most ``SELECT_CACHE_BYTES`` in its own dtype
    (the selection reads it several times); on a GPU and in a fused loss the budget alone
    sets it."""
    memory, width = topkd.memory, 248_320
    for backend in (topkd.backends.EAGER, topkd.backends.COMPILED):
        def rows(fused, device_type, backend=backend):
            return memory.select_rows(None, 1024, width, 2, fused, backend, device_type)
        cpu = rows(False, "cpu")
        assert cpu * width * 2 <= memory.SELECT_CACHE_BYTES < (cpu + 1) * width * 2, cpu
        assert rows(False, "cuda") > cpu, backend.name  # the budget's 64 or 128 rows
        assert rows(True, "cpu") == rows(True, "cuda"), backend.name


@pytest.mark.parametrize("impl", ["eager", "compile"])
def test_select_chunks_within_the_cache_bytes(impl, monkeypatch):
    """``select_topk`` runs its chunks at the cap's height (here 8 rows), with the result of
    one chunk for all, to the bit."""
    t = logits(40, 2000, scale=3.0, seed=5)
    whole = topkd.select_topk(t, 12, impl=impl)
    backend = topkd.backends.choose(impl, t.device)
    heights = []
    select = backend.select

    def spy(low, *args):
        heights.append(low.shape[0])
        return select(low, *args)

    monkeypatch.setattr(backend, "select", spy)
    monkeypatch.setattr(topkd.memory, "SELECT_CACHE_BYTES", 8 * 2000 * t.element_size())
    chunked = topkd.select_topk(t, 12, impl=impl)
    assert heights == [8] * 5, heights
    for a, b in zip((whole.indices, whole.logprobs, whole.rest_logprob),
                    (chunked.indices, chunked.logprobs, chunked.rest_logprob), strict=True):
        assert torch.equal(a, b)
