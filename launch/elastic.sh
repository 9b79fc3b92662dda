#!/usr/bin/env bash
# One torchrun elastic agent (a "node") of the reference training job. Start it once per node, with
# the same RDZV_ENDPOINT everywhere; the job runs at any node count in NNODES and survives nodes
# leaving or joining: the agents re-rendezvous, restart the workers, and train_gpt.py resumes from
# the newest complete checkpoint at the new world size.
#
#   RDZV_ENDPOINT=host:port  rendezvous store address (default 127.0.0.1:29400)
#   IS_HOST=1|0              1 on the node that serves the rendezvous store (default: decided by address)
#   NNODES=MIN:MAX           node range (default 1:2)    NPROC_PER_NODE   ranks per node (default 2)
#   MAX_RESTARTS             worker-group restarts after failures (default 3)
#   RDZV_ID                  job id shared by all agents (default ucp-elastic)
#   TRAIN_SCRIPT             the training script: a path, or a name in launch/ (default train_gpt.py); it gets
#                            `train` and this script's arguments, e.g. for DeepSpeed's PipelineEngine
#                            `TRAIN_SCRIPT=$PWD/tests/workers/train_pipe.py launch/elastic.sh --variant pp2 ...`
#
#   launch/elastic.sh --ckpt-dir /shared/ckpt --steps 1000 --ckpt-every 50 --keep 3 [--moe --ep 2]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
export PYTHONPATH="$here/..${PYTHONPATH:+:$PYTHONPATH}"
# torchrun shares one rendezvous TCPStore with the workers by default and keeps it across restarts,
# so a restarted worker group reads the previous round's process-group addresses and fails to
# connect (pytorch/pytorch#135712). A fresh store per round avoids it.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
conf="last_call_timeout=2,join_timeout=120,close_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=3"
if [ -n "${IS_HOST:-}" ]; then conf="$conf,is_host=$IS_HOST"; fi
script="${TRAIN_SCRIPT:-train_gpt.py}"
case "$script" in /*) ;; *) script="$here/$script" ;; esac
exec python -m torch.distributed.run \
  --nnodes="${NNODES:-1:2}" --nproc_per_node="${NPROC_PER_NODE:-2}" \
  --rdzv-backend=c10d --rdzv-endpoint="${RDZV_ENDPOINT:-127.0.0.1:29400}" --rdzv-id="${RDZV_ID:-ucp-elastic}" \
  --rdzv-conf="$conf" --max-restarts="${MAX_RESTARTS:-3}" --monitor-interval=0.5 \
  "$script" train "$@"
