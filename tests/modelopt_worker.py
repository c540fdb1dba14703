"""Body of test_modelopt.py's tensor-parallel tests, run in spawned gloo ranks whose
tensor-parallel group is megatron-core's ``parallel_state``.

Every rank builds the same full ``[s, b, V]`` inputs from a fixed seed and compares the
Model-Optimizer-facing criteria (``topkd.integrations.modelopt``) on its vocabulary shard with
the same criteria in one process (a TP = 1 config, the whole vocabulary), with the float64
reference (tests/reference.py), and with Model-Optimizer 0.47's own losses. Failures go to the
rank's result file (tp_worker.run_rank); rank 0 also writes the measured agreement to
``metrics_tp<TP>.json`` for the test to print.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

_HERE = os.path.dirname(os.path.abspath(__file__))
for _p in (_HERE, os.path.dirname(_HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import modelopt.torch.distill as mtd  # noqa: E402
import reference  # noqa: E402
import tp_worker  # noqa: E402
from megatron.core import parallel_state, tensor_parallel  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402
from megatron.core.transformer.module import MegatronModule  # noqa: E402
from modelopt.torch.distill.plugins import megatron as mo  # noqa: E402

from topkd.integrations import megatron as tmeg  # noqa: E402
from topkd.integrations import modelopt as tmo  # noqa: E402

ONE_PROCESS_RTOL = 1e-6  # TP loss vs one process (of the batch's loss scale)
ONE_PROCESS_GRAD = 1e-5  # gradient shard vs one process, of max |gradient|
REF_RTOL = 1e-5  # loss vs float64, of the batch's loss scale
REF_GRAD = 1e-5  # gradient vs float64, of max |reference gradient|
PEER_RTOL = 1e-5  # topkd vs Model-Optimizer 0.47 on the same inputs

S, B = 5, 3  # [s, b]: unequal, so a transposed layout cannot pass unnoticed


@dataclass
class ProviderConfig(TransformerConfig):
    """The vocabulary and sequence fields that Megatron-Bridge's GPTModelProvider adds to
    TransformerConfig."""

    vocab_size: int | None = None
    should_pad_vocab: bool = False
    make_vocab_size_divisible_by: int = 128
    seq_length: int = 1024


def megatron_config(tp: int, **fields) -> TransformerConfig:
    """A student config: Megatron-Core's own, or with ``fields`` a Bridge-style provider."""
    cls = ProviderConfig if fields else TransformerConfig
    return cls(num_layers=1, hidden_size=24, num_attention_heads=6,
               tensor_model_parallel_size=tp, use_cpu_initialization=True, **fields)


def inputs(width: int, seed: int):
    """Student and teacher logits ``[s, b, width]`` float32 and an upstream gradient ``[b, s]``,
    the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    student = (torch.randn(S, B, width, generator=g, dtype=torch.float64) * 2).float()
    teacher = (torch.randn(S, B, width, generator=g, dtype=torch.float64) * 2.5).float()
    return student, teacher, torch.randn(B, S, generator=g)


def scaled_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """max |x - ref| over the batch's loss scale, per row: max(|ref|, mean |ref|) (a row's own
    KL can be a small sum of cancelling terms; see tp_worker._compare)."""
    r = ref.double()
    scale = torch.maximum(r.abs(), r.abs().mean()).clamp_min(1e-30)
    return float(((x.double() - r).abs() / scale).max())


def grad_error(g: torch.Tensor, ref: torch.Tensor, ref_scale: float) -> float:
    return float((g.double() - ref.double()).abs().max()) / max(ref_scale, 1e-30)


def run_criterion(criterion, student, teacher, gout, as_tuple=False):
    """``(loss [b, s], flags, student gradient)`` of a Megatron-plugin criterion's forward and
    a backward with ``gout``."""
    leaf = student.detach().clone().requires_grad_(True)
    pred, targ = (leaf, None), (teacher, None)
    out = criterion(*((pred, targ) if as_tuple else (leaf, teacher)))
    loss, *flags = out
    loss.backward(gout)
    return loss.detach(), tuple(flags), leaf.grad


class Checker:
    def __init__(self, failures, metrics):
        self.failures, self.metrics = failures, metrics

    def error(self, name: str, what: str, value: float, bound: float) -> None:
        self.metrics.setdefault(name, {})[what] = value
        if not value <= bound:
            self.failures.append(f"[{name}] {what} = {value:.3e} > {bound}")

    def true(self, name: str, cond: bool, message: str) -> None:
        if not cond:
            self.failures.append(f"[{name}] {message}")


def same_on_all_ranks(x: torch.Tensor) -> bool:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return all(torch.equal(p, parts[0]) for p in parts)


def _shard(x, sizes, rank):
    start = sum(sizes[:rank])
    return x[..., start:start + sizes[rank]]


# (name, class name, options, inputs as (logits, bias) tuples); k=12 is more than a shard holds
CASES = [
    ("TopK k=12", "TopKLogitsKLLoss", dict(k=12), False),
    ("TopK k=5 topk reverse T=1.3 tuple", "TopKLogitsKLLoss",
     dict(k=5, normalize="topk", reverse=True, temperature=1.3), True),
    ("TopK k=7 top_p=0.8 jsd", "TopKLogitsKLLoss",
     dict(k=7, top_p=0.8, top_p_min_k=2, divergence="jsd"), False),
    ("LogitsKL T=2 tuple", "LogitsKLLoss", dict(temperature=2.0), True),
    ("LogitsKL reverse chunk_bytes=1", "LogitsKLLoss", dict(reverse=True, chunk_bytes=1), False),
]


def _reference(cls_name, student, teacher, gout, vocab_size, options):
    """float64 loss ``[b, s]`` and student gradient ``[s, b, W]`` from tests/reference.py."""
    opts = {n: v for n, v in options.items() if n != "chunk_bytes"}
    if cls_name == "TopKLogitsKLLoss":
        k = opts.pop("k")
        fn = lambda z, t: reference.topk_loss(z, t, k, vocab_size=vocab_size, **opts)  # noqa: E731
    else:
        fn = lambda z, t: reference.full_loss(z, t, vocab_size=vocab_size, **opts)  # noqa: E731
    loss, grad = reference.loss_and_grad(fn, student, teacher, grad_output=gout.t())
    return loss.t(), grad


def run_layout(tp, rank, width, sizes, vocab_size, config_fields, check, seed=0):
    """Every criterion case on one vocabulary layout: TP against one process and float64."""
    tag = f"TP={tp} W={width} shards={sizes} vocab_size={vocab_size}" + (
        " (from config)" if config_fields else "")
    config = megatron_config(tp, **config_fields)
    one = megatron_config(1, **{**config_fields, "make_vocab_size_divisible_by": width}
                          if config_fields.get("should_pad_vocab") else config_fields)
    student, teacher, gout = inputs(width, seed)
    s_r, t_r = _shard(student, sizes, rank), _shard(teacher, sizes, rank)
    for name, cls_name, options, as_tuple in CASES:
        name = f"{tag} {name}"
        opts = dict(options)
        if vocab_size is not None and not config_fields:
            opts["vocab_size"] = vocab_size
        cls = getattr(tmo, cls_name)
        loss_tp, flags, grad_tp = run_criterion(cls(config, **opts), s_r, t_r, gout, as_tuple)
        loss_1, _, grad_1 = run_criterion(cls(one, **opts), student, teacher, gout, as_tuple)
        check.true(name, flags == (False, False), f"flags {flags}, expected (False, False)")
        check.true(name, loss_tp.shape == (B, S) and loss_tp.dtype == torch.float32
                   and loss_tp.is_contiguous(),
                   f"loss {tuple(loss_tp.shape)} {loss_tp.dtype}, expected float32 [b, s]")
        check.true(name, same_on_all_ranks(loss_tp), "ranks returned different losses")
        check.error(name, "loss vs one process", scaled_error(loss_tp, loss_1), ONE_PROCESS_RTOL)
        g1 = _shard(grad_1, sizes, rank)
        check.error(name, "grad vs one process",
                    grad_error(grad_tp, g1, float(grad_1.abs().max())), ONE_PROCESS_GRAD)
        ref_loss, ref_grad = _reference(cls_name, student, teacher, gout, vocab_size, options)
        check.error(name, "loss vs float64", scaled_error(loss_tp, ref_loss), REF_RTOL)
        check.error(name, "grad vs float64",
                    grad_error(grad_tp, _shard(ref_grad, sizes, rank),
                               float(ref_grad.abs().max())), REF_GRAD)
        if vocab_size is not None and vocab_size < width:
            pad = grad_1[..., vocab_size:]
            check.true(name, bool((pad == 0).all()), "padding columns got a gradient")


def mask_loss(output, loss_mask, tp_group):
    """Megatron-LM's ``megatron/post_training/loss_func.py::_mask_loss`` (megatron-core does
    not ship it): unpack BaseLoss's (loss, tp_reduce, is_sequence_parallel), mask, sum, and
    all-reduce over tensor parallelism when asked."""
    if isinstance(output, tuple):
        output, tp_reduce, is_sequence_parallel = output
    else:
        tp_reduce, is_sequence_parallel = False, False
    if is_sequence_parallel:
        idx = dist.get_rank(tp_group)
        loss_mask = torch.tensor_split(loss_mask, dist.get_world_size(tp_group), dim=1)[idx]
    loss = torch.sum(output.view(-1).float() * loss_mask.reshape(-1).float())
    if tp_reduce or is_sequence_parallel:
        dist.all_reduce(loss, group=tp_group)
    return loss


def run_peers(tp, rank, check):
    """topkd against Model-Optimizer 0.47's own losses on the same [s, b, V/TP] inputs."""
    width, k = 40, 6
    sizes = [width // tp] * tp
    config = megatron_config(tp)
    student, teacher, gout = inputs(width, seed=7)
    s_r, t_r = _shard(student, sizes, rank), _shard(teacher, sizes, rank)
    for reverse, temperature in ((False, 1.0), (True, 1.7)):
        name = f"peer TP={tp} TopK k={k} reverse={reverse} T={temperature}"
        ours, _, g_ours = run_criterion(
            tmo.TopKLogitsKLLoss(config, k=k, normalize="topk", reverse=reverse,
                                 temperature=temperature), s_r, t_r, gout)
        theirs, flags, g_theirs = run_criterion(
            mo.TopKLogitsKLLoss(config, temperature=temperature, reverse=reverse, top_k=k),
            s_r, t_r, gout)
        check.true(name, flags == (False, False), f"Model-Optimizer's flags are {flags}")
        check.error(name, "topk vs Model-Optimizer", scaled_error(ours, theirs), PEER_RTOL)
        # Model-Optimizer's gradient is TP times the loss's own: its all_gather (torch.
        # distributed.nn) sums in backward the gradients of the same loss held by every rank.
        # topkd's equals the float64 gradient (run_layout); here it is TP x topkd's.
        check.error(name, f"Model-Optimizer grad vs {tp} x topkd grad",
                    grad_error(tp * g_ours, g_theirs, float(g_theirs.abs().max())), PEER_RTOL)

    # normalize="full" differs from Model-Optimizer exactly by the ghost bucket: with Q the
    # teacher's kept mass and P the student's, q_g = 1 - Q, p_g = 1 - P,
    # full = Q * topk + Q log(Q / P) + q_g log(q_g / p_g).
    name = f"ghost TP={tp} TopK k={k}"
    full, _, _ = run_criterion(tmo.TopKLogitsKLLoss(config, k=k), s_r, t_r, gout)
    theirs, _, _ = run_criterion(mo.TopKLogitsKLLoss(config, top_k=k), s_r, t_r, gout)
    ref_full = reference.topk_loss(student, teacher, k).t()
    ref_topk = reference.topk_loss(student, teacher, k, normalize="topk").t()
    check.error(name, "topkd full vs float64 full", scaled_error(full, ref_full), REF_RTOL)
    check.error(name, "Model-Optimizer vs float64 topk", scaled_error(theirs, ref_topk),
                REF_RTOL)
    sel = reference.select(teacher, k)
    lq, lp, _ = reference.buckets(student, sel["kept"], sel["logq"], sel["lead"])
    qg, pg = lq[:, -1].exp(), lp[:, -1].exp()
    big_q, big_p = 1 - qg, 1 - pg
    ghost = (big_q * (big_q / big_p).log() + qg * (qg / pg).log()).reshape(S, B).t()
    predicted = (big_q.reshape(S, B).t() * theirs.double() + ghost)
    check.error(name, "full - (Q * Model-Optimizer + ghost terms)",
                scaled_error(full, predicted), REF_RTOL)
    diff = (full.double() - theirs.double())
    check.metrics[name]["per-token full - topk (min, max)"] = [float(diff.min()),
                                                              float(diff.max())]
    check.true(name, float((ref_full - ref_topk).abs().max()) > 1e-2,
               "the ghost bucket should change the loss visibly here")

    # LogitsKLLoss: Model-Optimizer's returns each rank's partial sum with tp_reduce=True,
    # topkd's the whole loss with tp_reduce=False; through Megatron's loss function they agree.
    name = f"peer TP={tp} LogitsKL T=1.5 via mask_loss"
    loss_mask = (torch.arange(B * S).reshape(B, S) % 4 != 1).float()
    tp_group = parallel_state.get_tensor_model_parallel_group()
    values, grads = [], []
    for crit in (tmo.LogitsKLLoss(config, temperature=1.5),
                 mo.LogitsKLLoss(config, temperature=1.5)):
        leaf = s_r.detach().clone().requires_grad_(True)
        value = mask_loss(crit(leaf, t_r), loss_mask, tp_group)
        value.backward()
        values.append(value.detach())
        grads.append(leaf.grad)
    check.error(name, "masked sum vs Model-Optimizer", scaled_error(values[0], values[1]),
                PEER_RTOL)
    check.error(name, "grad vs Model-Optimizer",
                grad_error(grads[0], grads[1], float(grads[1].abs().max())), PEER_RTOL)


class TinyLM(MegatronModule):
    """An embedding and Megatron's ColumnParallelLinear output layer (bias-free, vocabulary
    sharded over the TP group), returning the output layer's [s, b, V/TP] logits."""

    def __init__(self, config, vocab: int, hidden: int):
        super().__init__(config)
        self.embedding = torch.nn.Embedding(vocab, hidden)
        self.output_layer = tensor_parallel.ColumnParallelLinear(
            hidden, vocab, config=config, init_method=config.init_method, bias=False,
            gather_output=False)

    def forward(self, input_ids):
        logits, _ = self.output_layer(self.embedding(input_ids).transpose(0, 1))
        return logits


def tiny_lm(config, vocab: int, hidden: int, seed: int) -> TinyLM:
    torch.manual_seed(seed)  # the same master weights on every rank (CPU initialization)
    return TinyLM(config, vocab, hidden)


def run_balancer(tp, rank, check):
    """Model-Optimizer's Megatron distillation path with topkd's criterion: DistillationConfig,
    setup_distillation_config (LogitsAndIntermediatesLossBalancer), mtd.convert,
    adjust_distillation_model_for_mcore, compute_kd_loss with Megatron's masked reduction;
    with and without the language-model loss."""
    real_vocab, hidden, k = 37, 8, 5
    config = megatron_config(tp, vocab_size=real_vocab, should_pad_vocab=True,
                             make_vocab_size_divisible_by=20 // tp, seq_length=S)
    padded = tmeg.vocab_layout(config).padded
    tp_group = parallel_state.get_tensor_model_parallel_group()
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, real_vocab, (B, S), generator=g)
    labels = torch.randint(0, real_vocab, (B, S), generator=g)
    loss_mask = (torch.rand(B, S, generator=g) < 0.7).float()
    teacher, student = (lambda: tiny_lm(config, padded, hidden, seed=2),
                        lambda: tiny_lm(config, padded, hidden, seed=1))

    def lm_loss(logits):
        """Megatron's per-token cross-entropy ``[b, s]``. It overwrites float32 logits in place
        (a model's bf16 logits it copies first), and the KD criterion reads them afterwards."""
        ce = tensor_parallel.vocab_parallel_cross_entropy(logits.clone(),
                                                          labels.t().contiguous())
        return ce.t().contiguous()

    for skip, scale in ((True, 1.0), (False, 0.5)):
        name = f"balancer TP={tp} skip_original_loss={skip} kd_loss_scale={scale}"
        plain = student()  # the same weights, outside Model-Optimizer (a ProcessGroup inside
        # ColumnParallelLinear keeps copy.deepcopy out)
        criterion = {("output_layer", "output_layer"): tmo.TopKLogitsKLLoss(config, k=k)}
        cfg = mo.setup_distillation_config(
            mo.DistillationConfig(criterion=criterion, skip_lm_loss=skip, kd_loss_scale=scale),
            config, config)
        check.true(name, isinstance(cfg.loss_balancer, mo.LogitsAndIntermediatesLossBalancer),
                   f"balancer {type(cfg.loss_balancer).__name__}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = mtd.convert(student(), mode=[("kd_loss", {
                "teacher_model": teacher(), "criterion": cfg.criterion,
                "loss_balancer": cfg.loss_balancer})])
        mo.adjust_distillation_model_for_mcore(model, cfg)
        model.train()
        out = model(ids)
        losses = model.compute_kd_loss(student_loss=mask_loss(lm_loss(out), loss_mask, tp_group),
                                       loss_reduction_fn=lambda x: mask_loss(x, loss_mask,
                                                                             tp_group))
        losses["kd_loss"].backward()

        # the same, written out: topkd's [b, s] loss, masked, balanced by hand
        logits = plain(ids)
        with torch.no_grad():  # frozen as DistillationModel freezes it (the same products)
            t_logits = teacher().requires_grad_(False).eval()(ids)
        kd = mask_loss(tmeg.topk_kl_loss(logits, t_logits, k, model_config=config), loss_mask,
                       tp_group)
        if skip:
            total = kd
        else:
            original = mask_loss(lm_loss(logits), loss_mask, tp_group)
            total = original + scale * kd * (original.detach() / kd.detach())
        total.backward()
        check.error(name, "logits_loss vs topkd", scaled_error(losses["logits_loss"].detach(),
                                                               kd.detach()), 1e-6)
        check.error(name, "kd_loss vs by hand", scaled_error(losses["kd_loss"].detach(),
                                                             total.detach()), 1e-6)
        check.true(name, float(losses["intermediate_loss"]) == 0.0, "an intermediate loss?")
        for what in ("output_layer.weight", "embedding.weight"):
            got = model.get_parameter(what).grad
            want = plain.get_parameter(what).grad
            check.error(name, f"{what} grad vs by hand",
                        grad_error(got, want, float(want.abs().max())), 1e-6)


def run_bad_inputs(tp, rank, check):
    """Each bad input raises the same clear error on every rank (no rank left waiting)."""
    width = 40
    sizes = [width // tp] * tp
    student, teacher, _ = inputs(width, seed=3)
    s_r, t_r = _shard(student, sizes, rank), _shard(teacher, sizes, rank)
    bridge = megatron_config(tp, vocab_size=37, should_pad_vocab=True,
                             make_vocab_size_divisible_by=20 // tp, seq_length=S)
    plain = megatron_config(tp)
    cases = [
        ("[b, s, V] vs seq_length", tmo.TopKLogitsKLLoss(bridge, k=4),
         (student.transpose(0, 1), teacher.transpose(0, 1)), ValueError,
         "looks like [b, s, V]"),
        ("[s, b, V] full vocabulary on every rank", tmo.LogitsKLLoss(
            megatron_config(tp, vocab_size=37, should_pad_vocab=True,
                            make_vocab_size_divisible_by=20 // tp)),
         (student, teacher), ValueError,
         "whole padded vocabulary" if tp > 1 else None),
        ("[b, s, V/TP] vs seq_length", tmo.LogitsKLLoss(bridge),
         (s_r.transpose(0, 1), t_r.transpose(0, 1)), ValueError, "looks like [b, s, V]"),
        ("vocab_size past the padded vocabulary", tmo.LogitsKLLoss(plain, vocab_size=45),
         (s_r, t_r), ValueError, "larger than the padded vocabulary"),
        ("tuple without a tensor first", tmo.TopKLogitsKLLoss(plain, k=4),
         ((None, s_r), (t_r, None)), TypeError, "logits tensor first"),
    ]
    for name, crit, args, error, words in cases:
        name = f"bad input TP={tp}: {name}"
        if words is None:  # one process: the whole vocabulary is the right input
            continue
        try:
            crit(*args)
            check.failures.append(f"[{name}] no error")
        except error as e:
            check.true(name, words in str(e), f"message {e!s} lacks {words!r}")
        except Exception as e:  # noqa: BLE001  (e.g. a gloo timeout: a rank was left waiting)
            check.failures.append(f"[{name}] {type(e).__name__}: {e}")


def run_group_size(tp, check):
    """A config whose tensor_model_parallel_size is not parallel_state's."""
    crit = tmo.LogitsKLLoss(megatron_config(tp + 1))
    x = torch.randn(S, B, 8)
    try:
        crit(x, x)
        check.failures.append("[group size] no error")
    except ValueError as e:
        check.true("group size", "tensor-parallel group has" in str(e), str(e))


def worker(rank, world, plan, result_dir):
    """``plan``: ``[(tp, [(width, shard sizes, vocab_size, config fields), ...], extras)]``;
    ``extras`` names the runs beyond the layouts ("peers", "balancer", "bad_inputs",
    "group_size")."""

    def body(group, failures):
        warnings.filterwarnings("ignore")
        for tp, layouts, extras in plan:
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                                     distributed_timeout_minutes=1)
            metrics: dict = {}
            check = Checker(failures, metrics)
            tp_rank = parallel_state.get_tensor_model_parallel_rank()
            try:
                for width, sizes, vocab_size, fields in layouts:
                    run_layout(tp, tp_rank, width, sizes, vocab_size, fields, check)
                if "peers" in extras:
                    run_peers(tp, tp_rank, check)
                if "balancer" in extras:
                    run_balancer(tp, tp_rank, check)
                if "bad_inputs" in extras:
                    run_bad_inputs(tp, tp_rank, check)
                if "group_size" in extras:
                    run_group_size(tp, check)
            finally:
                parallel_state.destroy_model_parallel()
            if rank == 0:
                with open(os.path.join(result_dir, f"metrics_tp{tp}.json"), "w") as f:
                    json.dump(metrics, f, indent=1)

    tp_worker.run_rank(rank, world, result_dir, body)


