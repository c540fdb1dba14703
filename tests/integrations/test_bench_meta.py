"""What every benchmark section records about the machine it ran on (``run_meta``) and
prints under its table (``load_line``)."""

from __future__ import annotations

import sys

import torch

from benchmarks import harness


def test_run_meta_names_the_cpu_and_its_isa():
    meta = harness.run_meta("core", ["--rows", "8"], 0.0, harness.loadavg())
    assert meta["command"] == "python -m benchmarks core --rows 8"
    assert meta["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    if sys.platform.startswith("linux"):
        with open("/proc/cpuinfo") as f:
            names = {line.split(":", 1)[1].strip() for line in f if line.startswith("model name")}
        assert meta["cpu_model"] in names
    line = harness.load_line(meta)
    assert line.startswith(f"{meta['cpus']} CPUs (")
    assert meta["cpu_capability"] in line and "load average" in line


def test_load_line_without_the_cpu_fields():
    """A JSON saved before the CPU was recorded still prints."""
    meta = {"cpus": 2, "loadavg_start": [1.0, 1.0, 1.0], "loadavg_end": [2.0, 1.0, 1.0],
            "total_s": 10.0}
    assert harness.load_line(meta) == ("2 CPUs; load average (1 min) 1.00 at the start, 2.00 at "
                                       "the end; total 10 s.")
