"""The memory policy: every chunk size, block size and buffer count of the package.

The rule, written once:

- **A chunk budget.** ``chunk_bytes`` (the user's), or by default ``min(64 MiB, max(1 MiB,
  logits bytes / 16))``: the work buffers of one chunk of rows stay a small fraction of one
  logits copy at every size, and at a few MiB of logits the per-chunk overhead, not memory,
  is what a smaller chunk would change (:func:`budget_bytes`).
- **Rows per chunk** = the budget over the bytes of the float32 work buffers one row needs
  at once: ``buffers`` rows of the widest shard's width + 1 spare column (:func:`chunk_rows`),
  the same on every rank (the statistics are combined chunk by chunk). How many buffers a
  chunk holds depends on the backend and the path (:func:`work_buffers`): a backend that
  widens each chunk into float32 (eager) holds the path's buffers; one that reads the chunk
  in its own dtype (compiled) holds only the gradient chunk. A backend may need chunks of a
  least height (:func:`least_rows`).
- **The teacher's selection** runs before the student's gradient exists: four times the
  budget for the logits losses, once for the fused ones (:data:`SELECT_FACTOR`); on a CPU a
  chunk of teacher logits is also kept cache-sized (:data:`SELECT_CACHE_BYTES`), since the
  selection reads it several times.
- **The fused losses** share ``min(512 MiB, max(64 MiB, logits bytes / 5))`` minus what one
  matrix product allocates while it runs (:func:`gemm_workspace`): a fifth for the float32
  work chunks (at least three buffers), the rest for the blocks of logits, which also hold
  the gradient stage (:func:`fused_rows`); the teacher's selection of a one-pass loss takes
  the work chunks' share between them (:func:`fused_select`). The 64 MiB floor
  (:data:`FUSED_MIN_BYTES`) is set by the work, not the memory: below it the chunks and blocks
  get so short that their fixed cost decides the time (512 tokens, V = 32,000: work chunks of
  two rows, 2.4-2.9x the unfused loss's time on an AVX-512 CPU). So the fused peak is at most
  0.25x the logits from 320 MiB of logits up (V = 248,320: from 676 tokens) and at most about
  64 MiB below. Logits of at most 4 MiB (the logits losses' least selection budget) run as
  one block and one chunk.
"""

from __future__ import annotations

import torch

from .divergences import KL, TVD, ReverseKL

# ---- the chunk budget ----------------------------------------------------------------------

DEFAULT_CHUNK_BYTES = 64 * 2**20
_DEFAULT_FRACTION = 16
MIN_CHUNK_BYTES = 2**20


def budget_bytes(chunk_bytes: int | None, count: int, width: int, element_bytes: int) -> int:
    """``chunk_bytes``, or by default ``min(64 MiB, max(1 MiB, logits bytes / 16))`` for
    logits of ``count x width`` elements of ``element_bytes`` each."""
    if chunk_bytes is None:
        fraction = count * width * element_bytes // _DEFAULT_FRACTION
        return min(DEFAULT_CHUNK_BYTES, max(MIN_CHUNK_BYTES, fraction))
    return int(chunk_bytes)


def chunk_rows(chunk_bytes: int | None, width: int, count: int, element_bytes: int,
               buffers: int = 1) -> int:
    """Rows per chunk so that ``buffers`` float32 work buffers of ``width`` columns fit in
    the budget (:func:`budget_bytes` of ``count x width`` logits) together. At least one."""
    budget = budget_bytes(chunk_bytes, count, width, element_bytes)
    return max(1, budget // (4 * max(width, 1) * buffers))


def least_rows(per: int, backend) -> int:
    """``per`` raised to the backend's least chunk height (the compiled kernels take two rows
    or more: see :mod:`topkd.backends.compiled`)."""
    return max(per, backend.least_rows)


def row_chunks(count: int, per_chunk: int):
    """``(start, stop)`` pairs covering ``range(count)``."""
    for start in range(0, count, per_chunk):
        yield start, min(count, start + per_chunk)


# ---- buffers per path and backend ------------------------------------------------------------

# Float32 chunk-sized buffers the eager full-vocabulary passes hold at once, (forward,
# backward), by divergence: generically the two chunks, their exponentials and the three that
# the divergence's terms make; KL's centered passes the two chunks (exponentials in place)
# and w - o; reverse KL keeps a - b for the gradient too; TVD's terms make one fewer.
_DENSE_GENERIC = (7, 7)


def _dense_buffers(divergence) -> tuple[int, int]:
    if isinstance(divergence, KL):
        return (3, 2)
    if isinstance(divergence, ReverseKL):
        return (4, 4)
    if isinstance(divergence, TVD):
        return (6, 6)
    return _DENSE_GENERIC


def work_buffers(cfg, sparse: bool, labels, backward: bool = False) -> int:
    """Float32 ``[rows, width + 1]`` buffers one chunk of a call holds at once.

    ``cfg``: the call's :class:`~topkd.engine.Config` (its backend, divergence, temperature,
    softcap). A backend that reads chunks in their own dtype holds the gradient chunk only;
    one that widens them holds the path's buffers, plus one for the CE's own normalizer (labels
    at T != 1) and one for a softcap's derivative."""
    backend = cfg.backend.runner(cfg.divergence, sparse)
    if not backend.widens_chunks:
        return 1
    extra = (labels is not None and cfg.temperature != 1.0) + (cfg.softcap is not None)
    if sparse:
        return 1 + extra
    return _dense_buffers(cfg.divergence)[backward] + extra


def logits_rows(cfg, sparse: bool, labels, chunk_bytes, count: int, widest: int,
                element_size: int) -> tuple[int, int]:
    """``(forward rows per chunk, backward rows per chunk)`` of a logits loss, from numbers
    every rank shares: :func:`work_buffers` float32 rows of the widest shard (+1 spare
    column) within the budget, raised to the backend's least height."""
    return tuple(least_rows(chunk_rows(chunk_bytes, widest + 1, count, element_size,
                                       work_buffers(cfg, sparse, labels, backward)),
                            cfg.backend)
                 for backward in (False, True))


# ---- the teacher's selection -----------------------------------------------------------------

SELECT_FACTOR = 4  # logits losses: the selection runs before the student's gradient exists
FUSED_SELECT_FACTOR = 1  # the fused losses' whole budget is small
_CANDIDATE_BYTES = 24  # per candidate of a merge block: float32 value, int32 index, gathered
# On a CPU the selection reads each chunk of teacher logits three times (its sample, the scan,
# the candidates' values) and, eagerly, its float32 copy several more: a chunk of at most this
# many bytes in its own dtype stays in the last-level cache between them. Measured on a 2-core
# Intel Xeon (V = 248,320, bf16, K = 4,096, 1,024 rows; docs/benchmarks.md): the compiled
# selection about 0.67 s at 128 rows per chunk (its budget's), 0.60 at 64, 0.58 at 32, 0.57 at
# 16, 0.60 at 8; the eager one 1.13 s at 128, 0.97-1.12 at 64 (its budget's), 0.75-0.81 at 32,
# 0.73-0.75 at 16. Not on a GPU (fewer, larger launches pay there) nor in a fused loss (its
# selection's budget is already a small share, and its teacher chunks are mostly matrix
# products, which want height).
SELECT_CACHE_BYTES = 8 * 2**20


def select_rows(chunk_bytes, count: int, valid: int, element_size: int, fused: bool,
                backend, device_type: str) -> int:
    """Rows per chunk of the teacher's selection: its float32 buffers of the ``valid`` columns
    within :data:`SELECT_FACTOR` (fused: :data:`FUSED_SELECT_FACTOR`) times the budget. A
    backend that widens the chunk holds it and, about as large again, its mask and candidates;
    one that reads the chunk in its own dtype holds a byte per entry and the candidates, a
    buffer in all. On a CPU (``device_type``), a logits chunk is also kept within
    :data:`SELECT_CACHE_BYTES`."""
    factor = FUSED_SELECT_FACTOR if fused else SELECT_FACTOR
    per = chunk_rows(factor * budget_bytes(chunk_bytes, count, valid, element_size), valid,
                     count, 4, buffers=2 if backend.widens_chunks else 1)
    if device_type == "cpu" and not fused:
        per = min(per, max(1, SELECT_CACHE_BYTES // (element_size * max(valid, 1))))
    return least_rows(per, backend)


def merge_rows(chunk_bytes, count: int, total: int, ranks: int, k: int, element_size: int,
               fused: bool) -> int:
    """Rows per block of the selection's merge, so the gathered candidates ``[block, ranks *
    K]`` stay within the selection's budget; from numbers every rank shares (``total``: the
    summed width of the shards)."""
    factor = FUSED_SELECT_FACTOR if fused else SELECT_FACTOR
    budget = budget_bytes(chunk_bytes, count, -(-total // ranks), element_size)
    return max(1, factor * budget // (_CANDIDATE_BYTES * ranks * k))


# ---- the fused LM head ------------------------------------------------------------------------

# The fused losses make the logits with one matrix product per block of rows and stage the
# logits gradient for the products that make the hidden states' and weight's gradients (see
# topkd.sources); those products run near full speed from ~100 rows. By default the blocks
# and the float32 work chunks share a fifth of the bytes the logits would take (at most
# 512 MiB): 80% for the blocks, 20% for the work chunks. A teacher given as (hidden, weight)
# gets blocks a quarter as tall as the student's: its blocks only feed its own product, while
# the student's also set how often the weight's float32 accumulator is read and written (once
# per block), which costs more than a shorter teacher product.
_FUSED_CHUNK_BYTES = 512 * 2**20
_FUSED_FRACTION = 5
_WORK_SHARE = 5  # the work chunks' share of the fused budget: 1/5
_FUSED_MIN_BUFFERS = 3  # the one-pass loop's temporaries live beside the chunk
_TEACHER_BLOCK_DIVISOR = 4
# By default a fused loss whose logits would take at most this (the logits losses' least
# selection budget) runs as one block and one chunk: a few MiB, where per-chunk overhead would
# cost more than the memory saved.
SMALL_FUSED_BYTES = SELECT_FACTOR * MIN_CHUNK_BYTES
# The fused budget's floor: the logits losses' largest default chunk budget.
FUSED_MIN_BYTES = DEFAULT_CHUNK_BYTES


def fused_rows(cfg, sparse: bool, labels, chunk_bytes, widest: int, count: int,
               dtype: torch.dtype, device, teacher_blocks: bool) -> tuple[int, int, int]:
    """``(work chunk rows, student block rows, teacher block rows)`` of a fused loss, the
    teacher's only with ``teacher_blocks`` (a hidden/weight teacher), from numbers every rank
    shares: the engine combines statistics per chunk, so every rank must cut the same chunks.
    One-pass losses stage the student's gradient in its own blocks; the two-pass ones hold a
    stage of that many rows but no student block. ``dtype``: the products'; what one product
    allocates while it runs (:func:`gemm_workspace`) is taken from the default budget so that
    the peak, products included, stays within it."""
    buffers = max(_FUSED_MIN_BUFFERS, work_buffers(cfg, sparse, labels))
    element = dtype.itemsize
    width = widest + 1
    if chunk_bytes is None and 0 < count * width * element <= SMALL_FUSED_BYTES:
        return count, count, count if teacher_blocks else 0  # small: one block, one chunk
    total, work = chunk_bytes, None if chunk_bytes is None else chunk_bytes // _WORK_SHARE
    if total is None:
        # By default at least FUSED_MIN_BYTES: at small shapes the per-chunk overhead, not the
        # products' speed or the memory, is what counts; less where the products' workspace
        # takes some of it.
        total = min(_FUSED_CHUNK_BYTES, count * width * element // _FUSED_FRACTION)
        total = max(total, FUSED_MIN_BYTES) - gemm_workspace(dtype, device)
        work = max(total // _WORK_SHARE, min(MIN_CHUNK_BYTES, total))
    row_bytes = width * element * (1 + (1 / _TEACHER_BLOCK_DIVISOR if teacher_blocks else 0))
    per = least_rows(chunk_rows(work, width, count, element, buffers=buffers), cfg.backend)
    # The blocks get what the work chunks leave (at least 4/5, unless a chunk had to be made
    # taller than its fifth), in whole chunks: a block starts at a chunk, so a remainder would
    # be made again.
    rest = max(0, total - per * 4 * width * buffers)
    block = max(per, int(rest // row_bytes) // per * per)
    teacher_block = max(1, block // _TEACHER_BLOCK_DIVISOR) if teacher_blocks else 0
    return per, block, teacher_block


_TARGET_BYTES = 16  # per kept entry of a selected teacher row: int64 index, float32 logprob,
# and their share of the rest


def fused_select(cfg, sparse: bool, labels, widest: int, k: int) -> tuple[int, int]:
    """``(span rows, chunk_bytes)`` of the teacher's selection in a one-pass fused loss (the
    targets made as the chunks go): the teacher of ``span`` rows at once, a block's (a teacher
    head's block when the teacher is a head), whose ``[span, K]`` targets take at most a
    quarter of the work chunks' share; selected in chunks within that share (the work chunks'
    buffers are free while the teacher is selected). Selecting per work chunk instead costs
    its fixed overhead once per few rows. ``cfg`` holds the rows that :func:`fused_rows`
    gave; spans are whole work chunks, the same on every rank."""
    per = cfg.rows_per_chunk
    work = per * 4 * (widest + 1) * max(_FUSED_MIN_BUFFERS, work_buffers(cfg, sparse, labels))
    span = min(cfg.teacher_block_rows or cfg.block_rows, work // (4 * _TARGET_BYTES * k))
    return max(per, span // per * per), work


# A stage of at least ROUNDED_PRODUCT_ROWS rows makes the weight's product in the weight's
# dtype, at most _WEIGHT_TILE_ROWS weight rows at a time (fastest on this CPU at 512-1,024 rows
# of a 151,936 x 1,024 weight).
ROUNDED_PRODUCT_ROWS = 64
_WEIGHT_TILE_ROWS = 1024


def weight_tile_rows(count: int, columns: int, hidden: int) -> int:
    """Weight rows per tile of a rounded weight product over ``count`` staged rows of
    ``columns``: its two tile buffers take at most half the stage's bytes."""
    return min(_WEIGHT_TILE_ROWS, max(1, count * columns // (6 * hidden)))


def float32_tile_rows(columns: int, element_size: int) -> int:
    """Weight rows per tile of a float32 weight product over few rows: a float32 tile is at
    most a quarter of the stage's bytes (the stage may be a whole block, most of the budget)."""
    return max(1, columns * element_size // 16)


# oneDNN's brgemm matmul holds per thread, for the length of one product, a copy of B's blocks
# (K_blk <= 1,024 x N_blk = 64, bf16), float32 accumulators (M_blk <= 256 x 64) and a copy of a
# transposed A (<= 256 x 512): about 0.45 MiB; this rounds it up. On an AMX CPU (Intel Xeon,
# 2 threads) the fused products' scratchpad read more: 1.4-1.6 MiB at H = 64, 3.5-3.7 MiB at
# H = 1,024, V = 151,936, growing with a product's rows (10.7 MiB at 4,096 rows, 1 thread); the
# fused peak there stays within its bound (at most 0.22x the logits in test_fused, 0.195x at
# the benchmark's shape) on the budget's other margins.
ONEDNN_WORKSPACE_PER_THREAD = 2**19


def gemm_workspace(dtype: torch.dtype, device: torch.device) -> int:
    """Bytes that one matrix product of ``dtype`` on ``device`` allocates through PyTorch's
    allocator while it runs, beyond its operands and result.

    On CPUs with AVX512 or AMX, PyTorch runs bfloat16 / float16 products with oneDNN, whose
    scratchpad is allocated per call (:data:`ONEDNN_WORKSPACE_PER_THREAD` per thread).
    Elsewhere nothing the allocator sees: MKL's float32 products and PyTorch's own bfloat16
    kernels (AVX2 CPUs) keep their temporaries outside it, and cuBLAS allocates its workspace
    once, not per product."""
    if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float16):
        return 0
    if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return 0
    supported = (torch.ops.mkldnn._is_mkldnn_bf16_supported if dtype == torch.bfloat16
                 else torch.ops.mkldnn._is_mkldnn_fp16_supported)
    return torch.get_num_threads() * ONEDNN_WORKSPACE_PER_THREAD if supported() else 0
