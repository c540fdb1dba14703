"""Tensor parallel (vocabulary shards over a gloo group) against one process: the logits
losses, the fused LM-head losses and the compiled kernels between the collectives.

The work happens in tp_worker.py (and fused_tp_worker.py) inside spawned ranks; one spawn runs
many layouts and cases, because starting processes is slow, but the two-rank checks are two
spawns (logits, fused), and the compiled kernels' one is test_parallel_compiled.py, so that
pytest-xdist's workers (one file each) can share them. Every wait
has a timeout so that a bug fails the test instead of hanging it.
"""

import helpers
import pytest
import torch.distributed as dist
import tp_worker

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

DEADLINE_S = 600  # every check of the group, the compiled kernels' first build included


def _spawn(world, plan, tmp_path):
    helpers.spawn_ranks(tp_worker.worker, world, (world, plan, str(tmp_path)), tmp_path,
                        DEADLINE_S)


def test_two_ranks_logits(tmp_path):
    """The logits losses on three layouts and the communication volume."""
    _spawn(2, {
        "layouts": [
            (64, [32, 32], None),  # equal shards
            (37, [20, 17], None),  # unequal shards
            (40, [20, 20], 37),  # padded vocabulary: the last 3 columns are outside
        ],
        "communication": True,
    }, tmp_path)


def test_two_ranks_fused(tmp_path):
    """The fused losses on two layouts (float32, and bf16 on the first)."""
    _spawn(2, {
        "fused": [
            (37, [20, 17], None),  # unequal shards
            (40, [20, 20], 37),  # padded vocabulary: the last 3 weight rows are outside
        ],
    }, tmp_path)


def test_three_ranks(tmp_path):
    _spawn(3, {
        "layouts": [
            (37, [10, 15, 12], None),  # unequal shards, K=12 larger than rank 0's shard
            (42, [14, 14, 14], 37),  # padding inside the last shard
            (37, [10, 15, 12], 24),  # the last shard is padding only
        ],
        "fused": [
            (37, [10, 15, 12], None),  # unequal shards, K=12 larger than rank 0's shard
        ],
    }, tmp_path)
