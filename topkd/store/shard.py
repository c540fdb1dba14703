"""One shard opened for reading, in either format: the memory map, its small per-sequence
arrays (checked against their SHA-256 when opened), and one sequence's rows on demand."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import torch

from . import codec
from . import format as fmt


def open_file(path: str, file: str):
    from safetensors import safe_open

    try:
        return safe_open(os.path.join(path, file), framework="pt")
    except Exception as e:  # safetensors raises its own error type for a damaged header
        raise ValueError(f"teacher store shard {os.path.join(path, file)} is damaged or "
                         f"truncated ({e}); run `topkd store verify {path}`") from None


def read_shard_ids(path: str, file: str) -> list:
    """The sample ids in one shard, from its header (which also proves the file is whole)."""
    with open_file(path, file) as handle:
        metadata = handle.metadata() or {}
    return shard_ids(metadata, os.path.join(path, file), path)


def shard_ids(metadata: dict, where: str, path: str) -> list:
    """The sample ids of a shard's header metadata, checked against their SHA-256."""
    try:
        ids = json.loads(metadata["sample_ids"])
        intact = fmt.ids_sha256(metadata["sample_ids"]) == metadata["sample_ids_sha256"]
    except (KeyError, json.JSONDecodeError):
        raise ValueError(f"teacher store shard {where} has no readable sample_ids in its "
                         f"header; run `topkd store verify {path}`") from None
    if not intact or not isinstance(ids, list):
        raise ValueError(f"teacher store shard {where}: the sample_ids in its header do not "
                         f"match their SHA-256 (the header was altered); run "
                         f"`topkd store verify {path}`")
    return ids


class Shard:
    """One open shard. ``parts(i)`` are sequence ``i``'s bytes its checksum covers (in that
    order), ``checksum(parts)`` theirs; ``rows(parts, i)`` turns them into ``(indices int64
    [L, K], logprobs float32 [L, K], rest_logprob float32 [L])`` (sampled rows: ``(indices
    int64 [L, samples], counts int32 [L, samples])``)."""

    def __init__(self, path: str, file: str, manifest: dict):
        self.file = os.path.join(path, file)
        self.k, self.vocab_size = manifest["k"], manifest["vocab_size"]
        self.codec, self.step = manifest["codec"], manifest.get("logprob_step")
        self.version = manifest["format_version"]
        self.v2 = self.version != fmt.PLAIN_VERSION  # (a payload: formats 2 and 3)
        self.sampled = manifest["kind"] == "sampled"
        self.sampled3 = self.sampled and self.version >= 3  # (ids, counts, tokens: one payload)
        sequence_tensors = fmt.SEQUENCE_TENSORS_V2 if self.v2 else fmt.SEQUENCE_TENSORS
        row_tensors = (("payload", "counts", fmt.TOKENS) if self.sampled else
                       fmt.ROW_TENSORS_V2 if self.v2 else fmt.ROW_TENSORS)
        self.handle = open_file(path, file)
        keys = set(self.handle.keys())
        self.has_counts = "counts" in keys
        self.has_tokens = (bool(manifest["store_tokens"]) if self.sampled3
                           else fmt.TOKENS in keys)
        # The small per-sequence arrays say where every read goes and what it must hash to:
        # check them in full once (the row data is checked per read, by its checksum).
        try:
            small = {name: self.handle.get_tensor(name) for name in sequence_tensors}
            hashes = json.loads((self.handle.metadata() or {})["sha256"])
            intact = all(fmt.sha256(t) == hashes[name] for name, t in small.items())
        except Exception:  # a missing tensor (safetensors' own error) or hash
            intact = False
        if not intact:
            raise ValueError(f"teacher store shard {self.file}: its sequence offsets, token "
                             f"hashes or checksums do not match their SHA-256 (the file was "
                             f"altered); run `topkd store verify {path}`")
        self.seq_rows = small["seq_rows"].tolist()
        self.seq_starts = small["seq_bytes" if self.v2 else "seq_entries"].tolist()
        self.seq_width = small["seq_width"].tolist() if self.v2 else None
        self.token_hash = small["token_hash"]
        self.crc = small["crc"].tolist()
        if self.v2:  # numpy views of the mapped file: a read slices without copying
            self.slices = _mapped(self.file, [n for n in row_tensors if n in keys])
        else:
            self.slices = {name: self.handle.get_slice(name) for name in row_tensors
                           if name in keys}

    def parts(self, i: int) -> dict:
        r0, r1 = self.seq_rows[i], self.seq_rows[i + 1]
        e0, e1 = self.seq_starts[i], self.seq_starts[i + 1]
        if self.sampled:
            parts = {"payload": self.slices["payload"][e0:e1]}
            if self.has_counts:  # (format 2)
                parts["counts"] = self.slices["counts"][r0:r1]
            return parts
        first = ("payload", "row_base") if self.v2 else ("indices", "logprobs")
        parts = {first[0]: self.slices[first[0]][e0:e1]}
        parts[first[1]] = self.slices[first[1]][r0:r1] if self.v2 else \
            self.slices[first[1]][e0:e1]
        parts["rest_logprob"] = self.slices["rest_logprob"][r0:r1]
        if self.has_counts:
            parts["counts"] = self.slices["counts"][r0:r1]
        return parts

    def checksum(self, parts: dict) -> int:
        """The checksum of a sequence's :meth:`parts` (what its ``crc`` entry must be)."""
        return fmt.checksum(parts.values(), self.version)

    def rows(self, parts: dict, i: int):
        if self.sampled3:
            indices, counts = codec.decode_sampled(
                parts["payload"], self.seq_width[i], self.seq_rows[i + 1] - self.seq_rows[i],
                self.vocab_size, self.k, self.has_tokens)
            return torch.from_numpy(indices), torch.from_numpy(counts)
        if self.sampled:  # format 2
            indices, counts = codec.decode_counts(parts["payload"], self.seq_width[i],
                                                  parts["counts"], self.vocab_size, self.k)
            return torch.from_numpy(indices), torch.from_numpy(counts)
        if self.v2:
            indices, logprobs = codec.decode(self.codec, parts["payload"], parts["row_base"],
                                             self.seq_width[i], parts.get("counts"),
                                             self.vocab_size, self.k, self.step,
                                             columns=self.version >= 3)
            rest = torch.from_numpy(parts["rest_logprob"].copy())
            return torch.from_numpy(indices), torch.from_numpy(logprobs), rest
        rest = parts["rest_logprob"].float()
        return (*_plain_rows(parts, rest.shape[0], self.k), rest)

    def tokens(self, i: int) -> torch.Tensor:
        r0, r1 = self.seq_rows[i], self.seq_rows[i + 1]
        if self.sampled3:
            payload = self.slices["payload"][self.seq_starts[i]:self.seq_starts[i + 1]]
            return torch.from_numpy(codec.sampled_tokens(payload, r1 - r0, self.vocab_size))
        ids = self.slices[fmt.TOKENS][r0:r1]
        return torch.from_numpy(ids.copy()) if self.v2 else ids

    def num_entries(self) -> int:
        """Kept entries (sampled rows: distinct ids) over the shard's rows."""
        if self.sampled3:
            return sum(codec.sampled_entries(self.parts(i)["payload"],
                                             self.seq_rows[i + 1] - self.seq_rows[i],
                                             self.vocab_size, self.k, self.has_tokens)
                       for i in range(len(self.crc)))
        if self.has_counts:
            return int(self.slices["counts"][:].sum())
        return self.seq_rows[-1] * self.k


_NUMPY = {"U8": np.uint8, "I32": np.int32, "I64": np.int64, "F32": np.float32}


def _mapped(file: str, names) -> dict:
    """Read-only numpy views of a safetensors file's tensors ``names`` (1-D, as the row tensors
    of formats 2 and 3 are), over one memory map of the file; the header was checked by
    safetensors when the shard was opened."""
    # (a plain ndarray over the map: slicing a np.memmap costs several microseconds more)
    mapped = np.asarray(np.memmap(file, dtype=np.uint8, mode="r"))
    size = int.from_bytes(mapped[:8].tobytes(), "little")
    header = json.loads(mapped[8:8 + size].tobytes())
    out = {}
    for name in names:
        entry = header[name]
        begin, end = (8 + size + offset for offset in entry["data_offsets"])
        out[name] = mapped[begin:end].view(_NUMPY[entry["dtype"]])
    return out


def _plain_rows(parts: dict, length: int, k: int):
    indices = parts["indices"].long()
    logprobs = parts["logprobs"].float()
    if "counts" not in parts:
        return indices.reshape(length, k), logprobs.reshape(length, k)
    used = torch.arange(k) < parts["counts"][:, None]
    full_indices = torch.full((length, k), -1, dtype=torch.int64)
    full_logprobs = torch.full((length, k), -math.inf)
    # (masked_scatter_ is several times faster than boolean index assignment)
    full_indices.masked_scatter_(used, indices)
    full_logprobs.masked_scatter_(used, logprobs)
    return full_indices, full_logprobs
