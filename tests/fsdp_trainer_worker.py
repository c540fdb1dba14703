"""Body of the KDTrainer-under-FSDP2 tests (integrations/test_hf_fsdp.py), run in spawned gloo
ranks, and the one-process reference they are compared with.

The ranks drive the code that runs under accelerate's FSDP2 plugin: ``KDTrainer.training_step``
(its ``compute_loss``: the head lookup, the teacher's forward, the fused call, the scaling by
the step's global token count), on a student wrapped by ``fully_shard`` as accelerate wraps it
(each decoder layer, then the root with ``reshard_after_forward=True``), so the LM head reaches
the loss as a ``Shard(0)`` DTensor. accelerate itself does not run FSDP on CPU (it falls back
to DDP), so the wrapping is done here, and the steps are driven by hand: collate this rank's
items, count the step's learned tokens over the ranks (``_get_num_items_in_batch``), one
``training_step``, one SGD step. The reference runs every rank's batch in one process through
the same ``training_step`` with the same global count, gradients accumulating, then one step.
Students: full fine-tuning (tied or not), a peft LoRA student (its head frozen: the loss gives
it no gradient) and one under gradient checkpointing (each layer recomputed in backward). The
ZeRO-3 cases (zero3_trainer_worker) run last in the same ranks.
"""

from __future__ import annotations

import os
import sys
import traceback

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
for _p in (_HERE, os.path.dirname(_HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import hf_worker  # noqa: E402

V = 101  # shards of 51/50 rows (2 ranks), 34/34/33 (3 ranks)
STEPS = 3
ITEMS_PER_RANK = 2
LR = 0.5
SHAPES = [(9, 1), (8, 0), (6, 4), (3, 1), (7, 2), (5, 0)]

# name: (student config, teacher wrapped by fully_shard, KDConfig overrides)
CASES = {
    "untied, sharded teacher, vocab_parallel":
        (dict(tie_word_embeddings=False), True, dict(ce_weight=0.5)),
    "tied, plain teacher, gather":
        (dict(tie_word_embeddings=True), False, dict(sharded_head="gather")),
    "tied, sharded teacher, top-k":
        (dict(tie_word_embeddings=True), True, dict(k=8)),
    "lora, sharded teacher":
        (dict(tie_word_embeddings=False), True, dict(ce_weight=0.5)),
    "tied, checkpointing, sharded teacher":
        (dict(tie_word_embeddings=True), True, {}),
}


def lora(model):
    """A peft LoRA student (adapters on q_proj and v_proj, random B so every adapter moves
    from the first step): the LM head and everything else frozen."""
    import peft

    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                             init_lora_weights=False)
    return peft.get_peft_model(model, config)


def models(case):
    student_config, _, _ = CASES[case]
    student = hf_worker.student(vocab_size=V, **student_config)
    if case.startswith("lora"):
        student = lora(student)
    if "checkpointing" in case:  # (transformers' default: non-reentrant torch checkpoint)
        enable = getattr(student, "activation_checkpointing_enable", None)
        (enable or student.gradient_checkpointing_enable)()
    return student, hf_worker.teacher(vocab_size=V)


def batches(step: int, world: int) -> list[list[dict]]:
    """Each rank's items at ``step`` (another draw each step)."""
    data = hf_worker.items(SHAPES[: world * ITEMS_PER_RANK], vocab=V, seed=100 + step)
    return [data[r * ITEMS_PER_RANK:(r + 1) * ITEMS_PER_RANK] for r in range(world)]


def trainer_for(case, model, teacher, output_dir, ranks: bool = True):
    from topkd.hf import KDTrainer

    _, _, overrides = CASES[case]
    if ranks:  # in the spawned gloo group
        overrides = {**overrides, "ddp_backend": "gloo"}
    args = hf_worker.config(output_dir, impl="eager", **overrides)
    return KDTrainer(model=model, teacher=teacher, args=args)


def reference(case, world: int, output_dir) -> dict[str, torch.Tensor]:
    """One process: every rank's batch through ``training_step`` with the step's global
    token count (so the gradients add up to FSDP's average), then one SGD step."""
    model, teacher = models(case)
    trainer = trainer_for(case, model, teacher, output_dir, ranks=False)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        inputs = [trainer._prepare_inputs(trainer.data_collator(b))
                  for b in batches(step, world)]
        count = trainer._get_num_items_in_batch(inputs, torch.device("cpu"))
        for batch in inputs:
            trainer.training_step(model, batch, count)
        opt.step()
        opt.zero_grad()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


class HeadSpy:
    """Wraps the trainer module's ``distill_loss``: records whether each head it is given
    is a DTensor (what the test claims to test)."""

    def __init__(self, module):
        self.module, self.seen = module, []
        self.original = module.distill_loss

    def __call__(self, student, teacher, *args, **kwargs):
        from topkd import sharded

        self.seen.append((sharded.is_dtensor(student[1]),
                          isinstance(teacher, tuple) and sharded.is_dtensor(teacher[1])))
        return self.original(student, teacher, *args, **kwargs)

    def __enter__(self):
        self.module.distill_loss = self
        return self

    def __exit__(self, *exc):
        self.module.distill_loss = self.original


def shard(model, reshard_root: bool = True):
    from torch.distributed.fsdp import fully_shard

    for layer in shard_layers(model):
        fully_shard(layer)
    fully_shard(model, reshard_after_forward=reshard_root)
    return model


def shard_layers(model):
    from topkd.hf.models import unwrap

    return unwrap(model).model.layers


def run_case(case, rank, world, result_dir, failures):
    import torch.distributed as dist

    import topkd.hf.trainer as trainer_module

    _, wrap_teacher, _ = CASES[case]
    model, teacher = models(case)
    shard(model)
    if wrap_teacher:
        shard(teacher)
    trainer = trainer_for(case, model, teacher, os.path.join(result_dir, f"out{rank}"))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    frozen = [name for name, p in model.named_parameters() if not p.requires_grad]
    # the first layer's attention runs twice per step under checkpointing (its recomputation
    # calls the layer's forward, which calls the attention module)
    calls = []
    hook = shard_layers(model)[0].self_attn.register_forward_hook(lambda *_: calls.append(1))
    with HeadSpy(trainer_module) as spy:
        for step in range(STEPS):
            batch = trainer._prepare_inputs(trainer.data_collator(batches(step, world)[rank]))
            count = trainer._get_num_items_in_batch([batch], torch.device("cpu"))
            trainer.training_step(model, batch, count)
            graded = [n for n, p in model.named_parameters() if n in frozen and p.grad is not None]
            if graded:
                failures.append(f"{case}: frozen parameters got a gradient: {graded}")
            opt.step()
            opt.zero_grad()
    hook.remove()
    forwards = 2 if "checkpointing" in case else 1
    if len(calls) != forwards * STEPS:
        failures.append(f"{case}: the first attention ran {len(calls)} times in {STEPS} steps, "
                        f"expected {forwards * STEPS}")
    expected = (True, wrap_teacher)
    if spy.seen != [expected] * STEPS:
        failures.append(f"{case}: the heads at the loss were DTensors {spy.seen}, expected "
                        f"{expected} at each of {STEPS} steps: the test does not test what it "
                        f"says")
    params = {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
              for name, p in model.named_parameters()}
    if rank == 0:
        torch.save(params, os.path.join(result_dir, f"{_slug(case)}.pt"))
    dist.barrier()


def run_fsdp1(rank, world, result_dir, failures):
    """A student wrapped by FSDP1, as accelerate's fsdp_version=1 hands it to compute_loss:
    the fused path refuses it, naming FSDP2 and fused=False."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    model, teacher = models("untied, sharded teacher, vocab_parallel")
    trainer = trainer_for("untied, sharded teacher, vocab_parallel", model, teacher,
                          os.path.join(result_dir, f"fsdp1-{rank}"))
    wrapped = FullyShardedDataParallel(model, device_id=torch.device("cpu"),
                                       use_orig_params=True)
    batch = trainer._prepare_inputs(trainer.data_collator(batches(0, world)[rank]))
    try:
        trainer.compute_loss(wrapped, batch, num_items_in_batch=torch.tensor(10))
    except ValueError as e:
        text = str(e)
        if not all(word in text for word in ("the student is wrapped in FSDP1", "fully_shard",
                                             "fsdp_version=2", "fused=False")):
            failures.append(f"FSDP1: the ValueError does not name the ways out: {text}")
    else:
        failures.append("FSDP1 with the fused head: no ValueError")


def _slug(case: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in case)


def worker(rank, world, plan, result_dir):
    from tp_worker import run_rank

    def body(group, failures):
        torch.manual_seed(0)
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                          LOCAL_WORLD_SIZE=str(world))
        for case in plan:
            try:
                if case == "fsdp1":
                    run_fsdp1(rank, world, result_dir, failures)
                elif case.startswith("zero3"):  # (last: DeepSpeed's engines stay set up)
                    import zero3_trainer_worker

                    zero3_trainer_worker.run_case(case, rank, world, result_dir, failures)
                else:
                    run_case(case, rank, world, result_dir, failures)
            except Exception:  # noqa: BLE001
                failures.append(f"{case}\n{traceback.format_exc()}")

    run_rank(rank, world, result_dir, body)
