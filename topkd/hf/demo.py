"""``topkd demo``: what topkd is for, in a few minutes on a CPU, with nothing downloaded.

1. A synthetic language (:class:`Language`): a random stochastic grammar over 1,024 token ids
   in which the next token is uncertain but confined to a few candidates that the context
   decides, so a trained teacher's distribution is spread over several tokens yet its top 16
   hold nearly all of it.
2. A small Llama teacher trained on it with cross-entropy.
3. A smaller Llama student, from the same initial weights, trained three ways by
   :class:`~topkd.hf.KDTrainer` with the same steps, batches and learning rate: cross-entropy
   only; online top-K KD from the teacher; top-K KD from a :class:`~topkd.store.TeacherStore`
   of the teacher's rows built on the spot. With ``store_kind="sampled"`` (or ``"both"``) a
   fourth way: KD from ``samples`` tokens drawn from the teacher per position (RS-KD,
   :func:`topkd.sample_teacher`), the rows kept as distinct ids and counts.
4. A table of held-out KL(teacher || student) and cross-entropy, before and after.

:func:`run_demo` does it and returns the numbers (:class:`DemoResult`); :func:`run` is the
command line's body (``topkd demo``), with the options :func:`add_arguments` declares.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import copy
import itertools
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch

from .._extras import require
from ..backends import ENV as IMPL_ENV

VOCAB_SIZE = 1024
SEQ_LEN = 64
TRAIN_SEQUENCES = 4096
HELD_OUT_SEQUENCES = 256
TEACHER = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=3,
               num_attention_heads=4)
TEACHER_BATCH = 32
TEACHER_LR = 3e-3
# The student is small enough that it cannot quite match the teacher, and trains on batches of
# few sequences: where a sampled token is all cross-entropy learns from, a teacher's row says
# how likely every candidate is.
STUDENT = dict(hidden_size=32, intermediate_size=96, num_hidden_layers=1, num_attention_heads=2)
STUDENT_BATCH = 8
STUDENT_LR = 3e-3
K = 16
SAMPLES = 12  # tokens drawn per position for the sampled rows (RS-KD)
STORE_KINDS = ("topk", "sampled", "both")
STEPS = 400  # each student's
EVAL_BATCH = 64
THREADS = 1  # PyTorch CPU threads of the run (see run_demo)


# -- the language -----------------------------------------------------------------------------


class _Words:
    """``size`` words drawn from ``pool``, Zipf-weighted (1, 1/2, 1/3, ...): one context's
    choices."""

    def __init__(self, pool, size: int, rng: random.Random):
        self.words = rng.sample(list(pool), min(size, len(pool)))
        self.cumulative = list(itertools.accumulate(1.0 / (rank + 1)
                                                    for rank in range(len(self.words))))

    def __call__(self, rng: random.Random) -> int:
        i = bisect.bisect_right(self.cumulative, rng.random() * self.cumulative[-1])
        return self.words[min(i, len(self.words) - 1)]


class Language:
    """A random stochastic grammar over token ids ``0 .. vocab_size - 1`` (0 is padding, 1
    begins a sequence, 2 ends a sentence).

    A sequence is ``<bos> sentence sentence ...``; a sentence is
    ``noun-phrase verb [noun-phrase] [adverb] .`` (the object only after a transitive verb); a
    noun phrase is ``determiner [adjective] noun [preposition noun-phrase]``. Nouns and verbs
    have singular and plural forms: a verb agrees with its subject, a determiner with its noun.

    Nouns, adjectives and verbs each belong to one of ``groups`` word groups, and every choice
    is among ``choices`` words of a set that the context decides: a noun's set depends on the
    group of its adjective, of the verb whose object it is, or of the noun its prepositional
    phrase follows; a verb's on its subject's group. A model must learn these sets from the
    context; a teacher that has learned them spreads each row over one set's words.
    Deterministic in ``seed``.
    """

    PAD, BOS, STOP = 0, 1, 2

    def __init__(self, vocab_size: int = VOCAB_SIZE, seed: int = 0, *, groups: int = 4,
                 choices: int = 6):
        rng = random.Random(seed)
        rest = vocab_size - 3
        if rest < 32 * groups:
            raise ValueError(f"vocab_size must be at least {3 + 32 * groups} for {groups} "
                             f"groups, got {vocab_size}")
        determiners = prepositions = 12  # closed classes
        adverbs, verbs = rest // 16, rest // 8
        nouns = (rest - determiners - prepositions - adverbs - 2 * verbs - rest // 5) // 2
        adjectives = rest - determiners - prepositions - adverbs - 2 * verbs - 2 * nouns
        ids = iter(range(3, vocab_size))

        def take(n: int) -> list[int]:
            return list(itertools.islice(ids, n))

        self.vocab_size, self.groups = vocab_size, groups
        self.noun = (take(nouns), take(nouns))  # (singular, plural) forms of noun i
        self.verb = (take(verbs), take(verbs))
        adjective, adverb = take(adjectives), take(adverbs)
        preposition, determiner = take(prepositions), take(determiners)
        # groups of equal size, randomly assigned
        self.noun_group = [i % groups for i in rng.sample(range(nouns), nouns)]
        self.verb_group = [i % groups for i in rng.sample(range(verbs), verbs)]
        self.adjective_group = {a: i % groups for i, a in
                                enumerate(rng.sample(adjective, adjectives))}
        self.transitive = [rng.random() < 0.6 for _ in range(verbs)]
        # determiners 0-3 go with singular nouns, 8-11 with plural ones, 4-7 with both
        self.pick_determiner = (_Words(determiner[:8], 8, rng), _Words(determiner[4:], 8, rng))
        self.pick_preposition = _Words(preposition, choices, rng)
        self.pick_adjective = _Words(adjective, choices, rng)
        self.pick_adverb = _Words(adverb, choices, rng)

        def members(group_of, group: int) -> list[int]:
            return [i for i, g in enumerate(group_of) if g == group]

        # pick_noun[g]: a noun of a phrase in group g; pick_noun[groups]: one with no group yet
        self.pick_noun = [_Words(members(self.noun_group, g), choices, rng)
                          for g in range(groups)] + [_Words(range(nouns), choices, rng)]
        self.pick_verb = [_Words(members(self.verb_group, g), choices, rng)
                          for g in range(groups)]

    def _noun_phrase(self, rng: random.Random, plural: int, group: int | None,
                     nested: bool = False) -> tuple[list[int], int]:
        """The phrase's tokens and its noun (an index into ``self.noun[plural]``)."""
        words = [self.pick_determiner[plural](rng)]
        if rng.random() < 0.3:
            adjective = self.pick_adjective(rng)
            words.append(adjective)
            group = self.adjective_group[adjective] if group is None else group
        noun = self.pick_noun[self.groups if group is None else group](rng)
        words.append(self.noun[plural][noun])
        if not nested and rng.random() < 0.2:
            words.append(self.pick_preposition(rng))
            words += self._noun_phrase(rng, int(rng.random() < 0.4), self.noun_group[noun],
                                       nested=True)[0]
        return words, noun

    def _sentence(self, rng: random.Random) -> list[int]:
        plural = int(rng.random() < 0.4)
        words, subject = self._noun_phrase(rng, plural, None)
        verb = self.pick_verb[self.noun_group[subject]](rng)
        words.append(self.verb[plural][verb])
        if self.transitive[verb]:
            words += self._noun_phrase(rng, int(rng.random() < 0.4), self.verb_group[verb])[0]
        if rng.random() < 0.2:
            words.append(self.pick_adverb(rng))
        words.append(self.STOP)
        return words

    def sample(self, n: int, length: int = SEQ_LEN, seed: int = 0) -> torch.Tensor:
        """``n`` sequences of ``length`` tokens (int64 ``[n, length]``), each ``<bos>`` then
        sentences, cut at ``length``; deterministic in ``seed``."""
        rng = random.Random(seed)
        out = []
        for _ in range(n):
            tokens = [self.BOS]
            while len(tokens) < length:
                tokens += self._sentence(rng)
            out.append(tokens[:length])
        return torch.tensor(out, dtype=torch.int64)


# -- the results ------------------------------------------------------------------------------


@dataclass
class RunResult:
    """One student run: held-out KL(teacher || student) and the student's cross-entropy,
    nats per token, before and after training; the run's seconds."""

    kl_before: float
    kl_after: float
    ce_before: float
    ce_after: float
    seconds: float


@dataclass
class DemoResult:
    """What :func:`run_demo` measured. ``runs`` by name: ``"ce"`` (cross-entropy only),
    ``"online"`` (top-K KD from the teacher), ``"store"`` (top-K KD from the store) and, with
    sampled rows, ``"sampled"`` (KD from ``samples`` drawn tokens per position)."""

    steps: int
    teacher_steps: int
    teacher_ce: float
    threads: int
    runs: dict[str, RunResult] = field(default_factory=dict)
    store_tokens: int = 0
    store_bytes: int = 0
    store_seconds: float = 0.0
    seconds: float = 0.0
    samples: int = SAMPLES
    sampled_bytes: int = 0  # the sampled store's bytes (0: no sampled run)
    sampled_seconds: float = 0.0


# name: (label, KDConfig fields, reads the store). The cross-entropy run reads the store too:
# with kd_weight=0 its KD term is no part of the gradient, and reading rows is cheaper than
# running the teacher.
RUNS = {
    "ce": ("cross-entropy only", dict(kd_weight=0.0, ce_weight=1.0), True),
    "online": (f"online top-{K} KD", dict(kd_weight=1.0, ce_weight=0.0), False),
    "store": (f"top-{K} KD from a store", dict(kd_weight=1.0, ce_weight=0.0), True),
}
SAMPLED_RUN = (f"{SAMPLES}-sample KD, stored", dict(kd_weight=1.0, ce_weight=0.0), True)


def _runs(store_kind: str, samples: int) -> dict:
    """The runs of a demo: :data:`RUNS`, with ``"sampled"`` after them or in place of the
    top-K store's."""
    runs = dict(RUNS)
    if store_kind == "sampled":
        del runs["store"]
    if store_kind in ("sampled", "both"):
        runs["sampled"] = (f"{samples}-sample KD, stored",) + SAMPLED_RUN[1:]
    return runs


# -- the demo ---------------------------------------------------------------------------------


def check_ready(out: str | None) -> None:
    """What the demo needs, checked before it spends minutes: every package it imports
    (``topkd[hf]``), the Trainer's own requirements (a :class:`KDConfig` is made), and that
    ``out`` (when given) is a directory it can write. ImportError or ValueError naming what
    is missing."""
    require("hf", "topkd demo")
    try:
        from transformers import Trainer  # noqa: F401

        with tempfile.TemporaryDirectory(prefix="topkd-demo-check-") as work:
            _config(work)  # TrainingArguments checks what the Trainer needs (accelerate's version)
    except ImportError as e:
        raise ImportError(f"topkd demo: the Hugging Face Trainer cannot run here: {e} "
                          f"(pip install 'topkd[hf]')") from e
    if out is None:
        return
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"--out {out!r} exists and is not a directory")
    try:
        os.makedirs(out, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as e:
        raise ValueError(f"--out {out!r}: cannot write there ({e})") from e


def run_demo(*, steps: int = STEPS, teacher_steps: int | None = None, seed: int = 0,
             out: str | None = None, progress: bool = True, file=None,
             threads: int | None = THREADS, store_kind: str = "topk",
             samples: int = SAMPLES) -> DemoResult:
    """Generate the corpus, train the teacher for ``teacher_steps`` (default
    ``3 * steps // 5``), distill the student three ways for ``steps`` each, print the table to
    ``file`` (default stdout) and return the numbers.

    The students train on the first ``steps * STUDENT_BATCH`` training sequences (at most
    ``TRAIN_SEQUENCES``), and the store holds the teacher's rows of those. With ``out``, the
    trained teacher, the untrained student, the store and the data are saved there
    (:func:`_save`; an ``out/store`` already there is replaced); without it nothing is kept.
    Progress bars go to stderr when ``progress``. Runs on the GPU when there is one.

    ``threads``: PyTorch's CPU threads for the run (restored after; None: leave them). The
    default is one: two are faster on a quiet machine, but threads that share a busy
    machine's cores wait on each other, and the demo should take minutes anywhere (see the
    README for the timings). Everything the demo needs is checked first
    (:func:`check_ready`).

    ``store_kind``: ``"topk"`` (the three runs above), ``"sampled"`` (the stored run from
    ``samples`` tokens drawn per position instead of the top-K rows) or ``"both"`` (four
    runs)."""
    if store_kind not in STORE_KINDS:
        raise ValueError(f"store_kind must be one of {STORE_KINDS}, got {store_kind!r}")
    check_ready(out)
    from transformers.utils import logging as hf_logging

    file = sys.stdout if file is None else file
    teacher_steps = 3 * steps // 5 if teacher_steps is None else teacher_steps
    start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        work = stack.enter_context(tempfile.TemporaryDirectory(prefix="topkd-demo-"))
        if threads is not None:
            stack.callback(torch.set_num_threads, torch.get_num_threads())
            torch.set_num_threads(threads)
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # the Trainer's notices about its defaults
        stack.callback(hf_logging.set_verbosity, verbosity)

        data = Language(VOCAB_SIZE, seed).sample(TRAIN_SEQUENCES + HELD_OUT_SEQUENCES,
                                                 SEQ_LEN, seed=seed)
        corpus, held_out = data[:TRAIN_SEQUENCES], data[TRAIN_SEQUENCES:]
        train = [{"sample_id": i, "input_ids": s} for i, s in
                 enumerate(corpus[:steps * STUDENT_BATCH])]
        held_out_items = [{"input_ids": s} for s in held_out]

        teacher = _model(TEACHER, seed)
        _train_teacher(teacher, corpus, teacher_steps, seed, progress)
        result = DemoResult(steps=steps, teacher_steps=teacher_steps,
                            teacher_ce=_cross_entropy(teacher, held_out),
                            threads=torch.get_num_threads())
        student = _model(STUDENT, seed + 1)
        if out is not None:
            _save(out, teacher, student, corpus, held_out)

        store = os.path.join(out if out is not None else work, "store")
        store_start = time.perf_counter()
        result.store_bytes = _build_store(teacher, train, store, progress)
        result.store_seconds = time.perf_counter() - store_start
        result.store_tokens = len(train) * SEQ_LEN
        runs = _runs(store_kind, samples)
        stores = dict.fromkeys(runs, store)
        if "sampled" in runs:
            sampled_start = time.perf_counter()
            stores["sampled"] = os.path.join(out if out is not None else work, "store-sampled")
            result.sampled_bytes = _build_sampled_store(teacher, train, stores["sampled"],
                                                        samples, seed, progress)
            result.sampled_seconds = time.perf_counter() - sampled_start
            result.samples = samples

        before = _evaluate(student, teacher, held_out_items, work)
        for name, (label, weights, reads_store) in runs.items():
            run_start = time.perf_counter()
            trained = copy.deepcopy(student)
            _distill(trained, teacher if not reads_store else None,
                     stores[name] if reads_store else None, train,
                     {**weights, "k": None if name == "sampled" else K}, steps, seed,
                     os.path.join(work, name), label if progress else None)
            after = _evaluate(trained, teacher, held_out_items, work)
            result.runs[name] = RunResult(before["eval_kl"], after["eval_kl"],
                                          before["eval_ce"], after["eval_ce"],
                                          time.perf_counter() - run_start)
        result.seconds = time.perf_counter() - start
        _print_table(result, runs, file, out)
    return result


def _save(out: str, teacher, student, corpus: torch.Tensor, held_out: torch.Tensor) -> None:
    """What the README's examples load: ``teacher/`` (trained), ``student/`` (untrained),
    ``train.jsonl`` and ``heldout.jsonl`` (``{"id", "input_ids"}`` per line)."""
    teacher.save_pretrained(os.path.join(out, "teacher"))
    student.save_pretrained(os.path.join(out, "student"))
    for name, sequences in (("train.jsonl", corpus), ("heldout.jsonl", held_out)):
        with open(os.path.join(out, name), "w") as f:
            for i, tokens in enumerate(sequences.tolist()):
                f.write(json.dumps({"id": i, "input_ids": tokens}) + "\n")


def _impl() -> str:
    """The demo's kernels: eager unless ``$TOPKD_IMPL`` chooses (compiling costs seconds per
    loss configuration on a CPU, more than the demo's small batches repay)."""
    return "auto" if os.environ.get(IMPL_ENV) else "eager"


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _model(sizes: dict, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB_SIZE, max_position_embeddings=SEQ_LEN,
                         tie_word_embeddings=False, pad_token_id=Language.PAD,
                         bos_token_id=Language.BOS, eos_token_id=Language.STOP, **sizes)
    return LlamaForCausalLM(config)


def _bar(total: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, disable=not enabled, leave=False, dynamic_ncols=True,
                file=sys.stderr)


def _train_teacher(teacher, corpus: torch.Tensor, steps: int, seed: int,
                   progress: bool) -> None:
    """Cross-entropy on random batches of ``corpus``: AdamW, a short warm-up, linear decay."""
    device = _device()
    teacher.to(device).train()
    optimizer = torch.optim.AdamW(teacher.parameters(), lr=TEACHER_LR, betas=(0.9, 0.95),
                                  weight_decay=0.0)
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * max(0.0, 1.0 - s / steps))
    generator = torch.Generator().manual_seed(seed)
    with _bar(steps, "teacher: cross-entropy", progress) as bar:
        for _ in range(steps):
            rows = torch.randint(len(corpus), (TEACHER_BATCH,), generator=generator)
            batch = corpus[rows].to(device)
            loss = teacher(input_ids=batch, labels=batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(teacher.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            schedule.step()
            bar.set_postfix(ce=f"{loss.item():.3f}", refresh=False)
            bar.update()
    teacher.eval()


@torch.no_grad()
def _cross_entropy(model, sequences: torch.Tensor) -> float:
    """The model's cross-entropy on ``sequences``, nats per predicted token."""
    device = _device()
    total = 0.0
    for batch in sequences.split(EVAL_BATCH):
        batch = batch.to(device)
        total += float(model(input_ids=batch, labels=batch).loss) * batch[:, 1:].numel()
    return total / sequences[:, 1:].numel()


def _build_store(teacher, train: list[dict], path: str, progress: bool) -> int:
    """Write the teacher's top-K rows of every training sequence into a new store at
    ``path``; its size in bytes."""
    from .. import SparseTeacher, select_topk

    def rows(logits, items):
        rows = select_topk(logits, K, impl=_impl())
        rows = SparseTeacher(rows.indices.cpu(), rows.logprobs.cpu(),
                             rows.rest_logprob.cpu(), rows.temperature, rows.vocab_size)
        return [SparseTeacher(rows.indices[i], rows.logprobs[i], rows.rest_logprob[i],
                              rows.temperature, rows.vocab_size) for i in range(len(items))]

    return _write_store(teacher, train, path, progress, {"k": K},
                        f"store: the teacher's top-{K}", rows)


def _build_sampled_store(teacher, train: list[dict], path: str, samples: int, seed: int,
                         progress: bool) -> int:
    """Write ``samples`` tokens drawn from the teacher per position of every training
    sequence (seeded by ``(seed, its sample id)``) into a new sampled store at ``path``; its
    size in bytes."""
    from .. import sample_teacher
    from ..store.rows import trimmed

    def rows(logits, items):
        drawn = sample_teacher(logits, samples, seed=seed,
                               sample_ids=[item["sample_id"] for item in items])
        drawn = drawn.to("cpu")
        return [trimmed(drawn.map(lambda t, i=i: t[i])) for i in range(len(items))]

    return _write_store(teacher, train, path, progress, {"samples": samples},
                        f"store: {samples} tokens drawn per position", rows)


@torch.no_grad()
def _write_store(teacher, train: list[dict], path: str, progress: bool, width: dict, desc: str,
                 rows) -> int:
    """Write ``rows(logits, items)`` (one teacher per item) of the teacher's logits of every
    batch of training sequences into a new store at ``path`` (``width``: its ``k`` or
    ``samples``); its size in bytes."""
    from ..store import TeacherStoreWriter

    device = _device()
    shutil.rmtree(path, ignore_errors=True)
    with TeacherStoreWriter(path, vocab_size=VOCAB_SIZE, **width) as writer, \
            _bar(len(train), desc, progress) as bar:
        for first in range(0, len(train), EVAL_BATCH):
            items = train[first:first + EVAL_BATCH]
            tokens = torch.stack([item["input_ids"] for item in items])
            teachers = rows(teacher(input_ids=tokens.to(device)).logits, items)
            for item, row in zip(items, teachers, strict=True):
                writer.add(item["sample_id"], item["input_ids"], row)
            bar.update(len(items))
    return sum(entry.stat().st_size for entry in os.scandir(path) if entry.is_file())


def _config(output_dir: str, **fields):
    from .trainer import KDConfig

    # chunk_bytes: a batch's rows fit in one chunk; smaller chunks only add work per chunk
    return KDConfig(output_dir=output_dir, per_device_train_batch_size=STUDENT_BATCH,
                    per_device_eval_batch_size=EVAL_BATCH, chunk_bytes=2**26,
                    report_to="none", disable_tqdm=True, logging_strategy="no",
                    save_strategy="no", dataloader_num_workers=0, impl=_impl(),
                    use_cpu=_device().type == "cpu", **fields)


def _distill(student, teacher, store: str | None, train: list[dict], weights: dict,
             steps: int, seed: int, output_dir: str, label: str | None) -> None:
    from transformers import PrinterCallback, TrainerCallback

    from .trainer import KDTrainer

    args = _config(output_dir, max_steps=steps, learning_rate=STUDENT_LR,
                   lr_scheduler_type="linear", warmup_steps=max(1, steps // 20),
                   weight_decay=0.0, seed=seed, data_seed=seed, **weights)
    bar = _bar(steps, label or "", label is not None)

    class Progress(TrainerCallback):
        def on_step_end(self, *_, **__):
            bar.update()

    source = dict(teacher=teacher) if store is None else dict(store=store)
    trainer = KDTrainer(model=student, args=args, train_dataset=train,
                        callbacks=[Progress()], **source)
    trainer.remove_callback(PrinterCallback)  # it prints the Trainer's logs
    with bar:
        trainer.train()


def _evaluate(student, teacher, held_out: list[dict], out: str) -> dict:
    """Held-out ``eval_kl`` (KL(teacher || student) over the whole vocabulary) and
    ``eval_ce``, the same way for every run: online, from the teacher itself."""
    from transformers import PrinterCallback

    from .trainer import KDTrainer

    trainer = KDTrainer(model=student, teacher=teacher, args=_config(os.path.join(out, "eval")))
    trainer.remove_callback(PrinterCallback)
    return trainer.evaluate(eval_dataset=held_out)


def _print_table(result: DemoResult, runs: dict, file, out: str | None) -> None:
    uniform = math.log(VOCAB_SIZE)
    lines = [
        "",
        f"topkd demo: distill a {_describe(TEACHER)} teacher into a {_describe(STUDENT)} "
        f"student",
        f"  language: {VOCAB_SIZE:,} tokens, {TRAIN_SEQUENCES:,} training sequences of "
        f"{SEQ_LEN} (Language, seed given)",
        f"  teacher:  {result.teacher_steps} steps of cross-entropy, held-out CE "
        f"{result.teacher_ce:.3f} (uniform: {uniform:.3f})",
        f"  students: {result.steps} steps of {STUDENT_BATCH} sequences each, same initial "
        f"weights, batches and learning rate",
        "",
        f"{'held-out, nats per token':<26}{'KL(teacher||student)':^28}"
        f"{'cross-entropy':^20}{'time':>7}",
        f"{'':<26}{'before':>9}{'after':>10}{'ratio':>9}{'before':>10}{'after':>10}",
    ]
    for name, run in result.runs.items():
        ratio = run.kl_after / run.kl_before if run.kl_before > 0 else float("nan")
        lines.append(f"{runs[name][0]:<26}{run.kl_before:>9.3f}{run.kl_after:>10.3f}"
                     f"{f'x{ratio:.3f}':>9}{run.ce_before:>10.3f}{run.ce_after:>10.3f}"
                     f"{f'{run.seconds:.0f} s':>7}")
    ce, online = result.runs["ce"], result.runs["online"]
    stored = result.runs.get("store", result.runs.get("sampled"))
    if min(online.kl_after, stored.kl_after) > 0:
        lines += ["", f"With the same steps, KD ends {ce.kl_after / online.kl_after:.1f}x "
                  f"(online) and {ce.kl_after / stored.kl_after:.1f}x (store) closer to the "
                  f"teacher than cross-entropy alone."]
    dense = result.store_tokens * VOCAB_SIZE * 4
    lines.append(
        f"Store: {result.store_tokens:,} token rows of top-{K} in "
        f"{result.store_bytes / 2**20:.1f} MiB (as float32 logits: {dense / 2**20:,.0f} MiB), "
        f"built in {result.store_seconds:.0f} s.")
    if "sampled" in result.runs:
        per_token = result.sampled_bytes / max(result.store_tokens, 1)
        topk = result.store_bytes / max(result.store_tokens, 1)
        lines.append(
            f"Sampled store ({result.samples} draws per token, distinct ids and counts): "
            f"{result.sampled_bytes / 2**20:.1f} MiB, {per_token:.1f} B per token "
            f"(top-{K} store: {topk:.1f} B, x{per_token / topk:.2f}), drawn in "
            f"{result.sampled_seconds:.0f} s.")
        if "store" in result.runs and result.runs["store"].kl_after > 0:
            ratio = result.runs["sampled"].kl_after / result.runs["store"].kl_after
            lines.append(f"Sampled KD ends at x{ratio:.2f} the top-{K} store's held-out KL.")
    lines.append(f"Total time: {result.seconds:.0f} s.")
    if out is not None:
        lines.append(f"Saved in {out}: teacher/ (trained), student/ (untrained), store/, "
                     f"train.jsonl and heldout.jsonl ({{\"id\", \"input_ids\"}} per line).")
    print("\n".join(lines), file=file, flush=True)


def _describe(sizes: dict) -> str:
    layers = sizes["num_hidden_layers"]
    return f"{layers}-layer Llama (hidden {sizes['hidden_size']})"


# -- the command line -------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``topkd demo``'s options: ``--steps``, ``--teacher-steps``, ``--seed``, ``--out``,
    ``--quiet``."""
    from .._args import int_at_least as _int_at_least

    parser.add_argument("--steps", type=_int_at_least(1), default=STEPS, metavar="N",
                        help=f"training steps of each student (default {STEPS})")
    parser.add_argument("--teacher-steps", type=_int_at_least(1), metavar="N",
                        help="training steps of the teacher (default: 0.6 x --steps)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the language, the data and the weights (default 0)")
    parser.add_argument("--out", metavar="DIR",
                        help="save the trained teacher, the untrained student, the store and "
                        "the data (JSON Lines of token ids) in DIR, for the README's examples "
                        "(default: keep nothing)")
    parser.add_argument("--threads", type=_int_at_least(1), default=THREADS, metavar="N",
                        help=f"PyTorch CPU threads (default {THREADS}: more are faster on a "
                        f"quiet machine and far slower on a busy one)")
    parser.add_argument("--store-kind", choices=STORE_KINDS, default="topk",
                        help="the stored teacher the offline run reads: top-K rows (default), "
                        "SAMPLES tokens drawn per position (RS-KD), or both (four runs)")
    parser.add_argument("--samples", type=_int_at_least(1), default=SAMPLES, metavar="N",
                        help=f"tokens drawn per position for --store-kind sampled/both "
                        f"(default {SAMPLES})")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    """``topkd demo`` with the options of :func:`add_arguments`; the exit status."""
    run_demo(steps=args.steps, teacher_steps=args.teacher_steps, seed=args.seed,
             out=args.out, progress=not args.quiet, threads=args.threads,
             store_kind=args.store_kind, samples=args.samples)
    return 0


__all__ = ["DemoResult", "Language", "RunResult", "STORE_KINDS", "add_arguments", "run",
           "run_demo"]
