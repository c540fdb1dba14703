"""Checking a whole teacher store: every byte of every shard against its recorded hashes."""

from __future__ import annotations

import json
import os

import numpy as np
import torch

from .. import _checks
from . import codec
from . import format as fmt
from .shard import open_file, shard_ids


def verify_store(path: str) -> list[str]:
    """Every problem found in the store at ``path``, one line each naming its file; empty when
    the store is whole. Reads every shard in full (SHA-256 of each tensor), checks the
    per-sequence layout, checksums and stored token ids (against their token hashes), and that
    no sample id is stored twice."""
    path = os.fspath(path)
    try:
        manifest = fmt.read_manifest(path)
    except (FileNotFoundError, ValueError) as e:
        return [str(e)]
    problems, seen = [], {}
    for file in fmt.shard_files(path):
        try:
            ids = _verify_shard(path, file, manifest)
        except ValueError as e:
            problems.append(str(e))
            continue
        for sample_id in ids:
            if sample_id in seen:
                problems.append(f"{os.path.join(path, file)}: sample_id {sample_id!r} is also "
                                f"in {seen[sample_id]}")
            seen[sample_id] = file
    return problems


def _verify_shard(path: str, file: str, manifest: dict) -> list:
    where = os.path.join(path, file)

    def bad(message):
        return ValueError(f"{where}: {message}")

    with open_file(path, file) as handle:
        metadata = handle.metadata() or {}
        ids = shard_ids(metadata, where, path)
        try:
            hashes = json.loads(metadata["sha256"])
        except (KeyError, json.JSONDecodeError):
            raise bad("header metadata (sha256) missing or unreadable") from None
        version = manifest["format_version"]
        sampled = manifest["kind"] == "sampled"
        required = ((fmt.REQUIRED_TENSORS_SAMPLED if version >= 3 else
                     fmt.REQUIRED_TENSORS_SAMPLED_V2) if sampled else
                    fmt.REQUIRED_TENSORS if version == fmt.PLAIN_VERSION else
                    fmt.REQUIRED_TENSORS_V2)
        missing = [name for name in required if name not in handle.keys()]
        if missing:
            raise bad(f"tensors {missing} are missing")
        if set(hashes) != set(handle.keys()):
            raise bad(f"tensors {sorted(handle.keys())} differ from the hashed ones "
                      f"{sorted(hashes)}")
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    for name, t in tensors.items():
        if fmt.sha256(t) != hashes[name]:
            raise bad(f"tensor {name!r} does not match its SHA-256 (the file was altered)")
    if sampled and version >= 3:
        tokens = _check_rows_sampled(tensors, ids, manifest, bad)
    else:
        check = (_check_rows_sampled_v2 if sampled else _check_rows_v1
                 if version == fmt.PLAIN_VERSION else _check_rows_v2)
        check(tensors, ids, manifest, bad)
        tokens = tensors.get(fmt.TOKENS)
    rows = tensors["seq_rows"].tolist()
    if manifest["store_tokens"] and tokens is None:
        raise bad(f"no {fmt.TOKENS} though the manifest says store_tokens=true")
    if tokens is not None and (tokens.dtype != fmt.TOKEN_DTYPE
                               or tuple(tokens.shape) != (rows[-1],)):
        raise bad(f"{fmt.TOKENS} is {tokens.dtype} {tuple(tokens.shape)}, expected "
                  f"{fmt.TOKEN_DTYPE} ({rows[-1]},)")
    for i, sample_id in enumerate(ids):
        if tokens is not None and fmt.token_hash(tokens[rows[i]:rows[i + 1]]) != bytes(
                tensors["token_hash"][i].tolist()):
            raise bad(f"sample_id {sample_id!r}: its {fmt.TOKENS} do not match its token hash")
    return ids


def _check_offsets(tensors, ids, rows, starts, tokens: int, end: int, bad, agree: bool) -> None:
    """A shard's per-sequence offsets (``rows`` into its ``tokens`` token rows, ``starts``
    into its ``end`` entries or bytes) start at 0, rise, and end there; its ``token_hash`` and
    ``crc`` hold one entry per sequence; and the format's own checks ``agree``."""
    if not (len(rows) == len(starts) == len(ids) + 1 and rows[0] == starts[0] == 0
            and rows == sorted(rows) and starts == sorted(starts) and rows[-1] == tokens
            and starts[-1] == end and tuple(tensors["token_hash"].shape) == (len(ids), 16)
            and tensors["crc"].shape[0] == len(ids) and agree):
        raise bad("sequence offsets, counts and array lengths disagree")


def _check_sum(tensors, parts, i, sample_id, version, bad) -> None:
    if fmt.checksum(parts, version) != int(tensors["crc"][i]):
        raise bad(f"sample_id {sample_id!r}: {fmt.CHECKSUMS[version]} checksum mismatch")


def _sequences(tensors, ids, rows, starts, crc_parts, version, bad):
    """``(i, sample_id, payload, r0, r1)`` of every sequence of an encoded shard (its bytes
    of ``payload``, its rows ``r0:r1``), once its checksum (over ``crc_parts``) holds."""
    for i, sample_id in enumerate(ids):
        _check_sum(tensors, crc_parts(tensors, rows, starts, i), i, sample_id, version, bad)
        yield (i, sample_id, tensors["payload"][starts[i]:starts[i + 1]].numpy(), rows[i],
               rows[i + 1])


def _decoded(sample_id, bad, decode, *args):
    """``decode(*args)``, its ValueError raised as ``bad`` naming ``sample_id``."""
    try:
        return decode(*args)
    except ValueError as e:
        raise bad(f"sample_id {sample_id!r}: {e}") from None


def _check_rows_v1(tensors, ids, manifest, bad) -> None:
    rows, entries = tensors["seq_rows"].tolist(), tensors["seq_entries"].tolist()
    k = manifest["k"]
    counts = tensors.get("counts")
    tokens = tensors["rest_logprob"].shape[0]
    expected_entries = tokens * k if counts is None else int(counts.sum())
    _check_offsets(tensors, ids, rows, entries, tokens, tensors["indices"].shape[0], bad,
                   tensors["indices"].shape[0] == tensors["logprobs"].shape[0]
                   == expected_entries)
    if str(tensors["logprobs"].dtype) != f"torch.{manifest['logprob_dtype']}":
        raise bad(f"logprobs are {tensors['logprobs'].dtype}, the manifest says "
                  f"{manifest['logprob_dtype']}")
    for i, sample_id in enumerate(ids):
        _check_sum(tensors, fmt.crc_parts(tensors, rows, entries, i), i, sample_id,
                   fmt.PLAIN_VERSION, bad)


def _check_rows_sampled(tensors, ids, manifest, bad) -> torch.Tensor | None:
    """Format 3: the offsets agree, every checksum holds, and every sequence decodes (its
    payload's length exactly what its sections say) to rows of distinct in-vocabulary ids
    (their counts sum to ``samples`` by construction). Returns the token ids decoded
    (int32 ``[T]``), or None when the store keeps none."""
    rows, starts = tensors["seq_rows"].tolist(), tensors["seq_bytes"].tolist()
    samples, vocab = manifest["samples"], manifest["vocab_size"]
    has_tokens = bool(manifest["store_tokens"])
    _check_offsets(tensors, ids, rows, starts, rows[-1] if rows else 0,
                   tensors["payload"].shape[0], bad,
                   tuple(tensors["seq_width"].shape) == (len(ids),))
    tokens = []
    for i, sample_id, payload, r0, r1 in _sequences(tensors, ids, rows, starts,
                                                    fmt.crc_parts_sampled, 3, bad):
        indices, _ = _decoded(sample_id, bad, codec.decode_sampled, payload,
                              int(tensors["seq_width"][i]), r1 - r0, vocab, samples, has_tokens)
        used = indices >= 0
        if (indices >= vocab).any() or (used[:, 1:] & (indices[:, 1:] <= indices[:, :-1])).any():
            raise bad(f"sample_id {sample_id!r}: decodes to ids outside the vocabulary or "
                      f"repeated ids")
        if has_tokens:
            tokens.append(torch.from_numpy(codec.sampled_tokens(payload, r1 - r0, vocab)))
    if not has_tokens:
        return None
    return (torch.cat(tokens) if tokens else torch.zeros(0, dtype=torch.int64)).to(
        fmt.TOKEN_DTYPE)


def _check_rows_sampled_v2(tensors, ids, manifest, bad) -> None:
    """Format 2: the offsets and lengths agree, every CRC-32 holds, and every sequence
    decodes to rows of distinct in-vocabulary ids whose counts sum to ``samples``."""
    rows, starts = tensors["seq_rows"].tolist(), tensors["seq_bytes"].tolist()
    samples, vocab = manifest["samples"], manifest["vocab_size"]
    lengths = tensors["counts"]
    _check_offsets(tensors, ids, rows, starts, lengths.shape[0], tensors["payload"].shape[0],
                   bad, lengths.dtype == torch.uint8
                   and tuple(tensors["seq_width"].shape) == (len(ids),))
    for i, sample_id, payload, r0, r1 in _sequences(tensors, ids, rows, starts,
                                                    fmt.crc_parts_sampled, 2, bad):
        indices, counts = _decoded(sample_id, bad, codec.decode_counts, payload,
                                   int(tensors["seq_width"][i]), lengths[r0:r1].numpy(), vocab,
                                   samples)
        if (indices >= vocab).any() or (counts.sum(-1) != samples).any():
            raise bad(f"sample_id {sample_id!r}: ids outside the vocabulary or counts that do "
                      f"not sum to samples={samples}")


def _check_rows_v2(tensors, ids, manifest, bad) -> None:
    """The offsets and lengths agree, every checksum holds, and every sequence decodes to
    distinct in-vocabulary indices and log-probs without NaN."""
    rows, starts = tensors["seq_rows"].tolist(), tensors["seq_bytes"].tolist()
    k, vocab = manifest["k"], manifest["vocab_size"]
    counts = tensors.get("counts")
    length = tensors["rest_logprob"].shape[0]
    base_dtype = "torch.float32" if manifest["codec"] == "compact" else "torch.int32"
    _check_offsets(tensors, ids, rows, starts, length, tensors["payload"].shape[0], bad,
                   tuple(tensors["row_base"].shape) == (length,)
                   and (counts is None or tuple(counts.shape) == (length,))
                   and tuple(tensors["seq_width"].shape) == (len(ids),))
    if str(tensors["row_base"].dtype) != base_dtype:
        raise bad(f"row_base is {tensors['row_base'].dtype}, codec {manifest['codec']!r} "
                  f"has {base_dtype}")
    if counts is not None and bool(((counts < 0) | (counts > k)).any()):
        raise bad(f"counts outside 0..{k}")
    version = manifest["format_version"]
    for i, sample_id, payload, r0, r1 in _sequences(tensors, ids, rows, starts,
                                                    fmt.crc_parts_v2, version, bad):
        indices, logprobs = _decoded(
            sample_id, bad, codec.decode, manifest["codec"], payload,
            tensors["row_base"][r0:r1].numpy(), int(tensors["seq_width"][i]),
            None if counts is None else counts[r0:r1].numpy(), vocab, k,
            manifest.get("logprob_step"), version >= 3)
        indices = torch.from_numpy(indices)
        if bool((indices >= vocab).any()) or np.isnan(logprobs).any() or bool(
                _checks.repeated(indices, indices >= 0)[1].any()):
            raise bad(f"sample_id {sample_id!r}: decodes to indices outside the vocabulary, "
                      f"repeated indices or NaN log-probs")
