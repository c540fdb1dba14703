"""The backends that run the per-chunk stages, and the choice of one per call.

A backend (:class:`~topkd.backends.base.Backend`) supplies every per-chunk stage with one
signature; the engine drives whichever it is given and never asks which. Two today:

- ``"eager"`` (:mod:`topkd.backends.eager`): plain PyTorch on float32 work buffers.
- ``"compile"`` (:mod:`topkd.backends.compiled`): ``torch.compile`` kernels that read each
  chunk in its own dtype.

:func:`choose` turns a call's ``impl`` into one of them, once per call.
"""

from __future__ import annotations

import os
import warnings

import torch

from . import compiled
from .base import Backend
from .compiled import COMPILED
from .eager import EAGER

IMPLS = ("auto", "eager", "compile")
ENV = "TOPKD_IMPL"
_warned: set[str] = set()

__all__ = ["COMPILED", "EAGER", "ENV", "IMPLS", "Backend", "Unavailable", "across_ranks",
           "check_impl", "choose", "ready"]


def check_impl(impl) -> str:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    return impl


class Unavailable(Backend):
    """What ``impl="compile"`` gets in a process-group call where this machine cannot compile:
    a name for the call's exchange, so that the other ranks learn it there instead of waiting
    in it for a rank that raised, and then :func:`ready`'s RuntimeError on every rank."""

    name = "compile (unavailable)"

    def __init__(self, error: str):
        self.error = error


def choose(impl: str, device: torch.device, group=None) -> Backend:
    """The backend a call with ``impl`` on ``device`` runs.

    ``"auto"`` (the default) is replaced by ``$TOPKD_IMPL`` when that is set; it compiles when
    the platform can and otherwise runs eager, warning once per process and device type.
    ``"compile"`` where the platform cannot is a RuntimeError: at once, or with a process
    ``group``, an :class:`Unavailable` backend that raises it after the call's exchange
    (:func:`ready`), on every rank. Inside a region that
    ``torch.compile`` is tracing, or under a user's ``TorchFunctionMode`` (which dynamo
    cannot always trace through), the eager backend runs."""
    check_impl(impl)
    if impl == "auto" and os.environ.get(ENV):
        impl = os.environ[ENV]
        if impl not in IMPLS:
            raise ValueError(f"${ENV} must be one of {IMPLS}, got {impl!r}")
    if impl == "eager" or _is_compiling() or _function_mode_active():
        return EAGER
    missing = compiled.compiler_missing(device.type)
    if missing is None:
        return COMPILED
    if impl == "compile":
        error = (f"impl='compile' cannot run on {device.type}: {missing}; use impl='eager' "
                 f"or 'auto'")
        if group is not None:
            return Unavailable(error)
        raise RuntimeError(error)
    if device.type not in _warned:
        _warned.add(device.type)
        warnings.warn(f"topkd: impl='auto' runs the eager kernels on {device.type}: {missing}",
                      RuntimeWarning, stacklevel=3)
    return EAGER


def across_ranks(backend: Backend, options=None) -> dict:
    """:func:`topkd.parallel.exchange_shards`'s ``same`` for a call that runs ``backend``:
    every rank of a group must run the same kernels (their chunk heights, and so the
    collectives per chunk, differ), whatever chose them (``impl``, ``$TOPKD_IMPL``, a
    compiler missing on one machine), and with ``options`` (a :class:`~topkd.KDOptions`)
    the same loss options (:meth:`~topkd.KDOptions.across_ranks`)."""
    kernels = (backend.name, (EAGER.name, COMPILED.name, Unavailable.name))
    same = {"the loss kernels (impl)": kernels}
    if options is not None:
        same["the loss options"] = (options.across_ranks(), ())
    return same


def ready(backend: Backend) -> Backend:
    """``backend``, once the call's exchange has run; an :class:`Unavailable` one raises its
    RuntimeError (on every rank: the exchange made sure all chose alike)."""
    if isinstance(backend, Unavailable):
        raise RuntimeError(backend.error)
    return backend


def _is_compiling() -> bool:
    """Whether ``torch.compile`` is tracing this call (``torch.compiler.is_compiling`` from
    torch 2.3; dynamo's own before)."""
    is_compiling = getattr(torch.compiler, "is_compiling", None)
    return is_compiling() if is_compiling else torch._dynamo.is_compiling()


def _function_mode_active() -> bool:
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._device import DeviceContext

    return any(not isinstance(mode, DeviceContext)
               for mode in _get_current_function_mode_stack())
