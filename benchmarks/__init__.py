"""Benchmarks of topkd's losses against the implementations they replace.

Not part of the installed package: run them from a checkout of the repository, at its root,
as ``python -m benchmarks [section] [options]`` (``python -m benchmarks --help``; each
section has its own ``--help``). From another directory, put the repository root on
``PYTHONPATH``. Six sections, one file each: :mod:`~benchmarks.core` (no section name),
:mod:`~benchmarks.fused`, :mod:`~benchmarks.store`, :mod:`~benchmarks.compiling`
(``compile``), :mod:`~benchmarks.trainer` and :mod:`~benchmarks.megatron`. They share one
harness (:mod:`~benchmarks.harness`: every case in its own fresh, memory-capped process,
profiler peak memory, timing, saved results), and their float64 reference is the test
suite's, ``tests/reference.py`` (one reference in the repository), imported as
``reference`` once this package has put ``tests/`` on ``sys.path``. ``benchmarks/gpu.sh``
runs the core, fused and Megatron sections and the CUDA tests on one GPU (``--device cuda``);
``benchmarks/gpu_trainer.sh`` runs ``topkd distill`` under DDP, FSDP2 and DeepSpeed ZeRO-3
(its Python side: :mod:`~benchmarks.sharded_trainer`).
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
"""The repository root: the directory that holds this package (and, in a checkout, topkd)."""

# tests/ first on the path, as the test suite's conftest.py puts it: ``import reference`` is
# the suite's float64 reference, never a module of that name from elsewhere.
_TESTS = os.path.join(ROOT, "tests")
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)
