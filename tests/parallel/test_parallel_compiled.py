"""The compiled kernels between the tensor-parallel collectives, against one process (a file
of its own so that pytest-xdist runs it beside test_parallel.py; the ranks' work is
tp_worker.py's, as there)."""

import helpers
import pytest
import torch.distributed as dist
import tp_worker

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

DEADLINE_S = 600  # the first build of the compiled kernels included


def test_two_ranks_compiled(tmp_path):
    """The compiled kernels between the collectives (every rank compiles its own; a few cases,
    see tp_worker.COMPILED_CASES) on a padded layout."""
    plan = {"compiled": [(37, [20, 17], 34)], "edge_cases": False}  # (test_parallel.py's)
    helpers.spawn_ranks(tp_worker.worker, 2, (2, plan, str(tmp_path)), tmp_path, DEADLINE_S)
