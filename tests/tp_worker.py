"""Body of the tensor-parallel tests, run in spawned gloo ranks (see test_parallel.py).

Each rank builds the same full inputs from a fixed seed, computes the one-process result
locally (process_group=None) and the tensor-parallel result on its contiguous vocabulary
shard, and compares: the loss within 1e-6 relative (and bit-identical on every rank), the
gradient shard allclose to its slice of the one-process gradient, select_topk outputs equal.
The objective cases (JSD, TVD, skew divergences, the hard-label CE term with global labels on
every shard) also check the (kd, ce) parts, the float64 reference and a second backward.
"""

from __future__ import annotations

import os
import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

_HERE = os.path.dirname(os.path.abspath(__file__))
for _p in (_HERE, os.path.dirname(_HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import reference  # noqa: E402

import topkd  # noqa: E402
from topkd.backends.compiled import compiler_missing  # noqa: E402

LOSS_RTOL = 1e-6
REF_RTOL = 1e-5  # loss vs float64, relative (to the batch's loss scale, per row)
REF_GRAD_TOL = 1e-5  # gradient vs float64: max err / max |reference gradient|
# The detached (kd, ce) parts of return_components. The loss itself is held to LOSS_RTOL; a
# part alone can be a small divergence made of cancelling float32 terms: one process's fused
# softcapped JSD(beta=0.1) part (batch scale 0.16) is already 1.06e-6 of its scale from
# float64, so one process and TP (each rounded so) may differ by twice that. A real TP error
# (a missing or doubled shard) is O(1) of the scale.
PART_RTOL = 3e-6


def _run(fn, student, *args, view=None, grad_output=None, **kwargs):
    """(loss, student gradient); with ``return_components=True`` the loss is the detached
    ``LossParts(loss, kd, ce)``, backward through its ``loss``."""
    s = student.detach().clone().requires_grad_(True)
    out = fn(s if view is None else view(s), *args, **kwargs)
    loss = out[0] if isinstance(out, tuple) else out
    g = torch.ones_like(loss) if grad_output is None or loss.dim() == 0 else grad_output
    loss.backward(g)
    if isinstance(out, tuple):
        return type(out)(*(x.detach() for x in out)), s.grad
    return loss.detach(), s.grad


def second_backward(fn, student, *args, grad_output=None, **kwargs):
    """Backward twice through one graph (``retain_graph=True``): an error message when the
    two gradients differ (a backward that consumed or changed saved state), else None. Every
    rank runs the same collectives whatever the outcome."""
    s = student.detach().clone().requires_grad_(True)
    out = fn(s, *args, **kwargs)
    loss = out[0] if isinstance(out, tuple) else out
    g = torch.ones_like(loss) if grad_output is None or loss.dim() == 0 else grad_output
    (first,) = torch.autograd.grad(loss, s, g, retain_graph=True)
    (second,) = torch.autograd.grad(loss, s, g)
    if not torch.equal(first, second):
        return (f"a second backward (retain_graph=True) gives another gradient: max diff "
                f"{float((first - second).abs().max()):.3e}, max|g| "
                f"{float(first.abs().max()):.3e}")
    return None


def _inputs(lead, width, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    s = (torch.randn(*lead, width, generator=g, dtype=torch.float64) * 2).to(dtype)
    t = (torch.randn(*lead, width, generator=g, dtype=torch.float64) * 2.5).to(dtype)
    gout = torch.randn(*lead, generator=g)
    return s, t, gout


def _same_on_all_ranks(x: torch.Tensor, group) -> bool:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return all(torch.equal(p, parts[0]) for p in parts)


def _compare(name, failures, loss_tp, loss_1, grad_tp, grad_1, same, rtol=LOSS_RTOL):
    """TP loss within 1e-6 relative of one process, gradients allclose.

    Per row, 1e-6 of a row's own loss is below float32 resolution when a row's KL is small
    (it is a sum of O(1) terms that cancel; the one-process loss itself is only within a few
    1e-7 absolute of float64 there), so each row is held to 1e-6 of the batch's loss scale
    (max(|row loss|, mean |row loss|)); scalar reductions are held to 1e-6 of themselves.
    Gradients: one-process and TP are each within ~2e-6 of max|g| of float64 for reverse KL
    (float32 rounding of log terms), and sum shards in another order, so "allclose" is
    rtol 1e-5 with atol 1e-5 * max|g|, the float32 gradient tolerance; a real TP error
    (a missing or doubled all-reduce term) is O(max|g|).
    """
    try:
        assert loss_tp.shape == loss_1.shape, f"loss shape {loss_tp.shape} vs {loss_1.shape}"
        assert loss_tp.dtype == torch.float32
        l1 = loss_1.double()
        err = (loss_tp.double() - l1).abs()
        scale = l1.abs().mean() if l1.numel() else torch.tensor(0.0, dtype=torch.float64)
        bound = rtol * torch.maximum(l1.abs(), scale) + 1e-12
        assert torch.all(err <= bound), (
            f"loss differs from one process: max err {float(err.max()):.3e}, "
            f"max err / scale {float((err / scale.clamp_min(1e-30)).max()):.3e}\n"
            f"{loss_tp}\nvs\n{loss_1}")
        assert same, "ranks returned different losses"
        if grad_1 is None:  # a value without a gradient (a detached loss component)
            return
        assert grad_tp.dtype == grad_1.dtype and grad_tp.shape == grad_1.shape, (
            grad_tp.dtype, grad_tp.shape, grad_1.dtype, grad_1.shape)
        gscale = float(grad_1.abs().max()) if grad_1.numel() else 0.0
        if grad_1.dtype == torch.float32:
            rtol, atol = 1e-5, 1e-5 * gscale
        else:  # bf16: the final rounding of the gradient may fall either way (1 ulp = 2^-7)
            rtol, atol = 2.0 ** -7, 1e-5 * gscale
        torch.testing.assert_close(grad_tp, grad_1, rtol=rtol, atol=atol)
    except AssertionError as e:
        failures.append(f"[{name}] {e}")


def _cases(k_small, width, vocab_size):
    v = vocab_size or width
    topk = topkd.topk_kl_loss
    cases = [
        ("topk k=1", topk, dict(k=1)),
        ("topk k=small", topk, dict(k=k_small)),
        ("topk k=small top_p reverse T", topk,
         dict(k=k_small, top_p=0.8, top_p_min_k=2, reverse=True, temperature=0.7)),
        ("topk k=small top_p T", topk, dict(k=k_small, top_p=0.6, temperature=1.4)),
        ("topk k=small normalize=topk", topk, dict(k=k_small, normalize="topk", reverse=True)),
        ("topk k=V", topk, dict(k=v)),
        ("topk mask mean chunk_bytes=1", topk,
         dict(k=k_small, reduction="mean", chunk_bytes=1, mask=True)),
        ("topk sum", topk, dict(k=k_small, reduction="sum", temperature=2.0)),
        ("kl", topkd.kl_loss, dict()),
        ("kl reverse T", topkd.kl_loss, dict(reverse=True, temperature=1.3)),
        ("kl mask none chunk_bytes=1", topkd.kl_loss, dict(chunk_bytes=1, mask=True)),
    ]
    return cases


def topk_via_sparse(student, teacher, k, *, top_p=None, top_p_min_k=1, temperature=1.0,
                    vocab_size=None, process_group=None, **opts):
    """The offline path: ``select_topk`` of the (sharded) teacher, then ``sparse_kl_loss``
    with the SparseTeacher's own temperature."""
    st = topkd.select_topk(teacher, k, top_p=top_p, top_p_min_k=top_p_min_k,
                           temperature=temperature, vocab_size=vocab_size,
                           process_group=process_group)
    return topkd.sparse_kl_loss(student, st, vocab_size=vocab_size, process_group=process_group,
                                **opts)


def labels_for(lead, sizes, vocab_size, seed):
    """Global label ids (int64, leading shape ``lead``) shared by every rank: two
    ``ignore_index`` rows, for every rank holding real columns a label in the middle of its
    shard and one on its first column, the first and last real ids, the rest random."""
    n = 1
    for x in lead:
        n *= x
    v = vocab_size or sum(sizes)
    g = torch.Generator().manual_seed(seed + 3)
    lab = torch.randint(0, v, (n,), generator=g)
    lab[0], lab[n - 1] = v - 1, 0
    for r in range(len(sizes)):
        start = sum(sizes[:r])
        stop = min(start + sizes[r], v)
        if stop > start:
            lab[2 + r] = (start + stop - 1) // 2
            lab[5 + r] = start
    lab[1] = lab[n - 2] = -100
    assert n >= 10 and len(sizes) <= 3
    return lab.reshape(lead)


def _objective_cases(k_small):
    """Divergences beyond KL and the hard-label term (labels with ignore_index rows, on every
    rank's shard), at T = 1 (CE folded into the KD normalizer) and T = 2 (its own); checked
    against one process, the float64 reference and, with ``twice``, a second backward."""
    topk, sparse, kl = topkd.topk_kl_loss, topk_via_sparse, topkd.kl_loss
    c = dict(labels=True, return_components=True)
    return [
        ("topk jsd ce T=1 twice", topk,
         dict(k=k_small, divergence="jsd", ce_weight=0.5, twice=True, **c)),
        ("topk JSD(0.1) ce T=2 mask mean", topk,
         dict(k=k_small, divergence=topkd.JSD(beta=0.1), ce_weight=0.3, temperature=2.0,
              mask=True, reduction="mean", **c)),
        ("topk tvd top_p ce T=2", topk,
         dict(k=5, divergence="tvd", top_p=0.8, top_p_min_k=2, ce_weight=1.0,
              temperature=2.0, **c)),
        ("topk SkewKL(0.2) normalize=topk ce kd_weight sum", topk,
         dict(k=k_small, divergence=topkd.SkewKL(alpha=0.2), normalize="topk", ce_weight=0.5,
              kd_weight=0.7, reduction="sum", **c)),
        ("topk ce only T=2 chunk_bytes=1", topk,
         dict(k=3, kd_weight=0.0, ce_weight=1.0, temperature=2.0, chunk_bytes=1, **c)),
        ("sparse JSD(0.1) ce T=2 chunk_bytes=1", sparse,
         dict(k=k_small, divergence=topkd.JSD(beta=0.1), ce_weight=0.5, temperature=2.0,
              chunk_bytes=1, **c)),
        ("sparse skew_reverse_kl ce T=1 mask mean", sparse,
         dict(k=k_small, divergence="skew_reverse_kl", ce_weight=1.0, mask=True,
              reduction="mean", **c)),
        ("sparse TVD ce T=1", sparse, dict(k=5, divergence=topkd.TVD(), ce_weight=0.3, **c)),
        ("kl jsd ce T=1", kl, dict(divergence="jsd", ce_weight=0.5, **c)),
        ("kl JSD(0.1) ce T=2 mask mean chunk_bytes=1", kl,
         dict(divergence=topkd.JSD(beta=0.1), ce_weight=0.5, temperature=2.0, mask=True,
              reduction="mean", chunk_bytes=1, **c)),
        ("kl tvd ce T=2 twice", kl,
         dict(divergence="tvd", ce_weight=1.0, temperature=2.0, twice=True, **c)),
        ("kl SkewKL ce T=1 chunk_bytes=1", kl,
         dict(divergence=topkd.SkewKL(), ce_weight=0.5, chunk_bytes=1, **c)),
        ("kl skew_reverse_kl ce T=2 kd_weight sum", kl,
         dict(divergence="skew_reverse_kl", ce_weight=0.5, kd_weight=2.0, temperature=2.0,
              reduction="sum", **c)),
    ]


_REFERENCE = {topkd.topk_kl_loss: reference.topk_loss, topk_via_sparse: reference.topk_loss,
              topkd.kl_loss: reference.full_loss}


def compare_reference(name, failures, parts_tp, ref_parts, grads):
    """The TP result against float64: the loss and its (kd, ce) parts within REF_RTOL of the
    batch's scale (as in _compare), each gradient shard within REF_GRAD_TOL of the max of the
    whole reference gradient. ``grads``: (label, TP shard, reference shard, max |whole
    reference gradient|) tuples."""
    try:
        for what, x, r in zip(("loss", "kd", "ce"), parts_tp, ref_parts, strict=True):
            assert x.shape == r.shape, f"{what} shape {x.shape} vs reference {r.shape}"
            err = (x.double() - r).abs()
            scale = r.abs().mean() if r.numel() else torch.tensor(0.0, dtype=torch.float64)
            bound = REF_RTOL * torch.maximum(r.abs(), scale) + 1e-9
            assert torch.all(err <= bound), (
                f"{what} vs float64 reference: max err {float(err.max()):.3e}, max err / "
                f"scale {float((err / scale.clamp_min(1e-30)).max()):.3e}\n{x}\nvs\n{r}")
        for what, g, r, scale in grads:
            assert g is not None, f"no {what} gradient"
            e = float((g.double() - r).abs().max()) if r.numel() else 0.0
            assert e <= REF_GRAD_TOL * scale + 1e-12, (
                f"{what} gradient vs float64 reference: max err {e:.3e} / max|ref| "
                f"{scale:.3e} = {e / max(scale, 1e-30):.3e} > {REF_GRAD_TOL}")
    except AssertionError as e:
        failures.append(f"[{name} vs reference] {e}")


def run_layout(group, rank, width, sizes, vocab_size, failures, seed=0, names=None):
    world = dist.get_world_size(group)
    assert len(sizes) == world and sum(sizes) == width
    start = sum(sizes[:rank])
    stop = start + sizes[rank]
    tag = f"W={width} shards={sizes} vocab_size={vocab_size}"
    lead = (3, 4)
    s, t, gout = _inputs(lead, width, torch.float32, seed)
    mask = torch.rand(*lead, generator=torch.Generator().manual_seed(seed + 1)) < 0.6
    k_small = 12  # larger than some shards: a rank may hold fewer than K candidates
    labels = labels_for(lead, sizes, vocab_size, seed)
    vs = {} if vocab_size is None else {"vocab_size": vocab_size}
    cases = [(c, False) for c in _cases(k_small, width, vocab_size)]
    cases += [(c, True) for c in _objective_cases(k_small)]
    if names is not None:  # a subset (the compiled kernels' run)
        cases = [c for c in cases if c[0][0] in names]
    for (name, fn, opts), check_ref in cases:
        opts = dict(opts)
        if opts.pop("mask", False):
            opts["mask"] = mask
        if opts.pop("labels", False):
            opts["labels"] = labels
        twice = opts.pop("twice", False)
        args = (opts.pop("k"),) if "k" in opts else ()
        l1, g1 = _run(fn, s, t, *args, grad_output=gout, **vs, **opts)
        lt, gt = _run(fn, s[..., start:stop], t[..., start:stop], *args, grad_output=gout,
                      process_group=group, **vs, **opts)
        parts_1 = tuple(l1) if isinstance(l1, tuple) else (l1,)
        parts_t = tuple(lt) if isinstance(lt, tuple) else (lt,)
        for i, (pt, p1) in enumerate(zip(parts_t, parts_1, strict=True)):
            same = _same_on_all_ranks(pt, group)
            what = ("", " (kd part)", " (ce part)")[i]
            _compare(f"{tag} {name}{what}", failures, pt, p1, gt if i == 0 else None,
                     g1[..., start:stop] if i == 0 else None, same,
                     rtol=LOSS_RTOL if i == 0 else PART_RTOL)
        if twice:
            err = second_backward(fn, s[..., start:stop], t[..., start:stop], *args,
                                  grad_output=gout, process_group=group, **vs, **opts)
            if err:
                failures.append(f"[{tag} {name}] {err}")
        if check_ref:
            ropts = {n: v for n, v in opts.items() if n not in ("chunk_bytes",
                                                                  "return_components")}
            ref_fn = _REFERENCE[fn]
            go = gout if opts.get("reduction", "none") == "none" else None
            rl, rg = reference.loss_and_grad(ref_fn, s, t, *args, grad_output=go, **vs,
                                             **ropts)
            _, rkd, rce = ref_fn(s, t, *args, return_components=True, **vs, **ropts)
            compare_reference(f"{tag} {name}", failures, parts_t, (rl, rkd, rce), [
                ("student", gt, rg[..., start:stop], float(rg.abs().max()))])

    # select_topk and sparse_kl_loss with a tensor-parallel teacher
    for k, opts in [(1, {}), (k_small, dict(top_p=0.8, top_p_min_k=3, temperature=0.8)),
                    (vocab_size or width, {})]:
        st1 = topkd.select_topk(t, k, **vs, **opts)
        stt = topkd.select_topk(t[..., start:stop], k, process_group=group, **vs, **opts)
        name = f"{tag} select_topk k={k} {opts}"
        try:
            assert torch.equal(stt.indices, st1.indices), f"indices\n{stt.indices}\n{st1.indices}"
            torch.testing.assert_close(stt.logprobs, st1.logprobs, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(stt.rest_logprob, st1.rest_logprob, rtol=1e-6,
                                       atol=1e-6)
            assert stt.vocab_size == st1.vocab_size == (vocab_size or width), (
                stt.vocab_size, st1.vocab_size)
            assert stt.temperature == st1.temperature
            assert _same_on_all_ranks(stt.indices, group), "ranks disagree on indices"
        except AssertionError as e:
            failures.append(f"[{name}] {e}")
        for reverse in (False, True):
            l1, g1 = _run(topkd.sparse_kl_loss, s, st1, grad_output=gout, reverse=reverse, **vs)
            lt, gt = _run(topkd.sparse_kl_loss, s[..., start:stop], stt, grad_output=gout,
                          reverse=reverse, process_group=group, **vs)
            same = _same_on_all_ranks(lt, group)
            _compare(f"{tag} sparse_kl_loss k={k} reverse={reverse} {opts}", failures, lt, l1,
                     gt, g1[..., start:stop], same)

    if names is not None:  # the compiled kernels' run: its cases and the selection only
        return
    # a SampledTeacher (drawn from the whole teacher) against the sharded student
    drawn = topkd.sample_teacher(t, 12, seed=3, temperature=1.3, vocab_size=vocab_size)
    l1, g1 = _run(topkd.sparse_kl_loss, s, drawn, grad_output=gout, **vs)
    lt, gt = _run(topkd.sparse_kl_loss, s[..., start:stop], drawn, grad_output=gout,
                  process_group=group, **vs)
    _compare(f"{tag} sparse_kl_loss SampledTeacher", failures, lt, l1, gt, g1[..., start:stop],
             _same_on_all_ranks(lt, group))

    # a non-contiguous [S, B, V] view of each shard, and bf16
    sb, tb, gb = _inputs((4, 3), width, torch.bfloat16, seed + 2)
    view = lambda x: x.transpose(0, 1)  # noqa: E731
    for name, fn, args, opts in [
        ("bf16 [S,B,V] view topk", topkd.topk_kl_loss, (k_small,),
         dict(top_p=0.9, reverse=True)),
        ("bf16 [S,B,V] view kl", topkd.kl_loss, (), dict(temperature=0.9)),
    ]:
        l1, g1 = _run(fn, sb, tb.transpose(0, 1), *args, view=view, grad_output=gb.T, **vs,
                      **opts)
        lt, gt = _run(fn, sb[..., start:stop], tb[..., start:stop].transpose(0, 1), *args,
                      view=view, grad_output=gb.T, process_group=group, **vs, **opts)
        same = _same_on_all_ranks(lt, group)
        _compare(f"{tag} {name}", failures, lt, l1, gt, g1[..., start:stop], same)


_COLLECTIVES = ["all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce",
                "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
                "gather", "scatter", "send", "recv", "isend", "irecv", "all_gather_object",
                "broadcast_object_list", "_all_gather_base", "_reduce_scatter_base"]


class _Counter:
    """Counts collective calls and the elements each rank contributes to them."""

    def __init__(self):
        self.calls = 0
        self.elements = 0
        self._saved = {}

    def __enter__(self):
        for name in _COLLECTIVES:
            orig = getattr(dist, name, None)
            if orig is None:
                continue
            self._saved[name] = orig

            def wrapped(*args, __orig=orig, __name=name, **kwargs):
                self.calls += 1
                x = args[1] if __name in ("all_gather", "all_gather_into_tensor",
                                          "_all_gather_base") and len(args) > 1 else (
                    args[0] if args else None)
                if isinstance(x, torch.Tensor):
                    self.elements += x.numel()
                elif isinstance(x, (list, tuple)):
                    self.elements += sum(y.numel() for y in x if isinstance(y, torch.Tensor))
                return __orig(*args, **kwargs)

            setattr(dist, name, wrapped)
        return self

    def __exit__(self, *exc):
        for name, orig in self._saved.items():
            setattr(dist, name, orig)


def run_communication(group, rank, failures):
    """Communication is O(rows x K), never O(rows x V); backward does at most one collective,
    however many rows and chunks (chunk_bytes=1: one row per chunk)."""
    world = dist.get_world_size(group)
    width = 3000 * world
    k = 8
    start, stop = rank * 3000, (rank + 1) * 3000
    stats = {}
    for rows in (4, 64):
        s, t, gout = _inputs((rows,), width, torch.float32, 7)
        for fname, fn, args, opts in [
            ("topk", topkd.topk_kl_loss, (k,), dict(top_p=0.9)),
            ("kl", topkd.kl_loss, (), {}),
        ]:
            sl = s[:, start:stop].clone().requires_grad_(True)
            with _Counter() as fwd:
                loss = fn(sl, t[:, start:stop], *args, process_group=group, chunk_bytes=1,
                          **opts)
            with _Counter() as bwd:
                loss.backward(gout)
            stats[(fname, rows)] = (fwd.calls, bwd.calls, fwd.elements + bwd.elements)
    try:
        for fname in ("topk", "kl"):
            f4, b4, _ = stats[(fname, 4)]
            _, b64, e64 = stats[(fname, 64)]
            assert f4 + b4 > 0, "no collective seen: the counter does not see the library's calls"
            # (the design bounds the forward's communication volume, below, not its number of
            # collectives: a per-chunk gather of top-K candidates is allowed.)
            assert b64 == b4, f"{fname}: backward collectives grow with rows/chunks: {b4} -> {b64}"
            assert b64 <= 1, f"{fname}: backward does {b64} collectives (expected at most one)"
            # rows x (K + a few per-row statistics), with generous slack; rows x V_r is 192,000
            bound = 64 * (k + 8) * 4 + 512
            assert e64 <= bound, (
                f"{fname}: {e64} elements communicated for 64 rows, K={k} (bound {bound})")
    except AssertionError as e:
        failures.append(f"[communication] {e} stats={stats}")


def run_sampled_selection(group, rank, failures):
    """The teacher's selection where each shard is wide enough for the sampled threshold (the
    other layouts' shards are not, but for K = 1): the merge of each rank's sampled candidates
    equals one process's selection, bf16 ties and top-p included."""
    world = dist.get_world_size(group)
    sizes = [400 + 37 * r for r in range(world)]
    start = sum(sizes[:rank])
    k = 20
    assert topkd.topk.sampled_plan(min(sizes), k + 1) is not None
    # (7 rows: each merge block's rows split unevenly among the ranks, one part padded; with
    # chunk_bytes=900, merge blocks of a few rows, the last shorter)
    for dtype, opts in ((torch.float32, {}), (torch.bfloat16, dict(top_p=0.9, top_p_min_k=4)),
                        (torch.float32, dict(chunk_bytes=900))):
        g = torch.Generator().manual_seed(11)
        t = (torch.randn(7, sum(sizes), generator=g) * 3.0).to(dtype)
        name = f"TP sampled select_topk {dtype} {opts}"
        try:
            st1 = topkd.select_topk(t, k, **opts)
            stt = topkd.select_topk(t[:, start:start + sizes[rank]], k, process_group=group,
                                    **opts)
            assert torch.equal(stt.indices, st1.indices), f"indices\n{stt.indices}\n{st1.indices}"
            torch.testing.assert_close(stt.logprobs, st1.logprobs, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(stt.rest_logprob, st1.rest_logprob, rtol=1e-6,
                                       atol=1e-6)
            for field in (stt.indices, stt.logprobs, stt.rest_logprob):
                assert _same_on_all_ranks(field, group), "ranks disagree"
        except AssertionError as e:
            failures.append(f"[{name}] {e}")


def run_edge_cases(group, rank, failures):
    """Zero rows; bad inputs raise ValueError on every rank (no rank left in a collective)."""
    world = dist.get_world_size(group)
    sizes = [5 + 3 * r for r in range(world)]
    width = sum(sizes)
    start = sum(sizes[:rank])
    stop = start + sizes[rank]
    # zero rows
    try:
        for fn, args in ((topkd.topk_kl_loss, (4,)), (topkd.kl_loss, ())):
            s = torch.randn(0, sizes[rank], requires_grad=True)
            t = torch.randn(0, sizes[rank])
            loss = fn(s, t, *args, process_group=group)
            assert loss.shape == (0,), loss.shape
            loss.sum().backward()
            s2 = torch.randn(2, 0, sizes[rank], requires_grad=True)
            loss = fn(s2, torch.randn(2, 0, sizes[rank]), *args, reduction="mean",
                      process_group=group)
            assert float(loss.detach()) == 0.0
            loss.backward()
    except Exception as e:  # noqa: BLE001
        failures.append(f"[TP zero rows] {type(e).__name__}: {e}")
    # k larger than the global vocabulary (each shard is smaller than k anyway)
    s = torch.randn(3, sizes[rank])
    t = torch.randn(3, sizes[rank])
    try:
        topkd.topk_kl_loss(s, t, width + 1, process_group=group)
        failures.append("[TP k > V] no error")
    except ValueError:
        pass
    # k between the largest shard and V is valid
    try:
        topkd.topk_kl_loss(s, t, width, process_group=group)
    except Exception as e:  # noqa: BLE001
        failures.append(f"[TP k = V] {type(e).__name__}: {e}")
    # a width mismatch on one rank only must raise on every rank, not hang the others
    t_bad = torch.randn(3, sizes[rank] + (1 if rank == 0 else 0))
    try:
        topkd.topk_kl_loss(s, t_bad, 3, process_group=group)
        failures.append("[TP width mismatch on rank 0 only] no error on this rank")
    except ValueError:
        pass
    except Exception as e:  # noqa: BLE001  (e.g. a gloo timeout: a rank was left waiting)
        failures.append(f"[TP width mismatch on rank 0 only] {type(e).__name__}: {e}")
    # other kernels on rank 0 only (their chunk heights, and so their collectives, differ):
    # a ValueError on every rank, raised before any kernel runs (where they can compile)
    impl = "eager" if rank == 0 else "compile"
    differ = [
        ("topk_kl_loss", lambda: topkd.topk_kl_loss(s, t, 3, impl=impl, process_group=group)),
        ("kl_loss", lambda: topkd.kl_loss(s, t, impl=impl, process_group=group)),
        ("select_topk", lambda: topkd.select_topk(t, 3, impl=impl, process_group=group)),
    ]
    if compiler_missing("cpu"):
        differ = []
    for name, call in differ:
        try:
            call()
            failures.append(f"[TP kernels differ: {name}] no error on this rank")
        except ValueError as e:
            expected = str(["eager", *["compile"] * (world - 1)])
            if "differ across ranks" not in str(e) or expected not in str(e):
                failures.append(f"[TP kernels differ: {name}] another message: {e}")
        except Exception as e:  # noqa: BLE001
            failures.append(f"[TP kernels differ: {name}] {type(e).__name__}: {e}")
    # options that differ on rank 0 only (a silently wrong loss, an aborted collective or a
    # wait before): a ValueError on every rank, naming this rank's options
    first = rank == 0
    for name, call in (
            ("k", lambda: topkd.topk_kl_loss(s, t, 3 if first else 2, process_group=group)),
            ("temperature", lambda: topkd.kl_loss(s, t, temperature=2.0 if first else 1.0,
                                                  process_group=group)),
            ("chunk_bytes", lambda: topkd.kl_loss(s, t, chunk_bytes=4096 if first else None,
                                                  process_group=group))):
        try:
            call()
            failures.append(f"[TP options differ: {name}] no error on this rank")
        except ValueError as e:
            named = f"{name}=" in str(e) if first else True  # (rank 0's options hold it)
            if "the loss options differ across ranks" not in str(e) or not named:
                failures.append(f"[TP options differ: {name}] another message: {e}")
        except Exception as e:  # noqa: BLE001
            failures.append(f"[TP options differ: {name}] {type(e).__name__}: {e}")
    # impl="compile" where a machine cannot compile: learned at the exchange, not raised
    # before it (which would leave the other ranks waiting there): on rank 0 only, a
    # ValueError on every rank; on all, the RuntimeError on every rank
    compiled = topkd.backends.compiled
    for missing_on, error in (({0}, ValueError), (set(range(world)), RuntimeError)):
        if compiler_missing("cpu") and missing_on != set(range(world)):
            continue
        found = compiled.compiler_missing
        if rank in missing_on:
            compiled.compiler_missing = lambda device_type: "no C++ compiler (a test's)"
        try:
            for name, call in (
                    ("kl_loss", lambda: topkd.kl_loss(s, t, impl="compile", process_group=group)),
                    ("select_topk", lambda: topkd.select_topk(t, 3, impl="compile",
                                                              process_group=group))):
                what = f"[TP compiler missing on ranks {sorted(missing_on)}: {name}]"
                try:
                    call()
                    failures.append(f"{what} no error on this rank")
                except error as e:
                    want = ("compile (unavailable)" if error is ValueError
                            else "no C++ compiler (a test's)")
                    if want not in str(e):
                        failures.append(f"{what} another message: {e}")
                except Exception as e:  # noqa: BLE001  (e.g. a gloo timeout)
                    failures.append(f"{what} {type(e).__name__}: {e}")
        finally:
            compiled.compiler_missing = found
    del start, stop


def run_rank(rank, world, result_dir, body):
    """One spawned rank: a gloo group (every wait with a timeout) that meets through a file
    in ``result_dir``, the test's own directory (no port, so tests run side by side cannot
    collide), then ``body(group, failures)``; failures, or "OK", go to
    ``result_dir/rank{rank}.txt``."""
    failures: list[str] = []
    try:
        torch.set_num_threads(1)
        rendezvous = os.path.join(os.path.abspath(result_dir), "rendezvous")
        dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=60))
        body(dist.group.WORLD, failures)
        dist.barrier()
    except Exception:  # noqa: BLE001  (reported to the parent through the result file)
        failures.append(traceback.format_exc())
    finally:
        with open(os.path.join(result_dir, f"rank{rank}.txt"), "w") as f:
            f.write("\n\n".join(failures) if failures else "OK")
        if dist.is_initialized():
            dist.destroy_process_group()


# The compiled kernels' run: each rank compiles its own kernels, so two cases that cover both
# paths, a mask, one-row chunks and the CE term with its own normalizer, then the sharded
# teacher's selection (its bf16 views and a SampledTeacher run eager only: test_parallel.py).
COMPILED_CASES = ("topk mask mean chunk_bytes=1", "kl JSD(0.1) ce T=2 mask mean chunk_bytes=1")


def worker(rank, world, plan, result_dir):
    """Every tensor-parallel check of one spawned group (starting the ranks is the slow part),
    in order: ``plan["layouts"]``, the logits losses for each ``(width, shard sizes,
    vocab_size)``; the communication volume if ``plan["communication"]``; the edge cases;
    ``plan["fused"]``, the fused losses (fused_tp_worker) for each layout, and in bf16 for the
    first; ``plan["compiled"]``, :data:`COMPILED_CASES` with the compiled kernels. The edge
    cases run unless ``plan["edge_cases"]`` is False."""
    def body(group, failures):
        for width, sizes, vocab_size in plan.get("layouts", ()):
            run_layout(group, rank, width, sizes, vocab_size, failures)
        if plan.get("communication"):
            run_communication(group, rank, failures)
        if plan.get("edge_cases", True):
            run_edge_cases(group, rank, failures)
            run_sampled_selection(group, rank, failures)
        fused = plan.get("fused", ())
        if fused:
            import fused_tp_worker

            for width, sizes, vocab_size in fused:
                fused_tp_worker.run_layout(group, rank, width, sizes, vocab_size, failures)
            width, sizes, vocab_size = fused[0]
            fused_tp_worker.run_layout(group, rank, width, sizes, vocab_size, failures,
                                       dtype=torch.bfloat16, seed=1)
        if plan.get("compiled"):
            impl = os.environ.get("TOPKD_IMPL")
            os.environ["TOPKD_IMPL"] = "compile"
            try:
                for width, sizes, vocab_size in plan["compiled"]:
                    run_layout(group, rank, width, sizes, vocab_size, failures,
                               names=COMPILED_CASES)
            finally:
                if impl is None:
                    del os.environ["TOPKD_IMPL"]
                else:
                    os.environ["TOPKD_IMPL"] = impl

    run_rank(rank, world, result_dir, body)
