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


@dataclass
class SampledTeacher:
    """A teacher distribution kept as ``samples`` tokens drawn from it per row (RS-KD, "Sparse
    Logit Sampling", arXiv 2503.16870): the distinct ids drawn and how often each was drawn.

    ``counts / samples`` is an unbiased estimate of the teacher's distribution ``q`` at
    ``temperature``, so the forward-KL gradient the losses take against it, ``p - counts /
    samples`` w.r.t. the student's logits (over ``T``), is an unbiased estimate of the full
    vocabulary's ``p - q`` (top-K targets are biased: they drop the tail). Only forward KL has
    such an estimate; the losses refuse every other divergence.

    Attributes:
        indices: int64 ``[..., S]``, the distinct vocabulary ids drawn, ascending; ``-1`` marks
            an unused slot (after the used ones). ``S`` (slots) is at most ``samples``.
        counts: int ``[..., S]``, how many of the ``samples`` draws gave each id (0 in unused
            slots); each row sums to ``samples``.
        samples: ``N``, the draws per row.
        temperature: the temperature the teacher was sampled at; the student is scaled by it.
        vocab_size: the vocabulary the teacher was normalized over (padding excluded).
        logprobs: optional float32 ``[..., S]``, the teacher's ``log q`` of each id drawn
            (``-inf`` in unused slots). With them the loss value estimates ``KL(q || p)``
            without bias; without them it estimates the cross-entropy ``KL(q || p) + H(q)``
            (``H(q)`` does not depend on the student: the gradient is the same).
        mask: optional bool ``[...]``, False on padding rows (a batch collated from a store).
    """

    indices: torch.Tensor
    counts: torch.Tensor
    samples: int
    temperature: float
    vocab_size: int
    logprobs: torch.Tensor | None = None
    mask: torch.Tensor | None = None

    @property
    def k(self) -> int:
        """Slots per row (the engine's kept entries)."""
        return self.indices.shape[-1]

    def weights(self) -> torch.Tensor:
        """float32 ``counts / samples``, the estimate of ``q`` at each slot."""
        return self.counts.float() / self.samples

    def to(self, device) -> SampledTeacher:
        return self.map(lambda t: t.to(device), mask=None if self.mask is None
                        else self.mask.to(device))

    def map(self, fn, *, mask=None) -> SampledTeacher:
        """A copy with ``fn`` applied to each per-row tensor (indices, counts, logprobs) and
        the given ``mask``."""
        return SampledTeacher(fn(self.indices), fn(self.counts), self.samples, self.temperature,
                              self.vocab_size, None if self.logprobs is None
                              else fn(self.logprobs), mask)
