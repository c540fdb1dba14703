"""``topkd distill``: distill a teacher into a student with :class:`~topkd.hf.KDTrainer`.

The teacher runs online (``teacher=`` a model directory), or its top-K rows come from a teacher
store (``store=``; the teacher model is not loaded). The data files are those
``topkd store build`` reads (:func:`topkd.store.build.read_samples`: JSON Lines, Parquet,
text), tokenized with the student's tokenizer; every token is learned (no prompt masking), by
the one alignment rule of :class:`~topkd.hf.KDCollator`.

Checkpoints (``checkpoint-N`` every ``save_steps`` steps, the Trainer's: model, optimizer,
scheduler, RNG, step) go under ``out``; ``resume=True`` continues from the newest complete
one, with the same data order, and ends where an uninterrupted run ends. The distilled
student (model and tokenizer) is saved to ``out`` itself, loadable with ``from_pretrained``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time

import torch

SETTINGS_FILE = "topkd_distill.json"
# settings a resumed run may change: they do not change what is trained
RESUMABLE = ("save_steps", "save_total_limit", "logging_steps", "eval_data", "eval_steps",
             "progress", "impl", "padding_free")
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def distill(student, data, out, *, teacher=None, store=None, eval_data=None, k: int | None = None,
            top_p: float | None = None, temperature: float | None = None,
            divergence="kl", beta: float = 0.5, alpha: float = 0.1, impl: str = "auto",
            kd_weight: float = 1.0, ce_weight: float = 0.0, max_steps: int | None = None,
            epochs: float = 1.0, batch_size: int = 8, grad_accum: int = 1, lr: float = 5e-5,
            max_length: int | None = None, padding_free: bool = False, bf16: bool = False,
            teacher_dtype: str | None = None,
            seed: int = 42, save_steps: int = 500, save_total_limit: int | None = 2,
            logging_steps: int = 10, eval_steps: int | None = None, resume: bool = False,
            text_field: str = "text", id_field: str = "id", ids_field: str = "input_ids",
            progress: bool = True, fsdp: bool = False, deepspeed: str | None = None) -> dict:
    """Distill ``teacher`` (a model directory) or a teacher ``store`` into ``student`` (a model
    directory) over ``data``, and save the student to ``out``.

    Args:
        student: a directory ``AutoModelForCausalLM.from_pretrained`` loads (no download),
            trained in float32 parameters (``bf16``: under bfloat16 autocast). Its tokenizer
            tokenizes the data (else the teacher's, which is then saved with the student).
        data: a JSON Lines, Parquet or text file; ``text_field`` / ``ids_field`` / ``id_field``
            as for ``topkd store build``. Sequences shorter than 2 tokens (nothing to learn)
            are skipped.
        out: the output directory: checkpoints, :data:`SETTINGS_FILE`, the final student.
        teacher: the teacher's directory (online). Its tokenizer must be the student's (a
            fingerprint is compared). With ``store`` it is not loaded: the store's recorded
            teacher fingerprint must be this checkpoint's.
        store: a teacher store's directory (offline): items are read by the sample ids the data
            file gives (the ids the store was built with), checked against their tokens' hash.
            ``max_length`` defaults to the store's build setting and must equal it.
        eval_data: a held-out data file: ``eval_kl`` (KL(teacher || student)) and ``eval_ce``
            before and after training (and every ``eval_steps``). With ``store``, its samples
            are read from the store too.
        k, top_p, temperature, divergence, beta, alpha, kd_weight, ce_weight: the
            :class:`~topkd.hf.KDConfig` settings (``k=None``: the full vocabulary online, the
            store's ``k`` offline).
        max_steps: optimizer steps (None: ``epochs`` passes over the data).
        batch_size, grad_accum, lr, seed: per-device batch size, gradient accumulation, peak
            learning rate (linear decay, AdamW), the seed of the data order.
        max_length: truncate every sequence to this many tokens.
        padding_free: pack each micro-batch's sequences into one row, ``position_ids``
            restarting at each (:class:`~topkd.hf.KDCollator`'s ``padding_free``): no padding
            is computed and the loss is the padded batch's. The models' attention must keep
            packed sequences apart (checked once per model; transformers' ``sdpa`` and
            ``eager`` do).
        teacher_dtype: ``"float32"``, ``"bfloat16"``, ``"float16"`` or ``"auto"`` (the
            checkpoint's); default bfloat16 with ``bf16``, else float32.
        save_steps, save_total_limit: a checkpoint every ``save_steps`` steps (and at the end),
            keeping the newest ``save_total_limit`` (None: all).
        logging_steps: log ``loss``, ``kd`` (and ``ce``) every so many steps (and at the end).
        resume: continue from the newest complete checkpoint in ``out`` (none: start afresh).
            The run's settings must be those recorded in ``out``.
        progress: the Trainer's progress bars.
        fsdp: shard the student with FSDP2 through accelerate's plugin
            (:func:`fsdp_settings`); CUDA GPUs only (a ValueError without them).
        deepspeed: a DeepSpeed config (a JSON file) for the Trainer
            (``TrainingArguments(deepspeed=...)``, :func:`deepspeed_settings`); under ZeRO
            stage 3 the student is partitioned when training starts and the fused loss
            gathers its head through DeepSpeed's hooks. Not with ``fsdp``.

    Under ``torchrun`` every rank calls this; the Trainer shards the batches (DDP, NCCL on
    CUDA, gloo on CPU). Returns a summary: ``steps``, ``epochs``, ``kd`` (the last logged KD
    per token), ``loss``, ``eval_before`` / ``eval_after`` (metric dicts or None),
    ``resumed_from`` (a checkpoint path or None), ``samples``, ``tokens``, ``skipped``
    (too-short samples), ``seconds``, ``out``.
    """
    start = time.perf_counter()
    if teacher is None and store is None:
        raise ValueError("give a teacher (online) or a store (offline)")
    for name, path in (("student", student), ("teacher", teacher), ("store", store)):
        if path is not None and not os.path.isdir(path):
            raise FileNotFoundError(f"{name} directory {os.fspath(path)!r} does not exist")
    for name, path in (("data", data), ("eval_data", eval_data)):
        if path is not None and not os.path.isfile(path):
            raise FileNotFoundError(f"{name} file {os.fspath(path)!r} does not exist")
    if fsdp and deepspeed is not None:
        raise ValueError(f"fsdp=True (--fsdp) and deepspeed={os.fspath(deepspeed)!r} "
                         f"(--deepspeed) both shard the student: choose one")
    deepspeed_config = None if deepspeed is None else deepspeed_settings(deepspeed)
    if deepspeed is not None and "LOCAL_RANK" not in os.environ:
        raise ValueError("deepspeed (--deepspeed) needs a distributed launcher, even for one "
                         "process: torchrun --nproc-per-node N, deepspeed or accelerate launch")
    if fsdp and not torch.cuda.is_available():
        raise ValueError("fsdp=True (--fsdp) needs CUDA GPUs: accelerate runs FSDP on GPUs only "
                         "(on CPU the Trainer would fall back to DDP); leave it out to run DDP")
    if teacher_dtype not in (None, "auto", "float32", "bfloat16", "float16"):
        raise ValueError(f"teacher_dtype must be auto, float32, bfloat16 or float16, got "
                         f"{teacher_dtype!r}")
    from ..store.build import data_format, has_tokenizer

    for path in (data, eval_data):
        if path is not None:
            data_format(path)
    out = os.fspath(out)
    rank, world = _rank_and_world()
    if teacher_dtype is None:
        teacher_dtype = "bfloat16" if bf16 else "float32"

    from transformers import AutoTokenizer

    tokenizer = teacher_tokenizer = None
    if teacher is not None and has_tokenizer(teacher):
        teacher_tokenizer = AutoTokenizer.from_pretrained(teacher)
    if has_tokenizer(student):
        tokenizer = AutoTokenizer.from_pretrained(student)
    else:
        tokenizer = teacher_tokenizer
    opened = None
    if store is not None:
        from ..store import TeacherStore

        opened = TeacherStore(store)
        built = opened.manifest.get("metadata", {}).get("max_length", max_length)
        if max_length is None:
            max_length = built
        elif built != max_length:
            raise ValueError(f"max_length={max_length} but the store {opened.path} was built "
                             f"with max_length={built}: the tokens would differ from the "
                             f"store's; use its setting")
        if teacher is not None:
            _same_teacher(opened, teacher)
    from .trainer import divergence_of

    _check_configs(student, None if store is not None else teacher, opened, tokenizer,
                   teacher_tokenizer, k=k, top_p=top_p, temperature=temperature,
                   divergence=divergence_of(divergence, beta, alpha))

    settings = {
        "student": os.path.abspath(student), "data": os.path.abspath(data),
        "teacher": None if store is not None else os.path.abspath(teacher),
        "store": None if store is None else os.path.abspath(store),
        "eval_data": None if eval_data is None else os.path.abspath(eval_data),
        "k": k, "top_p": top_p, "temperature": temperature,
        "divergence": divergence if isinstance(divergence, str) else repr(divergence),
        "impl": impl, "beta": beta, "alpha": alpha, "kd_weight": kd_weight, "ce_weight": ce_weight,
        "max_steps": max_steps, "epochs": None if max_steps is not None else epochs,
        "batch_size": batch_size, "grad_accum": grad_accum, "lr": lr, "max_length": max_length,
        "padding_free": bool(padding_free),
        "bf16": bool(bf16), "teacher_dtype": None if store is not None else teacher_dtype,
        "seed": seed, "world_size": world, "text_field": text_field, "id_field": id_field,
        "ids_field": ids_field, "save_steps": save_steps, "save_total_limit": save_total_limit,
        "logging_steps": logging_steps, "eval_steps": eval_steps, "progress": bool(progress),
        # (absent when off: older runs still resume)
        **({"fsdp": True} if fsdp else {}),
        **({"deepspeed": deepspeed_config} if deepspeed is not None else {})}
    checkpoint = _resume_point(out, settings, resume)

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(student, dtype=torch.float32)
    reading = dict(text_field=text_field, id_field=id_field, ids_field=ids_field)
    limit = _embeddings(model)
    train = _Samples.read(data, tokenizer, max_length, limit, opened, **reading)
    evaluation = None
    if eval_data is not None:
        evaluation = _Samples.read(eval_data, tokenizer, max_length, limit, opened, **reading)
    if not len(train):
        raise ValueError(f"{data}: no sample has 2 tokens or more: nothing to learn")
    positions = getattr(_text_config(model), "max_position_embeddings", None)
    if positions and train.longest > positions:
        print(f"topkd distill: warning: a sequence has {train.longest} tokens, more than the "
              f"student's max_position_embeddings={positions}; pass --max-length",
              file=sys.stderr)

    teacher_model = None
    if store is None:
        from ..store.build import MODEL_DTYPES

        dtype = teacher_dtype if teacher_dtype == "auto" else MODEL_DTYPES[teacher_dtype]
        teacher_model = AutoModelForCausalLM.from_pretrained(teacher, dtype=dtype)

    from transformers import TrainerCallback

    from .trainer import KDConfig, KDTrainer

    class LogLastStep(TrainerCallback):
        """Log at the last step too, so the run's final KD is in the logs."""

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step >= state.max_steps:
                control.should_log = True

    config = KDConfig(
        output_dir=out, k=k, top_p=top_p, temperature=temperature, divergence=divergence,
        impl=impl, beta=beta, alpha=alpha, kd_weight=kd_weight, ce_weight=ce_weight,
        max_steps=-1 if max_steps is None else max_steps, num_train_epochs=epochs,
        per_device_train_batch_size=batch_size, per_device_eval_batch_size=batch_size,
        gradient_accumulation_steps=grad_accum, learning_rate=lr, bf16=bool(bf16), seed=seed,
        padding_free=bool(padding_free),
        save_strategy="steps", save_steps=save_steps, save_total_limit=save_total_limit,
        logging_strategy="steps", logging_steps=logging_steps,
        eval_strategy="steps" if eval_steps and evaluation is not None else "no",
        eval_steps=eval_steps if evaluation is not None else None,
        report_to="none", disable_tqdm=not progress,
        dataloader_pin_memory=torch.cuda.is_available(),
        # without CUDA, use_cpu: else accelerate starts a process group under torchrun but
        # does not see a distributed run (no DDP, the ranks train apart)
        use_cpu=not torch.cuda.is_available(),
        ddp_backend="gloo" if world > 1 and not torch.cuda.is_available() else None,
        **(fsdp_settings(model) if fsdp else {}),
        **({"deepspeed": deepspeed_config} if deepspeed is not None else {}))
    source = {"store": opened} if store is not None else {
        "teacher": teacher_model, "teacher_tokenizer": teacher_tokenizer}
    trainer = KDTrainer(model=model, args=config, train_dataset=train, eval_dataset=evaluation,
                        processing_class=tokenizer, callbacks=[LogLastStep()], **source)
    trainer.accelerator.wait_for_everyone()  # every rank has read out's previous state
    if trainer.is_world_process_zero():
        os.makedirs(out, exist_ok=True)
        _write_json(os.path.join(out, SETTINGS_FILE), settings)
        if checkpoint is not None:
            print(f"topkd distill: resuming from {checkpoint}", file=sys.stderr)
            _remove_incomplete(out, checkpoint)

    before = trainer.evaluate() if evaluation is not None and checkpoint is None else None
    trainer.train(resume_from_checkpoint=checkpoint)
    after = None
    if evaluation is not None:  # (the last step's evaluation, when eval_steps made one)
        done = [entry for entry in trainer.state.log_history if "eval_kl" in entry
                and entry.get("step") == trainer.state.global_step] if eval_steps else []
        after = ({key: value for key, value in done[-1].items() if key.startswith("eval_")}
                 if done else trainer.evaluate())
    trainer.save_model(out)

    logged = [entry for entry in trainer.state.log_history if "kd" in entry]
    last = logged[-1] if logged else {}
    return {"out": out, "steps": trainer.state.global_step, "epochs": trainer.state.epoch,
            "kd": last.get("kd"), "loss": last.get("loss"), "eval_before": before,
            "eval_after": after, "resumed_from": checkpoint, "samples": len(train),
            "tokens": train.tokens, "skipped": train.skipped,
            "seconds": time.perf_counter() - start, "rank": rank, "world_size": world}


def fsdp_settings(model) -> dict:
    """The ``TrainingArguments`` settings of an FSDP2 run under accelerate's plugin: every
    decoder layer (the model's ``_no_split_modules`` classes) and the root wrapped by
    ``fully_shard`` with ``reshard_after_forward=True`` (full sharding), so the student's LM
    head reaches the fused loss as a DTensor sharded by rows; full state dicts saved. The
    teacher stays whole on every rank (the Trainer prepares the student only)."""
    layers = sorted(set(getattr(model, "_no_split_modules", None) or ()))
    if not layers:
        raise ValueError(f"{type(model).__name__} names no decoder layer class "
                         f"(_no_split_modules) for FSDP to wrap")
    return {"fsdp": True,
            "fsdp_config": {"version": 2, "reshard_after_forward": True,
                            "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                            "transformer_layer_cls_to_wrap": layers,
                            "state_dict_type": "FULL_STATE_DICT"}}


def deepspeed_settings(path) -> dict:
    """The DeepSpeed config in the JSON file ``path``, for ``TrainingArguments(deepspeed=...)``
    (its ``"auto"`` values are the Trainer's settings). Under ZeRO stage 3,
    ``stage3_gather_16bit_weights_on_model_save`` defaults to true, so the student saved at
    the end is whole (a config that sets it false keeps that: only DeepSpeed's partitioned
    checkpoint is then written). A ValueError names a missing or malformed file, an
    ImportError a missing deepspeed."""
    import importlib.util
    import json

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"deepspeed config {path!r} (--deepspeed) is not a file")
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"deepspeed config {path!r} (--deepspeed) is not JSON: {e}") from e
    if not isinstance(config, dict):
        raise ValueError(f"deepspeed config {path!r} (--deepspeed) holds a "
                         f"{type(config).__name__}, not a JSON object")
    if importlib.util.find_spec("deepspeed") is None:
        raise ImportError("--deepspeed needs deepspeed: pip install 'topkd[deepspeed]'")
    zero = config.get("zero_optimization") or {}
    if isinstance(zero, dict) and zero.get("stage") == 3:
        config = {**config, "zero_optimization": {
            "stage3_gather_16bit_weights_on_model_save": True, **zero}}
    return config


def summary_lines(summary: dict) -> list[str]:
    """The few lines ``topkd distill`` prints at the end."""
    kd = "-" if summary["kd"] is None else f"{summary['kd']:.4f}"
    epochs = summary["epochs"] or 0.0
    lines = [f"trained {summary['steps']} steps ({epochs:.2f} epochs over {summary['samples']} "
             f"samples, {summary['tokens']} tokens) in {summary['seconds']:.1f} s; "
             f"last logged kd {kd} per token"]
    if summary["skipped"]:
        lines.append(f"skipped {summary['skipped']} samples shorter than 2 tokens")
    if summary["resumed_from"]:
        lines.append(f"resumed from {summary['resumed_from']}")
    before, after = summary["eval_before"], summary["eval_after"]
    if after is not None:
        start = "" if before is None else (f"{before['eval_kl']:.4f} -> ")
        lines.append(f"held-out KL(teacher || student) {start}{after['eval_kl']:.4f}, "
                     f"student CE {after['eval_ce']:.4f}")
    lines.append(f"student saved to {summary['out']}")
    return lines


# -- data ------------------------------------------------------------------------------------

class _Samples(torch.utils.data.Dataset):
    """Tokenized samples as the Trainer's dataset: items ``{"input_ids": int64 [L],
    "sample_id": id}`` (every token learned: the collator's labels are the tokens)."""

    def __init__(self, ids: list, sequences: list, skipped: int):
        self.ids, self.sequences, self.skipped = ids, sequences, skipped
        self.tokens = sum(len(s) for s in sequences)
        self.longest = max((len(s) for s in sequences), default=0)

    def __len__(self) -> int:
        return len(self.sequences)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.sequences[index].to(torch.int64),
                "sample_id": self.ids[index]}

    @classmethod
    def read(cls, path, tokenizer, max_length, limit: int, store, *, text_field, id_field,
             ids_field, batch: int = 1024) -> _Samples:
        """Read and tokenize a data file as ``topkd store build`` does (texts with truncation
        to ``max_length``, given ids cut to it), checking ids against the student's
        embeddings (``limit``) and, with a store, that it holds every sample."""
        from ..store.build import encode_texts, read_samples

        ids, sequences, skipped, seen, pending = [], [], 0, set(), []

        def flush():
            nonlocal skipped
            encoded = iter(encode_texts(tokenizer, [s[2] for s in pending if s[3] is None],
                                        max_length))
            for where, sample_id, _, given in pending:
                seq = next(encoded) if given is None else given
                if max_length is not None:
                    seq = seq[:max_length]
                bad = [t for t in seq if not 0 <= t < limit]
                if bad:
                    raise ValueError(f"{where}: sample {sample_id!r} has token id {bad[0]}, "
                                     f"outside the student's embeddings [0, {limit})")
                if len(seq) < 2:
                    skipped += 1
                    continue
                ids.append(sample_id)
                sequences.append(torch.tensor(seq, dtype=torch.int32))
            pending.clear()

        for sample in read_samples(path, text_field=text_field, id_field=id_field,
                                   ids_field=ids_field):
            where, sample_id, text = sample[:3]
            if sample_id in seen:
                raise ValueError(f"{where}: sample id {sample_id!r} appears twice in {path}")
            seen.add(sample_id)
            if text is not None and tokenizer is None:
                raise ValueError(f"{where}: a text sample, but neither the student nor the "
                                 f"teacher directory has a tokenizer; give token ids "
                                 f"({ids_field!r}) or add a tokenizer")
            if store is not None and sample_id not in store:
                raise ValueError(f"{where}: sample id {sample_id!r} is not in the teacher store "
                                 f"{store.path}; a store is read with the ids it was built with "
                                 f"(the data's {id_field!r} field, default the 0-based line or "
                                 f"row number): build it from this file")
            pending.append(sample)
            if len(pending) == batch:
                flush()
        flush()
        return cls(ids, sequences, skipped)


def _same_teacher(store, teacher: str) -> None:
    """A store read beside ``--teacher`` must be that teacher's rows (its recorded
    fingerprint of the checkpoint, :func:`topkd.store.build.teacher_fingerprint`)."""
    from ..store.build import teacher_fingerprint

    recorded = store.manifest.get("metadata", {}).get("teacher_fingerprint")
    if recorded is None:
        print(f"topkd distill: warning: the store {store.path} records no teacher fingerprint "
              f"(not built by topkd store build), so it cannot be checked against {teacher}",
              file=sys.stderr)
        return
    mine = teacher_fingerprint(teacher)
    if mine != recorded:
        raise ValueError(f"the store {store.path} was built by another teacher than {teacher} "
                         f"(teacher fingerprint {recorded}, this teacher's {mine}); use the "
                         f"teacher it was built from, or rebuild the store with this one")


def _check_configs(student, teacher, store, tokenizer, teacher_tokenizer, *, k, top_p,
                   temperature, divergence=None) -> None:
    """The settings against the models' configs (their output rows) and tokenizers, and the
    store's manifest, before any model is loaded: what KDTrainer would find at construction or
    at the first step, found in a second."""
    from transformers import AutoConfig

    from .trainer import check_setup

    def rows(directory) -> int:
        config = AutoConfig.from_pretrained(directory)
        return getattr(config, "get_text_config", lambda: config)().vocab_size

    widths = {"student": rows(student)}
    if teacher is not None:
        widths["teacher"] = rows(teacher)
    check_setup(k=k, top_p=top_p, temperature=temperature, widths=widths, tokenizer=tokenizer,
                store=store, teacher_tokenizer=teacher_tokenizer, divergence=divergence)


def _embeddings(model) -> int:
    return model.get_input_embeddings().weight.shape[0]


def _text_config(model):
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


# -- checkpoints and resuming ----------------------------------------------------------------

def last_checkpoint(out: str) -> str | None:
    """The newest complete ``checkpoint-N`` in ``out``: its ``trainer_state.json`` (the
    Trainer writes it last, after the model, optimizer, scheduler and RNG states) reads and
    says step N. A run killed while saving leaves a newer incomplete one, which is passed
    over."""
    for _, path in reversed(_checkpoints(out)):
        try:
            with open(os.path.join(path, "trainer_state.json"), encoding="utf-8") as f:
                state = json.load(f)
        except (OSError, ValueError):
            continue
        if state.get("global_step") == _step(path):
            return path
    return None


def _checkpoints(out: str) -> list[tuple[int, str]]:
    if not os.path.isdir(out):
        return []
    found = [(int(m.group(1)), os.path.join(out, name)) for name in os.listdir(out)
             if (m := _CHECKPOINT.match(name)) and os.path.isdir(os.path.join(out, name))]
    return sorted(found)


def _step(path: str) -> int:
    return int(_CHECKPOINT.match(os.path.basename(path)).group(1))


def _resume_point(out: str, settings: dict, resume: bool) -> str | None:
    """The checkpoint to resume from (None: start afresh); refuses to start over a previous
    run's checkpoints without ``resume``, and to resume them with settings that change the
    training. Only a checkpoint binds: a run that failed before its first one (a bad option,
    a crash, a kill) left nothing to continue, and ``out`` is free for any settings."""
    recorded_path = os.path.join(out, SETTINGS_FILE)
    previous = _checkpoints(out)
    if not resume:
        if previous:
            raise ValueError(f"{out} already holds a distillation run ({previous[-1][1]}); pass "
                             f"--resume to continue it, or give another --out")
        return None
    if previous and os.path.exists(recorded_path):
        with open(recorded_path, encoding="utf-8") as f:
            recorded = json.load(f)
        changed = {key: (recorded.get(key), value) for key, value in settings.items()
                   if key not in RESUMABLE and recorded.get(key) != value}
        if changed:
            listed = "; ".join(f"{key}: {old!r} -> {new!r}" for key, (old, new) in
                               changed.items())
            raise ValueError(f"--resume with settings other than those of the run in {out} "
                             f"({listed}); resume with the same settings (see "
                             f"{recorded_path}), or give another --out")
    checkpoint = last_checkpoint(out)
    if checkpoint is None and _rank_and_world()[0] == 0:
        print(f"topkd distill: no complete checkpoint in {out}; starting from the beginning",
              file=sys.stderr)
    return checkpoint


def _remove_incomplete(out: str, checkpoint: str) -> None:
    """Remove checkpoints newer than the one resumed from (incomplete: a run killed while
    saving), so the Trainer's checkpoint rotation never counts them."""
    for step, path in _checkpoints(out):
        if step > _step(checkpoint):
            print(f"topkd distill: removing the incomplete {path}", file=sys.stderr)
            shutil.rmtree(path, ignore_errors=True)


def _rank_and_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0") or 0), int(os.environ.get("WORLD_SIZE", "1") or 1)


def _write_json(path: str, value: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


__all__ = ["SETTINGS_FILE", "deepspeed_settings", "distill", "fsdp_settings", "last_checkpoint",
           "summary_lines"]
