"""The on-disk layout of a teacher store, shared by the writer, the reader and ``verify``.

A store is a directory::

    manifest.json                          the store's settings (written once, atomically,
                                           just before the first shard)
    shard-<writer>-<number>.safetensors    complete shards, any number of writers
    .shard-<writer>-<number>.safetensors.tmp-<pid>   a shard being written (never read)
    .writer-<writer>.lock                  held (flock) by the live writer of that name

The manifest binds the settings only once something is stored: a writer that fails before its
first shard leaves none, so the next one may use other settings. (A writer closed without an
error writes it even with nothing stored: an empty store.)

A shard is one safetensors file (https://github.com/huggingface/safetensors): a JSON header, then
raw little-endian arrays, memory-mapped by the reader. The manifest's ``format_version`` says
which tensors a shard holds. Format 3 (what this topkd writes, but for codec ``"plain"``;
:mod:`topkd.store.codec` has the payloads), for top-K rows (codecs ``"compact"`` and
``"exact"``):

- ``payload`` uint8 ``[B]``: every sequence's encoded rows, sequence after sequence;
- ``row_base`` ``[T]`` (float32 for ``compact``, int32 for ``exact``): each row's base;
- ``rest_logprob``, ``counts``, ``input_ids``, ``seq_rows``, ``token_hash``: as in format 1;
- ``seq_bytes`` int64 ``[S + 1]``: where each sequence's payload starts;
- ``seq_width`` uint8 ``[S]``: each sequence's code width byte;
- ``crc`` int64 ``[S]``: the XXH3-64 checksum (as a signed integer) of each sequence's bytes
  in ``payload``, ``row_base``, ``rest_logprob`` and ``counts`` (:data:`CRC_TENSORS_V2`).

The manifest's ``kind`` says what a row holds: ``"topk"``, a teacher's K most probable entries;
or ``"sampled"`` (codec ``"counts"``), the distinct tokens drawn from the teacher ``samples``
times per position and how often each was drawn (RS-KD, :class:`~topkd.SampledTeacher`). A
sampled shard holds ``payload`` and the per-sequence arrays only: the counts, the ids and the
token ids (when stored) are all in the payload, and the checksums cover it
(:data:`CRC_TENSORS_SAMPLED`); ``seq_width`` is the ids' low bits.

Format 2 (read, no longer written) is format 3 with CRC-32 checksums, the top-K payload's
fields in the plain order, and sampled shards of another layout: the ids and counts in the
payload, ``counts`` uint8 ``[T]`` (the ids per row) and ``input_ids`` beside it, CRC-32s over
both (:data:`CRC_TENSORS_SAMPLED_V2`).

Format 1 (codec ``"plain"``, a fixed width per entry; still read and resumed):

- ``indices`` int32 ``[E]`` and ``logprobs`` (the store's dtype) ``[E]``: the kept entries of
  every row, row after row (``E`` = entries in the shard);
- ``rest_logprob`` float32 ``[T]``: one ghost log-mass per token row (``T`` = token rows);
- ``counts`` int32 ``[T]``: kept entries per row, only in shards where some row keeps fewer
  than K (top-p); otherwise every row keeps K;
- ``input_ids`` int32 ``[T]``: the token id of each row, in the stores whose manifest has
  ``store_tokens: true`` (the default; manifests without the key are ``false``);
- ``seq_rows`` / ``seq_entries`` int64 ``[S + 1]``: where each sequence's rows and entries
  start;
- ``token_hash`` uint8 ``[S, 16]``: BLAKE2b-128 of each sequence's token ids (int64 LE);
- ``crc`` int64 ``[S]``: CRC-32 of each sequence's bytes in ``indices``, ``logprobs``,
  ``rest_logprob`` and ``counts`` (:data:`CRC_TENSORS`), checked on every read of its teacher.
  A read of its ``input_ids`` is checked against its ``token_hash`` instead, so ``input_ids``
  can be read alone (and readers that do not know it read the rest unchanged).

The header's metadata holds the sample ids (JSON) with their SHA-256 (checked whenever a shard
is opened) and a SHA-256 of every tensor, which ``verify`` checks in full.
"""

from __future__ import annotations

import hashlib
import json
import numbers
import os
import re
import zlib

import numpy as np
import torch

FORMAT = "topkd-teacher-store"
FORMAT_VERSION = 3  # what compact, exact and sampled stores are written in
PLAIN_VERSION = 1  # fixed-width entries: codec "plain", with a logprob_dtype
READABLE_VERSIONS = (PLAIN_VERSION, 2, FORMAT_VERSION)
CODECS = ("compact", "exact", "plain")
KINDS = ("topk", "sampled")
# What every manifest since format 1 holds and the readers need (a bare KeyError without it).
REQUIRED = ("vocab_size", "k", "temperature")
SAMPLED_CODEC = "counts"  # the codec of every sampled store
MANIFEST = "manifest.json"
SHARD_SUFFIX = ".safetensors"
SHARD_PATTERN = re.compile(r"^shard-(?P<writer>[A-Za-z0-9_.-]+)-(?P<number>\d{6,})\.safetensors$")
WRITER_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
# The tensors each sequence's CRC-32 covers, in that order (``counts`` only where present).
CRC_TENSORS = ("indices", "logprobs", "rest_logprob", "counts")
TOKENS = "input_ids"
ROW_TENSORS = CRC_TENSORS + (TOKENS,)
SEQUENCE_TENSORS = ("seq_rows", "seq_entries", "token_hash", "crc")
REQUIRED_TENSORS = ("indices", "logprobs", "rest_logprob") + SEQUENCE_TENSORS
# format 2
CRC_TENSORS_V2 = ("payload", "row_base", "rest_logprob", "counts")
ROW_TENSORS_V2 = CRC_TENSORS_V2 + (TOKENS,)
SEQUENCE_TENSORS_V2 = ("seq_rows", "seq_bytes", "seq_width", "token_hash", "crc")
REQUIRED_TENSORS_V2 = ("payload", "row_base", "rest_logprob") + SEQUENCE_TENSORS_V2
# sampled rows (kind "sampled"): format 3, and format 2
CRC_TENSORS_SAMPLED = ("payload",)
REQUIRED_TENSORS_SAMPLED = CRC_TENSORS_SAMPLED + SEQUENCE_TENSORS_V2
CRC_TENSORS_SAMPLED_V2 = ("payload", "counts")
REQUIRED_TENSORS_SAMPLED_V2 = CRC_TENSORS_SAMPLED_V2 + SEQUENCE_TENSORS_V2
TOKEN_DTYPE = torch.int32
LOGPROB_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                  "float16": torch.float16}
TOKEN_HASH = "blake2b-128 of the token ids as int64 little-endian"

# The settings a reader may insist on, in the order errors name them.
SETTINGS = ("kind", "codec", "vocab_size", "samples", "k", "top_p", "top_p_min_k",
            "temperature", "logprob_dtype", "tokenizer_fingerprint", "store_tokens")


def shard_name(writer: str, number: int) -> str:
    return f"shard-{writer}-{number:06d}{SHARD_SUFFIX}"


def temporary_name(name: str) -> str:
    return f".{name}.tmp"


def shard_files(path: str) -> list[str]:
    """The complete shards of a store, sorted by name."""
    return sorted(n for n in os.listdir(path) if SHARD_PATTERN.match(n))


def sample_key(value):
    """A sample id as stored: a str, or any integer (numpy's included) as an int; None for
    anything else (bool too, which would equal 0 and 1 in a dict)."""
    if isinstance(value, bool) or not isinstance(value, (str, numbers.Integral)):
        return None
    return value if isinstance(value, str) else int(value)


def token_hash(input_ids) -> bytes:
    """BLAKE2b-128 of a sequence's token ids, as int64 little-endian bytes."""
    ids = torch.as_tensor(input_ids).cpu()
    if ids.dim() == 1 and ids.numel() == 0:
        ids = ids.to(torch.int64)  # torch.as_tensor([]) is float32: an empty sequence is fine
    if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"input_ids must be a 1-D sequence of integer token ids, got "
                         f"shape {tuple(ids.shape)} dtype {ids.dtype}")
    data = ids.to(torch.int64).contiguous().numpy().astype("<i8", copy=False).tobytes()
    return hashlib.blake2b(data, digest_size=16).digest()


def tensor_bytes(t: torch.Tensor):
    """The raw bytes of a tensor (any dtype, bfloat16 included), without a copy when
    contiguous."""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


def _sequence_parts(tensors: dict, rows, starts, i: int, by_start: tuple, by_row: tuple) -> list:
    """Sequence ``i``'s slices of the tensors ``by_start`` (cut by ``starts``), of those
    ``by_row`` (cut by ``rows``), and of ``counts`` where the shard has them."""
    r0, r1, b0, b1 = int(rows[i]), int(rows[i + 1]), int(starts[i]), int(starts[i + 1])
    parts = [tensors[name][b0:b1] for name in by_start] + [tensors[name][r0:r1]
                                                            for name in by_row]
    if "counts" in tensors:
        parts.append(tensors["counts"][r0:r1])
    return parts


def crc_parts(tensors: dict, rows, entries, i: int) -> list:
    """Sequence ``i``'s parts of a shard's :data:`CRC_TENSORS`, in the order its CRC-32 covers
    them; ``rows`` / ``entries`` are the shard's ``seq_rows`` / ``seq_entries``."""
    return _sequence_parts(tensors, rows, entries, i, ("indices", "logprobs"), ("rest_logprob",))


def crc_parts_v2(tensors: dict, rows, starts, i: int) -> list:
    """Sequence ``i``'s parts of a format-2 shard's :data:`CRC_TENSORS_V2`, in the order its
    CRC-32 covers them; ``rows`` / ``starts`` are the shard's ``seq_rows`` / ``seq_bytes``."""
    return _sequence_parts(tensors, rows, starts, i, ("payload",), ("row_base", "rest_logprob"))


def crc_parts_sampled(tensors: dict, rows, starts, i: int) -> list:
    """Sequence ``i``'s parts of a sampled shard's :data:`CRC_TENSORS_SAMPLED`."""
    return _sequence_parts(tensors, rows, starts, i, ("payload",), ())


def crc(tensors) -> int:
    """CRC-32 of the bytes of ``tensors`` (torch tensors or contiguous numpy arrays), in
    order."""
    value = 0
    for t in tensors:
        value = zlib.crc32(t if isinstance(t, np.ndarray) else tensor_bytes(t), value)
    return value


# Each format's per-sequence checksum: XXH3-64 reads at about 10x CRC-32's speed here.
CHECKSUMS = {1: "CRC-32", 2: "CRC-32", 3: "XXH3-64"}


def checksum(tensors, version: int) -> int:
    """The checksum of format ``version`` (:data:`CHECKSUMS`) of the bytes of ``tensors``
    (torch tensors or contiguous numpy arrays), in order, as a signed 64-bit integer (what
    the ``crc`` tensor holds)."""
    if version < 3:
        return crc(tensors)
    state = _xxh3_64()
    for t in tensors:
        state.update(t if isinstance(t, np.ndarray) else tensor_bytes(t))
    value = state.intdigest()
    return value - (1 << 64) if value >= 1 << 63 else value


def _xxh3_64():
    try:
        import xxhash
    except ImportError:
        raise ImportError("teacher stores of format 3 need xxhash: pip install "
                          "'topkd[store]'") from None
    return xxhash.xxh3_64()


def sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(tensor_bytes(t)).hexdigest()


def ids_sha256(sample_ids_json: str) -> str:
    """SHA-256 of a shard's ``sample_ids`` header string: the ids map reads to rows, so an
    altered id must be caught like an altered tensor."""
    return hashlib.sha256(sample_ids_json.encode()).hexdigest()


def fsync_directory(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: str, name: str, write, *, exclusive: bool = False) -> bool:
    """Make ``path/name`` complete or absent, even across a crash: ``write(file_name)``
    (or ``write`` bytes) fills a temporary file, which is fsynced, then renamed into place (or,
    with ``exclusive``, linked, which fails if the name exists: returns False then); then the
    directory is fsynced.
    """
    temporary = os.path.join(path, temporary_name(name) + f"-{os.getpid()}")
    try:
        if isinstance(write, bytes):
            with open(temporary, "wb") as f:
                f.write(write)
        else:
            write(temporary)
        with open(temporary, "rb+") as f:
            os.fsync(f.fileno())
        if exclusive:
            try:
                os.link(temporary, os.path.join(path, name))
            except FileExistsError:
                return False
        else:
            os.replace(temporary, os.path.join(path, name))
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
    fsync_directory(path)
    return True


def read_manifest(path: str) -> dict:
    file = os.path.join(path, MANIFEST)
    try:
        with open(file) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} is not a topkd teacher store (no {MANIFEST})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not valid JSON ({e})") from None
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{file} is not a topkd teacher store manifest "
                         f"(format={manifest.get('format')!r})")
    if manifest.get("format_version") not in READABLE_VERSIONS:
        raise ValueError(f"{file} has format_version={manifest.get('format_version')!r}; this "
                         f"topkd reads format_version {' and '.join(map(str, READABLE_VERSIONS))}")
    missing = [key for key in REQUIRED if key not in manifest]
    if missing:
        raise ValueError(f"{file} lacks {missing}: every topkd teacher store's manifest holds "
                         f"{list(REQUIRED)} (was it edited by hand?)")
    manifest.setdefault("store_tokens", False)  # written before token ids were stored
    if manifest["format_version"] == PLAIN_VERSION:  # written before codecs existed
        manifest.setdefault("codec", "plain")
        manifest.setdefault("kind", "topk")
    manifest.setdefault("samples", None)  # top-K stores
    sampled = manifest.get("kind") == "sampled"
    if manifest.get("kind") not in KINDS or manifest.get("codec") not in CODECS + (
            SAMPLED_CODEC,) or sampled != (manifest.get("codec") == SAMPLED_CODEC) or (
            sampled and manifest["format_version"] == PLAIN_VERSION):
        raise ValueError(f"{file} holds rows of kind={manifest.get('kind')!r} and codec="
                         f"{manifest.get('codec')!r}; this topkd reads kinds {list(KINDS)} "
                         f"with codecs {list(CODECS)} (topk) and {SAMPLED_CODEC!r} (sampled)")
    return manifest


def check_settings(manifest: dict, expected: dict, path: str, who: str, *,
                   strict: bool = False) -> None:
    """Raise if any setting in ``expected`` differs from the manifest's, naming both values;
    a None in ``expected`` is not checked unless ``strict``."""
    for key in SETTINGS:
        want = expected.get(key)
        if (want is not None or strict) and manifest.get(key) != want:
            raise ValueError(f"the teacher store {path} was written with {key}="
                             f"{manifest.get(key)!r} but {who} {key}={want!r}")
