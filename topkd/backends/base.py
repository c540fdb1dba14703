"""What a backend supplies: the per-chunk stages, each with one signature for every backend.

The engine (:mod:`topkd.engine`) owns the chunk loop, the collectives between the stages and
the per-row math; a backend computes what one chunk of rows contributes. Its stages take the
chunk as its source gives it (``low``, ``[r, W]`` in the logits' own dtype, ``W`` this
shard's real columns) and return float32 per-row statistics, or the chunk's gradient.

``cfg`` is the call's :class:`~topkd.engine.Config`; a stage reads only its ``divergence``,
``temperature``, ``logit_scale``, ``softcap``, ``teacher_logit_scale`` and
``teacher_softcap``. ``state`` is the backend's own, made by a statistics or refresh stage
and consumed by the stages after it for the same chunk. ``stats`` is a dict of the chunk's
combined per-row statistics (``[r]`` or ``[r, K]`` float32, named as in the engine).

Hard labels: ``label_columns`` (int64 ``[r]``, this shard's column of each row's label, the
spare column ``W`` where it is elsewhere or ignored) or ``None`` without labels; ``ce``:
whether the CE term needs its own temperature-1 normalizer (labels at T != 1); ``g_ce``
(``[r]``) the CE rows' upstream gradient, ``None`` without labels; ``stats`` holds
``ce_max``/``ce_sum`` exactly when ``ce``.

A new backend is one module here with a subclass of :class:`Backend`, and its name in
:func:`topkd.backends.choose`; its memory is accounted for by :mod:`topkd.memory` from
:attr:`Backend.widens_chunks` and :attr:`Backend.least_rows`.
"""

from __future__ import annotations

import torch


class Backend:
    """The per-chunk stages (see the module docstring for the shared arguments)."""

    name = "backend"
    # Whether a chunk is widened into float32 work buffers (their count is the memory
    # policy's, per path and divergence) or read in its own dtype (one gradient chunk).
    widens_chunks = True
    least_rows = 1  # the least rows per chunk its stages take
    # Sparse-path statistics that :meth:`sparse_refresh` remakes, so a two-pass loss need not
    # save them.
    sparse_remade: tuple[str, ...] = ()

    def runner(self, divergence, sparse: bool) -> Backend:
        """The backend that runs a call's chunks: this one, or one it hands a case it does not
        cover to (e.g. a divergence without its own :meth:`~topkd.Divergence.terms`)."""
        return self

    # ---- Top-K path: the student at the teacher's kept columns and over the ghost

    def sparse_statistics(self, cfg, low, columns, label_columns, ce: bool):
        """``(state, (selected [r, K], ghost max [r], ghost centered sum [r], label logit [r]
        or None, CE (max, centered sum) or None))`` of this shard's chunk at ``z / T``;
        ``columns`` int64 ``[r, K]``: each kept index's column here, or the spare ``W``."""
        raise NotImplementedError

    def sparse_refresh(self, cfg, low, columns, label_columns, stats: dict):
        """The gradient ``state`` of a chunk read again in backward; sets the statistics of
        :attr:`sparse_remade` in ``stats``."""
        raise NotImplementedError

    def sparse_gradient(self, cfg, state, stats: dict, upstream, g_ce, dtype: torch.dtype,
                        out=None):
        """The chunk's ``d loss / d (raw logits)`` ``[r, >= W]`` (columns past ``W`` junk) in
        ``dtype`` or float32: ``out`` (the sink's rows ``[r, >= W]`` in ``dtype``, or None)
        when the backend wrote it there, else a chunk of its own. ``upstream`` = ``(grad_sel
        [r, K], grad_norm [r], grad_rest [r])``: the upstream gradients of the kept values,
        the log-normalizer and the ghost."""
        raise NotImplementedError

    # ---- full-vocabulary path: student and teacher chunks side by side

    def dense_statistics(self, cfg, low_s, low_t, label_columns, ce: bool):
        """``(state, maxima [r, 2], centered sums [r, 2], label logit or None, CE normalizer
        or None)`` of this shard's student and teacher chunks at ``/ T``."""
        raise NotImplementedError

    def dense_terms(self, cfg, state, local_max, log_shift, inverse_sum):
        """``(D row sums [r], h row sums [r], state)`` of the divergence over this shard's
        chunk, from ``log_shift`` ``[r, 2]`` = (global max - shard max) + log global sum and
        ``inverse_sum`` ``[r, 2]`` = exp(shard max - global max) / global sum."""
        raise NotImplementedError

    def dense_refresh(self, cfg, low_s, low_t, label_columns, row_max, row_sum):
        """The gradient ``state`` of chunks read again from the global row maxima and sums
        ``[r, 2]`` (backward)."""
        raise NotImplementedError

    def dense_gradient(self, cfg, state, stats: dict, g_kd, g_norm_ce, g_ce,
                       dtype: torch.dtype, out=None):
        """The chunk's ``d loss / d (raw student logits)`` ``[r, >= W]`` from ``stats``'
        ``row_max``, ``row_sum`` and ``h_sum`` (in ``out`` or not, as
        :meth:`sparse_gradient`); ``g_norm_ce``: the CE's upstream gradient where it shares
        the KD normalizer (T = 1), else 0."""
        raise NotImplementedError

    # ---- the teacher's selection and the fused head's weight gradient

    def select(self, low, k: int, temperature: float, logit_scale: float, softcap,
               scratch=None, ordered: bool = True):
        """``(values [r, k], local indices [r, k], rest max [r], rest log-sum [r], done [r]
        bool)``: the chunk's top-``k`` of ``logits / T``, in canonical order
        (:mod:`topkd.topk`) with ``ordered`` (else in ``torch.topk``'s order), and the
        log-sum-exp of the rest as ``rest max + rest log-sum``; ``k <= W``. No host sync: a
        row that is not ``done`` (whether it is depends on the row alone) holds junk and is
        selected again by :meth:`select_exact`. ``scratch``: a
        :class:`~topkd.sources.Scratch` whose buffers the call's chunks share, or None."""
        raise NotImplementedError

    def select_exact(self, low, k: int, temperature: float, logit_scale: float, softcap,
                     scratch=None):
        """:meth:`select` of any rows, every one done: ``(values, indices, rest max, rest
        log-sum)``."""
        raise NotImplementedError

    def kernel(self, fn):
        """``fn``, a plain function of row-major tensors ``[r, ...]`` (an element-wise or
        per-row step of the package), as this backend runs it: itself, or compiled."""
        return fn

    def accumulator(self, like: torch.Tensor):
        """``add_(accumulator, product)``: adds a product tile (at most ``like``'s shape, any
        float dtype) into a float32 accumulator tile in place."""
        raise NotImplementedError
