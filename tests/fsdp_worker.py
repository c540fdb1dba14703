"""Body of the FSDP2 tests (a head that is a DTensor sharded by vocabulary rows), run in
spawned gloo ranks (see parallel/test_fsdp.py).

- Training: a tiny LM under ``fully_shard`` (its blocks and its root, the root resharded after
  forward, so ``lm_head.weight`` reaches the loss as a ``Shard(0)`` DTensor; uneven shards at
  3 ranks) trains three SGD steps against one process that runs every rank's batch with the
  same model and averages the per-rank losses (FSDP's reduction). The per-rank losses and then
  every parameter must match to 1e-5, for both ``sharded_head`` designs: KL against a teacher
  head that is itself sharded, Top-K against logits with the CE term, JSD against a
  SparseTeacher, a head tied to the input embedding, ``reduction="none"``, unequal row counts
  per rank, ``set_gradient_divide_factor``, gradient accumulation over micro-batches with
  FSDP's gradient sync off, the Module form.
- Loss level: float32 against the float64 reference (loss, hidden and weight gradients); bf16
  hidden states with a float32 head against one process.
- Bad input: a ValueError naming the argument before any collective; values bad on some
  ranks only (labels, a SparseTeacher's rows): a ValueError on every rank after one exchanged
  flag, the bad ranks' naming the argument, the others' the bad ranks.
"""

from __future__ import annotations

import os
import sys
import traceback

import torch
import torch.distributed as dist
from torch import nn

_HERE = os.path.dirname(os.path.abspath(__file__))
for _p in (_HERE, os.path.dirname(_HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import reference  # noqa: E402
from tp_worker import run_rank  # noqa: E402

import topkd  # noqa: E402

V, H, H_T = 37, 16, 12  # V = 37: shards of 19/18 rows (2 ranks), 13/13/11 (3 ranks)
BATCH, SEQ = 2, 5
STEPS = 3
LR = 0.5
PARAM_TOL = 1e-5


class TinyLM(nn.Module):
    def __init__(self, tied: bool):
        super().__init__()
        self.embed = nn.Embedding(V, H)
        self.blocks = nn.ModuleList(nn.Linear(H, H) for _ in range(2))
        self.lm_head = nn.Linear(H, V, bias=False)
        if tied:
            self.lm_head.weight = self.embed.weight

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        return x


def _data(step: int, rank: int, seq: int, t_weight):
    """One rank's batch at one step: token ids, labels, a mask, the teacher's hidden states
    and logits, an upstream gradient for ``reduction="none"``."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(0, V, (BATCH, seq), generator=g)
    labels = torch.randint(0, V, (BATCH, seq), generator=g)
    labels[0, 0] = -100
    mask = torch.rand(BATCH, seq, generator=g) < 0.8
    t_hidden = torch.randn(BATCH, seq, H_T, generator=g)
    go = torch.rand(BATCH, seq, generator=g)
    return {"ids": ids, "labels": labels, "mask": mask, "t_hidden": t_hidden,
            "t_logits": t_hidden @ t_weight.T, "go": go}


# (name, loss, teacher kind, options, tied, unequal rows, divide factor)
TRAIN_CASES = [
    ("kl, sharded teacher head", "kl", "head_sharded", dict(reduction="mean"), False, False,
     None),
    ("topk k=8, teacher logits, CE, mask", "topk", "logits",
     dict(k=8, labels=True, ce_weight=0.5, mask=True, reduction="mean"), False, False, None),
    ("jsd, SparseTeacher, tied head", "topk", "sparse",
     dict(k=6, divergence="jsd", reduction="mean"), True, False, None),
    ("kl, plain teacher head, CE, tied, unequal rows", "kl", "head_plain",
     dict(labels=True, ce_weight=1.0, temperature=2.0, reduction="mean"), True, True, None),
    ("topk none, sharded teacher head", "topk", "head_sharded", dict(k=5, reduction="none"),
     False, False, None),
    ("kl sum, divide factor 1", "kl", "logits", dict(reduction="sum"), False, False, 1.0),
    ("kl, 2 micro-batches (no gradient sync but the last), tied", "kl", "head_sharded",
     dict(reduction="mean", micro=2), True, False, None),
    ("FusedTopKLogitsKLLoss, sharded teacher head, CE", "module", "head_sharded",
     dict(k=6, labels=True, ce_weight=0.3, reduction="mean"), False, False, None),
]


def _teacher(kind, d, head_weight, t_weight, k):
    """The teacher argument: ``head_weight`` is the sharded teacher head's weight (FSDP) or
    the plain one (one process)."""
    if kind == "logits":
        return d["t_logits"]
    if kind == "sparse":
        return topkd.select_topk(d["t_logits"], k)
    if kind == "head_plain":
        return (d["t_hidden"], t_weight)
    return (d["t_hidden"], head_weight)


def _loss(loss, model, hidden, teacher, d, opts, design):
    opts = dict(opts)
    k = opts.pop("k", None)
    if opts.pop("labels", False):
        opts["labels"] = d["labels"]
    if opts.pop("mask", False):
        opts["mask"] = d["mask"]
    if design is not None:
        opts["sharded_head"] = design
    weight = model.lm_head.weight
    if loss == "module":  # the Module form: options at construction, mask/labels per call
        per_call = {n: opts.pop(n) for n in ("mask", "labels") if n in opts}
        return topkd.FusedTopKLogitsKLLoss(k, **opts)(hidden, weight, teacher, **per_call)
    if loss == "topk":
        if isinstance(teacher, topkd.SparseTeacher):
            return topkd.fused_topk_kl_loss(hidden, weight, teacher, **opts)
        return topkd.fused_topk_kl_loss(hidden, weight, teacher, k, **opts)
    return topkd.fused_kl_loss(hidden, weight, teacher, **opts)


def _full(p):
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def run_training(mesh, rank, world, failures):
    from torch.distributed.fsdp import fully_shard

    for name, loss, kind, opts, tied, unequal, divide in TRAIN_CASES:
        for design in ("vocab_parallel", "gather"):
            tag = f"[{world} ranks, {design}] {name}"
            try:
                _train_case(fully_shard, mesh, rank, world, loss, kind, opts, tied, unequal,
                            divide, design, tag, failures)
            except Exception:  # noqa: BLE001
                failures.append(f"{tag}\n{traceback.format_exc()}")


def _train_case(fully_shard, mesh, rank, world, loss, kind, opts, tied, unequal, divide,
                design, tag, failures):
    torch.manual_seed(0)
    model = TinyLM(tied)
    ref = TinyLM(tied)
    ref.load_state_dict(model.state_dict())
    initial = {n: p.detach().clone() for n, p in ref.named_parameters()}
    t_weight = torch.randn(V, H_T) * 0.5
    t_head = nn.Linear(H_T, V, bias=False)
    with torch.no_grad():
        t_head.weight.copy_(t_weight)
    fully_shard(t_head, mesh=mesh)  # a teacher head sharded for inference: never unsharded
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    if divide is not None:  # on every FSDP module: the setter is per module
        for module in model.modules():
            if hasattr(module, "set_gradient_divide_factor"):
                module.set_gradient_divide_factor(divide)
                module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    factor = {} if divide is None else {"gradient_divide_factor": divide}
    opts = dict(opts)
    micro = opts.pop("micro", 1)  # micro-batches per step, FSDP's gradient sync off but last
    for step in range(STEPS):
        seqs = [SEQ + (r if unequal else 0) for r in range(world)]
        data = [_data(step, r, seqs[r], t_weight) for r in range(world)]
        outs = []
        for m in range(micro):
            d = {key: x[m::micro] for key, x in data[rank].items()}
            if micro > 1:
                model.set_requires_gradient_sync(m == micro - 1)
            hidden = model(d["ids"])
            head = model.lm_head.weight
            if not type(head).__name__ == "DTensor":
                failures.append(f"{tag}: lm_head.weight is a {type(head).__name__} at the "
                                f"loss, not a DTensor: the test does not test the sharded head")
                return
            out = _loss(loss, model, hidden,
                        _teacher(kind, d, t_head.weight, t_weight, opts.get("k")), d,
                        {**opts, **factor}, design)
            if out.dim():
                out.backward(d["go"])
            else:
                out.backward()
            outs.append(out.detach())
        opt.step()
        opt.zero_grad()
        # one process: every rank's batch, the per-rank losses averaged (or summed / divide)
        total = 0.0
        for r in range(world):
            for m in range(micro):
                d = {key: x[m::micro] for key, x in data[r].items()}
                ref_out = _loss(loss, ref, ref(d["ids"]),
                                _teacher(kind, d, t_weight, t_weight, opts.get("k")), d, opts,
                                None)
                if r == rank:
                    err = float((outs[m] - ref_out.detach()).abs().max())
                    scale = float(ref_out.detach().abs().max())
                    if err > 1e-5 * max(scale, 1.0):
                        failures.append(f"{tag} step {step}: this rank's loss differs from "
                                        f"one process: {err:.3e} (scale {scale:.3e})")
                total = (total + (ref_out * d["go"]).sum() if ref_out.dim() else
                         total + ref_out)
        (total / (world if divide is None else divide)).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    moved = 0.0
    for (n, p), (n_ref, p_ref) in zip(model.named_parameters(), ref.named_parameters(),
                                      strict=True):
        assert n == n_ref, (n, n_ref)
        full = _full(p.detach())
        err = float((full - p_ref.detach()).abs().max())
        scale = float(p_ref.detach().abs().max())
        if err > PARAM_TOL * max(scale, 1.0):
            failures.append(f"{tag}: parameter {n} after {STEPS} steps differs from one "
                            f"process by {err:.3e} (max |p| {scale:.3e})")
        if "lm_head" in n or (tied and "embed" in n):
            moved = max(moved, float((p_ref.detach() - initial[n]).abs().max()))
    if moved < 1e-3:
        failures.append(f"{tag}: the head moved only {moved:.3e}: the check is vacuous")


# ---- loss level: float32 against the float64 reference ---------------------------------------

REF_CASES = [
    # (name, loss, teacher kind, options)
    ("kl mean, teacher head", "kl", "head", dict(reduction="mean")),
    ("topk k=7 none, teacher logits, CE T=2", "topk", "logits",
     dict(k=7, labels=True, ce_weight=0.5, temperature=2.0)),
    ("jsd topk k=5 sum, mask", "topk", "head",
     dict(k=5, divergence="jsd", mask=True, reduction="sum")),
    ("kl mean, CE, components", "kl", "logits",
     dict(labels=True, ce_weight=0.7, reduction="mean", return_components=True)),
    ("kl none, components", "kl", "head", dict(labels=True, ce_weight=0.7,
                                               return_components=True)),
    ("sampled KD (12 draws) mean, CE, mask", "sampled", "sampled",
     dict(labels=True, ce_weight=0.5, mask=True, reduction="mean")),
    # V + 3 teacher rows: its Shard(0) rows are not cut where the student's are
    ("kl mean, a wider teacher head, vocab_size=V", "kl", "head_wide",
     dict(reduction="mean", vocab_size=V)),
]


def _sampled(th, tw, r):
    """Rank ``r``'s SampledTeacher: 12 tokens drawn from its teacher logits (seed r)."""
    return topkd.sample_teacher(reference.linear_logits(th[r], tw).float(), 12, seed=r,
                                temperature=1.5)


def run_reference(mesh, rank, world, failures):
    from torch.distributed.tensor import Shard, distribute_tensor

    g = torch.Generator().manual_seed(7)
    n = 6
    h = [torch.randn(n, H, generator=g, dtype=torch.float64) for _ in range(world)]
    th = [torch.randn(n, H_T, generator=g, dtype=torch.float64) for _ in range(world)]
    w = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.5
    tw = torch.randn(V, H_T, generator=g, dtype=torch.float64) * 0.7
    go = [torch.rand(n, generator=g, dtype=torch.float64) for _ in range(world)]
    mask = [torch.rand(n, generator=g) < 0.7 for _ in range(world)]
    labels = [torch.randint(0, V, (n,), generator=g) for _ in range(world)]
    for r in range(world):
        labels[r][r] = -100
    for name, loss, kind, opts in REF_CASES:
        for design in ("vocab_parallel", "gather"):
            tag = f"[{world} ranks, {design}] reference: {name}"
            try:
                _reference_case(distribute_tensor, Shard, mesh, rank, world, loss, kind, opts,
                                design, tag, failures, h, th, w, tw, go, mask, labels)
            except Exception:  # noqa: BLE001
                failures.append(f"{tag}\n{traceback.format_exc()}")


def _reference_case(distribute_tensor, Shard, mesh, rank, world, loss, kind, opts, design,
                    tag, failures, h, th, w, tw, go, mask, labels):
    opts = dict(opts)
    k = opts.pop("k", None)
    use_labels, use_mask = opts.pop("labels", False), opts.pop("mask", False)
    if kind == "head_wide":
        kind, tw = "head", torch.cat([tw, 0.7 * torch.randn(
            3, H_T, generator=torch.Generator().manual_seed(11), dtype=torch.float64)])

    def extra(r):
        e = dict(opts)
        if use_labels:
            e["labels"] = labels[r]
        if use_mask:
            e["mask"] = mask[r]
        return e

    weight = distribute_tensor(w.float(), mesh, [Shard(0)]).requires_grad_(True)
    t_weight = distribute_tensor(tw.float(), mesh, [Shard(0)])
    hidden = h[rank].float().requires_grad_(True)
    if kind == "head":
        teacher = (th[rank].float(), t_weight)
    elif kind == "sampled":
        teacher = _sampled(th, tw, rank)
    else:
        teacher = reference.linear_logits(th[rank], tw).float()
    if loss == "sampled":
        out = topkd.fused_topk_kl_loss(hidden, weight, teacher, sharded_head=design,
                                       **extra(rank))
    elif loss == "topk":
        out = topkd.fused_topk_kl_loss(hidden, weight, teacher, k, sharded_head=design,
                                       **extra(rank))
    else:
        out = topkd.fused_kl_loss(hidden, weight, teacher, sharded_head=design, **extra(rank))
    parts = None
    if isinstance(out, tuple):
        parts, out = out, out.loss
    out.backward(go[rank].float() if out.dim() else None)
    gw = weight.grad.full_tensor()
    with torch.no_grad():  # evaluation: the same loss, no gradient, no backward collectives
        if loss == "sampled":
            again = topkd.fused_topk_kl_loss(hidden, weight, teacher, sharded_head=design,
                                             **extra(rank))
        elif loss == "topk":
            again = topkd.fused_topk_kl_loss(hidden, weight, teacher, k, sharded_head=design,
                                             **extra(rank))
        else:
            again = topkd.fused_kl_loss(hidden, weight, teacher, sharded_head=design,
                                        **extra(rank))
    again = again.loss if isinstance(again, tuple) else again
    if not torch.allclose(again, out.detach(), rtol=1e-6, atol=1e-7):
        failures.append(f"{tag}: under no_grad the loss differs: {again} vs {out.detach()}")
    # float64: every rank's loss; the head's gradient is their average (FSDP's reduction)
    ref_gw = torch.zeros_like(w)
    for r in range(world):
        t = reference.linear_logits(th[r], tw)
        fn, args = ((reference.topk_loss, (t, k)) if loss == "topk" else
                    (reference.full_loss, (t,)))
        ropts = {n: v for n, v in extra(r).items() if n != "return_components"}
        if loss == "sampled":
            st = _sampled(th, tw, r)
            fn, args = reference.sampled_loss, (st.indices, st.counts, st.samples)
            ropts.update(logq=st.logprobs, temperature=st.temperature)
        rl, rgh, rgw, _ = reference.linear_loss_and_grads(
            fn, h[r], w, *args, grad_output=go[r] if out.dim() else None, **ropts)
        ref_gw += rgw / world
        if r == rank and parts is not None:
            _, rkd, rce = fn(reference.linear_logits(h[r], w), *args, return_components=True,
                             **ropts)
            for what, x, ref_x in (("kd", parts.kd, rkd), ("ce", parts.ce, rce)):
                e = float((x.double() - ref_x).abs().max())
                if e > 1e-5 * max(float(ref_x.abs().max()), 1e-3):
                    failures.append(f"{tag}: the {what} part vs float64 {e:.3e}")
        if r == rank:
            err = float((out.detach().double() - rl).abs().max())
            if err > 1e-5 * max(float(rl.abs().max()), 1e-3):
                failures.append(f"{tag}: loss vs float64 {err:.3e}")
            e = float((hidden.grad.double() - rgh).abs().max())
            if e > 1e-5 * float(rgh.abs().max()):
                failures.append(f"{tag}: hidden gradient vs float64 {e:.3e} of "
                                f"{float(rgh.abs().max()):.3e}")
    e = float((gw.double() - ref_gw).abs().max())
    if e > 1e-5 * float(ref_gw.abs().max()):
        failures.append(f"{tag}: weight gradient vs float64 {e:.3e} of "
                        f"{float(ref_gw.abs().max()):.3e}")
    if tuple(weight.grad.placements) != tuple(weight.placements):
        failures.append(f"{tag}: weight gradient placements {weight.grad.placements}")


def run_mixed(mesh, rank, world, failures):
    """bf16 hidden states with a float32 DTensor head (autocast, or FSDP's sharded float32
    parameter with bf16 activations): each design against one process holding the whole
    head, to bf16 tolerance; the head's gradient float32, the average over ranks."""
    from torch.distributed.tensor import Shard, distribute_tensor

    g = torch.Generator().manual_seed(11)
    h = [torch.randn(5, H, generator=g).bfloat16() for _ in range(world)]
    t = [torch.randn(5, V, generator=g).bfloat16() for _ in range(world)]
    w = torch.randn(V, H, generator=g) * 0.5
    expect = torch.zeros_like(w)
    for r in range(world):
        leaf = w.clone().requires_grad_(True)
        one = topkd.fused_topk_kl_loss(h[r], leaf, t[r], 6, reduction="mean")
        one.backward()
        expect += leaf.grad / world
        if r == rank:
            one_rank = one.detach()
    for design in ("vocab_parallel", "gather"):
        weight = distribute_tensor(w, mesh, [Shard(0)]).requires_grad_(True)
        out = topkd.fused_topk_kl_loss(h[rank], weight, t[rank], 6, reduction="mean",
                                       sharded_head=design)
        out.backward()
        got = weight.grad.full_tensor()
        tag = f"[{world} ranks, {design}] bf16 hidden, float32 head"
        if got.dtype != torch.float32:
            failures.append(f"{tag}: the head's gradient is {got.dtype}")
        if abs(float(out) - float(one_rank)) > 1e-3 * max(abs(float(one_rank)), 1e-3):
            failures.append(f"{tag}: loss {float(out)} vs one process {float(one_rank)}")
        err = float((got - expect).abs().max())
        if err > 1e-2 * float(expect.abs().max()):
            failures.append(f"{tag}: head gradient vs one process {err:.3e} of "
                            f"{float(expect.abs().max()):.3e}")


# ---- bad input --------------------------------------------------------------------------------


class _NoCollectives:
    """Fails any collective called while active (the checks must come first), but the first
    ``flags`` all-gathers: the flag of :func:`topkd.parallel.raise_together`, which a check of
    each rank's own rows (its labels, its teacher rows) makes before it raises."""

    NAMES = ("all_gather", "all_reduce", "reduce_scatter_tensor", "all_to_all_single",
             "all_gather_into_tensor", "broadcast")

    def __init__(self, flags: int = 0):
        self.flags = flags

    def __enter__(self):
        self.saved = {n: getattr(dist, n) for n in self.NAMES}
        for n in self.NAMES:
            setattr(dist, n, self._fail(n))
        return self

    def _fail(self, name):
        def fail(*args, **kwargs):
            if name == "all_gather" and self.flags > 0:
                self.flags -= 1
                return self.saved[name](*args, **kwargs)
            raise AssertionError(f"{name} called before the arguments were checked")
        return fail

    def __exit__(self, *exc):
        for n, f in self.saved.items():
            setattr(dist, n, f)


def run_errors(mesh, rank, world, failures):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    w = torch.randn(V, H)
    hidden = torch.randn(4, H)
    t_logits = torch.randn(4, V)
    row = distribute_tensor(w, mesh, [Shard(0)])
    col = distribute_tensor(w, mesh, [Shard(1)])
    rep = distribute_tensor(w, mesh, [Replicate()])
    bias_row = distribute_tensor(torch.randn(V), mesh, [Shard(0)])
    ranks = list(range(world))
    other_mesh = DeviceMesh("cpu", ranks[::-1])
    other = distribute_tensor(torch.randn(V, H_T), other_mesh, [Shard(0)])
    cases = [
        ("weight Shard(1)", lambda: topkd.fused_kl_loss(hidden, col, t_logits),
         ["weight", "Shard(dim=1)"]),
        ("weight Replicate", lambda: topkd.fused_kl_loss(hidden, rep, t_logits),
         ["weight", "Replicate"]),
        ("bias plain with a sharded weight",
         lambda: topkd.fused_kl_loss(hidden, row, t_logits, bias=torch.zeros(V)),
         ["bias", "plain"]),
        ("bias sharded with a plain weight",
         lambda: topkd.fused_kl_loss(hidden, w, t_logits, bias=bias_row), ["bias", "DTensor"]),
        ("teacher on another mesh",
         lambda: topkd.fused_kl_loss(hidden, row, (torch.randn(4, H_T), other)),
         ["teacher weight", "mesh"]),
        ("teacher Replicate with a sharded student",
         lambda: topkd.fused_kl_loss(hidden, row, (torch.randn(4, H), rep)),
         ["teacher weight", "Replicate"]),
        ("hidden a DTensor",
         lambda: topkd.fused_kl_loss(distribute_tensor(hidden, mesh, [Replicate()]), row,
                                     t_logits), ["hidden", "DTensor"]),
        ("process_group with a DTensor head",
         lambda: topkd.fused_kl_loss(hidden, row, t_logits, process_group=dist.group.WORLD),
         ["process_group"]),
        ("teacher rows differ from hidden's",
         lambda: topkd.fused_kl_loss(hidden, row, torch.randn(3, V)), ["leading shape"]),
        ("k above the vocabulary",
         lambda: topkd.fused_topk_kl_loss(hidden, row, t_logits, V + 1), ["k"]),
        ("unknown design",
         lambda: topkd.fused_kl_loss(hidden, row, t_logits, sharded_head="all"),
         ["sharded_head"]),
    ]
    if world == 2:
        from torch.distributed.device_mesh import init_device_mesh

        mesh2 = init_device_mesh("cpu", (1, 2), mesh_dim_names=("a", "b"))
        two_d = distribute_tensor(w, mesh2, [Shard(0), Shard(0)])
        cases.append(("2-D mesh", lambda: topkd.fused_kl_loss(hidden, two_d, t_logits),
                      ["weight", "2-D mesh"]))
    # (checks of each rank's own rows: raised on every rank after one exchanged flag)
    own_rows = {"teacher rows differ from hidden's", "k above the vocabulary"}
    for name, call, words in cases:
        try:
            with _NoCollectives(flags=int(name in own_rows)):
                call()
            failures.append(f"[errors] {name}: no error")
        except ValueError as e:
            missing = [word for word in words if word not in str(e)]
            if missing:
                failures.append(f"[errors] {name}: the message lacks {missing}: {e}")
        except Exception:  # noqa: BLE001
            failures.append(f"[errors] {name}: not a ValueError\n{traceback.format_exc()}")


def run_refused(mesh, rank, world, failures):
    """Inputs whose values are bad on some ranks only (each rank's own rows): every rank
    raises, after one flag is exchanged, instead of the others waiting in the loss's
    collectives; a bad rank names its own input, the others name the bad ranks."""
    from torch.distributed.tensor import Shard, distribute_tensor

    g = torch.Generator().manual_seed(0)  # the same head on every rank
    row = distribute_tensor(torch.randn(V, H, generator=g), mesh, [Shard(0)])
    hidden, t_logits = torch.randn(4, H, generator=g), torch.randn(4, V, generator=g)
    picked = topkd.select_topk(t_logits, 4)
    indices = picked.indices.clone()
    indices[2, 3] = indices[2, 0]
    twice = topkd.SparseTeacher(indices, picked.logprobs, picked.rest_logprob, 1.0, V)
    bad = {
        "labels outside the vocabulary": (
            lambda: topkd.fused_kl_loss(hidden, row, t_logits, labels=torch.full((4,), V)),
            ["labels", str(V)]),
        "a SparseTeacher's index twice in a row": (
            lambda: topkd.fused_topk_kl_loss(hidden, row, twice),
            ["SparseTeacher.indices", "once"]),
    }
    good = {"labels outside the vocabulary": lambda: topkd.fused_kl_loss(hidden, row, t_logits),
            "a SparseTeacher's index twice in a row":
                lambda: topkd.fused_topk_kl_loss(hidden, row, picked)}
    for name, (call, words) in bad.items():
        for bad_ranks in (list(range(world)), [world - 1]):
            tag = f"[refused] {name}, bad on ranks {bad_ranks}"
            mine = rank in bad_ranks
            try:
                with _NoCollectives(flags=1):  # the flag only: no rank enters the loss
                    (call if mine else good[name])()
                failures.append(f"{tag}: no error")
            except ValueError as e:
                want = words if mine else ["rank(s)", str(bad_ranks), "found their inputs bad"]
                missing = [word for word in want if word not in str(e)]
                if missing:
                    failures.append(f"{tag}: the message lacks {missing}: {e}")
            except Exception:  # noqa: BLE001
                failures.append(f"{tag}: not a ValueError\n{traceback.format_exc()}")


def run_upstream(mesh, rank, world, failures):
    """A scalar vocab_parallel loss scaled differently on each rank: a RuntimeError on every
    rank in backward (its gradients were written in forward for every rank's rows)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    weight = distribute_tensor(torch.randn(V, H), mesh, [Shard(0)]).requires_grad_(True)
    hidden = torch.randn(4, H, requires_grad=True)
    out = topkd.fused_kl_loss(hidden, weight, torch.randn(4, V), reduction="mean")
    try:
        (out * (rank + 1)).backward()
        failures.append("[upstream] a different scale per rank raised nothing")
    except RuntimeError as e:
        if "differs across ranks" not in str(e):
            failures.append(f"[upstream] another error: {e}")


def worker(rank, world, plan, result_dir):
    from torch.distributed.device_mesh import init_device_mesh

    def body(group, failures):
        os.environ.setdefault("TOPKD_IMPL", "eager")
        mesh = init_device_mesh("cpu", (world,))
        if "errors" in plan:
            run_errors(mesh, rank, world, failures)
            run_refused(mesh, rank, world, failures)
            run_upstream(mesh, rank, world, failures)
        if "reference" in plan:
            run_reference(mesh, rank, world, failures)
            run_mixed(mesh, rank, world, failures)
        if "training" in plan:
            run_training(mesh, rank, world, failures)

    run_rank(rank, world, result_dir, body)
