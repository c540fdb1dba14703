#!/usr/bin/env bash
# KDTrainer sharded, on the device's GPUs, nothing downloaded: `topkd distill` (the fused loss,
# full-vocabulary KL) under DDP, FSDP2 (--fsdp: accelerate's plugin, fsdp_version 2) and
# DeepSpeed ZeRO-3 (--deepspeed), each with its loss curve and every rank's peak memory.
#
#   bash benchmarks/gpu_trainer.sh [--check] [--dry-run] [--bf16] [DIR]
#
# The models (benchmarks/sharded_trainer.py setup): a Llama student, H = 1,024, 4 layers, and
# a Llama teacher, H = 2,048, 4 layers, both V = 151,936 with untied heads, random init from a
# config; 512 random sequences of 1,024 tokens. Each case is `torchrun --standalone` of
# `python -m benchmarks.sharded_trainer run` (topkd distill in each rank, then the rank's
# torch.cuda.max_memory_allocated over the run and rank 0's log): 30 optimizer steps of 4
# sequences per rank, AdamW at 1e-4, KD logged every 5 steps, float32 parameters (--bf16:
# bfloat16, as each wrapper does it: autocast for DDP, FSDP2's mixed precision, DeepSpeed's
# bf16 mode, so the curves then differ by more than rounding). Cases, in order:
#
#   ddp-1, fsdp2-1, zero3-1   one process: world size 1 still takes the sharded code paths
#                             (the head a DTensor of one shard, a ZeRO-3 partition of one)
#   ddp-2, fsdp2-2, zero3-2   two processes, NCCL, one GPU each (only with two GPUs or more:
#                             NCCL refuses two ranks on one device)
#
# zero3-* need deepspeed (pip install 'topkd[deepspeed]'), skipped without it. At one world
# size the runs train on the same data from the same weights, so the summary compares each
# KD curve with the DDP run's (float32: equal to rounding). DIR (default $OUT if set, else
# gpu-trainer-results) receives the models and data (setup/), one record per rank per case
# (CASE-rank<r>.json), gpu_trainer.log and summary.txt; each case's output directory
# (checkpoints, the saved student) is deleted after its record is written.
#
# Every case runs under `timeout` (150 s) within a total budget (TOPKD_GPU_BUDGET_S, default
# 540 s); a failed case does not stop the others. Exit status 0 when every case that could
# run passed, 1 otherwise, 2 when nothing could start.
#
# --check: the CPU, tiny shapes (H = 64, V = 512, 32-token sequences, 6 steps), gloo; DDP and
# ZeRO-3 at 1 and 2 processes (FSDP2 is skipped: `topkd distill --fsdp` refuses the CPU, where
# the Trainer would fall back to DDP). A check of this script's plumbing on any machine; the
# first ZeRO-3 run on a CPU compiles DeepSpeed's shared-memory op (about 90 s on 2 cores).
# --dry-run: print each case's command and run nothing (not even the setup).
# PYTHON picks the interpreter (default: .venv/bin/python if there is one, else python3).

set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

check=0
dry=0
bf16=()
dir=""
while [ $# -gt 0 ]; do
  case "$1" in
    --check) check=1 ;;
    --dry-run) dry=1 ;;
    --bf16) bf16=(--bf16) ;;
    -h|--help) sed -n '2,/^$/s/^# \{0,1\}//p' "$0"; exit 0 ;;
    -*) echo "gpu_trainer.sh: unknown option $1 (--help)" >&2; exit 2 ;;
    *) dir="$1" ;;
  esac
  shift
done
dir="${dir:-${OUT:-gpu-trainer-results}}"
py="${PYTHON:-}"
if [ -z "$py" ]; then
  if [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
fi
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if [ "$check" = 1 ]; then
  mode="check (CPU, tiny float32 shapes)"
  sizes=(--vocab 512 --hidden 64 --layers 2 --teacher-hidden 128 --teacher-layers 2 --seq 32
         --samples 48)
  steps=6 batch=2 every=2
  export OMP_NUM_THREADS=1 TOPKD_IMPL=eager
else
  mode="GPU"
  sizes=()
  steps=30 batch=4 every=5
fi
budget="${TOPKD_GPU_BUDGET_S:-540}"
log="$dir/gpu_trainer.log"
summary="$dir/summary.txt"
start=$SECONDS
failed=0
records=()
notes=()

if [ "$dry" = 1 ]; then
  gpus=2 deepspeed=1 cuda=$((1 - check))
else
  mkdir -p "$dir" || exit 2
  : >"$log"
  facts="$("$py" - <<'PY'
import importlib.util

import torch

print(torch.cuda.device_count(), int(importlib.util.find_spec("deepspeed") is not None))
PY
)" || { echo "gpu_trainer.sh: $py cannot import torch" >&2; exit 2; }
  read -r gpus deepspeed <<<"$facts"
  cuda=$((gpus > 0))
  if [ "$check" = 0 ] && [ "$cuda" = 0 ]; then
    echo "gpu_trainer.sh: torch sees no CUDA device (--check runs the plumbing on the CPU)" >&2
    exit 2
  fi
fi

say() {
  if [ "$dry" = 1 ]; then echo "$@"; else echo "$@" | tee -a "$log"; fi
}

say "gpu_trainer.sh: $mode run, results in $dir, budget ${budget} s"
if [ "$dry" = 0 ]; then
  if ! "$py" -m benchmarks.sharded_trainer setup "$dir/setup" "${sizes[@]}" 2>&1 \
      | tee -a "$log"; then
    say "gpu_trainer.sh: the setup failed"
    exit 2
  fi
fi

# run_case NAME WORLD [FLAGS...]: topkd distill under torchrun with WORLD processes
run_case() {
  local name="$1" world="$2"
  shift 2
  local out="$dir/$name.out"
  local cmd=("$py" -m torch.distributed.run --standalone --nproc-per-node "$world"
             -m benchmarks.sharded_trainer run "$dir/$name" --
             --student "$dir/setup/student" --teacher "$dir/setup/teacher"
             --data "$dir/setup/train.jsonl" --out "$out" --max-steps "$steps"
             --batch-size "$batch" --lr 1e-4 --logging-steps "$every" --save-steps "$steps"
             --no-progress "${bf16[@]}" "$@")
  if [ "$dry" = 1 ]; then
    say "$name: ${cmd[*]}"
    return 0
  fi
  local left=$((budget - (SECONDS - start))) limit=150
  if [ "$left" -lt 30 ]; then
    notes+=("$name: NOT RUN (the ${budget} s budget is spent)")
    failed=1
    return 0
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  say ""
  say "=== $name (timeout ${limit} s): ${cmd[*]}"
  rm -rf "$out" "$dir/$name"-rank*.json
  local t0=$SECONDS rc
  timeout -k 10 "$limit" "${cmd[@]}" 2>&1 | tee -a "$log"
  rc=${PIPESTATUS[0]}
  rm -rf "$out"
  records+=("$dir/$name")
  if [ "$rc" != 0 ]; then
    failed=1
    notes+=("$name: FAILED (exit $rc) after $((SECONDS - t0)) s")
  fi
}

skip() { notes+=("$1: skipped ($2)"); }

for world in 1 2; do
  if [ "$world" = 2 ] && [ "$check" = 0 ] && [ "$gpus" -lt 2 ]; then
    for name in ddp-2 fsdp2-2 zero3-2; do
      skip "$name" "one GPU: NCCL refuses two ranks on one device"
    done
    continue
  fi
  run_case "ddp-$world" "$world"
  if [ "$cuda" = 1 ]; then
    run_case "fsdp2-$world" "$world" --fsdp
  else
    skip "fsdp2-$world" "topkd distill --fsdp needs CUDA"
  fi
  if [ "$deepspeed" = 1 ]; then
    run_case "zero3-$world" "$world" --deepspeed "$dir/setup/zero3.json"
  else
    skip "zero3-$world" "deepspeed is not installed"
  fi
done
[ "$dry" = 1 ] && exit 0

[ "${#records[@]}" -gt 0 ] || { say "gpu_trainer.sh: no case could run"; exit 2; }
lines="$("$py" -m benchmarks.sharded_trainer summary "${records[@]}" 2>&1)" || failed=1
{
  echo ""
  echo "=== summary: $mode run, $((SECONDS - start)) s of the ${budget} s budget"
  echo "$lines"
  for note in "${notes[@]}"; do echo "$note"; done
  echo "log: $log; records: $dir/*-rank*.json"
} | tee "$summary" | tee -a "$log"
exit "$failed"
