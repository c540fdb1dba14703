"""topkd's fused loss inside TRL's on-policy :class:`trl.DistillationTrainer`.

TRL 1.16's ``DistillationTrainer`` computes its loss with the module-level function
``trl.trainer.distillation_trainer._chunked_divergence_loss``. :func:`use_in_trl` replaces that
function with :func:`divergence_loss`, which keeps TRL's signature and return contract and
computes the loss with :func:`topkd.fused_kl_loss` (or, with ``k``,
:func:`topkd.fused_topk_kl_loss`): the same generalized JSD, exact to float32 rounding, with
topkd's memory budget. TRL's own generation loop, vLLM support and logging are untouched.
"""

from __future__ import annotations

import inspect
import math

import torch

from ..divergences import JSD
from ..entry import distill_loss
from ..memory import chunk_rows, row_chunks
from ..options import KDOptions
from ..sources import product_dtype

_TRL_MODULE = "trl.trainer.distillation_trainer"
_TRL_NAME = "_chunked_divergence_loss"
# TRL 1.16's parameters, in order, with their defaults; the replacement has exactly these.
_TRL_PARAMETERS = (
    ("student_hidden_states", inspect.Parameter.empty),
    ("teacher_hidden_states", inspect.Parameter.empty),
    ("student_lm_head_weight", inspect.Parameter.empty),
    ("teacher_lm_head_weight", inspect.Parameter.empty),
    ("completion_mask", inspect.Parameter.empty),
    ("beta", inspect.Parameter.empty),
    ("num_items_in_batch", None),
    ("student_lm_head_bias", None),
    ("teacher_lm_head_bias", None),
    ("student_logit_scale", 1.0),
    ("teacher_logit_scale", 1.0),
    ("student_final_logit_softcapping", None),
    ("teacher_final_logit_softcapping", None),
    ("temperature", 1.0),
)
_OPTIONS = {"k", "top_p", "top_p_min_k", "normalize", "chunk_bytes", "impl", "entropy"}
_TOPK_ONLY = {"top_p", "top_p_min_k", "normalize"}
# float32 [rows, V] buffers the entropy holds at once: the logits, their softmax and
# logsumexp's temporary
_ENTROPY_BUFFERS = 3


def _full(weight: torch.Tensor, bias: torch.Tensor | None):
    """An FSDP2 ``DTensor`` head gathered once per call, as TRL does (topkd converts the
    dtype itself)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a build without torch.distributed
        return weight, bias
    if isinstance(weight, DTensor):
        weight = weight.full_tensor()
        if isinstance(bias, DTensor):
            bias = bias.full_tensor()
    return weight, bias


@torch.no_grad()
def student_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor,
                        bias: torch.Tensor | None = None, *, logit_scale: float = 1.0,
                        softcap: float | None = None, temperature: float = 1.0,
                        chunk_bytes: int | None = None) -> torch.Tensor:
    """``sum_rows H(softmax(z / temperature))`` in nats, float32, no gradient, with ``z`` the
    transformed logits ``softcap * tanh(logit_scale * F.linear(hidden, weight, bias) /
    softcap)`` of ``hidden [N, H]``: TRL's ``entropy_sum``.

    Made one chunk of rows at a time (the product in :func:`topkd.sources.product_dtype`,
    then float32): at most three float32 ``[rows, V]`` buffers within ``chunk_bytes``
    (default as the losses': ``min(64 MiB, max(1 MiB, logits / 16))``). It costs one more
    forward product of the student's head over the rows, ``2 N V H`` FLOPs."""
    n, vocab = hidden.shape[0], weight.shape[0]
    dtype = product_dtype(hidden.dtype, weight.dtype)
    weight = weight.to(dtype)
    bias = None if bias is None else bias.to(dtype)
    per = chunk_rows(chunk_bytes, vocab, n, weight.element_size(), buffers=_ENTROPY_BUFFERS)
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for start, stop in row_chunks(n, per):
        z = torch.nn.functional.linear(hidden[start:stop].to(dtype), weight, bias).float()
        z.mul_(logit_scale)
        if softcap is not None:
            z.div_(softcap).tanh_().mul_(softcap)
        z.div_(temperature)
        lse = torch.logsumexp(z, -1)
        p = (z - lse[:, None]).exp_()
        # H = lse - sum_j p_j z_j; the row dot products make no [rows, V] temporary
        total += (lse - torch.einsum("rv,rv->r", p, z)).sum()
    return total


def divergence_loss(
    student_hidden_states: torch.Tensor,
    teacher_hidden_states: torch.Tensor,
    student_lm_head_weight: torch.Tensor,
    teacher_lm_head_weight: torch.Tensor,
    completion_mask: torch.Tensor,
    beta: float,
    num_items_in_batch: torch.Tensor | int | None = None,
    student_lm_head_bias: torch.Tensor | None = None,
    teacher_lm_head_bias: torch.Tensor | None = None,
    student_logit_scale: float = 1.0,
    teacher_logit_scale: float = 1.0,
    student_final_logit_softcapping: float | None = None,
    teacher_final_logit_softcapping: float | None = None,
    temperature: float = 1.0,
    *,
    k: int | None = None,
    top_p: float | None = None,
    top_p_min_k: int = 1,
    normalize: str = "full",
    chunk_bytes: int | None = None,
    impl: str = "auto",
    entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TRL 1.16's ``_chunked_divergence_loss`` computed by topkd: same arguments, same result.

    Args:
        student_hidden_states, teacher_hidden_states: ``[B, C, H_s]``, ``[B, C, H_t]``, the
            rows that predict the completion tokens (the teacher's get no gradient).
        student_lm_head_weight, teacher_lm_head_weight: ``[V, H_s]``, ``[V, H_t]``.
        completion_mask: ``[B, C]``; nonzero marks the positions in the loss. Only those rows
            are projected.
        beta: TRL's generalized JSD, :class:`topkd.JSD` (the same convention): 0 is
            ``KL(teacher || student)``, 1 is ``KL(student || teacher)``, else ``beta *
            KL(q || M) + (1 - beta) * KL(p || M)`` with ``M = beta q + (1 - beta) p``.
        num_items_in_batch: the divisor of the summed divergence; ``None``: the number of
            valid positions (at least 1).
        student_lm_head_bias, teacher_lm_head_bias: ``[V]`` or ``None``.
        student_logit_scale, teacher_logit_scale, student_final_logit_softcapping,
        teacher_final_logit_softcapping, temperature: each model's logits are
            ``softcap * tanh(scale * (h W^T + b) / softcap) / temperature`` (no softcap:
            ``scale * (h W^T + b) / temperature``); no ``T**2`` factor.
        k: ``None`` (TRL's loss: the whole vocabulary, :func:`topkd.fused_kl_loss`) or the
            teacher's top-K entries plus the exact rest bucket (:func:`topkd.fused_topk_kl_loss`,
            with ``top_p``, ``top_p_min_k`` and ``normalize``): another loss than TRL's.
        chunk_bytes, impl: as in :func:`topkd.fused_kl_loss`.
        entropy: ``False`` skips the student-entropy pass (one more student head product,
            forward only); ``entropy_sum`` is then NaN, and so is TRL's logged ``entropy``.

    Returns:
        ``(loss, entropy_sum, n_valid)``: the float32 scalar loss (gradients to the student's
        hidden states, weight and bias); the detached float32 sum over valid positions of the
        student's entropy in nats at ``temperature`` (see :func:`student_entropy_sum`); the
        int64 count of valid positions.
    """
    student_weight, student_bias = _full(student_lm_head_weight, student_lm_head_bias)
    teacher_weight, teacher_bias = _full(teacher_lm_head_weight, teacher_lm_head_bias)
    valid = completion_mask.reshape(-1) != 0
    n_valid = valid.sum()
    hidden = student_hidden_states.reshape(-1, student_hidden_states.shape[-1])[valid]
    teacher_hidden = teacher_hidden_states.reshape(-1, teacher_hidden_states.shape[-1])[valid]
    teacher = (teacher_hidden.detach(), teacher_weight, teacher_bias)
    options = KDOptions(k=k, top_p=top_p, top_p_min_k=top_p_min_k, normalize=normalize,
                        temperature=temperature, divergence=JSD(beta=float(beta)),
                        reduction="sum", chunk_bytes=chunk_bytes, impl=impl,
                        logit_scale=student_logit_scale,
                        softcap=student_final_logit_softcapping,
                        teacher_logit_scale=teacher_logit_scale,
                        teacher_softcap=teacher_final_logit_softcapping)
    total = distill_loss((hidden, student_weight, student_bias), teacher, options)
    if entropy:
        entropy_sum = student_entropy_sum(
            hidden.detach(), student_weight.detach(),
            None if student_bias is None else student_bias.detach(),
            logit_scale=student_logit_scale, softcap=student_final_logit_softcapping,
            temperature=temperature, chunk_bytes=chunk_bytes)
    else:
        entropy_sum = torch.full((), math.nan, dtype=torch.float32, device=total.device)
    if num_items_in_batch is None:
        loss = total / n_valid.clamp(min=1)
    else:
        if isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = num_items_in_batch.to(total.device)
        loss = total / num_items_in_batch
    return loss, entropy_sum, n_valid


def check_trl_signature(function, version: str) -> None:
    """Raise a RuntimeError unless ``function`` takes exactly TRL 1.16's parameters of
    ``_chunked_divergence_loss`` (names, order, defaults)."""
    try:
        parameters = tuple((p.name, p.default)
                           for p in inspect.signature(function).parameters.values())
    except (TypeError, ValueError) as e:
        raise RuntimeError(f"topkd.hf.use_in_trl: cannot read the signature of TRL {version}'s "
                           f"{_TRL_MODULE}.{_TRL_NAME}: {e}") from None
    if parameters != _TRL_PARAMETERS:
        expected = ", ".join(_describe(p) for p in _TRL_PARAMETERS)
        seen = ", ".join(_describe(p) for p in parameters)
        raise RuntimeError(
            f"topkd.hf.use_in_trl supports TRL 1.16's {_TRL_MODULE}.{_TRL_NAME}({expected}); "
            f"TRL {version}'s is ({seen}). Install trl==1.16.* or update topkd.")


def _describe(parameter) -> str:
    name, default = parameter
    return name if default is inspect.Parameter.empty else f"{name}={default!r}"


def _trl_module():
    try:
        import trl
    except ImportError as e:
        raise ImportError("topkd.hf.use_in_trl needs TRL: pip install trl (1.16 is the tested "
                          f"version): {e}") from e
    version = getattr(trl, "__version__", "unknown")
    try:
        import trl.trainer.distillation_trainer as module
    except ImportError as e:
        raise RuntimeError(f"topkd.hf.use_in_trl: TRL {version} has no {_TRL_MODULE} "
                           f"(TRL 1.16 has): {e}") from e
    if not callable(getattr(module, _TRL_NAME, None)):
        raise RuntimeError(f"topkd.hf.use_in_trl: TRL {version}'s {_TRL_MODULE} has no "
                           f"{_TRL_NAME} (TRL 1.16 has); install trl==1.16.*")
    return module, version


class TRLPatch:
    """The handle :func:`use_in_trl` returns: ``restore()`` puts TRL's function back (once;
    later calls do nothing); as a context manager it restores on exit. ``calls`` counts the
    replacement's calls."""

    def __init__(self, module, original, replacement):
        self.module, self.original, self.replacement = module, original, replacement
        self.calls = 0
        self.active = True

    def restore(self) -> None:
        if not self.active:
            return
        current = getattr(self.module, _TRL_NAME)
        if current is not self.replacement:
            raise RuntimeError(f"{_TRL_MODULE}.{_TRL_NAME} was replaced again after "
                               "use_in_trl(); restore the later patch first")
        setattr(self.module, _TRL_NAME, self.original)
        self.active = False

    def __enter__(self) -> TRLPatch:
        return self

    def __exit__(self, *exc) -> None:
        self.restore()


def use_in_trl(**options) -> TRLPatch:
    """Make TRL's ``DistillationTrainer`` compute its loss with topkd.

    Replaces ``trl.trainer.distillation_trainer._chunked_divergence_loss`` (TRL 1.16, checked:
    a RuntimeError naming the installed version if the function is missing or its parameters
    differ) with :func:`divergence_loss` called with ``options``: ``k``, ``top_p``,
    ``top_p_min_k``, ``normalize`` (Top-K only), ``chunk_bytes``, ``impl``, ``entropy``.
    The trainer's ``beta``, ``temperature``, the models' logit scales, softcaps and biases
    and ``num_items_in_batch`` arrive as TRL passes them.

    Usable as a call (``patch = use_in_trl(); ...; patch.restore()``) or a context manager
    (``with use_in_trl(): trainer.train()``). Raises ImportError (``pip install trl``) without
    TRL.
    """
    unknown = set(options) - _OPTIONS
    if unknown:
        raise TypeError(f"unknown use_in_trl options {sorted(unknown)}; allowed: "
                        f"{sorted(_OPTIONS)}")
    if options.get("k") is None and _TOPK_ONLY & set(options):
        raise ValueError(f"{sorted(_TOPK_ONLY & set(options))} apply only with k (Top-K)")
    KDOptions(**{n: v for n, v in options.items() if n != "entropy"})  # checked once, here
    if not isinstance(options.get("entropy", True), bool):
        raise TypeError(f"entropy must be a bool, got {options['entropy']!r}")
    module, version = _trl_module()
    original = getattr(module, _TRL_NAME)
    check_trl_signature(original, version)

    def _chunked_divergence_loss(
        student_hidden_states,
        teacher_hidden_states,
        student_lm_head_weight,
        teacher_lm_head_weight,
        completion_mask,
        beta,
        num_items_in_batch=None,
        student_lm_head_bias=None,
        teacher_lm_head_bias=None,
        student_logit_scale=1.0,
        teacher_logit_scale=1.0,
        student_final_logit_softcapping=None,
        teacher_final_logit_softcapping=None,
        temperature=1.0,
    ):
        patch.calls += 1
        return divergence_loss(
            student_hidden_states, teacher_hidden_states, student_lm_head_weight,
            teacher_lm_head_weight, completion_mask, beta, num_items_in_batch,
            student_lm_head_bias, teacher_lm_head_bias, student_logit_scale,
            teacher_logit_scale, student_final_logit_softcapping,
            teacher_final_logit_softcapping, temperature, **options)

    _chunked_divergence_loss.__doc__ = divergence_loss.__doc__
    patch = TRLPatch(module, original, _chunked_divergence_loss)
    setattr(module, _TRL_NAME, _chunked_divergence_loss)
    return patch
