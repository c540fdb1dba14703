"""What the trainer needs from a Hugging Face causal LM: its final hidden states without its
logits, its LM head, the transform its head applies, and the vocabulary it really has."""

from __future__ import annotations

import inspect
import math

import torch
import torch.nn.functional as F


def unwrap(model):
    """The ``PreTrainedModel`` inside DDP / accelerate / PEFT wrappers."""
    while hasattr(model, "module"):  # DistributedDataParallel
        model = model.module
    if hasattr(model, "get_base_model"):  # peft.PeftModel
        model = model.get_base_model()
    return model


def text_config(model):
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def head(model) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(weight [V_r, H], bias [V_r] or None)`` of the model's output embeddings (the same
    Parameter as the input embeddings when they are tied, so their gradients add)."""
    output = unwrap(model).get_output_embeddings()
    if output is None or not isinstance(getattr(output, "weight", None), torch.Tensor):
        raise ValueError(f"{type(unwrap(model)).__name__} has no output embeddings "
                         f"(get_output_embeddings() is {output!r}); use fused=False")
    return output.weight, getattr(output, "bias", None)


def rows(weight: torch.Tensor) -> int:
    """A weight's whole row count: a DTensor's global shape, a DeepSpeed ZeRO-3 partitioned
    parameter's ``ds_shape`` (its own shape is empty outside the module's forward)."""
    shape = getattr(weight, "ds_shape", None)
    return int(shape[0]) if shape is not None and len(shape) else int(weight.shape[0])


def is_fsdp2(model) -> bool:
    """Whether ``model`` was wrapped by FSDP2's ``fully_shard`` (an ``FSDPModule``)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return isinstance(model, FSDPModule)


def _fsdp1():
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # a torch without torch.distributed
        return None
    return FullyShardedDataParallel


def fused_head(model, role: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`head` for the fused losses, which use the head outside the model's forward: an
    FSDP2 head (a DTensor sharded by rows) and a DeepSpeed ZeRO-3 partitioned head are returned
    as they are (the loss takes the first; the trainer gathers the second through
    :mod:`topkd.hf.zero3`); FSDP1's flattened parameters are refused with a ValueError naming
    the ways out. ``role``: ``"student"`` or ``"teacher"``."""
    fsdp1 = _fsdp1()
    if fsdp1 is not None and isinstance(model, torch.nn.Module) \
            and any(isinstance(m, fsdp1) for m in model.modules()):
        raise ValueError(
            f"the {role} is wrapped in FSDP1 (torch.distributed.fsdp.FullyShardedDataParallel), "
            f"whose flattened parameters leave the LM head unusable outside the model's "
            f"forward; the fused loss takes an FSDP2 head: shard with fully_shard (accelerate: "
            f"fsdp_version=2, i.e. fsdp_config={{'fsdp_version': 2}}), or use fused=False (the "
            f"models' own logits)")
    return head(model)


def logit_transform(model) -> tuple[float, float | None]:
    """``(logit_scale, softcap)`` the model applies to ``F.linear(hidden, weight, bias)``:
    Cohere's ``logit_scale``, Granite's ``1 / logits_scaling``, Gemma's
    ``final_logit_softcapping``. :meth:`FinalHidden.check` confirms them on real logits."""
    config = text_config(unwrap(model))
    scale = getattr(config, "logit_scale", None) or 1.0
    divide = getattr(config, "logits_scaling", None)
    if divide:
        scale = scale / divide
    softcap = getattr(config, "final_logit_softcapping", None) or None
    return float(scale), None if softcap is None else float(softcap)


def transformed(logits: torch.Tensor, scale: float, softcap: float | None) -> torch.Tensor:
    logits = logits * scale
    return logits if softcap is None else softcap * torch.tanh(logits / softcap)


def vocabulary(tokenizer, widths: dict[str, int]) -> int:
    """The real vocabulary: the tokenizer's size when there is one (heads are often padded:
    Qwen's 151,936 or 152,064 rows for 151,665 tokens), else the heads' common width.
    ``widths``: output rows by model, ``"student"`` (the tokenizer's own model) first."""
    if tokenizer is not None:
        size = len(tokenizer)
        narrow = {name: w for name, w in widths.items() if w < size}
        if "teacher" in narrow:
            raise ValueError(
                f"the teacher has {narrow['teacher']} output rows but the student's tokenizer "
                f"has {size} tokens: the teacher's vocabulary is a different one. Distillation "
                f"pairs the two models' rows token by token, so both must use one tokenizer; "
                f"distillation across tokenizers is not supported")
        if narrow:
            raise ValueError(f"the student has {narrow['student']} output rows but its tokenizer "
                             f"has {size} tokens; resize its embeddings "
                             f"(model.resize_token_embeddings({size}))")
        return size
    if len(set(widths.values())) > 1:
        raise ValueError(f"the output widths differ ({widths}) and no tokenizer says which "
                         f"columns are padding; pass processing_class=<the tokenizer>")
    return next(iter(widths.values()))


def embedding_rows(model) -> int:
    """How many token ids the model's input embeddings take."""
    return rows(unwrap(model).get_input_embeddings().weight)


class FinalHidden:
    """Runs a causal LM for its final hidden states ``[B, T, H]`` (the decoder's output, after
    its final norm), the LM head applied to one position only.

    The call goes through the model (and whatever wraps it: DDP, accelerate's autocast, PEFT),
    with ``logits_to_keep`` naming one position, and a forward hook on the decoder keeps its
    output. Under autocast the hidden states are cast to the autocast dtype, as autocast's
    ``F.linear`` would cast them, so the fused products run in it.
    """

    def __init__(self, model):
        base = unwrap(model)
        if "logits_to_keep" not in inspect.signature(base.forward).parameters:
            raise ValueError(f"{type(base).__name__}.forward takes no logits_to_keep, so its "
                             f"logits cannot be skipped; use fused=False")
        self.decoder = base.get_decoder()
        self.scale, self.softcap = logit_transform(base)
        self.checked = False
        self._hidden = None

    def _keep(self, module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output.last_hidden_state
        device = hidden.device.type
        if torch.is_autocast_enabled(device):
            hidden = hidden.to(torch.get_autocast_dtype(device))
        self._hidden = hidden

    def __call__(self, model, input_ids, attention_mask,
                 position_ids=None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(hidden [B, T, H], the model's own logits [B, V] at the last position)``; the
        caller checks them with :meth:`check` once (after it has checked they are finite)."""
        probe = input_ids.shape[1] - 1
        keep = torch.tensor([probe], device=input_ids.device)
        hook = self.decoder.register_forward_hook(self._keep)
        try:
            output = model(input_ids=input_ids, attention_mask=attention_mask,
                           position_ids=position_ids, use_cache=False, logits_to_keep=keep)
        finally:
            hook.remove()
        hidden, self._hidden = self._hidden, None
        if hidden is None:
            raise RuntimeError(f"the decoder {type(self.decoder).__name__} did not run")
        if is_fsdp2(model) and torch.is_grad_enabled() and output.logits.requires_grad:
            hidden = _Anchor.apply(hidden, output.logits)
        return hidden, output.logits[:, 0]

    def check(self, model, hidden: torch.Tensor, logits: torch.Tensor) -> None:
        """Once: the model's own logits at the last position (``logits`` ``[B, V]``) must
        equal the transform of ``F.linear(hidden[:, -1], weight, bias)`` (an unknown head
        would make the fused loss wrong)."""
        if self.checked:
            return
        from .zero3 import gathered

        weight, bias = fused_head(model, "model")
        with torch.no_grad(), gathered(weight, bias):  # (a ZeRO-3 head: whole for the check)
            theirs = logits.float()
            weight, bias, theirs, group = _own_rows(weight, bias, theirs)
            ours = transformed(F.linear(hidden[:, -1].float(), weight.float(),
                                        None if bias is None else bias.float()),
                               self.scale, self.softcap)
            nonfinite = float(not bool(torch.isfinite(theirs).all()))
            error = (ours - theirs).abs().max().item() if theirs.numel() else 0.0
            size = theirs.abs().max().item() if theirs.numel() else 0.0
            if group is not None:  # every rank of a sharded head decides alike
                found = torch.tensor([nonfinite, error if math.isfinite(error) else math.inf,
                                      size], dtype=torch.float64, device=theirs.device)
                torch.distributed.all_reduce(found, op=torch.distributed.ReduceOp.MAX,
                                             group=group)
                nonfinite, error, size = found.tolist()
            if nonfinite:
                raise NonFiniteError(f"{type(unwrap(model)).__name__}'s logits are not finite "
                                     f"(NaN or inf) at the last position of the batch")
        tolerance = (0.02 if min(hidden.dtype.itemsize, logits.dtype.itemsize) < 4 else 1e-4)
        if not math.isfinite(error) or error > tolerance * max(size, 1.0):
            raise RuntimeError(
                f"{type(unwrap(model)).__name__}'s logits differ from its head applied to its "
                f"final hidden states (max difference {error:.3g} at logits up to {size:.3g}; "
                f"logit_scale={self.scale}, softcap={self.softcap} read from its config): its "
                f"head does something the fused loss does not know; use fused=False")
        self.checked = True


def _own_rows(weight, bias, logits):
    """For a head sharded by rows (an FSDP2 DTensor): this rank's rows of the weight and bias
    and its columns of ``logits`` ``[B, V]``, and the mesh's group; else all of them and None
    (the check then needs no gathered head)."""
    from .. import sharded

    if not sharded.is_dtensor(weight):
        return weight, bias, logits, None
    mesh = sharded.Mesh(weight)
    start = sum(mesh.sizes[:mesh.rank])
    local = weight.to_local()
    if bias is not None:
        bias = bias.to_local() if sharded.is_dtensor(bias) else bias[start:start + len(local)]
    return local, bias, logits[:, start:start + local.shape[0]], mesh.group


class _Anchor(torch.autograd.Function):
    """``hidden`` unchanged, its backward also giving the model's output ``logits`` a zero
    gradient. FSDP2 unshards a root's parameters for backward from a hook on the root's
    outputs; the fused loss's gradient enters at the decoder's output, an inner tensor, so
    without this the hook never fires and the final norm's backward reads freed storage."""

    @staticmethod
    def forward(ctx, hidden, logits):
        ctx.logits = (logits.shape, logits.dtype, logits.device)
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad):
        shape, dtype, device = ctx.logits
        return grad, torch.zeros(shape, dtype=dtype, device=device)


class NonFiniteError(ValueError):
    """A model (the teacher, or the student) gave NaN or infinite values: training on them
    would put NaN into the student's weights."""


def nonfinite_rows(x: torch.Tensor, logits: bool = False) -> torch.Tensor:
    """Bool ``[...]``: the rows of ``x`` ``[..., D]`` holding a NaN or an infinity. For
    ``logits``, -inf is a token the model rules out, allowed unless the whole row is -inf (no
    distribution). One reduction per row: no ``x``-sized temporary for logits."""
    if logits:
        return ~torch.isfinite(x.amax(-1))  # NaN propagates through amax
    return ~torch.isfinite(x.abs().amax(-1))
