"""topkd's fused losses in Megatron-Core's layout: the student's final hidden states and its
output layer's weight shard in, a ``[b, s]`` loss out; the ``[s, b, V/TP]`` student logits are
never made.

Megatron's output layer is a ``ColumnParallelLinear``: every tensor-parallel rank holds a
contiguous shard ``[V/TP, H]`` of the vocabulary's rows. Its input, the final hidden states, is
``[s, b, H]`` on every rank, or ``[s/TP, b, H]`` (this rank's part of the sequence) under
sequence parallelism. The losses here do to the hidden states what that layer does, so that
the gradient reaching the rest of the model is the one its backward gives:

- with sequence parallelism, gather them along ``s`` (:func:`gather_sequence`, Megatron's
  ``gather_from_sequence_parallel_region``) and reduce-scatter their gradient;
- without it, all-reduce their gradient over the tensor-parallel group (the ``allreduce_dgrad``
  of ``ColumnParallelLinear``, Megatron's ``copy_to_tensor_model_parallel_region``).

The weight's (and bias's) gradient is this rank's shard, as the layer's own.

:func:`fuse_output_layer` makes an output layer hand its inputs to these losses instead of
computing logits (see docs/megatron.md for the wiring in ``GPTModel`` and Model-Optimizer's
``DistillationModel``).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MethodType

import torch
import torch.distributed as dist

from .. import parallel
from ..entry import distill_loss
from ..fused import _teacher_k
from ..options import KDOptions
from ..teacher import SparseTeacher
from . import megatron

# torch 2.13 renamed these two (the old names still work there, with a FutureWarning)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = (getattr(dist, "reduce_scatter_single", None)
                          or dist.reduce_scatter_tensor)


@dataclass(frozen=True)
class HeadInputs:
    """What an output layer was given: ``hidden [s, b, H]`` (``[s/TP, b, H]`` when
    ``sequence_parallel``), its ``weight [V/TP, H]`` (the layer's, or the shared embedding
    weight passed as ``weight=``) and ``bias [V/TP]`` or None (None when the layer returns its
    bias apart, ``skip_bias_add``)."""

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None = None
    sequence_parallel: bool = False


class FusedOutput(tuple):
    """A fused output layer's output: ``(logits, bias)`` as ``ColumnParallelLinear`` returns
    it, except that the logits are a NaN placeholder of their shape and dtype that holds one
    element (a zero-stride view); ``head`` is the :class:`HeadInputs` the fused losses take.
    Anything that reads the placeholder's values gets NaN, never a silently wrong number."""

    head: HeadInputs

    def __new__(cls, placeholder: torch.Tensor, bias, head: HeadInputs):
        out = super().__new__(cls, (placeholder, bias))
        out.head = head
        return out


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 0 in forward, reduce-scatter of the gradient in backward: Megatron's
    ``gather_from_sequence_parallel_region`` (``tensor_parallel_output_grad=True``), on the
    tensor's own device (Megatron's allocates on ``torch.cuda.current_device()``)."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        tensor = tensor.contiguous()
        out = tensor.new_empty((tensor.shape[0] * dist.get_world_size(group), *tensor.shape[1:]))
        _all_gather_single(out, tensor, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        out = grad.new_empty((grad.shape[0] // dist.get_world_size(ctx.group), *grad.shape[1:]))
        _reduce_scatter_single(out, grad, group=ctx.group)
        return out, None


def gather_sequence(tensor: torch.Tensor, group) -> torch.Tensor:
    """``[s/TP, ...]`` sequence-parallel parts -> ``[s, ...]`` on every rank, in group order;
    the gradient is summed over the group and each rank gets its part back."""
    if group is None:
        return tensor
    return _GatherSequence.apply(tensor, group)


def _teacher(teacher, seq_batch, tp):
    """``(teacher, its vocabulary width on this rank or None, whether its hidden states are
    to be gathered)``, checked against the student's ``[s, b]`` without any collective."""
    if isinstance(teacher, FusedOutput):
        teacher = teacher.head
    if isinstance(teacher, HeadInputs):
        gather = teacher.sequence_parallel and tp > 1
        expected = (seq_batch[0] // tp if gather else seq_batch[0], seq_batch[1])
        if teacher.hidden.dim() != 3 or tuple(teacher.hidden.shape[:2]) != expected:
            raise ValueError(f"the teacher's hidden states have shape "
                             f"{tuple(teacher.hidden.shape)} (sequence_parallel="
                             f"{teacher.sequence_parallel}), expected [{expected[0]}, "
                             f"{expected[1]}, H] for the student's [s, b] = {list(seq_batch)}")
        return teacher, teacher.weight.shape[0], gather
    if isinstance(teacher, SparseTeacher):
        return megatron.sequence_first(teacher, seq_batch), None, False
    logits = megatron.output_logits("teacher logits", teacher)
    if tuple(logits.shape[:2]) != tuple(seq_batch):
        raise ValueError(f"teacher logits are [s, b] = {list(logits.shape[:2])}, the student's "
                         f"(gathered) hidden states {list(seq_batch)}")
    return logits, logits.shape[-1], False


def _prepare(model_config, hidden, weight, bias, teacher, sequence_parallel, options):
    """``(hidden [s, b, H], reduce_hidden_grad, teacher, group, vocab_size, shards)`` for
    :func:`topkd.distill_loss`. Every check runs before the first gather, on this rank's shapes
    or on numbers gathered from all ranks (the loss's one exchange of them), so a bad input
    raises on every rank."""
    for name, t in (("hidden", hidden), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if hidden.dim() != 3:
        raise ValueError(f"hidden must be the final hidden states [s, b, H] (sequence first; "
                         f"[s/TP, b, H] with sequence parallelism), got shape "
                         f"{tuple(hidden.shape)}")
    tp = megatron.tensor_parallel_size(model_config)
    group = megatron.tensor_parallel_group(model_config)
    if sequence_parallel is None:
        sequence_parallel = bool(getattr(model_config, "sequence_parallel", False))
    sequence_parallel = sequence_parallel and tp > 1  # as ColumnParallelLinear at TP = 1
    seq_batch = (hidden.shape[0] * (tp if sequence_parallel else 1), hidden.shape[1])
    teacher, teacher_width, gather_teacher = _teacher(teacher, seq_batch, tp)
    megatron.check_sequence(model_config, "student hidden states", (*seq_batch, hidden.shape[-1]))
    layout = megatron.vocab_layout(model_config, options.vocab_size)
    widths = {"student weight rows": weight.shape[0]}
    if teacher_width is not None:
        widths["teacher logits"] = teacher_width
    shards = parallel.exchange_shards(group, widths, seq_batch[0] * seq_batch[1], hidden.device,
                                      same=megatron.kernels(options, hidden.device, group))
    megatron.check_widths(layout, shards, tp)
    vocab = layout.vocab_size
    if vocab is None and isinstance(teacher, SparseTeacher):
        vocab = teacher.vocab_size
    if isinstance(teacher, HeadInputs):
        t_hidden = teacher.hidden.detach()
        teacher = (gather_sequence(t_hidden, group) if gather_teacher else t_hidden,
                   teacher.weight.detach(), None if teacher.bias is None else teacher.bias.detach())
    shards = megatron._loss_shards(shards)
    if sequence_parallel:  # gathered along s; the gradient is reduce-scattered back
        return gather_sequence(hidden, group), False, teacher, group, vocab, shards
    # replicated on every rank: the partial gradients of the vocabulary shards are summed
    return hidden, group is not None, teacher, group, vocab, shards


def _sequence_loss(weight, bias, options: KDOptions, prepared, topk: bool) -> torch.Tensor:
    """The fused loss of the prepared inputs, ``[b, s]`` contiguous; ``topk``: a Top-K loss,
    whose ``k`` only a SparseTeacher may leave out."""
    hidden, reduce_grad, teacher, group, vocab, shards = prepared
    options = options.replace(vocab_size=vocab, process_group=group,
                              reduce_hidden_grad=reduce_grad)
    if topk:
        options = _teacher_k(options, teacher)
    loss = distill_loss((hidden, weight, bias), teacher, options, shards=shards)
    return loss.transpose(0, 1).contiguous()


def fused_topk_kl_loss(hidden: torch.Tensor, weight: torch.Tensor, teacher, k: int | None = None,
                       *, model_config, bias: torch.Tensor | None = None,
                       sequence_parallel: bool | None = None, **options) -> torch.Tensor:
    """:func:`topkd.fused_topk_kl_loss` of a Megatron output layer: the same loss as
    :func:`topkd.integrations.megatron.topk_kl_loss` on that layer's logits, without them.

    Args:
        hidden: the student's final hidden states ``[s, b, H]``, or this rank's ``[s/TP, b,
            H]`` with sequence parallelism (float32/bfloat16/float16).
        weight: the output layer's weight shard ``[V/TP, H]`` (``output_layer.weight``, or
            the shared embedding weight GPTModel passes as ``weight=``).
        teacher: teacher logits ``[s, b, V/TP]`` or ``ColumnParallelLinear``'s ``(logits,
            bias)``; the teacher's output-layer inputs (:class:`HeadInputs` or a
            :class:`FusedOutput` of :func:`fuse_output_layer`), whose logits are made block by
            block under no grad; or a :class:`~topkd.SparseTeacher` ``[b, s, K]`` (an offline
            store; ``k``, ``top_p`` and the temperature are its own).
        k: teacher entries kept individually (the rest: the exact ghost bucket with the
            default ``normalize="full"``; ``"topk"`` is Model-Optimizer 0.47's loss).
        model_config: the student's ``TransformerConfig``: ``tensor_model_parallel_size``
            (the group is ``parallel_state``'s when > 1), ``sequence_parallel``, and where
            present ``vocab_size``, ``should_pad_vocab``, ``make_vocab_size_divisible_by``,
            ``seq_length`` (see :mod:`topkd.integrations.megatron`).
        bias: the layer's bias shard ``[V/TP]``, or None.
        sequence_parallel: whether ``hidden`` is sequence-sharded (default: the config's;
            ignored at TP = 1, as ``ColumnParallelLinear`` ignores it).
        options: ``top_p``, ``top_p_min_k``, ``temperature``, ``divergence``, ``reverse``,
            ``normalize``, ``vocab_size``, ``chunk_bytes``, ``impl``, as in
            :func:`topkd.integrations.megatron.topk_kl_loss`.

    Returns:
        float32 ``[b, s]`` (the whole sequence), identical on every tensor-parallel rank: the
        contract of the logits criteria (``tp_reduce=False``, ``is_sequence_parallel=False``).
        The gradients of ``hidden``, ``weight`` and ``bias`` are those of the layer's own
        backward. No ``T**2`` factor.
    """
    options = KDOptions.of(options, allowed=megatron.TOPK_OPTIONS, k=k)
    prepared = _prepare(model_config, hidden, weight, bias, teacher, sequence_parallel,
                        options)
    return _sequence_loss(weight, bias, options, prepared, topk=True)


def fused_kl_loss(hidden: torch.Tensor, weight: torch.Tensor, teacher, *, model_config,
                  bias: torch.Tensor | None = None, sequence_parallel: bool | None = None,
                  **options) -> torch.Tensor:
    """:func:`topkd.fused_kl_loss` (the whole vocabulary) of a Megatron output layer; the
    teacher is logits or an output layer's inputs (not a SparseTeacher); everything else as
    in :func:`fused_topk_kl_loss`."""
    options = KDOptions.of(options, allowed=megatron.KL_OPTIONS)
    if isinstance(teacher, SparseTeacher):
        raise TypeError("fused_kl_loss needs the whole teacher distribution: teacher logits or "
                        "the teacher's output-layer inputs; use fused_topk_kl_loss for a "
                        "SparseTeacher")
    prepared = _prepare(model_config, hidden, weight, bias, teacher, sequence_parallel,
                        options)
    return _sequence_loss(weight, bias, options, prepared, topk=False)


@torch.no_grad()
def teacher_logits(teacher, model_config):
    """Teacher logits ``[s, b, V/TP]``, made from the teacher's :class:`HeadInputs` (or
    :class:`FusedOutput`) when it is given so, else ``teacher`` as it is. For a loss on the
    student's logits: in eval, where a fused student layer makes them."""
    if isinstance(teacher, FusedOutput):
        teacher = teacher.head
    if not isinstance(teacher, HeadInputs):
        return teacher
    hidden = teacher.hidden
    if teacher.sequence_parallel and megatron.tensor_parallel_size(model_config) > 1:
        hidden = gather_sequence(hidden, megatron.tensor_parallel_group(model_config))
    return torch.nn.functional.linear(hidden, teacher.weight, teacher.bias)


def head_inputs(name: str, output) -> HeadInputs:
    """The :class:`HeadInputs` of a fused output layer's output (what Model-Optimizer's hook
    captured), or a clear error when the layer was not fused."""
    if isinstance(output, FusedOutput):
        return output.head
    if isinstance(output, HeadInputs):
        return output
    got = (f"a tuple starting with {type(output[0]).__name__}"
           if isinstance(output, tuple) and output else type(output).__name__)
    raise TypeError(
        f"{name}: a fused criterion takes the output layer's inputs, got {got}: call "
        f"topkd.integrations.modelopt.fuse_output_layers(model, distill_cfg) (or "
        f"topkd.integrations.megatron_fused.fuse_output_layer) after "
        f"adjust_distillation_model_for_mcore, or use the logits criterion")


def fuse_output_layer(layer, *, training_only: bool = True):
    """Make a ``ColumnParallelLinear`` output layer return a :class:`FusedOutput` (a NaN
    placeholder for the logits, and its inputs) instead of computing the logits.

    ``training_only``: do so only while ``layer.training`` (a student: in eval its logits are
    made as usual, for the validation loss); ``False`` always (a teacher, which
    Model-Optimizer keeps in eval). The layer's parameters, state dict and checkpoints are
    unchanged; :func:`unfuse_output_layer` restores it.

    The model must not use the placeholder: give ``GPTModel`` its ``labels`` (then it computes
    the language-model loss, which Model-Optimizer's ``adjust_distillation_model_for_mcore``
    replaces by zeros in training for ``skip_lm_loss=True``, and always for the teacher)."""
    if not all(hasattr(layer, a) for a in ("skip_bias_add", "sequence_parallel", "tp_group")):
        raise TypeError(f"fuse_output_layer needs Megatron's ColumnParallelLinear, got "
                        f"{type(layer).__name__}")

    def forward(self, input_, weight=None, runtime_gather_output=None):
        if training_only and not self.training:
            return type(self).forward(self, input_, weight=weight,
                                      runtime_gather_output=runtime_gather_output)
        weight = self.weight if weight is None else weight
        if weight is None:
            raise RuntimeError("weight was not supplied to the output layer and it has none "
                               "(skip_weight_param_allocation)")
        bias = None if self.skip_bias_add else self.bias
        sequence_parallel = bool(self.sequence_parallel)
        tp = dist.get_world_size(self.tp_group) if self.tp_group is not None else 1
        gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
        shape = (input_.shape[0] * (tp if sequence_parallel else 1), input_.shape[1],
                 weight.shape[0] * (tp if gather else 1))
        dtype = torch.promote_types(input_.dtype, weight.dtype)
        placeholder = torch.full((), float("nan"), dtype=dtype,
                                 device=input_.device).expand(shape)
        return FusedOutput(placeholder, self.bias if self.skip_bias_add else None,
                           HeadInputs(input_, weight, bias, sequence_parallel))

    layer.forward = MethodType(forward, layer)
    return layer


def unfuse_output_layer(layer):
    """Undo :func:`fuse_output_layer`."""
    layer.__dict__.pop("forward", None)
    return layer

