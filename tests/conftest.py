import os
import sys

# Inductor compiles in this process rather than in a pool of compile workers: on a 2-core
# machine (and in every spawned rank) starting the pool costs more than it saves.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
# The package is importable from the repository root without installing; the test helpers
# (reference.py, helpers.py) live beside this file.
for _p in (_HERE, _ROOT):
    if _p not in sys.path:
        sys.path.insert(0, _p)

# The suite runs the eager kernels unless told otherwise (``TOPKD_IMPL=compile pytest``
# runs all of it compiled). The modules that check against the float64 reference run both
# implementations (``both_impls``), and test_compiled.py compares the two directly; compiled
# kernels are built once per process and shared by every test.
os.environ.setdefault("TOPKD_IMPL", "eager")


@pytest.fixture(params=["eager", "compile"])
def both_impls(request, monkeypatch):
    """Run the test with ``impl="auto"`` resolved to each implementation (the test's own
    processes and any ranks it spawns)."""
    monkeypatch.setenv("TOPKD_IMPL", request.param)
    return request.param


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
