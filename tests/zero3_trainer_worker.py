"""The KDTrainer-under-DeepSpeed-ZeRO-3 cases of integrations/test_hf_fsdp.py, run in the
spawned gloo ranks of fsdp_trainer_worker (after its FSDP2 cases), and their one-process
reference.

Each rank runs ``KDTrainer.train()`` itself with ``KDConfig(deepspeed=...)``: transformers
hands the student to ``deepspeed.initialize`` (stage 3, every parameter partitioned: a
persistence threshold of 0, so the tiny head is partitioned as a large one would be), and
the fused path runs the loss as the head's forward (``topkd.hf.zero3``). DeepSpeed runs on
CPU over the ranks' gloo group. The reference is the same ``train()`` in one process on
every rank's items (per-device batch ``world x`` the ranks').
"""

from __future__ import annotations

import os

import fsdp_trainer_worker as fsdp
import hf_worker
import torch

STEPS = 3
# every parameter partitioned; "auto": the Trainer's batch sizes, accumulation, clipping; the
# optimizer the Trainer's own (SGD: optim="sgd")
ZERO3 = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
         "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
         "gradient_accumulation_steps": "auto", "gradient_clipping": "auto"}

# name: (student config, teacher wrapped by deepspeed.initialize, KDConfig overrides)
CASES = {
    "zero3, untied, zero3 teacher, ce": (dict(tie_word_embeddings=False), True,
                                         dict(ce_weight=0.5)),
    "zero3, tied, top-k": (dict(tie_word_embeddings=True), False, dict(k=8)),
}


def items(world: int) -> list[dict]:
    """The run's items in order: step ``s`` trains on ``fsdp.batches(s, world)`` (all ranks)."""
    return [item for step in range(STEPS) for rank_items in fsdp.batches(step, world)
            for item in rank_items]


def train(case, world: int, output_dir, zero3: bool):
    """``KDTrainer.train()`` for ``case``: ZeRO-3 on this rank's share, or one process on all
    the items. Returns the trainer."""
    from topkd.hf import KDTrainer

    student_config, zero3_teacher, overrides = CASES[case]
    model = hf_worker.student(vocab_size=fsdp.V, **student_config)
    teacher = hf_worker.teacher(vocab_size=fsdp.V)
    if zero3:
        overrides = {**overrides, "deepspeed": ZERO3, "ddp_backend": "gloo"}
    batch = fsdp.ITEMS_PER_RANK * (1 if zero3 else world)
    args = hf_worker.config(output_dir, impl="eager", max_steps=STEPS, learning_rate=fsdp.LR,
                            per_device_train_batch_size=batch, **overrides)
    if zero3 and zero3_teacher:  # an inference engine: no optimizer, every weight partitioned
        import deepspeed

        config = {"zero_optimization": ZERO3["zero_optimization"],
                  "train_micro_batch_size_per_gpu": 1}
        teacher = deepspeed.initialize(model=teacher, config=config)[0]
    trainer = KDTrainer(model=model, teacher=teacher, args=args, train_dataset=items(world),
                        eval_dataset=items(world)[:world * fsdp.ITEMS_PER_RANK])
    trainer.train()
    return trainer


def evaluated(trainer) -> dict[str, float]:
    """The held-out metrics after training (under ZeRO-3: the head gathered for a loss run
    under no grad)."""
    metrics = trainer.evaluate()
    return {key: metrics[key] for key in ("eval_kl", "eval_ce", "eval_loss")}


def reference(case, world: int, output_dir) -> tuple[dict[str, torch.Tensor], dict]:
    """One process: the parameters after training, and :func:`evaluated`'s metrics."""
    trainer = train(case, world, output_dir, zero3=False)
    params = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    return params, evaluated(trainer)


class PartitionSpy(fsdp.HeadSpy):
    """Records, at each loss, whether the student's and the teacher's heads are ZeRO-3
    parameters whose own partition holds fewer values than the whole (what the test claims
    to test)."""

    def __call__(self, student, teacher, *args, **kwargs):
        def split(p):
            return hasattr(p, "ds_id") and 0 < p.ds_tensor.numel() < p.ds_numel

        self.seen.append((split(student[1]), isinstance(teacher, tuple) and split(teacher[1])))
        return self.original(student, teacher, *args, **kwargs)


def without_shm_op() -> None:
    """DeepSpeed's CPU backend compiles a shared-memory all-reduce op when its process group
    starts (about 90 s the first time on a 2-core machine; GPUs never use it): the ranks use
    gloo's collectives instead."""
    import importlib

    # (by its name in sys.modules: the attribute deepspeed.comm.torch is the torch package)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


def run_case(case, rank, world, result_dir, failures):
    from deepspeed.utils import safe_get_full_fp32_param

    import topkd.hf.trainer as trainer_module

    without_shm_op()
    with PartitionSpy(trainer_module) as spy:
        trainer = train(case, world, os.path.join(result_dir, f"{fsdp._slug(case)}{rank}"),
                        zero3=True)
    expected = (True, CASES[case][1])
    if trainer.state.global_step != STEPS or spy.seen != [expected] * STEPS:
        failures.append(f"{case}: {trainer.state.global_step} steps; the heads at the loss "
                        f"were ZeRO-3 partitions {spy.seen}, expected {expected} at each of "
                        f"{STEPS} steps: the test does not test what it says")
    params = {name: safe_get_full_fp32_param(p).detach().clone()  # (a collective)
              for name, p in trainer.model_wrapped.module.named_parameters()}
    metrics = evaluated(trainer)
    if rank == 0:
        torch.save(params, os.path.join(result_dir, f"{fsdp._slug(case)}.pt"))
        torch.save(metrics, os.path.join(result_dir, f"{fsdp._slug(case)}-eval.pt"))
