#!/usr/bin/env bash
# One CUDA GPU, about nine minutes, nothing downloaded: the core section, the fused LM-head
# section with its GPU peers, the Megatron section and the tests that mean something on a GPU.
#
#   bash benchmarks/gpu.sh [--check] [--only STEP[,STEP...]] [DIR]
#
# DIR (default $OUT if set, else gpu-results) receives one JSON file per benchmark step (its
# --save; `python -m benchmarks [section] --load DIR/FILE` prints its table again), gpu.log
# (everything every step printed) and summary.txt (the summary printed at the end): eight
# files in all. Steps, in the order they run (the most wanted first, as the later ones are the
# ones a short time budget drops):
#
#   tests       test_cuda.py: the compiled kernels (Triton here) against the eager ones on
#               the GPU, the eager kernels on the GPU against the CPU, and the peak memory
#               bound by torch.cuda.max_memory_allocated
#   tests-peers the Triton-only tests of test_peers.py (Liger's JSD and TVD kernels, TRL's
#               chunked divergence kernels), topkd's side compiled (TOPKD_IMPL=compile)
#   core-topk   topk_kl_loss, 4,096 rows, V = 248,320, K = 4,096, bf16: topkd compiled and
#               eager, and the plain float32 code                              -> core-topk.json
#   core-kl     kl_loss, the same logits                                       -> core-kl.json
#   fused-jsd   fused_kl_loss(divergence=JSD(0.5)), N = 4,096, H = H_t = 4,096, V = 151,936,
#               bf16, against the unfused path, Liger's LigerFusedLinearJSDLoss and TRL's
#               _chunked_divergence_loss (its Triton kernels)              -> fused-jsd.json
#   fused-topk  fused_topk_kl_loss against F.linear + topk_kl_loss          -> fused-topk.json
#   megatron    the Model-Optimizer Megatron criteria at TP = 2, [2,048, 2, 124,160] bf16
#               shards per rank, topkd's kernels compiled                    -> megatron.json
#   fused-kl    fused_kl_loss against the unfused path and Liger (beta=0)    -> fused-kl.json
#
# The Megatron step: NCCL refuses two ranks on one GPU, so with one GPU the two TP ranks run
# over gloo, which all-reduces and all-gathers CUDA tensors through host memory, both ranks on
# that GPU. Each rank's peak is its own process's torch.cuda.max_memory_allocated, so the
# per-rank memory (the bound the adapters are held to) is what TP = 2 on two GPUs would show;
# the times are not: each includes the other rank's kernels and gloo's copies through the host.
# With two GPUs or more, `python -m benchmarks megatron --device cuda` picks NCCL, one GPU per
# rank.
#
# The peers (liger-kernel, trl, megatron-core, nvidia-modelopt) are optional: a case whose peer
# is not installed is reported as unavailable, and the Megatron step is skipped without
# megatron-core and nvidia-modelopt; neither counts as a failure. Where they cannot be
# installed from an index, TOPKD_GPU_WHEELS=DIR installs the wheels in DIR (pip --no-index
# --no-deps, into a temporary directory put on PYTHONPATH) before the steps.
#
# Every step runs under `timeout`, within a total budget (TOPKD_GPU_BUDGET_S, default 540 s); a
# step that fails or times out does not stop the others, and a step the budget leaves no time
# for is reported as not run (`--only` runs it in a second run). The exit status is 0 when
# every step passed (or was skipped for a missing peer), 1 otherwise, 2 when none could start.
#
# --check swaps the device to the CPU and the shapes to tiny float32 ones (eager kernels; the
# GPU-only tests run on the CPU or skip): a check of this script's plumbing on any machine.
# --only runs the named steps (a name or its prefix: `--only core` is core-topk and core-kl).
# PYTHON picks the interpreter (default: .venv/bin/python if there is one, else python3).

set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

check=0
only=""
dir=""
while [ $# -gt 0 ]; do
  case "$1" in
    --check) check=1 ;;
    --only) only="${2:-}"; shift ;;
    --only=*) only="${1#--only=}" ;;
    -h|--help) sed -n '2,/^$/s/^# \{0,1\}//p' "$0"; exit 0 ;;
    -*) echo "gpu.sh: unknown option $1 (--help)" >&2; exit 2 ;;
    *) dir="$1" ;;
  esac
  shift
done
steps="tests tests-peers core-topk core-kl fused-jsd fused-topk megatron fused-kl"
for w in ${only//,/ }; do
  case " $steps " in
    *" $w "* | *" $w-"*) ;;
    *) echo "gpu.sh: --only $w matches no step ($steps)" >&2; exit 2 ;;
  esac
done
dir="${dir:-${OUT:-gpu-results}}"
mkdir -p "$dir" || exit 2
log="$dir/gpu.log"
summary="$dir/summary.txt"
: >"$log"
step_log="$(mktemp)"
trap 'rm -f "$step_log"' EXIT

py="${PYTHON:-}"
if [ -z "$py" ]; then
  if [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
fi
export PYTHONUNBUFFERED=1 TRL_EXPERIMENTAL_SILENCE=1

if [ -n "${TOPKD_GPU_WHEELS:-}" ]; then
  site="$(mktemp -d)"
  if ! "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
      "$TOPKD_GPU_WHEELS"/*.whl; then
    echo "gpu.sh: installing the wheels in $TOPKD_GPU_WHEELS failed" >&2
    exit 2
  fi
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi

if [ "$check" = 1 ]; then
  mode="check (CPU, tiny float32 shapes)"
  device=cpu
  core=(--device cpu --rows 64 --vocab 4096 --k 64 --dtype float32 --kernels eager
        --repeats 1 --sample-rows 2 --timeout 120)
  fused=(--device cpu --tokens 64 --hidden 64 --teacher-hidden 64 --vocab 4096 --k 64
         --dtype float32 --kernels eager --repeats 1 --sample-rows 2 --liger-chunk-size 16
         --liger-no-compile --no-verify --timeout 120)
  # one criterion: a case is mostly its two ranks importing megatron-core, the same for both
  megatron=(--device cpu --tp 2 --seq 16 --batch 2 --vocab 4096 --k 64 --dtype float32
            --kernels eager --repeats 1 --timeout 120 --collective-timeout 60 --loss topk)
  tests_env=(TOPKD_TESTS_DEVICE=cpu)
  tests_k="not compile"  # compiling for the CPU is test_compiled's, and slow
else
  mode="GPU"
  device=cuda
  core=(--device cuda --rows 4096 --vocab 248320 --k 4096 --dtype bfloat16
        --kernels compile eager --timeout 150)
  fused=(--device cuda --tokens 4096 --hidden 4096 --teacher-hidden 4096 --vocab 151936
         --k 4096 --dtype bfloat16 --kernels compile --no-verify --timeout 150)
  megatron=(--device cuda --tp 2 --seq 2048 --batch 2 --vocab 248320 --k 4096
            --dtype bfloat16 --kernels auto --timeout 100 --collective-timeout 90)
  tests_env=(TOPKD_TESTS_DEVICE=cuda)
  tests_k=""
fi

budget="${TOPKD_GPU_BUDGET_S:-540}"
start=$SECONDS
failed=0
rows=()

say() { echo "$@" | tee -a "$log"; }

wanted() {  # is step $1 among --only's names (or their prefixes)?
  [ -z "$only" ] && return 0
  local w
  for w in ${only//,/ }; do
    case "$1" in "$w" | "$w"-*) return 0 ;; esac
  done
  return 1
}

# run_step NAME TIMEOUT_S JSON|pytest COMMAND...: the command under `timeout`, its output to
# the terminal and gpu.log, and the summary's rows: its status, and each case of the JSON
# results it saved, or pytest's closing line.
run_step() {
  local name="$1" limit="$2" json="$3"
  shift 3
  wanted "$name" || return 0
  local left=$((budget - (SECONDS - start)))
  if [ "$left" -lt 30 ]; then
    rows+=("$name: NOT RUN (the ${budget} s budget is spent)")
    failed=1
    return 0
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  say ""
  say "=== $name (timeout ${limit} s): $*"
  local t0=$SECONDS rc
  : >"$step_log"
  [ "$json" = pytest ] || rm -f "$json"  # a failed step leaves no earlier run's results
  timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$log" "$step_log"
  rc=${PIPESTATUS[0]}
  local took=$((SECONDS - t0)) status
  if [ "$rc" = 0 ]; then
    status="ok"
  elif [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    status="TIMED OUT after ${limit} s"
    failed=1
  else
    status="FAILED (exit $rc)"
    failed=1
  fi
  rows+=("$name: $status, ${took} s")
  if [ "$json" = pytest ]; then
    rows+=("    $(grep -E '(passed|failed|skipped|error|no tests ran)' "$step_log" | tail -n 1)")
  elif [ -f "$json" ]; then
    rows+=("$("$py" - "$json" <<'PY'
import json
import sys

with open(sys.argv[1]) as f:
    saved = json.load(f)
for r in saved["results"]:
    label = " ".join(str(r[k]) for k in ("impl", "kernels", "loss", "divergence") if
                     r.get(k) not in (None, "-", "kl") or k == "loss")
    if r["status"] != "ok":
        print(f"    {label}: {r['status']} {r.get('message', '')[:160]}")
        continue
    first = r.get("first_call_s")
    print(f"    {label}: peak {r['x_logits']:.3f}x logits, fwd+bwd {r['median_s'] * 1e3:.1f} ms"
          + (f" (first call {first:.1f} s)" if first is not None else ""))
PY
)")
  else
    rows+=("    (no results saved)")
  fi
}

skip_step() {  # skip_step NAME REASON: not run, and not a failure
  wanted "$1" && rows+=("$1: skipped ($2)")
}

# ---- what this machine has
say "gpu.sh: $mode run, results in $dir, budget ${budget} s"
"$py" - "$device" <<'PY' 2>&1 | tee -a "$log"
import importlib.metadata as md
import platform
import sys

import torch

print(f"python {platform.python_version()} ({sys.executable}), torch {torch.__version__}")
if torch.cuda.is_available():
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        print(f"cuda:{i} {p.name}, {p.total_memory / 2**30:.0f} GiB, CUDA {torch.version.cuda}")
else:
    print("no CUDA device")
for name in ("triton", "liger-kernel", "trl", "megatron-core", "nvidia-modelopt"):
    try:
        print(f"{name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"{name}: not installed")
if sys.argv[1] == "cuda" and not torch.cuda.is_available():
    sys.exit(1)
PY
if [ "${PIPESTATUS[0]}" != 0 ]; then
  say "gpu.sh: torch sees no CUDA device (--check runs the plumbing on the CPU)"
  exit 2
fi

# ---- the steps
cuda_tests="$(find tests -name test_cuda.py | head -n 1)"
peer_tests="$(find tests -name test_peers.py | head -n 1)"
run_step tests 150 pytest env "${tests_env[@]}" "$py" -m pytest -q -rs -p no:cacheprovider \
  ${tests_k:+-k "$tests_k"} "$cuda_tests"
# a second pytest process: test_peers' module-level skip (no TRL or Liger) must not hide the
# tests above, and its GPU tests compare topkd's compiled kernels (what impl="auto" runs there)
run_step tests-peers 90 pytest env "${tests_env[@]}" TOPKD_IMPL=compile "$py" -m pytest -q -rs \
  -p no:cacheprovider -k "kernel or triton" "$peer_tests"

run_step core-topk 170 "$dir/core-topk.json" "$py" -m benchmarks "${core[@]}" --loss topk \
  --save "$dir/core-topk.json"
run_step core-kl 170 "$dir/core-kl.json" "$py" -m benchmarks "${core[@]}" --loss kl \
  --save "$dir/core-kl.json"
run_step fused-jsd 200 "$dir/fused-jsd.json" "$py" -m benchmarks fused "${fused[@]}" \
  --loss jsd --save "$dir/fused-jsd.json"
run_step fused-topk 120 "$dir/fused-topk.json" "$py" -m benchmarks fused "${fused[@]}" \
  --loss topk --save "$dir/fused-topk.json"
if ! wanted megatron; then
  :
elif "$py" -c "import megatron.core, modelopt.torch.distill" >/dev/null 2>&1; then
  run_step megatron 150 "$dir/megatron.json" "$py" -m benchmarks megatron "${megatron[@]}" \
    --save "$dir/megatron.json"
else
  skip_step megatron "megatron-core or nvidia-modelopt is not installed"
fi
run_step fused-kl 150 "$dir/fused-kl.json" "$py" -m benchmarks fused "${fused[@]}" \
  --loss kl --impl fused unfused liger --save "$dir/fused-kl.json"

# ---- summary
{
  echo ""
  echo "=== summary: $mode run, $((SECONDS - start)) s of the ${budget} s budget"
  for row in "${rows[@]}"; do echo "$row"; done
  echo "tables: $log; results: $dir/*.json (python -m benchmarks [section] --load FILE)"
} | tee "$summary" | tee -a "$log"
exit "$failed"
