"""Body of test_megatron_fused.py, run in two spawned gloo ranks whose tensor-parallel group is
megatron-core's ``parallel_state`` (TP = 2).

- **output layer**: a real ``ColumnParallelLinear`` (sequence parallelism off and on) makes the
  logits and topkd's logits criterion takes them; the fused criterion takes the layer's inputs
  instead. Loss, and the gradients of the hidden states, the weight shard and the bias shard,
  must agree.
- **store**: a topkd store at a 262,144-entry vocabulary (Gemma 3's; Megatron-LM's own offline
  path stops at 2^17), read through a Megatron-style sampler of global sample indices, the
  default collate and ``teacher_from_batch``, into the ``[s, b, V/TP]`` sparse loss and the
  fused one, against one process.
- **GPTModel**: a 2-layer student distilled from a 2-layer teacher through Model-Optimizer's
  ``DistillationModel`` with the fused criterion, against the logits criterion.
- **errors**: an unfused student, a kept LM loss, a teacher batch in the wrong layout.

Megatron-Core allocates some buffers on CUDA only; :func:`cpu_patches` moves them to the CPU
(megatron's, not topkd's behaviour). The heavy imports happen in the ranks, not in the test's
own process.
"""

from __future__ import annotations

import contextlib
import json
import operator
import os
import sys
import warnings
from functools import reduce

import torch
import torch.distributed as dist

_HERE = os.path.dirname(os.path.abspath(__file__))
for _p in (_HERE, os.path.dirname(_HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import tp_worker  # noqa: E402

LOSS_RTOL = 1e-6  # fused vs logits path, of the batch's loss scale
GRAD_TOL = 1e-5  # gradient max error / max |gradient|
STORE_VOCAB, STORE_K, STORE_SEQ, STORE_SAMPLES = 262_144, 8, 8, 6


def cpu_patches():
    """Megatron-Core's CUDA-only pieces, on the CPU (none of them is topkd's):
    ``GlobalMemoryBuffer.get_tensor`` (ColumnParallelLinear's sequence-parallel gather buffer,
    attention's buffer) allocates on ``torch.cuda.current_device()``; the sequence-parallel
    backward allocates its reduce-scatter output there too; ``CudaRNGStatesTracker.fork``
    (attention dropout) needs a CUDA RNG state."""
    import megatron.core.utils as mu
    from megatron.core.tensor_parallel import random as mpr

    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
        return torch.empty(reduce(operator.mul, tensor_shape, 1), dtype=dtype).view(*tensor_shape)

    mu.GlobalMemoryBuffer.get_tensor = get_tensor
    mpr.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()
    torch.cuda.current_device = lambda: "cpu"


def scaled_error(x, ref) -> float:
    r = ref.double()
    scale = torch.maximum(r.abs(), r.abs().mean()).clamp_min(1e-30)
    return float(((x.double() - r).abs() / scale).max())


def grad_error(g, ref) -> float:
    return float((g.double() - ref.double()).abs().max()) / max(float(ref.abs().max()), 1e-30)


class Checker:
    def __init__(self, failures, metrics):
        self.failures, self.metrics = failures, metrics

    def error(self, name, what, value, bound):
        self.metrics.setdefault(name, {})[what] = value
        if not value <= bound:
            self.failures.append(f"[{name}] {what} = {value:.3e} > {bound}")

    def true(self, name, cond, message):
        if not cond:
            self.failures.append(f"[{name}] {message}")


def _config(tp, **fields):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2,
                             tensor_model_parallel_size=tp, use_cpu_initialization=True,
                             **fields)


def run_output_layer(tp, rank, check):
    """Fused criterion vs ColumnParallelLinear + logits criterion, sequence parallelism off and
    on. Top-K: Model-Optimizer-facing classes on fused layers (student with a bias, teacher
    fused too, padded vocabulary); whole vocabulary: the functions, teacher logits."""
    from megatron.core import tensor_parallel

    from topkd.integrations import megatron as tmeg
    from topkd.integrations import megatron_fused as mf
    from topkd.integrations import modelopt as tmo

    s, b, h, width, vocab, k = 6, 2, 16, 40, 37, 5
    for sp in (False, True):
        config = _config(tp, sequence_parallel=sp)
        torch.manual_seed(0)  # the same master weights on every rank (CPU initialization)
        layer = tensor_parallel.ColumnParallelLinear(
            h, width, config=config, init_method=config.init_method, bias=True,
            gather_output=False)
        teacher = tensor_parallel.ColumnParallelLinear(
            h, width, config=config, init_method=config.init_method, bias=False,
            gather_output=False)
        g = torch.Generator().manual_seed(1)
        hidden, t_hidden = torch.randn(s, b, h, generator=g), torch.randn(s, b, h, generator=g)
        gout = torch.randn(b, s, generator=g)
        with torch.no_grad():
            layer.bias.normal_(generator=g)

        def local(x, sp=sp):
            return x.chunk(tp, 0)[rank] if sp else x

        for kind in ("topk", "kl"):
            name = f"output layer TP={tp} sequence_parallel={sp} {kind}"
            grads, values = [], []
            for fused in (False, True):
                leaf = local(hidden).clone().requires_grad_(True)
                layer.weight.grad = layer.bias.grad = None
                if kind == "topk":
                    crit = (tmo.FusedTopKLogitsKLLoss if fused else tmo.TopKLogitsKLLoss)(
                        config, k=k, vocab_size=vocab)
                    if fused:
                        mf.fuse_output_layer(layer)
                        mf.fuse_output_layer(teacher, training_only=False)
                    with torch.no_grad():
                        t_out = teacher(local(t_hidden))
                    out = layer(leaf)
                    check.true(name, isinstance(out, mf.FusedOutput) == fused,
                               f"fused={fused} but the layer returned {type(out).__name__}")
                    loss, *flags = crit(out, t_out)
                    check.true(name, flags == [False, False], f"flags {flags}")
                    mf.unfuse_output_layer(layer)
                    mf.unfuse_output_layer(teacher)
                else:
                    with torch.no_grad():
                        t_out = teacher(local(t_hidden))
                    if fused:
                        loss = mf.fused_kl_loss(leaf, layer.weight, t_out, model_config=config,
                                                bias=layer.bias, temperature=1.5)
                    else:
                        loss = tmeg.kl_loss(layer(leaf), t_out, model_config=config,
                                            temperature=1.5)
                loss.backward(gout)
                values.append(loss.detach())
                grads.append((leaf.grad, layer.weight.grad.clone(), layer.bias.grad.clone()))
            check.true(name, values[1].shape == (b, s), f"loss shape {tuple(values[1].shape)}")
            check.error(name, "loss vs logits path", scaled_error(values[1], values[0]),
                        LOSS_RTOL)
            for what, got, want in zip(("hidden", "weight", "bias"), grads[1], grads[0],
                                       strict=True):
                check.error(name, f"{what} grad vs ColumnParallelLinear",
                            grad_error(got, want), GRAD_TOL)


class MegatronLikeDataset(torch.utils.data.Dataset):
    """What Megatron's GPTDataset gives for global sample index ``i``: a dict of ``[s]``
    tensors, made from ``i`` alone."""

    def __init__(self, n=STORE_SAMPLES, s=STORE_SEQ, vocab=STORE_VOCAB):
        self.n, self.s, self.vocab = n, s, vocab

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(1000 + int(i))
        text = torch.randint(0, self.vocab, (self.s + 1,), generator=g)
        return {"tokens": text[:-1], "labels": text[1:], "loss_mask": torch.ones(self.s),
                "position_ids": torch.arange(self.s)}


def teacher_logits(i: int) -> torch.Tensor:
    """The teacher's ``[s, V]`` logits on sample ``i`` (what the store was built from)."""
    g = torch.Generator().manual_seed(i)
    return torch.randn(STORE_SEQ, STORE_VOCAB, generator=g) * 3


def build_store(path: str) -> None:
    """The offline pass: the teacher over every global sample index, stored by that index."""
    import topkd
    from topkd.store import TeacherStoreWriter

    data = MegatronLikeDataset()
    with TeacherStoreWriter(path, k=STORE_K, vocab_size=STORE_VOCAB,
                            logprob_dtype="float32") as writer:
        for i in range(len(data)):
            writer.add(i, data[i]["tokens"], topkd.select_topk(teacher_logits(i), STORE_K))


def megatron_sampler(total: int, micro_batch: int, consumed: int, dp_rank: int, dp_size: int):
    """Megatron-LM's ``MegatronPretrainingSampler`` (megatron/training/datasets/
    data_samplers.py, not in megatron-core): from ``consumed`` on, every global batch of
    ``micro_batch x dp_size`` indices, this data-parallel rank's slice of it."""
    batch = []
    for idx in range(consumed, total):
        batch.append(idx)
        if len(batch) == micro_batch * dp_size:
            yield batch[dp_rank * micro_batch:(dp_rank + 1) * micro_batch]
            batch = []


def run_store(tp, rank, store_path, check):
    """Store rows by global sample index into Megatron's [s, b] losses at V = 262,144."""
    import torch.nn.functional as F

    import topkd
    from topkd.integrations import megatron as tmeg
    from topkd.integrations import megatron_fused as mf
    from topkd.integrations.megatron_data import WithTeacherRows, teacher_from_batch
    from topkd.store import TeacherStore

    store = TeacherStore(store_path)
    config = _config(tp)
    loader = torch.utils.data.DataLoader(
        WithTeacherRows(MegatronLikeDataset(), store),
        batch_sampler=list(megatron_sampler(STORE_SAMPLES, 2, consumed=2, dp_rank=0,
                                            dp_size=1)))
    width = STORE_VOCAB // tp
    h = 16
    g = torch.Generator().manual_seed(5)
    weight = torch.randn(STORE_VOCAB, h, generator=g) / h ** 0.5 * 2
    w_local = weight[rank * width:(rank + 1) * width].clone()
    seen = []
    for step, batch in enumerate(loader):
        ids = batch["tokens"]  # [b, s]
        teacher = teacher_from_batch(batch, vocab_size=store.vocab_size,
                                     temperature=store.temperature)
        seen.append(ids.shape[0])
        name = f"store V={STORE_VOCAB} TP={tp} batch {step}"
        want = store.collate(range(2 + 2 * step, 4 + 2 * step))
        check.true(name, torch.equal(teacher.indices, want.indices)
                   and torch.equal(teacher.logprobs, want.logprobs),
                   "the batch's teacher rows are not the store's rows of its global indices")
        b, s = ids.shape
        hidden = torch.randn(s, b, h, generator=g)
        full = F.linear(hidden, weight)  # [s, b, V], the student logits of one process
        gout = torch.randn(b, s, generator=g)

        leaf = full[..., rank * width:(rank + 1) * width].clone().requires_grad_(True)
        loss = tmeg.sparse_kl_loss(leaf, teacher, model_config=config)
        loss.backward(gout)
        one = full.transpose(0, 1).clone().requires_grad_(True)
        ref = topkd.sparse_kl_loss(one, teacher)  # [b, s], one process, the batch layout
        ref.backward(gout)
        check.error(name, "sparse loss [s, b, V/TP] vs one process", scaled_error(loss, ref),
                    LOSS_RTOL)
        check.error(name, "sparse grad vs one process",
                    grad_error(leaf.grad, one.grad.transpose(0, 1)[..., rank * width:
                                                                   (rank + 1) * width]),
                    GRAD_TOL)
        fused_loss = mf.fused_topk_kl_loss(hidden, w_local, teacher, model_config=config)
        check.error(name, "fused sparse loss vs one process", scaled_error(fused_loss, ref),
                    LOSS_RTOL)
    check.true("store", seen == [2, 2], f"batches of {seen}, expected the samples 2..5 in two")


def run_gpt(tp, rank, check, steps=20):
    """GPTModel TP=2 (local layer spec, CPU initialization): a 2-layer student (hidden 32)
    distilled from a 2-layer teacher (hidden 64) through Model-Optimizer's DistillationModel,
    Adam, one fixed batch, ``skip_lm_loss=True``; once with the fused criterion on fused
    output layers, once with the logits criterion; then the KD loss in eval, where the fused
    student makes its logits. Sequence parallelism stays off: the local spec's torch LayerNorm
    refuses it without Apex or Transformer Engine."""
    import modelopt.torch.distill as mtd
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from modelopt.torch.distill.plugins import megatron as mo

    from topkd.integrations import megatron_fused as mf
    from topkd.integrations import modelopt as tmo

    tp_group = parallel_state.get_tensor_model_parallel_group()
    s, b, real_vocab = 8, 2, 120

    def make(seed, hidden):
        torch.manual_seed(seed)
        cfg = TransformerConfig(num_layers=2, hidden_size=hidden, num_attention_heads=4,
                                tensor_model_parallel_size=tp, use_cpu_initialization=True,
                                attention_dropout=0.0, hidden_dropout=0.0)
        return cfg, GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(),
                             vocab_size=128, max_sequence_length=16)

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, real_vocab, (b, s), generator=g)
    labels = torch.randint(0, real_vocab, (b, s), generator=g)
    position = torch.arange(s).expand(b, s)
    attention = torch.ones(s, s, dtype=torch.bool).tril().logical_not().view(1, 1, s, s)
    loss_mask = (torch.rand(b, s, generator=g) < 0.8).float()

    def masked_sum(x):  # Megatron-LM's post-training _mask_loss, tp_reduce honoured
        x, tp_reduce, _ = x if isinstance(x, tuple) else (x, False, False)
        total = (x.float() * loss_mask).sum()
        if tp_reduce:
            dist.all_reduce(total, group=tp_group)
        return total

    runs = {}
    for fused in (False, True):
        t_cfg, teacher = make(2, 64)
        s_cfg, student = make(1, 32)
        cls = tmo.FusedTopKLogitsKLLoss if fused else tmo.TopKLogitsKLLoss
        cfg = mo.setup_distillation_config(mo.DistillationConfig(
            criterion={("output_layer", "output_layer"): cls(s_cfg, k=16,
                                                             vocab_size=real_vocab)}),
            s_cfg, t_cfg)
        model = mtd.convert(student, mode=[("kd_loss", {
            "teacher_model": teacher, "criterion": cfg.criterion,
            "loss_balancer": cfg.loss_balancer})])
        mo.adjust_distillation_model_for_mcore(model, cfg)
        if fused:
            tmo.fuse_output_layers(model, cfg)
        model.train()
        opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=3e-3)
        curve, first_grads = [], None
        for _ in range(steps):
            opt.zero_grad()
            out = model(ids, position, attention, labels=labels)
            loss = model.compute_kd_loss(student_loss=masked_sum(out),
                                         loss_reduction_fn=masked_sum)["kd_loss"]
            loss.backward()
            if first_grads is None:
                first_grads = {n: model.get_parameter(n).grad.clone() for n in (
                    "output_layer.weight", "embedding.word_embeddings.weight",
                    "decoder.final_layernorm.weight")}
            opt.step()
            curve.append(float(loss))
        model.eval()
        with torch.no_grad():
            eval_out = model(ids, position, attention, labels=labels)
            eval_kd = float(model.compute_kd_loss(student_loss=masked_sum(eval_out),
                                                  loss_reduction_fn=masked_sum)["kd_loss"])
            if fused:
                mf.unfuse_output_layer(model.output_layer)
                check.true("GPT eval", torch.equal(eval_out, model(
                    ids, position, attention, labels=labels)),
                           "in eval the fused student's output layer must make its logits")
        check.true("GPT eval", bool(torch.isfinite(eval_out).all()),
                   "the eval language-model loss is not finite")
        runs[fused] = curve, first_grads, eval_kd
    name = f"GPTModel TP={tp} DistillationModel {steps} steps"
    (logits_curve, logits_grads, logits_eval), (fused_curve, fused_grads, fused_eval) = (
        runs[False], runs[True])
    check.metrics[name] = {"fused KD loss first, last": [fused_curve[0], fused_curve[-1]],
                           "logits KD loss first, last": [logits_curve[0], logits_curve[-1]]}
    check.error(name, "step 0 KD loss, fused vs logits criterion",
                abs(fused_curve[0] - logits_curve[0]) / logits_curve[0], LOSS_RTOL)
    for what, grad in fused_grads.items():
        check.error(name, f"step 0 {what} grad, fused vs logits", grad_error(
            grad, logits_grads[what]), GRAD_TOL)
    check.error(name, "max relative gap of the two KD curves", max(
        abs(f - u) / u for f, u in zip(fused_curve, logits_curve, strict=True)), 1e-3)
    check.error(name, "eval KD loss (the student's logits), fused vs logits criterion",
                abs(fused_eval - logits_eval) / logits_eval, 1e-4)
    check.true(name, fused_curve[-1] < fused_curve[0] / 30,
               f"the KD loss did not fall: {fused_curve[0]:.3g} -> {fused_curve[-1]:.3g}")


def run_errors(tp, rank, check):
    """Each a clear error, raised on every rank before any collective."""
    from modelopt.torch.distill.plugins import megatron as mo

    from topkd import SparseTeacher
    from topkd.integrations import megatron as tmeg
    from topkd.integrations import modelopt as tmo

    config = _config(tp)
    s, b = 6, 2
    logits = torch.randn(s, b, 20)
    teacher = SparseTeacher(torch.zeros(s, b, 3, dtype=torch.long), torch.zeros(s, b, 3),
                            torch.zeros(s, b), 1.0, 40)

    class Model:  # what fuse_output_layers reads
        teacher_model = None

    cases = [
        ("unfused student", lambda: tmo.FusedTopKLogitsKLLoss(config, k=3)((logits, None),
                                                                           (logits, None)),
         TypeError, "fuse_output_layers"),
        ("LM loss kept", lambda: tmo.fuse_output_layers(Model(), mo.DistillationConfig(
            skip_lm_loss=False)), ValueError, "skip_lm_loss=False"),
        ("store batch as [s, b, K]", lambda: tmeg.sparse_kl_loss(logits, teacher,
                                                                  model_config=config),
         ValueError, "give the batch layout [b, s, K]"),
    ]
    # other kernels on the first rank only: the exchange of the widths refuses them everywhere
    from topkd.backends.compiled import compiler_missing
    from topkd.integrations import megatron_fused as mf

    impl = "eager" if rank == 0 else "compile"
    kernels = str(["eager", *["compile"] * (tp - 1)])
    batch_teacher = SparseTeacher(torch.zeros(b, s, 3, dtype=torch.long), torch.zeros(b, s, 3),
                                  torch.zeros(b, s), 1.0, 20 * tp)
    hidden, weight = torch.randn(s, b, 16), torch.randn(20, 16)
    cases += [] if tp == 1 or compiler_missing("cpu") else [
        ("kernels differ: topk_kl_loss", lambda: tmeg.topk_kl_loss(
            logits, logits, 3, model_config=config, impl=impl), ValueError, kernels),
        ("kernels differ: sparse_kl_loss", lambda: tmeg.sparse_kl_loss(
            logits, batch_teacher, model_config=config, impl=impl), ValueError, kernels),
        ("kernels differ: fused_kl_loss", lambda: mf.fused_kl_loss(
            hidden, weight, logits, model_config=config, impl=impl), ValueError, kernels),
    ]
    for name, call, error, words in cases:
        try:
            call()
            check.failures.append(f"[{name}] no error")
        except error as e:
            check.true(name, words in str(e), f"message {e!s} lacks {words!r}")


def worker(rank, world, store_path, result_dir):
    def body(group, failures):
        warnings.filterwarnings("ignore")
        from megatron.core import parallel_state

        parallel_state.initialize_model_parallel(tensor_model_parallel_size=world,
                                                 distributed_timeout_minutes=1)
        cpu_patches()
        metrics: dict = {}
        check = Checker(failures, metrics)
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        try:
            run_errors(world, tp_rank, check)
            run_output_layer(world, tp_rank, check)
            run_store(world, tp_rank, store_path, check)
            run_gpt(world, tp_rank, check)
        finally:
            parallel_state.destroy_model_parallel()
        if rank == 0:
            with open(os.path.join(result_dir, "metrics.json"), "w") as f:
                json.dump(metrics, f, indent=1)

    tp_worker.run_rank(rank, world, result_dir, body)
