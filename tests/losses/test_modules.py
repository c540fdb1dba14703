"""nn.Module wrappers equal the functions."""

import pytest
import torch
from helpers import logits, run

import topkd


@pytest.mark.parametrize("opts", [
    dict(),
    dict(top_p=0.9, top_p_min_k=3, temperature=0.8, reverse=True, reduction="mean"),
    dict(normalize="topk", reduction="sum", chunk_bytes=4096),
    dict(vocab_size=250, reduction="none"),
], ids=["default", "top_p-T-reverse-mean", "topk-norm-sum", "vocab_size"])
def test_topk_module_equals_function(opts):
    s = logits(3, 4, 256, seed=1)
    t = logits(3, 4, 256, seed=2)
    mod = topkd.TopKLogitsKLLoss(24, **opts)
    assert isinstance(mod, torch.nn.Module)
    l1, g1 = run(mod, s, t)
    l2, g2 = run(topkd.topk_kl_loss, s, t, 24, **opts)
    assert torch.equal(l1, l2)
    assert torch.equal(g1, g2)


@pytest.mark.parametrize("opts", [
    dict(),
    dict(temperature=1.7, reverse=True, reduction="mean"),
    dict(vocab_size=250, reduction="sum", chunk_bytes=4096),
], ids=["default", "T-reverse-mean", "vocab_size-sum"])
def test_full_module_equals_function(opts):
    s = logits(3, 4, 256, dtype=torch.bfloat16, seed=3)
    t = logits(3, 4, 256, dtype=torch.bfloat16, seed=4)
    mod = topkd.LogitsKLLoss(**opts)
    assert isinstance(mod, torch.nn.Module)
    l1, g1 = run(mod, s, t)
    l2, g2 = run(topkd.kl_loss, s, t, **opts)
    assert torch.equal(l1, l2)
    assert torch.equal(g1, g2)
