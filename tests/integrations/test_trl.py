"""topkd.hf.trl: TRL 1.16's DistillationTrainer loss, replaced by topkd's fused loss."""

from __future__ import annotations

import math
import sys

import pytest
import torch

trl = pytest.importorskip("trl")
distillation_trainer = pytest.importorskip("trl.trainer.distillation_trainer")

from topkd.hf.trl import check_trl_signature, divergence_loss, use_in_trl  # noqa: E402

TRL_LOSS = distillation_trainer._chunked_divergence_loss
B, C, H_S, H_T, V = 3, 5, 16, 24, 64
TRANSFORMS = {
    "plain": {},
    "scaled": {"student_logit_scale": 0.7, "teacher_logit_scale": 1.3,
               "student_final_logit_softcapping": 3.0, "teacher_final_logit_softcapping": 4.0,
               "temperature": 1.7},
}


def _inputs(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)

    mask = torch.rand(B, C, generator=g) > 0.3
    mask[0, 0] = True
    return {"student_hidden_states": randn(B, C, H_S), "teacher_hidden_states": randn(B, C, H_T),
            "student_lm_head_weight": randn(V, H_S, scale=0.4),
            "teacher_lm_head_weight": randn(V, H_T, scale=0.4),
            "completion_mask": mask.long(),
            "student_lm_head_bias": randn(V, scale=0.5),
            "teacher_lm_head_bias": randn(V, scale=0.5)}


_STUDENT = ("student_hidden_states", "student_lm_head_weight", "student_lm_head_bias")


def _call(fn, inputs, beta, **kwargs):
    """``(loss, entropy_sum, n_valid, [grad hidden, grad weight, grad bias])``."""
    inputs = {n: t.detach().clone().requires_grad_(n in _STUDENT) for n, t in inputs.items()}
    loss, entropy_sum, n_valid = fn(beta=beta, **inputs, **kwargs)
    loss.backward()
    return loss.detach(), entropy_sum, n_valid, [inputs[n].grad for n in _STUDENT]


def _rel(x, ref):
    return float((x.double() - ref.double()).abs().max() / ref.double().abs().max())


def _reference(inputs, beta, num_items_in_batch=None, student_logit_scale=1.0,
               teacher_logit_scale=1.0, student_final_logit_softcapping=None,
               teacher_final_logit_softcapping=None, temperature=1.0):
    """Float64, by definition: logits built whole, the generalized JSD written out."""
    def logits(hidden, weight, bias, scale, softcap):
        z = hidden.double() @ weight.double().T + bias.double()
        z = z * scale
        if softcap is not None:
            z = softcap * torch.tanh(z / softcap)
        return torch.log_softmax(z / temperature, -1)

    h = inputs["student_hidden_states"].double().requires_grad_(True)
    w = inputs["student_lm_head_weight"].double().requires_grad_(True)
    b = inputs["student_lm_head_bias"].double().requires_grad_(True)
    logp = logits(h, w, b, student_logit_scale, student_final_logit_softcapping)
    logq = logits(inputs["teacher_hidden_states"], inputs["teacher_lm_head_weight"],
                  inputs["teacher_lm_head_bias"], teacher_logit_scale,
                  teacher_final_logit_softcapping)
    p, q = logp.exp(), logq.exp()
    if beta == 0:
        rows = (q * (logq - logp)).sum(-1)
    elif beta == 1:
        rows = (p * (logp - logq)).sum(-1)
    else:
        logm = torch.log(beta * q + (1 - beta) * p)
        rows = beta * (q * (logq - logm)).sum(-1) + (1 - beta) * (p * (logp - logm)).sum(-1)
    valid = inputs["completion_mask"] != 0
    total = rows[valid].sum()
    n_valid = int(valid.sum())
    loss = total / (max(n_valid, 1) if num_items_in_batch is None else float(num_items_in_batch))
    loss.backward()
    entropy_sum = -(p * logp).sum(-1)[valid].sum()
    return loss.detach(), entropy_sum.detach(), n_valid, [h.grad, w.grad, b.grad]


@pytest.mark.parametrize("transform", sorted(TRANSFORMS))
@pytest.mark.parametrize("num_items_in_batch", [None, 7, torch.tensor(9.0)],
                         ids=["mean", "int", "tensor"])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_equals_trl(beta, num_items_in_batch, transform):
    inputs = _inputs()
    kwargs = {"num_items_in_batch": num_items_in_batch, **TRANSFORMS[transform]}
    loss, entropy_sum, n_valid, grads = _call(divergence_loss, inputs, beta, **kwargs)
    ref_loss, ref_entropy, ref_n, ref_grads = _call(TRL_LOSS, inputs, beta, **kwargs)
    assert loss.dtype == ref_loss.dtype == torch.float32 and loss.shape == ()
    assert _rel(loss, ref_loss) < 1e-5
    assert not entropy_sum.requires_grad and entropy_sum.dtype == ref_entropy.dtype
    assert _rel(entropy_sum, ref_entropy) < 1e-5
    assert n_valid.dtype == ref_n.dtype and int(n_valid) == int(ref_n)
    for g, ref in zip(grads, ref_grads, strict=True):
        assert g.dtype == torch.float32 and _rel(g, ref) < 1e-5


@pytest.mark.parametrize("transform", sorted(TRANSFORMS))
@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
def test_float64_reference(beta, transform):
    inputs = _inputs(seed=1)
    kwargs = {"num_items_in_batch": 11, **TRANSFORMS[transform]}
    loss, entropy_sum, n_valid, grads = _call(divergence_loss, inputs, beta, **kwargs)
    ref_loss, ref_entropy, ref_n, ref_grads = _reference(inputs, beta, **kwargs)
    assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
    assert abs(float(entropy_sum) - float(ref_entropy)) <= 1e-5 * float(ref_entropy)
    assert int(n_valid) == ref_n
    for g, ref in zip(grads, ref_grads, strict=True):
        assert _rel(g, ref) < 1e-5


def test_edge_cases():
    inputs = _inputs()
    # nothing valid: a zero loss with zero gradient, as TRL's
    empty = {**inputs, "completion_mask": torch.zeros(B, C, dtype=torch.long)}
    loss, entropy_sum, n_valid, grads = _call(divergence_loss, empty, 0.5)
    assert float(loss) == 0.0 and float(entropy_sum) == 0.0 and int(n_valid) == 0
    assert all(not g.any() for g in grads)
    # k equal to the vocabulary is the full loss; a smaller k another finite loss
    full = _call(divergence_loss, inputs, 0.5)
    assert _rel(_call(divergence_loss, inputs, 0.5, k=V)[0], full[0]) < 1e-6
    assert torch.isfinite(_call(divergence_loss, inputs, 0.5, k=8)[0])
    # entropy=False skips the entropy pass
    assert math.isnan(float(_call(divergence_loss, inputs, 0.5, entropy=False)[1]))
    # a small budget cuts the entropy into many chunks: the same sums
    chunked = _call(divergence_loss, inputs, 0.5, chunk_bytes=1)
    assert _rel(chunked[1], full[1]) < 1e-6 and _rel(chunked[0], full[0]) < 1e-6


def test_patch_and_restore():
    assert distillation_trainer._chunked_divergence_loss is TRL_LOSS
    patch = use_in_trl(chunk_bytes=2**20)
    try:
        replacement = distillation_trainer._chunked_divergence_loss
        assert replacement is not TRL_LOSS
        check_trl_signature(replacement, trl.__version__)  # TRL's exact parameters
        inputs = _inputs()
        assert _rel(replacement(beta=0.5, **inputs)[0], divergence_loss(beta=0.5, **inputs)[0]) == 0
        assert patch.calls == 1
        with use_in_trl(k=8) as inner:  # nested: restored in reverse order
            assert distillation_trainer._chunked_divergence_loss is not replacement
            with pytest.raises(RuntimeError, match="restore the later patch first"):
                patch.restore()
        assert not inner.active
        assert distillation_trainer._chunked_divergence_loss is replacement
    finally:
        patch.restore()
    assert distillation_trainer._chunked_divergence_loss is TRL_LOSS
    patch.restore()  # a second restore does nothing
    assert distillation_trainer._chunked_divergence_loss is TRL_LOSS


def test_checks(monkeypatch):
    check_trl_signature(TRL_LOSS, trl.__version__)
    with pytest.raises(TypeError, match="unknown use_in_trl options"):
        use_in_trl(beta=0.5)
    with pytest.raises(ValueError, match="apply only with k"):
        use_in_trl(top_p=0.9)
    with pytest.raises(ValueError, match="k must be"):
        use_in_trl(k=0)

    def renamed(student_hidden_states, teacher_hidden_states, student_lm_head_weight,
                teacher_lm_head_weight, completion_mask, beta, num_items_in_batch=None):
        raise AssertionError

    monkeypatch.setattr(distillation_trainer, "_chunked_divergence_loss", renamed)
    with pytest.raises(RuntimeError, match=f"TRL {trl.__version__}'s is"):
        use_in_trl()
    assert distillation_trainer._chunked_divergence_loss is renamed  # nothing patched
    monkeypatch.delattr(distillation_trainer, "_chunked_divergence_loss")
    with pytest.raises(RuntimeError, match=f"TRL {trl.__version__}'s .* has no"):
        use_in_trl()
    monkeypatch.setitem(sys.modules, "trl", None)  # TRL not installed
    with pytest.raises(ImportError, match="pip install trl"):
        use_in_trl()


def _tiny_run(tmp_path, patched: bool, steps: int = 2):
    """A few on-policy DistillationTrainer steps on CPU, tiny Llama models from configs and a
    word-level tokenizer made here; returns (log history, calls of the replacement)."""
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = [f"w{i}" for i in range(120)]
    vocab = {"[PAD]": 0, "[UNK]": 1, "[EOS]": 2, "[BOS]": 3,
             **{w: i + 4 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]",
                                        pad_token="[PAD]", eos_token="[EOS]", bos_token="[BOS]")

    def model(seed, hidden):
        torch.manual_seed(seed)
        config = LlamaConfig(vocab_size=len(vocab), hidden_size=hidden,
                             intermediate_size=2 * hidden, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=64, pad_token_id=0, eos_token_id=2,
                             bos_token_id=3, tie_word_embeddings=False)
        return LlamaForCausalLM(config)

    student, teacher = model(0, 32), model(1, 48)
    with torch.no_grad():
        teacher.lm_head.weight.mul_(30)  # a peaked teacher: a loss well above zero
    dataset = Dataset.from_dict({"prompt": [" ".join(words[i:i + 4]) for i in range(16)]})
    args = trl.DistillationConfig(
        output_dir=str(tmp_path / ("patched" if patched else "stock")), use_cpu=True,
        report_to=[], max_steps=steps, per_device_train_batch_size=4,
        gradient_accumulation_steps=2, max_completion_length=6, logging_steps=1, beta=0.5,
        temperature=0.9, save_strategy="no", learning_rate=1e-3, seed=0)
    trainer = trl.DistillationTrainer(model=student, teacher_model=teacher, args=args,
                                      train_dataset=dataset, processing_class=tokenizer)
    if not patched:
        trainer.train()
        return trainer.state.log_history, 0
    with use_in_trl() as patch:
        trainer.train()
    return trainer.state.log_history, patch.calls


def test_tiny_on_policy_distillation(tmp_path):
    stock, _ = _tiny_run(tmp_path, patched=False)
    history, calls = _tiny_run(tmp_path, patched=True)
    assert calls == 4  # 2 steps x 2 micro-batches, every one through topkd
    assert distillation_trainer._chunked_divergence_loss is TRL_LOSS
    steps = [h for h in history if "loss" in h]
    assert len(steps) == 2 and all(math.isfinite(h["loss"]) and h["loss"] > 0 for h in steps)
    # the same seeds sample the same first batch: TRL's loss and entropy to float32 rounding
    first, stock_first = steps[0], next(h for h in stock if "loss" in h)
    assert first["loss"] == pytest.approx(stock_first["loss"], rel=1e-4)
    assert first["entropy"] == pytest.approx(stock_first["entropy"], rel=1e-4)
