#!/usr/bin/env bash
# A smoke run for the first machine with GPUs (NCCL, bf16): what the CPU test suite cannot show.
#
#   1. a small torch LM trained on 2 GPUs at ZeRO-2 and saved; resumed on 1 GPU at ZeRO-3, saved at once;
#   2. a megatron-core GPT trained at TP=2 on 2 GPUs and saved; resumed at TP=1 on 1 GPU, saved at once;
#
# and after each, `ucp diff --all` compares every fp32 weight and optimizer state of the two checkpoints with
# torch.equal, one line per state. It has not run yet: this project's machines have no GPU (docs/guides/gpu.md).
#
#   bash launch/gpu_smoke.sh            in the environment you have (ucp_deepspeed, deepspeed, megatron-core)
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() and torch.cuda.device_count() >= 2 else 1)"; then
  echo "gpu_smoke: needs CUDA and at least 2 GPUs; this machine has none (run the CPU suite instead)" >&2
  exit 2
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
run() {
  local n=$1; shift
  torchrun --standalone --nproc_per_node "$n" launch/gpu_smoke.py "$@" 2>"$work/stderr" || { tail -40 "$work/stderr"; exit 1; }
}
same() {
  ucp diff --all "$1" "$2" | tee "$work/diff"
  tail -1 "$work/diff" | grep -q "checkpoints are identical" || { echo "FAIL $1 and $2 differ" >&2; exit 1; }
  echo "PASS every state equal: $1 and $2"
}
echo "== tiny LM: 2 GPUs at ZeRO-2 -> 1 GPU at ZeRO-3 (bf16, NCCL)"
run 2 tiny --zero 2 --out "$work/tiny-dp2"
run 1 tiny --zero 3 --init "$work/tiny-dp2" --out "$work/tiny-dp1"
same "$work/tiny-dp2" "$work/tiny-dp1"
echo "== megatron-core GPT: TP=2 on 2 GPUs -> TP=1 on 1 GPU (bf16, ZeRO-1)"
run 2 gpt --tp 2 --out "$work/gpt-tp2"
run 1 gpt --tp 1 --init "$work/gpt-tp2" --out "$work/gpt-tp1"
same "$work/gpt-tp2" "$work/gpt-tp1"
echo "gpu_smoke: all checks passed"
