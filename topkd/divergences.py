"""The divergences ``D(q, p)`` between the teacher ``q`` and the student ``p``: one class each.

A divergence is a sum over buckets of an elementwise term ``f(log p_j, log q_j)``. A class
supplies that term twice:

- :meth:`Divergence.pointwise`: the term in plain, autograd-safe PyTorch. The Top-K losses sum
  it over the ``[rows, K+1]`` buckets (kept entries and the ghost) and take its gradient by
  autograd; the full-vocabulary losses use it too unless :meth:`~Divergence.terms` is given.
- :meth:`Divergence.terms`: for the full-vocabulary losses, per chunk of ``[rows, V]``
  float32 log-probabilities and probabilities, the term ``f`` and ``h = p * df/dp``, without
  autograd. The chunk gradient is then ``dD/da_j = h_j - p_j * sum_k h_k``. The base class
  derives ``h`` from :meth:`pointwise` by autograd; a class overrides it to save the passes.

A divergence is math only: how a backend passes over the chunks, what it holds in memory and
what it compiles are the engine's, the backends' and :mod:`topkd.memory`'s. So a new
divergence is one new class here with :meth:`pointwise` (and a name in ``_NAMES``); nothing
else changes. Every term whose weight is exactly 0 is exactly 0, never NaN, in value
and gradient.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from . import _checks

_NEG_INF = float("-inf")


def _weighted(weight: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``weight * value`` with exactly 0 where the weight is 0 (``0 * log 0 = 0``).

    ``value`` is replaced as well as the product, so autograd sees no ``0 * inf`` either."""
    dead = weight == 0
    return torch.where(dead, 0.0, weight * torch.where(dead, 0.0, value))


def _times(value: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``value *= weight`` in place, for :meth:`Divergence.terms`: where the weight is 0 and
    the value infinite the NaN this gives is counted as 0 by the engine."""
    return value.mul_(weight)


def kl_terms(log_w: torch.Tensor, log_o: torch.Tensor) -> torch.Tensor:
    """Elementwise ``w * (log w - log o)`` with ``0 * log 0 = 0``: the terms of ``KL(w || o)``."""
    return _weighted(log_w.exp(), log_w - log_o)


def log_mix(weight: float, log_x: torch.Tensor, log_y: torch.Tensor) -> torch.Tensor:
    """``log(weight * x + (1 - weight) * y)``, elementwise and autograd-safe where both are 0."""
    if weight == 0.0:
        return log_y
    if weight == 1.0:
        return log_x
    x = log_x + math.log(weight)
    y = log_y + math.log1p(-weight)
    both_dead = (x == _NEG_INF) & (y == _NEG_INF)
    out = torch.logaddexp(torch.where(both_dead, 0.0, x), torch.where(both_dead, 0.0, y))
    return torch.where(both_dead, _NEG_INF, out)


def _log_mix_(weight: float, log_x: torch.Tensor, log_y: torch.Tensor) -> torch.Tensor:
    """``log(weight * x + (1 - weight) * y)`` for :meth:`Divergence.terms` (0 < weight < 1),
    in log space: a mixture of probabilities that underflow float32 keeps its exact log."""
    return torch.logaddexp(log_x + math.log(weight), log_y + math.log1p(-weight))


class Divergence:
    """Base class: ``D(q, p) = sum_j f(log p_j, log q_j)`` over the buckets it is given."""

    name = "divergence"

    def pointwise(self, logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
        """Elementwise ``f`` of float32 log-probabilities (``-inf`` for zero mass)."""
        raise NotImplementedError

    def canonical(self) -> Divergence:
        """The divergence this one equals exactly (``JSD(beta=0)`` is :class:`KL`): the losses
        run that one, so the endpoints give the same numbers to the bit."""
        return self

    def buckets(self, logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
        """Per-row ``D`` over the last dimension of ``[n, buckets]`` log-probabilities."""
        return self.pointwise(logp, logq).sum(-1)

    def terms(self, logp, logq, p, q):
        """``(f, h)`` elementwise for a chunk, ``h = p * df/dp = df/dlogp``; ``logp``, ``logq``
        and ``q`` may be overwritten, ``p`` must be left as it is (the gradient needs it).
        This default differentiates :meth:`pointwise` by autograd."""
        with torch.enable_grad():
            lp = logp.detach().requires_grad_(True)
            f = self.pointwise(lp, logq)
            if not f.requires_grad:
                return f, torch.zeros_like(lp)
            (h,) = torch.autograd.grad(f.sum(), lp)
        return f.detach(), h

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def __eq__(self, other) -> bool:
        return type(self) is type(other) and repr(self) == repr(other)

    def __hash__(self) -> int:
        return hash(repr(self))


class _MixtureWeight(Divergence):
    """A divergence with one weight in [0, 1] (its single dataclass field: beta or alpha),
    checked at construction and shown by repr."""

    def __post_init__(self):
        (field,) = dataclasses.fields(self)
        name = f"{type(self).__name__} {field.name}"
        value = _checks.real(name, getattr(self, field.name), lambda x: 0.0 <= x <= 1.0,
                             "in [0, 1]")
        object.__setattr__(self, field.name, value)

    def __repr__(self) -> str:
        (field,) = dataclasses.fields(self)
        return f"{type(self).__name__}({field.name}={getattr(self, field.name)})"


class KL(Divergence):
    """``KL(q || p) = sum q (log q - log p)``: forward KL, the teacher as the target."""

    name = "kl"

    def pointwise(self, logp, logq):
        return kl_terms(logq, logp)

    def terms(self, logp, logq, p, q):
        return _times(logq.sub_(logp), q), q.neg_()


class ReverseKL(Divergence):
    """``KL(p || q) = sum p (log p - log q)``: reverse KL, mode-seeking."""

    name = "reverse_kl"

    def pointwise(self, logp, logq):
        return kl_terms(logp, logq)

    def terms(self, logp, logq, p, q):
        f = _times(logp.sub_(logq), p)
        return f, f + p


@dataclass(frozen=True, repr=False, eq=False)
class JSD(_MixtureWeight):
    """Generalized Jensen-Shannon divergence, TRL's and Liger-Kernel's convention.

    ``beta = 0``: exactly ``KL(q || p)``; ``beta = 1``: exactly ``KL(p || q)``; otherwise, with
    the mixture ``M = beta * q + (1 - beta) * p``: ``beta * KL(q || M) + (1 - beta) * KL(p || M)``.
    """

    beta: float = 0.5
    name = "jsd"

    def canonical(self) -> Divergence:
        return KL() if self.beta == 0.0 else ReverseKL() if self.beta == 1.0 else self

    def pointwise(self, logp, logq):
        beta = self.beta
        if beta in (0.0, 1.0):
            return self.canonical().pointwise(logp, logq)
        logm = log_mix(beta, logq, logp)
        return beta * kl_terms(logq, logm) + (1 - beta) * kl_terms(logp, logm)

    def terms(self, logp, logq, p, q):
        beta = self.beta
        if beta in (0.0, 1.0):
            return self.canonical().terms(logp, logq, p, q)
        logm = _log_mix_(beta, logq, logp)
        h = _times(logp.sub_(logm), p).mul_(1 - beta)  # (1 - beta) p (log p - log M)
        f = _times(logq.sub_(logm), q).mul_(beta).add_(h)
        return f, h


@dataclass(frozen=True, repr=False, eq=False)
class SkewKL(_MixtureWeight):
    """Skew KL (DistiLLM): ``KL(q || alpha * q + (1 - alpha) * p)``; ``alpha = 0`` is KL."""

    alpha: float = 0.1
    name = "skew_kl"

    def canonical(self) -> Divergence:
        return KL() if self.alpha == 0.0 else self

    def pointwise(self, logp, logq):
        if self.alpha == 1.0:  # KL(q || q)
            return torch.zeros_like(logp)
        return kl_terms(logq, log_mix(self.alpha, logq, logp))

    def terms(self, logp, logq, p, q):
        alpha = self.alpha
        if alpha == 1.0:
            return torch.zeros_like(p), torch.zeros_like(p)
        logm = _log_mix_(alpha, logq, logp)
        # p * df/dp = -(1 - alpha) q p / M, with p / M = exp(log p - log M) <= 1 / (1 - alpha)
        ratio = logp.sub_(logm).exp_()
        f = _times(logq.sub_(logm), q)
        return f, ratio.mul_(q).mul_(alpha - 1)


@dataclass(frozen=True, repr=False, eq=False)
class SkewReverseKL(_MixtureWeight):
    """Skew reverse KL (DistiLLM): ``KL(p || alpha * p + (1 - alpha) * q)``; ``alpha = 0`` is
    reverse KL."""

    alpha: float = 0.1
    name = "skew_reverse_kl"

    def canonical(self) -> Divergence:
        return ReverseKL() if self.alpha == 0.0 else self

    def pointwise(self, logp, logq):
        if self.alpha == 1.0:  # KL(p || p)
            return torch.zeros_like(logp)
        return kl_terms(logp, log_mix(self.alpha, logp, logq))

    def terms(self, logp, logq, p, q):
        alpha = self.alpha
        if alpha == 1.0:
            return torch.zeros_like(p), torch.zeros_like(p)
        log_ratio = logp.sub_(_log_mix_(alpha, logp, logq))  # log p - log M
        ratio = log_ratio.exp()  # p / M
        f = _times(log_ratio, p)
        # p * df/dp = p (log p - log M) + p (1 - alpha p / M)
        return f, ratio.mul_(-alpha).add_(1.0).mul_(p).add_(f)


class TVD(Divergence):
    """Total variation distance ``0.5 * sum |q - p|`` (its subgradient is 0 where ``p = q``)."""

    name = "tvd"

    def pointwise(self, logp, logq):
        return 0.5 * (logq.exp() - logp.exp()).abs()

    def terms(self, logp, logq, p, q):
        diff = p.sub(q)
        return diff.abs().mul_(0.5), diff.sign_().mul_(p).mul_(0.5)


class SampledCrossEntropy(Divergence):
    """Forward KL against a :class:`~topkd.SampledTeacher`, as the losses run it internally
    (not a registered name): over the buckets, ``-w log p`` with ``w = counts / samples`` the
    drawn tokens' weights (given in place of ``log q``). Its gradient w.r.t. the student's
    logits is ``p - w``, an unbiased estimate of ``KL(q || p)``'s ``p - q``."""

    name = "sampled_kl"

    def pointwise(self, logp, logw):
        return _weighted(logw.exp(), -logp)


SAMPLED_CE = SampledCrossEntropy()


def has_own_terms(divergence: Divergence) -> bool:
    """Whether ``divergence`` defines :meth:`Divergence.terms` itself (rather than deriving
    it from :meth:`~Divergence.pointwise` by autograd): a compiled backend can trace it."""
    return type(divergence).terms is not Divergence.terms


_NAMES = {cls.name: cls for cls in (KL, ReverseKL, JSD, SkewKL, SkewReverseKL, TVD)}


def register(name: str, factory) -> None:
    """Make ``divergence=name`` mean ``factory()`` everywhere a name is taken: the losses,
    ``KDConfig``, ``topkd distill --divergence`` (register before ``topkd.cli.main()``).
    ``factory``: a :class:`Divergence` subclass or any callable returning one."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    if not callable(factory):
        raise TypeError(f"factory must be callable (a Divergence class), got {factory!r}")
    if name in _NAMES and _NAMES[name] is not factory:
        raise ValueError(f"divergence {name!r} is registered already ({_NAMES[name]!r})")
    _NAMES[name] = factory


def names() -> list[str]:
    """The registered divergence names, sorted."""
    return sorted(_NAMES)


def resolve(divergence, reverse: bool = False) -> Divergence:
    """The divergence object for ``divergence=`` (a name, an object) and the legacy
    ``reverse=True`` (``"reverse_kl"``; an error with any other divergence)."""
    if not isinstance(reverse, bool):
        raise TypeError(f"reverse must be a bool, got {reverse!r}")
    if isinstance(divergence, str):
        if divergence not in _NAMES:
            raise ValueError(f"divergence must be one of {sorted(_NAMES)} or a "
                             f"topkd.Divergence object, got {divergence!r}")
        name, divergence = divergence, _NAMES[divergence]()
        if not isinstance(divergence, Divergence):
            raise TypeError(f"the factory registered as {name!r} returned "
                            f"{type(divergence).__name__}, not a topkd.Divergence")
    elif not isinstance(divergence, Divergence):
        raise TypeError(f"divergence must be a name {sorted(_NAMES)} or a topkd.Divergence "
                        f"object, got {type(divergence).__name__}")
    if reverse:
        if not isinstance(divergence, (KL, ReverseKL)):
            raise ValueError(f"reverse=True means divergence='reverse_kl' and cannot be "
                             f"combined with divergence={divergence!r}")
        return ReverseKL()
    return divergence.canonical()
