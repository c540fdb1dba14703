"""Batches for :class:`~topkd.hf.KDTrainer`: padding, labels, and stored teacher rows."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..store import collate_teachers, require_keys
from ..teacher import SparseTeacher


def _sequence(item: dict, key: str) -> torch.Tensor:
    return torch.as_tensor(item[key], dtype=torch.int64).reshape(-1)


class KDCollator:
    """Right-pads dataset items into a batch and attaches the stored teacher rows.

    Items are dicts with ``input_ids`` (``[L_i]``) or, with a ``tokenizer``, a text field
    (``text_field``, tokenized as ``topkd store build`` and ``topkd distill`` tokenize:
    special tokens added, truncated to ``max_length``); optionally ``attention_mask`` and
    ``labels`` (``-100`` on tokens not to learn, e.g. a prompt; default: the tokens
    themselves), and with a ``store``: ``sample_id`` (or a ready ``teacher``
    :class:`~topkd.SparseTeacher` ``[L_i, K]``, as :class:`~topkd.store.TeacherDataset` gives).

    The batch: ``input_ids``, ``attention_mask`` and ``labels`` int64 ``[B, L]`` (padding is
    ``pad_token_id``, mask 0, label -100); ``sample_ids`` when the items have them; with a
    store, ``teacher`` ``[B, L, K]`` (each sequence's rows checked against its tokens' hash).

    ``padding_free=True`` packs the items instead, as ``transformers``'
    ``DataCollatorWithFlattening`` does: one row ``[1, sum L_i]`` of ``input_ids``, ``labels``
    (-100 at each sequence's first token) and ``position_ids`` (0, 1, ... for each sequence),
    no ``attention_mask``, and with a store ``teacher`` ``[1, sum L_i, K]``: each sequence's
    rows where its tokens are. No padding is computed; :class:`~topkd.hf.KDTrainer` passes the
    ``position_ids`` to the models and never trains a sequence's last row on the next one's
    first token.

    Alignment, the one rule: the row at position ``t`` predicts token ``t + 1``; the loss
    applies to row ``t`` where ``labels[t + 1] != -100`` (and, packed, where token ``t + 1``
    is in the same sequence). Stored rows follow the same rule.
    """

    def __init__(self, pad_token_id: int = 0, store=None, pad_to_multiple_of: int | None = None,
                 *, tokenizer=None, text_field: str = "text", max_length: int | None = None,
                 padding_free: bool = False):
        if padding_free and pad_to_multiple_of:
            raise ValueError("padding_free=True packs without padding: pad_to_multiple_of "
                             f"({pad_to_multiple_of}) does not apply")
        self.pad_token_id = int(pad_token_id)
        self.store = store
        self.multiple = pad_to_multiple_of
        self.tokenizer, self.text_field, self.max_length = tokenizer, text_field, max_length
        self.padding_free = bool(padding_free)

    def _with_ids(self, items: list) -> list:
        """The items, those that carry text but no ``input_ids`` tokenized (together)."""
        texts = [i for i, item in enumerate(items) if isinstance(item, Mapping)
                 and "input_ids" not in item and self.text_field in item]
        if not texts:
            return items
        if self.tokenizer is None:
            raise ValueError(f"KDTrainer's collator: item {texts[0]} has a {self.text_field!r} "
                             f"field but no 'input_ids', and there is no tokenizer to make "
                             f"them: pass processing_class=<the student's tokenizer>")
        from ..store.build import encode_texts

        encoded = encode_texts(self.tokenizer, [items[i][self.text_field] for i in texts],
                               self.max_length)
        items = list(items)
        for i, ids in zip(texts, encoded, strict=True):
            items[i] = {**items[i], "input_ids": ids}
        return items

    def __call__(self, items) -> dict:
        items = self._with_ids(list(items))
        keys = ("input_ids",) if self.store is None else ("input_ids", "sample_id")
        for item in items:
            require_keys(item, keys if "teacher" not in item else ("input_ids",),
                         "KDTrainer's collator")
        ids = [_sequence(item, "input_ids") for item in items]
        if self.padding_free:
            return self._packed(items, ids)
        length = max((len(s) for s in ids), default=0)
        if self.multiple:
            length = -(-length // self.multiple) * self.multiple
        batch = len(items)
        input_ids = torch.full((batch, length), self.pad_token_id, dtype=torch.int64)
        attention = torch.zeros((batch, length), dtype=torch.int64)
        labels = torch.full((batch, length), -100, dtype=torch.int64)
        for b, (item, seq) in enumerate(zip(items, ids, strict=True)):
            n = len(seq)
            for key in ("attention_mask", "labels"):  # before the copies below would fail
                if key in item and len(_sequence(item, key)) != n:
                    raise ValueError(f"KDCollator: item {b} has {n} input_ids but "
                                     f"{len(_sequence(item, key))} {key}")
            input_ids[b, :n] = seq
            attention[b, :n] = _sequence(item, "attention_mask") if "attention_mask" in item \
                else 1
            labels[b, :n] = _sequence(item, "labels") if "labels" in item else seq
        labels[attention == 0] = -100
        out = {"input_ids": input_ids, "attention_mask": attention, "labels": labels}
        if self.store is not None or any("sample_id" in item for item in items):
            out["sample_ids"] = [item.get("sample_id") for item in items]
        if self.store is not None:
            out["teacher"] = self._teachers(items, ids, length)
        return out

    def _packed(self, items, ids) -> dict:
        """The items as one row, each sequence's positions from 0."""
        labels, positions = [], []
        for b, (item, seq) in enumerate(zip(items, ids, strict=True)):
            n = len(seq)
            for key in ("attention_mask", "labels"):
                if key in item and len(_sequence(item, key)) != n:
                    raise ValueError(f"KDCollator: item {b} has {n} input_ids but "
                                     f"{len(_sequence(item, key))} {key}")
            if "attention_mask" in item and not bool((_sequence(item, "attention_mask")
                                                      == 1).all()):
                raise ValueError(f"KDCollator(padding_free=True): item {b}'s attention_mask has "
                                 f"zeros; a packed batch holds no padding (give each item its "
                                 f"real tokens only)")
            label = _sequence(item, "labels").clone() if "labels" in item else seq.clone()
            label[:1] = -100  # as DataCollatorWithFlattening: no row predicts a first token
            labels.append(label)
            positions.append(torch.arange(n, dtype=torch.int64))
        empty = torch.zeros(0, dtype=torch.int64)
        out = {"input_ids": torch.cat([empty, *ids])[None],
               "labels": torch.cat([empty, *labels])[None],
               "position_ids": torch.cat([empty, *positions])[None]}
        if self.store is not None or any("sample_id" in item for item in items):
            out["sample_ids"] = [item.get("sample_id") for item in items]
        if self.store is not None:
            rows = self._teachers(items, ids, None, collate=False)
            joined = SparseTeacher(*(torch.cat([getattr(t, name) for t in rows])
                                     for name in ("indices", "logprobs", "rest_logprob")),
                                   self.store.temperature, self.store.vocab_size) if rows \
                else None
            out["teacher"] = collate_teachers([] if joined is None else [joined],
                                              pad_to=out["input_ids"].shape[1],
                                              k=self.store.k, vocab_size=self.store.vocab_size,
                                              temperature=self.store.temperature)
            if joined is None:  # an empty batch: one row of length 0 all the same
                out["teacher"] = _one_row(out["teacher"])
        return out

    def _teachers(self, items, ids, length, collate: bool = True):
        teachers = []
        for item, seq in zip(items, ids, strict=True):
            teacher = item.get("teacher")
            if teacher is None:
                teacher = self.store.get(item["sample_id"], seq)
            if teacher.indices.shape[0] != len(seq):
                raise ValueError(f"sample {item.get('sample_id')!r}: {len(seq)} tokens but "
                                 f"{teacher.indices.shape[0]} stored teacher rows")
            teachers.append(teacher)
        if not collate:
            return teachers
        return collate_teachers(teachers, pad_to=length, k=self.store.k,
                                vocab_size=self.store.vocab_size,
                                temperature=self.store.temperature)


def _one_row(teacher: SparseTeacher) -> SparseTeacher:
    """A ``[0, 0, K]`` batch of teachers as ``[1, 0, K]``."""
    k = teacher.indices.shape[-1]
    return SparseTeacher(teacher.indices.reshape(1, 0, k), teacher.logprobs.reshape(1, 0, k),
                         teacher.rest_logprob.reshape(1, 0), teacher.temperature,
                         teacher.vocab_size, teacher.mask.reshape(1, 0))
