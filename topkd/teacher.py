"""The teacher side's data: a distribution kept as its top-K entries plus one exact ghost bucket."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SparseTeacher:
    """A teacher distribution kept as its top-K entries plus one exact ghost bucket.

    Attributes:
        indices: int64 ``[..., K]``, global vocabulary indices ordered by teacher probability
            (descending, ties by lower index); ``-1`` marks an unused slot (dropped by top-p).
        logprobs: float32 ``[..., K]``, ``log q`` of each entry, normalized over the whole
            vocabulary at ``temperature``; ``-inf`` in unused slots.
        rest_logprob: float32 ``[...]``, ``log q_g``: the log of the total probability of every
            entry not kept, computed as a log-sum-exp over them (exact even when the kept entries
            hold all but 1e-13 of the mass), ``-inf`` when nothing is left out.
        temperature: the temperature the teacher was normalized at; the student is scaled by it.
        vocab_size: the vocabulary the teacher was normalized over (padding excluded).
        mask: optional bool ``[...]``, False on rows that are padding (a batch collated from a
            store); the losses drop those rows as they drop rows of their own ``mask``.
    """

    indices: torch.Tensor
    logprobs: torch.Tensor
    rest_logprob: torch.Tensor
    temperature: float
    vocab_size: int
    mask: torch.Tensor | None = None

    @property
    def k(self) -> int:
        return self.indices.shape[-1]

    def to(self, device) -> SparseTeacher:
        return SparseTeacher(
            self.indices.to(device), self.logprobs.to(device), self.rest_logprob.to(device),
            self.temperature, self.vocab_size, None if self.mask is None else self.mask.to(device),
        )
