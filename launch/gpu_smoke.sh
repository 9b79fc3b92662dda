#!/usr/bin/env bash
# A smoke run for a machine with GPUs (NCCL, bf16): what the CPU test suite cannot show. With 2 GPUs or more:
#
#   1. a small torch LM trained on 2 GPUs at ZeRO-2 and saved; resumed on 1 GPU at ZeRO-3, saved at once;
#   2. a megatron-core GPT trained at TP=2 on 2 GPUs and saved; resumed at TP=1 on 1 GPU, saved at once.
#
# With 1 GPU, the layout changes that fit on it: ZeRO stage changes (the restore's CUDA paths, the all-gather
# refresh, ZeRO-3's regather), none of tensor or data parallelism:
#
#   1. the torch LM at ZeRO-2 resumed at ZeRO-3, and that ZeRO-3 save resumed at ZeRO-1;
#   2. the megatron-core GPT at ZeRO-1 resumed at ZeRO-3.
#
# After each resume, `ucp diff --all` compares every fp32 weight and optimizer state of the two checkpoints with
# torch.equal, one line per state. Results on real GPUs: docs/guides/gpu.md.
#
#   bash launch/gpu_smoke.sh            in the environment you have (ucp_deepspeed, deepspeed, megatron-core)
set -euo pipefail
cd "$(dirname "$0")/.."
gpus="$(python -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")"
if [ "$gpus" -lt 1 ]; then
  echo "gpu_smoke: needs CUDA and at least 1 GPU; this machine has none (run the CPU suite instead)" >&2
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
if [ "$gpus" -ge 2 ]; then
  echo "== tiny LM: 2 GPUs at ZeRO-2 -> 1 GPU at ZeRO-3 (bf16, NCCL)"
  run 2 tiny --zero 2 --out "$work/tiny-dp2"
  run 1 tiny --zero 3 --init "$work/tiny-dp2" --out "$work/tiny-dp1"
  same "$work/tiny-dp2" "$work/tiny-dp1"
  echo "== megatron-core GPT: TP=2 on 2 GPUs -> TP=1 on 1 GPU (bf16, ZeRO-1)"
  run 2 gpt --tp 2 --out "$work/gpt-tp2"
  run 1 gpt --tp 1 --init "$work/gpt-tp2" --out "$work/gpt-tp1"
  same "$work/gpt-tp2" "$work/gpt-tp1"
else
  echo "== 1 GPU: ZeRO stage changes only (tensor and data parallelism need 2 GPUs)"
  echo "== tiny LM: ZeRO-2 -> ZeRO-3 -> ZeRO-1 on 1 GPU (bf16, NCCL)"
  run 1 tiny --zero 2 --out "$work/tiny-z2"
  run 1 tiny --zero 3 --init "$work/tiny-z2" --out "$work/tiny-z3"
  same "$work/tiny-z2" "$work/tiny-z3"
  run 1 tiny --zero 1 --init "$work/tiny-z3" --out "$work/tiny-z1"
  same "$work/tiny-z3" "$work/tiny-z1"
  echo "== megatron-core GPT: ZeRO-1 -> ZeRO-3 on 1 GPU (bf16, TP=1)"
  run 1 gpt --zero 1 --out "$work/gpt-z1"
  run 1 gpt --zero 3 --init "$work/gpt-z1" --out "$work/gpt-z3"
  same "$work/gpt-z1" "$work/gpt-z3"
fi
echo "gpu_smoke: all checks passed"
