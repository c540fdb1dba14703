"""Benchmark, trainer section: ``python -m benchmarks trainer``.

Whole Hugging Face training runs, side by side, on one tiny-but-wide setup: a student
``LlamaForCausalLM`` of ``--layers`` (2) layers, H = ``--hidden`` (256), intermediate
``--intermediate`` (512), heads of 64 (4), untied embeddings, V = ``--vocab`` (151,936); a
teacher of the same architecture (``--teacher-*``, default the same sizes), initialized with
another seed and ``initializer_range`` ``--teacher-init`` (0.1, so that its distributions are
peaked and the divergence is far from 0). Float32 parameters, ``bf16=True`` (autocast) and
``use_cpu=True``; ``--batch`` (1) random sequences of ``--seq`` (1,024) tokens per step, every
token after the first learned (``labels = input_ids``); AdamW (the ``TrainingArguments``
default), constant learning rate ``--lr``, ``--steps`` (N) optimizer steps, no gradient
accumulation, no gradient checkpointing (TRL's configs default to it; it is turned off in
every case, or on in every case with ``--gradient-checkpointing``). Cases, each in its own
fresh process (:mod:`benchmarks.harness`):

* ``fused``: :class:`topkd.hf.KDTrainer` with ``KDConfig(divergence="jsd", beta=--beta,
  k=None, fused=True)``: the full-vocabulary generalized JSD, the same loss as TRL's; the
  student's and the teacher's final hidden states enter ``fused_kl_loss`` with their heads.
* ``unfused``: the same with ``fused=False``: both models' logits, then ``kl_loss``.
* ``trl``: TRL's ``trl.experimental.gkd.GKDTrainer`` with ``GKDConfig(lmbda=0, beta=--beta,
  seq_kd=False)``: off-policy (its ``training_step`` generates only when ``random.random() <=
  lmbda``), its ``generalized_jsd_loss`` on both models' full logits at temperature 1 (its
  ``compute_loss`` passes none). TRL's ``DistillationTrainer`` cannot be used: it always
  generates its completions from prompts with the student (on-policy; it has no ``lmbda``);
  its loss function alone is in the ``fused`` section. GKD's default collator
  (``DataCollatorForChatML``) builds chat prompts and completions from ``messages``; here it
  gets topkd's ``KDCollator``, which gives it the ``input_ids``, ``attention_mask`` and
  ``labels`` it reads, so the two trainers learn the same rows (the row at ``t`` where
  ``labels[t + 1] != -100``) of the same batches.

topkd's cases run once per ``--kernels`` value, set as ``$TOPKD_IMPL`` in their process
(``KDTrainer`` calls the losses with ``impl="auto"``, which the variable replaces).

Per case, with step 1 a warm-up (compiled kernels are built there), step 2 profiled, steps
3..N timed:

* **step peak**: step 2 under ``torch.profiler.profile(profile_memory=True)`` from
  ``on_step_begin`` to ``on_step_end`` (the batch was already collated): the forward and
  backward of both models and the loss, gradient clipping, ``optimizer.step()``, the
  scheduler and ``zero_grad``. The allocator events walked in time order, running maximum
  (:func:`harness.kineto_peak`): the step's peak above the memory live before it. **fwd+bwd
  peak**: the same running sum, its maximum over the events inside ``training_step`` (forward,
  loss, backward) only. **live before**: the bytes of every distinct tensor storage the
  garbage collector reaches when step 2 begins: the two models' parameters and buffers and
  AdamW's state (parameter gradients are None then, freed by the previous ``zero_grad``);
  these are the same in every case. **peak** = live before + step peak.
* **tokens/s**: ``batch x seq`` over the median wall time of steps 3..N (``on_step_begin`` to
  ``on_step_end``).
* **loss**: what each trainer's ``training_step`` returns at step 1 (the same weights and
  batch in every case: the losses alone compared) and step N, per learned token; and the JSD
  after the N steps on a held-out sequence, in float64 (both models' float32 logits, no
  autocast), by the test suite's float64 reference (``tests/reference.py``, ``full_loss``)
  per row, mean over the rows.

``--runs`` repeats every case in a new process; the table shows the median of the runs'
numbers (memory and losses are the same run to run).
"""

from __future__ import annotations

import argparse
import statistics
import time

import reference  # the float64 reference, tests/reference.py (benchmarks/__init__.py)

from . import harness
from .harness import MiB

IMPLS = ("fused", "unfused", "trl", "fused-fp32")
IMPL_LABELS = {"fused": "KDTrainer (fused)", "unfused": "KDTrainer(fused=False)",
               "trl": "TRL GKDTrainer (lmbda=0)",
               "fused-fp32": "KDTrainer (fused, float32: no autocast)"}
FWD_BWD = "benchmarks.trainer: training_step"
PROFILED_STEP = 2  # step 1 is the warm-up


# --------------------------------------------------------------------------------------------
# Child: models, data, the trainer, and what is measured around its steps
# --------------------------------------------------------------------------------------------


def _llama(args, *, teacher: bool):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    pick = (lambda name: getattr(args, f"teacher_{name}")) if teacher else \
        (lambda name: getattr(args, name))
    hidden = pick("hidden")
    heads = max(1, hidden // 64)
    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=hidden, intermediate_size=pick("intermediate"),
        num_hidden_layers=pick("layers"), num_attention_heads=heads, num_key_value_heads=heads,
        max_position_embeddings=max(args.seq, 128), tie_word_embeddings=False,
        initializer_range=args.teacher_init if teacher else 0.02,
        bos_token_id=None, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(args.seed + (1 if teacher else 0))
    model = LlamaForCausalLM(config)
    return model.float()


def _tokenizer(vocab: int):
    """A word-level tokenizer of exactly ``vocab`` tokens (``t0``, ``t1``, ...; ``t0`` the pad
    token): GKD needs one (its pad id), and ``KDTrainer`` reads the vocabulary from it."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    words = {f"t{i}": i for i in range(vocab)}
    tok = Tokenizer(models.WordLevel(words, unk_token="t1"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", unk_token="t1")


def _data(args):
    """``steps x batch`` training sequences and one held-out sequence, uniform random token
    ids (ids 0 and 1, the pad and unk tokens, excluded)."""
    import torch
    from datasets import Dataset

    g = torch.Generator().manual_seed(args.seed + 2)
    ids = torch.randint(2, args.vocab, (args.steps * args.batch + 1, args.seq), generator=g)
    train = Dataset.from_dict({"input_ids": ids[:-1].tolist()})
    return train, ids[-1:]


class _Recording:
    """The collator, recording a checksum of each batch's token ids (the same batches in the
    same order in every case)."""

    def __init__(self, collator):
        self.collator, self.sums = collator, []

    def __call__(self, items):
        import torch

        batch = self.collator(items)
        ids = batch["input_ids"]
        weights = torch.arange(1, ids.numel() + 1, dtype=torch.int64).reshape(ids.shape)
        self.sums.append(int((ids * weights).sum()) % (2**61 - 1))
        return batch


def _live_bytes(named: dict) -> dict:
    """Bytes of every distinct CPU tensor storage the garbage collector reaches, and of those
    of the groups ``named`` (name -> tensors) among them."""
    import gc

    import torch

    def key(t):
        try:
            st = t.untyped_storage()
            ptr = st.data_ptr()
        except Exception:  # noqa: BLE001 - fake, meta or otherwise storage-less tensors
            return None
        return (ptr, st.nbytes()) if ptr else None

    seen = {}
    for obj in gc.get_objects():
        try:
            # type(), not isinstance: some module objects warn when their __class__ is read
            if issubclass(type(obj), torch.Tensor) and obj.device.type == "cpu":
                k = key(obj)
                if k is not None:
                    seen[k[0]] = k[1]
        except Exception:  # noqa: BLE001
            continue
    out = {"total": sum(seen.values())}
    for name, tensors in named.items():
        ks = {k for k in map(key, tensors) if k is not None}
        out[name] = sum(n for _, n in ks)
    return out


def _optimizer_tensors(optimizer):
    import torch

    return [v for state in optimizer.state.values() for v in state.values()
            if isinstance(v, torch.Tensor)]


def _split_peak(prof) -> tuple[int, int, int]:
    """``(peak, end, fwd_bwd_peak)`` of the profiled step: the running sum of the allocator
    events in time order, its maximum, its final value, and its maximum over the events inside
    the ``training_step`` range."""
    events = list(prof.profiler.kineto_results.events())
    ranges = [(e.start_ns(), e.start_ns() + e.duration_ns()) for e in events
              if e.name() == FWD_BWD]
    mem = sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns())
    current = peak = inner = 0
    for e in mem:
        current += e.nbytes()
        peak = max(peak, current)
        if any(lo <= e.start_ns() <= hi for lo, hi in ranges):
            inner = max(inner, current)
    return peak, current, inner


def _instrumented(cls):
    """``cls`` whose ``training_step`` is a named profiler range and records its loss and
    token count."""
    import torch

    class Bench(cls):
        def training_step(self, model, inputs, num_items_in_batch=None):
            with torch.profiler.record_function(FWD_BWD):
                loss = super().training_step(model, inputs, num_items_in_batch)
            self.bench_losses.append(float(loss))
            self.bench_items.append(None if num_items_in_batch is None
                                    else int(num_items_in_batch))
            return loss

    Bench.__name__ = f"Bench{cls.__name__}"
    return Bench


def _probe(trainer, args, result):
    """The callback that times every step and profiles step 2."""
    from torch.profiler import ProfilerActivity, profile
    from transformers import TrainerCallback

    class Probe(TrainerCallback):
        def __init__(self):
            self.times, self.prof, self.t0 = [], None, None

        def on_step_begin(self, targs, state, control, **kwargs):
            step = state.global_step + 1
            if step == PROFILED_STEP:
                student = [*trainer.model.parameters(), *trainer.model.buffers()]
                teacher = trainer.bench_teacher
                result["live_before"] = _live_bytes({
                    "student": student,
                    "teacher": [*teacher.parameters(), *teacher.buffers()],
                    "optimizer": _optimizer_tensors(trainer.optimizer),
                    "grads": [p.grad for p in trainer.model.parameters() if p.grad is not None],
                })
                self.prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
                self.prof.__enter__()
            self.t0 = time.perf_counter()

        def on_step_end(self, targs, state, control, **kwargs):
            self.times.append(time.perf_counter() - self.t0)
            if self.prof is not None:
                self.prof.__exit__(None, None, None)
                peak, end, inner = _split_peak(self.prof)
                result.update(step_peak_bytes=peak, step_retained_bytes=end,
                              fwd_bwd_peak_bytes=inner,
                              kineto_peak_bytes=harness.kineto_peak(self.prof)[0])
                self.prof = None

    return Probe()


def _common_args(args, output_dir, bf16=True):
    return dict(
        output_dir=output_dir, per_device_train_batch_size=args.batch, max_steps=args.steps,
        learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        gradient_accumulation_steps=1,
        # transformers 5's name; it wins over TRL's gradient_checkpointing=True default
        activation_checkpointing=args.gradient_checkpointing,
        bf16=bf16, use_cpu=True, seed=args.seed, report_to="none", save_strategy="no",
        logging_steps=10**9, disable_tqdm=True, dataloader_num_workers=0,
        remove_unused_columns=False)


def _trainer(impl, args, student, teacher, tokenizer, train, collator, output_dir):
    if impl == "trl":
        from trl.experimental.gkd import GKDConfig, GKDTrainer

        config = GKDConfig(**_common_args(args, output_dir), lmbda=0.0, beta=args.beta,
                           seq_kd=False, max_length=args.seq)
        trainer = _instrumented(GKDTrainer)(
            model=student, teacher_model=teacher, args=config, train_dataset=train,
            data_collator=collator, processing_class=tokenizer)
    else:
        from topkd.hf import KDConfig, KDTrainer

        config = KDConfig(**_common_args(args, output_dir, bf16=impl != "fused-fp32"),
                          divergence="jsd", beta=args.beta, k=None, fused=impl != "unfused")
        trainer = _instrumented(KDTrainer)(
            model=student, teacher=teacher, args=config, train_dataset=train,
            data_collator=collator, processing_class=tokenizer)
    trainer.bench_losses, trainer.bench_items, trainer.bench_teacher = [], [], teacher
    return trainer


def _held_out_jsd(student, teacher, ids, beta, rows=16) -> float:
    """float64 JSD(beta) per row of the models' float32 logits on ``ids`` [1, L] (no
    autocast), mean over the ``L - 1`` rows (``rows`` rows at a time)."""
    import torch

    was = student.training
    student.eval()
    with torch.no_grad():
        s = student(input_ids=ids, use_cache=False).logits[0, :-1].float()
        t = teacher(input_ids=ids, use_cache=False).logits[0, :-1].float()
        total = 0.0
        for lo in range(0, s.shape[0], rows):
            total += float(reference.full_loss(s[lo:lo + rows], t[lo:lo + rows],
                                               divergence=("jsd", beta), reduction="sum"))
    student.train(was)
    return total / s.shape[0]


def run_case(args, impl, kernels="-", run=1) -> dict:
    """One case, in the child process: a whole training run of ``args.steps`` steps."""
    result = {"impl": impl, "kernels": kernels, "run": run, "status": "error",
              "mem_limit_gib": args.mem_limit_gib}
    with harness.stages(result) as stage:
        stage("import torch")
        import os
        import tempfile
        import warnings

        harness.child_torch(args, result)
        result["topkd_impl"] = os.environ.get("TOPKD_IMPL")
        stage(harness.IMPORT_STAGE)
        from importlib.metadata import version

        import transformers

        from topkd.hf import KDCollator

        result["transformers"] = transformers.__version__
        if impl == "trl":
            import trl.experimental.gkd  # noqa: F401

            result["trl_version"] = version("trl")
        else:
            import topkd  # noqa: F401
        warnings.filterwarnings("ignore", category=UserWarning)
        harness.cap_address_space(args.mem_limit_gib)

        stage("models and data")
        student, teacher = _llama(args, teacher=False), _llama(args, teacher=True)
        teacher.eval().requires_grad_(False)
        result["student_params"] = sum(p.numel() for p in student.parameters())
        result["teacher_params"] = sum(p.numel() for p in teacher.parameters())
        tokenizer = _tokenizer(args.vocab)
        train, held_out = _data(args)
        collator = _Recording(KDCollator(tokenizer.pad_token_id))
        result["jsd_before"] = _held_out_jsd(student, teacher, held_out, args.beta)

        stage("trainer")
        with tempfile.TemporaryDirectory(prefix="topkd-bench-trainer-") as out:
            trainer = _trainer(impl, args, student, teacher, tokenizer, train, collator, out)
            probe = _probe(trainer, args, result)
            trainer.add_callback(probe)
            stage("train")
            trainer.train()
            model = trainer.model
        result["param_dtype"] = str(next(model.parameters()).dtype).replace("torch.", "")
        result["optimizer"] = type(trainer.optimizer.optimizer if hasattr(
            trainer.optimizer, "optimizer") else trainer.optimizer).__name__
        result["optim"] = str(trainer.args.optim)
        result["activation_checkpointing"] = bool(trainer.args.activation_checkpointing)
        result["steps_s"] = probe.times
        timed = probe.times[PROFILED_STEP:]
        result["first_step_s"] = probe.times[0]
        if timed:
            result["median_step_s"] = statistics.median(timed)
            result["tokens_per_s"] = args.batch * args.seq / result["median_step_s"]
        result["losses"] = trainer.bench_losses
        result["learned_tokens"] = trainer.bench_items
        result["batch_checksums"] = collator.sums
        stage("held-out JSD")
        result["jsd_after"] = _held_out_jsd(model, teacher, held_out, args.beta)
    return result


# --------------------------------------------------------------------------------------------
# Parent
# --------------------------------------------------------------------------------------------


def _run_case(args, impl, kernels, run) -> dict:
    limit = harness.memory_limit(args.mem_limit_gib)
    env = {"TOPKD_IMPL": kernels} if kernels != "-" else None
    result = {"impl": impl, "kernels": kernels, "run": run, "mem_limit_gib": limit}
    result.update(harness.run_child("benchmarks.trainer:run_case",
                                    {**vars(args), "mem_limit_gib": limit}, impl, kernels, run,
                                    timeout=args.timeout, env=env))
    return result


def _ok(r):
    return r is not None and r.get("status") == "ok"


def _median(runs, key):
    values = [r[key] for r in runs if _ok(r) and r.get(key) is not None]
    return statistics.median(values) if values else None


def summarize_runs(results) -> list[dict]:
    """One row per (impl, kernels): the median of its runs' numbers (the first run's losses,
    and whether all runs' losses agree)."""
    rows = []
    for key in dict.fromkeys((r["impl"], r["kernels"]) for r in results):
        runs = [r for r in results if (r["impl"], r["kernels"]) == key]
        ok = [r for r in runs if _ok(r)]
        row = {"impl": key[0], "kernels": key[1], "runs": len(runs), "ok_runs": len(ok)}
        if not ok:
            row.update(status=runs[0]["status"], message=runs[0].get("message", ""))
            rows.append(row)
            continue
        first = ok[0]
        row["status"] = "ok"
        for k in ("step_peak_bytes", "fwd_bwd_peak_bytes", "step_retained_bytes",
                  "tokens_per_s", "median_step_s", "first_step_s"):
            row[k] = _median(ok, k)
        row["tokens_per_s_runs"] = [r.get("tokens_per_s") for r in ok]
        timed = [t for r in ok for t in r["steps_s"][PROFILED_STEP:]]
        row["step_s_min"], row["step_s_max"] = (min(timed), max(timed)) if timed else (None,
                                                                                       None)
        row["live_before"] = first.get("live_before")
        row["peak_bytes"] = row["live_before"]["total"] + row["step_peak_bytes"]
        losses = first["losses"]
        row["loss_first"], row["loss_last"] = losses[0], losses[-1]
        row["losses_agree_across_runs"] = all(r["losses"] == losses for r in ok)
        for k in ("jsd_before", "jsd_after", "learned_tokens", "batch_checksums", "trl_version",
                  "threads", "torch", "transformers", "topkd_impl", "optimizer", "optim",
                  "param_dtype", "student_params", "teacher_params",
                  "activation_checkpointing"):
            row[k] = first.get(k)
        rows.append(row)
    return rows


def _fmt_mib(b) -> str:
    return "-" if b is None else f"{b / MiB:,.0f}"


def _fmt_s(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def _ratio(a, b, fmt="{:.3f}") -> str:
    return "-" if a is None or b is None or not b else fmt.format(a / b)


def _loss_diffs(a, b) -> str:
    def rel(key):
        return f"{abs(a[key] - b[key]) / abs(b[key]):.1e}"

    return (f"loss rel. diff at step 1 {rel('loss_first')}, at step N {rel('loss_last')}, "
            f"held-out JSD after N {rel('jsd_after')}")


def format_table(rows, meta) -> str:
    trl = next((r for r in rows if r["impl"] == "trl" and r["status"] == "ok"), None)
    lines = [
        f"Trainer: student LlamaForCausalLM {meta['layers']} layers, H = {meta['hidden']}, "
        f"intermediate {meta['intermediate']}; teacher {meta['teacher_layers']} layers, "
        f"H = {meta['teacher_hidden']}, intermediate {meta['teacher_intermediate']} "
        f"(initializer_range {meta['teacher_init']:g}); V = {meta['vocab']:,}, untied heads; "
        f"batch {meta['batch']} x {meta['seq']:,} tokens; float32 parameters, bf16 autocast, "
        f"use_cpu; JSD beta = {meta['beta']:g}, temperature 1; AdamW lr {meta['lr']:g} "
        f"constant; {meta['steps']} steps; gradient checkpointing "
        f"{'on' if meta['gradient_checkpointing'] else 'off'}; torch {meta['torch']}, "
        f"transformers {meta.get('transformers')}, TRL {meta.get('trl_version') or '-'}; "
        f"{meta['threads']} threads; {meta['runs']} run(s) per case (medians).",
    ]
    load = harness.load_line(meta)
    if load:
        lines += ["", load]
    lines += ["",
              "| trainer | kernels | step peak above live (MiB) | x TRL | fwd+bwd peak (MiB) "
              "| live before (MiB) | peak incl. live (MiB) | x TRL | tokens/s | x TRL "
              "| step s (median [min-max]) | first step s | loss step 1 | loss step N "
              "| held-out JSD after N |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        label = IMPL_LABELS[r["impl"]]
        if r["status"] != "ok":
            lines.append(f"| {label} | {r['kernels']} | {harness.status_text(r)} "
                         + "| - " * 12 + "|")
            continue
        tps = r.get("tokens_per_s")
        spread = harness.spread([r[k] for k in ("step_s_min", "step_s_max")
                                 if r.get(k) is not None])
        lines.append(
            f"| {label} | {r['kernels']} | {_fmt_mib(r['step_peak_bytes'])} "
            f"| {_ratio(r['step_peak_bytes'], trl and trl['step_peak_bytes'])} "
            f"| {_fmt_mib(r['fwd_bwd_peak_bytes'])} | {_fmt_mib(r['live_before']['total'])} "
            f"| {_fmt_mib(r['peak_bytes'])} | {_ratio(r['peak_bytes'], trl and trl['peak_bytes'])} "
            f"| {'-' if tps is None else f'{tps:,.0f}'} "
            f"| {_ratio(tps, trl and trl.get('tokens_per_s'), '{:.2f}')} "
            f"| {_fmt_s(r.get('median_step_s'))}{spread} "
            f"| {r['first_step_s']:.2f} | {r['loss_first']:.6g} | {r['loss_last']:.6g} "
            f"| {r['jsd_after']:.6g} |")
    ok = [r for r in rows if r["status"] == "ok"]
    if ok:
        live = ok[0]["live_before"]
        other = live["total"] - sum(live[k] for k in ("student", "teacher", "optimizer", "grads"))
        lines += [
            "",
            "step peak above live = the running maximum of the profiler's allocator events "
            "(torch.profiler, profile_memory=True, in time order) over step "
            f"{PROFILED_STEP} (after a warm-up step), from on_step_begin to on_step_end: "
            "both models' forward, the loss, the backward (the parameter gradients included), "
            "gradient clipping, optimizer.step(), zero_grad. fwd+bwd peak = the same running sum, "
            "its maximum inside training_step (forward, loss, backward). live before = every "
            "distinct tensor storage reachable when the step begins (the same in every case: "
            f"student {live['student'] / MiB:,.0f} MiB, teacher {live['teacher'] / MiB:,.0f} "
            f"MiB, AdamW state {live['optimizer'] / MiB:,.0f} MiB, gradients "
            f"{live['grads'] / MiB:,.0f} MiB, other {other / MiB:,.0f} MiB). "
            "tokens/s = batch x seq over the median time of steps "
            f"{PROFILED_STEP + 1}..N. Losses: per learned token, as each trainer's "
            "training_step returns it; held-out JSD: float64, one held-out sequence, "
            f"float32 logits (before training: {ok[0]['jsd_before']:.6g}).",
        ]
        sums = {tuple(r["batch_checksums"] or ()) for r in ok}
        items = {tuple(r["learned_tokens"] or ()) for r in ok}
        lines.append(
            f"Same batches in every case: {'yes' if len(sums) == 1 else 'NO'}; learned tokens "
            "per step: " + "; ".join(
                f"{IMPL_LABELS[r['impl']]} {sorted(set(r['learned_tokens']))}" for r in ok)
            + ("" if len(items) == 1 else " (differ)") + ".")
        if not all(r["losses_agree_across_runs"] for r in ok):
            lines.append("Losses differ between runs of a case: "
                         + ", ".join(IMPL_LABELS[r["impl"]] for r in ok
                                     if not r["losses_agree_across_runs"]))
    if trl is not None:
        lines += ["", "KDTrainer's targets against TRL (step peak at most 0.5x TRL's, tokens/s "
                      "at least TRL's):"]
        for r in ok:
            if r["impl"] != "fused":
                continue
            mem = r["step_peak_bytes"] / trl["step_peak_bytes"]
            tps = (r.get("tokens_per_s") or 0) / (trl.get("tokens_per_s") or float("inf"))
            lines.append(
                f"- KDTrainer (fused, {r['kernels']}): step peak {mem:.3f}x TRL's (bound <= 0.5: "
                f"{'holds' if mem <= 0.5 else 'FAILS'}; with the live memory "
                f"{r['peak_bytes'] / trl['peak_bytes']:.3f}x); tokens/s {tps:.2f}x TRL's "
                f"(bound >= 1: {'holds' if tps >= 1 else 'FAILS'}); " + _loss_diffs(r, trl))
    pairs = [(f, u) for f in ok for u in ok if f["impl"] == "fused" and u["impl"] == "unfused"
             and f["kernels"] == u["kernels"]]
    for f, u in pairs:
        lines.append(f"- fused vs unfused ({f['kernels']}): " + _loss_diffs(f, u))
    notes = [r for r in rows if r["status"] != "ok" and r.get("message")]
    if notes:
        lines.append("")
        for r in notes:
            lines.append(f"- {IMPL_LABELS[r['impl']]} ({r['kernels']}): {r['message'][:600]}")
    return "\n".join(lines)


def build_parser():
    p = argparse.ArgumentParser(
        prog="python -m benchmarks trainer",
        description="Trainer section: whole training runs of KDTrainer (fused and not) and TRL's "
                    "GKDTrainer (lmbda=0, off-policy) at the same JSD, on a 2-layer student "
                    "with a 151,936-token vocabulary: one step's peak memory (profiler), "
                    "tokens/s, and the loss after N steps. Every case runs in its own process.")
    p.add_argument("--vocab", type=int, default=151_936, help="vocabulary V (151936)")
    p.add_argument("--seq", type=int, default=1024, help="tokens per sequence (1024)")
    p.add_argument("--batch", type=int, default=1, help="sequences per step (1)")
    p.add_argument("--steps", type=int, default=10,
                   help="optimizer steps N (10; step 1 warms up, step 2 is profiled, steps 3..N "
                        "are timed; at least 3)")
    p.add_argument("--hidden", type=int, default=256, help="student hidden width (256)")
    p.add_argument("--intermediate", type=int, default=512, help="student MLP width (512)")
    p.add_argument("--layers", type=int, default=2, help="student layers (2)")
    p.add_argument("--teacher-hidden", type=int, default=256, help="teacher hidden width (256)")
    p.add_argument("--teacher-intermediate", type=int, default=512,
                   help="teacher MLP width (512)")
    p.add_argument("--teacher-layers", type=int, default=2, help="teacher layers (2)")
    p.add_argument("--teacher-init", type=float, default=0.1,
                   help="the teacher's initializer_range (0.1: peaked distributions)")
    p.add_argument("--beta", type=float, default=harness.JSD_BETA,
                   help=f"the generalized JSD's beta ({harness.JSD_BETA:g})")
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate, constant (1e-3)")
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="gradient checkpointing in every case (default off in every case)")
    p.add_argument("--impl", nargs="+", choices=IMPLS, default=list(IMPLS),
                   help="trainers (default: all; fused-fp32 is the fused KDTrainer without "
                   "autocast, to show what bf16 autocast saves)")
    p.add_argument("--kernels", nargs="+", choices=harness.KERNELS, default=["compile"],
                   help="$TOPKD_IMPL of the KDTrainer cases, one case each (default: compile)")
    p.add_argument("--runs", type=int, default=1, help="processes per case (1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the models and data (0)")
    harness.add_process_options(p)
    harness.add_output_options(p)
    return p


def _show(saved) -> str:
    return format_table(summarize_runs(saved["results"]), saved["meta"])


def main(argv) -> int:
    args = build_parser().parse_args(argv)
    if args.load:
        harness.show_saved(args, _show)
        return 0
    if args.steps < PROFILED_STEP + 1:
        raise SystemExit(f"--steps must be at least {PROFILED_STEP + 1} (warm-up, profiled, "
                         f"timed), got {args.steps}")
    if not 0.0 <= args.beta <= 1.0:
        raise SystemExit(f"--beta must be in [0, 1], got {args.beta:g}")

    cases = [(impl, kernels, run) for impl in IMPLS if impl in args.impl
             for kernels in (args.kernels if impl != "trl" else ["-"])
             for run in range(1, args.runs + 1)]
    t_start = time.perf_counter()
    load_start = harness.loadavg()

    def describe(case):
        impl, kernels, run = case
        return (f"{IMPL_LABELS[impl]}{'' if kernels == '-' else f' ({kernels})'}"
                + (f" run {run}" if args.runs > 1 else ""))

    def summarize(r):
        tps = r.get("tokens_per_s")
        return (f"step peak {r['step_peak_bytes'] / MiB:,.0f} MiB above live, "
                f"{'-' if tps is None else f'{tps:,.0f}'} tokens/s, loss "
                f"{r['losses'][0]:.6g} -> {r['losses'][-1]:.6g}")

    results = harness.run_cases(cases, describe, lambda case: _run_case(args, *case), summarize)
    rows = summarize_runs(results)

    def first(key):
        return next((r[key] for r in rows if r.get(key)), None)

    meta = {
        "vocab": args.vocab, "seq": args.seq, "batch": args.batch, "steps": args.steps,
        "hidden": args.hidden, "intermediate": args.intermediate, "layers": args.layers,
        "teacher_hidden": args.teacher_hidden, "teacher_intermediate": args.teacher_intermediate,
        "teacher_layers": args.teacher_layers, "teacher_init": args.teacher_init,
        "beta": args.beta, "lr": args.lr, "gradient_checkpointing": args.gradient_checkpointing,
        "kernels": args.kernels, "runs": args.runs, "torch": first("torch"),
        "transformers": first("transformers"), "trl_version": first("trl_version"),
        "threads": harness.threads_of(results, args.threads),
        "mem_limit_gib": args.mem_limit_gib,
        **harness.run_meta("trainer", argv, t_start, load_start),
    }
    harness.emit(args, {"meta": meta, "rows": rows, "results": results}, _show)
    return 0 if all(r["status"] in ("ok", "unavailable") for r in results) else 1
