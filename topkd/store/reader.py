"""Reading a teacher store: memory-mapped, by sample id, every read checked."""

from __future__ import annotations

import math
import os

import torch

from ..teacher import SampledTeacher, SparseTeacher
from . import format as fmt
from .rows import agreed_settings
from .shard import Shard, read_shard_ids, shard_ids  # noqa: F401  (read_shard_ids: re-exported)


class MissingSampleError(KeyError):
    """A sample id that is not in the store (a KeyError whose text reads as a sentence)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""



def _manifest_entry(key: str, doc: str | None = None) -> property:
    """A read-only property: the store manifest's ``key``."""
    return property(lambda self: self.manifest[key], doc=doc)

class TeacherStore:
    """A teacher store opened read-only; sequences are read by sample id from memory maps.

    Args:
        path: the store's directory.
        vocab_size, k, temperature, tokenizer_fingerprint: when given, the store must have
            been written with these (the error names both values), so a student run cannot read
            targets made for another vocabulary, selection or tokenizer.
        verify_reads: check each sequence's checksum when it is read (default True; a damaged
            shard is then reported by name instead of read as wrong numbers).

    The shards present when the store is opened are its contents; a damaged or truncated shard
    header is an error at opening, damaged data at the read that touches it. The object can be
    pickled (to ``DataLoader`` workers): each process maps the files itself.
    """

    def __init__(self, path: str, *, vocab_size: int | None = None, k: int | None = None,
                 temperature: float | None = None, tokenizer_fingerprint: str | None = None,
                 verify_reads: bool = True):
        self.path = os.fspath(path)
        self.manifest = fmt.read_manifest(self.path)
        fmt.check_settings(self.manifest,
                           {"vocab_size": vocab_size, "k": k, "temperature": temperature,
                            "tokenizer_fingerprint": tokenizer_fingerprint},
                           self.path, "the reader asked for")
        self.verify_reads = bool(verify_reads)
        self.files = fmt.shard_files(self.path)
        self._where: dict = {}
        for number, file in enumerate(self.files):
            for position, sample_id in enumerate(read_shard_ids(self.path, file)):
                if sample_id in self._where:
                    other = self.files[self._where[sample_id][0]]
                    raise ValueError(f"sample_id {sample_id!r} is stored twice in {self.path}: "
                                     f"in {other} and in {file}")
                self._where[sample_id] = (number, position)
        self._shards: dict[int, Shard] = {}

    # -- what is there -----------------------------------------------------------------------

    vocab_size = _manifest_entry("vocab_size")
    k = _manifest_entry("k", "Entries per row (top-K), or slots per row (sampled: ``samples``).")
    kind = _manifest_entry("kind", """``"topk"`` (rows of :class:`~topkd.SparseTeacher`) or
        ``"sampled"`` (:class:`~topkd.SampledTeacher`).""")
    samples = _manifest_entry(
        "samples", "Tokens drawn per position of a sampled store (None for top-K rows).")
    temperature = _manifest_entry("temperature")

    @property
    def store_tokens(self) -> bool:
        """Whether the token ids are stored (:meth:`tokens`)."""
        return bool(self.manifest["store_tokens"])

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, sample_id) -> bool:
        key = fmt.sample_key(sample_id)
        return key is not None and key in self._where

    def ids(self) -> list:
        """Every stored sample id, in shard order."""
        return list(self._where)

    def nbytes(self) -> int:
        """Bytes on disk of the complete shards."""
        return sum(os.path.getsize(os.path.join(self.path, f)) for f in self.files)

    def num_tokens(self) -> int:
        """Token rows stored, over all sequences."""
        return sum(self._shard(n).seq_rows[-1] for n in range(len(self.files)))

    def num_entries(self) -> int:
        """Kept entries stored, over all token rows (K per row, fewer in rows top-p cut)."""
        return sum(self._shard(number).num_entries() for number in range(len(self.files)))

    # -- reading -----------------------------------------------------------------------------

    def _shard(self, number: int) -> Shard:
        shard = self._shards.get(number)
        if shard is None:
            shard = self._shards[number] = Shard(self.path, self.files[number], self.manifest)
        return shard

    def _locate(self, sample_id) -> tuple[Shard, int]:
        key = fmt.sample_key(sample_id)
        where = self._where.get(key) if key is not None else None
        if where is None:
            raise MissingSampleError(self._missing(sample_id, key))
        number, position = where
        return self._shard(number), position

    def _missing(self, sample_id, key) -> str:
        message = f"sample_id {sample_id!r} is not in the teacher store {self.path}"
        if not self._where:
            return message + " (it holds no samples)"
        example = next(iter(self._where))
        message += (f" ({len(self._where)} ids, e.g. {example!r}); a store is read with the "
                    f"ids it was built with (the data's id field, default the 0-based line or "
                    f"row number)")
        # the same id of the other type (5 and "5" are different ids)
        other = str(key) if isinstance(key, int) else None
        if isinstance(key, str):
            try:
                other = int(key)
            except ValueError:
                pass
        if other is not None and other in self._where:
            message += f"; the store has {other!r}, of type {type(other).__name__}"
        return message

    def tokens(self, sample_id) -> torch.Tensor:
        """The token ids stored with one sequence, int64 ``[L]``: those its teacher rows were
        computed from (after the build's truncation), checked against its stored token hash
        when the store verifies reads. A store built without them (``store_tokens=False``,
        ``--no-tokens``, or by an older topkd) raises a ValueError."""
        shard, position = self._locate(sample_id)
        if not shard.has_tokens:
            if self.store_tokens:
                raise ValueError(f"teacher store shard {shard.file} has no input_ids though the "
                                 f"manifest says store_tokens=true; run "
                                 f"`topkd store verify {self.path}`")
            raise ValueError(
                f"the teacher store {self.path} holds no token ids (built with "
                f"store_tokens=False / --no-tokens, or by a topkd that did not store them); "
                f"give them with the sample ids, TeacherDataset(store, samples=[(sample_id, "
                f"input_ids), ...]), tokenized exactly as for the build, or rebuild the store "
                f"into a new directory without --no-tokens")
        ids = shard.tokens(position).to(torch.int64)
        stored = bytes(shard.token_hash[position].tolist())
        if self.verify_reads and fmt.token_hash(ids) != stored:
            raise ValueError(f"sample_id {sample_id!r}: its token ids in teacher store shard "
                             f"{shard.file} are damaged (token hash mismatch); run "
                             f"`topkd store verify {self.path}`")
        return ids

    def get(self, sample_id, input_ids=None) -> SparseTeacher | SampledTeacher:
        """The stored teacher of one sequence: a :class:`~topkd.SparseTeacher` ``[L, K]``
        (indices int64, logprobs float32 widened from the store's dtype, unused slots ``-1`` /
        ``-inf``); in a sampled store a :class:`~topkd.SampledTeacher` ``[L, samples]`` (ids
        ascending, then ``-1`` slots with count 0; no log-probs).

        With ``input_ids`` (the tokens the student will see), their hash must equal the stored
        one: a store row never meets tokens it was not computed from.

        A sample id not in the store raises a KeyError that names it, the store and an id the
        store holds.
        """
        shard, position = self._locate(sample_id)
        if input_ids is not None:
            stored = bytes(shard.token_hash[position].tolist())
            if fmt.token_hash(input_ids) != stored:
                raise ValueError(
                    f"sample_id {sample_id!r}: the token ids given ({len(input_ids)} tokens) "
                    f"are not the ones the teacher store {self.path} was built from (token hash "
                    f"differs); the data and the store are misaligned")
        parts = shard.parts(position)
        if self.verify_reads and shard.checksum(parts) != shard.crc[position]:
            raise ValueError(f"sample_id {sample_id!r}: its data in teacher store shard "
                             f"{shard.file} is damaged ({fmt.CHECKSUMS[shard.version]} "
                             f"checksum mismatch); run `topkd store verify {self.path}`")
        try:
            rows = shard.rows(parts, position)
        except ValueError as e:  # only without verify_reads: the checksum would have caught it
            raise ValueError(f"sample_id {sample_id!r}: its data in teacher store shard "
                             f"{shard.file} is damaged ({e}); run "
                             f"`topkd store verify {self.path}`") from None
        if self.kind == "sampled":
            return SampledTeacher(*rows, self.samples, self.temperature, self.vocab_size)
        return SparseTeacher(*rows, self.temperature, self.vocab_size)

    def collate(self, sample_ids, *, input_ids=None, pad_to: int | None = None) -> SparseTeacher:
        """The teachers of several sequences as one batch ``[B, L, K]``, padded to the longest
        (or ``pad_to``) with rows its ``mask`` marks False, which the losses drop.

        ``input_ids``, when given, is one token sequence per sample id, each checked as in
        :meth:`get`.
        """
        sample_ids = list(sample_ids)
        if input_ids is None:
            input_ids = [None] * len(sample_ids)
        elif len(input_ids) != len(sample_ids):
            raise ValueError(f"input_ids has {len(input_ids)} sequences for "
                             f"{len(sample_ids)} sample ids")
        teachers = [self.get(s, ids) for s, ids in zip(sample_ids, input_ids, strict=True)]
        from .rows import collate_any

        return collate_any(teachers, pad_to=pad_to, k=self.k, vocab_size=self.vocab_size,
                           temperature=self.temperature, samples=self.samples)

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_shards"] = {}  # memory maps do not travel; each process opens its own
        return state


def collate_teachers(teachers, *, pad_to: int | None = None, k: int | None = None,
                     vocab_size: int | None = None,
                     temperature: float | None = None) -> SparseTeacher:
    """Stack per-sequence :class:`~topkd.SparseTeacher` rows ``[L_i, K]`` into ``[B, L, K]``.

    ``L`` is ``pad_to`` or the longest sequence. Padding rows hold a valid distribution (half
    the mass on index 0, half in the ghost bucket) whose forward and reverse KL are finite, so
    the zero gradient the losses give them stays zero (with all mass on one index the reverse
    KL is infinite there, and ``0 * inf`` is NaN); the batch's ``mask`` is False there.
    ``k``, ``vocab_size`` and ``temperature`` describe an empty batch and must agree with the
    teachers given.
    """
    teachers = list(teachers)
    lengths = [t.indices.shape[0] for t in teachers]
    k, vocab_size, temperature = agreed_settings(teachers, k=k, vocab_size=vocab_size,
                                                 temperature=temperature)
    longest = max(lengths, default=0)
    if pad_to is None:
        pad_to = longest
    elif isinstance(pad_to, bool) or not isinstance(pad_to, int):
        raise TypeError(f"pad_to must be an int or None, got {pad_to!r}")
    elif pad_to < longest:
        raise ValueError(f"pad_to must be >= the longest sequence ({longest}), got {pad_to}")
    batch = len(teachers)
    # A one-token vocabulary has no ghost: its one entry holds all the mass.
    half = math.log(0.5) if vocab_size > 1 else 0.0
    indices = torch.full((batch, pad_to, k), -1, dtype=torch.int64)
    logprobs = torch.full((batch, pad_to, k), float("-inf"))
    rest = torch.full((batch, pad_to), half if vocab_size > 1 else float("-inf"))
    indices[..., 0], logprobs[..., 0] = 0, half
    mask = torch.zeros((batch, pad_to), dtype=torch.bool)
    for b, (t, length) in enumerate(zip(teachers, lengths, strict=True)):
        indices[b, :length], logprobs[b, :length] = t.indices, t.logprobs
        rest[b, :length] = t.rest_logprob
        mask[b, :length] = True if t.mask is None else t.mask
    return SparseTeacher(indices, logprobs, rest, temperature, vocab_size, mask)
