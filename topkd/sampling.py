"""The teacher side of sampled KD: ``N`` tokens drawn per row, kept as distinct ids and counts.

RS-KD ("Sparse Logit Sampling", arXiv 2503.16870): a top-K cache gives biased targets (the
tail's mass is dropped or pooled), while the histogram of ``N`` tokens drawn from the teacher
is an unbiased estimate of its whole distribution, and a dozen draws per position keep fewer
bytes than a top-16 row. The draws here are reproducible: from ``seed`` alone, or per sequence
from ``(seed, sample id)``, so a store's rows do not depend on how sequences were batched.
"""

from __future__ import annotations

import hashlib
import math

import torch

from . import _checks, memory
from .teacher import SampledTeacher

MAX_SAMPLES = 255  # a stored count fits one byte


def sequence_seed(seed: int, sample_id) -> int:
    """The generator seed of one sequence's draws: a 63-bit hash of ``(seed, sample_id)``
    (stable across processes and Python versions, unlike ``hash``)."""
    kind = "s" if isinstance(sample_id, str) else "i"
    key = f"topkd-samples:{int(seed)}:{kind}:{sample_id}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


def _uniforms(lead: tuple, n: int, samples: int, seed: int, sample_ids) -> torch.Tensor:
    """float64 ``[n, samples]`` uniforms in [0, 1), on the CPU (the same on every device)."""
    if sample_ids is None:
        generator = torch.Generator().manual_seed(int(seed))
        return torch.rand(n, samples, generator=generator, dtype=torch.float64)
    sample_ids = list(sample_ids)
    if len(lead) != 2 or len(sample_ids) != lead[0]:
        raise ValueError(f"sample_ids: one id per sequence of teacher_logits [B, L, V] is "
                         f"needed, got {len(sample_ids)} ids for leading shape {tuple(lead)}")
    generator = torch.Generator()
    rows = []
    for sample_id in sample_ids:
        if isinstance(sample_id, bool) or not isinstance(sample_id, (int, str)):
            raise TypeError(f"sample_ids must be ints or strs, got {sample_id!r}")
        generator.manual_seed(sequence_seed(seed, sample_id))
        rows.append(torch.rand(lead[1], samples, generator=generator, dtype=torch.float64))
    return torch.cat(rows) if rows else torch.empty(0, samples, dtype=torch.float64)


def histogram(drawn: torch.Tensor, logq: torch.Tensor | None = None):
    """``(ids, counts, logq)`` ``[n, N]`` of ``[n, N]`` drawn ids: each row's distinct ids
    ascending, then ``-1`` slots (count 0, log-prob ``-inf``)."""
    drawn, order = drawn.sort(-1)
    first = torch.ones_like(drawn, dtype=torch.bool)
    first[:, 1:] = drawn[:, 1:] != drawn[:, :-1]
    slot = first.long().cumsum(-1) - 1
    ids = torch.full_like(drawn, -1).scatter_(1, slot, drawn)
    counts = torch.zeros_like(drawn, dtype=torch.int32).scatter_add_(
        1, slot, torch.ones_like(drawn, dtype=torch.int32))
    if logq is not None:
        logq = torch.full(drawn.shape, -math.inf, device=drawn.device).scatter_(
            1, slot, logq.gather(1, order))
    return ids, counts, logq


@torch.no_grad()
def sample_teacher(
    teacher_logits: torch.Tensor,
    samples: int,
    *,
    temperature: float = 1.0,
    seed: int = 0,
    sample_ids=None,
    vocab_size: int | None = None,
    chunk_bytes: int | None = None,
) -> SampledTeacher:
    """Draw ``samples`` tokens per row from ``softmax(teacher_logits / temperature)``.

    Args:
        teacher_logits: ``[..., V]`` float32/bfloat16/float16 (the whole vocabulary: not
            sharded).
        samples: draws per row ``N``, 1 to 255 (about 12 match full KD in the paper).
        temperature: the teacher's temperature; the loss scales the student by it.
        seed: the draws' seed. Without ``sample_ids`` one generator seeded with it draws every
            row in order.
        sample_ids: with ``teacher_logits`` ``[B, L, V]``, one id (int or str) per sequence:
            sequence ``b``'s draws come from its own generator seeded with ``(seed,
            sample_ids[b])``, so they do not depend on the batch it came in (a store's rows).
        vocab_size: the real vocabulary when the logits are padded past it (padding columns
            are never drawn).
        chunk_bytes: the float64 work budget per chunk of rows (default as the losses').

    Returns:
        A :class:`~topkd.SampledTeacher` with leading shape ``[...]`` and ``N`` slots per row
        (the distinct ids ascending, then unused slots), with the teacher's log-probs of the
        ids drawn. Drawn by inverse CDF in float64 from uniforms made on the CPU, so the same
        seed gives the same ids on every device, to float64 rounding of the CDF.
    """
    _checks.logits("teacher_logits", teacher_logits)
    samples = _checks.integer("samples", samples, 1, MAX_SAMPLES)
    temperature = _checks.temperature(temperature)
    seed = _checks.integer("seed", seed, -(2**63), 2**64 - 1)  # (a torch.Generator's)
    chunk_bytes = _checks.chunk_bytes(chunk_bytes)
    width = teacher_logits.shape[-1]
    vocab = _checks.vocab_size(vocab_size, ("teacher_logits", width))
    lead = tuple(teacher_logits.shape[:-1])
    n = math.prod(lead)
    uniforms = _uniforms(lead, n, samples, seed, sample_ids).to(teacher_logits.device)
    flat = teacher_logits.reshape(n, width)
    drawn = torch.empty(n, samples, dtype=torch.int64, device=teacher_logits.device)
    logq = torch.empty(n, samples, dtype=torch.float32, device=teacher_logits.device)
    # float64 logits, their CDF and one more buffer per row
    per = max(1, memory.budget_bytes(chunk_bytes, n, width, teacher_logits.element_size())
              // (8 * 3 * max(vocab, 1)))
    for start, stop in memory.row_chunks(n, per):
        z = flat[start:stop, :vocab].double().div_(temperature)
        logp = z.sub_(z.logsumexp(-1, keepdim=True))
        cdf = logp.exp().cumsum_(-1)
        # a row's CDF ends at 1 to float64 rounding: scale the uniforms to where it ends
        # (below the end: the last id of positive mass is the last one drawn)
        end = cdf[:, -1:]
        target = torch.minimum(uniforms[start:stop] * end, torch.nextafter(end, end.new_zeros(())))
        ids = torch.searchsorted(cdf, target, right=True).clamp_max_(vocab - 1)
        drawn[start:stop] = ids
        logq[start:stop] = logp.gather(1, ids).float()
    ids, counts, logq = histogram(drawn, logq)
    return SampledTeacher(ids.reshape(*lead, samples), counts.reshape(*lead, samples), samples,
                          temperature, vocab, logq.reshape(*lead, samples))
