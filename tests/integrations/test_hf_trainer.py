"""topkd.hf.KDTrainer: one optimizer step equals a float64 step computed by hand, whatever the
batching (gradient accumulation, DDP ranks); the fused loss equals the unfused one inside the
trainer in fp32, under bf16 autocast and with bf16 parameters; tied embeddings, Gemma-2's
softcap, a LoRA student and padded vocabularies; the offline store against the online teacher;
KD lowers the held-out KL; the logs; and every misuse refused with a readable error.

Tiny models built from configs (tests/hf_worker.py), no hub. The references are float64 models
run on each sequence alone (no padding, no masks, no topkd): KL(teacher || student) summed over
the rows whose next token is learned, divided by their count.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import helpers  # noqa: E402
import hf_worker  # noqa: E402
from hf_worker import LR, V  # noqa: E402
from transformers import TrainingArguments  # noqa: E402

import topkd  # noqa: E402
import topkd.hf.trainer as trainer_module  # noqa: E402
from topkd.hf import KDCollator, KDTrainer  # noqa: E402

PARAM_ATOL = 1e-5  # parameters after one step (the brief's bound)
F32_GRAD_TOL = 1e-5  # fused vs unfused gradient, max err / max|g| (measured below 1e-6)
BF16_GRAD_TOL = 4e-2  # the same with bf16 products (a few bf16 ulps of max|g|)
K = 8


# -- references ------------------------------------------------------------------------------


def reference_loss(student, teacher, data, *, vocab=None, ce_weight=0.0):
    """float64 ``(loss, kd, ce, student64)``: each item alone through float64 copies of the
    models; KL(teacher || student) over the first ``vocab`` columns at the rows whose next
    label is not -100, plus ``ce_weight`` times the CE, over the count. ``kd`` and ``ce`` are
    floats; the loss keeps its graph to ``student64``'s parameters."""
    s64, t64 = copy.deepcopy(student).double(), copy.deepcopy(teacher).double()
    kd = ce = 0.0
    count = 0
    for item in data:
        ids = torch.tensor(item["input_ids"])[None]
        labels = torch.tensor(item.get("labels", item["input_ids"]))
        keep = labels[1:] != -100
        logits = s64(input_ids=ids).logits[0, :-1][keep][:, :vocab]
        with torch.no_grad():
            target = t64(input_ids=ids).logits[0, :-1][keep][:, :vocab]
        p, q = target.log_softmax(-1), logits.log_softmax(-1)
        kd = kd + (p.exp() * (p - q)).sum()
        ce = ce - q.gather(-1, labels[1:][keep][:, None]).sum()
        count += int(keep.sum())
    return ((kd + ce_weight * ce) / count, float(kd.detach()) / count,
            float(ce.detach()) / count, s64)


def reference_step(student, teacher, data):
    """float64 parameters after one SGD step of rate LR on :func:`reference_loss`."""
    before = {n: p.detach().double().clone() for n, p in student.named_parameters()}
    loss, _, _, s64 = reference_loss(student, teacher, data)
    loss.backward()
    after = {n: p.detach() - LR * p.grad for n, p in s64.named_parameters()}
    return before, after


def assert_params_close(got: dict, want: dict, before: dict, what: str) -> float:
    """Parameters within PARAM_ATOL, and the update itself within 1e-4 of its size (so a
    small update cannot pass by being small). Returns the max difference."""
    diff = max(float((got[n].double() - want[n].double()).abs().max()) for n in want)
    update = max(float((want[n].double() - before[n]).abs().max()) for n in want)
    assert update > 1e-3, f"{what}: the step barely moved the parameters ({update:.2e})"
    assert diff <= PARAM_ATOL and diff <= 1e-4 * update, (
        f"{what}: parameters differ by {diff:.3e} (update size {update:.3e})")
    return diff


def tokenizer(size: int = 290, renamed: int | None = None):
    """A local word-level tokenizer of ``size`` tokens (``<pad>`` 0, ``<unk>`` 1); ``renamed``:
    that token gets another spelling (another vocabulary of the same size)."""
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<unk>": 1}
    vocab.update({(f"x{i}" if i == renamed else f"w{i}"): i for i in range(2, size)})
    model = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    model.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=model, unk_token="<unk>", pad_token="<pad>")


def trainer_for(tmp_path, student, teacher=None, **options):
    """A KDTrainer (online unless ``store=``) with the one-step config; KDTrainer's keywords
    (store, processing_class, teacher_tokenizer, datasets) pass through, the rest is config."""
    keys = ("store", "processing_class", "teacher_tokenizer", "train_dataset", "eval_dataset",
            "data_collator")
    kwargs = {k: options.pop(k) for k in keys if k in options}
    return KDTrainer(model=student, teacher=teacher, args=hf_worker.config(tmp_path, **options),
                     **kwargs)


def loss_and_grads(trainer, data):
    """One ``compute_loss`` + backward on ``data`` as one batch, the model prepared by the
    trainer's accelerator as ``train()`` prepares it (autocast wrapper included):
    ``(loss, {name: grad})``."""
    batch = trainer._prepare_inputs(trainer.data_collator(data))
    model = trainer.accelerator.prepare_model(trainer.model)
    model.train()
    count = (batch["labels"][:, 1:] != -100).sum()
    loss = trainer.compute_loss(model, batch, num_items_in_batch=count)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters()
             if p.grad is not None}
    return loss.detach(), grads


def fused_and_unfused(tmp_path, make_student, make_teacher, data, **options):
    """:func:`loss_and_grads` of a fused and an unfused trainer on the same models."""
    out = []
    for fused in (True, False):
        trainer = trainer_for(tmp_path / f"fused{fused}", make_student(), make_teacher(),
                              fused=fused, **options)
        out.append(loss_and_grads(trainer, data))
    return out


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return helpers.grad_err(got.double(), want.double())


def assert_no_further(fused: dict, unfused: dict, fp32: dict, what: str) -> None:
    """Each low-precision fused gradient is within 1.5x (+ 5e-3 of max|g|) of the unfused
    one's distance to the fp32 gradient (bf16 networks differ from fp32 by 1e-2 to 7e-2 of
    max|g| per parameter here; a wrong term or scale is O(1))."""
    for name, g in fp32.items():
        mine, theirs = rel_err(fused[name], g), rel_err(unfused[name], g)
        assert mine <= 1.5 * theirs + 5e-3, (
            f"{what}: {name} fused grad is {mine:.3e} from fp32, unfused {theirs:.3e}")


def assert_same_grads(fused: dict, unfused: dict, tol: float, what: str) -> float:
    assert fused.keys() == unfused.keys() and fused, f"{what}: parameters with gradients differ"
    worst = 0.0
    for name, g in unfused.items():
        assert fused[name].dtype == g.dtype, f"{what}: {name} grad {fused[name].dtype} vs {g.dtype}"
        assert torch.isfinite(fused[name]).all(), f"{what}: {name} grad not finite"
        e = rel_err(fused[name], g)
        worst = max(worst, e)
        assert e <= tol, f"{what}: {name} grad max err / max|unfused| = {e:.3e} > {tol}"
    return worst


# -- 1. gradient accumulation and the hand-computed step -------------------------------------


@pytest.fixture(scope="module")
def one_step_runs(tmp_path_factory):
    """One SGD step on the 4 items as (batch 4, accumulation 1) and (batch 2, accumulation 2),
    and the same step computed by hand in float64."""
    root = tmp_path_factory.mktemp("steps")
    runs = {(b, a): hf_worker.one_step(root / f"b{b}a{a}", b, a) for b, a in ((4, 1), (2, 2))}
    before, after = reference_step(hf_worker.student(), hf_worker.teacher(), hf_worker.items())
    return runs, before, after


def test_grad_accumulation_equals_one_batch_and_the_float64_step(one_step_runs):
    runs, before, reference = one_step_runs
    items = [it["input_ids"] for it in hf_worker.items()]
    assert runs[4, 1][2] == [items], "batch 4 did not see the 4 items in order"
    assert runs[2, 2][2] == [items[:2], items[2:]], "accumulation 2 did not see 2 + 2 in order"
    counts = [sum(1 for x in it["labels"][1:] if x != -100) for it in hf_worker.items()]
    assert counts[0] + counts[1] > 3 * (counts[2] + counts[3])  # the micro-batches differ
    one, accumulated = runs[4, 1][0], runs[2, 2][0]
    assert_params_close(accumulated, one, before, "(2, 2) vs (4, 1)")
    assert_params_close(one, reference, before, "(4, 1) vs float64 by hand")
    assert_params_close(accumulated, reference, before, "(2, 2) vs float64 by hand")


# -- 7. logging ------------------------------------------------------------------------------


def test_logged_loss_and_kd_under_accumulation(one_step_runs, tmp_path):
    runs, _, _ = one_step_runs
    loss, kd, _, _ = reference_loss(hf_worker.student(), hf_worker.teacher(), hf_worker.items())
    for key, (_, log, _) in runs.items():
        entry = log[0]
        assert entry["step"] == 1 and "kd" in entry and "ce" not in entry, entry
        # the 4x-too-high bug: a mean returned under accumulation, summed by the Trainer
        assert entry["loss"] == pytest.approx(float(loss.detach()), rel=1e-5), (key, entry)
        assert entry["kd"] == pytest.approx(float(kd), rel=1e-5, abs=1e-6), (key, entry)

    # with the CE term: kd and ce logged per learned token, loss = kd + w * ce
    w = 0.5
    loss, kd, ce, _ = reference_loss(hf_worker.student(), hf_worker.teacher(),
                                     hf_worker.items(), ce_weight=w)
    _, log, _ = hf_worker.one_step(tmp_path, 2, 2, ce_weight=w)
    entry = log[0]
    assert entry["loss"] == pytest.approx(float(loss.detach()), rel=1e-5), entry
    assert entry["kd"] == pytest.approx(float(kd), rel=1e-5, abs=1e-6), entry
    assert entry["ce"] == pytest.approx(float(ce), rel=1e-5, abs=1e-6), entry


def test_a_step_that_learns_nothing_changes_nothing(tmp_path):
    """Every label -100 over a whole optimizer step (the first; later items learn): a zero
    loss and zero gradients, not the 0 / 0 that turned every parameter into NaN, and one
    warning that says so."""
    data = hf_worker.items() + hf_worker.items(seed=3)
    for item in data[:4]:
        item["labels"] = [-100] * len(item["labels"])
    with pytest.warns(UserWarning, match="step 1 learns no token"):
        params, log, _ = hf_worker.one_step(tmp_path, 2, 2, data=data)
    for name, p in hf_worker.student().named_parameters():
        assert torch.equal(params[name], p.detach()), name
    assert log[0]["loss"] == 0.0 and "kd" not in log[0], log[0]


def test_a_training_set_with_nothing_to_learn_is_refused(tmp_path):
    """Every label -100, or every sequence one token long: refused before the first step
    (not trained at a loss of 0)."""
    silent = hf_worker.items()
    for item in silent:
        item["labels"] = [-100] * len(item["labels"])
    single = hf_worker.items([(1, 0)] * 3)
    for data in (silent, single):
        trainer = trainer_for(tmp_path, hf_worker.student(), hf_worker.teacher(),
                              train_dataset=data)
        with pytest.raises(ValueError, match=f"nothing to learn: none of its {len(data)} items"):
            trainer.train()
        assert trainer.state.global_step == 0


# -- 2. DDP ----------------------------------------------------------------------------------


def test_ddp_two_gloo_ranks_equal_one_process(one_step_runs, tmp_path):
    runs, before, reference = one_step_runs
    helpers.spawn_ranks(hf_worker.ddp_worker, 2, (2, helpers.free_port(), str(tmp_path)),
                        tmp_path, deadline_s=240)
    plain = [torch.load(tmp_path / f"plain-rank{r}.pt") for r in range(2)]
    items = [it["input_ids"] for it in hf_worker.items()]
    # a sequential loader under accelerate: rank r takes the r-th batch of 2
    assert [r["seen"] for r in plain] == [[items[:2]], [items[2:]]]
    one = runs[4, 1]
    for rank, result in enumerate(plain):
        assert_params_close(result["params"], one[0], before, f"rank {rank} vs 1 process")
        assert_params_close(result["params"], reference, before, f"rank {rank} vs by hand")
        assert result["log"][0]["loss"] == pytest.approx(one[1][0]["loss"], rel=1e-5)
        assert result["log"][0]["kd"] == pytest.approx(one[1][0]["kd"], rel=1e-5)
    # rank 1 learns no token: its zero loss still joins the gradient all-reduce and the
    # logging collectives, and the step is the float64 step over rank 0's tokens
    _, reference = reference_step(hf_worker.student(), hf_worker.teacher(),
                                  hf_worker.unlearned_tail())
    loss, kd, _, _ = reference_loss(hf_worker.student(), hf_worker.teacher(),
                                    hf_worker.unlearned_tail())
    for rank in range(2):
        result = torch.load(tmp_path / f"unlearned-rank{rank}.pt")
        assert_params_close(result["params"], reference, before, f"rank {rank}, unlearned")
        assert result["log"][0]["loss"] == pytest.approx(float(loss.detach()), rel=1e-5)
        assert result["log"][0]["kd"] == pytest.approx(kd, rel=1e-5, abs=1e-6)


# -- 3. fused against unfused, precisions ----------------------------------------------------


@pytest.mark.parametrize("options", [{}, {"k": K, "divergence": "jsd", "ce_weight": 0.5}],
                         ids=["kl-full", "jsd-topk-ce"])
def test_fused_equals_unfused_fp32(tmp_path, options):
    data = hf_worker.items()
    (fl, fg), (ul, ug) = fused_and_unfused(tmp_path, hf_worker.student, hf_worker.teacher,
                                           data, **options)
    assert fl.dtype == ul.dtype == torch.float32
    assert float(fl) == pytest.approx(float(ul), rel=1e-5)
    assert_same_grads(fg, ug, F32_GRAD_TOL, "fp32")
    if not options:  # the plain KL also against float64 by hand
        loss, _, _, _ = reference_loss(hf_worker.student(), hf_worker.teacher(), data)
        assert float(fl) == pytest.approx(float(loss.detach()), rel=1e-5)


class ProductDtypes(torch.overrides.TorchFunctionMode):
    """Records ``(operand dtypes, last operand's shape)`` of every matrix product made while
    active."""

    PRODUCTS = {"linear", "mm", "addmm", "matmul", "bmm", "baddbmm"}

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func)).strip("_")
        if name in self.PRODUCTS:
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            self.seen.append((tuple(a.dtype for a in tensors), tuple(tensors[-1].shape)))
        return func(*args, **(kwargs or {}))


def test_fused_bf16_autocast_runs_products_in_bf16(tmp_path, monkeypatch):
    calls = []
    real = trainer_module.distill_loss

    def spy(student, teacher, options, **kwargs):
        if not isinstance(student, tuple):  # the unfused trainer's logits
            return real(student, teacher, options, **kwargs)
        recorder = ProductDtypes()
        with recorder:
            out = real(student, teacher, options, **kwargs)
        calls.append((student[0].dtype, student[1].dtype, teacher[0].dtype, recorder.seen))
        return out

    monkeypatch.setattr(trainer_module, "distill_loss", spy)
    data = hf_worker.items()
    (fl, fg), (ul, ug) = fused_and_unfused(tmp_path, hf_worker.student, hf_worker.teacher,
                                           data, bf16=True)
    assert len(calls) == 1, calls
    hidden, weight, teacher_hidden, products = calls[0]
    assert (hidden, weight, teacher_hidden) == (torch.bfloat16, torch.float32, torch.bfloat16)
    # the logits products (student and teacher: [rows, H] x [H, V]) and the hidden states'
    # gradient run in bf16; the weight's gradient over so few rows runs in float32 by design
    # (topkd.sources.LinearGradient: a bf16 product would round per row)
    logits = [dtypes for dtypes, shape in products if shape[-1] == V]
    assert len(logits) >= 2 and all(set(d) == {torch.bfloat16} for d in logits), products
    # fp32 parameters: their gradients land in float32 .grad
    assert all(g.dtype == torch.float32 for g in fg.values())
    # both paths round the same logits' products to bf16 and widen them: the same loss; the
    # gradients differ by a few bf16 ulps of the largest (measured 1.3e-2 of max|g|)
    assert float(fl) == pytest.approx(float(ul), rel=1e-4)
    assert_same_grads(fg, ug, BF16_GRAD_TOL, "bf16 autocast")
    # and the fused bf16 step is no further from the fp32 step than the unfused one is
    f32, g32 = loss_and_grads(trainer_for(tmp_path / "fp32", hf_worker.student(),
                                          hf_worker.teacher()), data)
    assert_no_further(fg, ug, g32, "bf16 autocast")
    assert float(fl) == pytest.approx(float(f32), rel=1e-2)


def test_fused_equals_unfused_bf16_parameters(tmp_path):
    data = hf_worker.items()
    (fl, fg), (ul, ug) = fused_and_unfused(
        tmp_path, lambda: hf_worker.student().to(torch.bfloat16),
        lambda: hf_worker.teacher().to(torch.bfloat16), data)
    assert all(g.dtype == torch.bfloat16 for g in fg.values())
    assert float(fl) == pytest.approx(float(ul), rel=1e-4)
    assert_same_grads(fg, ug, BF16_GRAD_TOL, "bf16 parameters")  # measured 1.6e-2
    f32, g32 = loss_and_grads(trainer_for(tmp_path / "fp32", hf_worker.student(),
                                          hf_worker.teacher()), data)
    assert_no_further(fg, ug, g32, "bf16 parameters")
    assert float(fl) == pytest.approx(float(f32), rel=1e-2)


# -- 4. model variants -----------------------------------------------------------------------


def test_tied_embeddings_get_head_and_embedding_gradients(tmp_path):
    def student():
        return hf_worker.student(tie_word_embeddings=True)

    model = student()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    data = hf_worker.items()
    (fl, fg), (ul, ug) = fused_and_unfused(tmp_path, student, hf_worker.teacher, data)
    assert "model.embed_tokens.weight" in fg and "lm_head.weight" not in fg
    assert float(fl) == pytest.approx(float(ul), rel=1e-5)
    assert_same_grads(fg, ug, F32_GRAD_TOL, "tied")
    # the shared weight's gradient is the head's plus the embedding's: against float64, and
    # far from either part alone (from the same models untied)
    loss, _, _, s64 = reference_loss(student(), hf_worker.teacher(), data)
    loss.backward()
    want = s64.model.embed_tokens.weight.grad
    untied = student()
    untied.lm_head.weight = torch.nn.Parameter(untied.lm_head.weight.detach().clone())
    loss, _, _, u64 = reference_loss(untied, hf_worker.teacher(), data)
    loss.backward()
    parts = u64.model.embed_tokens.weight.grad, u64.lm_head.weight.grad
    assert rel_err(parts[0] + parts[1], want) <= 1e-10
    got = fg["model.embed_tokens.weight"]
    assert rel_err(got, want) <= F32_GRAD_TOL
    assert min(rel_err(got, part) for part in parts) > 1e-2


def test_gemma2_softcap_fused_equals_unfused(tmp_path):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    def gemma(seed, softcap, width):
        torch.manual_seed(seed)
        config = Gemma2Config(vocab_size=V, hidden_size=width, intermediate_size=2 * width,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=8, max_position_embeddings=64, sliding_window=4,
                              query_pre_attn_scalar=8, final_logit_softcapping=softcap,
                              initializer_range=0.3, attn_implementation="eager")
        return Gemma2ForCausalLM(config)

    def student():
        return gemma(0, 2.0, 32)

    def teacher():
        return gemma(1, 3.0, 48)

    data = hf_worker.items()
    trainer = trainer_for(tmp_path / "probe", student(), teacher())
    assert (trainer._student_hidden.softcap, trainer._teacher_hidden.softcap) == (2.0, 3.0)
    (fl, fg), (ul, ug) = fused_and_unfused(tmp_path, student, teacher, data)
    loss, _, _, s64 = reference_loss(student(), teacher(), data)
    assert float(fl) == pytest.approx(float(loss.detach()), rel=1e-5)
    assert float(ul) == pytest.approx(float(loss.detach()), rel=1e-5)
    assert_same_grads(fg, ug, F32_GRAD_TOL, "gemma2 softcap")
    # the cap is active: without it the same models' KL is another number
    uncapped_s, uncapped_t = student(), teacher()
    uncapped_s.config.final_logit_softcapping = uncapped_t.config.final_logit_softcapping = None
    other, _, _, _ = reference_loss(uncapped_s, uncapped_t, data)
    assert abs(float(other.detach()) - float(loss.detach())) > 0.05 * float(loss.detach())


def test_lora_student_fused_equals_unfused(tmp_path):
    peft = pytest.importorskip("peft")

    def student():
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                 init_lora_weights=False)
        return peft.get_peft_model(hf_worker.student(), config)

    data = hf_worker.items()
    (fl, fg), (ul, ug) = fused_and_unfused(tmp_path, student, hf_worker.teacher, data)
    assert fg and all("lora_" in name for name in fg), sorted(fg)
    assert all(float(g.abs().max()) > 0 for g in fg.values())
    assert float(fl) == pytest.approx(float(ul), rel=1e-5)
    assert_same_grads(fg, ug, F32_GRAD_TOL, "LoRA")
    loss, _, _, _ = reference_loss(student(), hf_worker.teacher(), data)
    assert float(fl) == pytest.approx(float(loss.detach()), rel=1e-5)


def test_padded_vocabularies_use_the_tokenizer(tmp_path):
    def student():
        return hf_worker.student()  # 300 output rows

    def teacher():
        return hf_worker.teacher(vocab_size=320)

    tok = tokenizer(290)
    assert len(tok) == 290
    data = hf_worker.items(vocab=290)
    trainer = trainer_for(tmp_path / "probe", student(), teacher(), processing_class=tok,
                          teacher_tokenizer=tokenizer(290))
    assert trainer.vocab_size == 290
    (fl, fg), (ul, ug) = fused_and_unfused(tmp_path, student, teacher, data,
                                           processing_class=tok)
    loss, _, _, _ = reference_loss(student(), teacher(), data, vocab=290)
    assert float(fl) == pytest.approx(float(loss.detach()), rel=1e-5)
    assert float(ul) == pytest.approx(float(loss.detach()), rel=1e-5)
    assert_same_grads(fg, ug, F32_GRAD_TOL, "padded")
    # the padding rows are outside both distributions: no gradient reaches them
    assert float(fg["lm_head.weight"][290:].abs().max()) == 0.0

    with pytest.raises(ValueError, match="widths differ"):
        trainer_for(tmp_path / "none", student(), teacher())
    with pytest.raises(ValueError, match="fingerprint"):
        trainer_for(tmp_path / "other", student(), teacher(), processing_class=tok,
                    teacher_tokenizer=tokenizer(290, renamed=7))


# -- 5. offline: the store against the online teacher ----------------------------------------


def build_store(path, teacher, data, *, k=K):
    """The teacher's float32 top-k rows of each item, stored under ids ``s0, s1, ...``."""
    from topkd.store import TeacherStoreWriter

    with TeacherStoreWriter(path, k=k, vocab_size=V, logprob_dtype="float32") as writer:
        for i, item in enumerate(data):
            ids = torch.tensor(item["input_ids"])
            with torch.no_grad():
                logits = teacher(input_ids=ids[None]).logits[0].float()
            writer.add(f"s{i}", ids, topkd.select_topk(logits, k))
    return path


@pytest.fixture
def offline(tmp_path):
    pytest.importorskip("safetensors")
    data = hf_worker.items()
    path = build_store(tmp_path / "store", hf_worker.teacher(), data)
    stored = [{**item, "sample_id": f"s{i}"} for i, item in enumerate(data)]
    return path, data, stored


@pytest.mark.parametrize("normalize", ["full", "topk"])
def test_store_rows_give_the_online_loss_and_step(offline, tmp_path, normalize):
    path, data, stored = offline
    online = trainer_for(tmp_path / "on", hf_worker.student(), hf_worker.teacher(), k=K,
                         normalize=normalize)
    for fused in (True, False):
        store = trainer_for(tmp_path / f"off{fused}", hf_worker.student(), store=str(path),
                            normalize=normalize, fused=fused)
        for on, off in ((data, stored), (data[:2], stored[:2]), (data[2:], stored[2:])):
            with torch.no_grad():
                a = online.compute_loss(online.model,
                                        online._prepare_inputs(online.data_collator(on)))
                b = store.compute_loss(store.model,
                                       store._prepare_inputs(store.data_collator(off)))
            assert float(b) == pytest.approx(float(a), rel=1e-5), (fused, len(on))
    if normalize == "full":
        # one step (2 x 2 accumulated) through the whole offline path: dataloader, collator,
        # sample ids, device moves
        steps = {}
        for name, source in (("online", dict(teacher=hf_worker.teacher(), k=K,
                                              train_dataset=data)),
                             ("offline", dict(store=path, train_dataset=stored))):
            model = hf_worker.student()
            trainer_for(tmp_path / name, model, per_device_train_batch_size=2,
                        gradient_accumulation_steps=2, **source).train()
            steps[name] = {n: p.detach().clone() for n, p in model.named_parameters()}
        before = {n: p.detach().double() for n, p in hf_worker.student().named_parameters()}
        assert_params_close(steps["offline"], steps["online"], before, "offline vs online")


def test_store_refuses_misaligned_and_missing_samples(offline, tmp_path):
    path, data, stored = offline
    trainer = trainer_for(tmp_path, hf_worker.student(), store=path)
    collate = trainer.data_collator
    collate(stored)  # the aligned batch is accepted
    wrong = [{**stored[0], "input_ids": data[1]["input_ids"], "labels": data[1]["labels"]}]
    with pytest.raises(ValueError, match="misaligned"):
        collate(wrong)
    with pytest.raises(KeyError, match="'nowhere'"):
        collate([{**stored[0], "sample_id": "nowhere"}])
    # through the trainer's own dataloader too
    bad = trainer_for(tmp_path / "bad", hf_worker.student(), store=path,
                      train_dataset=stored[:1] + wrong, per_device_train_batch_size=2)
    with pytest.raises(ValueError, match="misaligned"):
        next(iter(bad.get_train_dataloader()))


def test_store_items_without_sample_id(offline, tmp_path):
    path, data, stored = offline
    trainer = trainer_for(tmp_path, hf_worker.student(), store=path)
    with pytest.raises(ValueError, match="'sample_id'") as info:
        trainer.data_collator(data)
    assert "remove_unused_columns" in str(info.value)
    # remove_unused_columns=True drops sample_id before the collator: named, not a KeyError
    dropping = trainer_for(tmp_path / "drop", hf_worker.student(), store=path,
                           train_dataset=stored, remove_unused_columns=True)
    with pytest.raises(ValueError, match="remove_unused_columns") as info:
        next(iter(dropping.get_train_dataloader()))
    assert "'sample_id'" in str(info.value)


# -- 6. KD works -----------------------------------------------------------------------------


def test_kd_lowers_held_out_kl(tmp_path):
    """A teacher close to a bigram model (small layers, a head scaled up) on a 64-token
    vocabulary: 30 Adam steps of online KD must cut the held-out KL(teacher || student) by
    more than 40%. ``evaluate`` before training equals the float64 KL by hand."""
    vocab = 64
    train = hf_worker.items([(16, 0)] * 16, vocab=vocab, seed=5)
    held_out = hf_worker.items([(16, 0)] * 8, vocab=vocab, seed=6)
    student = hf_worker.student(vocab_size=vocab, initializer_range=0.02)
    teacher = hf_worker.teacher(vocab_size=vocab, initializer_range=0.02)
    with torch.no_grad():
        teacher.lm_head.weight.mul_(10.0)
    trainer = trainer_for(tmp_path, student, teacher, train_dataset=train,
                          eval_dataset=held_out, max_steps=30, learning_rate=5e-3,
                          optim="adamw_torch", per_device_train_batch_size=8,
                          per_device_eval_batch_size=8, logging_steps=10)
    before = trainer.evaluate()
    _, kd, ce, _ = reference_loss(student, teacher, held_out)
    assert before["eval_kl"] == pytest.approx(float(kd), rel=1e-5)
    assert before["eval_ce"] == pytest.approx(float(ce), rel=1e-5)
    assert before["eval_loss"] == pytest.approx(float(kd), rel=1e-5)
    trainer.train()
    after = trainer.evaluate()
    assert after["eval_kl"] < 0.6 * before["eval_kl"], (before, after)
    assert [e["step"] for e in trainer.state.log_history if "kd" in e] == [10, 20, 30]


# -- 8. bad input ----------------------------------------------------------------------------


def test_bad_construction_is_refused(offline, tmp_path):
    path, _, _ = offline
    student, teacher = hf_worker.student(), hf_worker.teacher()
    with pytest.raises(ValueError, match="exactly one of teacher"):
        trainer_for(tmp_path, student, teacher, store=path)
    with pytest.raises(ValueError, match="exactly one of teacher"):
        trainer_for(tmp_path, student)
    with pytest.raises(TypeError, match="KDConfig"):
        KDTrainer(model=student, teacher=teacher,
                  args=TrainingArguments(output_dir=str(tmp_path), use_cpu=True,
                                         report_to="none"))
    with pytest.raises(ValueError, match=f"k={K + 1}.*k={K}"):
        trainer_for(tmp_path, student, store=path, k=K + 1)
    with pytest.raises(ValueError, match="temperature"):
        trainer_for(tmp_path, student, store=path, temperature=2.0)
    with pytest.raises(ValueError, match="top_p"):
        trainer_for(tmp_path, student, teacher, top_p=0.9)
    with pytest.raises(TypeError, match="store must be"):
        trainer_for(tmp_path, student, store=3)
    with pytest.raises(ValueError, match="'nonsense'"):
        trainer_for(tmp_path, student, teacher, divergence="nonsense")


def test_collator_pads_and_masks():
    batch = KDCollator(pad_token_id=5)(hf_worker.items([(3, 1), (1, 0)]))
    assert batch["input_ids"].shape == (2, 3)
    assert batch["input_ids"][1, 1:].tolist() == [5, 5]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"][0, 0] == -100 and batch["labels"][1, 1:].tolist() == [-100, -100]
    for labels in ([1, 2, 3, 4], [1, 2]):  # named, not a shape error from a copy
        with pytest.raises(ValueError, match=f"3 input_ids but {len(labels)} labels"):
            KDCollator()([{"input_ids": [1, 2, 3], "labels": labels}])


# -- 9. what a new user hits -----------------------------------------------------------------


def _poisoned_teacher(token: int, value: float):
    """The test teacher with ``value`` (NaN, inf) in the input embedding of ``token``: a
    sequence holding the token gets non-finite hidden states everywhere (masked attention
    weighs its value vector by 0, and 0 * NaN is NaN), the other sequences none."""
    teacher = hf_worker.teacher()
    with torch.no_grad():
        teacher.get_input_embeddings().weight[token, 0] = value
    return teacher


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_a_non_finite_teacher_stops_training_before_the_optimizer(tmp_path, fused, value):
    data = hf_worker.items([(6, 0), (7, 0)])
    poison = data[1]["input_ids"][3]
    assert poison not in data[0]["input_ids"] and poison not in data[1]["input_ids"][:3]
    student = hf_worker.student()
    before = {n: p.detach().clone() for n, p in student.named_parameters()}
    trainer = trainer_for(tmp_path, student, _poisoned_teacher(poison, value),
                          train_dataset=data, fused=fused, per_device_train_batch_size=2)
    with pytest.raises(trainer_module.NonFiniteError,
                       match="step 1, batch row 1, position 0: the teacher gave NaN or "
                             "infinite values \\(.*; 6 row\\(s\\) of this batch\\)"):
        trainer.train()
    for name, p in student.named_parameters():  # nothing reached the optimizer
        assert torch.equal(p.detach(), before[name]), name


def test_a_non_finite_stored_row_stops_training(offline, tmp_path, monkeypatch):
    """topkd's writer refuses a NaN row; a store that holds one anyway (written by other
    software, or by a topkd that did not check) stops the training at that row, naming it."""
    from topkd.store import TeacherStore, TeacherStoreWriter

    _, data, _ = offline
    path = tmp_path / "bad-store"
    with TeacherStoreWriter(path, k=K, vocab_size=V, logprob_dtype="float32") as writer:
        for i, item in enumerate(data[:2]):
            ids = torch.tensor(item["input_ids"])
            with torch.no_grad():
                logits = hf_worker.teacher()(input_ids=ids[None]).logits[0].float()
            if i == 1:
                bad = logits.clone()
                bad[2] = float("nan")
                with pytest.raises(ValueError, match="sample 's1': .*not NaN"):
                    writer.add(f"s{i}", ids, topkd.select_topk(bad, K))
            writer.add(f"s{i}", ids, topkd.select_topk(logits, K))
    get = TeacherStore.get

    def poisoned(self, sample_id, input_ids=None):
        teacher = get(self, sample_id, input_ids)
        if sample_id == "s1":
            teacher.logprobs[2] = float("nan")
        return teacher

    monkeypatch.setattr(TeacherStore, "get", poisoned)
    stored = [{**item, "sample_id": f"s{i}"} for i, item in enumerate(data[:2])]
    trainer = trainer_for(tmp_path, hf_worker.student(), store=path, train_dataset=stored,
                          per_device_train_batch_size=2)
    with pytest.raises(trainer_module.NonFiniteError,
                       match="step 1, batch row 1 \\(sample id 's1'\\), position 2.*stored"):
        trainer.train()


def test_a_non_finite_teacher_head_is_refused_at_construction(tmp_path):
    teacher = hf_worker.teacher()
    with torch.no_grad():
        teacher.lm_head.weight[3, 3] = float("nan")
    with pytest.raises(trainer_module.NonFiniteError, match="LM head"):
        trainer_for(tmp_path, hf_worker.student(), teacher)


def test_text_items_are_tokenized_as_distill_tokenizes_them(tmp_path):
    """A datasets.Dataset with a "text" column and processing_class=tokenizer trains, with the
    loss of the same items given as token ids (tokenized by topkd's own function)."""
    datasets = pytest.importorskip("datasets")
    from topkd.store.build import encode_texts

    tok = tokenizer(290)
    texts = ["w5 w9 w13 w2 w40", "w7 w7 w8 w100 w3 w4 w5", "w250 w11 w12"]
    text_data = datasets.Dataset.from_dict({"text": texts})
    id_data = [{"input_ids": ids} for ids in encode_texts(tok, texts, None)]
    losses = []
    for data in (text_data, id_data):
        trainer = trainer_for(tmp_path, hf_worker.student(), hf_worker.teacher(),
                              processing_class=tok, train_dataset=data)
        losses.append(loss_and_grads(trainer, [data[i] for i in range(len(texts))])[0])
    assert float(losses[0]) == float(losses[1]) and float(losses[0]) > 0
    trainer.train_dataset = text_data
    trainer.train()  # the Trainer's own loader, collator and step
    # with a length limit, as distill's --max-length
    short = trainer_for(tmp_path, hf_worker.student(), hf_worker.teacher(),
                        processing_class=tok, max_length=3)
    assert short.data_collator([{"text": texts[1]}])["input_ids"].shape == (1, 3)
    with pytest.raises(ValueError, match="'text' field and no 'input_ids': pass "
                                         "processing_class"):
        trainer_for(tmp_path, hf_worker.student(), hf_worker.teacher(),
                    train_dataset=text_data)


def test_token_ids_outside_the_vocabulary_are_named(tmp_path):
    data = hf_worker.items([(5, 0), (6, 0)])
    data[1]["input_ids"][4] = V + 7
    trainer = trainer_for(tmp_path, hf_worker.student(), hf_worker.teacher(),
                          train_dataset=data, per_device_train_batch_size=2)
    with pytest.raises(ValueError, match=f"step 1, batch row 1, position 4: token id {V + 7} "
                                         f"is outside the vocabulary \\(the models embed ids "
                                         f"0 to {V - 1}"):
        trainer.train()


def test_another_vocabulary_is_not_a_resize(tmp_path):
    tok = tokenizer(290)
    with pytest.raises(ValueError, match="the teacher has 200 output rows but the student's "
                                         "tokenizer has 290 tokens: the teacher's vocabulary is "
                                         "a different one.*not supported"):
        trainer_for(tmp_path, hf_worker.student(), hf_worker.teacher(vocab_size=200),
                    processing_class=tok)
    with pytest.raises(ValueError, match="the student has 280 output rows but its tokenizer "
                                         "has 290 tokens; resize its embeddings"):
        trainer_for(tmp_path, hf_worker.student(vocab_size=280), hf_worker.teacher(),
                    processing_class=tok)


def test_k_larger_than_the_vocabulary_is_refused_at_construction(tmp_path):
    with pytest.raises(ValueError, match=f"k={V + 1} is larger than the vocabulary \\({V}"):
        trainer_for(tmp_path, hf_worker.student(), hf_worker.teacher(), k=V + 1)


_HalfTVD = helpers.half_tvd_class("half_tvd_trainer")


def test_kdconfig_takes_a_divergence_object_and_impl(tmp_path, monkeypatch):
    """``KDConfig(divergence=<object>, impl=...)`` reach the loss: half of the TVD loss and
    gradients, the eager kernels; the config still writes itself as JSON."""
    seen = helpers.record_options(monkeypatch, trainer_module)
    data = hf_worker.items()
    half = trainer_for(tmp_path / "half", hf_worker.student(), hf_worker.teacher(), k=K,
                       divergence=_HalfTVD(), impl="eager")
    (hl, hg) = loss_and_grads(half, data)
    tvd = trainer_for(tmp_path / "tvd", hf_worker.student(), hf_worker.teacher(), k=K,
                      divergence="tvd", impl="eager")
    (tl, tg) = loss_and_grads(tvd, data)
    assert float(hl) == pytest.approx(0.5 * float(tl), rel=1e-5)
    assert assert_same_grads(hg, {n: 0.5 * g for n, g in tg.items()}, F32_GRAD_TOL,
                             "half TVD") < F32_GRAD_TOL
    assert [(o.impl, type(o.divergence)) for o in seen] == [("eager", _HalfTVD),
                                                            ("eager", topkd.TVD)]
    assert f'"divergence": "{_HalfTVD()!r}"' in half.args.to_json_string()
    with pytest.raises(ValueError, match="impl"):
        trainer_for(tmp_path / "bad", hf_worker.student(), hf_worker.teacher(), impl="triton")
