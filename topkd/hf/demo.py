"""``topkd demo``: what topkd is for, in a few minutes on a CPU, with nothing downloaded.

1. A synthetic language (:class:`Language`): a random stochastic grammar over a vocabulary of
   1,024 token ids, with topics, word groups and number agreement, so that the next token is
   learnable but uncertain and a teacher's distribution is sharp but not one-hot.
2. A small Llama teacher trained on it with cross-entropy.
3. A smaller Llama student, from the same initial weights, trained three ways by
   :class:`~topkd.hf.KDTrainer` with the same steps, learning rate and data order:
   cross-entropy only; online top-K KD from the teacher; KD from a
   :class:`~topkd.store.TeacherStore` of the teacher's top-K rows built on the spot.
4. A table of held-out KL(teacher || student) and cross-entropy, before and after.

:func:`run_demo` returns the numbers (:class:`DemoResult`); :func:`run` is the command line's
body (``topkd demo``), with options from :func:`add_arguments`.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import copy
import itertools
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch

# The compiled kernels cost seconds of compilation per loss configuration on a CPU; the demo's
# rows are small, so the eager kernels finish sooner end to end. ``TOPKD_IMPL`` set by the user
# still wins.
os.environ.setdefault("TOPKD_IMPL", "eager")

VOCAB_SIZE = 1024
SEQ_LEN = 64
TRAIN_SEQUENCES = 4096
HELD_OUT_SEQUENCES = 256
BATCH_SIZE = 32
TEACHER = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=3,
               num_attention_heads=4)
STUDENT = dict(hidden_size=64, intermediate_size=192, num_hidden_layers=1,
               num_attention_heads=2)
TEACHER_LR = 3e-3
STUDENT_LR = 3e-3
K = 16
DEFAULT_STEPS = 200


# -- the language -----------------------------------------------------------------------------


class _Choice:
    """Draws an index with probability proportional to ``weights``."""

    def __init__(self, weights):
        self.cumulative = list(itertools.accumulate(weights))

    def __call__(self, rng: random.Random) -> int:
        i = bisect.bisect_right(self.cumulative, rng.random() * self.cumulative[-1])
        return min(i, len(self.cumulative) - 1)


def _zipf(n: int, exponent: float, rng: random.Random) -> list[float]:
    """Zipf weights ``1 / rank**exponent`` over ``n`` items, in a random order."""
    weights = [1.0 / (rank + 1) ** exponent for rank in range(n)]
    rng.shuffle(weights)
    return weights


class Language:
    """A random stochastic grammar over token ids ``0 .. vocab_size - 1``.

    A sequence is ``<bos> <topic> sentence sentence ...``; a sentence is
    ``noun-phrase verb [noun-phrase] [adverb] .``; a noun phrase is
    ``determiner adjective* noun [preposition noun-phrase]``. Nouns and verbs come in singular
    and plural forms and the verb agrees with its subject, determiners with their noun. Word
    frequencies are Zipfian with a different ranking per topic, and every noun, adjective and
    verb belongs to one of ``groups`` word groups: an adjective favors nouns of its group, a
    subject favors verbs of its group, a verb favors objects of its group. Everything is drawn
    from ``random.Random(seed)``.
    """

    PAD, BOS, STOP = 0, 1, 2

    def __init__(self, vocab_size: int = VOCAB_SIZE, seed: int = 0, *, topics: int = 8,
                 groups: int = 8, affinity: float = 6.0):
        rng = random.Random(seed)
        first = 3 + topics
        rest = vocab_size - first
        if rest < 100:
            raise ValueError(f"vocab_size must be at least {first + 100}, got {vocab_size}")
        nouns, verbs = int(rest * 0.2), int(rest * 0.12)  # each in two forms
        adjectives, adverbs, prepositions = int(rest * 0.2), int(rest * 0.07), int(rest * 0.04)
        determiners = rest - 2 * nouns - 2 * verbs - adjectives - adverbs - prepositions
        ids = iter(range(first, vocab_size))

        def take(n: int) -> list[int]:
            return list(itertools.islice(ids, n))

        self.vocab_size, self.groups = vocab_size, groups
        self.topics = list(range(3, first))
        self.noun = (take(nouns), take(nouns))  # (singular, plural)
        self.verb = (take(verbs), take(verbs))
        self.adjective, self.adverb = take(adjectives), take(adverbs)
        self.preposition, self.determiner = take(prepositions), take(determiners)
        self.noun_group = [rng.randrange(groups) for _ in range(nouns)]
        self.adjective_group = [rng.randrange(groups) for _ in range(adjectives)]
        self.verb_group = [rng.randrange(groups) for _ in range(verbs)]
        self.transitive = [rng.random() < 0.6 for _ in range(verbs)]
        number = [rng.choice((0, 1, None)) for _ in range(determiners)]  # None: either
        weights = _zipf(determiners, 0.8, rng)
        self.pick_determiner = [_Choice([w if number[i] in (plural, None) else 0.0
                                         for i, w in enumerate(weights)]) for plural in (0, 1)]

        def favor(weights, group_of, group):
            return [w * (affinity if group_of[i] == group else 1.0) for i, w in
                    enumerate(weights)]

        self.pick_adjective, self.pick_noun, self.pick_verb = [], [], []
        for _ in self.topics:
            noun_weights, verb_weights = _zipf(nouns, 1.1, rng), _zipf(verbs, 1.1, rng)
            self.pick_adjective.append(_Choice(_zipf(adjectives, 1.1, rng)))
            # pick_noun[topic][group], and [topic][groups] for no group
            self.pick_noun.append([_Choice(favor(noun_weights, self.noun_group, g))
                                   for g in range(groups)] + [_Choice(noun_weights)])
            self.pick_verb.append([_Choice(favor(verb_weights, self.verb_group, g))
                                   for g in range(groups)])
        self.pick_adverb = _Choice(_zipf(adverbs, 1.2, rng))
        self.pick_preposition = _Choice(_zipf(prepositions, 1.0, rng))

    def _noun_phrase(self, rng, topic: int, plural: int, group: int | None, nested: bool):
        words = [self.determiner[self.pick_determiner[plural](rng)]]
        while len(words) < 3 and rng.random() < 0.35:
            a = self.pick_adjective[topic](rng)
            words.append(self.adjective[a])
            group = self.adjective_group[a] if group is None else group
        noun = self.pick_noun[topic][self.groups if group is None else group](rng)
        words.append(self.noun[plural][noun])
        if not nested and rng.random() < 0.25:
            words.append(self.preposition[self.pick_preposition(rng)])
            words += self._noun_phrase(rng, topic, int(rng.random() < 0.4),
                                       self.noun_group[noun], True)[0]
        return words, noun

    def _sentence(self, rng, topic: int) -> list[int]:
        plural = int(rng.random() < 0.4)
        words, subject = self._noun_phrase(rng, topic, plural, None, False)
        verb = self.pick_verb[topic][self.noun_group[subject]](rng)
        words.append(self.verb[plural][verb])
        if self.transitive[verb]:
            words += self._noun_phrase(rng, topic, int(rng.random() < 0.4),
                                       self.verb_group[verb], False)[0]
        if rng.random() < 0.3:
            words.append(self.adverb[self.pick_adverb(rng)])
        words.append(self.STOP)
        return words

    def sample(self, n: int, length: int = SEQ_LEN, seed: int = 0) -> torch.Tensor:
        """``n`` sequences of ``length`` tokens, int64 ``[n, length]``, from
        ``random.Random(seed)``."""
        rng = random.Random(seed)
        out = []
        for _ in range(n):
            topic = rng.randrange(len(self.topics))
            tokens = [self.BOS, self.topics[topic]]
            while len(tokens) < length:
                tokens += self._sentence(rng, topic)
            out.append(tokens[:length])
        return torch.tensor(out, dtype=torch.int64)


# -- results ------------------------------------------------------------------------------------


@dataclass
class RunResult:
    """One student's held-out numbers, per token, in nats."""

    kl_before: float
    kl_after: float
    ce_before: float
    ce_after: float
    seconds: float


@dataclass
class DemoResult:
    """What :func:`run_demo` measured: ``runs`` by name (``"ce"``, ``"online"``,
    ``"store"``), the teacher's held-out cross-entropy, the store's size, the total time."""

    steps: int
    teacher_steps: int
    teacher_ce: float
    runs: dict[str, RunResult] = field(default_factory=dict)
    store_bytes: int = 0
    store_tokens: int = 0
    seconds: float = 0.0


# name: (label in the table, KDConfig fields, offline). The cross-entropy run reads the store
# too: its KD term has weight 0, and it then needs no teacher forward pass.
RUNS = {
    "ce": ("cross-entropy only", dict(kd_weight=0.0, ce_weight=1.0), True),
    "online": (f"online top-{K} KD", dict(kd_weight=1.0, ce_weight=0.0), False),
    "store": (f"top-{K} KD from a store", dict(kd_weight=1.0, ce_weight=0.0), True),
}


# -- the demo ---------------------------------------------------------------------------------


def run_demo(*, steps: int = DEFAULT_STEPS, teacher_steps: int | None = None, seed: int = 0,
             out: str | None = None, progress: bool = True, file=None) -> DemoResult:
    """Generate the corpus, train the teacher (``teacher_steps``, default ``2 * steps``),
    distill the student three ways (``steps`` each), print the table to ``file`` (default
    stdout) and return the numbers. The store is written under ``out`` (default: a temporary
    directory, removed at the end). Progress bars go to stderr when ``progress``."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    file = sys.stdout if file is None else file
    teacher_steps = 2 * steps if teacher_steps is None else teacher_steps
    start = time.perf_counter()
    temporary = out is None
    out = tempfile.mkdtemp(prefix="topkd-demo-") if temporary else out
    os.makedirs(out, exist_ok=True)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        language = Language(VOCAB_SIZE, seed)
        data = language.sample(TRAIN_SEQUENCES + HELD_OUT_SEQUENCES, SEQ_LEN, seed=seed)
        train = [{"sample_id": i, "input_ids": s} for i, s in enumerate(data[:TRAIN_SEQUENCES])]
        held_out = [{"input_ids": s} for s in data[TRAIN_SEQUENCES:]]

        def model(sizes, model_seed):
            torch.manual_seed(model_seed)
            config = LlamaConfig(vocab_size=VOCAB_SIZE, max_position_embeddings=SEQ_LEN,
                                 tie_word_embeddings=False, pad_token_id=Language.PAD,
                                 bos_token_id=Language.BOS, eos_token_id=Language.STOP,
                                 **sizes)
            return LlamaForCausalLM(config)

        teacher = model(TEACHER, seed)
        _train_teacher(teacher, data[:TRAIN_SEQUENCES], teacher_steps, seed, progress)
        student = model(STUDENT, seed + 1)
        result = DemoResult(steps=steps, teacher_steps=teacher_steps,
                            teacher_ce=_teacher_ce(teacher, data[TRAIN_SEQUENCES:]))
        store = os.path.join(out, "store")
        result.store_bytes = _build_store(teacher, train, store, progress)
        result.store_tokens = TRAIN_SEQUENCES * SEQ_LEN
        before = _evaluate(student, teacher, held_out, out)
        for name, (label, weights, offline) in RUNS.items():
            run_start = time.perf_counter()
            trained = copy.deepcopy(student)
            _distill(trained, teacher, store if offline else None, train, weights, steps,
                     seed, os.path.join(out, name), label if progress else None)
            after = _evaluate(trained, teacher, held_out, out)
            result.runs[name] = RunResult(before["eval_kl"], after["eval_kl"],
                                          before["eval_ce"], after["eval_ce"],
                                          time.perf_counter() - run_start)
        result.seconds = time.perf_counter() - start
        _print_table(result, file, None if temporary else store)
        return result
    finally:
        hf_logging.set_verbosity(verbosity)
        if temporary:
            shutil.rmtree(out, ignore_errors=True)


def _bar(total: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="step", disable=not enabled, leave=False,
                dynamic_ncols=True)


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _train_teacher(teacher, sequences: torch.Tensor, steps: int, seed: int,
                   progress: bool) -> None:
    """Plain cross-entropy training: AdamW, warm-up then linear decay, random batches."""
    device = _device()
    teacher.to(device).train()
    optimizer = torch.optim.AdamW(teacher.parameters(), lr=TEACHER_LR, weight_decay=0.0)
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * max(0.0, 1.0 - s / steps))
    generator = torch.Generator().manual_seed(seed)
    with _bar(steps, "teacher (cross-entropy)", progress) as bar:
        for _ in range(steps):
            batch = sequences[torch.randint(len(sequences), (BATCH_SIZE,),
                                            generator=generator)].to(device)
            loss = teacher(input_ids=batch, labels=batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(teacher.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            schedule.step()
            bar.update()
            bar.set_postfix(ce=f"{loss.item():.3f}", refresh=False)
    teacher.eval()


@torch.no_grad()
def _teacher_ce(teacher, sequences: torch.Tensor) -> float:
    device = _device()
    total = 0.0
    for batch in sequences.split(BATCH_SIZE):
        batch = batch.to(device)
        total += float(teacher(input_ids=batch, labels=batch).loss) * batch.numel()
    return total / sequences.numel()


@torch.no_grad()
def _build_store(teacher, train: list[dict], path: str, progress: bool) -> int:
    """Write the teacher's top-K rows of every training sequence to a store at ``path``;
    returns the store's size in bytes."""
    import topkd
    from topkd.store import TeacherStoreWriter

    device = _device()
    shutil.rmtree(path, ignore_errors=True)
    with TeacherStoreWriter(path, k=K, vocab_size=VOCAB_SIZE) as writer, \
            _bar(len(train), f"store: teacher top-{K}", progress) as bar:
        for start in range(0, len(train), BATCH_SIZE):
            items = train[start:start + BATCH_SIZE]
            tokens = torch.stack([item["input_ids"] for item in items])
            logits = teacher(input_ids=tokens.to(device)).logits.float()
            rows = topkd.select_topk(logits, K)
            for i, item in enumerate(items):
                writer.add(item["sample_id"], item["input_ids"], topkd.SparseTeacher(
                    rows.indices[i].cpu(), rows.logprobs[i].cpu(), rows.rest_logprob[i].cpu(),
                    rows.temperature, rows.vocab_size))
            bar.update(len(items))
    return sum(entry.stat().st_size for entry in os.scandir(path) if entry.is_file())


def _config(output_dir: str, **fields):
    from .trainer import KDConfig

    # chunk_bytes: a batch's rows fit in one chunk (8 MiB of logits); smaller chunks would only
    # add per-chunk work
    return KDConfig(output_dir=output_dir, per_device_train_batch_size=BATCH_SIZE,
                    per_device_eval_batch_size=BATCH_SIZE, chunk_bytes=2**26, report_to="none",
                    disable_tqdm=True, logging_strategy="no", save_strategy="no",
                    dataloader_num_workers=0, use_cpu=_device().type == "cpu", **fields)


def _distill(student, teacher, store: str | None, train: list[dict], weights: dict,
             steps: int, seed: int, output_dir: str, label: str | None) -> None:
    from transformers import PrinterCallback, TrainerCallback

    from .trainer import KDTrainer

    args = _config(output_dir, max_steps=steps, learning_rate=STUDENT_LR,
                   lr_scheduler_type="linear", warmup_steps=max(1, steps // 20),
                   weight_decay=0.0, seed=seed, data_seed=seed, k=K, **weights)
    bar = _bar(steps, label or "", label is not None)

    class Progress(TrainerCallback):
        def on_step_end(self, *_, **__):
            bar.update()

    source = dict(store=store) if store is not None else dict(teacher=teacher)
    trainer = KDTrainer(model=student, args=args, train_dataset=train,
                        callbacks=[Progress()], **source)
    trainer.remove_callback(PrinterCallback)  # the Trainer's own log lines
    with bar:
        trainer.train()


def _evaluate(student, teacher, held_out: list[dict], out: str) -> dict:
    """Held-out KL(teacher || student) over the full vocabulary and the student's CE."""
    from transformers import PrinterCallback

    from .trainer import KDTrainer

    trainer = KDTrainer(model=student, teacher=teacher, args=_config(os.path.join(out, "eval")))
    trainer.remove_callback(PrinterCallback)
    return trainer.evaluate(eval_dataset=held_out)


def _print_table(result: DemoResult, file, store: str | None) -> None:
    teacher, student = _describe(TEACHER), _describe(STUDENT)
    lines = [
        "",
        f"topkd demo: a synthetic language of {VOCAB_SIZE} tokens, {TRAIN_SEQUENCES} training "
        f"sequences of {SEQ_LEN}",
        f"teacher: {teacher}, {result.teacher_steps} steps, held-out CE "
        f"{result.teacher_ce:.3f} (uniform: {torch.tensor(float(VOCAB_SIZE)).log():.3f})",
        f"student: {student}, {result.steps} steps per run, same initial weights, "
        f"learning rate and batches",
        "",
        f"{'held-out, nats/token':<24}{'KL(teacher||student)':>26}{'cross-entropy':>20}",
        f"{'':<24}{'before':>9}{'after':>9}{'':>8}{'before':>10}{'after':>10}",
    ]
    for name, run in result.runs.items():
        change = run.kl_after / run.kl_before if run.kl_before > 0 else float("nan")
        lines.append(f"{RUNS[name][0]:<24}{run.kl_before:>9.3f}{run.kl_after:>9.3f}"
                     f"{f'x{change:.2f}':>8}{run.ce_before:>10.3f}{run.ce_after:>10.3f}")
    dense = result.store_tokens * VOCAB_SIZE * 4
    lines += [
        "",
        f"store: {result.store_tokens:,} token rows of top-{K} in "
        f"{result.store_bytes / 2**20:.1f} MiB (the float32 logits: {dense / 2**20:.0f} MiB)"
        + (f", kept in {store}" if store else ""),
        f"time: {result.seconds:.0f} s",
    ]
    print("\n".join(lines), file=file, flush=True)


def _describe(sizes: dict) -> str:
    return (f"Llama, {sizes['num_hidden_layers']} layer"
            f"{'s' if sizes['num_hidden_layers'] > 1 else ''}, hidden {sizes['hidden_size']}")


# -- the command line ---------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``topkd demo``'s options."""
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, metavar="N",
                        help=f"training steps of each student run (default {DEFAULT_STEPS})")
    parser.add_argument("--teacher-steps", type=int, metavar="N",
                        help="training steps of the teacher (default: 2 x --steps)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the language, the data and the weights (default 0)")
    parser.add_argument("--out", metavar="DIR",
                        help="keep the teacher store here (default: a temporary directory, "
                        "removed at the end)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    """``topkd demo``: :func:`run_demo` with the parsed options; the exit status."""
    for name in ("steps", "teacher_steps"):
        value = getattr(args, name)
        if value is not None and value < 1:
            print(f"topkd demo: error: --{name.replace('_', '-')} must be >= 1, got {value}",
                  file=sys.stderr)
            return 2
    with contextlib.ExitStack():
        run_demo(steps=args.steps, teacher_steps=args.teacher_steps, seed=args.seed,
                 out=args.out, progress=not args.quiet)
    return 0


__all__ = ["DemoResult", "Language", "RunResult", "add_arguments", "run", "run_demo"]
