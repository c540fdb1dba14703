"""Writing a teacher store: sequences in, complete shards out, safe against a crash."""

from __future__ import annotations

import fcntl
import json
import os
import re
from collections.abc import Iterable
from functools import partial

import torch

from .. import _checks
from ..teacher import SampledTeacher, SparseTeacher
from . import codec as row_codec
from . import format as fmt
from .shard import read_shard_ids


class TeacherStoreWriter:
    """Appends teachers' :class:`~topkd.SparseTeacher` rows, one sequence at a time, to a store.

    Args:
        path: the store's directory (created if missing). Several writers may share it if each
            has its own ``name``; the reader sees the union of their shards.
        k: entries per row (the ``k`` given to :func:`topkd.select_topk`).
        samples: instead of ``k``: a store of sampled rows (kind ``"sampled"``), the distinct
            tokens of ``samples`` draws per position and their counts, as
            :func:`topkd.sample_teacher` makes them (:class:`~topkd.SampledTeacher`); codec
            ``"counts"`` (the counts in ``samples - 1`` bits a row, the ids Elias-Fano coded,
            the token ids in ``bit_length(vocab_size - 1)`` bits: they must lie in
            ``[0, vocab_size)``), no top-p, no ghost.
        vocab_size: the vocabulary the teacher was normalized over, up to ``2**31 - 2``.
        top_p, top_p_min_k, temperature: the selection's settings, recorded in the manifest;
            every added teacher must have this ``k``, temperature and vocabulary.
        codec: how the kept entries are stored. ``"compact"`` (the default): indices
            Elias-Fano coded, log-probs rounded to 1/32 nat relative to the row's largest,
            the kept mass preserved (about 2.8 bytes per entry at K = 64, V = 151,936,
            everything counted). ``"exact"``: the float32 log-probs bit for bit (about 4.8
            bytes per entry there).
            ``"plain"``: the fixed-width layout of format 1 (int32 indices, log-probs in
            ``logprob_dtype``), which older stores have; given ``logprob_dtype`` alone, it is
            this one. The ghost log-mass is float32 in every case, stored as given.
        logprob_dtype: ``"float16"``, ``"bfloat16"`` or ``"float32"``, for ``codec="plain"``
            only (default there: float16).
        tokenizer_fingerprint: identifies the tokenizer (see :func:`tokenizer_fingerprint`);
            a reader asking for another one is refused.
        store_tokens: keep each sequence's token ids (int32, 4 B per token) with its rows, so
            training can read them from the store (:meth:`TeacherStore.tokens`,
            ``TeacherDataset(store)``). Default True; a store setting like the others.
        metadata: free JSON-serializable information kept in the manifest.
        match_metadata: keys of ``metadata`` whose values an existing store must share (when
            it has them): a resumed build refuses another teacher this way.
        name: this writer's name in shard file names; default ``rank<R>`` under
            ``torch.distributed``, else ``main``. Two live writers may not share a name.
        shard_bytes: a shard is written once its rows reach this many bytes (default 256 MiB).

    Shards become visible only when complete (temporary file, fsync, atomic rename), so a crash
    loses at most the rows not yet in a shard. Reopening a store resumes it: the settings must
    match the manifest (an error names both values), ``sample_id in writer`` tells what is
    stored already, and adding a stored id again is an error.

    The manifest is written just before the first shard (or by :meth:`close` when nothing was
    added), so a writer that fails before storing anything binds no settings. Of concurrent
    writers with different settings on a new store, the first to write a shard wins; the others
    are refused at their first shard (and closed, their rows dropped).
    """

    def __init__(self, path: str, *, k: int | None = None, vocab_size: int,
                 samples: int | None = None, top_p: float | None = None,
                 top_p_min_k: int = 1, temperature: float = 1.0, codec: str | None = None,
                 logprob_dtype: str | None = None, tokenizer_fingerprint: str | None = None,
                 store_tokens: bool = True, metadata: dict | None = None,
                 match_metadata: Iterable[str] = (), name: str | None = None,
                 shard_bytes: int = 256 * 2**20):
        vocab_size = _checks.integer("vocab_size", vocab_size, 1, _checks.MAX_VOCAB)
        if (k is None) == (samples is None):
            raise ValueError(f"give exactly one of k (top-K rows) and samples (sampled rows), "
                             f"got k={k!r}, samples={samples!r}")
        temperature = _checks.temperature(temperature)
        top_p, top_p_min_k = _checks.top_p(top_p, top_p_min_k)
        kind = "topk" if samples is None else "sampled"
        if kind == "sampled":
            samples = k = _checks.integer("samples", samples, 1, MAX_SAMPLES)
            if top_p is not None:
                raise ValueError(f"top_p={top_p} applies to top-K rows, not to sampled ones")
            if codec not in (None, fmt.SAMPLED_CODEC) or logprob_dtype is not None:
                raise ValueError(f"sampled rows are stored with codec={fmt.SAMPLED_CODEC!r} "
                                 f"(ids and counts), not codec={codec!r} / logprob_dtype="
                                 f"{logprob_dtype!r}")
            codec_name = fmt.SAMPLED_CODEC
        else:
            k = _checks.integer("k", k, 1, vocab_size)
            codec_name, logprob_dtype = writer_codec(codec, logprob_dtype)
        if tokenizer_fingerprint is not None and not isinstance(tokenizer_fingerprint, str):
            raise TypeError(f"tokenizer_fingerprint must be a str or None, got "
                            f"{type(tokenizer_fingerprint).__name__}")
        if not isinstance(store_tokens, bool):
            raise TypeError(f"store_tokens must be a bool, got {store_tokens!r}")
        self.shard_bytes = _checks.integer("shard_bytes", shard_bytes, 1)
        self.name = _default_name() if name is None else name
        if not isinstance(self.name, str) or not fmt.WRITER_NAME.match(self.name):
            raise ValueError(f"name must be 1-64 characters of [A-Za-z0-9_.-], got {name!r}")
        try:
            metadata_json = json.loads(json.dumps({} if metadata is None else metadata))
        except TypeError as e:
            raise TypeError(f"metadata must be JSON-serializable: {e}") from None
        self._metadata, self._match_metadata = metadata_json, tuple(match_metadata)

        self.path = os.fspath(path)
        os.makedirs(self.path, exist_ok=True)
        self.settings = {"kind": kind, "codec": codec_name, "vocab_size": vocab_size, "k": k,
                         "samples": samples, "top_p": top_p, "top_p_min_k": top_p_min_k,
                         "temperature": temperature, "logprob_dtype": logprob_dtype,
                         "tokenizer_fingerprint": tokenizer_fingerprint,
                         "store_tokens": store_tokens}
        try:
            import safetensors.torch  # noqa: F401  (needed at the first shard: fail now)
        except ImportError:
            raise ImportError("the teacher store needs safetensors: pip install "
                              "'topkd[store]'") from None
        existing = self._existing_manifest()
        self._bound = existing is not None
        self.manifest = existing if self._bound else self._new_manifest(metadata_json)
        self._lock = self._take_lock()
        try:
            self._remove_own_temporaries()
            self._stored = set()
            numbers = [-1]
            for file in fmt.shard_files(self.path):
                self._stored.update(read_shard_ids(self.path, file))
                match = fmt.SHARD_PATTERN.match(file)
                if match["writer"] == self.name:
                    numbers.append(int(match["number"]))
        except BaseException:
            self._lock.close()  # a store this writer cannot resume: leave no lock behind
            raise
        self._next_number = max(numbers) + 1
        self._logprob_dtype = fmt.LOGPROB_DTYPES.get(logprob_dtype)
        self._pending: list[tuple] = []
        self._pending_bytes = 0
        self.closed = False

    # -- setup -------------------------------------------------------------------------------

    def _new_manifest(self, metadata: dict) -> dict:
        sampled = self.settings["kind"] == "sampled"
        if self.settings["codec"] == "plain":
            layout = {"format_version": fmt.PLAIN_VERSION, "index_dtype": "int32"}
        else:
            layout = {"format_version": fmt.FORMAT_VERSION,
                      "index_coding": "elias-fano, entries sorted by index within a row",
                      "checksum": "xxh3-64"}
            if self.settings["codec"] == "compact":
                layout["logprob_step"] = row_codec.COMPACT_STEP
        if sampled:
            layout["count_coding"] = "a one where each id's draws end, samples - 1 bits a row"
        else:
            layout["rest_dtype"] = "float32"
        manifest = {"format": fmt.FORMAT, **layout, **self.settings,
                    "token_hash": fmt.TOKEN_HASH, "metadata": metadata}
        if self.settings["store_tokens"]:
            manifest["input_ids_dtype"] = ("bit_length(vocab_size - 1) bits, in the payload"
                                           if sampled else "int32")
        return manifest

    def _existing_manifest(self) -> dict | None:
        """The store's manifest, checked against this writer; None for a store not yet bound."""
        # Shards are listed before the manifest is read: a manifest is written before any
        # shard, so shards seen without one were left by something else than a writer.
        files = fmt.shard_files(self.path)
        try:
            existing = fmt.read_manifest(self.path)
        except FileNotFoundError:
            if files:
                raise ValueError(f"{self.path} holds teacher store shards ({files[0]}, ...) but "
                                 f"no {fmt.MANIFEST}: its settings are unknown; write into "
                                 f"another directory") from None
            return None
        try:
            self._check(existing)
            if existing["format_version"] not in (fmt.PLAIN_VERSION, fmt.FORMAT_VERSION):
                raise ValueError(
                    f"the teacher store {self.path} is in format {existing['format_version']}, "
                    f"which this topkd reads but does not write (it writes format "
                    f"{fmt.FORMAT_VERSION}); finish it with the topkd that started it, or "
                    f"write into another directory")
        except ValueError as e:
            if files:
                raise
            raise ValueError(f"{e} (the store holds no shards: if no writer is running on it, "
                             f"delete {os.path.join(self.path, fmt.MANIFEST)} to start "
                             f"over)") from None
        return existing

    def _check(self, existing: dict) -> None:
        fmt.check_settings(existing, self.settings, self.path, "this writer has", strict=True)
        stored, mine = existing.get("metadata") or {}, self._metadata
        for key in self._match_metadata:
            if key in stored and stored[key] != mine.get(key):
                raise ValueError(f"the teacher store {self.path} was written with {key}="
                                 f"{stored[key]!r} but this writer has {key}={mine.get(key)!r}")

    def _bind(self) -> None:
        """Write the manifest, or check this writer against the one another writer wrote first;
        on a mismatch this writer can store nothing: it is closed and its rows dropped."""
        if self._bound:
            return
        data = json.dumps(self.manifest, indent=2, sort_keys=True).encode()
        # Exclusive create: of several writers binding together, one manifest wins and the
        # others check theirs against it.
        fmt.write_durably(self.path, fmt.MANIFEST, data, exclusive=True)
        existing = fmt.read_manifest(self.path)
        try:
            self._check(existing)
        except ValueError:
            self._pending, self._pending_bytes = [], 0
            self.closed = True
            self._lock.close()
            raise
        self.manifest, self._bound = existing, True

    def _take_lock(self):
        lock = open(os.path.join(self.path, f".writer-{self.name}.lock"), "w")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            raise RuntimeError(f"another live writer named {self.name!r} holds {self.path}; "
                               f"give each concurrent writer its own name=") from None
        return lock

    def _remove_own_temporaries(self) -> None:
        """Shards this writer name left unfinished when a process died (it held the lock)."""
        own = re.compile(rf"^\.shard-{re.escape(self.name)}-\d{{6,}}\.safetensors\.tmp-\d+$")
        for entry in os.listdir(self.path):
            if own.match(entry):
                os.unlink(os.path.join(self.path, entry))

    # -- writing -----------------------------------------------------------------------------

    def __contains__(self, sample_id) -> bool:
        key = fmt.sample_key(sample_id)
        return key is not None and key in self._stored

    def __len__(self) -> int:
        """Sequences stored by every writer before this one opened, and added by this one."""
        return len(self._stored)

    def add(self, sample_id, input_ids, teacher: SparseTeacher | SampledTeacher) -> None:
        """Store one sequence: its id (str or int), its token ids ``[L]`` and its teacher rows
        (a :class:`~topkd.SparseTeacher` with leading shape ``[L]``, from the same tokens; a
        :class:`~topkd.SampledTeacher` ``[L, S]`` in a store of ``samples``).
        The token ids are stored too (as int32) unless the writer has ``store_tokens=False``;
        their hash is stored in every case.

        The sequence is queued, and written with the next shard; if writing that shard fails,
        it stays queued for the next :meth:`flush` or :meth:`close`."""
        self._check_open()
        key = fmt.sample_key(sample_id)
        if key is None:
            raise TypeError(f"sample_id must be a str or an int, got {sample_id!r}")
        sample_id = key
        if sample_id in self._stored:
            raise ValueError(f"sample_id {sample_id!r} is already in the store {self.path}")
        token_hash = fmt.token_hash(input_ids)
        length = len(input_ids)
        tokens = self._tokens(sample_id, input_ids) if self.settings["store_tokens"] else None
        if self.settings["kind"] == "sampled":
            rows = self._sampled_rows(sample_id, teacher, length, tokens)
        else:
            rows = self._rows(sample_id, teacher, length)
            if tokens is not None:
                rows[fmt.TOKENS] = tokens
        rows["rows"] = length
        self._stored.add(sample_id)
        self._pending.append((sample_id, token_hash, rows))
        self._pending_bytes += sum(t.numel() * t.element_size() for t in rows.values()
                                   if isinstance(t, torch.Tensor))
        if self._pending_bytes >= self.shard_bytes:
            self.flush()

    def _check_settings(self, sample_id, teacher, width: str) -> None:
        """A sequence's teacher has no padding rows and the store's vocab_size, ``width``
        (``k`` or ``samples``) and temperature."""
        if teacher.mask is not None and not bool(teacher.mask.all()):
            raise ValueError(f"sample {sample_id!r}: the teacher has padding rows (its mask); "
                             f"add each sequence's own rows")
        for key in ("vocab_size", width, "temperature"):
            have, want = getattr(teacher, key), self.settings[key]
            if have != want:
                raise ValueError(f"sample {sample_id!r}: the teacher has {key}={have} but the "
                                 f"store {self.path} has {key}={want}")

    def _rows(self, sample_id, teacher, length: int) -> dict:
        """Validate one sequence's teacher and pack its rows (the parts its checksum
        covers)."""
        if not isinstance(teacher, SparseTeacher):
            raise TypeError(f"teacher must be a topkd.SparseTeacher, got "
                            f"{type(teacher).__name__}")
        self._check_settings(sample_id, teacher, "k")
        try:  # what a loss would refuse (dtypes, shapes, indices, unused slots' mass, masses)
            _checks.sparse_teacher(teacher)
        except (TypeError, ValueError) as e:
            raise type(e)(f"sample {sample_id!r}: {e}") from None
        s = self.settings
        if tuple(teacher.indices.shape) != (length, s["k"]):  # (logprobs, rest: checked alike)
            raise ValueError(f"sample {sample_id!r}: teacher.indices must be [{length}, "
                             f"{s['k']}] (one row per token), got {tuple(teacher.indices.shape)}")
        indices = teacher.indices.detach().cpu()
        logprobs = teacher.logprobs.detach().cpu().float()
        rest = teacher.rest_logprob.detach().cpu().float()
        used = indices >= 0
        counts = used.sum(-1)
        # Unused slots (-1) may only end a row: they are what top-p dropped.
        prefix = torch.arange(s["k"]) < counts[:, None]
        if not torch.equal(used, prefix):
            raise ValueError(f"sample {sample_id!r}: unused slots (-1) must come after the used "
                             f"ones in each row, as select_topk makes them")
        if bool(torch.isnan(rest).any() | (rest > 0).any()):
            raise ValueError(f"sample {sample_id!r}: teacher.rest_logprob must be a log-mass "
                             f"(<= 0, not NaN), got {rest[torch.isnan(rest) | (rest > 0)][:3]}")
        if bool((counts == s["k"]).all()):
            indices, logprobs = indices.reshape(-1), logprobs.reshape(-1)
        else:  # (masked_select is several times faster than boolean indexing here)
            indices, logprobs = indices.masked_select(used), logprobs.masked_select(used)
        bad = torch.isnan(logprobs) | (logprobs == float("inf"))
        if bool(bad.any()):
            raise ValueError(f"sample {sample_id!r}: teacher.logprobs of kept entries must not "
                             f"be NaN or +inf, got {logprobs[bad][:3].tolist()}")
        counts = counts.to(torch.int32)
        if s["codec"] == "plain":
            return {"indices": indices.to(torch.int32),
                    "logprobs": logprobs.to(self._logprob_dtype), "rest_logprob": rest,
                    "counts": counts}
        payload, base, width = row_codec.encode(s["codec"], indices.numpy(), logprobs.numpy(),
                                            counts.numpy(), s["vocab_size"], s["k"])
        return {"payload": torch.from_numpy(payload), "row_base": torch.from_numpy(base),
                "rest_logprob": rest, "counts": counts, "width": width}

    def _sampled_rows(self, sample_id, teacher, length: int, tokens) -> dict:
        """Validate one sequence's :class:`~topkd.SampledTeacher` and encode its rows, and its
        token ids (int32 ``[L]``) unless None."""
        if not isinstance(teacher, SampledTeacher):
            raise TypeError(f"the store {self.path} holds sampled rows: teacher must be a "
                            f"topkd.SampledTeacher (topkd.sample_teacher), got "
                            f"{type(teacher).__name__}")
        self._check_settings(sample_id, teacher, "samples")
        s = self.settings
        shape = tuple(teacher.indices.shape)
        if len(shape) != 2 or shape[0] != length or shape[1] > s["samples"] or \
                tuple(teacher.counts.shape) != shape:
            raise ValueError(f"sample {sample_id!r}: teacher.indices and counts must be "
                             f"[{length}, S <= {s['samples']}] (one row per token), got "
                             f"{shape} and {tuple(teacher.counts.shape)}")
        _checks.sampled_teacher(teacher.map(lambda t: t.detach().cpu()))
        indices, counts = teacher.indices.detach().cpu(), teacher.counts.detach().cpu()
        used = counts > 0
        lengths = used.sum(-1)
        if not torch.equal(used, torch.arange(shape[1]) < lengths[:, None]):
            raise ValueError(f"sample {sample_id!r}: unused slots (count 0) must come after "
                             f"the used ones in each row, as sample_teacher makes them")
        if tokens is not None and tokens.numel() and (
                int(tokens.min()) < 0 or int(tokens.max()) >= s["vocab_size"]):
            raise ValueError(f"sample {sample_id!r}: token ids must lie in [0, vocab_size="
                             f"{s['vocab_size']}) to be stored with sampled rows, got "
                             f"{int(tokens.min())}..{int(tokens.max())}; use "
                             f"store_tokens=False")
        payload, width = row_codec.encode_sampled(
            indices.masked_select(used).numpy(), counts.masked_select(used).numpy(),
            lengths.numpy(), s["vocab_size"], s["samples"],
            None if tokens is None else tokens.numpy())
        return {"payload": torch.from_numpy(payload), "width": width}

    def _tokens(self, sample_id, input_ids) -> torch.Tensor:
        ids = torch.as_tensor(input_ids).cpu().to(torch.int64).reshape(-1)
        info = torch.iinfo(fmt.TOKEN_DTYPE)
        if ids.numel() and (int(ids.min()) < info.min or int(ids.max()) > info.max):
            raise ValueError(f"sample {sample_id!r}: token ids must fit in int32 to be stored, "
                             f"got {int(ids.min())}..{int(ids.max())}; use store_tokens=False")
        return ids.to(fmt.TOKEN_DTYPE)

    def flush(self) -> None:
        """Write the pending sequences as one shard (nothing if there are none)."""
        self._check_open()
        if not self._pending:
            return
        from safetensors.torch import save_file

        ids = [p[0] for p in self._pending]
        parts = [p[2] for p in self._pending]
        v2 = self.settings["codec"] != "plain"
        sampled = self.settings["kind"] == "sampled"
        tensors = {n: torch.cat([p[n] for p in parts]) for n in parts[0]
                   if n not in ("width", "rows")}
        rows = torch.tensor([0] + [p["rows"] for p in parts]).cumsum(0)
        first = "payload" if v2 else "indices"
        starts = torch.tensor([0] + [len(p[first]) for p in parts]).cumsum(0)
        if not sampled and bool((tensors["counts"] == self.settings["k"]).all()):
            del tensors["counts"]  # every row full: the counts say nothing
        crc_parts = (fmt.crc_parts_sampled if sampled else
                     fmt.crc_parts_v2 if v2 else fmt.crc_parts)
        version = self.manifest["format_version"]
        crcs = [fmt.checksum(crc_parts(tensors, rows, starts, i), version)
                for i in range(len(ids))]
        tensors["seq_rows"] = rows
        if v2:
            tensors["seq_bytes"] = starts
            tensors["seq_width"] = torch.tensor([p["width"] for p in parts], dtype=torch.uint8)
        else:
            tensors["seq_entries"] = starts
        tensors["token_hash"] = torch.tensor([list(p[1]) for p in self._pending],
                                             dtype=torch.uint8).reshape(len(ids), 16)
        tensors["crc"] = torch.tensor(crcs, dtype=torch.int64)
        ids_json = json.dumps(ids)
        metadata = {"format": fmt.FORMAT, "sample_ids": ids_json,
                    "sample_ids_sha256": fmt.ids_sha256(ids_json),
                    "sha256": json.dumps({n: fmt.sha256(t) for n, t in tensors.items()})}
        name = fmt.shard_name(self.name, self._next_number)
        self._bind()
        # (save_file streams the tensors to the file: no shard-sized bytes copy)
        fmt.write_durably(self.path, name, partial(save_file, tensors, metadata=metadata))
        self._next_number += 1
        self._pending, self._pending_bytes = [], 0

    def close(self) -> None:
        """Write what is pending and release the directory; a store still without a manifest
        (nothing was ever stored) gets one: an empty store. If a write fails, the writer stays
        open (and the rows queued), so ``close`` can be called again."""
        self._close(bind=True)

    def _close(self, *, bind: bool) -> None:
        if self.closed:
            return
        self.flush()
        if bind:
            self._bind()
        if not self.closed:  # (a refused _bind has closed it)
            self.closed = True
            self._lock.close()

    def _check_open(self) -> None:
        if self.closed:
            raise ValueError(f"the writer for {self.path} is closed")

    def __enter__(self) -> TeacherStoreWriter:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        # Closed by an error: keep what was added, but a store with nothing in it stays
        # unbound, so a corrected run may choose other settings.
        self._close(bind=exc_type is None)


MAX_SAMPLES = 255  # a row's distinct ids fit its uint8 count


def writer_codec(codec_name, logprob_dtype) -> tuple[str, str | None]:
    """The writer's codec and log-prob dtype from what was given."""
    if codec_name is None:
        codec_name = "compact" if logprob_dtype is None else "plain"
    _checks.choice("codec", codec_name, fmt.CODECS)
    if codec_name == "plain":
        logprob_dtype = "float16" if logprob_dtype is None else logprob_dtype
        _checks.choice("logprob_dtype", logprob_dtype, tuple(fmt.LOGPROB_DTYPES))
    elif logprob_dtype is not None:
        raise ValueError(f"logprob_dtype={logprob_dtype!r} is for codec='plain' only; codec="
                         f"{codec_name!r} stores its own way (leave logprob_dtype unset)")
    return codec_name, logprob_dtype


def _default_name() -> str:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return f"rank{dist.get_rank():05d}"
    return "main"
