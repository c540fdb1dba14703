"""Body of the fused LM-head tensor-parallel tests, run in spawned gloo ranks (tp_worker.worker
runs :func:`run_layout` for test_parallel.py's fused layouts).

Each rank builds the same full inputs from a fixed seed and computes the one-process result
(process_group=None, the whole weight) and the tensor-parallel one: its contiguous shard of
the weight's rows, of the bias, of the teacher's logits or of the teacher's weight/bias, with
the hidden states replicated. Then, with tp_worker's tolerances:

- the loss within 1e-6 (relative to the batch's loss scale) of one process, identical on every
  rank;
- the weight and bias gradients: this rank's shard of the one-process gradients;
- the hidden gradient: by default this rank's partial sum (the sum over ranks equals the
  one-process gradient); with ``reduce_hidden_grad=True`` the full one-process gradient on
  every rank;
- OBJECTIVE_CASES (divergences, labels/CE, softcap): also the (kd, ce) parts, the float64
  reference and, for ``twice``, a second backward with ``retain_graph=True``.
"""

from __future__ import annotations

import os
import sys
import traceback

import torch
import torch.distributed as dist

_HERE = os.path.dirname(os.path.abspath(__file__))
for _p in (_HERE, os.path.dirname(_HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import reference  # noqa: E402
from tp_worker import (  # noqa: E402
    PART_RTOL,
    _compare,
    _same_on_all_ranks,
    compare_reference,
    labels_for,
)

import topkd  # noqa: E402

LEAD = (3, 4)
H = 16
H_T = 12


def _inputs(width, dtype, seed):
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)

    d = {
        "h": rnd(*LEAD, H),
        "W": rnd(width, H, scale=2.0 / H ** 0.5),
        "b": rnd(width, scale=0.5),
        "t": rnd(*LEAD, width, scale=2.5),
        "th": rnd(*LEAD, H_T),
        "tW": rnd(width, H_T, scale=2.5 / H_T ** 0.5),
        "tb": rnd(width, scale=0.5),
    }
    d["go"] = torch.randn(*LEAD, generator=g)
    d["mask"] = torch.rand(*LEAD, generator=g) < 0.6
    return d


def _teacher(d, kind, sl, k, opts, group):
    """The teacher argument for the weight rows ``sl`` (all of them in one process)."""
    if kind == "logits":
        return d["t"][..., sl]
    if kind == "pair":
        return (d["th"], d["tW"][sl])
    if kind == "pair_bias":
        return (d["th"], d["tW"][sl], d["tb"][sl])
    if kind == "sparse":
        return topkd.select_topk(d["t"][..., sl], k, top_p=opts.get("top_p"),
                                 top_p_min_k=opts.get("top_p_min_k", 1),
                                 temperature=opts.get("temperature", 1.0),
                                 vocab_size=opts.get("vocab_size"), process_group=group)
    raise AssertionError(kind)


def _call(d, loss, kind, opts, sl, group, requires):
    """``(output, (hidden, weight, bias) leaves)``; the output is the loss or, with
    ``return_components``, ``LossParts(loss, kd, ce)``."""
    opts = dict(opts)
    opts.pop("twice", None)
    k = opts.pop("k", None)
    if opts.pop("mask", False):
        opts["mask"] = d["mask"]
    if opts.pop("labels", False):
        opts["labels"] = d["labels"]
    teacher = _teacher(d, kind, sl, k, opts, group)
    if kind == "sparse":
        opts.pop("top_p", None)
        opts.pop("top_p_min_k", None)
    h = d["h"].detach().clone().requires_grad_(requires[0])
    w = d["W"][sl].detach().clone().requires_grad_(requires[1])
    b = d["b"][sl].detach().clone().requires_grad_(requires[2])
    if loss == "topk":
        out = topkd.fused_topk_kl_loss(h, w, teacher, k, bias=b, process_group=group, **opts)
    else:
        out = topkd.fused_kl_loss(h, w, teacher, bias=b, process_group=group, **opts)
    return out, (h, w, b)


def _run(d, loss, kind, opts, sl, group, requires):
    out, (h, w, b) = _call(d, loss, kind, opts, sl, group, requires)
    value = out[0] if isinstance(out, tuple) else out
    value.backward(d["go"] if value.dim() else None)
    if isinstance(out, tuple):
        out = type(out)(*(x.detach() for x in out))
    else:
        out = out.detach()
    return out, h.grad, w.grad, b.grad


def _second_backward(d, loss, kind, opts, sl, group, requires):
    """Backward twice through one graph (``retain_graph=True``): an error message when the
    gradients differ, else None (every rank runs the same collectives either way)."""
    out, leaves = _call(d, loss, kind, opts, sl, group, requires)
    value = out[0] if isinstance(out, tuple) else out
    go = d["go"] if value.dim() else torch.ones_like(value)
    leaves = [x for x in leaves if x.requires_grad]
    first = torch.autograd.grad(value, leaves, go, retain_graph=True)
    second = torch.autograd.grad(value, leaves, go)
    for name, a, b in zip("hWb", first, second, strict=True):
        if not torch.equal(a, b):
            return (f"a second backward (retain_graph=True) gives another {name} gradient: "
                    f"max diff {float((a - b).abs().max()):.3e}")
    return None


CASES = [
    # (name, loss, teacher kind, options, requires_grad of (hidden, weight, bias))
    ("topk logits k=12", "topk", "logits", dict(k=12), None),
    ("topk logits top_p reverse T chunk=1", "topk", "logits",
     dict(k=12, top_p=0.8, top_p_min_k=2, reverse=True, temperature=0.7, chunk_bytes=1), None),
    ("topk logits normalize=topk reverse", "topk", "logits",
     dict(k=5, normalize="topk", reverse=True), None),
    ("topk pair T", "topk", "pair", dict(k=12, temperature=1.4), None),
    ("topk pair_bias reverse reduce_hidden_grad", "topk", "pair_bias",
     dict(k=5, reverse=True, reduce_hidden_grad=True), None),
    ("topk pair_bias top_p mask mean chunk=1 reduce_hidden_grad", "topk", "pair_bias",
     dict(k=12, top_p=0.7, mask=True, reduction="mean", chunk_bytes=1,
          reduce_hidden_grad=True), None),
    ("topk sparse reverse", "topk", "sparse", dict(k=12, reverse=True, temperature=0.9), None),
    ("topk sparse top_p sum reduce_hidden_grad", "topk", "sparse",
     dict(k=12, top_p=0.8, reduction="sum", reduce_hidden_grad=True), None),
    ("topk k=V pair", "topk", "pair", dict(k="V"), None),
    ("topk frozen weight", "topk", "logits", dict(k=12), (True, False, True)),
    ("kl logits", "kl", "logits", dict(), None),
    ("kl pair_bias reverse T reduce_hidden_grad", "kl", "pair_bias",
     dict(reverse=True, temperature=1.3, reduce_hidden_grad=True), None),
    ("kl pair sum chunk=1", "kl", "pair", dict(reduction="sum", chunk_bytes=1), None),
    ("kl logits mask none frozen hidden", "kl", "logits", dict(mask=True),
     (False, True, True)),
]

# Divergences beyond KL and the hard-label term (labels with ignore_index rows and on every
# rank's shard) with a (hidden, weight) teacher and a softcapped student, "mean" (one pass,
# gradients in forward) and "none" (two passes), T = 1 and 2; also checked against the float64
# reference and, with ``twice``, a second backward through the same graph.
_C = dict(labels=True, return_components=True)
OBJECTIVE_CASES = [
    ("topk pair softcap jsd ce T=1 mask mean twice", "topk", "pair",
     dict(k=12, divergence="jsd", softcap=3.0, ce_weight=0.5, mask=True, reduction="mean",
          twice=True, **_C), None),
    ("topk pair_bias softcap scale JSD(0.1) ce T=2 none reduce_hidden_grad", "topk",
     "pair_bias", dict(k=12, divergence=topkd.JSD(beta=0.1), softcap=2.5, logit_scale=1.5,
                       teacher_softcap=4.0, ce_weight=0.3, temperature=2.0,
                       reduce_hidden_grad=True, **_C), None),
    ("topk pair softcap tvd top_p ce T=2 mean chunk=1 reduce_hidden_grad twice", "topk",
     "pair", dict(k=5, divergence="tvd", top_p=0.8, softcap=3.0, ce_weight=1.0,
                  temperature=2.0, reduction="mean", chunk_bytes=1, reduce_hidden_grad=True,
                  twice=True, **_C), None),
    ("topk pair softcap SkewKL(0.2) ce T=1 none chunk=1", "topk", "pair",
     dict(k=12, divergence=topkd.SkewKL(alpha=0.2), softcap=3.0, ce_weight=0.5,
          chunk_bytes=1, **_C), None),
    ("topk sparse softcap skew_reverse_kl ce T=2 sum", "topk", "sparse",
     dict(k=12, divergence="skew_reverse_kl", softcap=3.0, ce_weight=0.5, temperature=2.0,
          reduction="sum", **_C), None),
    ("kl pair softcap jsd ce T=2 mean twice", "kl", "pair",
     dict(divergence="jsd", softcap=3.0, ce_weight=0.5, temperature=2.0, reduction="mean",
          twice=True, **_C), None),
    ("kl pair_bias softcap JSD(0.1) ce T=1 none reduce_hidden_grad", "kl", "pair_bias",
     dict(divergence=topkd.JSD(beta=0.1), softcap=2.5, ce_weight=1.0, reduce_hidden_grad=True,
          **_C), None),
    ("kl pair softcap tvd ce T=2 none", "kl", "pair",
     dict(divergence="tvd", softcap=3.0, ce_weight=0.5, temperature=2.0, **_C), None),
    ("kl pair softcap skew_reverse_kl ce T=1 mask mean chunk=1", "kl", "pair",
     dict(divergence="skew_reverse_kl", softcap=3.0, ce_weight=0.5, kd_weight=0.5, mask=True,
          reduction="mean", chunk_bytes=1, **_C), None),
    ("kl pair softcap SkewKL ce T=2 none frozen weight", "kl", "pair",
     dict(divergence=topkd.SkewKL(), softcap=3.0, ce_weight=0.5, temperature=2.0, **_C),
     (True, False, True)),
]


def _compare_hidden(name, failures, gh_tp, gh_part, gh_1, reduced, group, dtype):
    """The hidden gradient. ``gh_part`` is this rank's gradient without reduce_hidden_grad:
    the sum over ranks of the partials (in float64) equals the one-process gradient. With
    ``reduced``, ``gh_tp`` is the same on every rank and equals the SUM all-reduce of the
    partials."""
    try:
        if gh_1 is None:
            assert gh_tp is None and gh_part is None, "hidden got a gradient it does not require"
            return
        assert gh_tp is not None and gh_part is not None, "no hidden gradient"
        for g in (gh_tp, gh_part):
            assert g.dtype == gh_1.dtype and g.shape == gh_1.shape, (
                g.dtype, g.shape, gh_1.dtype, gh_1.shape)
        scale = float(gh_1.abs().max())
        total = gh_part.double().clone()
        dist.all_reduce(total, group=group)
        spread = gh_part.double().abs()
        dist.all_reduce(spread, group=group)
        ref = gh_1.double()
        if dtype == torch.float32:
            bound = 1e-5 * ref.abs() + 1e-5 * scale
        else:  # each partial and the one-process gradient are rounded to bf16 (2^-9 relative)
            bound = 2.0 ** -7 * (spread + ref.abs()) + 1e-5 * scale
        err = (total - ref).abs()
        assert torch.all(err <= bound), (
            f"hidden gradient: sum of the partials differs from one process: max err "
            f"{float(err.max()):.3e}, max|g| {scale:.3e}, worst ratio "
            f"{float((err / bound).max()):.2f}")
        if world_size(group) > 1 and scale > 0:
            # the default is a partial sum, not already the full gradient
            assert not torch.allclose(gh_part.double(), ref, rtol=1e-3, atol=1e-3 * scale), (
                "the hidden gradient is already reduced without reduce_hidden_grad")
        if reduced:
            assert _same_on_all_ranks(gh_tp, group), "reduced hidden gradients differ by rank"
            expect = gh_part.clone()
            dist.all_reduce(expect, group=group)
            assert torch.equal(gh_tp, expect), (
                f"reduce_hidden_grad=True: not the SUM all-reduce of the partials: max err "
                f"{float((gh_tp.double() - expect.double()).abs().max()):.3e}")
            if dtype == torch.float32:
                e = float((gh_tp.double() - ref).abs().max())
                assert e <= 1e-5 * scale, f"reduced hidden gradient vs one process: {e:.3e}"
    except AssertionError as e:
        failures.append(f"[{name}] {e}")


def _reference(d, loss, kind, opts):
    """float64 ``(loss, kd, ce)`` and ``(hidden, weight, bias)`` gradients of the case."""
    ropts = {n: v for n, v in opts.items()
             if n not in ("reduce_hidden_grad", "chunk_bytes", "twice", "return_components")}
    if ropts.pop("mask", False):
        ropts["mask"] = d["mask"]
    if ropts.pop("labels", False):
        ropts["labels"] = d["labels"]
    k = ropts.pop("k", None)
    if kind in ("logits", "sparse"):
        t = d["t"]
    else:
        t = reference.linear_logits(d["th"], d["tW"], d["tb"] if kind == "pair_bias" else None)
    fn, args = (reference.topk_loss, (t, k)) if loss == "topk" else (reference.full_loss, (t,))
    go = d["go"] if ropts.get("reduction", "none") == "none" else None
    rl, gh, gw, gb = reference.linear_loss_and_grads(fn, d["h"], d["W"], *args, bias=d["b"],
                                                     grad_output=go, **ropts)
    _, kd, ce = fn(reference.linear_logits(d["h"], d["W"], d["b"]), *args,
                   return_components=True, **ropts)
    return (rl, kd, ce), (gh, gw, gb)


def world_size(group):
    return dist.get_world_size(group)


def run_layout(group, rank, width, sizes, vocab_size, failures, dtype=torch.float32, seed=0):
    world = dist.get_world_size(group)
    assert len(sizes) == world and sum(sizes) == width
    start = sum(sizes[:rank])
    sl = slice(start, start + sizes[rank])
    full = slice(None)
    tag = f"W={width} shards={sizes} vocab_size={vocab_size} {dtype}"
    d = _inputs(width, dtype, seed)
    d["labels"] = labels_for(LEAD, sizes, vocab_size, seed)
    vs = {} if vocab_size is None else {"vocab_size": vocab_size}
    objective = {c[0] for c in OBJECTIVE_CASES}
    # bf16: of the objective cases only the "mean" (one-pass) ones, to keep the spawn short
    cases = CASES + [c for c in OBJECTIVE_CASES
                     if dtype == torch.float32 or c[3].get("reduction") == "mean"]
    for name, loss, kind, opts, requires in cases:
        if dtype != torch.float32 and "frozen" in name:
            continue
        opts = dict(opts, **vs)
        if opts.get("k") == "V":
            opts["k"] = vocab_size or width
        if dtype != torch.float32:
            opts["chunk_bytes"] = 1  # the same chunking in both runs: one row per chunk
        requires = requires or (True, True, True)
        reduced = opts.get("reduce_hidden_grad", False)
        one = {n: x for n, x in opts.items() if n != "reduce_hidden_grad"}
        try:
            l1, gh1, gw1, gb1 = _run(d, loss, kind, one, full, None, requires)
            lt, ght, gwt, gbt = _run(d, loss, kind, opts, sl, group, requires)
            ghp = _run(d, loss, kind, one, sl, group, requires)[1] if reduced else ght
        except Exception:  # noqa: BLE001
            failures.append(f"[{tag} {name}] {traceback.format_exc()}")
            # keep the ranks in step: every rank runs the same collectives per case
            continue
        if isinstance(lt, tuple):  # return_components: the kd and ce parts too
            for what, pt, p1 in zip(("kd", "ce"), lt[1:], l1[1:], strict=True):
                _compare(f"{tag} {name} ({what} part)", failures, pt, p1, None, None,
                         _same_on_all_ranks(pt, group), rtol=PART_RTOL)
            parts_t, lt, l1 = tuple(lt), lt[0], l1[0]
        else:
            parts_t = (lt,)
        same = _same_on_all_ranks(lt, group)
        for pname, gt, g1 in (("weight", gwt, gw1), ("bias", gbt, gb1)):
            if g1 is None:
                if gt is not None:
                    failures.append(f"[{tag} {name}] {pname} got a gradient it does not "
                                    f"require")
                continue
            if gt is None:
                failures.append(f"[{tag} {name}] no {pname} gradient")
                continue
            _compare(f"{tag} {name} ({pname} gradient)", failures, lt, l1, gt, g1[sl], same)
        if vocab_size is not None and gw1 is not None:
            if not torch.all(gw1[vocab_size:] == 0):
                failures.append(f"[{tag} {name}] padded weight rows got a gradient")
        _compare_hidden(f"{tag} {name}", failures, ght, ghp, gh1, reduced, group, dtype)
        if opts.get("twice") and dtype == torch.float32:
            err = _second_backward(d, loss, kind, opts, sl, group, requires)
            if err:
                failures.append(f"[{tag} {name}] {err}")
        if name in objective and dtype == torch.float32:
            ref_parts, (rgh, rgw, rgb) = _reference(d, loss, kind, one)
            grads = []
            if gh1 is not None:  # the whole hidden gradient: reduced, or the sum of partials
                full_h = ght.clone()
                if not reduced:
                    dist.all_reduce(full_h, group=group)
                grads.append(("hidden", full_h, rgh, float(rgh.abs().max())))
            for pname, gt, rg, need in (("weight", gwt, rgw, requires[1]),
                                        ("bias", gbt, rgb, requires[2])):
                if need:
                    grads.append((pname, gt, rg[sl], float(rg.abs().max())))
            compare_reference(f"{tag} {name}", failures, parts_t, ref_parts, grads)
