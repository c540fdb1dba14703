"""The kernels on a CUDA device (skipped without one): the compiled kernels (Triton there) equal
the eager ones on the GPU, the eager kernels on the GPU equal the eager kernels on the CPU, and
the peak memory bound holds on the GPU, measured by ``torch.cuda.max_memory_allocated``.

The cases and the comparison are test_compiled's (``CASES``, ``assert_agree``: loss 2e-6
relative, float32 gradients 1e-5 of their largest magnitude, bf16 / fp16 gradients within one
ulp elementwise), on the same inputs moved to the device. Every case runs eager on both
devices; the compiled cases are one or two per kernel family (compiling for the GPU is most of
what a case costs). The memory cases are test_memory's shape and bound.

``$TOPKD_TESTS_DEVICE`` (default ``cuda``) names the device; ``cpu`` runs the same comparisons
on the CPU, which checks this file's plumbing without a GPU.
"""

from __future__ import annotations

import os

import pytest
import torch
from test_compiled import CASES, _call, assert_agree, case_inputs

import topkd

DEVICE = os.environ.get("TOPKD_TESTS_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(DEVICE.startswith("cuda") and not torch.cuda.is_available(),
                                reason="no CUDA device")

# one or two per kernel family of test_compiled's list
COMPILED = [
    "topk-plain", "topk-labels_T2-tvd", "topk-top_p-jsd-neg_inf", "topk-fp16",
    "kl-bf16", "kl-jsd-neg_inf", "kl-tvd-labels_T2-neg_inf",
    "fused_topk-softcap-labels_T1", "fused_topk-bf16-80rows", "fused_topk-pair_bias-T2",
    "fused_kl-pair-scale_softcap-jsd",
]


def _on_cpu(result):
    value, grads = result
    return value.cpu(), [g.cpu() for g in grads]


@pytest.mark.parametrize("case", COMPILED)
def test_compile_equals_eager_on_device(case):
    loss, d, opts = case_inputs(case, DEVICE)
    assert_agree(_call(loss, d, "eager", **dict(opts)), _call(loss, d, "compile", **dict(opts)),
                 f"{case} on {DEVICE}")


@pytest.mark.parametrize("case", CASES)
def test_eager_on_device_equals_cpu(case):
    loss, d, opts = case_inputs(case, DEVICE)
    on_device = _on_cpu(_call(loss, d, "eager", **dict(opts)))
    loss, d, opts = case_inputs(case, "cpu")
    assert_agree(_call(loss, d, "eager", **dict(opts)), on_device, f"{case}: cpu vs {DEVICE}")


@pytest.mark.skipif(not DEVICE.startswith("cuda"), reason="torch.cuda.max_memory_allocated")
@pytest.mark.parametrize("impl", ["eager", "compile"])
@pytest.mark.parametrize("name", ["topk_kl_loss", "kl_loss"])
def test_peak_memory_bound_on_device(name, impl):
    """test_memory's bound (1.25x the student logits, 1.0x of it the gradient) at its shape,
    the peak above the inputs by the CUDA allocator."""
    rows, vocab, k, chunk, bound = 256, 32000, 512, 1 << 20, 1.25
    g = torch.Generator().manual_seed(0)
    s = (torch.randn(rows, vocab, generator=g) * 2).to(DEVICE, torch.bfloat16)
    t = (torch.randn(rows, vocab, generator=g) * 2).to(DEVICE, torch.bfloat16)
    s.requires_grad_(True)

    def step():
        s.grad = None
        if name == "topk_kl_loss":
            loss = topkd.topk_kl_loss(s, t, k, chunk_bytes=chunk, reduction="mean", impl=impl)
        else:
            loss = topkd.kl_loss(s, t, chunk_bytes=chunk, reduction="mean", impl=impl)
        loss.backward()

    step()  # compiling and the first call's one-time allocations outside the measured step
    s.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    ratio = (torch.cuda.max_memory_allocated() - base) / (s.numel() * s.element_size())
    assert ratio <= bound, f"{name} ({impl}) on {DEVICE}: peak {ratio:.3f}x the logits"
