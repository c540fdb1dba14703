"""topkd.hf.KDTrainer under FSDP2 and DeepSpeed ZeRO-3: the trainer's own training step
(compute_loss: the head lookup, the teacher's forward, the fused call with the head as the
DTensor FSDP leaves it) on a student wrapped by ``fully_shard`` in 2 and 3 gloo ranks equals one
process after three SGD steps, for full, LoRA and gradient-checkpointed students; ``train()``
under ZeRO-3 (the head partitioned, gathered by DeepSpeed's hooks for the loss) equals one
process; FSDP1 is refused on the fused path with the ways out. (The work of the ranks is in
tests/fsdp_trainer_worker.py and tests/zero3_trainer_worker.py.)"""

from __future__ import annotations

import importlib.util

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
import hf_worker  # noqa: E402
import zero3_trainer_worker as zero3_worker  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_gloo_available(), reason="no gloo")
HAS_PEFT = importlib.util.find_spec("peft") is not None  # (the LoRA case: the peft extra)
# (the ZeRO-3 cases: the deepspeed extra)
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None

PARAM_ATOL = 1e-5
DEADLINE_S = 300  # the first group runs every FSDP2 case, the FSDP1 refusal and ZeRO-3


def _check_against_one_process(case, world, result_dir):
    sharded = torch.load(result_dir / f"{worker._slug(case)}.pt")
    if case.startswith("zero3"):
        ref, metrics = zero3_worker.reference(case, world, result_dir / "ref")
        theirs = torch.load(result_dir / f"{worker._slug(case)}-eval.pt")
        for key, value in metrics.items():  # evaluation under ZeRO-3 (no grad) too
            assert theirs[key] == pytest.approx(value, rel=1e-5), (case, key, theirs, metrics)
        config = zero3_worker.CASES[case][0]
        initial = dict(hf_worker.student(vocab_size=worker.V, **config).named_parameters())
    else:
        ref = worker.reference(case, world, result_dir / "ref")
        initial = dict(worker.models(case)[0].named_parameters())
    assert sharded.keys() == ref.keys()
    for name, p in ref.items():
        moved = (p - initial[name]).abs().max().item()
        if not initial[name].requires_grad:  # (a LoRA student's frozen weights, its head's)
            assert torch.equal(sharded[name], initial[name]), f"{case}: frozen {name} moved"
            continue
        assert moved > 1e-4, f"{name} did not move ({moved}): the comparison tests nothing"
        err = (sharded[name] - p).abs().max().item()
        assert err <= PARAM_ATOL, f"{case}: {name} differs from one process by {err:.3g}"


def test_two_ranks(tmp_path):
    """Every case of fsdp_trainer_worker.CASES at 2 ranks against one process, and the FSDP1
    refusal, in one spawned group (starting the ranks is the slow part)."""
    cases = [case for case in worker.CASES if not case.startswith("lora") or HAS_PEFT]
    cases += list(zero3_worker.CASES) if HAS_DEEPSPEED else []
    helpers.spawn_ranks(worker.worker, 2, (2, [*cases, "fsdp1"], str(tmp_path)),
                        tmp_path, DEADLINE_S)
    for case in cases:
        _check_against_one_process(case, 2, tmp_path)


def test_three_ranks_uneven_shards(tmp_path):
    """Shards of 34/34/33 head rows."""
    case = "tied, sharded teacher, top-k"
    helpers.spawn_ranks(worker.worker, 3, (3, [case], str(tmp_path)), tmp_path, DEADLINE_S)
    _check_against_one_process(case, 3, tmp_path)


def _zero3_student():
    """A student whose LM head is what DeepSpeed ZeRO-3 leaves outside the forward: an empty
    parameter carrying ``ds_id``, ``ds_status`` and ``ds_shape`` (a fake: no deepspeed
    needed)."""
    model = worker.models("untied, sharded teacher, vocab_parallel")[0]
    weight = torch.nn.Parameter(torch.empty(0))
    weight.ds_id, weight.ds_status = 7, "NOT_AVAILABLE"
    weight.ds_shape = model.lm_head.weight.shape
    model.lm_head.weight = weight
    return model


@pytest.mark.parametrize("fused", [True, False])
def test_a_zero3_partitioned_head_is_taken_at_construction(tmp_path, fused):
    """(Before ``train()`` hands it to DeepSpeed, a student loaded under ``zero.Init`` is
    already partitioned): the trainer is built and reads the vocabulary from ``ds_shape``."""
    from topkd.hf import KDTrainer

    teacher = worker.models("untied, sharded teacher, vocab_parallel")[1]
    trainer = KDTrainer(model=_zero3_student(), teacher=teacher,
                        args=worker.hf_worker.config(tmp_path, fused=fused))
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


def test_distill_deepspeed_settings(tmp_path, monkeypatch):
    """``topkd distill --deepspeed CONFIG``: the JSON goes to ``TrainingArguments(deepspeed=)``
    (ZeRO-3: the student saved whole at the end unless the config says otherwise); a missing
    or malformed file, ``--fsdp`` beside it and a run without a launcher are refused before
    any model is loaded. (The ZeRO-3 training itself: test_two_ranks.)"""
    from topkd.cli import build_parser
    from topkd.hf.distill import deepspeed_settings, distill

    parsed = build_parser().parse_args(["distill", "--student", "s", "--teacher", "t",
                                        "--data", "d.jsonl", "--out", "o", "--deepspeed",
                                        "ds.json"])
    assert parsed.deepspeed == "ds.json"
    for name in ("student", "teacher"):
        (tmp_path / name).mkdir()
    (tmp_path / "d.jsonl").write_text('{"text": "a b"}\n')
    config = tmp_path / "ds.json"
    config.write_text('{"zero_optimization": {"stage": 3}, "train_batch_size": "auto"}')
    (tmp_path / "bad.json").write_text("{stage: 3")
    (tmp_path / "list.json").write_text("[3]")

    def run(deepspeed, **kwargs):
        return distill(str(tmp_path / "student"), str(tmp_path / "d.jsonl"),
                       str(tmp_path / "o"), teacher=str(tmp_path / "teacher"),
                       deepspeed=deepspeed, **kwargs)

    for path, message in (("missing.json", "is not a file"), ("bad.json", "is not JSON"),
                          ("list.json", "holds a list, not a JSON object")):
        with pytest.raises(ValueError, match=message):
            run(str(tmp_path / path))
    with pytest.raises(ValueError, match="choose one"):
        run(str(config), fsdp=True)
    if not HAS_DEEPSPEED:
        with pytest.raises(ImportError, match=r"topkd\[deepspeed\]"):
            run(str(config))
        return
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(ValueError, match="needs a distributed launcher"):
        run(str(config))
    settings = deepspeed_settings(config)
    assert settings["zero_optimization"] == {
        "stage": 3, "stage3_gather_16bit_weights_on_model_save": True}
    config.write_text('{"zero_optimization": {"stage": 3, '
                      '"stage3_gather_16bit_weights_on_model_save": false}}')
    assert not deepspeed_settings(config)["zero_optimization"][
        "stage3_gather_16bit_weights_on_model_save"]
