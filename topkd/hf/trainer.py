"""Knowledge distillation with the Hugging Face ``Trainer``: :class:`KDConfig` and
:class:`KDTrainer`."""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from transformers import Trainer, TrainingArguments
from transformers.training_args import ParallelMode

from .. import divergences
from ..entry import distill_loss
from ..options import KDOptions
from ..teacher import SampledTeacher, SparseTeacher
from .data import KDCollator
from .models import (
    FinalHidden,
    NonFiniteError,
    embedding_rows,
    fused_head,
    head,
    is_fsdp2,
    nonfinite_rows,
    rows,
    unwrap,
    vocabulary,
)
from .packing import Layout, PackingCheck, learned
from .zero3 import gathered, partitioned, through_head

_SPARSE = ("indices", "logprobs", "rest_logprob")


@dataclass
class KDConfig(TrainingArguments):
    """``TrainingArguments`` plus the distillation settings.

    ``k=None`` distills over the full vocabulary; an int keeps the teacher's top ``k`` (and
    ``top_p``) per row plus the exact ghost bucket (``normalize``: see
    :func:`topkd.topk_kl_loss`). ``divergence`` is a registered name (``"kl"``,
    ``"reverse_kl"``, ``"jsd"`` with ``beta``, ``"skew_kl"`` / ``"skew_reverse_kl"`` with
    ``alpha``, ``"tvd"``, or one added by :func:`topkd.divergences.register`) or a
    :class:`topkd.Divergence` object. ``impl`` chooses the kernels (``"auto"``, ``"eager"``,
    ``"compile"``; see :func:`topkd.topk_kl_loss`).
    The loss is ``kd_weight * KD + ce_weight * CE`` summed over the tokens learned and divided
    by their count over the whole optimizer step (all micro-batches, all ranks).
    ``remove_unused_columns`` defaults to False here: the teacher's keys must reach the batch.
    ``padding_free`` packs each batch into one row (:class:`~topkd.hf.KDCollator`'s
    ``padding_free``).
    """

    k: int | None = field(default=None, metadata={"help": "teacher entries kept per row "
                                                  "(None: the full vocabulary)"})
    top_p: float | None = field(default=None, metadata={"help": "nucleus cut of the top-k"})
    temperature: float | None = field(default=None, metadata={
        "help": "distillation temperature (None: 1, or the store's)"})
    divergence: str = field(default="kl", metadata={
        "help": "a registered name (kl, reverse_kl, jsd, skew_kl, skew_reverse_kl, tvd, ...) "
                "or a topkd.Divergence object"})
    beta: float = field(default=0.5, metadata={"help": "JSD's mixture weight"})
    alpha: float = field(default=0.1, metadata={"help": "skew KL's mixture weight"})
    kd_weight: float = field(default=1.0, metadata={"help": "weight of the KD term"})
    ce_weight: float = field(default=0.0, metadata={"help": "weight of the hard-label CE"})
    normalize: str = field(default="full", metadata={"help": "full or topk"})
    fused: bool = field(default=True, metadata={"help": "never build the [B, T, V] logits"})
    chunk_bytes: int | None = field(default=None, metadata={"help": "the loss's work budget"})
    impl: str = field(default="auto", metadata={"help": "the loss kernels: auto, eager or "
                                                "compile"})
    sharded_head: str = field(default="vocab_parallel", metadata={
        "help": "an FSDP2-sharded LM head (fully_shard, accelerate fsdp_version=2): "
                "vocab_parallel or gather (see docs/scaling.md)"})
    text_field: str = field(default="text", metadata={
        "help": "items with this field and no input_ids are tokenized by processing_class"})
    max_length: int | None = field(default=None, metadata={
        "help": "truncate tokenized text to this many tokens"})
    padding_free: bool = field(default=False, metadata={
        "help": "pack each batch's sequences into one row (position_ids restarting at each), "
                "no padding"})
    remove_unused_columns: bool = False

    def kd_divergence(self) -> divergences.Divergence:
        """The :class:`topkd.Divergence` these settings name."""
        return divergence_of(self.divergence, self.beta, self.alpha)

    def kd_options(self) -> KDOptions:
        """The loss options these settings give (checked: a ValueError or TypeError naming
        the option). The trainer adds, per batch, what the models and the store decide."""
        return KDOptions(k=self.k, top_p=self.top_p, temperature=self.temperature,
                         divergence=self.kd_divergence(), kd_weight=self.kd_weight,
                         ce_weight=self.ce_weight, normalize=self.normalize,
                         chunk_bytes=self.chunk_bytes, impl=self.impl, reduction="sum",
                         sharded_head=self.sharded_head,
                         return_components=True)

    def to_dict(self):
        # a Divergence object is written by its repr (TrainingArguments' JSON and logs)
        d = super().to_dict()
        if isinstance(d.get("divergence"), divergences.Divergence):
            d["divergence"] = repr(d["divergence"])
        return d


class KDTrainer(Trainer):
    """A ``Trainer`` whose loss distills ``teacher`` (a causal LM) or a teacher ``store`` into
    the model.

    Online: ``KDTrainer(model=student, teacher=teacher, args=KDConfig(...),
    train_dataset=..., processing_class=tokenizer)``. Offline: ``store=`` a
    :class:`~topkd.store.TeacherStore` or its path, and items carrying ``sample_id``.
    Dataset items: ``input_ids``, optionally ``attention_mask`` and ``labels`` (see
    :class:`~topkd.hf.KDCollator` for the alignment rule).

    Packed batches (``position_ids`` restarting mid-row: ``padding_free=True``, or
    ``transformers.DataCollatorWithFlattening``): both models get the ``position_ids`` and no
    attention mask, no row learns the next sequence's first token, and each model's attention
    is checked once to keep the sequences apart (a ValueError names an implementation that
    does not; ``sdpa`` and ``eager`` do).

    With ``fused=True`` (default) the student's final hidden states and its output embeddings
    enter the fused loss, and the teacher enters as its ``(hidden, weight)`` pair: neither
    model's ``[B, T, V]`` logits are built. Under ``bf16=True`` / ``fp16=True`` (autocast) the
    hidden states are cast to the autocast dtype, so the products run in it and the float32
    weight's gradient lands in its float32 ``.grad``; with bf16 parameters everything is bf16.
    Tied embeddings receive the head's gradient through the shared Parameter. Softcap and
    logit scale come from each model's config and are checked once against its real logits.
    Under FSDP2 (``fully_shard``; accelerate ``fsdp_version=2``) a head sharded by rows goes to
    the fused loss as the DTensor it is (``KDConfig.sharded_head``); a teacher already wrapped
    by ``fully_shard`` on the same mesh is used as it is (the trainer does not wrap one). Under
    DeepSpeed ZeRO-3 (``KDConfig(deepspeed=...)``) the student's loss runs as the forward of its
    output-embedding module, so DeepSpeed's hooks gather the partitioned head for it and reduce
    its gradient (:mod:`topkd.hf.zero3`); a ZeRO-3 teacher (the engine
    ``deepspeed.initialize`` returns) has its head gathered for the loss. FSDP1 is refused
    with the fused loss (ValueError): use FSDP2 or ``fused=False``.

    ``teacher_tokenizer``: when given (online) its fingerprint must equal the student's
    tokenizer's; a store's recorded fingerprint is checked likewise. The vocabulary is the
    tokenizer's size (a store's: its own); padded head rows beyond it are outside both
    distributions.

    Logs ``kd`` and ``ce`` (per learned token) with the loss; :meth:`evaluate` reports
    ``eval_kl`` (KL(teacher || student) at temperature 1, or at the store's), ``eval_ce`` and
    ``eval_loss`` (the training objective), per token.
    """

    def __init__(self, model=None, args: KDConfig | None = None, *, teacher=None, store=None,
                 teacher_tokenizer=None, data_collator=None, processing_class=None, **kwargs):
        if args is None:
            args = KDConfig(output_dir="topkd-output")
        if not isinstance(args, KDConfig):
            raise TypeError(f"args must be a topkd.hf.KDConfig, got {type(args).__name__}")
        if (teacher is None) == (store is None):
            raise ValueError("give exactly one of teacher= (online) and store= (offline), got "
                             f"teacher={type(teacher).__name__}, store={type(store).__name__}")
        self.options = args.kd_options()
        if store is not None:
            store = _open_store(store)
        _check_text_items(kwargs.get("train_dataset"), args, processing_class)
        if args.fused:  # a head the fused loss cannot take: refused before anything runs
            fused_head(model, "student")
            if teacher is not None:
                fused_head(teacher, "teacher")
        widths = {"student": rows(head(model)[0])}
        if teacher is not None:
            widths["teacher"] = rows(head(teacher)[0])
        self.vocab_size = check_setup(k=args.k, top_p=args.top_p, temperature=args.temperature,
                                      widths=widths, tokenizer=processing_class, store=store,
                                      teacher_tokenizer=teacher_tokenizer,
                                      divergence=self.options.divergence,
                                      normalize=args.normalize)
        self.options = self.options.replace(vocab_size=self.vocab_size)
        if store is not None:  # a store's rows: their K, top-p and temperature are their own
            self.options = self.options.replace(k=None, top_p=None, temperature=None)
        if data_collator is None:
            pad = getattr(processing_class, "pad_token_id", None)
            data_collator = KDCollator(0 if pad is None else pad, store=store,
                                       tokenizer=processing_class, text_field=args.text_field,
                                       max_length=args.max_length,
                                       padding_free=args.padding_free)
        super().__init__(model=model, args=args, data_collator=data_collator,
                         processing_class=processing_class, **kwargs)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 \
                and args.parallel_mode != ParallelMode.DISTRIBUTED:
            # (on CPU, accelerate runs DDP only with use_cpu=True; without it every rank would
            # train its own copy while the token count is summed over all of them)
            raise ValueError(f"a process group of {dist.get_world_size()} ranks is running but "
                             f"the Trainer is not distributed (parallel_mode="
                             f"{args.parallel_mode}); on CPU pass use_cpu=True")
        self.loss_is_scaled_for_ga = True  # the loss is divided by the step's global count
        self.teacher, self.store = teacher, store
        # token ids every model embeds (a larger one is an IndexError deep in the model)
        self._id_limit = min(embedding_rows(m) for m in (self.model, teacher) if m is not None)
        if teacher is not None:
            teacher.eval()  # (separately: a DeepSpeed engine's eval returns None)
            teacher.requires_grad_(False)
            # (a fully_shard or ZeRO-3 teacher is on its mesh's devices)
            if not is_fsdp2(teacher) and not partitioned(head(teacher)[0]):
                teacher.to(self.args.device)
            if _nonfinite_head(teacher):
                raise NonFiniteError("the teacher's output embeddings (its LM head) hold NaN or "
                                     "infinite values")
        self._student_hidden = FinalHidden(self.model) if args.fused else None
        self._teacher_hidden = FinalHidden(teacher) if args.fused and teacher else None
        self._packing = PackingCheck()
        self._warned_empty = False
        self._sums = torch.zeros(3, dtype=torch.float64)  # kd, ce, tokens since the last log

    # -- the loss ------------------------------------------------------------------------------

    def _get_num_items_in_batch(self, batch_samples, device):
        """The tokens learned over the optimizer step: every micro-batch, every rank."""
        count = sum(int(learned(b).sum()) for b in batch_samples)
        count = torch.tensor(count, dtype=torch.int64, device=device)
        if self.args.world_size > 1 and dist.is_available() and dist.is_initialized():
            dist.all_reduce(count)
        if int(count) == 0 and not self._warned_empty:
            self._warned_empty = True
            warnings.warn(f"step {self.state.global_step + 1} learns no token: every label of "
                          f"its batches is -100 past the first position (or each sequence has "
                          f"one token); its loss is 0 and it changes nothing. Warned once per "
                          f"run.", stacklevel=2)
        # a step that learns no token (every label -100) divides its zero sum by 1: 0 / 0
        # would make every gradient, then every parameter, NaN
        return count.clamp_(min=1)

    def train(self, *args, **kwargs):
        """``Trainer.train``, refusing first a training set with nothing to learn."""
        config = self.args
        _check_learnable(self.train_dataset, KDCollator(
            tokenizer=self.processing_class, text_field=config.text_field,
            max_length=config.max_length))
        return super().train(*args, **kwargs)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        parts = self._parts(model, inputs, self.args.ce_weight)
        if num_items_in_batch is None:  # not in a training step: a mean over this batch
            num_items_in_batch, world = max(parts.tokens, 1), 1
        else:
            world = self.accelerator.num_processes  # DDP averages the ranks' gradients
        loss = parts.loss * (world / num_items_in_batch)
        if model.training:
            self._sums += torch.tensor([float(parts.kd), float(parts.ce), parts.tokens],
                                       dtype=torch.float64)
        return (loss, None) if return_outputs else loss

    def _parts(self, model, inputs, ce_weight: float, *, eval_kl: bool = False) -> _Parts:
        """The objective summed over the batch's learned tokens (with ``ce_weight``), its KD
        and CE sums and the token count; with ``eval_kl`` also KL(teacher || student) summed.
        The models run under the run's autocast, the losses outside it."""
        args = self.args
        input_ids = inputs["input_ids"]
        layout = Layout(inputs)
        # (packed rows: the models get the position_ids and no mask; a row whose next token is
        # another sequence's learns nothing)
        attention, positions = layout.attention_mask, layout.position_ids
        keep = layout.learned(inputs["labels"])
        self._check_ids(input_ids, inputs)
        if layout.packed:
            self._packing(model, "student")
            if self.teacher is not None:
                self._packing(self.teacher, "teacher")
        changes = {"ce_weight": ce_weight}
        labels = inputs["labels"][:, 1:][keep] if ce_weight else None
        if self.store is not None:
            teacher = self._stored(inputs, keep)
        if args.fused:
            # refused before any forward (FSDP1 arrives wrapped here, from the Trainer); the
            # heads themselves are read after the forwards, as FSDP leaves them
            fused_head(model, "student")
            if self.store is None:
                fused_head(self.teacher, "teacher")
                with torch.no_grad(), self.accelerator.autocast():
                    t_hidden, probe = self._teacher_hidden(self.teacher, input_ids, attention,
                                                           positions)
                self._check_teacher(nonfinite_rows(t_hidden[:, :-1]), keep, inputs,
                                    "its final hidden states")
                self._teacher_hidden.check(self.teacher, t_hidden, probe)
                t_weight, t_bias = fused_head(self.teacher, "teacher")
                teacher = (t_hidden[:, :-1][keep], t_weight) + (() if t_bias is None
                                                                else (t_bias,))
            with self.accelerator.autocast():
                hidden, probe = self._student_hidden(model, input_ids, attention, positions)
            self._student_hidden.check(model, hidden, probe)
            weight, bias = fused_head(model, "student")  # an FSDP2 DTensor as it is
            student = (hidden[:, :-1][keep], weight, bias)
            changes.update(logit_scale=self._student_hidden.scale,
                           softcap=self._student_hidden.softcap)
            if self.store is None:
                changes.update(teacher_logit_scale=self._teacher_hidden.scale,
                               teacher_softcap=self._teacher_hidden.softcap)
        else:
            if self.store is None:
                with torch.no_grad(), self.accelerator.autocast():
                    teacher = self.teacher(input_ids=input_ids, attention_mask=attention,
                                           position_ids=positions,
                                           use_cache=False).logits[:, :-1]
                self._check_teacher(nonfinite_rows(teacher, logits=True), keep, inputs,
                                    "its logits")
                teacher = teacher[keep]
            with self.accelerator.autocast():
                student = model(input_ids=input_ids, attention_mask=attention,
                                position_ids=positions, use_cache=False).logits[:, :-1][keep]
        options = self.options.replace(**changes)  # checked once per batch

        def losses(student):
            result = distill_loss(student, teacher, options, labels=labels)
            kl = None
            if eval_kl:
                with torch.no_grad():
                    kl = distill_loss(student, teacher, _full_kl(options)).kd
            return result.loss, (result.kd, result.ce, kl)

        # a DeepSpeed ZeRO-3 teacher's head is gathered for the loss; a ZeRO-3 student's
        # loss runs as its head's forward, so ZeRO-3 gathers the head and reduces its gradient
        with gathered(*(teacher[1:] if isinstance(teacher, tuple) else ())):
            if args.fused and partitioned(student[1]):
                loss, (kd, ce, kl) = through_head(
                    unwrap(model).get_output_embeddings(),
                    lambda rows, weight, bias: losses((rows, weight, bias)), student[0])
            else:
                loss, (kd, ce, kl) = losses(student)
        return _Parts(loss, kd, ce, int(keep.sum()), kl)

    def _stored(self, inputs, keep) -> SparseTeacher | SampledTeacher:
        """The batch's stored teacher rows at the learned tokens."""
        teacher = inputs.get("teacher")
        if not isinstance(teacher, (SparseTeacher, SampledTeacher)):
            raise ValueError("the batch has no 'teacher' rows: with store= the data collator "
                             "must attach them (KDCollator does; check remove_unused_columns)")
        teacher = teacher.to(keep.device)
        if teacher.mask is not None and not bool(teacher.mask[:, :-1][keep].all()):
            raise ValueError("a learned token has no stored teacher row (the store's sequence "
                             "is shorter than the tokens): the data and the store are "
                             "misaligned")
        if isinstance(teacher, SampledTeacher):  # ids and counts: nothing non-finite
            return teacher.map(lambda t: t[:, :-1][keep])
        # a stored row's largest log-probability (the ghost's included) is NaN or +inf
        top = torch.maximum(teacher.logprobs[:, :-1].amax(-1), teacher.rest_logprob[:, :-1])
        self._check_teacher(torch.isnan(top) | (top == float("inf")), keep, inputs,
                            "its stored log-probabilities")
        rows = (getattr(teacher, name)[:, :-1][keep] for name in _SPARSE)
        return SparseTeacher(*rows, teacher.temperature, teacher.vocab_size)

    def _where(self, inputs, b: int, t: int = 0) -> str:
        """``step N, batch row b (sample id s)`` for error messages (a packed row: the sample
        at position ``t``)."""
        when = (f"step {self.state.global_step + 1}" if self.model.training
                else "evaluation")
        ids = inputs.get("sample_ids")
        index = Layout(inputs).sequence_of(b, t)
        index = b if index is None else index
        sample = ("" if not ids or index >= len(ids) or ids[index] is None
                  else f" (sample id {ids[index]!r})")
        return f"{when}, batch row {b}{sample}"

    def _check_ids(self, input_ids: torch.Tensor, inputs) -> None:
        """Every token id is one the models embed (else a bare IndexError in the model)."""
        bad = (input_ids < 0) | (input_ids >= self._id_limit)
        if bool(bad.any()):
            b, t = (int(i) for i in bad.nonzero()[0])
            raise ValueError(f"{self._where(inputs, b, t)}, position {t}: token id "
                             f"{int(input_ids[b, t])} is outside the vocabulary (the models "
                             f"embed ids 0 to {self._id_limit - 1}; vocab_size "
                             f"{self.vocab_size})")

    def _check_teacher(self, bad: torch.Tensor, keep: torch.Tensor, inputs, what: str) -> None:
        """Stop on a non-finite teacher row that the loss would use (``bad``, ``keep``: bool
        ``[B, T - 1]``): a NaN target makes NaN gradients, and NaN weights after the step."""
        bad = bad & keep
        if bool(bad.any()):
            b, t = (int(i) for i in bad.nonzero()[0])
            raise NonFiniteError(
                f"{self._where(inputs, b, t)}, position {t}: the teacher gave NaN or infinite "
                f"values ({what}; {int(bad.sum())} row(s) of this batch). Training stopped "
                f"before the optimizer step; check the teacher (its weights, its dtype's range) "
                f"and this sample")

    # -- logging and evaluation ----------------------------------------------------------------

    def log(self, logs: dict, *args, **kwargs) -> None:
        if "loss" in logs:
            sums = self._sums.clone()
            self._sums.zero_()
            # every rank logs the loss, so every rank joins: a rank that learned no token
            # since the last log must not skip the collective (the others would wait on it)
            if self.args.world_size > 1 and dist.is_available() and dist.is_initialized():
                sums = sums.to(self.args.device)
                dist.all_reduce(sums)
                sums = sums.cpu()
            kd, ce, tokens = sums.tolist()
            if tokens > 0:
                logs["kd"] = kd / tokens
                if self.args.ce_weight:
                    logs["ce"] = ce / tokens
        super().log(logs, *args, **kwargs)

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval"):
        """Held-out ``{prefix}_kl`` (KL(teacher || student)), ``{prefix}_ce`` (the student's
        cross-entropy) and ``{prefix}_loss`` (the training objective), each per learned token
        over the whole evaluation set (all ranks)."""
        loader = self.get_eval_dataloader(eval_dataset)
        model = self._wrap_model(self.model, training=False, dataloader=loader)
        model.eval()
        sums = torch.zeros(4, dtype=torch.float64)
        kd_weight, ce_weight = self.args.kd_weight, self.args.ce_weight
        with torch.no_grad():
            for inputs in loader:
                parts = self._parts(model, self._prepare_inputs(inputs), 1.0, eval_kl=True)
                objective = kd_weight * float(parts.kd) + ce_weight * float(parts.ce)
                sums += torch.tensor([float(parts.kl), float(parts.ce), objective,
                                      parts.tokens], dtype=torch.float64)
        if self.args.world_size > 1 and dist.is_available() and dist.is_initialized():
            sums = sums.to(self.args.device)
            dist.all_reduce(sums)
            sums = sums.cpu()
        kl, ce, loss, tokens = sums.tolist()
        tokens = max(tokens, 1.0)
        metrics = {f"{metric_key_prefix}_kl": kl / tokens, f"{metric_key_prefix}_ce": ce / tokens,
                   f"{metric_key_prefix}_loss": loss / tokens}
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control,
                                                         metrics)
        return metrics


@dataclass
class _Parts:
    loss: torch.Tensor
    kd: torch.Tensor
    ce: torch.Tensor
    tokens: int
    kl: torch.Tensor | None = None


def _nonfinite_head(teacher) -> bool:
    """Whether the teacher's head holds a NaN or an infinity (a sharded head: any rank's rows,
    every rank answering alike; a ZeRO-3 head: gathered whole for the check)."""
    from .. import sharded

    bad, group, device = False, None, None
    with gathered(*head(teacher)):
        for t in head(teacher):
            if t is None:
                continue
            if sharded.is_dtensor(t):
                group, t = t.device_mesh.get_group(), t.to_local()
            device = t.device
            bad = bad or (t.numel() > 0
                          and bool(nonfinite_rows(t.detach().reshape(1, -1)).any()))
    if group is not None:
        flag = torch.tensor([float(bad)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        bad = bool(flag.item())
    return bad


def _full_kl(options: KDOptions) -> KDOptions:
    """Evaluation's KL(teacher || student): the full vocabulary at temperature 1 (a store's
    rows: their own temperature, the ghost bucket exact)."""
    return options.replace(k=None, top_p=None, temperature=None, normalize="full",
                           divergence="kl", ce_weight=0.0, kd_weight=1.0)


def check_setup(*, k, top_p, temperature, widths: dict[str, int], tokenizer=None, store=None,
                teacher_tokenizer=None, divergence=None, normalize="full") -> int:
    """What can be checked before any batch: the settings against the teacher (its store,
    or the two models' output rows ``widths`` and their tokenizers). :class:`KDTrainer` runs
    it at construction; ``topkd distill`` from the models' configs, before loading them.
    Returns the vocabulary the distributions live on."""
    if store is not None and getattr(store, "kind", "topk") == "sampled":
        _sampled_store_settings(store, k, top_p, divergence, normalize)
    elif store is not None and k is not None and k != store.k:
        raise ValueError(f"k={k} but the store {store.path} keeps k={store.k}")
    if store is not None:
        if temperature is not None and temperature != store.temperature:
            raise ValueError(f"temperature={temperature} but the store {store.path} was built "
                             f"at temperature={store.temperature}")
        _same_tokenizer(tokenizer, store.manifest.get("tokenizer_fingerprint"),
                        f"the store {store.path}")
        if widths["student"] < store.vocab_size:
            raise ValueError(f"the student has {widths['student']} output rows, fewer than "
                             f"the store's vocabulary {store.vocab_size}")
        return store.vocab_size
    if k is None and top_p is not None:
        raise ValueError(f"top_p={top_p} needs k (the full-vocabulary loss keeps all)")
    fingerprint = None
    if teacher_tokenizer is not None:
        from ..store import tokenizer_fingerprint

        fingerprint = tokenizer_fingerprint(teacher_tokenizer)
    _same_tokenizer(tokenizer, fingerprint, "the teacher's tokenizer")
    vocab = vocabulary(tokenizer, widths)
    if k is not None and k > vocab:
        raise ValueError(f"k={k} is larger than the vocabulary ({vocab} tokens)")
    return vocab


def divergence_of(name, beta: float, alpha: float) -> divergences.Divergence:
    """The :class:`topkd.Divergence` a name (or object) and JSD's ``beta`` / the skews'
    ``alpha`` give (``KDConfig``'s and ``topkd distill``'s settings)."""
    if isinstance(name, divergences.Divergence):
        return name
    if name == "jsd":
        return divergences.JSD(beta=beta)
    if name in ("skew_kl", "skew_reverse_kl"):
        cls = divergences.SkewKL if name == "skew_kl" else divergences.SkewReverseKL
        return cls(alpha=alpha)
    return divergences.resolve(name)


def _sampled_store_settings(store, k, top_p, divergence, normalize) -> None:
    """A store of sampled rows (RS-KD) trains forward KL only, without top-K settings."""
    where = f"the store {store.path} holds {store.samples} sampled tokens per row"
    if k is not None:
        raise ValueError(f"k={k} applies to top-K teachers but {where}; leave k unset")
    if top_p is not None:
        raise ValueError(f"top_p={top_p} applies to top-K teachers but {where}")
    if normalize != "full":
        raise ValueError(f"normalize={normalize!r} applies to top-K teachers but {where}")
    if divergence is not None and not isinstance(divergences.resolve(divergence),
                                                 divergences.KL):
        raise ValueError(f"divergence={divergence!r} cannot be estimated without bias from "
                         f"sampled tokens ({where}); only forward KL (divergence='kl') can")


def _first_item(dataset):
    """The first item of a map-style dataset, or None (empty, iterable, unindexable)."""
    try:
        return dataset[0] if dataset is not None and len(dataset) else None
    except (TypeError, KeyError, IndexError, NotImplementedError):
        return None


def _check_text_items(dataset, args: KDConfig, tokenizer) -> None:
    """Refuse, at construction, text items with no tokenizer to make their ``input_ids``."""
    item = _first_item(dataset)
    if isinstance(item, Mapping) and "input_ids" not in item and args.text_field in item \
            and tokenizer is None:
        raise ValueError(f"the training items have a {args.text_field!r} field and no "
                         f"'input_ids': pass processing_class=<the student's tokenizer> to "
                         f"tokenize them (as topkd distill does), or tokenize the dataset")


def _check_learnable(dataset, collator) -> None:
    """Refuse a map-style training set in which no item has a token to learn (every label
    -100 past the first position, or one token per item): training it would log a loss of 0
    and change nothing. The scan stops at the first item that has one."""
    try:
        size = len(dataset)
    except TypeError:  # an iterable dataset: the per-step warning covers it
        return
    drop = ("teacher", "sample_id")  # the tokens and labels alone: no store reads
    for index in range(size):
        item = dataset[index]
        if isinstance(item, Mapping):
            item = {key: value for key, value in item.items() if key not in drop}
        batch = collator([item])
        if bool((batch["labels"][:, 1:] != -100).any()):
            return
    raise ValueError(f"the training set has nothing to learn: none of its {size} items has a "
                     f"label past its first token (every label is -100, or each item has one "
                     f"token)")


def _open_store(store):
    from ..store import TeacherStore
    from ..store.rows import TeacherRows

    if isinstance(store, (TeacherStore, TeacherRows)):
        return store
    if isinstance(store, (str, os.PathLike)):
        return TeacherStore(store)
    raise TypeError(f"store must be a topkd.store.TeacherStore (or TeacherRows) or a path, got "
                    f"{type(store).__name__}")


def _same_tokenizer(tokenizer, fingerprint: str | None, what: str) -> None:
    """The student's tokenizer must be the one the teacher's rows were made with."""
    if tokenizer is None or fingerprint is None:
        if fingerprint is not None:
            warnings.warn(f"{what} has a tokenizer fingerprint but no processing_class was "
                          f"given to compare it with", stacklevel=3)
        return
    from ..store import tokenizer_fingerprint

    mine = tokenizer_fingerprint(tokenizer)
    if mine != fingerprint:
        raise ValueError(f"the student's tokenizer (fingerprint {mine}) is not {what} "
                         f"({fingerprint}): the two vocabularies differ, so distillation "
                         f"would pair unrelated tokens")


__all__ = ["KDConfig", "KDTrainer", "NonFiniteError", "check_setup"]
