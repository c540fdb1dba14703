"""What the Model-Optimizer criteria (generic and Megatron) share: their options, checked at
construction into one :class:`~topkd.KDOptions`."""

from __future__ import annotations

from .. import _checks
from ..options import KDOptions


def criterion_options(options: dict, allowed: frozenset[str], k: int | None = None,
                      **fixed) -> KDOptions:
    """``options`` (and ``fixed``) checked as a criterion's: only ``allowed`` keys, every value
    (ValueError or TypeError naming the option), and ``k`` within ``vocab_size`` when both are
    given."""
    checked = KDOptions.of(options, allowed=allowed, k=k, **fixed)
    if k is not None and checked.vocab_size is not None:
        _checks.integer("k", k, 1, checked.vocab_size)
    return checked
