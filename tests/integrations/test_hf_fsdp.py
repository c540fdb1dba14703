"""topkd.hf.KDTrainer under FSDP2: the trainer's own training step (compute_loss: the head
lookup, the teacher's forward, the fused call with the head as the DTensor FSDP leaves it) on a
student wrapped by ``fully_shard`` in 2 and 3 gloo ranks equals one process after three SGD steps;
FSDP1 and a DeepSpeed ZeRO-3 partitioned head are refused on the fused path with the ways out.
(The work of the ranks is in tests/fsdp_trainer_worker.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
try:
    from torch.distributed.fsdp import fully_shard  # noqa: F401
except ImportError:
    pytest.skip("FSDP2 (fully_shard) is not available in this torch", allow_module_level=True)

import fsdp_trainer_worker as worker  # noqa: E402
import helpers  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_gloo_available(), reason="no gloo")

PARAM_ATOL = 1e-5
DEADLINE_S = 300  # the first group runs three cases and the FSDP1 refusal


def _check_against_one_process(case, world, result_dir):
    sharded = torch.load(result_dir / f"{worker._slug(case)}.pt")
    ref = worker.reference(case, world, result_dir / "ref")
    initial = dict(worker.models(case)[0].named_parameters())
    assert sharded.keys() == ref.keys()
    for name, p in ref.items():
        moved = (p - initial[name]).abs().max().item()
        assert moved > 1e-4, f"{name} did not move ({moved}): the comparison tests nothing"
        err = (sharded[name] - p).abs().max().item()
        assert err <= PARAM_ATOL, f"{case}: {name} differs from one process by {err:.3g}"


def test_two_ranks(tmp_path):
    """Every case of fsdp_trainer_worker.CASES at 2 ranks against one process, and the FSDP1
    refusal, in one spawned group (starting the ranks is the slow part)."""
    helpers.spawn_ranks(worker.worker, 2, (2, [*worker.CASES, "fsdp1"], str(tmp_path)),
                        tmp_path, DEADLINE_S)
    for case in worker.CASES:
        _check_against_one_process(case, 2, tmp_path)


def test_three_ranks_uneven_shards(tmp_path):
    """Shards of 34/34/33 head rows."""
    case = "tied, sharded teacher, top-k"
    helpers.spawn_ranks(worker.worker, 3, (3, [case], str(tmp_path)), tmp_path, DEADLINE_S)
    _check_against_one_process(case, 3, tmp_path)


def _zero3_student():
    """A student whose LM head is what DeepSpeed ZeRO-3 leaves outside the forward: an empty
    parameter carrying ``ds_id``, ``ds_status`` and ``ds_shape`` (a fake: deepspeed is not
    installed)."""
    model = worker.models("untied, sharded teacher, vocab_parallel")[0]
    weight = torch.nn.Parameter(torch.empty(0))
    weight.ds_id, weight.ds_status = 7, "NOT_AVAILABLE"
    weight.ds_shape = model.lm_head.weight.shape
    model.lm_head.weight = weight
    return model


def test_zero3_partitioned_head_refused(tmp_path):
    from topkd.hf import KDTrainer

    teacher = worker.models("untied, sharded teacher, vocab_parallel")[1]
    args = worker.hf_worker.config(tmp_path)
    with pytest.raises(ValueError, match=r"student's LM head weight is partitioned by "
                                         r"DeepSpeed ZeRO-3.*fused=False.*FSDP2"):
        KDTrainer(model=_zero3_student(), teacher=teacher, args=args)
    # unfused, the head is the model's business: the trainer is built, the vocabulary read
    # from ds_shape
    trainer = KDTrainer(model=_zero3_student(), teacher=teacher,
                        args=worker.hf_worker.config(tmp_path, fused=False))
    assert trainer.vocab_size == worker.V


def test_distill_fsdp_settings_build_accelerates_fsdp2_plugin(tmp_path):
    """``topkd distill --fsdp``: the TrainingArguments settings give accelerate's FSDP2 plugin
    (fsdp_version 2, the decoder layers wrapped, the root resharded after forward). The run
    itself needs GPUs: on CPU it is refused before any model is loaded."""
    from topkd.cli import build_parser
    from topkd.hf import KDConfig
    from topkd.hf.distill import distill, fsdp_settings

    settings = fsdp_settings(worker.models("tied, plain teacher, gather")[0])
    args = KDConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", **settings)
    plugin = args.fsdp_plugin_args
    assert plugin["fsdp_version"] == 2
    assert plugin["reshard_after_forward"] is True
    assert plugin["auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
    assert plugin["transformer_cls_names_to_wrap"] == "LlamaDecoderLayer"
    parsed = build_parser().parse_args(["distill", "--student", "s", "--teacher", "t",
                                        "--data", "d.jsonl", "--out", "o", "--fsdp"])
    assert parsed.fsdp is True
    for name in ("student", "teacher"):
        (tmp_path / name).mkdir()
    (tmp_path / "d.jsonl").write_text('{"text": "a b"}\n')
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs CUDA GPUs"):
            distill(str(tmp_path / "student"), str(tmp_path / "d.jsonl"), str(tmp_path / "o"),
                    teacher=str(tmp_path / "teacher"), fsdp=True)
