"""Padding-free (packed) batches in topkd.hf.KDTrainer: several sequences in one row,
``position_ids`` restarting at each, as ``transformers.DataCollatorWithFlattening`` and
``KDCollator(padding_free=True)`` make them.

Each sequence of a packed batch must get the KD and CE it gets in a padded batch (float32 tiny
models, fused and unfused, eager and sdpa attention); no row is trained across a sequence
boundary, whatever the labels say there; a training step, the offline store's rows and the
token count are the padded batch's; and what cannot be made right is refused: an attention
implementation that lets packed sequences see each other, padding inside a packed row, packing
keys without position_ids.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import hf_worker  # noqa: E402
from hf_worker import V  # noqa: E402
from transformers import AttentionInterface, DataCollatorWithFlattening  # noqa: E402
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402

import topkd  # noqa: E402
import topkd.hf.trainer as trainer_module  # noqa: E402
from topkd.hf import KDCollator, KDTrainer  # noqa: E402

# an attention that ignores transformers' packed-sequence mask: plain causal attention over the
# whole row (what a custom kernel without packing support does)
AttentionInterface.register("causal_only", sdpa_attention_forward)

K = 8
RTOL = 1e-6  # packed vs padded, per sequence (float32; measured up to 5.1e-7)


def trainer_for(tmp_path, student, teacher=None, **options):
    keys = ("store", "train_dataset", "data_collator")
    kwargs = {k: options.pop(k) for k in keys if k in options}
    return KDTrainer(model=student, teacher=teacher, args=hf_worker.config(tmp_path, **options),
                     **kwargs)


def recorded_rows(trainer, batch, monkeypatch, ce_weight=0.5):
    """The batch's ``(kd, ce, tokens)`` sums and its per-row KD and CE (the inputs the trainer
    gives the loss, recomputed with ``reduction="none"``)."""
    calls = []
    real = trainer_module.distill_loss

    def spy(student, teacher, options, **kwargs):
        calls.append((student, teacher, options, kwargs))
        return real(student, teacher, options, **kwargs)

    monkeypatch.setattr(trainer_module, "distill_loss", spy)
    with torch.no_grad():
        parts = trainer._parts(trainer.model, trainer._prepare_inputs(batch), ce_weight)
        student, teacher, options, kwargs = calls[0]
        rows = real(student, teacher, options.replace(reduction="none"), **kwargs)
    monkeypatch.undo()
    return parts, rows.kd, rows.ce


def per_sequence(values: torch.Tensor, counts: list[int]) -> torch.Tensor:
    return torch.stack([chunk.sum() for chunk in values.split(counts)])


def learned_counts(data) -> list[int]:
    return [sum(label != -100 for label in item.get("labels", item["input_ids"])[1:])
            for item in data]


# -- 1. each sequence's loss is its padded run's ---------------------------------------------


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("fused", [True, False])
def test_each_sequence_gets_its_padded_kd_and_ce(tmp_path, monkeypatch, fused, attention):
    """DataCollatorWithFlattening's batch and KDCollator(padding_free=True)'s: every
    sequence's KD and CE equal the padded batch's to 1e-6 (the models get the position_ids;
    without them the sequences attend to each other and KD moves by 2%)."""
    data = hf_worker.items()
    trainer = trainer_for(tmp_path, hf_worker.student(attn_implementation=attention),
                          hf_worker.teacher(attn_implementation=attention), fused=fused,
                          ce_weight=0.5)
    counts = learned_counts(data)
    padded, kd_want, ce_want = recorded_rows(trainer, KDCollator()(data), monkeypatch)
    flattened = DataCollatorWithFlattening()(data)
    ours = KDCollator(padding_free=True)(data)
    assert all(torch.equal(flattened[key], ours[key]) for key in flattened)
    assert "attention_mask" not in ours
    for batch in (flattened, ours):
        packed, kd, ce = recorded_rows(trainer, batch, monkeypatch)
        assert packed.tokens == padded.tokens == sum(counts)
        for got, want, what in ((kd, kd_want, "kd"), (ce, ce_want, "ce")):
            got, want = per_sequence(got, counts), per_sequence(want, counts)
            torch.testing.assert_close(got, want, rtol=RTOL, atol=1e-7, msg=what)
        assert float(packed.kd) == pytest.approx(float(padded.kd), rel=RTOL)
        assert float(packed.ce) == pytest.approx(float(padded.ce), rel=RTOL)


def test_a_mask_of_ones_beside_packed_positions_is_dropped(tmp_path):
    """A packed row with an all-ones attention_mask (a collator that adds one): with the mask,
    transformers would build a plain causal mask over the whole row; the trainer drops it.
    Padding after the row's last sequence is allowed (causal attention never looks ahead)."""
    data = hf_worker.items()
    trainer = trainer_for(tmp_path, hf_worker.student(), hf_worker.teacher(), ce_weight=0.5)
    padded = trainer._parts(trainer.model, KDCollator()(data), 0.5)
    packed = KDCollator(padding_free=True)(data)
    length = packed["input_ids"].shape[1]
    ones = {**packed, "attention_mask": torch.ones(1, length, dtype=torch.int64)}
    tail = {key: torch.cat([value, value[:, :3]], 1) for key, value in ones.items()}
    tail["attention_mask"][:, length:] = 0
    tail["labels"][:, length:] = 7  # not -100: the mask alone keeps them out
    with torch.no_grad():
        for batch in (ones, tail):
            got = trainer._parts(trainer.model, batch, 0.5)
            assert got.tokens == padded.tokens
            assert float(got.kd) == pytest.approx(float(padded.kd), rel=RTOL)
            assert float(got.ce) == pytest.approx(float(padded.ce), rel=RTOL)


def test_left_padded_rows_with_position_ids_are_not_packing(tmp_path):
    """Left-padded rows whose position_ids are the mask's cumulative sum (as for generation;
    the padding's positions restart) keep their mask and train as right-padded rows do: the
    last pad, whose next label is its sequence's first token, learns nothing."""
    data = hf_worker.items()
    trainer = trainer_for(tmp_path, hf_worker.student(), hf_worker.teacher(), ce_weight=0.5)
    right = KDCollator()(data)
    length = right["input_ids"].shape[1]
    left = {key: torch.zeros_like(value) for key, value in right.items()}
    left["labels"].fill_(-100)
    for b, item in enumerate(data):
        n = len(item["input_ids"])
        for key in ("input_ids", "attention_mask", "labels"):
            left[key][b, length - n:] = right[key][b, :n]
    left["position_ids"] = (left["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    left["position_ids"].masked_fill_(left["attention_mask"] == 0, 1)
    with torch.no_grad():
        want = trainer._parts(trainer.model, right, 0.5)
        got = trainer._parts(trainer.model, left, 0.5)
    assert got.tokens == want.tokens
    assert float(got.kd) == pytest.approx(float(want.kd), rel=1e-5)
    assert float(got.ce) == pytest.approx(float(want.ce), rel=1e-5)


# -- 2. the shift never crosses a boundary ---------------------------------------------------


@pytest.mark.parametrize("fused", [True, False])
def test_no_row_is_trained_on_the_next_sequences_first_token(tmp_path, fused):
    """A packed batch whose labels are the tokens everywhere (no -100 at the sequence starts,
    as a hand-made batch or DataCollatorWithFlattening(separator_id=<a token>) gives): the last
    row of a sequence learns nothing, for KD and CE, and the step's token count agrees."""
    data = [{"input_ids": item["input_ids"]} for item in hf_worker.items()]
    trainer = trainer_for(tmp_path, hf_worker.student(), hf_worker.teacher(), fused=fused,
                          ce_weight=0.5)
    padded_batch = KDCollator()(data)
    packed = KDCollator(padding_free=True)(data)
    packed["labels"] = packed["input_ids"].clone()
    separated = DataCollatorWithFlattening(separator_id=5)(data)
    with torch.no_grad():
        want = trainer._parts(trainer.model, padded_batch, 0.5)
        for batch in (packed, separated):
            got = trainer._parts(trainer.model, batch, 0.5)
            assert got.tokens == want.tokens == sum(len(item["input_ids"]) - 1 for item in data)
            assert float(got.kd) == pytest.approx(float(want.kd), rel=RTOL)
            assert float(got.ce) == pytest.approx(float(want.ce), rel=RTOL)
            assert int(trainer._get_num_items_in_batch([batch], "cpu")) == want.tokens


# -- 3. a training step ----------------------------------------------------------------------


def one_step(tmp_path, **options):
    """One SGD step over 2 accumulated micro-batches of 2: ``(parameters, logged kd)``."""
    model = hf_worker.student()
    trainer = trainer_for(tmp_path, model, hf_worker.teacher(), ce_weight=0.5,
                          train_dataset=hf_worker.items(), per_device_train_batch_size=2,
                          gradient_accumulation_steps=2, **options)
    trainer.train()
    kd = [entry["kd"] for entry in trainer.state.log_history if "kd" in entry]
    return {n: p.detach().clone() for n, p in model.named_parameters()}, kd


@pytest.fixture(scope="module")
def padded_step(tmp_path_factory):
    return one_step(tmp_path_factory.mktemp("padded"))


@pytest.mark.parametrize("how", ["padding_free", "flattening"])
def test_a_packed_step_equals_the_padded_step(padded_step, tmp_path, how):
    """KDConfig(padding_free=True), or DataCollatorWithFlattening given as the collator: the
    step moves the parameters as the padded run does, and logs the same KD."""
    options = ({"padding_free": True} if how == "padding_free"
               else {"data_collator": DataCollatorWithFlattening()})
    packed, kd_packed = one_step(tmp_path, **options)
    padded, kd_padded = padded_step
    before = {n: p.detach() for n, p in hf_worker.student().named_parameters()}
    update = max(float((padded[n] - before[n]).abs().max()) for n in padded)
    diff = max(float((packed[n] - padded[n]).abs().max()) for n in padded)
    assert update > 1e-3 and diff <= 1e-6, (diff, update)
    assert kd_packed == pytest.approx(kd_padded, rel=RTOL)


# -- 4. the offline store --------------------------------------------------------------------


def test_stored_rows_line_up_by_sequence(tmp_path):
    """KDCollator(padding_free=True, store=...): each sequence's stored rows lie where its
    tokens lie in the packed row, and the loss is the online padded loss."""
    pytest.importorskip("safetensors")
    from topkd.store import TeacherStore, TeacherStoreWriter

    data, teacher = hf_worker.items(), hf_worker.teacher()
    with TeacherStoreWriter(tmp_path / "store", k=K, vocab_size=V,
                            logprob_dtype="float32") as writer:
        for i, item in enumerate(data):
            ids = torch.tensor(item["input_ids"])
            with torch.no_grad():
                logits = teacher(input_ids=ids[None]).logits[0]
            writer.add(f"s{i}", ids, topkd.select_topk(logits, K))
    store = TeacherStore(tmp_path / "store")
    stored = [{**item, "sample_id": f"s{i}"} for i, item in enumerate(data)]
    batch = KDCollator(store=store, padding_free=True)(stored)
    start = 0
    for i, item in enumerate(data):
        n = len(item["input_ids"])
        want = store.get(f"s{i}")
        got = batch["teacher"]
        assert torch.equal(got.indices[0, start:start + n], want.indices)
        assert torch.equal(got.logprobs[0, start:start + n], want.logprobs)
        assert torch.equal(got.rest_logprob[0, start:start + n], want.rest_logprob)
        start += n
    assert start == batch["input_ids"].shape[1] and bool(batch["teacher"].mask.all())

    online = trainer_for(tmp_path / "on", hf_worker.student(), teacher, k=K, ce_weight=0.5)
    with torch.no_grad():
        want = online.compute_loss(online.model, KDCollator()(data))
        for fused in (True, False):
            offline = trainer_for(tmp_path / f"off{fused}", hf_worker.student(), store=store,
                                  fused=fused, ce_weight=0.5, padding_free=True)
            got = offline.compute_loss(offline.model, offline.data_collator(stored))
            assert float(got) == pytest.approx(float(want), rel=1e-5), fused


# -- 5. refused --------------------------------------------------------------------------------


@pytest.mark.parametrize("who", ["student", "teacher"])
def test_an_attention_that_lets_packed_sequences_meet_is_refused(tmp_path, who):
    """A model whose attention ignores the packed layout is refused at the first packed
    batch, its implementation named; padded batches still train with it."""
    models = {"student": hf_worker.student(), "teacher": hf_worker.teacher()}
    factory = hf_worker.student if who == "student" else hf_worker.teacher
    models[who] = factory(attn_implementation="causal_only")
    for fused in (True, False):
        trainer = trainer_for(tmp_path / str(fused), models["student"], models["teacher"],
                              fused=fused)
        data = hf_worker.items()
        with torch.no_grad():
            trainer._parts(trainer.model, KDCollator()(data), 0.0)
            with pytest.raises(ValueError, match=f"the {who} .*'causal_only'.* does not keep "
                               "packed sequences apart"):
                trainer._parts(trainer.model, DataCollatorWithFlattening()(data), 0.0)


def test_batches_that_cannot_be_made_right_are_refused(tmp_path):
    data = hf_worker.items()
    trainer = trainer_for(tmp_path, hf_worker.student(), hf_worker.teacher())
    packed = KDCollator(padding_free=True)(data)
    length = packed["input_ids"].shape[1]
    holes = {**packed, "attention_mask": torch.ones(1, length, dtype=torch.int64)}
    holes["attention_mask"][0, 3] = 0  # padding inside the row
    with pytest.raises(ValueError, match="attention_mask has zeros before real tokens"):
        trainer._parts(trainer.model, holes, 0.0)
    flat = DataCollatorWithFlattening(return_position_ids=False, return_seq_idx=True)(data)
    with pytest.raises(ValueError, match="no 'position_ids'"):
        trainer._parts(trainer.model, flat, 0.0)
    with pytest.raises(ValueError, match="shape"):
        trainer._parts(trainer.model, {**packed, "position_ids": packed["position_ids"][:, 1:]},
                       0.0)
    with pytest.raises(ValueError, match="pad_to_multiple_of"):
        KDCollator(padding_free=True, pad_to_multiple_of=8)
    with pytest.raises(ValueError, match="attention_mask has zeros"):
        KDCollator(padding_free=True)([{"input_ids": [3, 4, 5], "attention_mask": [1, 1, 0]}])


def test_an_error_in_a_packed_row_names_its_sample(tmp_path):
    data = [{**item, "sample_id": f"s{i}"} for i, item in enumerate(hf_worker.items())]
    data[2]["input_ids"] = [*data[2]["input_ids"][:-1], V + 5]
    trainer = trainer_for(tmp_path, hf_worker.student(), hf_worker.teacher())
    with pytest.raises(ValueError, match=r"batch row 0 \(sample id 's2'\), position 22"):
        trainer._parts(trainer.model, KDCollator(padding_free=True)(data), 0.0)
