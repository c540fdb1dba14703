"""Argument checks, run before any work (and before any collective)."""

from __future__ import annotations

import math
import numbers

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
REDUCTIONS = ("none", "sum", "mean")
NORMALIZE = ("full", "topk")


def logits(name: str, x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{name} must be float32, bfloat16 or float16, got dtype {x.dtype}"
        )
    if x.dim() < 1:
        raise ValueError(f"{name} must have a vocabulary dimension, got shape {tuple(x.shape)}")
    if x.shape[-1] < 1:
        raise ValueError(f"{name} has an empty vocabulary dimension: shape {tuple(x.shape)}")


def integer(name: str, value, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    value = int(value)
    if value < low or (high is not None and value > high):
        bound = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be in {bound}, got {value}")
    return value


def real(name: str, value, ok, requirement: str) -> float:
    """``value`` as a float, if it is a real number (not a bool) for which ``ok`` holds."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {value!r}")
    value = float(value)
    if not math.isfinite(value) or not ok(value):
        raise ValueError(f"{name} must be finite and {requirement}, got {value}")
    return value


_F32 = torch.finfo(torch.float32)
# How far past 1 (as a log) a SparseTeacher row's mass may sum: a store in bfloat16 rounds
# each log-prob by up to 2^-8 of itself, so a row's sum by up to 2^-8 times its entropy, at
# most log K (3.2% at K = 4,096; float16 8x less; measured on float16 rows: 3.4e-4).
_MASS_SLACK = math.log1p(5e-2)


def temperature(value, name: str = "temperature") -> float:
    """A temperature: finite, > 0, and a float32 normal number (the logits are divided by it
    in float32: past that range they would be 0 or inf, and the loss NaN)."""
    return real(name, value, lambda x: _F32.tiny <= x <= _F32.max,
                f"> 0, in float32's normal range [{_F32.tiny:.3g}, {_F32.max:.3g}]")


def process_group(value):
    """None or a ``torch.distributed`` process group (a bare AttributeError from inside
    torch.distributed otherwise)."""
    if value is None:
        return None
    import torch.distributed as dist

    if not dist.is_available() or not isinstance(value, dist.ProcessGroup):
        raise TypeError(f"process_group must be a torch.distributed ProcessGroup or None, got "
                        f"{value!r} ({type(value).__name__})")
    return value


def top_p(value, min_k) -> tuple[float | None, int]:
    min_k = integer("top_p_min_k", min_k, 1)
    if value is None:
        return None, min_k
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"top_p must be a real number or None, got {value!r}")
    value = float(value)
    if not (0.0 < value <= 1.0):
        raise ValueError(f"top_p must be in (0, 1], got {value}")
    return value, min_k


def choice(name: str, value, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    return value


def same_leading(name_a: str, a: torch.Size, name_b: str, b: torch.Size) -> None:
    if tuple(a) != tuple(b):
        raise ValueError(
            f"{name_a} and {name_b} must have the same leading shape, got {tuple(a)} and {tuple(b)}"
        )


def mask(value, lead_shape: tuple[int, ...]) -> None:
    if value is None:
        return
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"mask must be a bool torch.Tensor or None, got {type(value).__name__}")
    if value.dtype != torch.bool:
        raise TypeError(f"mask must have dtype torch.bool, got {value.dtype}")
    if tuple(value.shape) != tuple(lead_shape):
        raise ValueError(
            f"mask must have the logits' leading shape {tuple(lead_shape)}, "
            f"got {tuple(value.shape)}"
        )


def teacher_mask(value, teacher, lead_shape: tuple[int, ...]):
    """The rows a loss keeps: its own ``mask`` and a :class:`SparseTeacher`'s padding mask."""
    if teacher.mask is None:
        return value
    if not isinstance(teacher.mask, torch.Tensor) or teacher.mask.dtype != torch.bool:
        raise TypeError(f"teacher.mask must be a bool torch.Tensor or None, got "
                        f"{getattr(teacher.mask, 'dtype', type(teacher.mask).__name__)}")
    if tuple(teacher.mask.shape) != tuple(lead_shape):
        raise ValueError(f"teacher.mask must have the leading shape {tuple(lead_shape)}, "
                         f"got {tuple(teacher.mask.shape)}")
    return teacher.mask if value is None else value & teacher.mask


def integer_tensor(name: str, value) -> None:
    """``value`` is a tensor of an integer dtype (not bool)."""
    if (not isinstance(value, torch.Tensor) or value.dtype == torch.bool
            or value.dtype.is_floating_point or value.dtype.is_complex):
        raise TypeError(f"{name} must be an integer tensor, got "
                        f"{getattr(value, 'dtype', type(value).__name__)}")


def floating_tensor(name: str, value) -> None:
    """``value`` is a tensor of a floating-point dtype."""
    if not isinstance(value, torch.Tensor) or not value.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating-point tensor, got "
                        f"{getattr(value, 'dtype', type(value).__name__)}")


def _row_at(flat: int, lead_shape) -> tuple[int, ...]:
    """The position in ``lead_shape`` of row ``flat`` of its flattened rows."""
    return tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), tuple(lead_shape)))


def sparse_teacher(teacher, keep=None, masses: bool = True) -> None:
    """A :class:`~topkd.SparseTeacher`'s tensors: their dtypes and shapes, then, on the rows a
    loss keeps (``keep``: bool with the leading shape, or None for all), their values (one
    host sync): indices in ``[-1, vocab_size)``, none twice in a row, ``-inf`` log-probs
    at the unused slots (-1), and with ``masses`` (a loss that takes the log-probs as they
    are: ``normalize="full"``; ``"topk"`` renormalizes them) masses, kept and rest, summing
    to at most 1 (+5%, for rounded stores; raw logits given as log-probs sum far past it).
    Out of range, an index would be dropped or give inf; twice, its mass would count twice:
    a wrong number. A teacher checked before (or made by :func:`topkd.select_topk`) and
    unchanged since (its tensors' in-place versions) is not read again: one valid on every
    row, whatever ``keep``; one valid on kept rows only, while ``keep`` is the same unchanged
    tensor."""
    indices, logprobs, rest = teacher.indices, teacher.logprobs, teacher.rest_logprob
    integer_tensor("SparseTeacher.indices", indices)
    floating_tensor("SparseTeacher.logprobs", logprobs)
    floating_tensor("SparseTeacher.rest_logprob", rest)
    if indices.dim() < 1 or logprobs.shape != indices.shape:
        raise ValueError(f"SparseTeacher.logprobs must have indices' shape [..., K] "
                         f"{tuple(indices.shape)}, got {tuple(logprobs.shape)}")
    if rest.shape != indices.shape[:-1]:
        raise ValueError(f"SparseTeacher.rest_logprob must have indices' leading shape "
                         f"{tuple(indices.shape[:-1])}, got {tuple(rest.shape)}")
    if indices.shape[-1] == 0:
        raise ValueError(f"SparseTeacher must keep K >= 1 entries a row, got indices "
                         f"{tuple(indices.shape)}")
    vocab = integer("SparseTeacher.vocab_size", teacher.vocab_size, 1)
    temperature(teacher.temperature, "SparseTeacher.temperature")
    if indices.numel() == 0 or _checked(teacher, keep, masses):
        return
    k = indices.shape[-1]
    idx, logq = indices.reshape(-1, k).long(), logprobs.reshape(-1, k)
    outside = (idx < -1) | (idx >= vocab)
    unused_mass = (idx == -1) & (logq > float("-inf"))
    ids, twice = repeated(idx, idx >= 0)
    bad = outside.any(-1) | unused_mass.any(-1) | twice.any(-1)
    if masses:
        mass = torch.logaddexp(torch.logsumexp(logq.float(), -1), rest.reshape(-1).float())
        bad |= mass > _MASS_SLACK
    if not bool(bad.any()):  # valid on every row: whatever rows a later call keeps
        mark_checked(teacher, None, masses)
        return
    if keep is not None:
        bad &= keep.reshape(-1).to(bad.device)
        if not bool(bad.any()):
            mark_checked(teacher, keep, masses)
            return
    row = int(bad.nonzero()[0, 0])
    at = _row_at(row, indices.shape[:-1])
    if outside[row].any():
        seen = int(idx[row][outside[row]][0])
        raise ValueError(f"SparseTeacher.indices must lie in [-1, vocab_size={vocab}) (-1: an "
                         f"unused slot); row {at} holds {seen}")
    if twice[row].any():
        seen = int(ids[row, 1:][twice[row]][0])
        raise ValueError(f"SparseTeacher.indices must hold each vocabulary index at most once "
                         f"per row; row {at} holds {seen} more than once")
    if masses and mass[row] > _MASS_SLACK:
        raise ValueError(f"SparseTeacher.logprobs and rest_logprob must be log-probabilities "
                         f"of at most the whole mass (a row's kept masses and rest sum to 1, "
                         f"or less where the rest is left out); row {at} sums to "
                         f"{float(mass[row].exp()):.6g}")
    slot = int(unused_mass[row].nonzero()[0, 0])
    raise ValueError(f"SparseTeacher.logprobs must be -inf at the unused slots (index -1); "
                     f"row {at} has {float(logq[row, slot])} at slot {slot}")


def _versions(teacher, keep):
    """What :func:`sparse_teacher` read: the tensors themselves and their in-place versions
    (None where a tensor has no version counter: an inference-mode tensor)."""
    try:
        return ((teacher.indices, teacher.indices._version),
                (teacher.logprobs, teacher.logprobs._version),
                (teacher.rest_logprob, teacher.rest_logprob._version), teacher.vocab_size,
                None if keep is None else (keep, keep._version))
    except RuntimeError:
        return None


def mark_checked(teacher, keep=None, masses: bool = True) -> None:
    """Record that ``teacher`` holds valid values on the rows ``keep`` keeps (None: all rows),
    its masses included where ``masses``, so that :func:`sparse_teacher` need not read them
    again while they are unchanged."""
    seen = _versions(teacher, keep)
    teacher.__dict__["_checked"] = None if seen is None else (*seen, masses)


def _same(a, b) -> bool:
    """Two ``(tensor, version)`` of :func:`_versions`: one tensor, unchanged between them."""
    return a[0] is b[0] and a[1] == b[1]


def _checked(teacher, keep, masses: bool = True) -> bool:
    """Whether :func:`mark_checked` recorded ``teacher`` as it is now, on every row or on the
    rows ``keep`` keeps, its masses included where ``masses``."""
    seen, now = teacher.__dict__.get("_checked"), _versions(teacher, keep)
    if seen is None or now is None or (masses and not seen[-1]):
        return False
    *tensors, vocab, kept, _ = seen
    *tensors_now, vocab_now, keep_now = now
    if vocab != vocab_now or not all(map(_same, tensors, tensors_now)):
        return False
    return kept is None or (keep_now is not None and _same(kept, keep_now))


def teacher_temperature(value, teacher) -> None:
    """A temperature given next to a :class:`SparseTeacher` must be the one it was made at."""
    if value is not None and temperature(value) != teacher.temperature:
        raise ValueError(f"temperature={value} differs from the SparseTeacher's temperature "
                         f"{teacher.temperature} (the teacher was normalized at it)")


# Vocabulary indices travel as int32 and sort under a packed int64 key (see topk.py).
MAX_VOCAB = 2**31 - 2


def vocab_size(value, *widths: tuple[str, int]) -> int:
    """The vocabulary the distributions live on: ``value`` or the common width.

    ``widths`` are ``(name, full width)`` pairs; without ``value`` they must agree, and with it,
    ``value`` must fit inside each.
    """
    seen = ", ".join(f"{n} {w}" for n, w in widths)
    if value is None:
        if len({w for _, w in widths}) > 1:
            raise ValueError(
                f"vocabulary widths differ ({seen}); pass vocab_size= no larger than the "
                f"smallest to use the common prefix"
            )
        value = widths[0][1]
    else:
        value = integer(f"vocab_size (vocabulary widths: {seen})", value, 1,
                        min(w for _, w in widths))
    if value > MAX_VOCAB:
        raise ValueError(f"vocabularies up to {MAX_VOCAB} entries are supported, got {value}")
    return value


def chunk_bytes(value) -> int | None:
    return None if value is None else integer("chunk_bytes", value, 1)


def weight(name: str, value) -> float:
    """A loss weight: a finite real number >= 0."""
    return real(name, value, lambda x: x >= 0, ">= 0")


def scale(name: str, value) -> float:
    """A logit scale: a finite real number != 0."""
    return real(name, value, lambda x: x != 0, "nonzero")


def softcap(name: str, value) -> float | None:
    """A logit softcap: None or a finite real number > 0."""
    return None if value is None else real(name, value, lambda x: x > 0, "> 0")


def labels(value, lead_shape, device):
    """``labels``: None, or an integer tensor of the logits' leading shape; returned as int64
    ``[n]`` on ``device``."""
    if value is None:
        return None
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"labels must be an integer torch.Tensor or None, got "
                        f"{type(value).__name__}")
    if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
        raise TypeError(f"labels must have an integer dtype (int64), got {value.dtype}")
    if tuple(value.shape) != tuple(lead_shape):
        raise ValueError(f"labels must have the logits' leading shape {tuple(lead_shape)}, "
                         f"got {tuple(value.shape)}")
    return value.reshape(-1).to(device=device, dtype=torch.int64)


def label_range(labels, ignore_index: int, vocab: int) -> None:
    """Every label (if there are labels) is in ``[0, vocab)`` or ``ignore_index``."""
    if labels is None:
        return
    bad = ((labels < 0) | (labels >= vocab)) & (labels != ignore_index)
    if bool(bad.any()):
        seen = labels[bad][:5].tolist()
        raise ValueError(f"labels must be in [0, {vocab}) or ignore_index={ignore_index}; "
                         f"got {seen}{' ...' if int(bad.sum()) > 5 else ''}")


def teacher_vocab(vocab: int, teacher, student_desc: str) -> None:
    if vocab != teacher.vocab_size:
        raise ValueError(f"the teacher was normalized over vocab_size={teacher.vocab_size} but "
                         f"the student's vocabulary is {vocab} ({student_desc})")


def aligned(shards, vocab: int) -> int:
    """This rank's real columns, after checking student and teacher are sharded alike."""
    student, teacher = shards["student"], shards["teacher"]
    valid = student.valid(vocab)
    if (student.offset, valid) != (teacher.offset, teacher.valid(vocab)):
        raise ValueError(
            "the student and teacher logits must be sharded alike over the vocabulary: this "
            f"rank holds student columns from {student.offset} ({student.width} wide) and "
            f"teacher columns from {teacher.offset} ({teacher.width} wide)"
        )
    return valid


def repeated(indices: torch.Tensor, used: torch.Tensor):
    """``(ids, twice)`` of ``indices`` ``[..., K]``: each row sorted with its unused slots
    (``used`` False) as -1 (first), and, for each entry past the first, whether it repeats
    the used one before it."""
    ids = torch.where(used, indices.long(), -1).sort(-1).values
    return ids, (ids[..., 1:] == ids[..., :-1]) & (ids[..., 1:] >= 0)


def sampled_teacher(teacher, keep=None) -> None:
    """A :class:`~topkd.SampledTeacher`'s tensors: shapes, dtypes, its temperature, and on the
    rows a loss keeps (``keep``: bool with the leading shape, or None for the rows of the
    teacher's own ``mask``), distinct ids with counts summing to ``samples`` (or to 0: a row
    of no draws, which contributes nothing) (one host sync)."""
    indices, counts = teacher.indices, teacher.counts
    integer("samples", teacher.samples, 1)
    temperature(teacher.temperature, "SampledTeacher.temperature")
    for name, t in (("indices", indices), ("counts", counts)):
        integer_tensor(f"SampledTeacher.{name}", t)
    if indices.dim() < 1 or counts.shape != indices.shape:
        raise ValueError(f"SampledTeacher.counts must have indices' shape "
                         f"{tuple(indices.shape)}, got {tuple(counts.shape)}")
    if teacher.logprobs is not None:
        floating_tensor("SampledTeacher.logprobs", teacher.logprobs)
        if teacher.logprobs.shape != indices.shape:
            raise ValueError(f"SampledTeacher.logprobs must have indices' shape "
                             f"{tuple(indices.shape)}, got {tuple(teacher.logprobs.shape)}")
    if indices.numel() == 0:
        return
    used = counts > 0
    twice = repeated(indices, used)[1].any(-1)
    total = counts.long().sum(-1)  # (0: a padding row of no draws, which counts nothing)
    bad = (twice | ((total != teacher.samples) & (total != 0)) | (counts < 0).any(-1)
           | (used & ((indices < 0) | (indices >= teacher.vocab_size))).any(-1))
    keep = teacher.mask if keep is None else keep  # (a loss's keep includes teacher.mask)
    if keep is not None:
        bad = bad & keep.to(bad.device)
    if bool(bad.any()):
        at = _row_at(int(bad.reshape(-1).nonzero()[0, 0]), bad.shape)
        raise ValueError(f"SampledTeacher: every row must hold distinct ids in [0, "
                         f"{teacher.vocab_size}) with counts >= 0 summing to samples="
                         f"{teacher.samples} (use topkd.sample_teacher); row {at} holds ids "
                         f"{indices[at].tolist()} with counts {counts[at].tolist()}")
