#!/usr/bin/env bash
# Install everything, then run the reference training script (launch/train_gpt.py, a tiny megatron-core GPT under
# DeepSpeed) as a user would: train on 2 ranks at ZeRO-2 and save; resume on 3 ranks at ZeRO-3, saving at once
# at the new layout; `ucp diff` then compares every fp32 weight and Adam moment of that checkpoint with the one
# saved, exactly. The resume reads the saved rank files in place (the default "direct" reshard), so no
# converted copy is written. Then the same from TP=2 x PP=2 to TP=1 x DP=2.
#
#   bash launch/demo.sh               install what the demo needs (.ci/install, UCP_INSTALL=demo), then run it
#   bash launch/demo.sh --no-install  run it in the environment you already have (what the tests do)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" != --no-install ]; then
  # torch, DeepSpeed, this package with megatron-core and one op: not the ops and packages only the tests use
  UCP_INSTALL=demo source .ci/install
fi
work="$(mktemp -d)"
log="$work/demo.log"
train() {
  local n=$1; shift
  if ! torchrun --standalone --nproc_per_node "$n" launch/train_gpt.py "$@" >"$log" 2>&1; then
    cat "$log"; exit 1
  fi
  grep -E '^(step |resumed )' "$log"
}
echo "== train on 2 ranks (ZeRO-2), save at step 4"
train 2 --zero 2 --ckpt-dir "$work/dp2" --steps 4 --ckpt-every 4
echo "== resume on 3 ranks at ZeRO-3: save at once at this layout, then train on"
train 3 --zero 3 --init-from "$work/dp2" --ckpt-dir "$work/dp3" --save-resumed --steps 6 --ckpt-every 6
echo "== the step-4 checkpoint saved at 2 ranks against the one saved on 3 ranks right after resuming"
ucp diff "$work/dp2" "$work/dp3" --tag-a global_step4 --tag-b global_step4
echo "== the saved checkpoint the resume read in place, every byte checked"
ucp inspect "$work/dp2"
ucp verify "$work/dp2"
copies="$(find "$work/dp2" -maxdepth 2 -name '*.universal')"
if [ -n "$copies" ]; then
  echo "demo: a resume wrote a converted copy, which the direct reshard should not: $copies" >&2; exit 1
fi
echo "no converted copy written: $(du -sh "$work/dp2" | cut -f1) on disk, as saved"
echo "== Llama-style GPT (SwiGLU, RoPE, GQA): train at TP=2 x PP=2 and save at step 3"
train 4 --arch llama --tp 2 --pp 2 --ckpt-dir "$work/tp2pp2" --steps 3 --ckpt-every 3
echo "== resume at TP=1 x PP=1 x DP=2 and save at once; compare"
train 2 --arch llama --init-from "$work/tp2pp2" --ckpt-dir "$work/llama-dp2" --save-resumed --steps 3
ucp diff "$work/tp2pp2" "$work/llama-dp2"
rm -rf "$work"
