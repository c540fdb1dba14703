"""The Model-Optimizer Megatron-plugin criteria (logits and fused) and
:func:`fuse_output_layers`; import them from :mod:`topkd.integrations.modelopt`, which loads this
module (and megatron-core) on first use."""

from __future__ import annotations

import torch

try:
    from modelopt.torch.distill.plugins.megatron import BaseLoss
except ImportError as e:
    raise ImportError('topkd.integrations.modelopt.TopKLogitsKLLoss / LogitsKLLoss need '
                      'nvidia-modelopt and megatron-core: pip install "topkd[megatron]"') from e

from .. import _checks
from . import megatron, megatron_fused
from .criteria import criterion_options


def topk_options(model_config, k, top_k, options: dict) -> int:
    """The checked ``k`` of a Top-K criterion (``top_k`` is Model-Optimizer's spelling), after
    checking its options against the config; ValueError or TypeError naming the option."""
    if k is not None and top_k is not None:
        raise TypeError(f"give k or top_k (the same option), not both: k={k}, top_k={top_k}")
    k = top_k if k is None else k
    if k is None:
        raise TypeError("a Top-K criterion needs k= (the number of teacher entries kept)")
    criterion_options(options, megatron.TOPK_OPTIONS)
    layout = megatron.vocab_layout(model_config, options.get("vocab_size"))
    megatron.tensor_parallel_size(model_config)
    return _checks.integer("k", k, 1, layout.vocab_size)


def kl_options(model_config, options: dict) -> None:
    """Checks the options of a whole-vocabulary criterion against the config."""
    criterion_options(options, megatron.KL_OPTIONS)
    megatron.vocab_layout(model_config, options.get("vocab_size"))
    megatron.tensor_parallel_size(model_config)


class TopKLogitsKLLoss(BaseLoss):
    """:func:`topkd.topk_kl_loss` as Model-Optimizer's Megatron ``TopKLogitsKLLoss``.

    Args:
        model_config: the student's ``TransformerConfig`` (see
            :func:`topkd.integrations.megatron.topk_kl_loss` for what is read from it).
        k: teacher entries kept individually; ``top_k=`` (Model-Optimizer's spelling) is the
            same. With the default ``normalize="full"`` the rest of the vocabulary is one exact
            ghost bucket; ``normalize="topk"`` is Model-Optimizer 0.47's loss.
        options: ``temperature``, ``divergence``, ``reverse``, ``top_p``, ``top_p_min_k``,
            ``normalize``, ``vocab_size`` (the real vocabulary, default the config's),
            ``chunk_bytes``, ``impl``; checked here, ValueError or TypeError naming the option.

    ``forward(predictions, targets)``: ``[s, b, V/TP]`` logits or ``(logits, bias)`` tuples ->
    ``(loss float32 [b, s], False, False)``, the loss whole on every rank (no ``tp_reduce``).
    No ``T**2`` factor.
    """

    def __init__(self, model_config, k: int | None = None, *, top_k: int | None = None,
                 **options):
        super().__init__(model_config)
        self.k = topk_options(model_config, k, top_k, options)
        self.options = options

    def forward(self, predictions, targets) -> tuple[torch.Tensor, bool, bool]:
        loss = megatron.topk_kl_loss(predictions, targets, self.k, model_config=self._config,
                                     **self.options)
        return self.post_forward(loss.transpose(0, 1), tp_reduce=False,
                                 is_sequence_parallel=False)

    def extra_repr(self) -> str:
        return ", ".join([f"k={self.k}"] + [f"{n}={v!r}" for n, v in self.options.items()])


class LogitsKLLoss(BaseLoss):
    """:func:`topkd.kl_loss` (the whole vocabulary) as Model-Optimizer's Megatron
    ``LogitsKLLoss``; ``model_config``, options and ``forward`` as in
    :class:`TopKLogitsKLLoss` (``temperature``, ``divergence``, ``reverse``, ``vocab_size``,
    ``chunk_bytes``, ``impl``). Unlike Model-Optimizer's, the loss is whole on every rank:
    ``tp_reduce=False``."""

    def __init__(self, model_config, **options):
        super().__init__(model_config)
        kl_options(model_config, options)
        self.options = options

    def forward(self, predictions, targets) -> tuple[torch.Tensor, bool, bool]:
        loss = megatron.kl_loss(predictions, targets, model_config=self._config, **self.options)
        return self.post_forward(loss.transpose(0, 1), tp_reduce=False,
                                 is_sequence_parallel=False)

    def extra_repr(self) -> str:
        return ", ".join(f"{n}={v!r}" for n, v in self.options.items())


def student_logits_in_eval(predictions) -> bool:
    """A fused student's output layer makes its logits in eval (for the validation loss), which
    runs under no grad: a fused criterion then takes them (and the teacher's logits, made from
    its layer's inputs if that one is fused). With grad enabled it needs the layer's inputs:
    logits there mean a layer left unfused (``head_inputs`` says so)."""
    return not torch.is_grad_enabled() and not isinstance(
        predictions, (megatron_fused.FusedOutput, megatron_fused.HeadInputs))


class _FusedCriterion(BaseLoss):
    """The forward of the fused criteria: the loss on the student's output-layer inputs, or on
    its logits under no grad; subclasses supply the two losses."""

    def forward(self, predictions, targets) -> tuple[torch.Tensor, bool, bool]:
        if student_logits_in_eval(predictions):
            loss = self.logits_loss(predictions,
                                    megatron_fused.teacher_logits(targets, self._config))
        else:
            loss = self.head_loss(megatron_fused.head_inputs("student output", predictions),
                                  targets)
        return self.post_forward(loss.transpose(0, 1), tp_reduce=False,
                                 is_sequence_parallel=False)


class FusedTopKLogitsKLLoss(_FusedCriterion):
    """:class:`TopKLogitsKLLoss` on the student's output-layer inputs instead of its logits
    (:func:`topkd.integrations.megatron_fused.fused_topk_kl_loss`): the ``[s, b, V/TP]``
    student logits are never made.

    Keyed like the logits criterion, ``{("output_layer", "output_layer"): ...}``, on a
    ``DistillationModel`` whose output layers :func:`fuse_output_layers` fused: the student's
    output is then a :class:`~topkd.integrations.megatron_fused.FusedOutput` (its hidden
    states, sequence-sharded or not, and its weight shard), the teacher's too, or its ``[s, b,
    V/TP]`` logits when only the student's layer was fused. ``model_config``, ``k`` /
    ``top_k`` and the options as in :class:`TopKLogitsKLLoss`; ``forward`` returns ``(loss
    float32 [b, s], False, False)``. Under no grad (validation, where the fused student makes
    its logits) it computes the same loss from the logits.
    """

    def __init__(self, model_config, k: int | None = None, *, top_k: int | None = None,
                 **options):
        super().__init__(model_config)
        self.k = topk_options(model_config, k, top_k, options)
        self.options = options

    def head_loss(self, head, targets) -> torch.Tensor:
        return megatron_fused.fused_topk_kl_loss(
            head.hidden, head.weight, targets, self.k, model_config=self._config,
            bias=head.bias, sequence_parallel=head.sequence_parallel, **self.options)

    def logits_loss(self, student, teacher) -> torch.Tensor:
        return megatron.topk_kl_loss(student, teacher, self.k, model_config=self._config,
                                     **self.options)

    def extra_repr(self) -> str:
        return ", ".join([f"k={self.k}"] + [f"{n}={v!r}" for n, v in self.options.items()])


class FusedLogitsKLLoss(_FusedCriterion):
    """:class:`LogitsKLLoss` (the whole vocabulary) on the student's output-layer inputs
    (:func:`topkd.integrations.megatron_fused.fused_kl_loss`); wiring, arguments and
    ``forward`` as in :class:`FusedTopKLogitsKLLoss`."""

    def __init__(self, model_config, **options):
        super().__init__(model_config)
        kl_options(model_config, options)
        self.options = options

    def head_loss(self, head, targets) -> torch.Tensor:
        return megatron_fused.fused_kl_loss(
            head.hidden, head.weight, targets, model_config=self._config, bias=head.bias,
            sequence_parallel=head.sequence_parallel, **self.options)

    def logits_loss(self, student, teacher) -> torch.Tensor:
        return megatron.kl_loss(student, teacher, model_config=self._config, **self.options)

    def extra_repr(self) -> str:
        return ", ".join(f"{n}={v!r}" for n, v in self.options.items())


def fuse_output_layers(model, distill_cfg, *, teacher: bool = True):
    """Fuse the output layers of a Model-Optimizer ``DistillationModel`` of Megatron
    ``GPTModel`` s, for :class:`FusedTopKLogitsKLLoss` / :class:`FusedLogitsKLLoss`.

    Call it after ``mtd.convert`` and ``adjust_distillation_model_for_mcore(model,
    distill_cfg)``. In training the student's ``output_layer`` then hands its hidden states and
    weight to the criterion instead of making logits (in eval it makes them, for the
    validation loss); with ``teacher=True`` the teacher's always does (it runs under no grad;
    its logits are made block by block inside the loss). ``GPTModel`` must be called with
    ``labels``, as Megatron's training step does.

    Raises ValueError when the student's language-model loss is kept (``skip_lm_loss=False``
    needs the logits: use the logits criterion) and NotImplementedError for multi-token
    prediction (its heads share the output layer and need their logits).
    """
    if not distill_cfg.skip_lm_loss:
        raise ValueError("fuse_output_layers: skip_lm_loss=False keeps the student's "
                         "language-model loss, which needs its logits; the fused criterion "
                         "would save nothing. Use topkd's TopKLogitsKLLoss / LogitsKLLoss")
    for name, m in (("student", model), ("teacher", model.teacher_model)):
        if getattr(getattr(m, "config", None), "mtp_num_layers", None):
            raise NotImplementedError(f"fuse_output_layers: the {name} has multi-token "
                                      f"prediction layers, which need the output layer's "
                                      f"logits")
    megatron_fused.fuse_output_layer(model.output_layer, training_only=True)
    if teacher:
        megatron_fused.fuse_output_layer(model.teacher_model.output_layer, training_only=False)
    return model
