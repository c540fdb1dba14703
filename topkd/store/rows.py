"""Sampled teacher rows outside the on-disk format: batching them, sizing them, and holding
them in memory behind the store's reading interface.

A sampled row (a :class:`~topkd.SampledTeacher` row: RS-KD's distinct drawn ids and their
counts) has as many entries as distinct tokens were drawn, at most ``samples``.
"""

from __future__ import annotations

import torch

from ..teacher import SampledTeacher, SparseTeacher


def agreed_settings(teachers: list, **given) -> tuple:
    """The settings ``given`` (name: value or None) that the ``teachers`` to collate share,
    in order: the teachers' own where there are any, else the values given (all needed)."""
    for name, value in given.items():
        seen = {getattr(t, name) for t in teachers} | ({value} if value is not None else set())
        if len(seen) > 1:
            raise ValueError(f"the teachers to collate differ in {name}: {sorted(seen)}")
    if not teachers and None in given.values():
        *first, last = given
        raise ValueError(f"collating no teachers needs {', '.join(first)} and {last}")
    if teachers:
        return tuple(getattr(teachers[0], name) for name in given)
    return tuple(given.values())


def collate_sampled(teachers, *, pad_to: int | None = None, samples: int | None = None,
                    vocab_size: int | None = None,
                    temperature: float | None = None) -> SampledTeacher:
    """Stack per-sequence :class:`~topkd.SampledTeacher` rows ``[L_i, S_i]`` into ``[B, L,
    S]`` (``S`` the widest), padded with rows of no draws (ids ``-1``, counts 0) that the
    batch's ``mask`` marks False. ``samples``, ``vocab_size`` and ``temperature`` describe an
    empty batch and must agree with the teachers given."""
    teachers = list(teachers)
    samples, vocab_size, temperature = agreed_settings(
        teachers, samples=samples, vocab_size=vocab_size, temperature=temperature)
    lengths = [t.indices.shape[0] for t in teachers]
    longest = max(lengths, default=0)
    if pad_to is None:
        pad_to = longest
    elif pad_to < longest:
        raise ValueError(f"pad_to must be >= the longest sequence ({longest}), got {pad_to}")
    slots = max((t.k for t in teachers), default=1)
    batch = len(teachers)
    indices = torch.full((batch, pad_to, slots), -1, dtype=torch.int64)
    counts = torch.zeros((batch, pad_to, slots), dtype=torch.int32)
    with_logq = bool(teachers) and all(t.logprobs is not None for t in teachers)
    logq = torch.full((batch, pad_to, slots), float("-inf")) if with_logq else None
    mask = torch.zeros((batch, pad_to), dtype=torch.bool)
    for b, (t, length) in enumerate(zip(teachers, lengths, strict=True)):
        indices[b, :length, :t.k] = t.indices
        counts[b, :length, :t.k] = t.counts
        if with_logq:
            logq[b, :length, :t.k] = t.logprobs
        mask[b, :length] = True if t.mask is None else t.mask
    return SampledTeacher(indices, counts, samples, temperature, vocab_size, logq, mask)


def collate_any(teachers, *, pad_to=None, k=None, vocab_size=None, temperature=None,
                samples=None):
    """:func:`collate_sampled` for sampled rows (or, with none, when ``samples`` is given),
    else the top-K rows' ``collate_teachers``."""
    from .reader import collate_teachers

    teachers = list(teachers)
    if (teachers and isinstance(teachers[0], SampledTeacher)) or (not teachers and samples):
        return collate_sampled(teachers, pad_to=pad_to, samples=samples,
                               vocab_size=vocab_size, temperature=temperature)
    return collate_teachers(teachers, pad_to=pad_to, k=k, vocab_size=vocab_size,
                            temperature=temperature)


def join_sampled(teachers) -> SampledTeacher:
    """Sequences' sampled rows ``[L_i, S_i]`` end to end as one ``[sum L_i, S]`` (a packed
    row), ``S`` the widest."""
    teachers = list(teachers)
    width = max(t.k for t in teachers)

    def cat(name, fill):
        parts = [getattr(t, name) for t in teachers]
        return torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[-1]), value=fill)
                          for p in parts])

    first = teachers[0]
    with_logq = all(t.logprobs is not None for t in teachers)
    return SampledTeacher(cat("indices", -1), cat("counts", 0), first.samples,
                          first.temperature, first.vocab_size,
                          cat("logprobs", float("-inf")) if with_logq else None)


def trimmed(teacher: SampledTeacher) -> SampledTeacher:
    """One sequence's sampled rows ``[L, N]`` cut to the widest row's distinct ids."""
    width = max(1, int((teacher.counts > 0).sum(-1).max())) if teacher.counts.numel() else 1
    return teacher.map(lambda t: t[..., :width].clone(), mask=teacher.mask)


def sampled_row_bytes(teacher: SampledTeacher, *, index_bytes: int = 4,
                      token_bytes: int = 4) -> int:
    """Bytes the rows of ``teacher`` take stored as distinct ids (``index_bytes`` each), one
    count byte per id, one byte per row (its number of ids) and its token id
    (``token_bytes``)."""
    entries = int((teacher.counts > 0).sum())
    rows = teacher.counts.shape[:-1].numel()
    return entries * (index_bytes + 1) + rows * (1 + token_bytes)


class TeacherRows:
    """Teacher rows held in memory, read like a :class:`~topkd.store.TeacherStore` (what
    :class:`~topkd.hf.KDTrainer` and :class:`~topkd.hf.KDCollator` use of one): ``get``,
    ``ids``, ``k``, ``vocab_size``, ``temperature``, ``kind``, ``samples``, ``manifest``.

    ``rows``: ``{sample_id: teacher}``, each a :class:`~topkd.SparseTeacher` ``[L, K]`` or a
    :class:`~topkd.SampledTeacher` ``[L, S]`` (all of one kind, temperature and vocabulary),
    with the tokens it was made from under ``tokens`` (``{sample_id: [L]}``; checked on
    ``get`` when given).
    """

    path = "<in memory>"

    def __init__(self, rows: dict, tokens: dict | None = None):
        self._rows, self._tokens = dict(rows), tokens
        first = next(iter(self._rows.values()), None)
        if first is None:
            raise ValueError("TeacherRows needs at least one sequence's rows")
        self.kind = "sampled" if isinstance(first, SampledTeacher) else "topk"
        kinds = {type(t) for t in self._rows.values()}
        if len(kinds) > 1 or not kinds <= {SampledTeacher, SparseTeacher}:
            raise TypeError(f"TeacherRows: every teacher must be a SparseTeacher, or every one "
                            f"a SampledTeacher, got {sorted(k.__name__ for k in kinds)}")
        self.vocab_size, self.temperature = first.vocab_size, first.temperature
        self.samples = first.samples if self.kind == "sampled" else None
        self.k = None if self.kind == "sampled" else first.k
        self.manifest = {"kind": self.kind, "samples": self.samples, "k": self.k,
                         "vocab_size": self.vocab_size, "temperature": self.temperature}

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, sample_id) -> bool:
        return sample_id in self._rows

    def ids(self) -> list:
        return list(self._rows)

    def get(self, sample_id, input_ids=None):
        if sample_id not in self._rows:
            raise KeyError(f"sample_id {sample_id!r} is not in these teacher rows")
        teacher = self._rows[sample_id]
        if input_ids is not None and self._tokens is not None:
            if not torch.equal(torch.as_tensor(input_ids).reshape(-1).long(),
                               torch.as_tensor(self._tokens[sample_id]).reshape(-1).long()):
                raise ValueError(f"sample_id {sample_id!r}: the token ids given are not the "
                                 f"ones its teacher rows were made from")
        return teacher

    def nbytes(self, *, index_bytes: int = 4) -> int:
        """For sampled rows: :func:`sampled_row_bytes` of every sequence."""
        if self.kind != "sampled":
            raise ValueError("nbytes is measured for sampled rows only")
        return sum(sampled_row_bytes(t, index_bytes=index_bytes) for t in self._rows.values())
