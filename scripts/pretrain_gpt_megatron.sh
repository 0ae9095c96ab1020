#!/usr/bin/env bash
# GPT pretraining with megatron-core and topo-align (TopoAlignDDP), same data and flags as the
# DeepSpeed script.
#
#   bash scripts/pretrain_gpt_megatron.sh                        # CPU: 4 ranks as 2 virtual nodes x 2,
#                                                                # tiny GPT, bundled corpus
#   bash scripts/pretrain_gpt_megatron.sh --topo-align-mode hierarchical     # or flat, or --no-topo-align
#   bash scripts/pretrain_gpt_megatron.sh --resume               # continue from the last checkpoint
#   bash scripts/pretrain_gpt_megatron.sh --megatron-lm ~/Megatron-LM <Megatron-LM pretrain_gpt.py flags>
#   MEGATRON_LM=~/Megatron-LM bash scripts/pretrain_gpt_megatron.sh <pretrain_gpt.py flags>   # the same
#
# With a Megatron-LM tree, its own unmodified pretrain_gpt.py runs through
# `python -m topo_integrations.megatron` (docs/megatron.md); on a machine without CUDA the CPU
# compatibility layer is applied and the run needs Megatron's CPU flags (docs/megatron.md, "On CPU").
#
# Output: runs/<name>/ (metrics.csv, tensorboard/, checkpoints/, summary.json). Launch flags and
# environment variables: scripts/_pretrain_launch.sh; training flags: `--help`; docs/pretraining.md.
set -euo pipefail
source "$(dirname "$0")/_pretrain_launch.sh"
if [ -n "${MEGATRON_LM:-}" ] && [[ " $* " != *" --megatron-lm "* ]]; then
  set -- --megatron-lm "$MEGATRON_LM" "$@"
fi
pretrain_launch topo_integrations.train.pretrain_megatron "$@"
