"""FSDP2: fused losses whose LM head is a DTensor sharded by vocabulary rows, in spawned gloo
ranks (the work is in fsdp_worker.py): training under ``fully_shard`` equal to one process
after three steps, both ``sharded_head`` designs, float32 against the float64 reference, and
bad input named before any collective. 3 ranks give uneven shards (13/13/11 of 37 rows)."""

import fsdp_worker
import helpers
import pytest
import torch.distributed as dist

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")
pytest.importorskip("torch.distributed.fsdp", reason="FSDP2 (fully_shard) is not available")
try:
    from torch.distributed.fsdp import fully_shard  # noqa: F401
except ImportError:
    pytest.skip("FSDP2 (fully_shard) is not available in this torch", allow_module_level=True)

DEADLINE_S = 300


def _spawn(world, plan, tmp_path):
    helpers.spawn_ranks(fsdp_worker.worker, world, (world, plan, str(tmp_path)), tmp_path,
                        DEADLINE_S)


def test_two_ranks(tmp_path):
    _spawn(2, ("errors", "reference", "training"), tmp_path)


def test_three_ranks(tmp_path):
    _spawn(3, ("errors", "reference", "training"), tmp_path)
