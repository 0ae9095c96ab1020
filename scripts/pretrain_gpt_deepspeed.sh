#!/usr/bin/env bash
# GPT pretraining under DeepSpeed with topo-align (the README's first command).
#
#   bash scripts/pretrain_gpt_deepspeed.sh                       # CPU: 4 ranks as 2 virtual nodes x 2,
#                                                                # tiny GPT, bundled corpus, ~5 minutes
#   bash scripts/pretrain_gpt_deepspeed.sh --topo-align-mode hierarchical    # or flat, or --no-topo-align
#   bash scripts/pretrain_gpt_deepspeed.sh --resume              # continue from the last checkpoint
#   NPROC_PER_NODE=8 bash scripts/pretrain_gpt_deepspeed.sh --model 125M --topology configs/topologies/X.json
#   srun --ntasks-per-node=1 bash scripts/pretrain_gpt_deepspeed.sh --model 1.3B --set communication.bucket_size_mb=64
#
# Output: runs/<name>/ (metrics.csv, tensorboard/, checkpoints/, summary.json). Launch flags and
# environment variables: scripts/_pretrain_launch.sh; training flags: `--help`; docs/pretraining.md.
set -euo pipefail
source "$(dirname "$0")/_pretrain_launch.sh"
pretrain_launch topo_integrations.train.pretrain_deepspeed "$@"
