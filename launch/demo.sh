#!/usr/bin/env bash
# Install everything, train a tiny LM on 2 ranks (ZeRO-2), save, then resume it on 1 rank (ZeRO-2)
# and on 3 ranks (ZeRO-3), checking every restored tensor against the state before saving. Both
# resumes read the saved rank files in place (the default "direct" reshard), so no copy is written.
# Then the same for a megatron-core GPT: saved at TP=2 x PP=2, resumed at TP=1 x DP=2.
#
#   bash launch/demo.sh               install (.ci/install), then run the demo
#   bash launch/demo.sh --no-install  run it in the environment you already have (what the tests do)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" != --no-install ]; then
  source .ci/install
fi
work="$(mktemp -d)"
log="$work/demo.log"
run() {
  local n=$1 script=launch/train_tiny.py; shift
  if [ "$1" = gpt ]; then script=launch/train_gpt.py; shift; fi
  if ! torchrun --standalone --nproc_per_node "$n" "$script" "$@" >"$log" 2>&1; then
    cat "$log"; exit 1
  fi
  grep '^\[' "$log"
}
echo "== train on 2 ranks and save"
run 2 save --out "$work/ckpt" --variant z2
echo "== resume on 1 rank"
run 1 load --variant z2 --source "$work/ckpt/z2" --results "$work/dp1.json"
echo "== resume on 3 ranks at ZeRO-3"
run 3 load --variant z3 --source "$work/ckpt/z2" --results "$work/dp3.json"
echo "== the saved checkpoint both resumes read in place, every byte checked"
ucp inspect "$work/ckpt/z2"
ucp verify "$work/ckpt/z2"
copies="$(find "$work/ckpt/z2" -maxdepth 1 -name '*.universal')"
if [ -n "$copies" ]; then
  echo "demo: a resume wrote a converted copy, which the direct reshard should not: $copies" >&2; exit 1
fi
echo "no converted copy written: $(du -sh "$work/ckpt/z2" | cut -f1) on disk, as saved"
echo "== megatron-core GPT (SwiGLU, RoPE, GQA): train at TP=2 x PP=2 and save"
run 4 gpt save --arch llama --tp 2 --pp 2 --out "$work/gpt"
echo "== resume at TP=1 x PP=1 x DP=2"
run 2 gpt load --arch llama --source "$work/gpt" --results "$work/gpt.json"
rm -rf "$work"
