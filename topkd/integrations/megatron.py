"""topkd's losses in Megatron-Core's layout: ``[s, b, V/TP]`` logits in, a ``[b, s]`` loss out.

Megatron's output layer (``ColumnParallelLinear``) gives each tensor-parallel rank a contiguous
shard of the vocabulary, sequence first, as a ``(logits, bias)`` tuple. The functions here take
that output as it is, find the tensor-parallel group in ``parallel_state`` and the real
vocabulary in the model config, check the shapes against the config, and return the per-token
loss ``[b, s]`` (float32, the same on every rank: no further tensor-parallel reduction), the
layout Megatron's ``loss_mask`` has. :func:`sparse_kl_loss` takes a :class:`~topkd.SparseTeacher`
(an offline store's rows) in Megatron's batch layout ``[b, s, K]`` instead of teacher logits.

Where the config knows it (Megatron-Bridge's model providers, which subclass
``TransformerConfig``): ``vocab_size`` is the real vocabulary, and with ``should_pad_vocab`` the
model pads it to a multiple of ``make_vocab_size_divisible_by x tensor_model_parallel_size``;
``seq_length`` is the sequence length. Megatron-Core's own ``TransformerConfig`` has none of
these, so with it pass ``vocab_size=`` (``args.vocab_size`` of a Megatron-LM run, not its
``padded_vocab_size``) to keep the padding out of both distributions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

try:
    from megatron.core import parallel_state
except ImportError as e:
    raise ImportError('topkd.integrations.megatron needs megatron-core: pip install '
                      '"topkd[megatron]"') from e

from .. import _checks, backends, parallel
from ..entry import distill_loss
from ..options import KDOptions
from ..teacher import SparseTeacher


@dataclass(frozen=True)
class VocabLayout:
    """What the config and options say about the vocabulary.

    ``vocab_size``: the real vocabulary (columns past it are padding, outside both
    distributions), or None for the logits' whole width. ``padded``: the whole padded width the
    config implies (every rank then holds ``padded / TP`` columns), or None where the config
    does not say. ``source``: where ``vocab_size`` came from, for error messages.
    """

    vocab_size: int | None
    padded: int | None
    source: str


def tensor_parallel_size(model_config) -> int:
    return _checks.integer("model_config.tensor_model_parallel_size",
                           getattr(model_config, "tensor_model_parallel_size", 1) or 1, 1)


def padded_vocab_size(vocab_size: int, divisible_by: int, tensor_parallel: int) -> int:
    """Megatron's padding: ``vocab_size`` rounded up to a multiple of ``divisible_by x TP``."""
    multiple = divisible_by * tensor_parallel
    return -(-vocab_size // multiple) * multiple


def vocab_layout(model_config, vocab_size: int | None = None) -> VocabLayout:
    """The real and padded vocabulary from ``vocab_size`` (wins) and the config's
    ``vocab_size`` / ``should_pad_vocab`` / ``make_vocab_size_divisible_by`` where it has them.

    Raises ValueError for a ``vocab_size`` larger than the padded vocabulary the config implies.
    """
    tp = tensor_parallel_size(model_config)
    config_vocab = getattr(model_config, "vocab_size", None)
    padded = None
    if config_vocab is not None:
        config_vocab = _checks.integer("model_config.vocab_size", config_vocab, 1)
        if hasattr(model_config, "should_pad_vocab"):
            padded = config_vocab
            if model_config.should_pad_vocab:
                divisible = _checks.integer(
                    "model_config.make_vocab_size_divisible_by",
                    getattr(model_config, "make_vocab_size_divisible_by", 128), 1)
                padded = padded_vocab_size(config_vocab, divisible, tp)
    if vocab_size is None:
        if config_vocab is None:
            return VocabLayout(None, None, "")
        return VocabLayout(config_vocab, padded, f"model_config.vocab_size={config_vocab}")
    vocab_size = _checks.integer("vocab_size", vocab_size, 1)
    if padded is not None and vocab_size > padded:
        raise ValueError(
            f"vocab_size={vocab_size} is larger than the padded vocabulary {padded} that the "
            f"model config implies (vocab_size={config_vocab}, should_pad_vocab="
            f"{model_config.should_pad_vocab}, tensor_model_parallel_size={tp})")
    return VocabLayout(vocab_size, padded, f"vocab_size={vocab_size}")


def tensor_parallel_group(model_config):
    """``parallel_state``'s tensor-parallel group when the config says TP > 1, else None."""
    tp = tensor_parallel_size(model_config)
    if tp == 1:
        return None
    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError(f"model_config.tensor_model_parallel_size={tp} but megatron.core."
                           f"parallel_state is not initialized (initialize_model_parallel)")
    group = parallel_state.get_tensor_model_parallel_group()
    if dist.get_world_size(group) != tp:
        raise ValueError(f"model_config.tensor_model_parallel_size={tp} but parallel_state's "
                         f"tensor-parallel group has {dist.get_world_size(group)} ranks")
    return group


def output_logits(name: str, output) -> torch.Tensor:
    """The logits of an output layer's output: a tensor, or the ``(logits, bias)`` tuple
    ``ColumnParallelLinear`` returns."""
    if isinstance(output, (tuple, list)):
        if not output or not isinstance(output[0], torch.Tensor):
            first = type(output[0]).__name__ if output else "nothing"
            raise TypeError(f"{name}: a tuple must be ColumnParallelLinear's (logits, bias) with "
                            f"the logits tensor first, got {first} first")
        output = output[0]
    if not isinstance(output, torch.Tensor):
        raise TypeError(f"{name} must be logits [s, b, V/TP] or ColumnParallelLinear's "
                        f"(logits, bias) tuple, got {type(output).__name__}")
    _checks.logits(name, output)
    if output.dim() != 3:
        raise ValueError(f"{name} must be [s, b, V/TP] (Megatron's sequence-first layout), got "
                         f"shape {tuple(output.shape)}")
    return output


def check_sequence(model_config, name: str, shape) -> None:
    """A ``[b, s, ...]`` tensor is refused where the config tells the sequence length."""
    seq = getattr(model_config, "seq_length", None)
    if seq is None or getattr(model_config, "variable_seq_lengths", False):
        return
    expected = seq // (getattr(model_config, "context_parallel_size", 1) or 1)
    if shape[0] != expected and shape[1] == expected:
        raise ValueError(
            f"{name} has shape {tuple(shape)}: its dim 1 is the sequence length {expected} "
            f"(model_config.seq_length={seq}), so it looks like [b, s, V]; Megatron's output "
            f"layer gives [s, b, V/TP] (sequence first), which this loss expects")


def check_widths(layout: VocabLayout, shards: dict, tp: int) -> None:
    """The logits' widths, summed over the group, against the real ``vocab_size`` and (the
    student's, whose config this is) against the padded vocabulary. Every rank checks the same
    gathered numbers."""
    for name, shard in shards.items():
        if (name.startswith("student") and layout.padded is not None
                and (shard.total, shard.widest * tp) != (layout.padded,) * 2):
            hint = (" (every rank holds the whole padded vocabulary: [b, s, V] logits?)"
                    if shard.width == layout.padded and tp > 1 else "")
            raise ValueError(
                f"{name}: the {tp} tensor-parallel ranks hold {shard.total} vocabulary columns "
                f"({shard.width} on this rank), but the model config implies a padded "
                f"vocabulary of {layout.padded} ({layout.padded // tp} per rank): expected "
                f"[s, b, V/TP] logits{hint}")
        if layout.vocab_size is not None and layout.vocab_size > shard.total:
            raise ValueError(
                f"{layout.source} is larger than the padded vocabulary: the {tp} "
                f"tensor-parallel ranks' {name} hold {shard.total} columns in all")


def prepare(model_config, student_logits, teacher_logits, options: KDOptions):
    """Checked ``(student [s, b, V_r], teacher [s, b, V_r], group, vocab_size, shards)`` for
    :func:`topkd.distill_loss`. The checks that need every rank's widths run on the same
    gathered numbers on all ranks (the loss's one exchange of them), so a bad input raises
    everywhere instead of leaving ranks in a collective."""
    student = output_logits("student logits", student_logits)
    teacher = output_logits("teacher logits", teacher_logits)
    if student.shape[:2] != teacher.shape[:2]:
        raise ValueError(f"student and teacher logits must share [s, b], got shapes "
                         f"{tuple(student.shape)} and {tuple(teacher.shape)}")
    check_sequence(model_config, "student logits", student.shape)
    layout = vocab_layout(model_config, options.vocab_size)
    group = tensor_parallel_group(model_config)
    shards = parallel.exchange_shards(group, {"student logits": student.shape[-1],
                                              "teacher logits": teacher.shape[-1]},
                                      student.shape[:2].numel(), student.device,
                                      same=kernels(options, student.device, group))
    check_widths(layout, shards, tensor_parallel_size(model_config))
    return student, teacher, group, layout.vocab_size, _loss_shards(shards)


def kernels(options: KDOptions, device, group) -> dict:
    """:func:`topkd.parallel.exchange_shards`'s ``same`` for a loss with ``options`` on
    ``device`` in ``group``: every rank must run the same kernels (a compiler missing here
    raises in the loss, after the exchange, on every rank) and the same options."""
    return backends.across_ranks(backends.choose(options.impl, device, group), options)


def _loss_shards(shards: dict) -> dict:
    """The shards named as :func:`topkd.distill_loss` takes them."""
    return {name.split()[0]: shard for name, shard in shards.items()}


def _sequence_loss(student, teacher, options: KDOptions, shards) -> torch.Tensor:
    """The per-token loss ``[s, b]`` -> Megatron's ``[b, s]``, contiguous."""
    loss = distill_loss(student, teacher, options, shards=shards)
    return loss.transpose(0, 1).contiguous()


# The options of the losses below (and of the Model-Optimizer criteria built on them): all of
# topkd's but those the layout fixes (reduction, process_group) and the hard-label term
# (Megatron computes its own language-model loss).
KL_OPTIONS = frozenset({"temperature", "divergence", "reverse", "vocab_size", "chunk_bytes",
                        "impl"})
TOPK_OPTIONS = KL_OPTIONS | {"top_p", "top_p_min_k", "normalize"}


def topk_kl_loss(student_logits, teacher_logits, k: int, *, model_config,
                 **options) -> torch.Tensor:
    """:func:`topkd.topk_kl_loss` in Megatron's layout.

    Args:
        student_logits, teacher_logits: ``[s, b, V/TP]`` float32/bfloat16/float16, this rank's
            vocabulary shard, or ``ColumnParallelLinear``'s ``(logits, bias)`` tuple.
        k: teacher entries kept individually; the rest is the exact ghost bucket
            (``normalize="full"``) or dropped and both renormalized (``"topk"``, Model-Optimizer
            0.47's ``TopKLogitsKLLoss``).
        model_config: the student's ``TransformerConfig``: ``tensor_model_parallel_size`` (the
            group is ``parallel_state``'s when > 1) and, where present, ``vocab_size``,
            ``should_pad_vocab``, ``make_vocab_size_divisible_by`` and ``seq_length``.
        vocab_size: the real vocabulary (default: the config's, else the logits' whole width);
            padding columns past it get zero gradient.
        options: ``top_p``, ``top_p_min_k``, ``temperature``, ``divergence``, ``reverse``,
            ``normalize``, ``chunk_bytes``, ``impl``, as in :func:`topkd.topk_kl_loss`
            (:data:`TOPK_OPTIONS`). No ``T**2`` factor.

    Returns:
        float32 ``[b, s]``, contiguous, identical on every tensor-parallel rank; the student
        gradient on each rank is its shard of the single-process gradient.
    """
    options = KDOptions.of(options, allowed=TOPK_OPTIONS, k=_checks.integer("k", k, 1))
    student, teacher, group, vocab, shards = prepare(model_config, student_logits,
                                                     teacher_logits, options)
    options = options.replace(vocab_size=vocab, process_group=group)
    return _sequence_loss(student, teacher, options, shards)


def kl_loss(student_logits, teacher_logits, *, model_config, **options) -> torch.Tensor:
    """:func:`topkd.kl_loss` (the whole vocabulary) in Megatron's layout; arguments and result
    as in :func:`topk_kl_loss`."""
    options = KDOptions.of(options, allowed=KL_OPTIONS)
    student, teacher, group, vocab, shards = prepare(model_config, student_logits,
                                                     teacher_logits, options)
    options = options.replace(vocab_size=vocab, process_group=group)
    return _sequence_loss(student, teacher, options, shards)


def sequence_first(teacher, seq_batch: tuple[int, int]) -> SparseTeacher:
    """A :class:`SparseTeacher` of Megatron's batch layout ``[b, s, K]`` (as a data loader
    collates it, like ``tokens``) as the ``[s, b, K]`` view the sequence-first losses take.
    ``seq_batch``: the ``(s, b)`` of the student's tensors."""
    if not isinstance(teacher, SparseTeacher):
        raise TypeError(f"teacher must be a topkd.SparseTeacher, got {type(teacher).__name__}")
    s, b = seq_batch
    if teacher.indices.dim() != 3 or tuple(teacher.indices.shape[:2]) != (b, s):
        hint = (" (it is [s, b, K]: give the batch layout [b, s, K], as tokens are)"
                if tuple(teacher.indices.shape[:2]) == (s, b) and s != b else "")
        raise ValueError(f"the SparseTeacher must be [b, s, K] = [{b}, {s}, K] for student "
                         f"tensors of [s, b] = [{s}, {b}], got {tuple(teacher.indices.shape)}"
                         + hint)
    mask = None if teacher.mask is None else teacher.mask.transpose(0, 1)
    return SparseTeacher(teacher.indices.transpose(0, 1), teacher.logprobs.transpose(0, 1),
                         teacher.rest_logprob.transpose(0, 1), teacher.temperature,
                         teacher.vocab_size, mask)


def sparse_kl_loss(student_logits, teacher: SparseTeacher, *, model_config,
                   **options) -> torch.Tensor:
    """:func:`topkd.sparse_kl_loss` in Megatron's layout: offline distillation from a topkd
    store (or any :class:`SparseTeacher`), at any vocabulary size.

    Args:
        student_logits: ``[s, b, V/TP]`` or ``ColumnParallelLinear``'s ``(logits, bias)``.
        teacher: ``[b, s, K]``, Megatron's batch layout (:func:`~topkd.integrations.
            megatron_data.teacher_from_batch` of a batch, or ``TeacherStore.collate`` of its
            sample ids). Its ``vocab_size`` is the real vocabulary: the padding columns past
            it are outside both distributions.
        model_config: as in :func:`topk_kl_loss`.
        vocab_size: default the config's, else the teacher's; must equal the teacher's.
        temperature: ``None`` or the teacher's own (a store made at another is refused).
        divergence, reverse, normalize, chunk_bytes, impl: as in :func:`topkd.sparse_kl_loss`.

    Returns:
        float32 ``[b, s]``, identical on every tensor-parallel rank; the student gradient on
        each rank is its shard of the single-process gradient. No ``T**2`` factor.
    """
    options = KDOptions.of(options, allowed=KL_OPTIONS | {"normalize"})
    student = output_logits("student logits", student_logits)
    teacher = sequence_first(teacher, student.shape[:2])
    check_sequence(model_config, "student logits", student.shape)
    layout = vocab_layout(model_config, options.vocab_size)
    group = tensor_parallel_group(model_config)
    shards = parallel.exchange_shards(group, {"student logits": student.shape[-1]},
                                      student.shape[:2].numel(), student.device,
                                      same=kernels(options, student.device, group))
    check_widths(layout, shards, tensor_parallel_size(model_config))
    vocab = teacher.vocab_size if layout.vocab_size is None else layout.vocab_size
    options = options.replace(vocab_size=vocab, process_group=group)
    return _sequence_loss(student, teacher, options, _loss_shards(shards))
