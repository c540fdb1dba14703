"""The backend seam: the engine runs whatever backend a call chose, through its stages alone,
and the memory policy counts a backend's buffers from what it declares."""

from __future__ import annotations

import pytest
import torch

import topkd
import topkd.backends
from topkd import memory
from topkd.backends.eager import EagerBackend
from topkd.engine import Config

V, K, H = 50, 5, 8
STAGES = ("sparse_statistics", "sparse_refresh", "sparse_gradient", "dense_statistics",
          "dense_terms", "dense_refresh", "dense_gradient", "select", "accumulator")


class Recording(EagerBackend):
    """The eager stages, each call recorded."""

    name = "recording"

    def __init__(self):
        self.calls = []

    def __getattribute__(self, name):
        if name in STAGES:
            object.__getattribute__(self, "calls").append(name)
        return object.__getattribute__(self, name)


@pytest.fixture
def recording(monkeypatch):
    backend = Recording()
    monkeypatch.setattr(topkd.backends, "choose", lambda impl, device, group=None: backend)
    return backend


def _data():
    g = torch.Generator().manual_seed(3)
    return (torch.randn(12, V, generator=g) * 2, torch.randn(12, V, generator=g) * 2,
            torch.randn(12, H, generator=g), torch.randn(V, H, generator=g) / 3)


@pytest.mark.parametrize("loss,reduction,expected", [
    ("kl", "none", {"dense_statistics", "dense_terms", "dense_refresh", "dense_gradient"}),
    ("topk", "none", {"select", "sparse_statistics", "sparse_refresh", "sparse_gradient"}),
    ("fused_kl", "sum", {"dense_statistics", "dense_terms", "dense_gradient"}),
    ("fused_topk", "mean", {"select", "sparse_statistics", "sparse_gradient"}),
])
def test_engine_runs_the_chosen_backend(recording, loss, reduction, expected):
    s, t, h, w = _data()

    def run():
        leaves = [x.clone().requires_grad_(True) for x in ((h, w) if "fused" in loss else (s,))]
        if loss == "kl":
            out = topkd.kl_loss(leaves[0], t, reduction=reduction, chunk_bytes=2000)
        elif loss == "topk":
            out = topkd.topk_kl_loss(leaves[0], t, K, reduction=reduction, chunk_bytes=2000)
        elif loss == "fused_kl":
            out = topkd.fused_kl_loss(*leaves, t, reduction=reduction, chunk_bytes=2000)
        else:
            out = topkd.fused_topk_kl_loss(*leaves, t, K, reduction=reduction,
                                           chunk_bytes=2000)
        out.sum().backward()
        return out.detach(), [x.grad for x in leaves]

    got = run()
    assert expected <= set(recording.calls), recording.calls
    recording.calls.clear()
    with pytest.MonkeyPatch.context() as m:
        m.setattr(topkd.backends, "choose", lambda impl, device, group=None: topkd.backends.EAGER)
        want = run()
    assert not recording.calls
    assert torch.equal(got[0], want[0])
    for a, b in zip(got[1], want[1], strict=True):
        assert torch.equal(a, b)


def test_compiled_backend_hands_pointwise_only_divergences_to_eager():
    class PointwiseOnly(topkd.Divergence):
        def pointwise(self, logp, logq):
            return (logq.exp() - logp.exp()) ** 2

    compiled = topkd.backends.COMPILED
    assert compiled.runner(PointwiseOnly(), sparse=False) is topkd.backends.EAGER
    assert compiled.runner(PointwiseOnly(), sparse=True) is compiled
    assert compiled.runner(topkd.KL(), sparse=False) is compiled
    assert topkd.backends.EAGER.runner(topkd.KL(), sparse=False) is topkd.backends.EAGER


@pytest.mark.parametrize("divergence,forward,backward", [
    (topkd.KL(), 3, 2), (topkd.ReverseKL(), 4, 4), (topkd.TVD(), 6, 6), (topkd.JSD(0.5), 7, 7),
])
def test_work_buffers_per_backend(divergence, forward, backward):
    eager = Config(divergence=divergence, temperature=1.0)
    assert memory.work_buffers(eager, False, None) == forward
    assert memory.work_buffers(eager, False, None, backward=True) == backward
    assert memory.work_buffers(eager, True, None) == 1
    # labels at T != 1 (the CE's own normalizer) and a softcap: one buffer each
    extra = Config(divergence=divergence, temperature=2.0, softcap=30.0)
    assert memory.work_buffers(extra, True, torch.zeros(1)) == 3
    compiled = Config(divergence=divergence, temperature=2.0, softcap=30.0,
                      backend=topkd.backends.COMPILED)
    assert memory.work_buffers(compiled, False, torch.zeros(1)) == 1
    assert memory.least_rows(1, topkd.backends.COMPILED) == 2
    assert memory.least_rows(1, topkd.backends.EAGER) == 1
