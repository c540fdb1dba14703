"""The compiled backend (``impl="compile"``): the per-chunk stages as ``torch.compile`` kernels.

Each kernel reads a chunk as it comes from its source (``low``, ``[r, W]`` in the logits' own
dtype) and returns per-row statistics or the chunk's gradient: the widening, logit transform,
exponentials and sums run as one fused loop per result under ``torch.compile`` (inductor: C++
on CPU, Triton on CUDA), so no float32 copy of the chunk is made. They compute what the eager
kernels of :mod:`topkd.kernels` compute, in the same order of operations per element (sums may
be reassociated: equal to float32 rounding; on a CPU one exponential is an ``exp2``, see
:func:`_shared_exp`).

Compiled once per process per variant (dtype, divergence, options) with dynamic shapes, so a
run whose row count or vocabulary changes does not recompile; inductor's on-disk cache makes
later processes start fast.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math

import torch

from .. import topk
from ..divergences import KL, ReverseKL, has_own_terms
from ..kernels import centered_kl_sums, finite_or_zero
from ..sources import empty
from ..topk import candidates_, positions, row_starts, sampled_plan, sampled_top
from .base import Backend
from .eager import EAGER

NEG_INF = float("-inf")
_LOG2_E = 1 / math.log(2)
# Variants (dtype, divergence, options, shape specializations) that one kernel may compile for
# in a process; dynamo's own default (8) is shared by all callers of one code object.
_RECOMPILE_LIMIT = 256
# The kernels' arguments that only multiply or divide (see _compiled).
_FACTORS = frozenset({"temperature", "logit_scale", "t_logit_scale"})


# ---- whether this platform can compile ---------------------------------------------------


def compiler_missing(device_type: str) -> str | None:
    """Why ``torch.compile`` cannot build kernels for ``device_type`` here, or None."""
    if device_type == "cpu":
        try:
            try:
                from torch._inductor.cpp_builder import get_cpp_compiler
            except ImportError:  # torch < 2.5
                from torch._inductor.codecache import cpp_compiler as get_cpp_compiler

            get_cpp_compiler()
        except Exception as e:  # noqa: BLE001 - any failure to find one means no compiler
            return f"no C++ compiler for inductor ({type(e).__name__}: {e})"
        return None
    if device_type == "cuda":
        from torch.utils._triton import has_triton

        return None if has_triton() else "Triton is not available for this CUDA device"
    return f"topkd compiles kernels on cpu and cuda only, not {device_type}"


def _compiled(fn=None, *, rows: bool = True, duck: bool = True):
    """``fn`` compiled lazily (once per process, dynamic shapes), called with a recompile
    limit of its own.

    ``rows``: every tensor argument and result is row-major ``[r, ...]``, and a call with one
    row runs as two (the row twice, the result's first row kept, and the first row of the
    argument named ``out``, which a kernel writes in place, copied back into the caller's). A
    kernel built for a static size of one (dynamo specializes sizes 0 and 1) may sum a row in
    another order than the one built for any height, and a row's result must not depend on
    how the rows were chunked. A tensor expanded along its rows (a per-row upstream gradient
    of a sum) is passed as a copy: dynamo guards on strides, and a one-row tensor's may be
    anything, so every height sees one layout.

    A factor (an argument named in :data:`_FACTORS`: it only multiplies or divides) of exactly
    1.0 is passed as None, and the kernel leaves its operation out, as the eager kernels do
    (exact: ``x * 1 = x / 1 = x``). Dynamo passes a float as a tensor to the kernel, so
    ``x / 1.0`` would otherwise run as a division per element.

    ``duck=False``: sizes that happen to be equal at the first call are not taken to be one
    size (dynamo's duck sizing), for a kernel whose arguments' sizes are independent: it
    would otherwise guard on their equality and compile again at the first call where they
    differ."""
    if fn is None:
        return functools.partial(_compiled, rows=rows, duck=duck)
    state = {}
    names = list(inspect.signature(fn).parameters)
    factors = [i for i, name in enumerate(names) if name in _FACTORS]
    written = names.index("out") if "out" in names else None

    @functools.wraps(fn)
    def call(*args):
        if "fn" not in state:
            state["fn"] = torch.compile(fn, dynamic=True)
        _announce(fn.__name__, args)
        # Dynamo guards on what a tensor is a view of and on requires_grad; a chunk is a view
        # of the logits or not (the whole tensor, a copy), of one base height or another, so
        # each would compile its own graph. Detached, every chunk is a plain tensor on the
        # same storage (in-place kernels still write through).
        args = tuple(_plain(a) if isinstance(a, torch.Tensor) else a for a in args)
        args = tuple(None if i in factors and isinstance(a, (int, float)) and a == 1 else a
                     for i, a in enumerate(args))
        single = rows and next(a for a in args if isinstance(a, torch.Tensor)).shape[0] == 1
        given = args
        if single:
            args = tuple(torch.cat([a, a]) if isinstance(a, torch.Tensor) else a for a in args)
        with _settings(duck):
            out = state["fn"](*args)
        if not single:
            return out
        if written is not None:  # every kernel that has an ``out`` is given one
            given[written].copy_(args[written][:1])
        if isinstance(out, torch.Tensor):
            return out[:1]
        return tuple(x[:1] for x in out)

    call.eager = fn
    return call


def _plain(a: torch.Tensor) -> torch.Tensor:
    """``a`` detached, and contiguous where it is expanded along its rows (see
    :func:`_compiled`)."""
    a = a.detach()
    return a.contiguous() if a.dim() and a.shape[0] > 1 and a.stride(0) == 0 else a


class _Settings:
    """Config values set for the duration of a kernel call, re-entrantly: ``(module, name,
    value)`` (a torch config module, e.g. ``torch._dynamo.config``), assigned and restored
    directly. (A ``config.patch`` added about 70 us to each call, more than a small kernel's
    own call takes; this adds about 20.)"""

    def __init__(self, *settings):
        self.settings, self.saved = settings, []

    def __enter__(self):
        self.saved.append([getattr(module, name) for module, name, _ in self.settings])
        for module, name, value in self.settings:
            setattr(module, name, value)

    def __exit__(self, *exc):
        for (module, name, _), old in zip(self.settings, self.saved.pop(), strict=True):
            setattr(module, name, old)


@functools.cache
def _settings(duck: bool) -> _Settings:
    """What a kernel runs under: a recompile limit of its own (under this torch's names; older
    torch names them ``cache_size_limit``) and, with ``duck`` False, no duck sizing (where
    this torch has the setting)."""
    dynamo = torch._dynamo.config
    name = "recompile_limit" if hasattr(dynamo, "recompile_limit") else "cache_size_limit"
    settings = [(dynamo, name, _RECOMPILE_LIMIT),
                (dynamo, f"accumulated_{name}", 4 * _RECOMPILE_LIMIT)]
    try:
        from torch.fx.experimental import _config
    except ImportError:
        _config = None
    if not duck and hasattr(_config, "use_duck_shape"):
        settings.append((_config, "use_duck_shape", False))
    return _Settings(*settings)


_seen: set = set()
logger = logging.getLogger("topkd")


def _announce(name: str, args) -> None:
    """Say that a kernel is being compiled, once per configuration (the kernel, its tensors'
    dtypes, its other arguments): INFO each time, and the first time in a process a WARNING
    (shown by default), since the call then stops for seconds with no other sign."""
    key = (name, *((a.dtype, a.dim()) if isinstance(a, torch.Tensor) else repr(a)
                   for a in args))
    if key in _seen:
        return
    first = not _seen
    _seen.add(key)
    dtypes = sorted({str(a.dtype).removeprefix("torch.") for a in args
                     if isinstance(a, torch.Tensor)})
    logger.info("compiling the %s kernel (%s)", name, ", ".join(dtypes))
    if first:
        logger.warning(
            "topkd: compiling its kernels for this loss configuration (torch.compile): the "
            "first call of each configuration takes about 15-25 s on a CPU (a few seconds "
            "once inductor's on-disk cache is warm); later calls do not recompile. "
            "TOPKD_IMPL=eager or impl='eager' skips compiling.")


# ---- element-wise pieces (traced into each kernel) ----------------------------------------


def _finite(x):
    return torch.where(torch.isfinite(x), x, 0.0)


def _nan_to_zero(x):
    """``x`` with NaN replaced by 0 (infinities kept): ``fmax(x, 0) + fmin(x, 0)``, which
    inductor vectorizes in a reduction where it does not vectorize ``where``."""
    zero = torch.zeros_like(x)
    return torch.fmax(x, zero) + torch.fmin(x, zero)


def _times(x, factor):
    """``x * factor``; ``x`` itself where the factor is None (one of 1.0, see :func:`_compiled`)."""
    return x if factor is None else x * factor


def _over(x, factor):
    """``x / factor``; ``x`` itself where the factor is None (one of 1.0)."""
    return x if factor is None else x / factor


def _unit(factor):
    return 1.0 if factor is None else factor


def _logits(low, logit_scale, softcap):
    """The transformed logits in float32, as :func:`topkd.kernels.logits_` computes them."""
    z = low.float()
    if softcap is None:
        return _times(z, logit_scale)
    return torch.tanh(z * (_unit(logit_scale) / softcap)) * softcap


def _derivative(low, logit_scale, softcap):
    """d(transformed)/d(raw) at ``low`` (None: 1), as :func:`topkd.kernels.logits_grad_`
    computes it."""
    if softcap is None:
        return logit_scale
    t = torch.tanh(low.float() * (_unit(logit_scale) / softcap))
    return _times(1.0 - t * t, logit_scale)


def _at(low, columns):
    """``low`` gathered at ``columns`` ``[r, K]`` (the spare column ``W`` gives -inf)."""
    width = low.shape[1]
    inside = columns < width
    values = low.gather(1, torch.where(inside, columns, 0))
    return inside, values


def _normalizer(z):
    m = z.amax(-1)
    return m, torch.exp(z - _finite(m)[:, None]).sum(-1)


def _label_statistics(low, labels, logit_scale, softcap, ce):
    """The label's logit at temperature 1 (-inf where it is elsewhere) and, with ``ce``, the
    temperature-1 normalizer ``(max, centered sum)``."""
    out = ()
    if labels is not None:
        inside, values = _at(low, labels[:, None])
        out += (torch.where(inside, _logits(values, logit_scale, softcap), NEG_INF)[:, 0],)
    if ce:
        out += _normalizer(_logits(low, logit_scale, softcap))
    return out


def _ce_gradient(grad, low, columns, labels, g_ce, ce_max, ce_sum, logit_scale, softcap):
    """``grad`` (w.r.t. the transformed logits at ``columns``, or every column when None) plus
    the CE gradient not folded into the normalizer: ``g * softmax(z)`` at temperature 1 (with
    ``ce_max``) and ``-g`` at the label."""
    if labels is None:
        return grad
    if ce_max is not None:
        z = _logits(low, logit_scale, softcap)
        coef = g_ce / ce_sum.clamp_min(1e-38)
        grad = grad + torch.exp(z - _finite(ce_max)[:, None]) * coef[:, None]
    if columns is None:
        columns = torch.arange(low.shape[1], device=low.device)[None, :]
    return grad - torch.where(columns == labels[:, None], g_ce[:, None], 0.0)


# ---- Top-K / sparse teacher ---------------------------------------------------------------


# bf16's +inf and -inf as int16
_BF16_INF, _BF16_NEG_INF = 0x7F80, -0x80


def kept_bound(columns: torch.Tensor, width: int) -> torch.Tensor:
    """Bfloat16 ``[r, width + 1]``: -inf at ``columns``, +inf elsewhere; written as int16
    (a bf16 fill of +inf runs 5-8x slower). Read as bf16 and widened in a kernel, it costs
    what a chunk's own bf16 columns do; with an int8 mask widened to float32 the statistics
    pass took 2.5x the time on an AVX2 CPU."""
    bound = torch.empty(columns.shape[0], width + 1, dtype=torch.int16, device=columns.device)
    bound.fill_(_BF16_INF).scatter_(1, columns, _BF16_NEG_INF)
    return bound.view(torch.bfloat16)


@_compiled
def sparse_statistics(low, columns, bound, labels, temperature, logit_scale, softcap, ce: bool):
    """``(selected [r, K], ghost max [r], ghost centered sum [r], *label statistics)`` of a
    chunk, as :func:`topkd.kernels.read` + :func:`~topkd.kernels.sparse_statistics` give;
    ``bound`` is :func:`kept_bound` of ``columns``."""
    # -inf at the kept entries by a minimum with -inf there and +inf elsewhere (arithmetic,
    # which inductor vectorizes in a reduction where it does not vectorize ``where``)
    rest = torch.minimum(_over(_logits(low, logit_scale, softcap), temperature),
                         bound[:, :low.shape[1]].float())
    rest_max = rest.amax(-1)
    rest_sum = torch.exp(rest - _finite(rest_max)[:, None]).sum(-1)
    inside, values = _at(low, columns)
    selected = _over(_logits(values, logit_scale, softcap), temperature)
    selected = torch.where(inside, selected, NEG_INF)
    return (selected, rest_max, rest_sum, *_label_statistics(low, labels, logit_scale, softcap, ce))


@_compiled
def sparse_gradient(low, columns, labels, row_max, total, rest_max, rest_sum, selected,
                    grad_sel, grad_norm, grad_rest, g_ce, ce_max, ce_sum, temperature, logit_scale,
                    softcap, out):
    """``(columns [r, K], kept [r, K])`` for :func:`scatter_kept`, having written the chunk's
    ``d loss / d (raw logits)`` at every column as if none were kept into ``out`` ``[r, >= W]``
    (its dtype; columns past ``W`` untouched): ghost entries in one pass over the chunk, as
    :func:`~topkd.kernels.sparse_gradient_` and the CE and transform steps after it give.
    ``kept``: the gradient at the kept entries' ``columns`` in ``out``'s dtype. A kept entry
    elsewhere (another shard's, at the spare column ``W``) becomes a copy of the row's first
    one here, column and value; in a row with none here, column 0 and the value written there.
    (A scatter inside the kernel made inductor write the chunk three times: to a buffer, to a
    functional copy of ``out``, then to ``out``.)"""
    has_rest = rest_sum > 0
    ghost = grad_norm * torch.exp(rest_max - row_max) / total
    ghost = ghost + torch.where(has_rest, grad_rest / rest_sum.clamp_min(1e-38), 0.0)
    ghost = _over(torch.where(has_rest, ghost, 0.0), temperature)

    def dense(low):  # the gradient at the columns of ``low`` (the chunk's first ones)
        a = _over(_logits(low, logit_scale, softcap), temperature)
        grad = torch.exp(a - _finite(rest_max)[:, None]) * ghost[:, None]
        grad = _ce_gradient(grad, low, None, labels, g_ce, ce_max, ce_sum, logit_scale, softcap)
        return _times(grad, _derivative(low, logit_scale, softcap)).to(out.dtype)

    out[:, :low.shape[1]].copy_(dense(low))

    kept = torch.exp(selected - row_max[:, None]) * (grad_norm / total)[:, None]
    kept = _over(kept + grad_sel, temperature)
    inside, values = _at(low, columns)
    kept = _ce_gradient(kept, values, columns, labels, g_ce, ce_max, ce_sum, logit_scale, softcap)
    kept = _times(kept, _derivative(values, logit_scale, softcap)).to(out.dtype)
    first = inside.int().argmax(-1, keepdim=True)
    here = inside.any(-1, keepdim=True)
    anchor = torch.where(here, columns.gather(1, first), 0)
    value = torch.where(here, kept.gather(1, first), dense(low[:, :1]))
    return torch.where(inside, columns, anchor), torch.where(inside, kept, value)


_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def scatter_kept(out, columns, kept):
    """``out`` (contiguous: the sink's rows or a new chunk) with ``kept`` written at
    ``columns`` (``[r, K]``, as :func:`sparse_gradient` gives them), eagerly, as the integers
    of the same width: a bit copy (a CPU ``scatter_`` into bf16/fp16 widens and narrows all of
    ``out``: 25x slower; an ``index_put_``, 10x)."""
    bits = _BITS[out.element_size()]
    out.view(bits).scatter_(1, columns, kept.view(bits))
    return out


# ---- full vocabulary ----------------------------------------------------------------------


def _both(low_s, low_t, temperature, logit_scale, softcap, t_logit_scale, t_softcap):
    return (_over(_logits(low_s, logit_scale, softcap), temperature),
            _over(_logits(low_t, t_logit_scale, t_softcap), temperature))


def _shared_exp(x):
    """``exp(x)`` for a value that two sums use: on a CPU as ``exp2(x log2(e))``, elsewhere
    ``exp``. (On a CPU inductor stores an exponential (``exp``, not ``exp2``) that two results
    use into a float32 buffer, and a kernel with a loop over one runs 8 float32 lanes, loading
    a bf16 or fp16 chunk half a vector at a time through a copy: about 3x the time. The
    argument's rounding moves a term by up to ``|x|`` float32 ulps; a row's sum of them is as
    far from float64 as ``exp``'s: 5e-8 to 7e-8 relative (median over rows; max 2e-7 to
    3e-7, ``exp`` 1e-7 to 3e-7) at V = 248,320 for logits of standard deviation 1 to 10.)"""
    return torch.exp2(x * _LOG2_E) if x.device.type == "cpu" else torch.exp(x)


@_compiled
def dense_statistics(low_s, low_t, labels, temperature, logit_scale, softcap, t_logit_scale,
                     t_softcap, ce: bool, weighted: int | None = None):
    """``(maxima [r, 2], sums [r, 2], *label statistics)`` of this shard's chunks (the
    student's logit transform ``logit_scale``/``softcap``, the teacher's
    ``t_logit_scale``/``t_softcap``).

    ``weighted``, the column (0 student, 1 teacher) of KL's weights: ``(maxima, sums,
    weighted sums [r], *label statistics)`` with, for 1, ``sum_j eb_j (b_j - a_j)`` (a term
    whose ``eb_j`` is 0 counted 0; 0 swaps the roles), ``a``, ``b`` the logits less their
    maxima: the sums of :func:`topkd.kernels.centered_kl_sums`, in the same pass, as the
    eager backend's KL passes make them."""
    a, b = _both(low_s, low_t, temperature, logit_scale, softcap, t_logit_scale, t_softcap)
    label = _label_statistics(low_s, labels, logit_scale, softcap, ce)
    if weighted is None:
        (ma, sa), (mb, sb) = _normalizer(a), _normalizer(b)
        return (torch.stack([ma, mb], -1), torch.stack([sa, sb], -1), *label)
    ma, mb = a.amax(-1), b.amax(-1)
    a, b = a - _finite(ma)[:, None], b - _finite(mb)[:, None]
    w, o = (b, a) if weighted else (a, b)
    e = _shared_exp(w)
    sums = [o.exp().sum(-1), e.sum(-1)]
    return (torch.stack([ma, mb], -1), torch.stack(sums[::1 if weighted else -1], -1),
            (torch.where(e == 0, 0.0, w - o) * e).sum(-1), *label)


def _terms(divergence, low_s, low_t, center, log_shift, inverse_sum, temperature,
           *transforms):
    """``(p, f, h)`` of the divergence over the chunk: ``log p = (a - center) - log_shift``,
    ``p = exp(a - center) * inverse_sum`` (likewise ``q``), as
    :func:`topkd.kernels.dense_terms`. KL's ``h = -q`` is never NaN and is not cleaned."""
    a, b = _both(low_s, low_t, temperature, *transforms)
    # (columns by index, not by slice: a slice of the size-2 dimension is not provably 1 wide
    # under dynamic shapes)
    a, b = a - center[:, 0, None], b - center[:, 1, None]
    logp, logq = a - log_shift[:, 0, None], b - log_shift[:, 1, None]
    p, q = torch.exp(a) * inverse_sum[:, 0, None], torch.exp(b) * inverse_sum[:, 1, None]
    f, h = divergence.terms(logp, logq, p, q)
    return p, f, h if isinstance(divergence, KL) else _nan_to_zero(h)


@_compiled
def dense_terms(divergence, low_s, low_t, center, log_shift, inverse_sum, temperature,
                logit_scale, softcap, t_logit_scale, t_softcap):
    """``(D row sums, h row sums)`` of this shard; a term whose weight is 0 counts 0, a NaN in
    the inputs reaches the row through ``log_shift``."""
    _, f, h = _terms(divergence, low_s, low_t, center, log_shift, inverse_sum, temperature,
                     logit_scale, softcap, t_logit_scale, t_softcap)
    f_sum = torch.where(torch.isnan(log_shift).any(-1), float("nan"), _nan_to_zero(f).sum(-1))
    return f_sum, h.sum(-1)


@_compiled
def dense_gradient(divergence, low_s, low_t, labels, row_max, row_sum, h_sum, g_kd,
                   g_norm_ce, g_ce, ce_max, ce_sum, temperature, logit_scale, softcap,
                   t_logit_scale, t_softcap, out):
    """The chunk's ``d loss / d (raw student logits)`` written into ``out`` ``[r, >= W]`` (its
    dtype) and returned, from the global row maxima and sums ``[r, 2]``: ``(g_kd * (h - p sum
    h) + g_ce * p) / T`` and the CE and transform steps, as
    :func:`~topkd.kernels.dense_gradient_` and those after it."""
    p, _, h = _terms(divergence, low_s, low_t, _finite(row_max), row_sum.log(), 1 / row_sum,
                     temperature, logit_scale, softcap, t_logit_scale, t_softcap)
    coef = g_kd * h_sum - g_norm_ce
    grad = _over(h * g_kd[:, None] - p * coef[:, None], temperature)
    grad = _ce_gradient(grad, low_s, None, labels, g_ce, ce_max, ce_sum, logit_scale, softcap)
    out[:, :low_s.shape[1]].copy_(_times(grad, _derivative(low_s, logit_scale, softcap)))
    return out


# ---- the teacher's selection and the fused head's accumulators ----------------------------


@_compiled
def read(low, temperature, logit_scale, softcap, out):
    """``logits / T`` of a chunk into the float32 buffer ``out`` (the exact selection sorts
    it)."""
    return out.copy_(_over(_logits(low, logit_scale, softcap), temperature))


# The sample's threshold from pivots: the sorted top values of every _SUBSAMPLE-th entry of the
# sample, at most _PIVOTS of them, around the rank the sample's keep-th largest has there, at
# least _PIVOT_STEP ranks apart (closer, the sample's entries between two pivots vary too much).
_SUBSAMPLE = 4
_PIVOTS = 9
_PIVOT_STEP = 6


def _pivot_ranks(width: int, keep: int):
    """``(lo, hi, step)``: the ranks ``range(lo, hi, step)`` of the pivots among the sorted
    top values of every :data:`_SUBSAMPLE`-th of a sample's ``width`` entries, or None where
    ``keep`` is too small for pivots :data:`_PIVOT_STEP` apart (below 147), or that
    sub-sample too short. The sample's ``keep``-th largest has a rank there of about
    ``Binomial(keep, 1/4)`` (mean ``keep / 4``, standard deviation ``sqrt(3 keep) / 4``); the
    pivots span 4 standard deviations either side of it."""
    mid, spread = keep // _SUBSAMPLE, math.isqrt(3 * keep) + 2
    lo, hi = max(0, mid - spread), mid + spread + 1
    step = -(-(hi - lo) // _PIVOTS)
    if step < _PIVOT_STEP or hi > -(-width // _SUBSAMPLE):
        return None
    return lo, hi, step


@_compiled
def sample_threshold(sample, keep, pivots, temperature, logit_scale, softcap):
    """A threshold per row of ``b = logits / T`` of ``sample`` (a chunk's strided columns) with
    about ``keep`` of the row's entries at or above it: the highest pivot (see
    :func:`_pivot_ranks`, ``pivots``) with at least ``keep`` (the last where none has), or
    with ``pivots`` None the ``keep``-th largest. A sorted top of a quarter of the row and a
    count per pivot cost about half of a top ``keep`` of the whole row; the selection is
    exact for any threshold (it only sets how many candidates a row has)."""
    b = _over(_logits(sample, logit_scale, softcap), temperature)
    if pivots is None:
        return torch.topk(b, keep, dim=-1, sorted=False).values.amin(-1)
    lo, hi, step = pivots
    top = torch.topk(b[:, ::_SUBSAMPLE], hi, dim=-1, sorted=True).values[:, lo::step]
    # (a float sum of 0/1 is exact here and vectorizes; a sum of bools does not)
    counts = torch.where(b[:, None, :] >= top[:, :, None], 1.0, 0.0).sum(-1)
    enough = counts >= keep
    first = torch.where(enough.any(-1), enough.int().argmax(-1), top.shape[1] - 1)
    return top.gather(1, first[:, None])[:, 0]


@_compiled
def threshold_scan(low, threshold, temperature, logit_scale, softcap):
    """``(flags, below [r], count [r])`` of a chunk's ``b = logits / T`` in one pass:
    ``flags`` (int8 ``[r, W]``, new) 1 where ``b >= threshold`` (``[r]``), else 0 (inductor
    stores an int8 several times faster than a bool), the row sum of ``exp(b - threshold)``
    below it, and how many are at or above it (float32: exact below 2**24 columns). (Written
    into a buffer the caller passed, the flags took a second loop over the chunk, 8 lanes
    wide with half-vector bf16 loads on a CPU: a copy into an input is a node of its own.)"""
    b = _over(_logits(low, logit_scale, softcap), temperature)
    above = b >= threshold[:, None]
    flag = torch.where(above, 1.0, 0.0)  # (float: stored faster, summed exactly, vectorized)
    below = torch.where(above, 0.0, torch.exp(b - threshold[:, None])).sum(-1)
    return flag.to(torch.int8), below, flag.sum(-1)


@_compiled(rows=False, duck=False)
def candidate_keys(low, words, at, row, start, capacity, temperature, logit_scale, softcap):
    """:func:`topkd.topk.candidate_keys` of a chunk's ``logits / T`` at the flat positions
    of :func:`topkd.topk.nonzero_words`' ``(words, at)`` (``[n]``, ascending; ``at`` -1:
    none), of the rows ``row`` (``[n]``; at least ``r``: none), in
    :func:`topkd.topk.compact`'s layout: int64 ``[r, capacity + 1]``, the entry of rank ``j``
    in row ``i`` (its position less ``start[i]``, the row's first, of ``start`` ``[r + 1]``)
    at ``[i, j]``, ranks past ``capacity`` left out, padded with ``PAD_KEY``. Located,
    placed, gathered, transformed and keyed in one pass over the candidates (not over the
    slots). (Each candidate's row comes in, from the rows' counts: a CPU divides int64s one
    at a time, and a division per candidate took 60% of this kernel.)"""
    rows, width = low.shape
    real = at >= 0
    flat = (words[torch.where(real, at >> 3, 0)] << 3) | (at & 7)
    row = torch.where(real, row, rows)
    rank = torch.arange(at.shape[0], device=at.device) - start[row]
    kept = (row < rows) & (rank <= capacity)
    column = torch.where(kept, flat - row * width, 0)
    values = _over(_logits(low[torch.where(kept, row, 0), column], logit_scale, softcap),
                   temperature)
    keys = torch.full((rows + 1, capacity + 1), topk.PAD_KEY, dtype=torch.int64,
                      device=low.device)
    keys[torch.where(kept, row, rows), torch.where(kept, rank, 0)] = topk.sort_keys(values,
                                                                                    column)
    return keys[:rows]  # (the spare row ``r`` takes what is left out)


# Rows narrower than this have their candidates counted exactly by the scan's float sum.
_FLOAT_COUNT_COLUMNS = 2**24


class _Sampled:
    """:func:`topkd.topk.sampled_top`'s kernels on a chunk in its own dtype: no float32 copy
    of it, and no host sync off a CPU (:func:`topkd.topk.positions`)."""

    def __init__(self, temperature, logit_scale, softcap):
        self.options = (temperature, logit_scale, softcap)
        # products and quotients round alike in every kernel; a softcap's tanh may not
        self.rounding_gap = 0.0 if softcap is None else 2.0**-16

    def threshold(self, low, stride, keep):
        # (contiguous: a one-row chunk's sample, doubled, is; a kernel must see one layout)
        sample = low[:, ::stride].contiguous()
        return sample_threshold(sample, keep, _pivot_ranks(sample.shape[1], keep),
                                *self.options)

    def scan(self, low, threshold, capacity):
        above, below, count = threshold_scan(low, threshold, *self.options)
        if topk.no_host_sync(low.device):
            flat, row, count = positions(above.view(torch.bool), capacity, sync_free=True)
            words, at = topk.word_parts(flat)
        else:  # the positions as words and bytes, put together by the kernel below
            words, at = topk.nonzero_words(above.view(torch.bool).view(-1))
            count = (count.long() if low.shape[1] < _FLOAT_COUNT_COLUMNS
                     else above.view(torch.bool).sum(-1))
            row = torch.repeat_interleave(torch.arange(low.shape[0], device=low.device),
                                          count, output_size=at.shape[0])
        start = row_starts(count)
        # (dynamo specializes sizes 0 and 1, so a kernel sees at least 2 rows and 2 entries:
        # a one-row chunk doubled, its second row empty; entries -1, left out)
        one = low.shape[0] == 1
        if one:
            low, start = torch.cat([low, low]), torch.cat([start, start[-1:]])
        if at.shape[0] < 2:
            at = torch.cat([at, at.new_full((2 - at.shape[0],), -1)])
            row = torch.cat([row, row.new_zeros(2 - row.shape[0])])
        if words.shape[0] < 2:
            words = torch.cat([words, words.new_zeros(2 - words.shape[0])])
        keys = candidate_keys(low, words, at, row, start, capacity, *self.options)
        return keys[:1] if one else keys, count, lambda: below

    @staticmethod
    def finish(*args):
        return _kernel(topk.sampled_finish)(*args)


@_compiled
def log_sum_exp(b, center):
    """``log sum exp(b - center)`` of each row of ``b`` ``[r, W]`` (``center`` ``[r]``, 0
    where it is not finite)."""
    return torch.exp(b - _finite(center)[:, None]).sum(-1).log()


@_compiled(rows=False)
def accumulate_(accumulator, product):
    """``accumulator += product`` (float32 += any float dtype) in one pass, in place."""
    accumulator.add_(product.float())


# ---- the backend --------------------------------------------------------------------------


def _transforms(cfg):
    return (cfg.logit_scale, cfg.softcap, cfg.teacher_logit_scale, cfg.teacher_softcap)


def _gradient_out(low, dtype, out):
    """Where a gradient kernel writes: the sink's rows ``out``, or a new ``[r, W]`` chunk."""
    if out is None:
        out = torch.empty(low.shape, dtype=dtype, device=low.device)
    return out


def _label_extras(extra, label_columns, ce):
    """``(label logit, CE normalizer)`` from a statistics kernel's extra results (see
    :func:`_label_statistics`)."""
    z_label = extra[0] if label_columns is not None else None
    return z_label, tuple(extra[-2:]) if ce else None


class CompiledBackend(Backend):
    """The stages as the kernels above (see :class:`~topkd.backends.base.Backend` for the
    signatures): each reads its chunk in its own dtype, so the gradient stages read it again
    and a chunk holds only its gradient (in the sink's ``dtype``). Chunks of two rows or more
    (see :func:`_compiled`). A divergence without its own
    :meth:`~topkd.Divergence.terms` runs the full-vocabulary path on the eager backend."""

    name = "compile"
    widens_chunks = False
    least_rows = 2
    sparse_remade = ()  # the kernels take the saved kept values

    def runner(self, divergence, sparse):
        return self if sparse or has_own_terms(divergence) else EAGER

    # ---- Top-K path

    def sparse_statistics(self, cfg, low, columns, label_columns, ce):
        selected, rest_max, rest_sum, *extra = sparse_statistics(
            low, columns, kept_bound(columns, low.shape[1]), label_columns, cfg.temperature,
            cfg.logit_scale, cfg.softcap, ce)
        z_label, ce_norm = _label_extras(extra, label_columns, ce)
        return (low, columns, label_columns), (selected, rest_max, rest_sum, z_label, ce_norm)

    def sparse_refresh(self, cfg, low, columns, label_columns, stats):
        return (low, columns, label_columns)

    def sparse_gradient(self, cfg, state, stats, upstream, g_ce, dtype, out=None):
        low, columns, label_columns = state
        grad_sel, grad_norm, grad_rest = upstream
        out = _gradient_out(low, dtype, out)
        columns, kept = sparse_gradient(
            low, columns, label_columns, stats["row_max"], stats["total"], stats["rest_max"],
            stats["rest_sum"], stats["selected"], grad_sel, grad_norm, grad_rest, g_ce,
            stats.get("ce_max"), stats.get("ce_sum"), cfg.temperature, cfg.logit_scale,
            cfg.softcap, out)
        return scatter_kept(out, columns, kept)

    # ---- full-vocabulary path

    def dense_statistics(self, cfg, low_s, low_t, label_columns, ce):
        weighted = _centered(cfg.divergence)
        local_max, local_sum, *extra = dense_statistics(
            low_s, low_t, label_columns, cfg.temperature, *_transforms(cfg), ce, weighted)
        state = (low_s, low_t, label_columns)
        if weighted is not None:  # for kernels.centered_kl_sums
            state += ((extra.pop(0), local_sum, bool(weighted)),)
        z_label, ce_norm = _label_extras(extra, label_columns, ce)
        return state, local_max, local_sum, z_label, ce_norm

    def dense_terms(self, cfg, state, local_max, log_shift, inverse_sum):
        low_s, low_t, label_columns, *centered = state
        if centered:
            weighted, sums, teacher_weighted = centered[0]
            f_sum, h_sum = centered_kl_sums(weighted, sums, log_shift, inverse_sum,
                                            teacher_weighted)
        else:
            f_sum, h_sum = dense_terms(cfg.divergence, low_s, low_t, finite_or_zero(local_max),
                                       log_shift, inverse_sum, cfg.temperature,
                                       *_transforms(cfg))
        return f_sum, h_sum, (low_s, low_t, label_columns)

    def dense_refresh(self, cfg, low_s, low_t, label_columns, row_max, row_sum):
        return (low_s, low_t, label_columns)

    def dense_gradient(self, cfg, state, stats, g_kd, g_norm_ce, g_ce, dtype, out=None):
        low_s, low_t, label_columns = state
        return dense_gradient(
            cfg.divergence, low_s, low_t, label_columns, stats["row_max"], stats["row_sum"],
            stats["h_sum"], g_kd, g_norm_ce, g_ce, stats.get("ce_max"), stats.get("ce_sum"),
            cfg.temperature, *_transforms(cfg), _gradient_out(low_s, dtype, out))

    # ---- the teacher's selection (its passes over the chunk compiled, the sorts eager) and
    # the fused head's weight gradient

    def select(self, low, k, temperature, logit_scale, softcap, scratch=None, ordered=True):
        plan = sampled_plan(low.shape[1], k + 1)  # None where 16 (k + 1) > W
        if plan is None:
            return (*self.select_exact(low, k, temperature, logit_scale, softcap, scratch),
                    torch.ones(low.shape[0], dtype=torch.bool, device=low.device))
        return sampled_top(low, k + 1, plan,
                           _Sampled(temperature, logit_scale, softcap), ordered)

    def select_exact(self, low, k, temperature, logit_scale, softcap, scratch=None):
        b = read(low, temperature, logit_scale, softcap,
                 empty(scratch, "select", *low.shape, torch.float32, low.device))
        values, indices, rest_max = candidates_(b, k)
        return values, indices, rest_max, log_sum_exp(b, rest_max)

    def kernel(self, fn):
        return _kernel(fn)

    def accumulator(self, like):
        return accumulate_


def _centered(divergence):
    """The weights' column of KL in either direction (1: the teacher's, ``KL(q || p)``), whose
    row sums come from the statistics pass, as in the eager backend; None for the others."""
    if isinstance(divergence, KL):
        return 1
    return 0 if isinstance(divergence, ReverseKL) else None


@functools.cache
def _kernel(fn):
    """:meth:`CompiledBackend.kernel`: one compiled kernel per function, made once."""
    return _compiled(fn)


COMPILED = CompiledBackend()
