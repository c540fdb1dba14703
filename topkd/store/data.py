"""Offline KD in a training loop: a Dataset pairing tokens with their stored teacher, and its
collate function."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from .reader import TeacherStore
from .rows import collate_any


def require_keys(item, keys: Iterable[str], where: str = "a dataset item") -> None:
    """Raise a ValueError unless the mapping ``item`` has every key of ``keys``, naming the
    missing ones, the keys it has and the usual fix; a TypeError if it is not a mapping.

    ``where`` says who asks (e.g. ``"KDTrainer's collator"``). Collators call this before
    reading the columns they need, so a dropped column is reported as such rather than as a
    bare KeyError deep in the batch code.
    """
    keys = tuple(keys)
    if not isinstance(item, Mapping):
        raise TypeError(f"{where}: expected a mapping with keys {list(keys)}, got "
                        f"{type(item).__name__}")
    missing = [key for key in keys if key not in item]
    if not missing:
        return
    names = ", ".join(repr(key) for key in missing)
    raise ValueError(
        f"{where}: the item has no {names} (its keys: {sorted(map(str, item))}); each item "
        f"needs {list(keys)}. Check the dataset's column names; with a transformers Trainer "
        f"pass remove_unused_columns=False, since with True it drops every column the model's "
        f"forward does not take ({names} among them)")


class TeacherDataset(torch.utils.data.Dataset):
    """Token sequences with their stored teachers, checked against each other.

    Args:
        store: a :class:`TeacherStore`, or its path.
        samples: a sequence (a list, a map-style dataset) of ``(sample_id, input_ids)`` pairs or
            of mappings with ``"sample_id"`` and ``"input_ids"`` (other keys are kept). None
            (default): every sample of the store, in :meth:`TeacherStore.ids` order, with the
            token ids stored with it (the store must have them: ``store_tokens``).

    An item is a dict with ``"sample_id"``, ``"input_ids"`` (int64 ``[L]``), ``"teacher"`` (a
    :class:`~topkd.SparseTeacher` ``[L, K]``) and the sample's other keys. Given tokens are
    checked against the stored token hash on every read, so misaligned data fails at the first
    batch; stored tokens are checked against it too (when the store verifies reads). The
    dataset pickles to ``DataLoader`` workers.
    """

    def __init__(self, store, samples=None):
        self.store = store if isinstance(store, TeacherStore) else TeacherStore(store)
        self.samples = samples
        self._ids = None
        if samples is None:
            self._ids = self.store.ids()
            if self._ids and not self.store.store_tokens:
                self.store.tokens(self._ids[0])  # raises its error now, not at the first batch

    def __len__(self) -> int:
        return len(self._ids) if self.samples is None else len(self.samples)

    def __getitem__(self, index: int) -> dict:
        if self.samples is None:
            sample_id = self._ids[index]
            input_ids = self.store.tokens(sample_id)
            # (the tokens were just checked against the token hash: no need to hash again)
            return {"sample_id": sample_id, "input_ids": input_ids,
                    "teacher": self.store.get(sample_id)}
        sample = self.samples[index]
        if isinstance(sample, Mapping):
            require_keys(sample, ("sample_id", "input_ids"), f"TeacherDataset sample {index}")
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
    for item in items:
        require_keys(item, ("sample_id", "input_ids", "teacher"), "topkd.store.collate")
    teacher = collate_any([item["teacher"] for item in items], pad_to=pad_to)
    batch, length = teacher.indices.shape[:2]
    input_ids = torch.full((batch, length), pad_token_id, dtype=torch.int64)
    for b, item in enumerate(items):
        input_ids[b, : len(item["input_ids"])] = item["input_ids"]
    return {"sample_ids": [item["sample_id"] for item in items], "input_ids": input_ids,
            "attention_mask": teacher.mask.long(), "teacher": teacher}
