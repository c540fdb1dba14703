"""Every option a loss takes, in one frozen object checked once: :class:`KDOptions`.

The public losses (:func:`topkd.topk_kl_loss`, :func:`topkd.kl_loss`, ...) keep their keyword
signatures; each builds a :class:`KDOptions` from its keywords and calls
:func:`topkd.distill_loss`. The Modules, ``KDConfig``, ``topkd distill``, the TRL hook and the
Megatron / Model-Optimizer criteria build one at construction and reuse it for every call. An
option added here is checked here and reaches every entry point that forwards ``**options``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from . import _checks
from .backends import IMPLS
from .divergences import Divergence, resolve
from .sharded import DESIGNS


@dataclass(frozen=True)
class KDOptions:
    """The options of a distillation loss; everything but the tensors.

    Fields (checked at construction: a ``TypeError``/``ValueError`` naming the option):
        k: teacher entries kept per row (Top-K with the exact ghost bucket); ``None``: the
            whole vocabulary (or a :class:`~topkd.SparseTeacher`'s own K).
        top_p, top_p_min_k: a nucleus cut of the K kept entries, keeping at least
            ``top_p_min_k`` (Top-K only).
        temperature: ``None`` (1.0, or a SparseTeacher's own) or > 0. No ``T**2`` factor.
        divergence: a registered name (:func:`topkd.divergences.names`) or a
            :class:`~topkd.Divergence`; stored as the object. ``reverse=True`` is the legacy
            spelling of ``"reverse_kl"`` and is folded into it.
        normalize: ``"full"`` (the ghost bucket) or ``"topk"`` (renormalized over the K).
        vocab_size: the real vocabulary when the logits are padded past it.
        ignore_index, kd_weight, ce_weight: the hard-label term; ``loss = kd_weight * KD +
            ce_weight * CE``.
        reduction: ``"none"``, ``"sum"`` or ``"mean"``.
        process_group: the tensor-parallel group of vocabulary-sharded logits, or ``None``.
        chunk_bytes: the float32 work budget per chunk of rows (``None``: the default).
        return_components: return ``LossParts(loss, kd, ce)``.
        impl: ``"auto"``, ``"eager"`` or ``"compile"`` (the kernels' backend).
        reduce_hidden_grad, logit_scale, softcap, teacher_logit_scale, teacher_softcap: a fused
            LM head's options (see :func:`topkd.fused_topk_kl_loss`); defaults elsewhere.
        sharded_head, gradient_divide_factor: a fused LM head that is a DTensor sharded by
            vocabulary rows (FSDP2): ``"vocab_parallel"`` or ``"gather"``, and what its
            gradient is divided by (``None``: the mesh size, FSDP's average); see
            :mod:`topkd.sharded`.
    """

    k: int | None = None
    top_p: float | None = None
    top_p_min_k: int = 1
    temperature: float | None = None
    divergence: Divergence | str = "kl"
    reverse: bool = False
    normalize: str = "full"
    vocab_size: int | None = None
    ignore_index: int = -100
    kd_weight: float = 1.0
    ce_weight: float = 0.0
    reduction: str = "none"
    process_group: Any = None
    chunk_bytes: int | None = None
    return_components: bool = False
    impl: str = "auto"
    reduce_hidden_grad: bool = False
    logit_scale: float = 1.0
    softcap: float | None = None
    teacher_logit_scale: float = 1.0
    teacher_softcap: float | None = None
    sharded_head: str = "vocab_parallel"
    gradient_divide_factor: float | None = None

    def __post_init__(self):
        checked = {
            "divergence": resolve(self.divergence, self.reverse),
            "reverse": False,
            "k": None if self.k is None else _checks.integer("k", self.k, 1),
            "temperature": (None if self.temperature is None
                            else _checks.temperature(self.temperature)),
            "normalize": _checks.choice("normalize", self.normalize, _checks.NORMALIZE),
            "vocab_size": (None if self.vocab_size is None
                           else _checks.integer("vocab_size", self.vocab_size, 1)),
            "ignore_index": _checks.integer("ignore_index", self.ignore_index, -(2**63)),
            "kd_weight": _checks.weight("kd_weight", self.kd_weight),
            "ce_weight": _checks.weight("ce_weight", self.ce_weight),
            "reduction": _checks.choice("reduction", self.reduction, _checks.REDUCTIONS),
            "chunk_bytes": _checks.chunk_bytes(self.chunk_bytes),
            "process_group": _checks.process_group(self.process_group),
            "impl": _checks.choice("impl", self.impl, IMPLS),
            "logit_scale": _checks.scale("logit_scale", self.logit_scale),
            "teacher_logit_scale": _checks.scale("teacher_logit_scale",
                                                 self.teacher_logit_scale),
            "softcap": _checks.softcap("softcap", self.softcap),
            "teacher_softcap": _checks.softcap("teacher_softcap", self.teacher_softcap),
            "sharded_head": _checks.choice("sharded_head", self.sharded_head, DESIGNS),
            "gradient_divide_factor": (
                None if self.gradient_divide_factor is None else
                _checks.real("gradient_divide_factor", self.gradient_divide_factor,
                             lambda x: x > 0, "> 0")),
        }
        checked["top_p"], checked["top_p_min_k"] = _checks.top_p(self.top_p, self.top_p_min_k)
        for name in ("return_components", "reduce_hidden_grad"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        for name, value in checked.items():
            object.__setattr__(self, name, value)

    @classmethod
    def names(cls) -> frozenset[str]:
        """Every option's name."""
        return frozenset(f.name for f in dataclasses.fields(cls))

    @classmethod
    def of(cls, options: dict, *, allowed: frozenset[str] | None = None,
           **fixed) -> KDOptions:
        """``KDOptions(**fixed, **options)``, naming any key of ``options`` that is not an
        option (or not in ``allowed``) in a ``TypeError``."""
        allowed = cls.names() if allowed is None else allowed
        unknown = set(options) - allowed
        if unknown:
            raise TypeError(f"unknown loss options {sorted(unknown)}; allowed: "
                            f"{sorted(allowed)}")
        return cls(**fixed, **options)

    def replace(self, **changes) -> KDOptions:
        """A copy with ``changes`` (checked again)."""
        return dataclasses.replace(self, **changes)

    def across_ranks(self) -> str:
        """The options every rank of a tensor-parallel group must share, as text alike in every
        process: all that differ from their defaults but the group, ``impl`` (the kernels it
        chose are compared as such) and ``return_components``. (``k``, ``temperature``,
        ``vocab_size`` or ``chunk_bytes`` differing across ranks gave a silently wrong loss,
        or a collective aborted or waited.) A value without a ``repr`` of its own (a user's
        divergence) is named by its class and attributes: the default ``repr`` holds an
        address."""
        def text(value):
            if type(value).__repr__ is object.__repr__:
                return f"{type(value).__qualname__}{sorted(vars(value).items())}"
            return repr(value)

        given = self.given()
        for name in ("process_group", "impl", "return_components"):
            given.pop(name, None)
        return ", ".join(f"{name}={text(value)}" for name, value in sorted(given.items())) \
            or "defaults"

    def given(self) -> dict:
        """The options that differ from their defaults (what a ``repr`` shows)."""
        default = KDOptions()
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) != getattr(default, f.name)}

    def __repr__(self) -> str:
        return f"KDOptions({', '.join(f'{n}={v!r}' for n, v in self.given().items())})"


def keywords(arguments: dict, *tensors: str) -> dict:
    """A public function's options from its ``locals()``: everything but the named tensor
    arguments and the per-call ``mask`` and ``labels``."""
    skip = {*tensors, "mask", "labels"}
    return {name: value for name, value in arguments.items() if name not in skip}


# The options each public function takes (besides its tensors and ``mask``/``labels``).
_COMMON = frozenset({"temperature", "divergence", "reverse", "vocab_size", "reduction",
                     "process_group", "chunk_bytes", "ignore_index", "kd_weight", "ce_weight",
                     "return_components", "impl"})
_TOPK = frozenset({"top_p", "top_p_min_k", "normalize"})
_FUSED = frozenset({"reduce_hidden_grad", "logit_scale", "softcap", "teacher_logit_scale",
                    "teacher_softcap", "sharded_head", "gradient_divide_factor"})
KL_OPTIONS = _COMMON
TOPK_OPTIONS = _COMMON | _TOPK
FUSED_KL_OPTIONS = _COMMON | _FUSED
FUSED_TOPK_OPTIONS = _COMMON | _TOPK | _FUSED
