"""Teacher rows from a serving engine: normalized top-k log-probs per position (what vLLM's and
SGLang's ``prompt_logprobs`` return) turned into :class:`~topkd.SparseTeacher` rows with the
ghost bucket, and a JSON Lines file of them imported into a store.

The JSON Lines layout (one sequence per line)::

    {"id": "doc-1", "input_ids": [t0, t1, ..., t(L-1)],
     "topk_ids": [[i, i, ...], ... L rows], "topk_logprobs": [[lp, lp, ...], ... L rows]}

Row ``t`` is the teacher's distribution of the token after ``input_ids[t]`` (the row a causal
LM's logits at position ``t`` give), its log-probs normalized over the whole vocabulary. A
row may hold any number of entries (the k most probable, and whatever else the engine adds);
the store keeps its ``k`` most probable, and the ghost is the mass of everything else. ``id``
is optional (default: the 0-based line number).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import numpy as np
import torch

from .. import _checks
from ..teacher import SparseTeacher

# How far above 0 a row's total log-mass may round before the row is refused as not
# normalized (engines compute log-softmax in float32).
SUM_TOLERANCE = 1e-4


def ghost_logprob(logprobs: np.ndarray) -> np.ndarray:
    """``log(1 - sum(exp(logprobs)))`` per row of a float64 ``[L, n]`` array (``-inf`` pads),
    without losing the ghost when the kept mass is close to 1.

    The kept log-mass is ``s = m + log1p(sum exp(lp - m) - 1)`` over the row (``m`` its
    largest), and the ghost ``log(-expm1(s))``: when one entry holds nearly all the mass, ``s``
    keeps the digits of ``m`` itself, so a ghost of 1e-12 (or 1e-300) comes out to float64's
    relative precision, not to 1e-16 / ghost. A row whose log-probs sum to 1 or more (within
    rounding) has ghost ``-inf``: nothing is left out."""
    top = logprobs.max(axis=1, initial=-math.inf)
    finite = np.isfinite(top)
    safe = np.where(finite, top, 0.0)
    rest = np.exp(logprobs - safe[:, None])
    # the largest entry contributes exactly 1; sum the others without it
    first = np.argmax(logprobs, axis=1)
    rest[np.arange(len(rest)), first] = 0.0
    kept = safe + np.log1p(rest.sum(axis=1))
    with np.errstate(divide="ignore", invalid="ignore"):
        ghost = np.where(kept < 0, np.log(-np.expm1(np.minimum(kept, 0.0))), -math.inf)
    return np.where(finite, ghost, 0.0)  # a row with nothing kept: all the mass is the ghost


def teacher_from_logprobs(token_ids: Sequence, logprobs: Sequence, *, k: int, vocab_size: int,
                          temperature: float = 1.0) -> SparseTeacher:
    """One sequence's teacher from per-position top-k log-probs.

    Args:
        token_ids: per position, the vocabulary ids of its entries (a list of lists, ragged
            allowed, or an integer array ``[L, n]``).
        logprobs: per position, their log-probs, normalized over the whole vocabulary (the
            same shapes; float64 keeps the most of a ghost near 0).
        k: entries kept per row: each row's ``k`` most probable (ties: lower id); rows with
            fewer get unused slots (``-1`` / ``-inf``), as top-p makes them.
        vocab_size: the vocabulary the log-probs are normalized over.
        temperature: the temperature the engine normalized at (recorded, not applied).

    Returns a :class:`~topkd.SparseTeacher` ``[L, k]`` whose ``rest_logprob`` is
    :func:`ghost_logprob` of each row's kept entries, computed in float64, then float32.
    Raises ValueError naming the position for ids outside the vocabulary or repeated in a
    row, NaN or +inf log-probs, or a row whose probabilities sum past 1.
    """
    vocab_size = _checks.integer("vocab_size", vocab_size, 1, _checks.MAX_VOCAB)
    k = _checks.integer("k", k, 1, vocab_size)
    temperature = _checks.temperature(temperature)
    ids, values = _rows(token_ids, logprobs)
    if ids.size and (int(ids.min()) < -1 or int(ids.max()) >= vocab_size):
        row = int(np.argwhere((ids < -1) | (ids >= vocab_size))[0, 0])
        raise ValueError(f"token_ids must lie in [0, vocab_size={vocab_size}), got "
                         f"{[int(i) for i in ids[row] if i != -1]} at position {row}")
    used = ids >= 0
    if np.isnan(values[used]).any() or np.isposinf(values).any():
        row = int(np.argwhere(used & (np.isnan(values) | np.isposinf(values)))[0, 0])
        raise ValueError(f"logprobs must not be NaN or +inf, got {values[row][used[row]]} at "
                         f"position {row}")
    # each row by log-prob descending, ties by lower id; padding last
    order = np.lexsort((np.where(used, ids, np.iinfo(np.int64).max),
                        -np.where(used, values, -math.inf)), axis=1)
    ids = np.take_along_axis(ids, order, axis=1)
    values = np.take_along_axis(values, order, axis=1)
    used = ids >= 0
    distinct_pads = np.where(used, ids, -1 - np.arange(ids.shape[1]))
    ordered = np.sort(distinct_pads, axis=1)
    repeated = (ordered[:, 1:] == ordered[:, :-1]).any(axis=1)
    if repeated.any():
        row = int(np.argmax(repeated))
        raise ValueError(f"token_ids repeat an id within a row at position {row}: "
                         f"{ids[row][used[row]].tolist()}")
    mass = _log_mass(np.where(used, values, -math.inf))
    if (mass > SUM_TOLERANCE).any():
        row = int(np.argmax(mass))
        raise ValueError(f"logprobs must be normalized over the vocabulary: position {row}'s "
                         f"probabilities sum to {math.exp(mass[row]):.6g} > 1")
    length = ids.shape[0]
    out_ids = np.full((length, k), -1, np.int64)
    out_values = np.full((length, k), -math.inf)
    width = min(k, ids.shape[1])
    out_ids[:, :width], out_values[:, :width] = ids[:, :width], values[:, :width]
    kept = out_ids >= 0
    out_values[~kept] = -math.inf
    rest = ghost_logprob(out_values)
    if vocab_size == k:
        rest = np.where(kept.all(axis=1), -math.inf, rest)
    return SparseTeacher(torch.from_numpy(out_ids), torch.from_numpy(out_values).float(),
                         torch.from_numpy(rest).float(), temperature, vocab_size)


def _log_mass(values: np.ndarray) -> np.ndarray:
    top = values.max(axis=1, initial=-math.inf)
    safe = np.where(np.isfinite(top), top, 0.0)
    with np.errstate(divide="ignore"):
        return np.where(np.isfinite(top),
                        safe + np.log(np.exp(values - safe[:, None]).sum(axis=1)), -math.inf)


def _rows(token_ids, logprobs) -> tuple[np.ndarray, np.ndarray]:
    """Ragged per-position lists (or arrays) as padded ``[L, n]`` int64 / float64 arrays
    (pads: id ``-1``, log-prob ``-inf``)."""
    if isinstance(token_ids, (np.ndarray, torch.Tensor)) and len(np.shape(token_ids)) == 2:
        ids = np.asarray(token_ids)
        values = np.asarray(logprobs, dtype=np.float64)
        if ids.dtype.kind not in "iu":
            raise TypeError(f"token_ids must be integers, got dtype {ids.dtype}")
        if values.shape != ids.shape:
            raise ValueError(f"logprobs has shape {values.shape}, token_ids {ids.shape}")
        return ids.astype(np.int64), values
    if len(token_ids) != len(logprobs):
        raise ValueError(f"token_ids has {len(token_ids)} positions, logprobs "
                         f"{len(logprobs)}")
    width = max((len(row) for row in token_ids), default=0)
    ids = np.full((len(token_ids), width), -1, np.int64)
    values = np.full((len(token_ids), width), -math.inf)
    for t, (row_ids, row_values) in enumerate(zip(token_ids, logprobs, strict=True)):
        if len(row_ids) != len(row_values):
            raise ValueError(f"position {t}: {len(row_ids)} token_ids but {len(row_values)} "
                             f"logprobs")
        if any(isinstance(i, bool) or not isinstance(i, (int, np.integer)) for i in row_ids):
            raise TypeError(f"position {t}: token_ids must be integers, got {row_ids[:5]}")
        ids[t, : len(row_ids)] = row_ids
        values[t, : len(row_values)] = row_values
    return ids, values


def import_jsonl(data, out, *, k: int, vocab_size: int, codec: str | None = None,
                 temperature: float = 1.0, tokenizer_fingerprint: str | None = None,
                 id_field: str = "id", ids_field: str = "input_ids",
                 shard_bytes: int = 256 * 2**20) -> dict:
    """Import a JSON Lines file of per-position top-k log-probs (the layout in this module's
    docstring) into the store at ``out`` (created, or resumed: ids already stored are skipped).
    Returns ``{"added", "skipped", "tokens", "path"}``."""
    from .build import jsonl_rows
    from .writer import TeacherStoreWriter, writer_codec

    vocab_size = _checks.integer("vocab_size", vocab_size, 1, _checks.MAX_VOCAB)
    k = _checks.integer("k", k, 1, vocab_size)
    writer_codec(codec, None)
    if not os.path.isfile(data):
        raise FileNotFoundError(f"data {data!r} is not a file")
    added = skipped = tokens = 0
    with TeacherStoreWriter(out, k=k, vocab_size=vocab_size, temperature=temperature,
                            codec=codec, tokenizer_fingerprint=tokenizer_fingerprint,
                            metadata={"source": "imported top-k log-probs"},
                            shard_bytes=shard_bytes) as writer:
        for line_number, where, item in jsonl_rows(data, "not JSON ({})"):
            missing = [f for f in (ids_field, "topk_ids", "topk_logprobs") if f not in item]
            if missing:
                raise ValueError(f"{where}: missing {missing} (has {sorted(item)})")
            sample_id = item.get(id_field, line_number)
            if sample_id in writer:
                skipped += 1
                continue
            input_ids = item[ids_field]
            if len(item["topk_ids"]) != len(input_ids):
                raise ValueError(f"{where}: {len(input_ids)} input_ids but "
                                 f"{len(item['topk_ids'])} rows of topk_ids (one per token)")
            try:
                teacher = teacher_from_logprobs(item["topk_ids"], item["topk_logprobs"], k=k,
                                                vocab_size=vocab_size, temperature=temperature)
            except (ValueError, TypeError) as e:
                raise type(e)(f"{where}: {e}") from None
            writer.add(sample_id, torch.tensor(input_ids, dtype=torch.int64), teacher)
            added += 1
            tokens += len(input_ids)
    return {"added": added, "skipped": skipped, "tokens": tokens, "path": os.fspath(out)}
