"""Building a teacher store from a Hugging Face causal LM and a data file.

``build_store`` (and ``topkd store build``) reads samples from JSON Lines, Parquet or plain
text, tokenizes them with the teacher's tokenizer (or takes their token ids as given), runs the
teacher in right-padded batches (or, ``padding_free``, each batch packed into one row), and
stores each sequence's :func:`topkd.select_topk` rows under
its sample id. A rerun resumes: ids already stored are skipped before the teacher runs.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings

import torch

from .. import _checks
from ..sampling import sample_teacher
from ..select import select_topk
from ..teacher import SampledTeacher, SparseTeacher
from .rows import trimmed
from .writer import MAX_SAMPLES, writer_codec

TEXT_SUFFIXES = (".txt",)
JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
PARQUET_SUFFIXES = (".parquet", ".pq")
MODEL_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                "float16": torch.float16}
# A directory holds a tokenizer when it has one of these (what AutoTokenizer loads from).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                   "vocab.txt", "spiece.model", "sentencepiece.bpe.model")
# Metadata a resumed build must agree with: mixing them in one store would mix targets.
RESUME_METADATA = ("teacher", "teacher_fingerprint", "model_type", "model_dtype",
                   "max_length", "seed")


def data_format(path: str) -> str:
    """``"jsonl"``, ``"parquet"`` or ``"text"`` from a data file's name; ValueError otherwise."""
    name = os.fspath(path).lower()
    for kind, suffixes in (("jsonl", JSONL_SUFFIXES), ("parquet", PARQUET_SUFFIXES),
                           ("text", TEXT_SUFFIXES)):
        if name.endswith(suffixes):
            return kind
    raise ValueError(f"data file {path!r}: unknown format; use JSON Lines "
                     f"({', '.join(JSONL_SUFFIXES)}), Parquet ({', '.join(PARQUET_SUFFIXES)}) "
                     f"or plain text, one sample per line ({', '.join(TEXT_SUFFIXES)})")


def read_samples(path: str, *, text_field: str = "text", id_field: str = "id",
                 ids_field: str = "input_ids"):
    """Yield ``(where, sample_id, text, input_ids)`` for every sample of a data file, in file
    order; exactly one of ``text`` / ``input_ids`` is not None.

    - JSON Lines: one object per line with ``text_field`` (a string) or ``ids_field`` (a list
      of token ids; used when both are present) and optionally ``id_field`` (str or int).
      Blank lines are skipped.
    - Parquet: the same, as columns.
    - Text: every line (without its line break) is one text sample, empty lines included.

    The default sample id is the 0-based line number (JSON Lines, text) or row number
    (Parquet). ``where`` names the file and line/row for error messages.
    """
    kind = data_format(path)
    if kind == "text":
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f):
                yield f"{path}:{number + 1}", number, line.rstrip("\r\n"), None
        return
    if kind == "jsonl":
        rows = jsonl_rows(path)
    else:
        rows = _parquet_rows(path, (text_field, id_field, ids_field))
    for number, where, row in rows:
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
        sample_id = row.get(id_field)
        if sample_id is None:
            sample_id = number
        elif isinstance(sample_id, bool) or not isinstance(sample_id, (str, int)):
            raise ValueError(f"{where}: the id field {id_field!r} must be a string or an "
                             f"integer, got {sample_id!r}")
        ids, text = row.get(ids_field), row.get(text_field)
        if ids is not None:
            if not isinstance(ids, (list, tuple)) or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise ValueError(f"{where}: the token ids field {ids_field!r} must be a list of "
                                 f"integers, got {_short(ids)}")
            yield where, sample_id, None, list(ids)
        elif text is not None:
            if not isinstance(text, str):
                raise ValueError(f"{where}: the text field {text_field!r} must be a string, got "
                                 f"{_short(text)}")
            yield where, sample_id, text, None
        else:
            raise ValueError(f"{where}: no text field {text_field!r} and no token ids field "
                             f"{ids_field!r} (fields: {sorted(row)})")


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def jsonl_rows(path: str, invalid: str = "not valid JSON ({}); JSON Lines files hold one "
               "object per line"):
    """``(number, where, row)`` of every non-blank line of the JSON Lines file ``path``
    (``number`` 0-based, ``where`` its ``path:line``); a line that is not JSON raises
    ``ValueError("{where}: " + invalid)``, ``invalid`` formatted with the parser's error."""
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f):
            if not line.strip():
                continue
            where = f"{path}:{number + 1}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: " + invalid.format(e)) from None
            yield number, where, row


def _parquet(path: str):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError("reading Parquet data needs pyarrow: pip install pyarrow (or "
                          "topkd[hf])") from None
    return pq.ParquetFile(path)


def _parquet_rows(path: str, fields):
    file = _parquet(path)
    names = file.schema_arrow.names
    columns = [name for name in dict.fromkeys(fields) if name in names]
    number = 0
    for batch in file.iter_batches(batch_size=1024, columns=columns):
        for row in batch.to_pylist():
            yield number, f"{path}: row {number}", row
            number += 1


def count_samples(path: str) -> int:
    """The number of samples in a data file, cheaply (line count, or Parquet metadata)."""
    kind = data_format(path)
    if kind == "parquet":
        return _parquet(path).metadata.num_rows
    count, skip_blank = 0, kind == "jsonl"
    with open(path, "rb") as f:
        for line in f:
            if not skip_blank or line.strip():
                count += 1
    return count


def has_tokenizer(directory: str) -> bool:
    return any(os.path.exists(os.path.join(directory, name)) for name in TOKENIZER_FILES)


def teacher_vocab(config, width: int) -> int:
    """The vocabulary the teacher is normalized over: the config's ``vocab_size`` when it fits
    in the logits' ``width`` (columns past it are padding), else the width."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = getattr(text_config, "vocab_size", None)
    if isinstance(vocab, int) and 1 <= vocab <= width:
        return vocab
    return width


def _distributed(device):
    """(rank, world size, whether this call started the process group, device)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), False, device
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world <= 1:
        return 0, 1, False, device
    if not dist.is_available():
        raise RuntimeError("WORLD_SIZE > 1 but torch.distributed is not available")
    use_cuda = torch.cuda.is_available() and (device is None or
                                              torch.device(device).type == "cuda")
    if use_cuda and (device is None or torch.device(device).index is None):
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    if use_cuda:
        torch.cuda.set_device(torch.device(device))
    dist.init_process_group("nccl" if use_cuda else "gloo")
    return dist.get_rank(), dist.get_world_size(), True, device


def _load_model(teacher_dir: str, dtype, device):
    import transformers
    from transformers import AutoModelForCausalLM

    if isinstance(dtype, str) and dtype != "auto":
        dtype = MODEL_DTYPES[dtype]
    major, minor = (int(p) for p in transformers.__version__.split(".")[:2])
    key = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
    model = AutoModelForCausalLM.from_pretrained(teacher_dir, **{key: dtype})
    return model.to(device).eval()


def _metadata(teacher_dir, model, data, max_length, tokenizer) -> dict:
    import transformers

    try:
        from importlib.metadata import version

        topkd_version = version("topkd")
    except Exception:  # not installed (run from a checkout)
        topkd_version = None
    return {
        "builder": "topkd.store.build",
        "teacher": os.path.basename(os.path.normpath(os.path.abspath(teacher_dir))),
        # the directory's name alone would let two checkpoints named alike mix in one store
        "teacher_fingerprint": teacher_fingerprint(teacher_dir),
        "model_type": getattr(model.config, "model_type", None),
        "model_dtype": str(model.dtype).removeprefix("torch."),
        "data": os.path.basename(os.fspath(data)),
        "max_length": max_length,
        "tokenizer": None if tokenizer is None else type(tokenizer).__name__,
        "add_special_tokens": True,
        "topkd_version": topkd_version,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
    }


def teacher_fingerprint(directory: str, sample_bytes: int = 2**20) -> str:
    """A cheap fingerprint of a checkpoint directory: SHA-256 over ``config.json`` and, for
    every weight file, its name, size and first and last ``sample_bytes`` (which differ between
    two checkpoints of one model; hashing hundreds of GB in full would take minutes)."""
    import hashlib

    digest = hashlib.sha256()
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if name != "config.json" and not name.endswith((".safetensors", ".bin", ".pt")):
            continue
        size = os.path.getsize(path)
        digest.update(f"{name}\0{size}\0".encode())
        with open(path, "rb") as f:
            digest.update(f.read(sample_bytes))
            if size > 2 * sample_bytes:
                f.seek(size - sample_bytes)
                digest.update(f.read(sample_bytes))
    return "sha256:" + digest.hexdigest()[:32]


class _Progress:
    """A tqdm bar over tokens whose total is estimated from the tokens per sample so far and
    the samples left, so it shows tokens/s and an ETA without tokenizing everything first."""

    def __init__(self, enabled: bool, samples: int, rank: int, world: int):
        self.bar = None
        self.samples_left = samples
        self.done_samples = self.done_tokens = 0
        if not enabled:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            return
        desc = "teacher" if world == 1 else f"teacher rank {rank}"
        self.bar = tqdm(total=None, unit="tok", unit_scale=True, desc=desc, position=rank,
                        dynamic_ncols=True, disable=None, file=sys.stderr)

    def skip(self, samples: int = 1) -> None:
        self.samples_left -= samples

    def update(self, samples: int, tokens: int) -> None:
        self.samples_left -= samples
        self.done_samples += samples
        self.done_tokens += tokens
        if self.bar is None:
            return
        per_sample = self.done_tokens / max(self.done_samples, 1)
        self.bar.total = int(self.done_tokens + per_sample * max(self.samples_left, 0))
        self.bar.update(tokens)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.total = self.bar.n
            self.bar.close()


def build_store(teacher_dir, data, out, *, k: int | None = None, samples: int | None = None,
                seed: int = 0, top_p: float | None = None,
                top_p_min_k: int = 1, temperature: float = 1.0, batch_size: int = 8,
                max_length: int | None = None, padding_free: bool = False,
                codec: str | None = None, logprob_dtype: str | None = None,
                text_field: str = "text", id_field: str = "id", ids_field: str = "input_ids",
                dtype="auto", device=None, shard_teacher: bool = False,
                shard_bytes: int = 256 * 2**20, store_tokens: bool = True,
                progress: bool = True) -> dict:
    """Run a Hugging Face causal LM over a data file and store its top-K rows at ``out``.

    Args:
        teacher_dir: a directory ``AutoModelForCausalLM.from_pretrained`` loads (no download);
            its tokenizer, if it has one, tokenizes text samples and fingerprints the store.
        data: a JSON Lines, Parquet or text file (see :func:`read_samples`).
        out: the store's directory, created or resumed.
        k, top_p, top_p_min_k, temperature: :func:`topkd.select_topk`'s settings.
        samples, seed: instead of ``k``: store ``samples`` tokens drawn per position from the
            teacher at ``temperature`` (RS-KD, :func:`topkd.sample_teacher`), each sequence's
            draws seeded by ``(seed, its sample id)``: the same rows whatever the batching,
            the ranks or a resumed run.
        batch_size: sequences per forward pass (right-padded with an attention mask).
        max_length: truncate every sequence (text or given ids) to this many tokens.
        padding_free: run each batch packed into one row (``position_ids`` restarting at each
            sequence, no mask, no padding computed); each sequence's rows are stored as the
            padded build stores them (to rounding). The teacher's attention must keep packed
            sequences apart: checked on the model before the first batch (transformers'
            ``sdpa`` and ``eager`` do; a ValueError names an implementation that does not).
        codec, logprob_dtype: how the rows are stored, as :class:`TeacherStoreWriter` takes
            them (default: ``"compact"``; ``"exact"`` for lossless log-probs).
        text_field, id_field, ids_field: the field names of JSON Lines / Parquet samples.
        dtype: the teacher's weights: ``"auto"`` (the checkpoint's), ``"float32"``,
            ``"bfloat16"``, ``"float16"`` or a ``torch.dtype``. The logits stay in the model's
            dtype; the selection reads them chunk by chunk.
        device: where the teacher runs (default: CUDA if available, else CPU).
        shard_teacher: under ``torch.distributed`` with 2+ ranks, shard the teacher over the
            ranks with FSDP2 for inference (``fully_shard`` on its decoder layers and root,
            each layer gathered for its forward), each rank still its own samples: a teacher
            larger than one device. Rank 0 alone reads the checkpoint, on the CPU; the other
            ranks take their shards of its weights by broadcast. The
            stored rows are those of the unsharded build (the gathered weights are the
            checkpoint's bits). With one rank the teacher runs unsharded.
        shard_bytes: a shard is written once its rows reach this many bytes.
        store_tokens: keep the token ids in the store (int32, 4 B per token), so training
            needs only the store (``TeacherDataset(store)``).
        progress: show a tqdm bar over tokens (only on a terminal).

    Under ``torch.distributed`` (initialized, or ``WORLD_SIZE > 1`` as set by ``torchrun``, in
    which case the process group is started here: NCCL on CUDA, else gloo) rank ``r`` of ``W``
    takes samples ``i`` with ``i % W == r`` and writes its own shards. With ``shard_teacher``
    the ranks run their forwards in step (a rank out of batches runs dummy forwards, whose
    rows are not written, until every rank is done); an error preparing or writing one rank's
    batch stops every rank at the next forward; a wait is bounded by the process group's
    timeout.

    Returns a summary: ``added`` / ``skipped`` (already stored) sequences, ``tokens`` added,
    ``seconds``, ``rank``, ``world_size``, ``path``, ``sharded`` (whether the teacher was).
    """
    start = time.perf_counter()
    if (k is None) == (samples is None):
        raise ValueError(f"give exactly one of k (top-K rows) and samples (sampled rows), got "
                         f"k={k!r}, samples={samples!r}")
    if samples is None:
        k = _checks.integer("k", k, 1)
        # (what the writer checks again, checked here before a model is loaded)
        writer_codec(codec, logprob_dtype)
    else:
        samples = _checks.integer("samples", samples, 1, MAX_SAMPLES)
        if top_p is not None or codec is not None or logprob_dtype is not None:
            raise ValueError("samples stores drawn tokens: top_p, codec and logprob_dtype "
                             "apply to top-K rows")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {seed!r}")
    batch_size = _checks.integer("batch_size", batch_size, 1)
    if max_length is not None:
        max_length = _checks.integer("max_length", max_length, 1)
    _checks.temperature(temperature)
    _checks.top_p(top_p, top_p_min_k)
    _checks.integer("shard_bytes", shard_bytes, 1)
    if not isinstance(store_tokens, bool):
        raise TypeError(f"store_tokens must be a bool, got {store_tokens!r}")
    if not isinstance(padding_free, bool):
        raise TypeError(f"padding_free must be a bool, got {padding_free!r}")
    if not isinstance(shard_teacher, bool):
        raise TypeError(f"shard_teacher must be a bool, got {shard_teacher!r}")
    if not (dtype == "auto" or dtype in MODEL_DTYPES or isinstance(dtype, torch.dtype)):
        raise ValueError(f"dtype must be 'auto', one of {tuple(MODEL_DTYPES)} or a torch.dtype, "
                         f"got {dtype!r}")
    teacher_dir, data, out = os.fspath(teacher_dir), os.fspath(data), os.fspath(out)
    if not os.path.isdir(teacher_dir):
        raise FileNotFoundError(f"teacher directory {teacher_dir!r} does not exist")
    if not os.path.isfile(data):
        raise FileNotFoundError(f"data file {data!r} does not exist")
    data_format(data)

    rank, world, started_group, device = _distributed(device)
    try:
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        device = torch.device(device)
        return _build(teacher_dir, data, out, k=k, samples=samples, seed=seed, top_p=top_p,
                      top_p_min_k=top_p_min_k,
                      temperature=temperature, batch_size=batch_size, max_length=max_length,
                      padding_free=padding_free, codec=codec, logprob_dtype=logprob_dtype,
                      text_field=text_field, id_field=id_field,
                      ids_field=ids_field, dtype=dtype, device=device,
                      shard=shard_teacher and world > 1, shard_bytes=shard_bytes,
                      store_tokens=store_tokens, progress=progress, rank=rank, world=world,
                      start=start)
    finally:
        if started_group:
            import torch.distributed as dist

            dist.destroy_process_group()


def _build(teacher_dir, data, out, *, k, samples, seed, top_p, top_p_min_k, temperature,
           batch_size,
           max_length, padding_free, codec, logprob_dtype, text_field, id_field, ids_field,
           dtype, device, shard,
           shard_bytes, store_tokens, progress, rank, world, start) -> dict:
    from . import tokenizer_fingerprint
    from .writer import TeacherStoreWriter

    tokenizer = None
    if has_tokenizer(teacher_dir):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(teacher_dir)
    if shard:  # read by rank 0 alone, on the CPU, and moved to the devices a shard at a time
        from .sharded_teacher import load_sharded

        model, device = load_sharded(_load_model, teacher_dir, dtype, device, world)
    else:
        model = _load_model(teacher_dir, dtype, device)
    if padding_free:  # (a forward: collective, on every rank alike, when sharded)
        from ..hf.packing import PackingCheck

        PackingCheck()(model, "teacher")
    output = model.get_output_embeddings()
    width = output.weight.shape[0] if output is not None else model.config.vocab_size
    vocab = teacher_vocab(model.config, width)
    embeddings = model.get_input_embeddings().weight.shape[0]
    text_config = getattr(model.config, "get_text_config", lambda: model.config)()
    max_positions = getattr(text_config, "max_position_embeddings", None)
    pad_id = 0
    if tokenizer is not None and tokenizer.pad_token_id is not None:
        pad_id = tokenizer.pad_token_id
    metadata = _metadata(teacher_dir, model, data, max_length, tokenizer)
    metadata["padding_free"] = padding_free

    if samples is not None:
        metadata["seed"] = seed
    writer = TeacherStoreWriter(
        out, k=k, samples=samples, vocab_size=vocab, top_p=top_p, top_p_min_k=top_p_min_k,
        temperature=temperature, codec=codec, logprob_dtype=logprob_dtype,
        tokenizer_fingerprint=None if tokenizer is None else tokenizer_fingerprint(tokenizer),
        store_tokens=store_tokens, metadata=metadata, match_metadata=RESUME_METADATA,
        shard_bytes=shard_bytes)
    # (closed by an error before anything was stored, the writer binds no settings)
    with writer:
        total = count_samples(data)
        mine = len(range(rank, total, world))
        bar = _Progress(progress, mine, rank, world)
        added = skipped = tokens = 0
        warned = False

        def batches():
            """This rank's samples not yet stored, in batches of ``batch_size``."""
            nonlocal skipped
            seen: set = set()
            pending: list = []
            for ordinal, sample in enumerate(read_samples(data, text_field=text_field,
                                                          id_field=id_field,
                                                          ids_field=ids_field)):
                where, sample_id = sample[:2]
                if sample_id in seen:
                    raise ValueError(f"{where}: sample id {sample_id!r} appears twice in {data}")
                seen.add(sample_id)
                if ordinal % world != rank:
                    continue
                if sample_id in writer:
                    skipped += 1
                    bar.skip()
                    continue
                if sample[2] is not None and tokenizer is None:
                    raise ValueError(f"{where}: a text sample, but the teacher directory "
                                     f"{teacher_dir} has no tokenizer; give token ids "
                                     f"({ids_field!r}) or add a tokenizer")
                pending.append(sample)
                if len(pending) == batch_size:
                    yield pending
                    pending = []
            if pending:
                yield pending

        def prepare(batch) -> list[list[int]]:
            nonlocal warned
            ids = _tokenize(batch, tokenizer, max_length, embeddings)
            longest = max(map(len, ids), default=0)
            if not warned and max_positions and longest > max_positions:
                warned = True
                warnings.warn(f"a sequence has {longest} tokens, more than the teacher's "
                              f"max_position_embeddings={max_positions}; pass max_length",
                              stacklevel=2)
            return ids

        def run(batch, ids) -> list:
            if samples is None:
                def rows(logits, _):
                    return select_topk(logits, k, top_p=top_p, top_p_min_k=top_p_min_k,
                                       temperature=temperature, vocab_size=vocab)
            else:
                def rows(logits, i):
                    drawn = sample_teacher(logits[None], samples, temperature=temperature,
                                           seed=seed, sample_ids=[batch[i][1]],
                                           vocab_size=vocab)
                    return trimmed(drawn.map(lambda t: t[0].cpu()))
            return _teachers(model, ids, pad_id, device, width, rows, k=k or samples,
                             samples=samples, temperature=temperature, vocab=vocab,
                             padding_free=padding_free, always_forward=shard)

        def write(batch, ids, teachers) -> None:
            nonlocal added, tokens
            for (_, sample_id, _, _), seq, teacher in zip(batch, ids, teachers, strict=True):
                writer.add(sample_id, seq, teacher)
                tokens += len(seq)
            added += len(batch)
            bar.update(len(batch), sum(map(len, ids)))

        if not shard:
            for batch in batches():
                ids = prepare(batch)
                write(batch, ids, run(batch, ids))
        else:
            # every rank runs one forward per step until no rank has a batch left
            from .sharded_teacher import Lockstep

            lockstep, mine_left, failure = Lockstep(rank, device), batches(), None
            while True:
                batch = ids = None
                if failure is None:
                    try:
                        batch = next(mine_left, None)
                        ids = None if batch is None else prepare(batch)
                    except Exception as e:  # stops every rank at this step
                        batch, failure = None, e
                if not lockstep.agree(batch is not None, failure):
                    break
                teachers = run(batch or [], ids or [])
                if batch is not None:
                    try:
                        write(batch, ids, teachers)
                    except Exception as e:  # reported at the next step, before its forward
                        failure = e
        bar.close()
    return {"path": out, "added": added, "skipped": skipped, "tokens": tokens,
            "seconds": time.perf_counter() - start, "rank": rank, "world_size": world,
            "sharded": shard}


def encode_texts(tokenizer, texts: list[str], max_length: int | None) -> list[list[int]]:
    """Token ids of ``texts`` as every topkd entry point makes them (the store's build,
    ``topkd distill``, :class:`~topkd.hf.KDCollator`): the tokenizer's special tokens added,
    truncated to ``max_length``. Stores are read by the hash of these ids, so one function
    makes them everywhere."""
    if not texts:
        return []
    encoded = tokenizer(list(texts), truncation=max_length is not None,
                        max_length=max_length)["input_ids"]
    return [list(seq) for seq in encoded]


def _tokenize(batch, tokenizer, max_length, embeddings) -> list[list[int]]:
    """Token ids of a batch of samples: texts tokenized together (truncated to
    ``max_length``), given ids checked and truncated."""
    texts = [(i, s[2]) for i, s in enumerate(batch) if s[3] is None]
    ids: list = [s[3] for s in batch]
    encoded = encode_texts(tokenizer, [t for _, t in texts], max_length)
    for (i, _), seq in zip(texts, encoded, strict=True):
        ids[i] = seq
    for (where, sample_id, _, _), seq in zip(batch, ids, strict=True):
        t = torch.tensor(seq, dtype=torch.int64)
        bad = t[(t < 0) | (t >= embeddings)]
        if bad.numel():
            raise ValueError(f"{where}: sample {sample_id!r} has token id {int(bad[0])}, outside "
                             f"the teacher's embeddings [0, {embeddings})")
    if max_length is not None:
        ids = [seq[:max_length] for seq in ids]
    return ids


def _teachers(model, ids, pad_id, device, width, rows, *, k, samples, temperature, vocab,
              padding_free=False, always_forward=False) -> list:
    """One forward pass over the non-empty sequences (right-padded, or packed in one row),
    then ``rows(logits [L_i, V], i)`` on each sequence's own rows (its top-K, or its draws);
    empty sequences get zero rows. ``always_forward``: with no non-empty sequence (or none at
    all), a dummy forward all the same (a sharded teacher's forward is collective)."""
    teachers: list = [None] * len(ids)
    live = [i for i, seq in enumerate(ids) if seq]
    if not live and always_forward:
        from .sharded_teacher import dummy_forward

        dummy_forward(model, device)
    elif live and padding_free:
        input_ids = torch.tensor([t for i in live for t in ids[i]], dtype=torch.int64)
        positions = torch.cat([torch.arange(len(ids[i])) for i in live])
        with torch.inference_mode():
            logits = model(input_ids=input_ids[None].to(device),
                           position_ids=positions[None].to(device), use_cache=False).logits[0]
            if logits.shape[-1] != width:
                raise RuntimeError(f"the teacher's logits have {logits.shape[-1]} columns, its "
                                   f"output embeddings {width}")
            start = 0
            for i in live:
                teachers[i] = rows(logits[start:start + len(ids[i])], i)
                start += len(ids[i])
            del logits
    elif live:
        longest = max(len(ids[i]) for i in live)
        input_ids = torch.full((len(live), longest), pad_id, dtype=torch.int64)
        mask = torch.zeros((len(live), longest), dtype=torch.int64)
        for b, i in enumerate(live):
            input_ids[b, :len(ids[i])] = torch.tensor(ids[i], dtype=torch.int64)
            mask[b, :len(ids[i])] = 1
        with torch.inference_mode():
            logits = model(input_ids=input_ids.to(device), attention_mask=mask.to(device),
                           use_cache=False).logits
            if logits.shape[-1] != width:
                raise RuntimeError(f"the teacher's logits have {logits.shape[-1]} columns, its "
                                   f"output embeddings {width}")
            for b, i in enumerate(live):
                teachers[i] = rows(logits[b, :len(ids[i])], i)
            del logits
    for i, seq in enumerate(ids):
        if not seq and samples is not None:
            teachers[i] = SampledTeacher(torch.empty(0, 1, dtype=torch.int64),
                                         torch.empty(0, 1, dtype=torch.int32), samples,
                                         temperature, vocab)
        elif not seq:
            teachers[i] = SparseTeacher(torch.empty(0, k, dtype=torch.int64),
                                        torch.empty(0, k), torch.empty(0), temperature, vocab)
    return teachers
