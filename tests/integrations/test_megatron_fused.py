"""The fused Megatron criterion (topkd.integrations.megatron_fused and the Model-Optimizer
classes on it) and offline distillation from a topkd store in Megatron's layout, with the real
libraries in two gloo ranks of megatron-core's parallel_state (TP = 2; see megatron_worker.py):

- the fused criterion equals ColumnParallelLinear + the logits criterion, with sequence
  parallelism off and on: loss, and the gradients of the hidden states, weight and bias shards;
- store rows attached by global sample index (a Megatron-style sampler from a resume point, the
  default collate) give the [s, b, V/TP] sparse and fused losses of one process at V = 262,144;
- GPTModel at TP = 2 distilled through Model-Optimizer's DistillationModel with the fused
  criterion: the same KD curve as the logits criterion, falling. Two patches of megatron-core
  make it run on the CPU (GlobalMemoryBuffer allocates on CUDA; CudaRNGStatesTracker.fork needs
  a CUDA RNG state): they are megatron's CUDA-only buffers, not topkd behaviour
  (megatron_worker.cpu_patches);
- the errors for an unfused student, a kept LM loss and a store batch in the wrong layout.

One spawn of two ranks for everything: each rank imports megatron-core and Model-Optimizer
once (most of this file's time); this process imports neither.
"""

import importlib.util
import json

import pytest
import torch.distributed as dist

pytestmark = [
    pytest.mark.skipif(any(importlib.util.find_spec(m) is None
                           for m in ("megatron.core", "modelopt", "safetensors")),
                       reason="needs megatron-core, nvidia-modelopt and safetensors"),
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                       reason="torch.distributed with gloo is not available"),
]

import helpers  # noqa: E402
import megatron_worker  # noqa: E402

DEADLINE_S = 240  # a hang in a collective fails the test instead of hanging the suite


def test_fused_criterion_store_and_gpt_distillation_at_tp2(tmp_path):
    store = tmp_path / "store"
    megatron_worker.build_store(str(store))
    helpers.spawn_ranks(megatron_worker.worker, 2, (2, str(store), str(tmp_path)), tmp_path,
                        DEADLINE_S)
    for case, values in json.loads((tmp_path / "metrics.json").read_text()).items():
        shown = ", ".join(f"{k} {v:.1e}" if isinstance(v, float) else
                          f"{k} {[float(f'{x:.3g}') for x in v]}" for k, v in values.items())
        print(f"\n  {case}: {shown}")
