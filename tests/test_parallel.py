"""Tensor parallel (vocabulary shards over a gloo group) against one process.

The work happens in tp_worker.py inside spawned ranks; each spawn runs several layouts and
cases, because starting processes is the slow part. Every wait has a timeout so that a bug
fails the test instead of hanging it.
"""

import socket
import time

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
import tp_worker

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

DEADLINE_S = 300


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _spawn(world, layouts, check_comm, tmp_path):
    ctx = mp.start_processes(tp_worker.worker,
                             args=(world, _free_port(), layouts, check_comm, str(tmp_path)),
                             nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + DEADLINE_S
    try:
        while not ctx.join(timeout=5):
            if time.monotonic() > deadline:
                pytest.fail(f"tensor-parallel ranks did not finish within {DEADLINE_S} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)
    reports = []
    for rank in range(world):
        path = tmp_path / f"rank{rank}.txt"
        assert path.exists(), f"rank {rank} wrote no result"
        text = path.read_text()
        if text != "OK":
            reports.append(f"--- rank {rank} ---\n{text}")
    assert not reports, "\n".join(reports)


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
