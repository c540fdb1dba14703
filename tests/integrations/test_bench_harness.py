"""The benchmark harness: what every section records about the machine it ran on
(``run_meta``) and prints under its table (``load_line``), and how it reads a peak from the
profiler's allocator events (``running_peak``, ``counted``)."""

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
            text = f.read()
        names = {line.split(":", 1)[1].strip() for line in text.splitlines()
                 if line.startswith("model name")}
        assert meta["cpu_model"] in names
        fields = dict((k.strip(), v.strip()) for k, _, v in
                      (line.partition(":") for line in text.split("\n\n")[0].splitlines()))
        if "cpu family" in fields:  # x86
            assert meta["cpu_family"] == f"family {fields['cpu family']} model {fields['model']}"
            assert meta["cpu_family"] in harness.load_line(meta)
    line = harness.load_line(meta)
    assert line.startswith(f"{meta['cpus']} CPUs (")
    assert meta["cpu_capability"] in line and "load average" in line


def test_load_line_names_the_cpu_generation():
    meta = {"cpus": 2, "loadavg_start": [1.0] * 3, "loadavg_end": [1.0] * 3, "total_s": 1.0,
            "cpu_model": "AMD EPYC", "cpu_family": "family 25 model 1", "cpu_capability": "AVX2"}
    assert harness.load_line(meta).startswith("2 CPUs (AMD EPYC family 25 model 1, AVX2); ")


def test_load_line_without_the_cpu_fields():
    """A JSON saved before the CPU was recorded still prints."""
    meta = {"cpus": 2, "loadavg_start": [1.0, 1.0, 1.0], "loadavg_end": [2.0, 1.0, 1.0],
            "total_s": 10.0}
    assert harness.load_line(meta) == ("2 CPUs; load average (1 min) 1.00 at the start, 2.00 at "
                                       "the end; total 10 s.")


MiB = 2**20


def _events(*steps):
    """``allocations``-shaped events from ``(ptr, signed bytes)`` steps, in order."""
    return [(i, i, ptr, size, ()) for i, (ptr, size) in enumerate(steps)]


def test_running_peak_is_the_running_sum():
    events = _events((1, 10 * MiB), (2, 5 * MiB), (1, -10 * MiB), (3, 8 * MiB), (2, -5 * MiB))
    assert harness.running_peak(events) == (15 * MiB, 8 * MiB)


def test_running_peak_leaves_out_the_free_of_an_earlier_block():
    """The profiler reports the free of a block allocated under an earlier profiler (kept alive
    in between), not its allocation: that free is left out, so what was there before does not
    read against the step. Shown with two real profiled regions, then on made-up events."""
    def profiled(fn):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                    profile_memory=True) as prof:
            fn()
        return harness.allocations(prof)

    kept = []
    profiled(lambda: kept.append(torch.zeros(1024)))

    def step():
        kept.clear()  # frees the earlier region's 4 KiB block
        torch.ones(10)

    allocs = profiled(step)
    assert [e[3] for e in allocs if e[3] < 0][0] == -4096  # the profiler does report it
    assert -4096 not in harness.counted(allocs)
    assert harness.running_peak(allocs)[0] > 0
    made_up = _events((7, -6 * MiB), (1, 10 * MiB), (1, -10 * MiB))
    assert harness.running_peak(made_up) == (10 * MiB, 0)


def test_running_peak_frees_what_a_reused_address_held():
    """A block freed where the profiler does not see (no free event) leaves the sum when its
    address is handed out again, not never: the peak is what was live, not an overcount."""
    unseen = _events((1, 10 * MiB), (2, 10 * MiB), (1, 10 * MiB), (2, 10 * MiB), (3, 4 * MiB),
                     (3, -4 * MiB))
    assert harness.running_peak(unseen) == (24 * MiB, 20 * MiB)
    plain_sum = max(sum(e[3] for e in unseen[:i + 1]) for i in range(len(unseen)))
    assert plain_sum == 44 * MiB  # what summing the events alone would report


def test_merge_processes_takes_the_median_of_medians_and_the_worst_peak():
    def run(median, times, peak, err):
        return {"status": "ok", "median_s": median, "times_s": times, "peak_bytes": peak,
                "x_logits": peak / 100, "loss_rel_err": err, "first_call_s": median * 10}

    runs = [run(1.0, [0.9, 1.0, 1.1], 100, 1e-6), run(3.0, [3.0, 3.0], 130, 1e-7),
            run(2.5, [2.5], 110, 3e-6)]
    merged = harness.merge_processes(runs)
    assert merged["process_medians"] == [1.0, 3.0, 2.5]
    assert merged["median_s"] == 2.5
    assert merged["times_s"] == [0.9, 1.0, 1.1, 3.0, 3.0, 2.5]
    assert (merged["peak_bytes"], merged["x_logits"], merged["loss_rel_err"]) == (130, 1.3, 3e-6)
    assert merged["first_call_s"] == 10.0  # the first process's, whose compile may be cold
    assert harness.merge_processes(runs[:2] + [run(9.0, [9.0], 1, 0.0)])["median_s"] == 3.0
    assert harness.merge_processes(runs[:1]) is runs[0]
    failed = {"status": "oom", "message": "out of memory"}
    assert harness.merge_processes([runs[0], failed, runs[1]]) is failed


def test_run_rounds_runs_every_case_in_turn():
    order = []

    def run(case):
        order.append(case)
        return {"status": "ok", "median_s": float(len(order)), "times_s": [float(len(order))]}

    merged = harness.run_rounds(["a", "b"], 3, str, run, lambda r: "")
    assert order == ["a", "b"] * 3
    assert [m["process_medians"] for m in merged] == [[1.0, 3.0, 5.0], [2.0, 4.0, 6.0]]
