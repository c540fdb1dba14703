"""The Model-Optimizer Megatron-plugin criteria; import them from
:mod:`topkd.integrations.modelopt`, which loads this module (and megatron-core) on first use."""

from __future__ import annotations

import torch

try:
    from modelopt.torch.distill.plugins.megatron import BaseLoss
except ImportError as e:
    raise ImportError('topkd.integrations.modelopt.TopKLogitsKLLoss / LogitsKLLoss need '
                      'nvidia-modelopt and megatron-core: pip install "topkd[megatron]"') from e

from .. import _checks
from . import megatron
from .modelopt import check_criterion_options


class TopKLogitsKLLoss(BaseLoss):
    """:func:`topkd.topk_kl_loss` as Model-Optimizer's Megatron ``TopKLogitsKLLoss``.

    Args:
        model_config: the student's ``TransformerConfig`` (see
            :func:`topkd.integrations.megatron.topk_kl_loss` for what is read from it).
        k: teacher entries kept individually; ``top_k=`` (Model-Optimizer's spelling) is the
            same. With the default ``normalize="full"`` the rest of the vocabulary is one exact
            ghost bucket; ``normalize="topk"`` is Model-Optimizer 0.47's loss.
        options: ``temperature``, ``divergence``, ``reverse``, ``top_p``, ``top_p_min_k``,
            ``normalize``, ``vocab_size`` (the real vocabulary, default the config's),
            ``chunk_bytes``, ``impl``; checked here, ValueError or TypeError naming the option.

    ``forward(predictions, targets)``: ``[s, b, V/TP]`` logits or ``(logits, bias)`` tuples ->
    ``(loss float32 [b, s], False, False)``, the loss whole on every rank (no ``tp_reduce``).
    No ``T**2`` factor.
    """

    def __init__(self, model_config, k: int | None = None, *, top_k: int | None = None,
                 **options):
        super().__init__(model_config)
        if k is not None and top_k is not None:
            raise TypeError(f"give k or top_k (the same option), not both: k={k}, top_k={top_k}")
        k = top_k if k is None else k
        if k is None:
            raise TypeError("TopKLogitsKLLoss needs k= (the number of teacher entries kept)")
        check_criterion_options(options, megatron.TOPK_OPTIONS)
        layout = megatron.vocab_layout(model_config, options.get("vocab_size"))
        megatron.tensor_parallel_size(model_config)
        self.k = _checks.integer("k", k, 1, layout.vocab_size)
        self.options = options

    def forward(self, predictions, targets) -> tuple[torch.Tensor, bool, bool]:
        loss = megatron.topk_kl_loss(predictions, targets, self.k, model_config=self._config,
                                     **self.options)
        return self.post_forward(loss.transpose(0, 1), tp_reduce=False,
                                 is_sequence_parallel=False)

    def extra_repr(self) -> str:
        return ", ".join([f"k={self.k}"] + [f"{n}={v!r}" for n, v in self.options.items()])


class LogitsKLLoss(BaseLoss):
    """:func:`topkd.kl_loss` (the whole vocabulary) as Model-Optimizer's Megatron
    ``LogitsKLLoss``; ``model_config``, options and ``forward`` as in
    :class:`TopKLogitsKLLoss` (``temperature``, ``divergence``, ``reverse``, ``vocab_size``,
    ``chunk_bytes``, ``impl``). Unlike Model-Optimizer's, the loss is whole on every rank:
    ``tp_reduce=False``."""

    def __init__(self, model_config, **options):
        super().__init__(model_config)
        check_criterion_options(options, megatron.KL_OPTIONS)
        megatron.vocab_layout(model_config, options.get("vocab_size"))
        megatron.tensor_parallel_size(model_config)
        self.options = options

    def forward(self, predictions, targets) -> tuple[torch.Tensor, bool, bool]:
        loss = megatron.kl_loss(predictions, targets, model_config=self._config, **self.options)
        return self.post_forward(loss.transpose(0, 1), tp_reduce=False,
                                 is_sequence_parallel=False)

    def extra_repr(self) -> str:
        return ", ".join(f"{n}={v!r}" for n, v in self.options.items())
