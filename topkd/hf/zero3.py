"""DeepSpeed ZeRO-3 partitioned LM heads for the fused loss.

Under ZeRO-3 every parameter holds only its rank's partition outside the forward of the module
that owns it (an empty ``data``; ``ds_shape`` is its whole shape). DeepSpeed's hooks on that
module gather it for the module's forward and again for its backward, where its gradient is
accumulated whole and reduce-scattered into the partitions. The fused loss uses the head
outside the model's forward, so:

- the student's loss runs *as the forward of its output-embedding module*
  (:func:`through_head`): ZeRO-3's hooks gather the head for the loss and again when the loss's
  backward runs, so the head's gradient lands on the gathered parameter and is reduced like
  every other parameter's. (Gathering it by hand around the loss is not enough: the gradient
  would arrive in backward at a parameter already partitioned again, of shape ``[0]``.)
- a partitioned teacher's head (no gradient) is gathered for the loss with
  :func:`gathered`, ``deepspeed.zero.GatheredParameters`` with no modifier rank.

Each rank then holds the whole ``[V, H]`` head (and, for the student, its gradient) for the
duration of the loss, as under the ``"gather"`` design of an FSDP2 head. deepspeed is imported
only when a partitioned parameter is seen.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch


def partitioned(p) -> bool:
    """Whether ``p`` is a DeepSpeed ZeRO-3 parameter (it carries ``ds_id``)."""
    return p is not None and hasattr(p, "ds_id")


def gathered(*params):
    """A context in which the ZeRO-3 parameters among ``params`` (``None`` and plain tensors
    are skipped) hold their whole values on every rank; read-only (no rank's changes are
    kept). Parameters already gathered (a module using them is running) are left as they
    are."""
    wanted = {id(p): p for p in params if partitioned(p)}
    if not wanted:
        return contextlib.nullcontext()
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters, ZeroParamStatus

    wanted = [p for p in wanted.values() if p.ds_status != ZeroParamStatus.AVAILABLE]
    if not wanted:
        return contextlib.nullcontext()
    return GatheredParameters(wanted, modifier_rank=None)


def through_head(module: torch.nn.Module, fn: Callable, hidden: torch.Tensor):
    """``fn(hidden, module.weight, module.bias)`` run as ``module``'s forward (``module``: the
    student's output embeddings, a ``torch.nn.Linear``-like module), so ZeRO-3's hooks on it
    gather its parameters for the call and again for its backward.

    ``fn`` returns ``(loss, extra)``: ``loss`` a tensor (what the hooks see: the backward's
    gathering is tied to it), ``extra`` anything else (returned untouched). ``hidden`` goes in
    as the module's input, so the head is released again once its gradient has left. Returns
    ``(loss, extra)``."""
    kept = {}

    def forward(x):
        loss, kept["extra"] = fn(x, module.weight, getattr(module, "bias", None))
        return loss

    own = module.__dict__.get("forward")  # a wrapper's patched forward (accelerate's hooks)
    module.forward = forward
    try:
        loss = module(hidden)
    finally:
        if own is None:
            del module.forward
        else:
            module.forward = own
    return loss, kept["extra"]


__all__ = ["gathered", "partitioned", "through_head"]
