"""Benchmark of topkd's losses against the plain float32 implementation they replace.

Run ``python -m topkd.bench --help`` (or the ``topkd-bench`` console script). Every case runs in
its own fresh, memory-capped process; see :mod:`topkd.bench.__main__`.
"""
