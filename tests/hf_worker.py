"""Tiny models, data and one-step training runs for test_hf_trainer.py, and the body of its
DDP test, run in spawned gloo ranks.

Everything here is built from configs and fixed seeds (no hub), so a spawned rank builds the
same student, teacher and items as the test process.
"""

from __future__ import annotations

import os
import sys
import traceback
from datetime import timedelta

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
for _p in (_HERE, os.path.dirname(_HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

V = 300  # both heads' width (no tokenizer: the vocabulary)
LR = 0.1
# (length, prompt tokens labelled -100): the two micro-batches of 2 learn 15 and 4 tokens, so
# a loss normalized per micro-batch (or per rank) instead of over the step moves the step.
SHAPES = [(9, 1), (8, 0), (6, 4), (3, 1)]


def student(seed: int = 0, **config):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    settings = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                    tie_word_embeddings=False, initializer_range=0.1)
    return LlamaForCausalLM(LlamaConfig(**{**settings, **config}))


def teacher(seed: int = 1, **config):
    """Another architecture and width than the student; a wide init, so its distributions are
    far from the student's and the gradients are not small."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    settings = dict(vocab_size=V, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                    tie_word_embeddings=False, initializer_range=0.3)
    return Qwen2ForCausalLM(Qwen2Config(**{**settings, **config}))


def items(shapes=SHAPES, vocab: int = V, seed: int = 2) -> list[dict]:
    """Dataset items: ``input_ids`` and ``labels`` (the prompt's first tokens -100)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for length, prompt in shapes:
        ids = torch.randint(0, vocab, (length,), generator=g)
        labels = ids.clone()
        labels[:prompt] = -100
        out.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
    return out


def unlearned_tail() -> list[dict]:
    """:func:`items` whose last two (one DDP rank's half) learn no token: labels all -100."""
    data = items()
    for item in data[2:]:
        item["labels"] = [-100] * len(item["labels"])
    return data


def config(output_dir, **overrides):
    """A KDConfig for one plain SGD step: constant rate, no clipping, no decay, data in order."""
    from topkd.hf import KDConfig

    settings = dict(output_dir=str(output_dir), use_cpu=True, max_steps=1, learning_rate=LR,
                    optim="sgd", lr_scheduler_type="constant", warmup_steps=0,
                    weight_decay=0.0, max_grad_norm=0.0, train_sampling_strategy="sequential",
                    report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True,
                    dataloader_num_workers=0)
    return KDConfig(**{**settings, **overrides})


class Recording:
    """A collator that records the input_ids of every item it batches, then delegates."""

    def __init__(self, collator):
        self.collator, self.seen = collator, []

    def __call__(self, batch):
        self.seen.append([list(item["input_ids"]) for item in batch])
        return self.collator(batch)


def one_step(output_dir, batch: int, accumulation: int, data=None, **overrides):
    """One SGD step of online KD (student <- teacher) on ``data`` (default :func:`items`):
    ``(parameters after, log_history, batches the collator saw)``."""
    from topkd.hf import KDCollator, KDTrainer

    model, data = student(), items() if data is None else data
    collator = Recording(KDCollator())
    trainer = KDTrainer(model=model, teacher=teacher(), data_collator=collator,
                        args=config(output_dir, per_device_train_batch_size=batch,
                                    gradient_accumulation_steps=accumulation, **overrides),
                        train_dataset=data)
    trainer.train()
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    return params, trainer.state.log_history, collator.seen


def ddp_worker(rank: int, world: int, port: int, result_dir: str) -> None:
    """One of ``world`` gloo ranks: one step at per-device batch 2 on the 4 items, then on
    :func:`unlearned_tail` (rank 1 learns nothing, yet joins every collective); the
    parameters, the log and the batches seen go to ``result_dir/<run>-rank<r>.pt``, and
    ``rank<r>.txt`` says OK or holds the error."""
    import torch.distributed as dist

    report = os.path.join(result_dir, f"rank{rank}.txt")
    try:
        # the slow imports before the rendezvous, so the ranks reach it together
        import transformers  # noqa: F401

        import topkd.hf  # noqa: F401

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                          WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                          LOCAL_WORLD_SIZE=str(world))
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=timedelta(seconds=120))
        try:
            for run, data in (("plain", items()), ("unlearned", unlearned_tail())):
                params, log, seen = one_step(os.path.join(result_dir, f"{run}{rank}"), 2, 1,
                                             data=data, ddp_backend="gloo")
                torch.save({"params": params, "log": log, "seen": seen},
                           os.path.join(result_dir, f"{run}-rank{rank}.pt"))
            dist.barrier()
        finally:
            dist.destroy_process_group()
        with open(report, "w") as f:
            f.write("OK")
    except BaseException:
        with open(report, "w") as f:
            f.write(traceback.format_exc())
