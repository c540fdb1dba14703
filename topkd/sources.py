"""Logits rows, chunk by chunk: from a tensor or from a fused LM head, and their gradients.

The losses treat every leading position as one row. A contiguous (or otherwise viewable)
tensor is flattened to ``[rows, V]`` as a view; a tensor whose leading dimensions cannot be
viewed as one (a transposed ``[s, b, v]`` tensor, say) is read one chunk of rows at a time
through advanced indexing, so only that chunk is ever copied. A fused LM head's logits are made
one chunk at a time by a matrix product and never exist whole.
"""

from __future__ import annotations

import math

import torch

from . import memory


class LogitsSource:
    """A ``[..., V]`` logits tensor read as ``[rows, V]``, one chunk of rows at a time."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self.lead_shape = tuple(tensor.shape[:-1])
        self.width = tensor.shape[-1]
        self.count = math.prod(self.lead_shape)
        self.device = tensor.device
        self.element_size = tensor.element_size()
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

    def low_chunk(self, start: int, stop: int, columns: int) -> torch.Tensor:
        """The first ``columns`` columns of rows ``[start, stop)`` in the logits' dtype."""
        return self.get(start, stop)[:, :columns]

    def slice(self, start: int, stop: int) -> LogitsSource:
        """Rows ``[start, stop)`` as a source of their own (a chunk copy if not viewable)."""
        return LogitsSource(self.get(start, stop))

    def gradient(self, needs_grad, backend=None) -> LogitsGradient:
        return LogitsGradient(self)


class LogitsGradient:
    """The gradient of a :class:`LogitsSource` tensor, written one chunk of rows at a time."""

    def __init__(self, source: LogitsSource):
        self.grad = torch.empty(source.tensor.shape, dtype=source.tensor.dtype,
                                device=source.device)
        self.chunk_dtype = self.grad.dtype  # what a gradient chunk may come in: no loss
        self._flat = self.grad.view(source.count, source.width)

    def destination(self, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of the gradient, for a backend to write a chunk into."""
        return self._flat[start:stop]

    def add(self, start: int, stop: int, grad_chunk: torch.Tensor, columns: int) -> None:
        """Set rows ``[start, stop)`` from ``grad_chunk`` (nothing to copy when it was written
        there); columns at or past ``columns`` (vocabulary padding) get zero."""
        rows = self._flat[start:stop]
        if grad_chunk.data_ptr() != rows.data_ptr() or grad_chunk.stride() != rows.stride():
            rows[:, :columns].copy_(grad_chunk[:, :columns])
        rows[:, columns:] = 0

    def finish(self, columns: int) -> None:
        """After the chunk loop, which skips a shard with no real columns."""
        if columns == 0:
            self.grad.zero_()

    def result(self) -> tuple[torch.Tensor]:
        return (self.grad,)


def product_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """The dtype the fused products run in: the lower precision of the inputs' (bfloat16 or
    float16 hidden states with a float32 weight, as under autocast, run in the 16-bit one)."""
    low = {d for d in dtypes if d != torch.float32}
    if len(low) > 1:
        raise TypeError(f"hidden and weight mix {sorted(str(d) for d in low)}; convert one, "
                        f"e.g. weight.to(hidden.dtype)")
    return low.pop() if low else torch.float32


class LinearSource:
    """Logits ``hidden @ weight.T + bias`` that never exist whole: one chunk of rows at a time.

    ``hidden`` ``[..., H]``, ``weight`` ``[V_r, H]``, ``bias`` ``[V_r]`` or ``None``. A chunk is
    computed by one matrix product in :func:`product_dtype` (as the unfused, autocast
    ``hidden @ weight.T`` is) and then widened to float32. An input in another dtype is
    converted once per call; ``inputs`` keeps the originals, whose dtypes the gradients take.
    """

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 stage_rows: int = 1):
        self.inputs = (hidden, weight, bias)
        dtype = product_dtype(hidden.dtype, weight.dtype)
        self.hidden, self.weight = hidden.to(dtype), weight.to(dtype)
        self.bias = None if bias is None else bias.to(dtype)
        self.stage_rows = stage_rows
        self.lead_shape = tuple(hidden.shape[:-1])
        self.count = math.prod(self.lead_shape)
        self.width = weight.shape[0]
        self.device = weight.device
        self.element_size = self.weight.element_size()
        self.flat_hidden = self.hidden.reshape(self.count, hidden.shape[-1])

    def low_chunk(self, start: int, stop: int, columns: int,
                  out: torch.Tensor | None = None) -> torch.Tensor:
        bias = None if self.bias is None else self.bias[:columns]
        return matmul(self.flat_hidden[start:stop], self.weight[:columns].T, out=out, bias=bias)

    def slice(self, start: int, stop: int) -> LinearSource:
        return LinearSource(self.flat_hidden[start:stop], self.weight, self.bias,
                            self.stage_rows)

    def gradient(self, needs_grad, backend) -> LinearGradient:
        return LinearGradient(self, *needs_grad, backend=backend, stage_rows=self.stage_rows)


def matmul(a: torch.Tensor, b: torch.Tensor, *, out: torch.Tensor | None = None,
           bias: torch.Tensor | None = None, add: bool = False) -> torch.Tensor:
    """``a @ b`` (``+ bias``), into ``out`` when given, or added to ``out`` (``add``): every
    matrix product of the fused losses, so that what one costs beyond its operands
    (:func:`topkd.memory.gemm_workspace`) is accounted for in one place."""
    if add:
        return out.addmm_(a, b)
    if bias is not None:
        return torch.addmm(bias, a, b, out=out) if out is not None else torch.addmm(bias, a, b)
    return torch.mm(a, b, out=out) if out is not None else torch.mm(a, b)


class Storage:
    """Reusable flat storage, viewed as a contiguous ``[rows, columns]`` tensor; grows on
    demand (its contents are then lost)."""

    def __init__(self, dtype: torch.dtype, device):
        self.dtype, self.device = dtype, device
        self.flat = torch.empty(0, dtype=dtype, device=device)

    def view(self, rows: int, columns: int) -> torch.Tensor:
        if self.flat.numel() < rows * columns:
            self.flat = None  # free the old storage before making the new
            self.flat = torch.empty(rows * columns, dtype=self.dtype, device=self.device)
        return self.flat[:rows * columns].view(rows, columns)

    def capacity(self, columns: int) -> int:
        """Rows of ``columns`` it holds without growing."""
        return self.flat.numel() // max(columns, 1)


class Scratch:
    """Work buffers reused by name across one call's chunks (a fresh buffer of tens of MiB
    costs its page faults on every chunk on a CPU: above 32 MiB glibc maps and unmaps each
    one). A backend stage that takes one may use it; None means fresh buffers."""

    def __init__(self):
        self._storage: dict[str, Storage] = {}

    def empty(self, name: str, rows: int, columns: int, dtype: torch.dtype,
              device) -> torch.Tensor:
        storage = self._storage.get(name)
        if storage is None or storage.dtype != dtype:
            storage = self._storage[name] = Storage(dtype, device)
        return storage.view(rows, columns)


def empty(scratch: Scratch | None, name: str, rows: int, columns: int, dtype: torch.dtype,
          device) -> torch.Tensor:
    """``scratch``'s buffer ``name``, or a new tensor without one."""
    if scratch is None:
        return torch.empty(rows, columns, dtype=dtype, device=device)
    return scratch.empty(name, rows, columns, dtype, device)


class BlockedSource:
    """A row source whose logits are made ``block_rows`` rows at a time and then read in
    smaller chunks: the matrix product of a fused LM head runs far faster over ~100+ rows than
    over the few rows a float32 work chunk can afford. Chunks must be requested in order.

    The blocks are made into one reused :class:`Storage`. For a one-pass loss (each chunk's
    gradient is made after the chunk is read) the same storage also stages the logits
    gradient (see :meth:`gradient`), so blocks and stage together take one buffer.
    """

    def __init__(self, source, block_rows: int):
        self.source, self.block_rows = source, max(1, block_rows)
        for name in ("count", "width", "device", "element_size", "lead_shape"):
            setattr(self, name, getattr(source, name))
        self._block = (0, 0, None)  # rows [first, last) of the held block, or no block
        self._storage = None
        self._sink = None

    def low_chunk(self, start: int, stop: int, columns: int) -> torch.Tensor:
        first, last, block = self._block
        if block is None or start < first or stop > last or block.shape[1] != columns:
            self._block = block = None  # no reference to the old block while refilling
            if self._sink is not None:
                self._sink.flush()  # the staged gradient lives in the storage we refill
            last = min(self.count, start + max(self.block_rows, stop - start))
            block = self._make(start, last, columns)
            first, self._block = start, (start, last, block)
        return block[start - first:stop - first]

    def _make(self, start: int, stop: int, columns: int) -> torch.Tensor:
        if not isinstance(self.source, LinearSource):
            return self.source.low_chunk(start, stop, columns)  # a view: nothing to make
        if self._storage is None:
            self._storage = Storage(self.source.weight.dtype, self.device)
        return self.source.low_chunk(start, stop, columns,
                                     out=self._storage.view(stop - start, columns))

    def slice(self, start: int, stop: int) -> LogitsSource:
        return LogitsSource(self.low_chunk(start, stop, self.width))

    def gradient(self, needs_grad, backend) -> LinearGradient:
        """The source's gradient, staged in this source's block storage: only for loops that
        are done reading each chunk before they add its gradient."""
        self._storage = Storage(self.source.weight.dtype, self.device)
        self._sink = LinearGradient(self.source, *needs_grad, backend=backend,
                                    stage=self._storage)
        return self._sink


class LinearGradient:
    """Gradients of :class:`LinearSource`' hidden states, weight and bias, accumulated chunk by
    chunk: hidden rows are written once; the weight's and bias's add into float32
    accumulators (the only full-size buffers), returned in the inputs' dtypes.

    Adding into the weight's accumulator reads and writes all of it, and a product over few
    rows runs far below the machine's speed, so the logits gradient is staged for
    ``stage_rows`` rows (in the weight's dtype) and turned into both gradients by one product
    each per stage rather than per chunk.
    """

    def __init__(self, source: LinearSource, need_hidden: bool, need_weight: bool,
                 need_bias: bool, backend, stage_rows: int = 1, stage: Storage | None = None):
        self.source = source
        self.backend = backend  # its accumulator adds the weight's product tiles
        # a gradient chunk in the weight's dtype loses nothing (the products round to it);
        # the bias's sum is taken in float32
        self.chunk_dtype = torch.float32 if need_bias else source.weight.dtype
        h, w = source.flat_hidden, source.weight
        self.hidden = torch.zeros_like(h) if need_hidden else None
        self.weight = torch.zeros(w.shape, dtype=torch.float32, device=w.device) \
            if need_weight else None
        self.bias = torch.zeros(w.shape[0], dtype=torch.float32, device=w.device) \
            if need_bias else None
        self._stage = None
        if need_weight or need_hidden:
            if stage is not None:
                self._stage = stage
            elif stage_rows > 1:
                self._stage = Storage(w.dtype, w.device)
                self._stage.view(min(stage_rows, source.count), w.shape[0])
        self._staged = (0, 0)  # rows [first, first + count) are in the stage
        self._columns = w.shape[0]

    def destination(self, start: int, stop: int) -> None:
        """None: a chunk's gradient is staged (or multiplied out) by :meth:`add`, and a stage
        shared with :class:`BlockedSource` holds the very logits being read."""
        return None

    def add(self, start: int, stop: int, grad_chunk: torch.Tensor, columns: int) -> None:
        """Add the contribution of logits gradient rows ``[start, stop)`` (columns at
        or past ``columns`` are vocabulary padding, whose gradient is zero). Chunks arrive in
        row order; a stage shared with :class:`BlockedSource` only ever receives rows at or
        before the block position of the chunk just read, which is consumed."""
        grad = grad_chunk[:, :columns]
        self._columns = columns
        if self.bias is not None:
            self.bias[:columns] += grad.sum(0)
        count, capacity = stop - start, 0 if self._stage is None else self._stage.capacity(columns)
        if count > capacity:
            self.flush()
            self._add_products(start, grad.to(self.source.weight.dtype))
            return
        first, staged = self._staged
        if staged + count > capacity:
            self.flush()
            first, staged = start, 0
        self._stage.view(staged + count, columns)[staged:].copy_(grad)  # in the weight's dtype
        self._staged = (first if staged else start, staged + count)

    def flush(self) -> None:
        first, staged = self._staged
        if staged:
            self._add_products(first, self._stage.view(staged, self._columns))
        self._staged = (0, 0)

    def _add_products(self, start: int, grad_low: torch.Tensor) -> None:
        """The hidden rows' and weight's gradients from logits gradient rows ``[start,
        start + len(grad_low))`` in the weight's dtype: one product each, over many rows."""
        source, columns = self.source, grad_low.shape[1]
        if self.hidden is not None:
            matmul(grad_low, source.weight[:columns],
                   out=self.hidden[start:start + grad_low.shape[0]])
        if self.weight is None:
            return
        hidden = source.flat_hidden[start:start + grad_low.shape[0]]
        if grad_low.dtype == torch.float32:
            matmul(grad_low.T, hidden, out=self.weight[:columns], add=True)
            return
        count = grad_low.shape[0]
        if count >= memory.ROUNDED_PRODUCT_ROWS:
            # A product over a whole stage runs at the dtype's full speed; rounding its output
            # once per stage costs far less than the bf16 rounding of the logits gradient
            # itself, which the unfused path has too. Its output goes through two tile
            # buffers made once per stage (fresh tile-sized tensors cost a quarter of the time
            # here), of at most half the stage's bytes and freed at once, like the work chunks
            # they share the budget with.
            tile = memory.weight_tile_rows(count, columns, hidden.shape[1])
            low = hidden.new_empty(tile, hidden.shape[1])
            add_ = self.backend.accumulator(low)
            for lo in range(0, columns, tile):
                hi = min(columns, lo + tile)
                add_(self.weight[lo:hi], matmul(grad_low[:, lo:hi].T, hidden, out=low[:hi - lo]))
            return
        # Over few rows that rounding would be per row: run the products in float32 instead
        # (a float32 tile is at most a quarter of the stage's bytes: the stage may be a whole
        # block, most of the budget).
        hidden = hidden.float()
        tile = memory.float32_tile_rows(columns, grad_low.element_size())
        for lo in range(0, columns, tile):
            hi = min(columns, lo + tile)
            matmul(grad_low[:, lo:hi].T.float(), hidden, out=self.weight[lo:hi], add=True)

    def finish(self, columns: int) -> None:
        """After the chunk loop: add what is still staged, and drop the stage."""
        self.flush()
        self._stage = None

    def accumulators(self) -> tuple:
        """The gradients of (hidden, weight, bias) as accumulated (None where not needed)."""
        return self.hidden, self.weight, self.bias

    def result(self) -> tuple:
        """The gradients in the inputs' dtypes and shapes; a float32 accumulator is returned as
        it is when its input is float32."""
        return tuple(None if acc is None else acc.to(like.dtype).view(like.shape)
                     for acc, like in zip(self.accumulators(), self.source.inputs, strict=True))
