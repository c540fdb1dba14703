"""Body of the tensor-parallel tests, run in spawned gloo ranks (see test_parallel.py).

Each rank builds the same full inputs from a fixed seed, computes the one-process result
locally (process_group=None) and the tensor-parallel result on its contiguous vocabulary
shard, and compares: the loss within 1e-6 relative (and bit-identical on every rank), the
gradient shard allclose to its slice of the one-process gradient, select_topk outputs equal.
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

import topkd  # noqa: E402

LOSS_RTOL = 1e-6


def _run(fn, student, *args, view=None, grad_output=None, **kwargs):
    s = student.detach().clone().requires_grad_(True)
    loss = fn(s if view is None else view(s), *args, **kwargs)
    g = torch.ones_like(loss) if grad_output is None or loss.dim() == 0 else grad_output
    loss.backward(g)
    return loss.detach(), s.grad


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


def _compare(name, failures, loss_tp, loss_1, grad_tp, grad_1, same):
    """SPEC 4: TP loss within 1e-6 relative of one process, gradients allclose.

    Per row, 1e-6 of a row's own loss is below float32 resolution when a row's KL is small
    (it is a sum of O(1) terms that cancel; the one-process loss itself is only within a few
    1e-7 absolute of float64 there), so each row is held to 1e-6 of the batch's loss scale
    (max(|row loss|, mean |row loss|)); scalar reductions are held to 1e-6 of themselves.
    Gradients: one-process and TP are each within ~2e-6 of max|g| of float64 for reverse KL
    (float32 rounding of log terms), and sum shards in another order, so "allclose" is
    rtol 1e-5 with atol 1e-5 * max|g|, SPEC's float32 gradient tolerance; a real TP error
    (a missing or doubled all-reduce term) is O(max|g|).
    """
    try:
        assert loss_tp.shape == loss_1.shape, f"loss shape {loss_tp.shape} vs {loss_1.shape}"
        assert loss_tp.dtype == torch.float32
        l1 = loss_1.double()
        err = (loss_tp.double() - l1).abs()
        scale = l1.abs().mean() if l1.numel() else torch.tensor(0.0, dtype=torch.float64)
        bound = LOSS_RTOL * torch.maximum(l1.abs(), scale) + 1e-12
        assert torch.all(err <= bound), (
            f"loss differs from one process: max err {float(err.max()):.3e}, "
            f"max err / scale {float((err / scale.clamp_min(1e-30)).max()):.3e}\n"
            f"{loss_tp}\nvs\n{loss_1}")
        assert same, "ranks returned different losses"
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


def run_layout(group, rank, width, sizes, vocab_size, failures, seed=0):
    world = dist.get_world_size(group)
    assert len(sizes) == world and sum(sizes) == width
    start = sum(sizes[:rank])
    stop = start + sizes[rank]
    tag = f"W={width} shards={sizes} vocab_size={vocab_size}"
    lead = (3, 4)
    s, t, gout = _inputs(lead, width, torch.float32, seed)
    mask = torch.rand(*lead, generator=torch.Generator().manual_seed(seed + 1)) < 0.6
    k_small = 12  # larger than some shards: a rank may hold fewer than K candidates
    vs = {} if vocab_size is None else {"vocab_size": vocab_size}
    for name, fn, opts in _cases(k_small, width, vocab_size):
        opts = dict(opts)
        if opts.pop("mask", False):
            opts["mask"] = mask
        args = (opts.pop("k"),) if "k" in opts else ()
        l1, g1 = _run(fn, s, t, *args, grad_output=gout, **vs, **opts)
        lt, gt = _run(fn, s[..., start:stop], t[..., start:stop], *args, grad_output=gout,
                      process_group=group, **vs, **opts)
        same = _same_on_all_ranks(lt, group)
        _compare(f"{tag} {name}", failures, lt, l1, gt, g1[..., start:stop], same)

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
            # (SPEC 3 bounds the forward's communication volume, below, not its number of
            # collectives: a per-chunk gather of top-K candidates is allowed.)
            assert b64 == b4, f"{fname}: backward collectives grow with rows/chunks: {b4} -> {b64}"
            assert b64 <= 1, f"{fname}: backward does {b64} collectives (expected at most one)"
            # rows x (K + a few per-row statistics), with generous slack; rows x V_r is 192,000
            bound = 64 * (k + 8) * 4 + 512
            assert e64 <= bound, (
                f"{fname}: {e64} elements communicated for 64 rows, K={k} (bound {bound})")
    except AssertionError as e:
        failures.append(f"[communication] {e} stats={stats}")


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
    del start, stop


def run_rank(rank, world, port, result_dir, body):
    """One spawned rank: a gloo group on 127.0.0.1 (every wait with a timeout), then
    ``body(group, failures)``; failures, or "OK", go to ``result_dir/rank{rank}.txt``."""
    failures: list[str] = []
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
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


def worker(rank, world, port, layouts, check_comm, result_dir):
    def body(group, failures):
        for width, sizes, vocab_size in layouts:
            run_layout(group, rank, width, sizes, vocab_size, failures)
        if check_comm:
            run_communication(group, rank, failures)
        run_edge_cases(group, rank, failures)

    run_rank(rank, world, port, result_dir, body)
