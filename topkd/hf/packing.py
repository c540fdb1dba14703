"""Padding-free (packed) batches: several sequences in one row, ``position_ids`` restarting
at each (what ``transformers.DataCollatorWithFlattening`` and ``KDCollator(padding_free=True)``
make).

Three things make such a batch right: the models get its ``position_ids`` and no attention mask
(transformers keeps the sequences apart only then: with a 2D mask, even one of all ones, it
builds a plain causal mask and the sequences attend to each other); the next-token shift never
crosses from one sequence into the next (the last row of a sequence predicts nothing); and the
model's attention implementation really keeps them apart, which :class:`PackingCheck` measures
once per model.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .models import text_config, unwrap

# keys that DataCollatorWithFlattening adds for packed batches next to (or instead of)
# position_ids
_PACKING_KEYS = ("seq_idx", "cu_seq_lens_q", "cu_seq_lens_k")


def sequence_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """Bool ``[B, T]``: True where a sequence starts, at position 0 of each row and wherever
    the position is not the previous one plus 1 (the rule of transformers' own detection,
    ``masking_utils.find_packed_sequence_indices``)."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    return starts


class Layout:
    """How a batch enters the models and which shifted rows it may train.

    ``attention_mask`` and ``position_ids``: what the models get. ``crossing``: None, or bool
    ``[B, T - 1]``, True at the rows whose next token belongs to another sequence (or is
    padding after a packed row's last sequence): they learn nothing. ``packed``: a row holds
    more than one sequence."""

    def __init__(self, inputs: Mapping):
        input_ids = inputs["input_ids"]
        attention = inputs.get("attention_mask")
        position_ids = inputs.get("position_ids")
        self.attention_mask, self.position_ids, self.crossing = attention, position_ids, None
        self.packed = False
        if position_ids is None:
            extra = [key for key in _PACKING_KEYS if key in inputs]
            if extra:
                raise ValueError(f"the batch has {', '.join(map(repr, extra))} but no "
                                 f"'position_ids': a packed batch needs its position_ids (each "
                                 f"sequence's positions from 0) so that the models keep its "
                                 f"sequences apart; use DataCollatorWithFlattening's default "
                                 f"return_position_ids=True, or KDCollator(padding_free=True)")
            return
        if position_ids.shape != input_ids.shape:
            raise ValueError(f"the batch's position_ids have shape {tuple(position_ids.shape)}, "
                             f"its input_ids {tuple(input_ids.shape)}: they must be equal")
        starts = sequence_starts(position_ids)
        real = None if attention is None else attention.bool()
        restarts = starts[:, 1:]
        if real is not None:  # (padding's positions say nothing: left padding is not packing)
            restarts = restarts & real[:, 1:] & real[:, :-1]
        if not bool(restarts.any()):
            return  # one sequence per row: the position_ids go to the models as they are
        self.packed = True
        crossing = starts[:, 1:]
        if real is not None:
            if not bool(real.all()):
                # padding after a row's last sequence is harmless without a mask (causal
                # attention never looks ahead); anything else is not
                if bool((real[:, 1:] & ~real[:, :-1]).any()):
                    raise ValueError(
                        "a packed batch (position_ids restarting mid-row) whose attention_mask "
                        "has zeros before real tokens: the models would have to take that mask, "
                        "and with a mask transformers no longer keeps packed sequences apart. "
                        "Pack without padding (KDCollator(padding_free=True), "
                        "DataCollatorWithFlattening), or pad at the end of each row only")
                crossing = crossing | ~real[:, 1:]
            # (a mask, even all ones, turns off transformers' packed-sequence detection)
            self.attention_mask = None
        self.crossing = crossing

    def learned(self, labels: torch.Tensor) -> torch.Tensor:
        """Bool ``[B, T - 1]``: the rows trained, where the next label is not -100, the next
        token is in the same sequence and the row's own token is not padding (a left-padded
        row's last pad would otherwise be trained on its sequence's first token, from no
        context)."""
        keep = labels[:, 1:] != -100
        if self.crossing is not None:
            keep = keep & ~self.crossing.to(keep.device)
        if self.attention_mask is not None:
            keep = keep & self.attention_mask[:, :-1].to(keep.device).bool()
        return keep

    def sequence_of(self, b: int, t: int) -> int | None:
        """The index, over the whole batch, of the sequence holding row ``b``, position ``t``
        (packed batches); None for one sequence per row."""
        if not self.packed:
            return None
        starts = sequence_starts(self.position_ids)
        return int(starts[:b].sum()) + int(starts[b, :t + 1].sum()) - 1


def learned(inputs: Mapping) -> torch.Tensor:
    """Bool ``[B, T - 1]``: the shifted rows a batch trains (see :meth:`Layout.learned`)."""
    return Layout(inputs).learned(inputs["labels"])


def attention_implementation(model) -> str:
    base = unwrap(model)
    config = text_config(base)
    return str(getattr(config, "_attn_implementation", None)
               or getattr(base.config, "_attn_implementation", None))


class PackingCheck:
    """Once per model: does it keep packed sequences apart? Two short sequences run packed
    (``position_ids`` restarting, no mask, as the trainer runs them) must give the second one
    the logits it has alone; they are also run attending to each other, to tell a difference
    of rounding from one of attention. Refuses the model with a ValueError naming its
    attention implementation otherwise."""

    def __init__(self):
        self._checked: set[int] = set()

    def __call__(self, model, what: str) -> None:
        base = unwrap(model)
        if id(base) in self._checked:
            return
        error, crossed, scale, dtype = _packing_error(base)
        floor = (1e-5 if dtype.itemsize >= 4 else 2e-2) * scale
        if not error <= max(0.1 * crossed, floor):
            impl = attention_implementation(base)
            raise ValueError(
                f"the {what} ({type(base).__name__}, attn_implementation={impl!r}) does not keep "
                f"packed sequences apart: with position_ids restarting mid-row a sequence's "
                f"logits differ from its logits alone by {error:.3g} (by {crossed:.3g} when the "
                f"sequences attend to each other). Load it with attn_implementation='sdpa' or "
                f"'eager', or train on padded batches (no position_ids restarting mid-row)")
        self._checked.add(id(base))


def _packing_error(base) -> tuple[float, float, float, torch.dtype]:
    """``(max |packed - alone|, max |crossed - alone|, max(1, max |alone|), logits dtype)`` on
    the second of two 5-token sequences, in eval mode (no dropout), without autocast."""
    parameter = next(base.parameters())
    rows = base.get_input_embeddings().weight.shape[0]
    ids = (torch.arange(10, device=parameter.device) * 7 + 3) % rows
    positions = torch.arange(10, device=parameter.device) % 5
    training = base.training
    base.eval()
    try:
        with torch.no_grad(), torch.autocast(parameter.device.type, enabled=False):
            run = dict(input_ids=ids[None], position_ids=positions[None], use_cache=False)
            try:
                packed = base(**run).logits[0, 5:]
            except TypeError as e:
                raise ValueError(f"{type(base).__name__} takes no position_ids ({e}): it cannot "
                                 f"train on packed batches") from None
            crossed = base(**run, attention_mask=torch.ones_like(ids)[None]).logits[0, 5:]
            alone = base(input_ids=ids[None, 5:], use_cache=False).logits[0].float()
    finally:
        base.train(training)
    scale = max(1.0, float(alone.abs().max()))
    return (float((packed.float() - alone).abs().max()),
            float((crossed.float() - alone).abs().max()), scale, packed.dtype)
