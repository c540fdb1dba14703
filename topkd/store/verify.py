"""Checking a whole teacher store: every byte of every shard against its recorded hashes."""

from __future__ import annotations

import json
import os

from . import format as fmt
from .reader import _open, shard_ids


def verify_store(path: str) -> list[str]:
    """Every problem found in the store at ``path``, one line each naming its file; empty when
    the store is whole. Reads every shard in full (SHA-256 of each tensor), checks the
    per-sequence layout, CRC-32s and stored token ids (against their token hashes), and that no
    sample id is stored twice."""
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

    with _open(path, file) as handle:
        metadata = handle.metadata() or {}
        ids = shard_ids(metadata, where, path)
        try:
            hashes = json.loads(metadata["sha256"])
        except (KeyError, json.JSONDecodeError):
            raise bad("header metadata (sha256) missing or unreadable") from None
        missing = [name for name in fmt.REQUIRED_TENSORS if name not in handle.keys()]
        if missing:
            raise bad(f"tensors {missing} are missing")
        if set(hashes) != set(handle.keys()):
            raise bad(f"tensors {sorted(handle.keys())} differ from the hashed ones "
                      f"{sorted(hashes)}")
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    for name, t in tensors.items():
        if fmt.sha256(t) != hashes[name]:
            raise bad(f"tensor {name!r} does not match its SHA-256 (the file was altered)")
    rows, entries = tensors["seq_rows"].tolist(), tensors["seq_entries"].tolist()
    k = manifest["k"]
    counts = tensors.get("counts")
    tokens = tensors["rest_logprob"].shape[0]
    expected_entries = tokens * k if counts is None else int(counts.sum())
    consistent = (
        len(rows) == len(entries) == len(ids) + 1 and rows[0] == entries[0] == 0
        and rows == sorted(rows) and entries == sorted(entries) and rows[-1] == tokens
        and entries[-1] == tensors["indices"].shape[0] == tensors["logprobs"].shape[0]
        == expected_entries and tuple(tensors["token_hash"].shape) == (len(ids), 16)
        and tensors["crc"].shape[0] == len(ids)
    )
    if not consistent:
        raise bad("sequence offsets, counts and array lengths disagree")
    tokens = tensors.get(fmt.TOKENS)
    if manifest["store_tokens"] and tokens is None:
        raise bad(f"no {fmt.TOKENS} though the manifest says store_tokens=true")
    if tokens is not None and (tokens.dtype != fmt.TOKEN_DTYPE
                               or tuple(tokens.shape) != (rows[-1],)):
        raise bad(f"{fmt.TOKENS} is {tokens.dtype} {tuple(tokens.shape)}, expected "
                  f"{fmt.TOKEN_DTYPE} ({rows[-1]},)")
    if str(tensors["logprobs"].dtype) != f"torch.{manifest['logprob_dtype']}":
        raise bad(f"logprobs are {tensors['logprobs'].dtype}, the manifest says "
                  f"{manifest['logprob_dtype']}")
    for i, sample_id in enumerate(ids):
        if fmt.crc(fmt.crc_parts(tensors, rows, entries, i)) != int(tensors["crc"][i]):
            raise bad(f"sample_id {sample_id!r}: CRC-32 mismatch")
        if tokens is not None and fmt.token_hash(tokens[rows[i]:rows[i + 1]]) != bytes(
                tensors["token_hash"][i].tolist()):
            raise bad(f"sample_id {sample_id!r}: its {fmt.TOKENS} do not match its token hash")
    return ids
