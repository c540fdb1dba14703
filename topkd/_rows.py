"""Row access for ``[..., V]`` tensors, chunk by chunk, without a full copy.

The losses treat every leading position as one row. A contiguous (or otherwise viewable)
tensor is flattened to ``[rows, V]`` as a view; a tensor whose leading dimensions cannot be
viewed as one (a transposed ``[s, b, v]`` tensor, say) is read and written one chunk of rows at
a time through advanced indexing, so only that chunk is ever copied.
"""

from __future__ import annotations

import math

import torch

# Work buffers are float32 rows of V (+1 spare) entries; the default chunk is the smaller of this
# and 1/16 of the logits, so the loop's temporaries stay a small fraction of one logits copy
# at every size (see README, "Choosing chunk_bytes").
DEFAULT_CHUNK_BYTES = 64 * 2**20
_DEFAULT_FRACTION = 16


class Rows:
    """A ``[..., V]`` tensor read as ``[rows, V]``, one chunk of rows at a time."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self.lead_shape = tuple(tensor.shape[:-1])
        self.width = tensor.shape[-1]
        self.count = math.prod(self.lead_shape)
        try:
            self._flat = tensor.view(self.count, self.width)
        except RuntimeError:
            self._flat = None

    def get(self, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)``: a view when the tensor flattens as one, else a chunk copy."""
        if self._flat is not None:
            return self._flat[start:stop]
        flat = torch.arange(start, stop, device=self.tensor.device)
        return self.tensor[torch.unravel_index(flat, self.lead_shape)]

    def float_chunk(self, start: int, stop: int, columns: int, spare: int = 0) -> torch.Tensor:
        """A new float32 ``[stop - start, columns + spare]`` buffer holding the first
        ``columns`` columns of the rows (the spare columns are left uninitialized)."""
        out = torch.empty(stop - start, columns + spare, dtype=torch.float32,
                          device=self.tensor.device)
        out[:, :columns].copy_(self.get(start, stop)[:, :columns])
        return out


def budget_bytes(chunk_bytes: int | None, rows: int, width: int, element_bytes: int) -> int:
    """``chunk_bytes``, or by default ``min(64 MiB, logits bytes / 16)`` for logits of
    ``rows x width`` elements of ``element_bytes`` each."""
    if chunk_bytes is None:
        return min(DEFAULT_CHUNK_BYTES, rows * width * element_bytes // _DEFAULT_FRACTION)
    return int(chunk_bytes)


def chunk_rows(chunk_bytes: int | None, width: int, rows: int, element_bytes: int,
               buffers: int = 1) -> int:
    """Rows per chunk so that ``buffers`` float32 work buffers of ``width`` columns fit in
    the budget (:func:`budget_bytes`) together. Always at least one row."""
    budget = budget_bytes(chunk_bytes, rows, width, element_bytes)
    return max(1, budget // (4 * max(width, 1) * buffers))


def row_chunks(rows: int, per_chunk: int):
    """``(start, stop)`` pairs covering ``range(rows)``."""
    for start in range(0, rows, per_chunk):
        yield start, min(rows, start + per_chunk)
