"""Benchmark, compile section: what ``impl="compile"`` costs before its first step.

``python -m benchmarks compile`` runs, per configuration (loss, dtype, divergence, options),
two fresh Python processes that share one new, empty inductor cache directory
(``TORCHINDUCTOR_CACHE_DIR``):

* **cold**: the first process. Its first forward + backward compiles every kernel the call
  needs (dynamo's trace, inductor's code generation, the C++ or Triton build).
* **warm disk cache**: the second process, a new run of the same job (a restarted training
  job, the next rank's process): dynamo traces again, but inductor loads the built kernels
  from the on-disk cache.

Each reports the first call's wall time, the steady-state time (median of ``--repeats`` calls
after it) and the eager kernels' steady-state time in the same process. The kernels are built
with dynamic shapes, so the figures hold for any row count and vocabulary; a small shape keeps
the steady state out of the way.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from . import harness

LOSSES = ("topk", "kl")
# name: (dtype, divergence, options) of a configuration
CONFIGS = {
    "bf16 kl": ("bfloat16", "kl", {}),
    "fp32 kl": ("float32", "kl", {}),
    "bf16 kl T=2": ("bfloat16", "kl", {"temperature": 2.0}),
    "bf16 kl +CE": ("bfloat16", "kl", {"ce_weight": 0.5}),
    "bf16 jsd": ("bfloat16", "jsd", {}),
    "bf16 tvd": ("bfloat16", "tvd", {}),
}


def run_case(args, loss, config) -> dict:
    """In the child: first call, steady state (compiled) and eager steady state."""
    result = {"status": "error"}
    with harness.stages(result) as stage:
        stage("import torch")
        torch = harness.child_torch(args, result)

        import topkd

        dtype_name, divergence, options = CONFIGS[config]
        dtype = getattr(torch, dtype_name)
        g = torch.Generator().manual_seed(0)
        student = (torch.randn(args.rows, args.vocab, generator=g) * 2).to(dtype)
        teacher = (torch.randn(args.rows, args.vocab, generator=g) * 2).to(dtype)
        student.requires_grad_(True)
        options = dict(options, divergence=divergence)
        if "ce_weight" in options:
            options["labels"] = torch.randint(0, args.vocab, (args.rows,), generator=g)

        def step(impl):
            student.grad = None
            if loss == "topk":
                out = topkd.topk_kl_loss(student, teacher, args.k, impl=impl, **options)
            else:
                out = topkd.kl_loss(student, teacher, impl=impl, **options)
            out.sum().backward()

        stage("first call (compile)")
        result["first_call_s"] = harness.first_call(lambda: step("compile"))
        stage("steady state")
        result["times_s"] = harness.timed(lambda: step("compile"), args.repeats)
        result["median_s"] = statistics.median(result["times_s"])
        harness.timed(lambda: step("eager"), 1)
        result["eager_times_s"] = harness.timed(lambda: step("eager"), args.repeats)
        result["eager_median_s"] = statistics.median(result["eager_times_s"])
    return result


def _run(args, loss, config) -> dict:
    out = {"loss": loss, "config": config}
    with tempfile.TemporaryDirectory(prefix="topkd-inductor-") as cache:
        for which in ("cold", "warm"):
            out[which] = harness.run_child("benchmarks.compiling:run_case", vars(args), loss,
                                           config, timeout=args.timeout,
                                           env={"TORCHINDUCTOR_CACHE_DIR": cache})
    out["status"] = "ok" if all(out[w].get("status") == "ok" for w in ("cold", "warm")) \
        else "error"
    return out


def format_table(results, meta) -> str:
    lines = [f"Compile cost: rows = {meta['rows']:,}, V = {meta['vocab']:,}, K = {meta['k']:,}, "
             f"device cpu, torch {meta['torch']}, {meta['threads']} threads, repeats = "
             f"{meta['repeats']}; each row: two fresh processes sharing a new inductor cache "
             f"directory.", ""]
    load = harness.load_line(meta)
    if load:
        lines += [load, ""]
    lines += ["| loss | dtype, divergence, options | first call, cold (s) "
              "| first call, warm disk cache (s) | steady compiled (s) | steady eager (s) |",
              "|---|---|---:|---:|---:|---:|"]
    for r in results:
        name = {"topk": "topk_kl_loss", "kl": "kl_loss"}[r["loss"]]
        if r["status"] != "ok":
            bad = r["cold"] if r["cold"].get("status") != "ok" else r["warm"]
            lines.append(f"| {name} | {r['config']} | {harness.status_text(bad)} | - | - | - |")
            continue
        cold, warm = r["cold"], r["warm"]
        lines.append(f"| {name} | {r['config']} | {cold['first_call_s']:.1f} "
                     f"| {warm['first_call_s']:.1f} | {warm['median_s']:.4f} "
                     f"| {warm['eager_median_s']:.4f} |")
    return "\n".join(lines)


def _show(saved) -> str:
    return format_table(saved["results"], saved["meta"])


def build_parser():
    p = argparse.ArgumentParser(
        prog="python -m benchmarks compile",
        description="First-call compile time of impl='compile' per (loss, dtype, divergence, "
                    "options), cold and with inductor's on-disk cache warm.")
    p.add_argument("--loss", nargs="+", choices=LOSSES, default=list(LOSSES))
    p.add_argument("--config", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    p.add_argument("--rows", type=int, default=256, help="rows (256)")
    p.add_argument("--vocab", type=int, default=32_000, help="vocabulary (32000)")
    p.add_argument("--k", type=int, default=512, help="Top-K (512)")
    p.add_argument("--repeats", type=int, default=5, help="steady-state calls (5)")
    harness.add_process_options(p, mem_limit=False)
    harness.add_output_options(p)
    return p


def main(argv) -> int:
    args = build_parser().parse_args(argv)
    if args.load:
        harness.show_saved(args, _show)
        return 0
    cases = [(loss, config) for loss in args.loss for config in args.config]
    t_start, load_start = time.perf_counter(), harness.loadavg()

    def summarize(r):
        return (f"cold {r['cold']['first_call_s']:.1f} s, warm cache "
                f"{r['warm']['first_call_s']:.1f} s")

    results = harness.run_cases(cases, lambda c: f"{c[0]} {c[1]}",
                                lambda c: _run(args, *c), summarize)
    import torch

    first = next((r["cold"] for r in results if r["cold"].get("threads")), {})
    meta = {"rows": args.rows, "vocab": args.vocab, "k": args.k, "repeats": args.repeats,
            "torch": torch.__version__, "threads": first.get("threads", args.threads),
            **harness.run_meta("compile", argv, t_start, load_start)}
    harness.emit(args, {"meta": meta, "results": results}, _show)
    return 0 if all(r["status"] == "ok" for r in results) else 1
