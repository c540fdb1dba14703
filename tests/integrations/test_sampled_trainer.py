"""KDTrainer from sampled teacher rows (RS-KD): the loss equals the float64 sampled loss on
the same rows, fused and unfused; a step trains; settings that cannot apply are refused."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import hf_worker  # noqa: E402
import reference as ref  # noqa: E402

import topkd  # noqa: E402
from topkd.hf import KDTrainer  # noqa: E402
from topkd.store.rows import TeacherRows, collate_sampled, sampled_row_bytes, trimmed  # noqa: E402

N = 12


def sampled_rows(teacher, data, seed=0):
    rows, tokens = {}, {}
    for i, item in enumerate(data):
        ids = torch.tensor(item["input_ids"])
        with torch.no_grad():
            logits = teacher(input_ids=ids[None]).logits.float()
        drawn = topkd.sample_teacher(logits, N, seed=seed, sample_ids=[f"s{i}"])
        rows[f"s{i}"] = trimmed(drawn.map(lambda t: t[0]))
        tokens[f"s{i}"] = ids
    return TeacherRows(rows, tokens)


@pytest.fixture(scope="module")
def setup():
    data = hf_worker.items()
    store = sampled_rows(hf_worker.teacher(), data)
    stored = [{**item, "sample_id": f"s{i}"} for i, item in enumerate(data)]
    return data, store, stored


def reference(student, store, data):
    """float64: the sampled loss summed over the learned rows of each item, over their count."""
    total, count = 0.0, 0
    for i, item in enumerate(data):
        ids = torch.tensor(item["input_ids"])
        keep = torch.tensor(item["labels"])[1:] != -100
        with torch.no_grad():
            logits = student.double()(input_ids=ids[None]).logits[0, :-1][keep]
        student.float()
        rows = store.get(f"s{i}")
        total += float(ref.sampled_loss(logits, rows.indices[:-1][keep], rows.counts[:-1][keep],
                                        N, logq=rows.logprobs[:-1][keep], reduction="sum"))
        count += int(keep.sum())
    return total / count


@pytest.mark.parametrize("fused", [True, False])
def test_sampled_rows_give_the_reference_loss(setup, tmp_path, fused):
    data, store, stored = setup
    trainer = KDTrainer(model=hf_worker.student(), store=store,
                        args=hf_worker.config(tmp_path, fused=fused, impl="eager"))
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model,
                                    trainer._prepare_inputs(trainer.data_collator(stored)))
    assert float(loss) == pytest.approx(reference(hf_worker.student(), store, data), rel=1e-5)
    # one step through the dataloader, collator and accumulation
    trainer = KDTrainer(model=hf_worker.student(), store=store, train_dataset=stored,
                        args=hf_worker.config(tmp_path / "step", fused=fused, impl="eager",
                                              per_device_train_batch_size=2,
                                              gradient_accumulation_steps=2))
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(),
                                                      strict=True))


@pytest.mark.parametrize("setting,match", [(dict(k=8), "k=8"), (dict(top_p=0.9), "top_p"),
                                           (dict(divergence="jsd"), "divergence"),
                                           (dict(normalize="topk"), "normalize")])
def test_sampled_rows_refuse_top_k_settings(setup, tmp_path, setting, match):
    _, store, _ = setup
    with pytest.raises(ValueError, match=match):
        KDTrainer(model=hf_worker.student(), store=store,
                  args=hf_worker.config(tmp_path, **setting))


def test_collate_and_bytes(setup):
    _, store, _ = setup
    a, b = store.get("s0"), store.get("s3")
    batch = collate_sampled([a, b])
    length = max(a.indices.shape[0], b.indices.shape[0])
    assert batch.indices.shape == (2, length, max(a.k, b.k))
    assert batch.mask.sum() == a.indices.shape[0] + b.indices.shape[0]
    assert torch.equal(batch.counts[~batch.mask], torch.zeros_like(batch.counts[~batch.mask]))
    assert torch.equal(batch.counts.sum(-1)[batch.mask],
                       torch.full((int(batch.mask.sum()),), N, dtype=batch.counts.dtype))
    entries = int((a.counts > 0).sum())
    assert sampled_row_bytes(a) == entries * 5 + a.indices.shape[0] * 5


def test_packed_batches_give_the_padded_loss(setup, tmp_path):
    """KDCollator(padding_free=True) with sampled rows: each sequence's rows where its tokens
    lie, and the padded batch's loss."""
    from topkd.hf import KDCollator

    data, store, stored = setup
    batch = KDCollator(store=store, padding_free=True)(stored)
    start = 0
    for i, item in enumerate(data):
        n, want = len(item["input_ids"]), store.get(f"s{i}")
        got = batch["teacher"]
        assert torch.equal(got.indices[0, start:start + n, :want.k], want.indices)
        assert torch.equal(got.counts[0, start:start + n, :want.k], want.counts)
        start += n
    losses = []
    for packed in (False, True):
        trainer = KDTrainer(model=hf_worker.student(), store=store,
                            args=hf_worker.config(tmp_path / str(packed), padding_free=packed,
                                                  impl="eager"))
        with torch.no_grad():
            losses.append(float(trainer.compute_loss(trainer.model,
                                                     trainer.data_collator(stored))))
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)


def test_a_sampled_store_trains_as_its_rows(setup, tmp_path):
    """KDTrainer(store=<a sampled store on disk>): the loss the same rows give in memory
    (without the teacher's log-probs, which the store does not keep)."""
    pytest.importorskip("safetensors")
    from topkd.store import TeacherStoreWriter

    data, store, stored = setup
    path = tmp_path / "store"
    rows = {}
    with TeacherStoreWriter(path, samples=N, vocab_size=hf_worker.V) as writer:
        for i, item in enumerate(data):
            rows[f"s{i}"] = store.get(f"s{i}").map(lambda t: t)  # (logprobs dropped below)
            rows[f"s{i}"].logprobs = None
            writer.add(f"s{i}", item["input_ids"], rows[f"s{i}"])
    losses = []
    for source in (path, TeacherRows(rows)):
        trainer = KDTrainer(model=hf_worker.student(), store=source,
                            args=hf_worker.config(tmp_path / str(len(losses)), impl="eager"))
        with torch.no_grad():
            losses.append(float(trainer.compute_loss(trainer.model,
                                                     trainer.data_collator(stored))))
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    with pytest.raises(ValueError, match="divergence"):
        KDTrainer(model=hf_worker.student(), store=path,
                  args=hf_worker.config(tmp_path / "jsd", divergence="jsd"))
