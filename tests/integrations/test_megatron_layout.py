"""Megatron's layout in one process (TP = 1): each criterion function is the topkd loss of the
``[s, b, V]`` logits, transposed to ``[b, s]``, and learns the vocabulary shards with ONE
exchange per call (the integration's width checks and the loss share it)."""

import importlib.util
from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron.core") is None,
                                reason="needs megatron-core")

import helpers  # noqa: E402

import topkd  # noqa: E402

S, B, V, H, K = 5, 2, 48, 8, 6


@pytest.fixture
def exchanges(monkeypatch):
    calls = []
    real = topkd.parallel.exchange_shards

    def counting(group, widths, rows, device, same=None):
        calls.append((sorted(widths), same))
        return real(group, widths, rows, device, same=same)

    monkeypatch.setattr(topkd.parallel, "exchange_shards", counting)
    return calls


@pytest.mark.parametrize("case", ["topk", "full", "sparse", "fused-topk", "fused-full"])
def test_one_exchange_per_call_and_the_plain_loss(case, exchanges):
    from topkd.integrations import megatron, megatron_fused

    config = SimpleNamespace(tensor_model_parallel_size=1, vocab_size=V)
    s, t = helpers.logits(S, B, V, seed=1), helpers.logits(S, B, V, seed=2)
    hidden, weight = helpers.logits(S, B, H, seed=3), helpers.logits(V, H, seed=4, scale=0.3)
    opts = dict(temperature=2.0, divergence="jsd", impl="eager")
    if case == "topk":
        got = megatron.topk_kl_loss(s, t, K, model_config=config, **opts)
        want = topkd.topk_kl_loss(s, t, K, **opts)
    elif case == "full":
        got = megatron.kl_loss(s, t, model_config=config, **opts)
        want = topkd.kl_loss(s, t, **opts)
    elif case == "sparse":
        rows = topkd.select_topk(t, K, temperature=2.0)
        batch = topkd.SparseTeacher(rows.indices.transpose(0, 1), rows.logprobs.transpose(0, 1),
                                    rows.rest_logprob.transpose(0, 1), 2.0, V)
        exchanges.clear()  # select_topk's own
        got = megatron.sparse_kl_loss(s, batch, model_config=config, **opts)
        want = topkd.sparse_kl_loss(s, rows, **opts)
    elif case == "fused-topk":
        got = megatron_fused.fused_topk_kl_loss(hidden, weight, t, K, model_config=config,
                                                **opts)
        want = topkd.fused_topk_kl_loss(hidden, weight, t, K, **opts)
    else:
        got = megatron_fused.fused_kl_loss(hidden, weight, t, model_config=config, **opts)
        want = topkd.fused_kl_loss(hidden, weight, t, **opts)
    assert len(exchanges) == 2  # one for the Megatron call, one for the plain call
    eager = topkd.backends.across_ranks(topkd.backends.EAGER)
    kernels = "the loss kernels (impl)"
    # each carries the kernels, and the options, the same text in both
    assert [same[kernels] for _, same in exchanges] == [eager[kernels]] * 2
    options = [same["the loss options"][0] for _, same in exchanges]
    assert options[0] == options[1] and "temperature=2.0" in options[0], options
    assert got.shape == (B, S) and got.is_contiguous()
    torch.testing.assert_close(got, want.transpose(0, 1), rtol=0, atol=0)
