"""Compiled per-chunk kernels (``impl="compile"``) and the choice of implementation.

Each kernel reads a chunk as it comes from its source (``low``, ``[r, W]`` in the logits' own
dtype) and returns per-row statistics or the chunk's gradient: the widening, logit transform,
exponentials and sums run as one fused loop per result under ``torch.compile`` (inductor: C++
on CPU, Triton on CUDA), so no float32 copy of the chunk is made. They compute what the eager
kernels of :mod:`topkd.kernels` compute, in the same order of operations per element (sums may
be reassociated: equal to float32 rounding); nothing in them depends on the device.

Compiled once per process per variant (dtype, divergence, options) with dynamic shapes, so a
run whose row count or vocabulary changes does not recompile; inductor's on-disk cache makes
later processes start fast.
"""

from __future__ import annotations

import functools
import logging
import os
import warnings

import torch

NEG_INF = float("-inf")
IMPLS = ("auto", "eager", "compile")
ENV = "TOPKD_IMPL"
# Variants (dtype, divergence, options, shape specializations) that one kernel may compile for
# in a process; dynamo's own default (8) is shared by all callers of one code object.
_RECOMPILE_LIMIT = 256
_warned: set[str] = set()


# ---- which implementation ----------------------------------------------------------------


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


def check_impl(impl) -> str:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    return impl


def use_compile(impl: str, device: torch.device) -> bool:
    """Whether a call with ``impl`` on ``device`` runs the compiled kernels.

    ``"auto"`` (the default) is replaced by ``$TOPKD_IMPL`` when that is set; it compiles when
    the platform can and otherwise runs eager, warning once per process and device type.
    ``"compile"`` where the platform cannot is a RuntimeError. Inside a region that
    ``torch.compile`` is tracing, or under a user's ``TorchFunctionMode`` (which dynamo
    cannot always trace through), the eager kernels run."""
    check_impl(impl)
    if impl == "auto" and os.environ.get(ENV):
        impl = os.environ[ENV]
        if impl not in IMPLS:
            raise ValueError(f"${ENV} must be one of {IMPLS}, got {impl!r}")
    if impl == "eager" or _is_compiling() or _function_mode_active():
        return False
    missing = compiler_missing(device.type)
    if missing is None:
        return True
    if impl == "compile":
        raise RuntimeError(f"impl='compile' cannot run on {device.type}: {missing}; use "
                           f"impl='eager' or 'auto'")
    if device.type not in _warned:
        _warned.add(device.type)
        warnings.warn(f"topkd: impl='auto' runs the eager kernels on {device.type}: {missing}",
                      RuntimeWarning, stacklevel=3)
    return False


def _is_compiling() -> bool:
    is_compiling = getattr(torch.compiler, "is_compiling", None)  # torch >= 2.3
    return is_compiling() if is_compiling else torch._dynamo.is_compiling()


def _function_mode_active() -> bool:
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._device import DeviceContext

    return any(not isinstance(mode, DeviceContext)
               for mode in _get_current_function_mode_stack())


def _compiled(fn=None, *, rows: bool = True):
    """``fn`` compiled lazily (once per process, dynamic shapes), called with a recompile
    limit of its own.

    ``rows``: every tensor argument and result is row-major ``[r, ...]``, and a call with one
    row runs as two (the row twice, the result's first row kept). A kernel built for a static
    size of one (dynamo specializes sizes 0 and 1) may sum a row in another order than the one
    built for any height, and a row's result must not depend on how the rows were chunked."""
    if fn is None:
        return functools.partial(_compiled, rows=rows)
    state = {}

    @functools.wraps(fn)
    def call(*args):
        if "fn" not in state:
            state["fn"] = torch.compile(fn, dynamic=True)
        _announce(fn.__name__, args)
        single = rows and next(a for a in args if isinstance(a, torch.Tensor)).shape[0] == 1
        if single:
            args = tuple(torch.cat([a, a]) if isinstance(a, torch.Tensor) else a for a in args)
        with torch._dynamo.config.patch(_recompile_limits()):
            out = state["fn"](*args)
        if not single:
            return out
        if isinstance(out, torch.Tensor):
            return out[:1]
        return tuple(x[:1] for x in out)

    call.eager = fn
    return call


def _recompile_limits() -> dict:
    """Dynamo's recompile limits for one kernel, under this torch's names for them (older
    torch names them ``cache_size_limit``)."""
    old = not hasattr(torch._dynamo.config, "recompile_limit")
    name = "cache_size_limit" if old else "recompile_limit"
    return {name: _RECOMPILE_LIMIT, f"accumulated_{name}": 4 * _RECOMPILE_LIMIT}


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


def _logits(low, scale, softcap):
    """The transformed logits in float32, as :func:`topkd.kernels.logits_` computes them."""
    z = low.float()
    if softcap is None:
        return z * scale
    return torch.tanh(z * (scale / softcap)) * softcap


def _derivative(low, scale, softcap):
    """d(transformed)/d(raw) at ``low``, as :func:`topkd.kernels.logits_grad_` computes it."""
    if softcap is None:
        return scale
    t = torch.tanh(low.float() * (scale / softcap))
    return (1.0 - t * t) * scale


def _at(low, columns):
    """``low`` gathered at ``columns`` ``[r, K]`` (the spare column ``W`` gives -inf)."""
    width = low.shape[1]
    inside = columns < width
    values = low.gather(1, torch.where(inside, columns, 0))
    return inside, values


def _normalizer(z):
    m = z.amax(-1)
    return m, torch.exp(z - _finite(m)[:, None]).sum(-1)


def _label_statistics(low, labels, scale, softcap, ce):
    """The label's logit at temperature 1 (-inf where it is elsewhere) and, with ``ce``, the
    temperature-1 normalizer ``(max, centered sum)``."""
    out = ()
    if labels is not None:
        inside, values = _at(low, labels[:, None])
        out += (torch.where(inside, _logits(values, scale, softcap), NEG_INF)[:, 0],)
    if ce:
        out += _normalizer(_logits(low, scale, softcap))
    return out


def _ce_gradient(grad, low, columns, labels, g_ce, ce_max, ce_sum, scale, softcap):
    """``grad`` (w.r.t. the transformed logits at ``columns``, or every column when None) plus
    the CE gradient not folded into the normalizer: ``g * softmax(z)`` at temperature 1 (with
    ``ce_max``) and ``-g`` at the label."""
    if labels is None:
        return grad
    if ce_max is not None:
        z = _logits(low, scale, softcap)
        coef = g_ce / ce_sum.clamp_min(1e-38)
        grad = grad + torch.exp(z - _finite(ce_max)[:, None]) * coef[:, None]
    if columns is None:
        columns = torch.arange(low.shape[1], device=low.device)[None, :]
    return grad - torch.where(columns == labels[:, None], g_ce[:, None], 0.0)


# ---- Top-K / sparse teacher ---------------------------------------------------------------


def kept_bias(columns: torch.Tensor, width: int) -> torch.Tensor:
    """Float32 ``[r, width + 1]``: -inf at ``columns``, 0 elsewhere (made eagerly: a scatter
    inside a compiled kernel, or a mask read through ``where``, keeps inductor's reduction
    from vectorizing)."""
    bias = torch.zeros(columns.shape[0], width + 1, device=columns.device)
    return bias.scatter_(1, columns, NEG_INF)


@_compiled
def sparse_statistics(low, columns, bias, labels, temperature, scale, softcap, ce: bool):
    """``(selected [r, K], ghost max [r], ghost centered sum [r], *label statistics)`` of a
    chunk, as :func:`topkd.kernels.read` + :func:`~topkd.kernels.sparse_statistics` give;
    ``bias`` is :func:`kept_bias` of ``columns``."""
    width = low.shape[1]
    rest = _logits(low, scale, softcap) / temperature + bias[:, :width]
    rest_max = rest.amax(-1)
    rest_sum = torch.exp(rest - _finite(rest_max)[:, None]).sum(-1)
    inside, values = _at(low, columns)
    selected = torch.where(inside, _logits(values, scale, softcap) / temperature, NEG_INF)
    return (selected, rest_max, rest_sum, *_label_statistics(low, labels, scale, softcap, ce))


@_compiled
def sparse_gradient(low, columns, labels, row_max, total, rest_max, rest_sum, selected,
                    grad_sel, grad_norm, grad_rest, g_ce, ce_max, ce_sum, temperature, scale,
                    softcap, dtype: torch.dtype):
    """The chunk's ``d loss / d (raw logits)`` ``[r, W + 1]`` in ``dtype`` (the last column is
    junk), as :func:`~topkd.kernels.sparse_gradient_` and the CE and transform steps after it
    give: ghost entries in one pass over the chunk, kept ones computed at ``[r, K]`` and
    scattered over them."""
    r, width = low.shape
    has_rest = rest_sum > 0
    ghost = grad_norm * torch.exp(rest_max - row_max) / total
    ghost = ghost + torch.where(has_rest, grad_rest / rest_sum.clamp_min(1e-38), 0.0)
    ghost = torch.where(has_rest, ghost, 0.0) / temperature
    a = _logits(low, scale, softcap) / temperature
    grad = torch.exp(a - _finite(rest_max)[:, None]) * ghost[:, None]
    grad = _ce_gradient(grad, low, None, labels, g_ce, ce_max, ce_sum, scale, softcap)
    grad = grad * _derivative(low, scale, softcap)

    kept = torch.exp(selected - row_max[:, None]) * (grad_norm / total)[:, None]
    kept = (kept + grad_sel) / temperature
    _, values = _at(low, columns)
    kept = _ce_gradient(kept, values, columns, labels, g_ce, ce_max, ce_sum, scale, softcap)
    kept = kept * _derivative(values, scale, softcap)
    out = torch.cat([grad.to(dtype), torch.zeros(r, 1, dtype=dtype, device=low.device)], 1)
    return out.scatter(1, columns, kept.to(dtype))


# ---- full vocabulary ----------------------------------------------------------------------


def _both(low_s, low_t, temperature, scale, softcap, t_scale, t_softcap):
    return (_logits(low_s, scale, softcap) / temperature,
            _logits(low_t, t_scale, t_softcap) / temperature)


@_compiled
def dense_statistics(low_s, low_t, labels, temperature, scale, softcap, t_scale, t_softcap,
                     ce: bool):
    """``(maxima [r, 2], sums [r, 2], *label statistics)`` of this shard's chunks (the
    student's logit transform ``scale``/``softcap``, the teacher's ``t_scale``/``t_softcap``)."""
    a, b = _both(low_s, low_t, temperature, scale, softcap, t_scale, t_softcap)
    (ma, sa), (mb, sb) = _normalizer(a), _normalizer(b)
    label = _label_statistics(low_s, labels, scale, softcap, ce)
    return (torch.stack([ma, mb], -1), torch.stack([sa, sb], -1), *label)


def _terms(divergence, low_s, low_t, center, log_shift, inverse, temperature, *transforms):
    """``(p, f, h)`` of the divergence over the chunk: ``log p = (a - center) - log_shift``,
    ``p = exp(a - center) * inverse`` (likewise ``q``), as :func:`topkd.kernels.dense_terms`
    (``inverse``: its ``scale``)."""
    a, b = _both(low_s, low_t, temperature, *transforms)
    # (columns by index, not by slice: a slice of the size-2 dimension is not provably 1 wide
    # under dynamic shapes)
    a, b = a - center[:, 0, None], b - center[:, 1, None]
    logp, logq = a - log_shift[:, 0, None], b - log_shift[:, 1, None]
    p, q = torch.exp(a) * inverse[:, 0, None], torch.exp(b) * inverse[:, 1, None]
    f, h = divergence.terms(logp, logq, p, q)
    return p, f, _nan_to_zero(h) if divergence.h_may_be_nan else h


@_compiled
def dense_terms(divergence, low_s, low_t, center, log_shift, inverse, temperature, scale,
                softcap, t_scale, t_softcap):
    """``(D row sums, h row sums)`` of this shard; a term whose weight is 0 counts 0, a NaN in
    the inputs reaches the row through ``log_shift``."""
    _, f, h = _terms(divergence, low_s, low_t, center, log_shift, inverse, temperature, scale,
                     softcap, t_scale, t_softcap)
    f_sum = torch.where(torch.isnan(log_shift).any(-1), float("nan"), _nan_to_zero(f).sum(-1))
    return f_sum, h.sum(-1)


@_compiled
def dense_gradient(divergence, low_s, low_t, labels, row_max, row_sum, h_sum, g_kd,
                   g_norm_ce, g_ce, ce_max, ce_sum, temperature, scale, softcap, t_scale,
                   t_softcap, dtype: torch.dtype):
    """The chunk's ``d loss / d (raw student logits)`` ``[r, W]`` in ``dtype`` from the global
    row maxima and sums ``[r, 2]``: ``(g_kd * (h - p sum h) + g_ce * p) / T`` and the CE and
    transform steps, as :func:`~topkd.kernels.dense_gradient_` and those after it."""
    p, _, h = _terms(divergence, low_s, low_t, _finite(row_max), row_sum.log(), 1 / row_sum,
                     temperature, scale, softcap, t_scale, t_softcap)
    coef = g_kd * h_sum - g_norm_ce
    grad = (h * g_kd[:, None] - p * coef[:, None]) / temperature
    grad = _ce_gradient(grad, low_s, None, labels, g_ce, ce_max, ce_sum, scale, softcap)
    return (grad * _derivative(low_s, scale, softcap)).to(dtype)


# ---- the teacher's selection and the fused head's accumulators ----------------------------


@_compiled
def read(low, temperature, scale, softcap):
    """``logits / T`` of a chunk as a new float32 buffer (the selection sorts it)."""
    return _logits(low, scale, softcap) / temperature


@_compiled
def log_sum_exp(b, center):
    """``log sum exp(b - center)`` of each row of ``b`` ``[r, W]`` (``center`` ``[r]``, 0
    where it is not finite)."""
    return torch.exp(b - _finite(center)[:, None]).sum(-1).log()


@_compiled(rows=False)
def accumulate_(accumulator, product):
    """``accumulator += product`` (float32 += any float dtype) in one pass, in place."""
    accumulator.add_(product.float())
