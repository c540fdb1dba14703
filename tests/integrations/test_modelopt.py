"""topkd.integrations.modelopt and .megatron with the real libraries (Model-Optimizer 0.47,
megatron-core): the Megatron-plugin criteria in parallel_state groups of TP = 1, 2 and 3 (gloo
ranks, see modelopt_worker.py), against one process, the float64 reference and
Model-Optimizer's own losses; its loss balancer; the generic DistillationModel criteria; and the
errors for bad options and inputs.
"""

import json
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("modelopt.torch.distill")
pytest.importorskip("megatron.core")

import helpers  # noqa: E402
import modelopt.torch.distill as mtd  # noqa: E402
import modelopt_worker  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402

import topkd  # noqa: E402
from topkd.integrations import modelopt as tmo  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

DEADLINE_S = 150  # a hang in a collective fails the test instead of hanging the suite
EXTRAS = ("peers", "balancer", "bad_inputs")


def _bridge(vocab, divisible_by):
    return dict(vocab_size=vocab, should_pad_vocab=True, make_vocab_size_divisible_by=divisible_by)


def _spawn(world, plan, tmp_path):
    helpers.spawn_ranks(modelopt_worker.worker, world, (world, plan, str(tmp_path)), tmp_path,
                        DEADLINE_S)
    for path in sorted(tmp_path.glob("metrics_tp*.json")):
        print(f"\n{path.stem}:")
        for case, values in json.loads(path.read_text()).items():
            shown = ", ".join(f"{k} {v:.1e}" if isinstance(v, float) else f"{k} {v}"
                              for k, v in values.items())
            print(f"  {case}: {shown}")


def test_tensor_parallel_one_and_two(tmp_path):
    """One spawn of two ranks: parallel_state with TP = 1 (each rank alone), then TP = 2. Equal
    shards, a padded vocabulary given as vocab_size= and read from a Bridge-style config; the
    peer row against Model-Optimizer's losses, the balancer path and the bad inputs at both."""
    plan = [
        (1, [(40, [40], None, {}), (40, [40], 37, {}), (40, [40], 37, _bridge(37, 40))],
         EXTRAS + ("group_size",)),
        (2, [(40, [20, 20], None, {}), (40, [20, 20], 37, {}),
             (40, [20, 20], 37, _bridge(37, 20))], EXTRAS),
    ]
    _spawn(2, plan, tmp_path)


def test_tensor_parallel_three_unequal_shards(tmp_path):
    """TP = 3: a 37-entry vocabulary in shards of 13, 12 and 12 columns, and a padded one
    (42 = 3 x 14 columns, 37 real) with the last shard part padding."""
    plan = [(3, [(37, [13, 12, 12], None, {}), (42, [14, 14, 14], 37, {}),
                 (42, [14, 14, 14], 37, _bridge(37, 14))], ())]
    _spawn(3, plan, tmp_path)


# --- the generic DistillationModel path (one process) ---------------------------------------


@dataclass
class Output:
    """A model output carrying logits, like a Hugging Face CausalLMOutput."""

    logits: torch.Tensor


class TinyLM(torch.nn.Module):
    def __init__(self, vocab, hidden, wrap=False):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.lm_head = torch.nn.Linear(hidden, vocab, bias=False)
        self.wrap = wrap

    def forward(self, ids):
        logits = self.lm_head(self.embed(ids))
        return Output(logits) if self.wrap else logits


def _distill(criterion, key, wrap=False, balancer=None, seed=0):
    torch.manual_seed(seed)
    student, teacher = TinyLM(37, 8, wrap), TinyLM(37, 8, wrap)
    plain = TinyLM(37, 8, wrap)
    plain.load_state_dict(student.state_dict())
    model = mtd.convert(student, mode=[("kd_loss", {"teacher_model": teacher,
                                                    "criterion": {key: criterion},
                                                    "loss_balancer": balancer})])
    return model, plain, teacher


def _logits(x):
    return x.logits if isinstance(x, Output) else x


@pytest.mark.parametrize("criterion, fn", [
    (tmo.TopKLogitsKLCriterion(5, temperature=1.5),
     lambda s, t: topkd.topk_kl_loss(s, t, 5, temperature=1.5, reduction="mean")),
    (tmo.LogitsKLCriterion(divergence="jsd"),
     lambda s, t: topkd.kl_loss(s, t, divergence="jsd", reduction="mean")),
], ids=["topk", "full"])
@pytest.mark.parametrize("key, wrap", [(("lm_head", "lm_head"), False), (("", ""), True)],
                         ids=["lm_head", "model-output"])
def test_generic_criterion_in_distillation_model(criterion, fn, key, wrap):
    """compute_kd_loss without a balancer returns the criterion's scalar; keyed on the LM head
    (logits) or on the whole model (an output with .logits)."""
    model, plain, teacher = _distill(criterion, key, wrap)
    ids = torch.randint(0, 37, (2, 6))
    model(ids)
    loss = model.compute_kd_loss()
    loss.backward()
    want = fn(_logits(plain(ids)), _logits(teacher(ids)).detach())
    want.backward()
    assert loss.dim() == 0 and loss.dtype == torch.float32
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=0)
    torch.testing.assert_close(model.lm_head.weight.grad, plain.lm_head.weight.grad,
                               rtol=1e-6, atol=1e-9)


def test_generic_criterion_with_balancer_and_mask():
    """StaticLossBalancer with the student's own loss, and reduction="none" reduced by
    compute_kd_loss(loss_reduction_fn=...) with a mask."""
    model, plain, teacher = _distill(tmo.TopKLogitsKLCriterion(4, reduction="none"),
                                     ("lm_head", "lm_head"),
                                     balancer=mtd.StaticLossBalancer(kd_loss_weight=0.7))
    ids = torch.randint(0, 37, (2, 6))
    mask = torch.rand(2, 6) < 0.6
    logits = model(ids)
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, 37), ids.reshape(-1))
    loss = model.compute_kd_loss(student_loss=ce,
                                 loss_reduction_fn=lambda x: (x * mask).sum() / mask.sum())
    s = plain(ids)
    kd = topkd.topk_kl_loss(s, teacher(ids).detach(), 4, mask=mask, reduction="mean")
    want = 0.7 * kd + 0.3 * torch.nn.functional.cross_entropy(s.reshape(-1, 37),
                                                               ids.reshape(-1))
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=0)


def test_generic_criterion_is_a_loss_modelopt_accepts():
    """Model-Optimizer's config takes only torch _Loss criteria: topkd's plain Modules are
    refused, the criteria accepted."""
    for crit in (tmo.TopKLogitsKLCriterion(3), tmo.LogitsKLCriterion()):
        assert isinstance(crit, torch.nn.modules.loss._Loss)
    with pytest.raises(Exception, match="(?i)loss"):
        mtd.convert(TinyLM(37, 8), mode=[("kd_loss", {"teacher_model": TinyLM(37, 8),
                                                      "criterion": topkd.LogitsKLLoss()})])


def test_generic_criterion_refuses_non_tensor():
    with pytest.raises(TypeError, match="logits tensor"):
        tmo.LogitsKLCriterion()(torch.randn(2, 5), ("not", "logits"))


# --- construction and input checks (one process, TP = 1 or no parallel_state) --------------


def _config(tp=1, **fields):
    return modelopt_worker.megatron_config(tp, **fields)


@pytest.mark.parametrize("make", [
    lambda **o: tmo.TopKLogitsKLLoss(_config(), k=4, **o),
    lambda **o: tmo.LogitsKLLoss(_config(), **o),
    lambda **o: tmo.TopKLogitsKLCriterion(4, **o),
    lambda **o: tmo.LogitsKLCriterion(**o),
], ids=["megatron-topk", "megatron-full", "generic-topk", "generic-full"])
@pytest.mark.parametrize("option, value, error", [
    ("temperature", 0.0, ValueError),
    ("divergence", "hellinger", ValueError),
    ("vocab_size", 0, ValueError),
    ("chunk_bytes", -1, ValueError),
    ("impl", "triton", ValueError),
    ("no_such_option", 1, TypeError),
])
def test_options_checked_at_construction(make, option, value, error):
    with pytest.raises(error, match=option):
        make(**{option: value})


@pytest.mark.parametrize("make", [
    lambda **o: tmo.TopKLogitsKLLoss(_config(), k=4, **o),
    lambda **o: tmo.TopKLogitsKLCriterion(4, **o),
], ids=["megatron", "generic"])
@pytest.mark.parametrize("option, value", [("top_p", 1.5), ("top_p_min_k", 0),
                                           ("normalize", "softmax")])
def test_topk_options_checked_at_construction(make, option, value):
    with pytest.raises(ValueError, match=option):
        make(**{option: value})


def test_megatron_options_only_what_the_layout_leaves():
    """reduction and process_group come from the layout and parallel_state."""
    for option, value in (("reduction", "mean"), ("process_group", None)):
        with pytest.raises(TypeError, match=option):
            tmo.LogitsKLLoss(_config(), **{option: value})


def test_k_and_top_k():
    assert tmo.TopKLogitsKLLoss(_config(), top_k=7).k == 7  # Model-Optimizer's spelling
    with pytest.raises(TypeError, match="not both"):
        tmo.TopKLogitsKLLoss(_config(), k=3, top_k=7)
    with pytest.raises(TypeError, match="needs k"):
        tmo.TopKLogitsKLLoss(_config())


def test_vocab_size_past_padded_vocabulary_at_construction():
    """A Bridge-style config tells the padded vocabulary (37 -> 40 at TP 2 x 20): a larger
    vocab_size, or a k larger than the vocabulary, fails at construction."""
    config = _config(2, vocab_size=37, should_pad_vocab=True, make_vocab_size_divisible_by=20)
    with pytest.raises(ValueError, match="larger than the padded vocabulary 40"):
        tmo.LogitsKLLoss(config, vocab_size=41)
    with pytest.raises(ValueError, match="k must be in"):
        tmo.TopKLogitsKLLoss(config, k=38)
    tmo.LogitsKLLoss(config, vocab_size=40)


def test_padded_vocabulary_from_config_one_process():
    """The config's real vocabulary keeps the padding out: the same as vocab_size=37."""
    config = _config(vocab_size=37, should_pad_vocab=True, make_vocab_size_divisible_by=40)
    s, t, _ = modelopt_worker.inputs(40, seed=5)
    loss, tp_reduce, sequence_parallel = tmo.TopKLogitsKLLoss(config, k=6)(s, t)
    want = topkd.topk_kl_loss(s, t, 6, vocab_size=37).t()
    assert (tp_reduce, sequence_parallel) == (False, False)
    assert torch.equal(loss, want)


def test_tensor_parallel_config_without_parallel_state():
    x = torch.randn(5, 3, 8)
    with pytest.raises(RuntimeError, match="parallel_state is not initialized"):
        tmo.LogitsKLLoss(_config(2))(x, x)


@pytest.mark.parametrize("student, error, words", [
    (torch.randn(15, 8), ValueError, r"\[s, b, V/TP\]"),
    ((), TypeError, "logits tensor first"),
    (("logits", None), TypeError, "logits tensor first"),
    ([torch.randn(5, 3, 8).long()], TypeError, "float32"),
    ("logits", TypeError, "got str"),
], ids=["2-D", "empty tuple", "str first", "int logits", "str"])
def test_bad_logits(student, error, words):
    with pytest.raises(error, match=words):
        tmo.TopKLogitsKLLoss(_config(), k=2)(student, torch.randn(5, 3, 8))


def test_student_teacher_layout_mismatch():
    with pytest.raises(ValueError, match=r"share \[s, b\]"):
        tmo.LogitsKLLoss(_config())(torch.randn(5, 3, 8), torch.randn(3, 5, 8))


def test_generic_criteria_need_no_megatron():
    """The generic criteria import without megatron-core (the Megatron classes load it on
    first use, as every other test here does)."""
    code = ("import sys; from topkd.integrations.modelopt import TopKLogitsKLCriterion; "
            "assert not any(m.startswith(('megatron', 'modelopt')) for m in sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_config_without_vocab_fields_is_plain_transformer_config():
    """Megatron-Core's own TransformerConfig carries no vocabulary: nothing is assumed."""
    from topkd.integrations import megatron as tmeg

    layout = tmeg.vocab_layout(TransformerConfig(num_layers=1, hidden_size=8,
                                                 num_attention_heads=1))
    assert (layout.vocab_size, layout.padded) == (None, None)
    assert tmeg.padded_vocab_size(151_936, 128, 2) == 152_064
