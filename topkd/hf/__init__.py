"""Distillation with Hugging Face ``transformers``: :class:`KDTrainer` / :class:`KDConfig`, the
batch collator, and the TRL hook. Needs ``pip install "topkd[hf]"``."""

from .data import KDCollator
from .trainer import KDConfig, KDTrainer
from .trl import use_in_trl

__all__ = ["KDCollator", "KDConfig", "KDTrainer", "use_in_trl"]
