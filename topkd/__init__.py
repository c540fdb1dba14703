"""topkd: exact, memory-lean knowledge-distillation losses for huge vocabularies."""

from .losses import LogitsKLLoss, TopKLogitsKLLoss, kl_loss, sparse_kl_loss, topk_kl_loss
from .select import SparseTeacher, select_topk

__all__ = [
    "LogitsKLLoss",
    "SparseTeacher",
    "TopKLogitsKLLoss",
    "kl_loss",
    "select_topk",
    "sparse_kl_loss",
    "topk_kl_loss",
]
