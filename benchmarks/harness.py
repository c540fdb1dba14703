"""The harness every benchmark section uses.

A section's parent process runs each case in a fresh Python child (:func:`run_child`), whose
address space a case caps itself (:func:`cap_address_space`), so a case that runs out of
memory is reported as such instead of taking the machine down. In the child, :func:`stages`
turns an exception into the case's status (``oom``, ``unavailable``, ``error``), and the
memory of one forward + backward comes from the profiler: the allocator events of a
``torch.profiler.profile(profile_memory=True)`` walked in time order, running maximum
(:func:`profile_peak`), or per allocation with their addresses so that some can be left out
(:func:`allocations`, :func:`peak_excluding`). Times are medians of repeated runs
(:func:`timed`). Results are JSON: ``--save`` writes them and ``--load`` renders them again
without running anything (:func:`emit`, :func:`show_saved`).

Nothing here imports torch at module level: the parent stays light, and every child imports
it after its memory cap is known.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time

GiB = 2**30
MiB = 2**20
DTYPES = ("bfloat16", "float16", "float32")
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}

# The repository root, which holds this package: the children run ``python -m benchmarks``.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _child_pythonpath(existing: str | None) -> str:
    """``PYTHONPATH`` for a child: the directory of the topkd this process imports (found
    without importing it), then the repository root, then ``existing``; so a child imports
    the same topkd and the same benchmarks as its parent, whatever its working directory."""
    import importlib.util

    spec = importlib.util.find_spec("topkd")
    topkd_dir = None
    if spec is not None and spec.origin:
        # topkd/__init__.py -> the directory that holds the topkd package
        topkd_dir = os.path.dirname(os.path.dirname(os.path.abspath(spec.origin)))
    parts = []
    for p in (topkd_dir, _ROOT, *(existing or "").split(os.pathsep)):
        if p and p not in parts:
            parts.append(p)
    return os.pathsep.join(parts)


# --------------------------------------------------------------------------------------------
# Parent: children, the memory cap, progress
# --------------------------------------------------------------------------------------------


def mem_available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def memory_limit(limit_gib: float) -> float:
    """``limit_gib`` lowered to MemAvailable - 1 GiB (at least 0.5 GiB) when that is less, so
    that a child never takes the machine down; 0 (no cap) stays 0."""
    available = mem_available_bytes()
    if limit_gib and available is not None:
        return min(limit_gib, max(0.5, math.floor((available - GiB) / GiB * 10) / 10))
    return limit_gib


def run_child(target: str, settings: dict, *job, timeout: float | None,
              echo: bool = False, env: dict | None = None) -> dict:
    """Run ``target(argparse.Namespace(**settings), *job)`` in a fresh Python process.

    ``target`` is ``"module:function"``; it returns a JSON-able dict, which is returned here.
    A child that leaves no result gives ``{"status": "oom" | "crashed" | "timeout",
    "message": ...}`` (``oom`` when it was killed by SIGKILL, as the kernel's OOM killer
    does). With ``echo``, the lines the child wrote to stderr indented by two spaces (its
    progress) are printed to this process's stderr once it ends. ``env``: variables set for
    the child on top of this process's.
    """
    env = {**os.environ, **(env or {})}
    env["PYTHONPATH"] = _child_pythonpath(env.get("PYTHONPATH"))
    with tempfile.TemporaryDirectory(prefix="topkd-bench-") as tmp:
        spec_path = os.path.join(tmp, "spec.json")
        out_path = os.path.join(tmp, "result.json")
        err_path = os.path.join(tmp, "stderr.txt")
        with open(spec_path, "w") as f:
            json.dump({"target": target, "settings": settings, "job": list(job),
                       "out": out_path}, f)
        cmd = [sys.executable, "-m", "benchmarks", "--child", spec_path]
        try:
            with open(err_path, "w") as err:
                rc = subprocess.run(cmd, stdout=err, stderr=err, env=env,
                                    timeout=timeout or None).returncode
        except subprocess.TimeoutExpired:
            return {"status": "timeout", "message": f"no result after {timeout} s"}
        tail = ""
        if os.path.exists(err_path):
            with open(err_path, errors="replace") as f:
                tail = f.read()
        if echo:
            for line in tail.splitlines():
                if line.startswith("  "):
                    print(line, file=sys.stderr, flush=True)
        if os.path.exists(out_path):
            with open(out_path) as f:
                return json.load(f)
        tail = tail.strip()[-600:]
        if rc < 0:
            name = signal.Signals(-rc).name if -rc in signal.Signals._value2member_map_ else rc
            return {"status": "oom" if -rc == signal.SIGKILL else "crashed",
                    "message": f"child killed by {name}: {tail}"}
        return {"status": "crashed", "message": f"child exited {rc}: {tail}"}


def child_main(spec_path: str) -> int:
    """The child's side of :func:`run_child`: run the target, write its result. An exception
    the target lets through is printed and becomes ``{"status": "error"}``."""
    with open(spec_path) as f:
        spec = json.load(f)
    module, name = spec["target"].split(":")
    try:
        fn = getattr(importlib.import_module(module), name)
        result = fn(argparse.Namespace(**spec["settings"]), *spec["job"])
    except Exception as exc:
        import traceback

        traceback.print_exc()
        result = {"status": "oom" if is_oom(exc) else "error",
                  "message": f"{type(exc).__name__}: {str(exc).strip()[:400]}"}
    with open(spec["out"], "w") as f:
        json.dump(result, f)
    return 0


def run_cases(cases, describe, run, summarize) -> list[dict]:
    """Run ``run(case)`` for each case, with progress on stderr: ``describe(case)`` before,
    ``summarize(result)`` after (for a result whose status is ``ok``)."""
    results = []
    for i, case in enumerate(cases, 1):
        print(f"[{i}/{len(cases)}] {describe(case)} ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        r = run(case)
        if r["status"] == "ok":
            summary = summarize(r)
        else:
            summary = status_text(r) + (f": {r['message'][:200]}" if r.get("message") else "")
        print(f"[{i}/{len(cases)}]   {summary} ({time.perf_counter() - t0:.0f} s)",
              file=sys.stderr, flush=True)
        results.append(r)
    return results


def run_rounds(cases, rounds: int, describe, run, summarize) -> list[dict]:
    """:func:`run_cases` ``rounds`` times over, every case once per round in turn (so each meets
    the machine as the others do), each run in its own fresh process; one result per case, by
    :func:`merge_processes`."""
    def label(i):
        return describe if rounds == 1 else lambda case: f"round {i}/{rounds}: {describe(case)}"

    runs = [run_cases(cases, label(i), run, summarize) for i in range(1, rounds + 1)]
    return [merge_processes(list(per_case)) for per_case in zip(*runs, strict=True)]


# a case's fields that take the largest of its processes' (its errors, its peak)
_WORST = ("peak_bytes", "x_logits", "retained_bytes", "loss_rel_err", "grad_err",
          "loss_rel_err_reference_selection")


def merge_processes(runs: list[dict]) -> dict:
    """One case's results from one or more fresh processes as one: the first process's, with
    the time the median of the processes' medians (each one's in ``process_medians``), every
    repeat in ``times_s``, and the largest peak and errors. A case that failed in any process
    is that process's result."""
    failed = [r for r in runs if r["status"] != "ok"]
    if failed:
        return failed[0]
    if len(runs) == 1:
        return runs[0]
    merged = dict(runs[0])
    merged["process_medians"] = [r["median_s"] for r in runs]
    merged["median_s"] = statistics.median(merged["process_medians"])
    merged["times_s"] = [t for r in runs for t in r["times_s"]]
    for key in _WORST:
        seen = [r[key] for r in runs if r.get(key) is not None]
        if seen:
            merged[key] = max(seen)
    return merged


def loadavg():
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def threads_of(results, requested: int) -> int:
    """The torch threads the children ran with (the first that says), else what this process
    would use."""
    for r in results:
        if r.get("threads"):
            return r["threads"]
    if requested:
        return requested
    import torch

    return torch.get_num_threads()


def _first_cpu() -> dict[str, str]:
    """The first processor's fields in ``/proc/cpuinfo`` (empty where there is none)."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    return fields


def cpu_model() -> str | None:
    """The CPU's model name (``/proc/cpuinfo``; ``platform.processor()`` elsewhere), or None."""
    return _first_cpu().get("model name") or platform.processor() or None


def cpu_family() -> str | None:
    """``"family F model M"`` from ``/proc/cpuinfo`` (x86 Linux), or None: a model name such
    as "AMD EPYC" names several generations (Zen 3 with AVX2 is family 25 model 1, Zen 4
    with AVX-512 family 25 model 17)."""
    fields = _first_cpu()
    if "cpu family" not in fields or "model" not in fields:
        return None
    return f"family {fields['cpu family']} model {fields['model']}"


def cpu_capability() -> str | None:
    """The vector ISA PyTorch's CPU kernels dispatch to ("AVX512", "AVX2", ...), or None."""
    import torch

    get = getattr(torch.backends.cpu, "get_cpu_capability", None)
    return get() if get else None


def run_meta(section: str, argv, t_start: float, load_start) -> dict:
    """The fields of a section's ``meta`` that describe the run itself."""
    prefix = "python -m benchmarks" + (f" {section}" if section else "")
    return {"python": platform.python_version(), "machine": platform.machine(),
            "cpu_model": cpu_model(), "cpu_family": cpu_family(),
            "cpu_capability": cpu_capability(),
            "cpus": os.cpu_count(), "command": " ".join([prefix, *argv]),
            "total_s": time.perf_counter() - t_start, "loadavg_start": load_start,
            "loadavg_end": loadavg()}


# --------------------------------------------------------------------------------------------
# Command line and saved results
# --------------------------------------------------------------------------------------------


def add_process_options(p, *, mem_limit: bool = True) -> None:
    """The options of the children: torch threads, timeout, and the memory cap."""
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads (default 0: torch's default for the machine)")
    p.add_argument("--timeout", type=float, default=1800.0,
                   help="seconds per child process (1800)")
    if mem_limit:
        p.add_argument("--mem-limit-gib", type=float, default=20.0,
                       help="address-space cap per case, GiB above the process's size after "
                            "its imports; lowered to MemAvailable - 1 GiB if that is less; "
                            "0 = no cap (20)")


KERNELS = ("compile", "eager", "auto")


def add_kernel_options(p) -> None:
    """``--kernels``: the ``impl=`` values topkd's cases run with (one case each)."""
    p.add_argument("--kernels", nargs="+", choices=KERNELS, default=["compile", "eager"],
                   help="topkd's impl= for its cases, one case each (default: compile eager); "
                        "the first call of a compiled case includes compiling, reported apart")


def first_call(step, sync=None) -> float:
    """Seconds of the process's first ``step()``: with compiled kernels, their compiling (or
    loading from inductor's on-disk cache) included."""
    start = time.perf_counter()
    step()
    if sync is not None:
        sync()
    return time.perf_counter() - start


def add_output_options(p) -> None:
    p.add_argument("--json", action="store_true", help="print JSON results instead of the table")
    p.add_argument("--save", metavar="FILE", help="also write the JSON results to FILE")
    p.add_argument("--load", metavar="FILE",
                   help="print the table (or --json) of results saved with --save; runs nothing")


def show_saved(args, show) -> None:
    """``--load``: the saved results, as ``show(saved)`` or as JSON with ``--json``."""
    with open(args.load) as f:
        saved = json.load(f)
    print(json.dumps(saved, indent=2) if args.json else show(saved))


def emit(args, saved: dict, show) -> None:
    """Write ``saved`` to ``--save`` (if given), and print it (``--json``) or ``show(saved)``."""
    if args.save:
        with open(args.save, "w") as f:
            json.dump(saved, f, indent=2)
    print(json.dumps(saved, indent=2) if args.json else show(saved))


def int_bytes(text: str) -> int:
    """``64MiB``, ``1g``, ``4096`` ... as a number of bytes."""
    text = text.strip().lower().replace("_", "")
    mult = 1
    for suffix, m in (("gib", GiB), ("mib", MiB), ("kib", 1024), ("g", GiB), ("m", MiB),
                      ("k", 1024)):
        if text.endswith(suffix):
            text, mult = text[: -len(suffix)], m
            break
    return int(float(text) * mult)


# --------------------------------------------------------------------------------------------
# Child: the memory cap, errors, memory, time
# --------------------------------------------------------------------------------------------


def _vm_size_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def cap_address_space(limit_gib: float) -> None:
    """Cap this process's address space at its size now plus ``limit_gib`` (0: no cap). Called
    after the imports (torch, triton and torch.compile reserve address space of their own)."""
    if limit_gib and limit_gib > 0:
        import resource

        cap = _vm_size_bytes() + int(limit_gib * GiB)
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))


def is_oom(exc: BaseException) -> bool:
    if isinstance(exc, MemoryError):
        return True
    text = str(exc).lower()
    return any(
        s in text
        for s in ("can't allocate memory", "cannot allocate memory", "out of memory",
                  "not enough memory", "std::bad_alloc", "failed to allocate")
    )


IMPORT_STAGE = "import implementation"


@contextlib.contextmanager
def stages(result: dict):
    """Run a case's body, which names its stage by calling the yielded function. On success
    ``result["status"] = "ok"``; an exception becomes ``oom`` (out of memory), ``unavailable``
    (raised while in :data:`IMPORT_STAGE`) or ``error``, with the stage in ``message``. Either
    way the process's peak resident size is added."""
    current = ["start"]
    try:
        yield lambda name: current.__setitem__(0, name)
        result["status"] = "ok"
    except Exception as exc:
        result["status"] = ("oom" if is_oom(exc) else
                            "unavailable" if current[0] == IMPORT_STAGE else "error")
        result["message"] = f"{current[0]}: {type(exc).__name__}: {str(exc).strip()[:400]}"
    try:
        import resource

        result["maxrss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    except (ImportError, OSError):
        pass


def kineto_peak(prof) -> tuple[int, int]:
    """``(peak, end)``: the running maximum of bytes allocated, from the profiler's allocator
    events in time order (:func:`running_peak` of :func:`allocations`), and the balance at
    the end."""
    return running_peak(allocations(prof))


def running_peak(allocs) -> tuple[int, int]:
    """``(peak, end)`` of :func:`allocations`' events: the running sum of their
    :func:`counted` bytes."""
    current = peak = 0
    for size in counted(allocs):
        current += size
        peak = max(peak, current)
    return peak, current


def counted(allocs) -> list[int]:
    """The signed bytes of :func:`allocations`' events that a running sum of what the profiled
    code allocated counts, in order: each event's, with two corrections.

    - A block freed on a thread the profiler does not follow has no free event: a gloo
      collective's worker thread drops the last reference to what it gathered at a time that
      varies from call to call (seen at TP = 2: 3-6 blocks of 10 MiB, +30-60 MiB on a 295 MiB
      peak, in some calls only). An address cannot be handed out twice while in use, so a
      block allocated at an address the sum still holds was freed before it: the earlier block
      leaves the sum then.
    - The profiler reports the free of a block allocated under an earlier profiler (and kept
      since, by a cache or a caller), though not its allocation: a test process that profiled
      one step, then another, read a 4 KiB block of the first against the second. A free of
      an address the sum does not hold is left out."""
    live: dict[int, int] = {}
    out = []
    for _, _, ptr, size, _ in allocs:
        if size > 0:
            if ptr in live:
                out.append(-live.pop(ptr))
            live[ptr] = size
        elif live.pop(ptr, None) is None:
            continue
        out.append(size)
    return out


def profile_peak(step, device: str):
    """``(peak, retained, prof)``: bytes allocated during ``step()`` above the allocation before
    it, at the peak and at the end. On CPU by :func:`kineto_peak` (``prof`` is the profiler);
    on CUDA by ``torch.cuda.max_memory_allocated`` (``prof`` is None)."""
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base, torch.cuda.memory_allocated() - base, None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    return (*kineto_peak(prof), prof)


def allocations(prof, device_type: str | None = None) -> list[tuple]:
    """``[(time_ns, order, ptr, signed bytes, enclosing op names)]`` of the profiler's
    allocator events, in time order; with ``device_type`` (``"cuda"``), those of that device's
    allocator alone."""
    from torch._C._profiler import _EventType

    out = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation and (
                device_type is None or node.extra_fields.device.type == device_type):
            ef = node.extra_fields
            ops, parent = [], node.parent
            while parent is not None:
                ops.append(parent.name)
                parent = parent.parent
            out.append((node.start_time_ns, len(out), ef.ptr, ef.alloc_size, tuple(ops)))
        stack.extend(node.children)
    out.sort()
    return out


def peak_excluding(allocs, grad_ptrs: dict, accumulator_bytes: int | None):
    """``(peak, raw_peak, excluded_bytes, notes)`` of :func:`allocations`: the running maximum
    of allocated bytes minus the bytes of the excluded allocations alive at that time.
    Excluded: the last allocation at each address in ``grad_ptrs`` (name -> address) if it is
    never freed (the returned gradients), and the first allocation of exactly
    ``accumulator_bytes`` made inside ``aten::zeros`` (if not None)."""
    last_alloc = {}
    freed_after = set()
    for i, (_, _, ptr, size, _) in enumerate(allocs):
        if size > 0:
            last_alloc[ptr] = i
        elif size < 0 and ptr in last_alloc:
            freed_after.add(last_alloc[ptr])
    excluded = set()
    notes = []
    for name, ptr in grad_ptrs.items():
        i = last_alloc.get(ptr)
        if i is not None and i not in freed_after:
            excluded.add(i)
            notes.append(f"{name} grad {allocs[i][3]} B")
        else:
            notes.append(f"{name} grad not allocated in the step")
    if accumulator_bytes:
        # made by torch.zeros (the size alone is ambiguous: N x V x 2 == V x H x 4 when N = 2H)
        for i, (_, _, _, size, ops) in enumerate(allocs):
            if size == accumulator_bytes and i not in excluded and "aten::zeros" in ops:
                excluded.add(i)
                notes.append(f"float32 accumulator {size} B (in {' < '.join(ops)})")
                break
        else:
            notes.append("no float32 accumulator found")
    current = current_ex = peak = raw = 0
    live_excluded = {}
    excluded_bytes = 0
    for i, (_, _, ptr, size, _) in enumerate(allocs):
        current += size
        if size > 0 and i in excluded:
            live_excluded[ptr] = size
            current_ex += size
            excluded_bytes += size
        elif size < 0 and ptr in live_excluded:
            current_ex -= live_excluded.pop(ptr)
        raw = max(raw, current)
        peak = max(peak, current - current_ex)
    return peak, raw, excluded_bytes, notes


def timed(step, repeats: int, sync=None) -> list[float]:
    """Wall times of ``repeats`` calls of ``step()`` (``sync()`` around each, e.g. CUDA's)."""
    times = []
    for _ in range(repeats):
        if sync is not None:
            sync()
        t0 = time.perf_counter()
        step()
        if sync is not None:
            sync()
        times.append(time.perf_counter() - t0)
    return times


def sample_rows(total: int, n: int) -> list[int]:
    """``min(n, total)`` row indices spread evenly over ``range(total)``, first and last
    included."""
    n = min(n, total)
    return sorted({round(i * (total - 1) / max(n - 1, 1)) for i in range(n)}) if total else []


# --------------------------------------------------------------------------------------------
# Errors against the float64 reference (the test suite's tests/reference.py, which the sections
# import as ``reference``: see benchmarks/__init__.py)
# --------------------------------------------------------------------------------------------

DIVERGENCES = ("kl", "jsd", "tvd")  # the divergences the sections measure
JSD_BETA = 0.5  # their JSD: beta KL(q || M) + (1 - beta) KL(p || M), M = beta q + (1 - beta) p


def reference_divergence(name: str):
    """A section's divergence name as the reference's ``divergence=`` (JSD at JSD_BETA)."""
    return ("jsd", JSD_BETA) if name == "jsd" else name


def rel_err(got, ref) -> float:
    """``max |got - ref| / |ref|`` (elementwise over tensors, or of two numbers)."""
    if isinstance(ref, (int, float)):
        return abs(got - ref) / abs(ref)
    return ((got - ref).abs() / ref.abs()).max().item()


def grad_err(g, g64, dtype) -> tuple[float, float]:
    """``(err, floor)``: ``max |g - g64| / max |g64|``, and the same for ``g64`` rounded to
    ``dtype`` (what a correctly rounded gradient in that dtype gets)."""
    scale = g64.abs().max().item()
    err = (g.double() - g64).abs().max().item() / scale
    floor = (g64.to(dtype).double() - g64).abs().max().item() / scale
    return err, floor


# --------------------------------------------------------------------------------------------
# Formatting
# --------------------------------------------------------------------------------------------


def fmt_err(x) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.1e}"


def spread(times, unit: str = "") -> str:
    """`` [min-max]`` of two or more times (``unit`` after the max), else ``""``."""
    times = times or []
    if len(times) < 2:
        return ""
    return f" [{min(times):.2f}-{max(times):.2f}{unit}]"


def status_text(r: dict, short: bool = False) -> str:
    """A result that is not ``ok``, in a table cell."""
    if r["status"] == "oom":
        lim = r.get("mem_limit_gib")
        text = f"out of memory at {lim:g} GiB" if lim else "out of memory"
        if r.get("estimated_only") and not short:
            text += f" (estimated need {r['estimate_bytes'] / GiB:.1f} GiB, not run)"
        return text
    return r["status"]


def load_line(meta: dict) -> str | None:
    """The machine's load during the run, or None when the run did not record it."""
    if not (meta.get("loadavg_start") and meta.get("loadavg_end")):
        return None
    name = " ".join(x for x in (meta.get("cpu_model"), meta.get("cpu_family")) if x)
    cpu = ", ".join(x for x in (name, meta.get("cpu_capability")) if x)
    return (f"{meta['cpus']} CPUs" + (f" ({cpu})" if cpu else "")
            + f"; load average (1 min) {meta['loadavg_start'][0]:.2f} at the start, "
            f"{meta['loadavg_end'][0]:.2f} at the end; total {meta['total_s']:.0f} s.")


def child_torch(args, result: dict):
    """A child's torch: ``--threads`` applied, the thread count and torch version recorded in
    ``result`` (and, with a CUDA ``--device``, the GPU's name)."""
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    result["threads"] = torch.get_num_threads()
    result["torch"] = torch.__version__
    device = getattr(args, "device", "cpu")
    if device.startswith("cuda"):
        result["device_name"] = torch.cuda.get_device_name(device)
    return torch
