"""topkd: exact, memory-lean knowledge-distillation losses for huge vocabularies."""

from .divergences import JSD, KL, TVD, Divergence, ReverseKL, SkewKL, SkewReverseKL
from .engine import LossParts
from .entry import distill_loss
from .fused import FusedLogitsKLLoss, FusedTopKLogitsKLLoss, fused_kl_loss, fused_topk_kl_loss
from .losses import LogitsKLLoss, TopKLogitsKLLoss, kl_loss, sparse_kl_loss, topk_kl_loss
from .options import KDOptions
from .sampling import sample_teacher
from .select import select_topk
from .teacher import SampledTeacher, SparseTeacher

__all__ = [
    "JSD",
    "KL",
    "TVD",
    "Divergence",
    "FusedLogitsKLLoss",
    "KDOptions",
    "FusedTopKLogitsKLLoss",
    "LogitsKLLoss",
    "LossParts",
    "ReverseKL",
    "SkewKL",
    "SampledTeacher",
    "SkewReverseKL",
    "SparseTeacher",
    "TopKLogitsKLLoss",
    "distill_loss",
    "fused_kl_loss",
    "fused_topk_kl_loss",
    "kl_loss",
    "sample_teacher",
    "select_topk",
    "sparse_kl_loss",
    "topk_kl_loss",
]
