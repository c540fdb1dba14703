"""Fused LM-head losses under tensor parallelism (gloo ranks) against one process.

The work happens in fused_tp_worker.py inside spawned ranks, launched with test_parallel's
launcher (free port, per-rank result files, a deadline so that a bug fails instead of hanging);
each spawn runs every case for several vocabulary layouts.
"""

import fused_tp_worker
import pytest
import test_parallel as _tp
import torch.distributed as dist

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


def _spawn(monkeypatch, world, layouts, with_bf16, tmp_path):
    # test_parallel._spawn starts ``tp_worker.worker``; point it at the fused worker.
    monkeypatch.setattr(_tp, "tp_worker", fused_tp_worker)
    _tp._spawn(world, layouts, with_bf16, tmp_path)


def test_fused_two_ranks(monkeypatch, tmp_path):
    layouts = [
        (37, [20, 17], None),  # unequal shards
        (40, [20, 20], 37),  # padded vocabulary: the last 3 weight rows are outside
    ]
    _spawn(monkeypatch, 2, layouts, True, tmp_path)


def test_fused_three_ranks(monkeypatch, tmp_path):
    layouts = [
        (37, [10, 15, 12], None),  # unequal shards, K=12 larger than rank 0's shard
    ]
    _spawn(monkeypatch, 3, layouts, True, tmp_path)
