import getpass
import os
import sys
import tempfile

# Inductor compiles in this process rather than in a pool of compile workers: on a 2-core
# machine (and in every spawned rank) starting the pool costs more than it saves.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# Compiled kernels persist in inductor's on-disk cache, so a later run (and every worker and
# spawned rank) starts warm. pytest-xdist's workers may share it on POSIX: inductor writes each
# entry to a file of its own process and renames it into place, and builds each kernel under
# a file lock. On Windows a file another process holds open cannot be replaced, so there
# each worker (and the ranks it spawns) gets a directory of its own.
if (os.name == "nt" and os.environ.get("PYTEST_XDIST_WORKER")
        and "TORCHINDUCTOR_CACHE_DIR" not in os.environ):
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
        tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}",
        f"topkd-tests-{os.environ['PYTEST_XDIST_WORKER']}")

import pytest  # noqa: E402
import torch  # noqa: E402

# pytest-xdist's workers share the cores: each runs PyTorch (and the subprocesses it starts)
# on its share of the threads the machine would give one process. More threads than cores
# leave OpenMP's threads waiting on each other: a training step 10x slower. The machine's
# count stays in $TOPKD_TESTS_MACHINE_THREADS (helpers.machine_threads) for the tests that
# model it.
os.environ.setdefault("TOPKD_TESTS_MACHINE_THREADS", str(torch.get_num_threads()))
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    _threads = max(1, int(os.environ["TOPKD_TESTS_MACHINE_THREADS"]) // _workers)
    torch.set_num_threads(_threads)
    os.environ["OMP_NUM_THREADS"] = str(_threads)

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
# The package is importable from the repository root without installing; the test helpers
# (reference.py, helpers.py) live beside this file.
for _p in (_HERE, _ROOT):
    if _p not in sys.path:
        sys.path.insert(0, _p)

# The suite runs the eager kernels unless told otherwise (``TOPKD_IMPL=compile pytest``
# runs all of it compiled): the float64 reference matrix runs eager, and test_compiled.py
# compares the compiled kernels with the eager ones, one case per kernel variant.
os.environ.setdefault("TOPKD_IMPL", "eager")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield

