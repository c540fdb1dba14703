"""Benchmark of topkd's losses against the implementations they replace.

Run ``python -m topkd.bench --help`` (or the ``topkd-bench`` console script). Three sections,
one file each: :mod:`~topkd.bench.core`, :mod:`~topkd.bench.fused` and
:mod:`~topkd.bench.store`; they share one harness (:mod:`~topkd.bench.harness`: every case in
its own fresh, memory-capped process, profiler peak memory, timing, saved results) and one set
of float64 references (:mod:`~topkd.bench.reference`).
"""
