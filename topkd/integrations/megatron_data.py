"""Offline distillation in Megatron: a topkd store's teacher rows in Megatron's batches.

Megatron's samplers hand the dataset global sample indices (``MegatronPretrainingSampler``:
``consumed_samples`` onward, each data-parallel rank its slice of every global batch), and its
``GPTDataset`` builds sample ``i`` deterministically from its index files. A store whose
sample id is that global index (built once by running the teacher over ``dataset[i]["tokens"]``
for every ``i``) therefore gives every sample its teacher rows, whatever the data-parallel
size, the resume point or the worker count. :class:`WithTeacherRows` adds them to each sample as
plain tensors, which Megatron's loader collates with its default ``collate_fn`` and its
``get_batch`` broadcasts to the other tensor-parallel ranks like the tokens;
:func:`teacher_from_batch` makes the :class:`~topkd.SparseTeacher` ``[b, s, K]`` that
:func:`topkd.integrations.megatron.sparse_kl_loss` takes.

Nothing here imports megatron-core: it runs in the data loader's workers.
"""

from __future__ import annotations

import torch

from ..teacher import SparseTeacher

TEACHER_KEYS = ("teacher_indices", "teacher_logprobs", "teacher_rest_logprob")


class WithTeacherRows(torch.utils.data.Dataset):
    """A map-style dataset whose items (dicts, as Megatron's ``GPTDataset`` gives) gain their
    stored teacher rows: ``teacher_indices`` int32 ``[s, K]`` (``-1`` in unused slots),
    ``teacher_logprobs`` float32 ``[s, K]``, ``teacher_rest_logprob`` float32 ``[s]``.

    Args:
        dataset: indexed by the global sample index; ``dataset[i][tokens_key]`` is the
            ``[s]`` token ids the student sees (and the teacher saw).
        store: a :class:`topkd.store.TeacherStore` whose sample ids are those indices (int).
        tokens_key: the item's token ids; their hash is checked against the store's, so a
            store row never meets tokens it was not computed from (``None``: no check).

    Indices are int32 (any vocabulary below 2^31: half the bytes of int64 in the batch and in
    the tensor-parallel broadcast); :func:`teacher_from_batch` widens them.
    """

    def __init__(self, dataset, store, *, tokens_key: str | None = "tokens"):
        self.dataset, self.store, self.tokens_key = dataset, store, tokens_key

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index):
        item = dict(self.dataset[index])
        tokens = None if self.tokens_key is None else item[self.tokens_key]
        teacher = self.store.get(int(index), input_ids=tokens)
        length = teacher.indices.shape[0]
        if tokens is not None and len(tokens) != length:
            raise ValueError(f"sample {int(index)}: {len(tokens)} tokens but {length} stored "
                             f"teacher rows")
        item["teacher_indices"] = teacher.indices.to(torch.int32)
        item["teacher_logprobs"] = teacher.logprobs
        item["teacher_rest_logprob"] = teacher.rest_logprob
        return item


def teacher_from_batch(batch: dict, *, vocab_size: int, temperature: float,
                       device=None) -> SparseTeacher:
    """The :class:`~topkd.SparseTeacher` ``[b, s, K]`` of a collated batch of
    :class:`WithTeacherRows` items (``vocab_size`` and ``temperature``: the store's, e.g.
    ``store.vocab_size``, ``store.temperature``), on ``device`` if given."""
    missing = [key for key in TEACHER_KEYS if key not in batch]
    if missing:
        raise KeyError(f"the batch has no {', '.join(missing)}: wrap the dataset in "
                       f"WithTeacherRows (and broadcast these keys to every tensor-parallel "
                       f"rank with the tokens); its keys are {sorted(batch)}")
    indices, logprobs, rest = (batch[key] for key in TEACHER_KEYS)
    if device is not None:
        indices, logprobs, rest = (t.to(device, non_blocking=True)
                                   for t in (indices, logprobs, rest))
    return SparseTeacher(indices.long(), logprobs.float(), rest.float(), float(temperature),
                         int(vocab_size))
