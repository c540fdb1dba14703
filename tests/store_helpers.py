"""Store test helpers: a teacher passed through a row codec, without a store."""

from __future__ import annotations

import numpy as np
import torch

import topkd
from topkd.store import codec

COMPACT_STEP = codec.COMPACT_STEP


def through_codec(teacher: topkd.SparseTeacher, name: str, step=None) -> topkd.SparseTeacher:
    """``teacher`` ``[L, K]`` encoded and decoded by codec ``name`` (what a store of that codec
    returns for it)."""
    indices, logprobs = teacher.indices, teacher.logprobs
    used = indices >= 0
    counts = used.sum(-1).numpy().astype(np.int64)
    payload, base, width = codec.encode(name, indices[used].numpy(), logprobs[used].numpy(),
                                        counts, teacher.vocab_size, teacher.k, step)
    full = bool((counts == teacher.k).all())
    out_indices, out_logprobs = codec.decode(name, payload, base, width,
                                             None if full else counts, teacher.vocab_size,
                                             teacher.k, step)
    return topkd.SparseTeacher(torch.from_numpy(out_indices), torch.from_numpy(out_logprobs),
                               teacher.rest_logprob.float(), teacher.temperature,
                               teacher.vocab_size)
