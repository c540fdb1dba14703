"""Tensor parallel (vocabulary shards over a gloo group) against one process.

The work happens in tp_worker.py inside spawned ranks; each spawn runs several layouts and
cases, because starting processes is the slow part. Every wait has a timeout so that a bug
fails the test instead of hanging it.
"""

import helpers
import pytest
import torch.distributed as dist
import tp_worker

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

DEADLINE_S = 300


def _spawn(world, layouts, check_comm, tmp_path):
    helpers.spawn_ranks(tp_worker.worker, world, (world, helpers.free_port(), layouts,
                                                  check_comm, str(tmp_path)), tmp_path,
                        DEADLINE_S)


def test_two_ranks(tmp_path):
    layouts = [
        (64, [32, 32], None),  # equal shards
        (37, [20, 17], None),  # unequal shards
        (40, [20, 20], 37),  # padded vocabulary: the last 3 columns are outside
    ]
    _spawn(2, layouts, True, tmp_path)


def test_three_ranks(tmp_path):
    layouts = [
        (37, [10, 15, 12], None),  # unequal shards, K=12 larger than rank 0's shard
        (42, [14, 14, 14], 37),  # padding inside the last shard
        (37, [10, 15, 12], 24),  # the last shard is padding only
    ]
    _spawn(3, layouts, False, tmp_path)


def test_two_ranks_compiled(tmp_path, monkeypatch):
    """The compiled kernels between the collectives (every rank compiles its own; a few
    cases, see tp_worker.COMPILED_CASES)."""
    monkeypatch.setenv("TOPKD_IMPL", "compile")
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "1")  # no compile-worker pool per rank
    helpers.spawn_ranks(tp_worker.compiled_worker, 2, (2, helpers.free_port(),
                                                       [(37, [20, 17], 34)], str(tmp_path)),
                        tmp_path, DEADLINE_S)
