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

So a new divergence is one new class here with :meth:`pointwise` (and a name in ``_NAMES``);
nothing else changes. Every term whose weight is exactly 0 is exactly 0, never NaN, in value
and gradient.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from . import _checks, kernels
from .kernels import finite_or_zero

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
    # Float32 chunk-sized buffers the full-vocabulary math holds at once (the chunk budget):
    # the two chunks, their exponentials and what :meth:`terms` makes.
    buffers = 7
    backward_buffers = 7  # the same, for the gradient's pass (no collectives there)
    # Whether :meth:`terms`' ``h`` can be NaN (a zero weight times an infinite log); when it
    # cannot, the compiled gradient skips cleaning it.
    h_may_be_nan = True

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

    # The full-vocabulary math per chunk, driven by topkd.engine.DensePath: statistics of this
    # shard, the terms once the normalizers are global, the gradient. These defaults use
    # :meth:`terms`; a divergence may override them to need fewer passes (see _CenteredKL).

    def dense_statistics(self, a, b):
        """``(maxima [r, 2], sums [r, 2], state)`` of the chunks ``a = z/T``, ``b = t/T``."""
        return kernels.dense_statistics(a, b)

    def dense_terms(self, state, log_shift, scale):
        """``(D row sums, h row sums, gradient state)`` (see :func:`kernels.dense_terms`)."""
        return kernels.dense_terms(self, state, log_shift, scale)

    def dense_refresh(self, a, b, row_max, row_sum):
        """The gradient state of fresh chunks from the global row maxima and sums (backward)."""
        return kernels.dense_refresh(self, a, b, row_max, row_sum)

    def dense_gradient(self, state, h_sum, grad_kd, grad_norm_ce, temperature):
        """The chunk's ``d loss / d (logits)`` (see :func:`kernels.dense_gradient_`)."""
        return kernels.dense_gradient_(state, h_sum, grad_kd, grad_norm_ce, temperature)

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


class _CenteredKL(Divergence):
    """KL in either direction over the whole vocabulary in the passes of the plain KL: the
    terms are sums of ``exp(w) * (w - o)`` over the chunks centered on their maxima, so the
    exponentials are taken in place and no normalized log-probabilities are made."""

    buffers = 3  # the two chunks (their exponentials in place) and w - o
    backward_buffers = 2
    teacher_weighted = True  # KL(q || p): the teacher's q weights the terms

    def _columns(self):
        return (1, 0) if self.teacher_weighted else (0, 1)

    def dense_statistics(self, a, b):
        maxima = kernels.center_(a, b)
        w, o = (b, a) if self.teacher_weighted else (a, b)
        diff = w - o
        a.exp_()
        b.exp_()
        sums = torch.stack([a.sum(-1), b.sum(-1)], -1)
        return maxima, sums, (a, b, diff, sums)

    def dense_terms(self, state, log_shift, scale):
        ea, eb, diff, sums = state
        w, o = self._columns()
        e_w = (ea, eb)[w]
        # sum_j w_j (log w_j - log o_j), w_j = e_w * scale_w, log w_j = c_w - log_shift_w;
        # the reverse direction's gradient needs a - b again, so it keeps diff
        product = diff.mul_(e_w) if self.teacher_weighted else diff * e_w
        weighted = torch.nansum(product, -1)  # 0 * inf: a zero weight
        offset = torch.where(sums[:, w] > 0, log_shift[:, o] - log_shift[:, w], 0.0)
        f_sum = scale[:, w] * (weighted + offset * sums[:, w])
        f_sum = torch.where(torch.isnan(log_shift).any(-1), float("nan"), f_sum)
        mass = scale * sums  # this shard's share of p and q
        # h = -q for KL(q || p); h = p (log p - log q) + p for KL(p || q)
        h_sum = -mass[:, 1] if self.teacher_weighted else f_sum + mass[:, 0]
        return f_sum, h_sum, (ea, eb, log_shift, scale,
                              None if self.teacher_weighted else diff)

    def dense_refresh(self, a, b, row_max, row_sum):
        row_max = finite_or_zero(row_max)
        a.sub_(row_max[:, :1])
        b.sub_(row_max[:, 1:])
        diff = None if self.teacher_weighted else a - b
        return (a.exp_(), b.exp_(), row_sum.log(), 1 / row_sum, diff)

    def dense_gradient(self, state, h_sum, grad_kd, grad_norm_ce, temperature):
        ea, eb, log_shift, scale, diff = state
        # dD/da = h - p sum h, with p = ea * scale_p and q = eb * scale_q
        coef = (grad_kd * h_sum - grad_norm_ce) / temperature
        if self.teacher_weighted:  # h = -q
            ea.mul_((-coef * scale[:, 0])[:, None])
            return ea.sub_(eb.mul_((grad_kd * scale[:, 1] / temperature)[:, None]))
        # h = p (log p - log q + 1), log p - log q = (a - b) + log_shift_q - log_shift_p
        row = grad_kd * (log_shift[:, 1] - log_shift[:, 0] + 1) / temperature - coef
        diff.mul_((grad_kd / temperature)[:, None]).add_(row[:, None])
        grad = ea.mul_(scale[:, :1]).mul_(diff)
        return grad.nan_to_num_(0.0, float("inf"), _NEG_INF)


class KL(_CenteredKL):
    """``KL(q || p) = sum q (log q - log p)``: forward KL, the teacher as the target."""

    name = "kl"
    h_may_be_nan = False  # h = -q

    def pointwise(self, logp, logq):
        return kl_terms(logq, logp)

    def terms(self, logp, logq, p, q):
        return _times(logq.sub_(logp), q), q.neg_()


class ReverseKL(_CenteredKL):
    """``KL(p || q) = sum p (log p - log q)``: reverse KL, mode-seeking."""

    name = "reverse_kl"
    teacher_weighted = False
    buffers = backward_buffers = 4  # and a - b kept for the gradient

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
    buffers = backward_buffers = 6

    def pointwise(self, logp, logq):
        return 0.5 * (logq.exp() - logp.exp()).abs()

    def terms(self, logp, logq, p, q):
        diff = p.sub(q)
        return diff.abs().mul_(0.5), diff.sign_().mul_(p).mul_(0.5)


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
