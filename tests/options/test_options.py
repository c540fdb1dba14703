"""The options layer: :class:`topkd.KDOptions` (checked once, frozen), :func:`topkd.distill_loss`
(the one entry point every public loss forwards to), the divergence registry, and the Modules
holding one options object."""

from __future__ import annotations

import dataclasses

import pytest
import reference as ref
import torch
from helpers import GRAD_TOL_F32, assert_loss_close, grad_err, logits

import topkd
from topkd import KDOptions, distill_loss

N, V, K = 6, 40, 5


@pytest.mark.parametrize("name, value, error", [
    ("k", 0, ValueError), ("k", 2.0, TypeError), ("top_p", 1.5, ValueError),
    ("top_p_min_k", 0, ValueError), ("temperature", 0.0, ValueError),
    ("temperature", float("nan"), ValueError), ("divergence", "kl2", ValueError),
    ("divergence", 3, TypeError), ("normalize", "none", ValueError),
    ("vocab_size", 0, ValueError), ("ignore_index", 1.5, TypeError),
    ("kd_weight", -1.0, ValueError), ("ce_weight", float("inf"), ValueError),
    ("reduction", "avg", ValueError), ("chunk_bytes", 0, ValueError),
    ("impl", "triton", ValueError), ("logit_scale", 0.0, ValueError),
    ("softcap", -1.0, ValueError), ("teacher_logit_scale", True, TypeError),
    ("teacher_softcap", 0.0, ValueError), ("return_components", 1, TypeError),
    ("reduce_hidden_grad", "yes", TypeError), ("reverse", 1, TypeError),
])
def test_each_option_checked_by_name(name, value, error):
    with pytest.raises(error, match=name if name != "reverse" else "reverse"):
        KDOptions(**{name: value})


def test_options_frozen_normalized_and_replaced():
    options = KDOptions(k=8, divergence="reverse_kl", temperature=2, kd_weight=1)
    assert options.divergence == topkd.ReverseKL() and options.temperature == 2.0
    assert KDOptions(reverse=True).divergence == topkd.ReverseKL()
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.k = 3
    changed = options.replace(k=4)
    assert (changed.k, options.k) == (4, 8)
    with pytest.raises(ValueError, match="top_p"):
        options.replace(top_p=2.0)  # a copy is checked again
    assert repr(KDOptions(k=3, impl="eager")) == "KDOptions(k=3, impl='eager')"
    assert KDOptions.names() >= {"k", "top_p", "impl", "softcap", "process_group"}
    with pytest.raises(TypeError, match=r"unknown loss options \['bogus'\]"):
        KDOptions.of({"bogus": 1})


def _pair(seed=0):
    return logits(N, V, seed=seed), logits(N, V, seed=seed + 1)


@pytest.mark.parametrize("case", ["topk", "full", "sparse", "fused-topk", "fused-full"])
def test_distill_loss_is_each_public_function(case):
    """Each public function equals distill_loss with the same options (bit for bit: one code
    path), and that equals the float64 reference."""
    s, t = _pair()
    labels = torch.randint(0, V, (N,))
    opts = dict(temperature=1.5, divergence="jsd", ce_weight=0.5, reduction="sum",
                impl="eager")
    hidden, weight = logits(N, 8, seed=3), logits(V, 8, seed=4, scale=0.3)
    if case == "topk":
        public = topkd.topk_kl_loss(s, t, K, labels=labels, **opts)
        entry = distill_loss(s, t, KDOptions(k=K, **opts), labels=labels)
        expected = ref.topk_loss(s.double(), t.double(), K, divergence="jsd", temperature=1.5,
                                 labels=labels, ce_weight=0.5, reduction="sum")
    elif case == "full":
        public = topkd.kl_loss(s, t, labels=labels, **opts)
        entry = distill_loss(s, t, KDOptions(**opts), labels=labels)
        expected = ref.full_loss(s.double(), t.double(), divergence="jsd", temperature=1.5,
                                 labels=labels, ce_weight=0.5, reduction="sum")
    elif case == "sparse":
        sparse = topkd.select_topk(t, K, temperature=1.5)
        public = topkd.sparse_kl_loss(s, sparse, labels=labels, **opts)
        entry = distill_loss(s, sparse, KDOptions(**opts), labels=labels)
        expected = ref.topk_loss(s.double(), t.double(), K, divergence="jsd", temperature=1.5,
                                 labels=labels, ce_weight=0.5, reduction="sum")
    else:
        z = ref.linear_logits(hidden.double(), weight.double())
        if case == "fused-topk":
            public = topkd.fused_topk_kl_loss(hidden, weight, t, K, labels=labels, **opts)
            entry = distill_loss((hidden, weight), t, KDOptions(k=K, **opts), labels=labels)
            expected = ref.topk_loss(z, t.double(), K, divergence="jsd", temperature=1.5,
                                     labels=labels, ce_weight=0.5, reduction="sum")
        else:
            public = topkd.fused_kl_loss(hidden, weight, t, labels=labels, **opts)
            entry = distill_loss((hidden, weight), t, KDOptions(**opts), labels=labels)
            expected = ref.full_loss(z, t.double(), divergence="jsd", temperature=1.5,
                                     labels=labels, ce_weight=0.5, reduction="sum")
    assert torch.equal(public, entry)
    assert_loss_close(entry, expected)


def test_distill_loss_gradient_against_reference():
    s, t = _pair(5)
    leaf = s.clone().requires_grad_(True)
    distill_loss(leaf, t, KDOptions(k=K, divergence="tvd", reduction="mean",
                                    impl="eager")).backward()
    s64 = s.double().requires_grad_(True)
    ref.topk_loss(s64, t.double(), K, divergence="tvd", reduction="mean").backward()
    assert grad_err(leaf.grad, s64.grad) < GRAD_TOL_F32


@pytest.mark.parametrize("options, teacher, error, match", [
    (KDOptions(top_p=0.9), "logits", ValueError, "top_p=0.9 needs k"),
    (KDOptions(normalize="topk"), "logits", ValueError, "normalize='topk' needs k"),
    (KDOptions(k=K + 1), "sparse", ValueError, "differs from the SparseTeacher's K"),
    (KDOptions(k=K, top_p=0.5), "sparse", ValueError, "already selected"),
    (KDOptions(reduce_hidden_grad=True), "logits", ValueError, "fused LM head"),
    ({"k": 3}, "logits", TypeError, "options must be a topkd.KDOptions"),
])
def test_distill_loss_refuses_options_that_do_not_fit(options, teacher, error, match):
    s, t = _pair()
    if teacher == "sparse":
        t = topkd.select_topk(t, K)
    with pytest.raises(error, match=match):
        distill_loss(s, t, options)


def test_given_shards_are_checked_against_the_tensors():
    s, t = _pair()
    shards = topkd.parallel.exchange_shards(None, {"student": V, "teacher": V}, N, s.device)
    assert torch.equal(distill_loss(s, t, KDOptions(k=K, impl="eager"), shards=shards),
                       topkd.topk_kl_loss(s, t, K, impl="eager"))
    with pytest.raises(ValueError, match=r"shards must hold \['student', 'teacher'\]"):
        distill_loss(s, t, KDOptions(k=K), shards={"student": shards["student"]})
    narrow = topkd.parallel.exchange_shards(None, {"student": V - 1, "teacher": V}, N, s.device)
    with pytest.raises(ValueError, match=r"shards\['student'\] is 39 columns wide"):
        distill_loss(s, t, KDOptions(k=K), shards=narrow)


class _HalfTVD(topkd.Divergence):
    """A user's divergence: only ``pointwise`` (half the total variation)."""

    name = "half_tvd"

    def pointwise(self, logp, logq):
        return 0.25 * (logq.exp() - logp.exp()).abs()


def test_registered_divergence_by_name():
    topkd.divergences.register("half_tvd", _HalfTVD)
    topkd.divergences.register("half_tvd", _HalfTVD)  # the same again: nothing changes
    assert "half_tvd" in topkd.divergences.names()
    s, t = _pair(7)
    by_name = topkd.topk_kl_loss(s, t, K, divergence="half_tvd", impl="eager")
    tvd = topkd.topk_kl_loss(s, t, K, divergence="tvd", impl="eager")
    torch.testing.assert_close(by_name, 0.5 * tvd, rtol=1e-6, atol=1e-7)
    assert KDOptions(divergence="half_tvd").divergence == _HalfTVD()
    with pytest.raises(ValueError, match="registered already"):
        topkd.divergences.register("half_tvd", topkd.TVD)
    with pytest.raises(TypeError, match="callable"):
        topkd.divergences.register("x", 3)
    topkd.divergences.register("not_a_divergence", lambda: 3)
    with pytest.raises(TypeError, match="not a topkd.Divergence"):
        KDOptions(divergence="not_a_divergence")


@pytest.mark.parametrize("module, args, options", [
    (topkd.TopKLogitsKLLoss, (K,), {"impl": "eager", "divergence": "jsd"}),
    (topkd.LogitsKLLoss, (), {"impl": "eager", "temperature": 2.0}),
    (topkd.FusedTopKLogitsKLLoss, (K,), {"impl": "eager", "softcap": 5.0}),
    (topkd.FusedLogitsKLLoss, (), {"impl": "eager", "logit_scale": 0.5}),
])
def test_modules_hold_one_checked_options_object(module, args, options):
    loss_fn = module(*args, **options)
    assert isinstance(loss_fn.options, KDOptions)
    assert all(getattr(loss_fn.options, n) == topkd.KDOptions(**{n: v}).__getattribute__(n)
               for n, v in options.items())
    for n, v in options.items():
        assert f"{n}={KDOptions(**{n: v}).__getattribute__(n)!r}" in repr(loss_fn)
    with pytest.raises(TypeError, match="unknown loss options"):
        module(*args, mask=None)  # per call, not an option
    with pytest.raises(ValueError, match="chunk_bytes"):
        module(*args, chunk_bytes=-1)
