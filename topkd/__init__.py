"""topkd: exact, memory-lean knowledge-distillation losses for huge vocabularies."""

from .fused import FusedLogitsKLLoss, FusedTopKLogitsKLLoss, fused_kl_loss, fused_topk_kl_loss
from .losses import LogitsKLLoss, TopKLogitsKLLoss, kl_loss, sparse_kl_loss, topk_kl_loss
from .select import SparseTeacher, select_topk

__all__ = [
    "FusedLogitsKLLoss",
    "FusedTopKLogitsKLLoss",
    "LogitsKLLoss",
    "SparseTeacher",
    "TopKLogitsKLLoss",
    "fused_kl_loss",
    "fused_topk_kl_loss",
    "kl_loss",
    "select_topk",
    "sparse_kl_loss",
    "topk_kl_loss",
]
