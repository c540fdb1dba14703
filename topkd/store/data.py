"""Offline KD in a training loop: a Dataset pairing tokens with their stored teacher, and its
collate function."""

from __future__ import annotations

import torch

from .reader import TeacherStore, collate_teachers


class TeacherDataset(torch.utils.data.Dataset):
    """Each item of ``samples`` with its stored teacher, checked against its tokens.

    Args:
        store: a :class:`TeacherStore`, or its path.
        samples: a sequence (a list, a map-style dataset) of ``(sample_id, input_ids)`` pairs or
            of mappings with ``"sample_id"`` and ``"input_ids"`` (other keys are kept).

    An item is a dict with ``"sample_id"``, ``"input_ids"`` (int64 ``[L]``), ``"teacher"`` (a
    :class:`~topkd.SparseTeacher` ``[L, K]``) and the sample's other keys. The token hash is
    checked on every read, so misaligned data fails at the first batch.
    """

    def __init__(self, store, samples):
        self.store = store if isinstance(store, TeacherStore) else TeacherStore(store)
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict:
        sample = self.samples[index]
        if isinstance(sample, dict):
            item = dict(sample)
        else:
            sample_id, input_ids = sample
            item = {"sample_id": sample_id, "input_ids": input_ids}
        item["input_ids"] = torch.as_tensor(item["input_ids"], dtype=torch.int64)
        item["teacher"] = self.store.get(item["sample_id"], item["input_ids"])
        return item


def collate(items, *, pad_to: int | None = None, pad_token_id: int = 0) -> dict:
    """Batch :class:`TeacherDataset` items: ``input_ids`` int64 ``[B, L]`` (right-padded with
    ``pad_token_id``), ``attention_mask`` int64 ``[B, L]``, ``teacher`` a
    :class:`~topkd.SparseTeacher` ``[B, L, K]`` whose ``mask`` drops the padding in the loss,
    and ``sample_ids``. Use ``functools.partial(collate, pad_to=...)`` for a fixed length."""
    items = list(items)
    teacher = collate_teachers([item["teacher"] for item in items], pad_to=pad_to)
    batch, length = teacher.indices.shape[:2]
    input_ids = torch.full((batch, length), pad_token_id, dtype=torch.int64)
    for b, item in enumerate(items):
        input_ids[b, : len(item["input_ids"])] = item["input_ids"]
    return {"sample_ids": [item["sample_id"] for item in items], "input_ids": input_ids,
            "attention_mask": teacher.mask.long(), "teacher": teacher}
