# Shared launcher of scripts/pretrain_gpt_deepspeed.sh and scripts/pretrain_gpt_megatron.sh (sourced).
#
# pretrain_launch MODULE [LAUNCH FLAGS] [TRAINING FLAGS]
#   1. installs what the run needs into .venv (scripts/setup_env.sh; instant once done);
#   2. picks the launch: Slurm (under srun), a hostfile (ssh to each host), explicit multi-node
#      variables, or one machine (torchrun --standalone, the default);
#   3. runs `torchrun ... -m MODULE TRAINING FLAGS` on every node.
#
# Launch flags (or the environment variable in brackets):
#   --nproc-per-node N / --gpus-per-node N  [NPROC_PER_NODE]  ranks per node (default: GPUs, else 4)
#   --nnodes N --node-rank R                [NNODES, NODE_RANK]
#   --master-addr A --master-port P         [MASTER_ADDR, MASTER_PORT]
#   --hostfile FILE                         [HOSTFILE]  "host slots=N" lines; ssh starts every node
#   --virtual-nodes K                       [VIRTUAL_NODES]  one machine as K nodes (default 2 on CPU)
#   --skip-setup                            [TOPO_ALIGN_SKIP_SETUP=1]  use the current .venv as it is
#   --dry-run                               [TOPO_ALIGN_DRY_RUN=1]  check the flags, print the launch
#                                           command, start nothing (what the docs test runs)
# Everything else goes to the Python entry point (see `--help`).

_die() { echo "error: $*" >&2; exit 2; }

# NCCL reads only the settings it knows; a few widely copied ones are invalid or do nothing
# (docs/cli.md, `doctor`). Refuse the harmful ones before starting hundreds of ranks.
_check_nccl_env() {
  if [ -n "${NCCL_ALGO:-}" ]; then
    local tok
    for tok in $(echo "$NCCL_ALGO" | tr ',;:^' '    '); do
      case "${tok,,}" in
        tree|ring|collnetdirect|collnetchain|nvls|nvlstree|pat) ;;
        allreduce|allgather|reducescatter|broadcast|reduce|sendrecv) ;;
        *) _die "NCCL_ALGO=$NCCL_ALGO: '$tok' is not an NCCL algorithm (accepted: Tree, Ring, CollNetDirect, CollNetChain, NVLS, NVLSTree, PAT); leave NCCL_ALGO unset, NCCL's tuner is already topology-aware" ;;
      esac
    done
  fi
  if [ -n "${NCCL_TIMEOUT:-}" ]; then
    _die "NCCL_TIMEOUT does not exist in NCCL (it is ignored); unset it and pass --timeout-s SECONDS (the process-group timeout)"
  fi
}

pretrain_launch() {
  local module=$1; shift
  cd "$(dirname "${BASH_SOURCE[0]}")/.."
  local nproc="${NPROC_PER_NODE:-}" nnodes="${NNODES:-}" node_rank="${NODE_RANK:-}"
  local master_addr="${MASTER_ADDR:-}" master_port="${MASTER_PORT:-29500}"
  local hostfile="${HOSTFILE:-}" vnodes="${VIRTUAL_NODES:-}" skip_setup="${TOPO_ALIGN_SKIP_SETUP:-0}"
  local dry_run="${TOPO_ALIGN_DRY_RUN:-0}"
  local args=()
  while [ $# -gt 0 ]; do
    case "$1" in
      --nproc-per-node|--gpus-per-node) nproc=${2:?"$1 needs a value"}; shift 2 ;;
      --nnodes) nnodes=${2:?"--nnodes needs a value"}; shift 2 ;;
      --node-rank) node_rank=${2:?"--node-rank needs a value"}; shift 2 ;;
      --master-addr) master_addr=${2:?"--master-addr needs a value"}; shift 2 ;;
      --master-port) master_port=${2:?"--master-port needs a value"}; shift 2 ;;
      --hostfile) hostfile=${2:?"--hostfile needs a value"}; shift 2 ;;
      --virtual-nodes) vnodes=${2:?"--virtual-nodes needs a value"}; shift 2 ;;
      --skip-setup) skip_setup=1; shift ;;
      --dry-run) dry_run=1; shift ;;
      *) args+=("$1"); shift ;;
    esac
  done
  _check_nccl_env

  if [ "$skip_setup" != 1 ]; then
    [ -x .venv/bin/python ] || echo "installing the environment into .venv (first run only; a few minutes)" >&2
    bash scripts/setup_env.sh
  fi
  local py=.venv/bin/python
  [ -x "$py" ] || _die ".venv/bin/python is missing; run without --skip-setup"

  local gpus
  gpus=$("$py" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null || echo 0)
  if [ "$gpus" = 0 ]; then
    # DeepSpeed's CPU accelerator, one intra-op thread per rank (2-4 ranks share a laptop's cores).
    export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  fi
  [ -n "$nproc" ] || { [ "$gpus" -gt 0 ] && nproc=$gpus || nproc=4; }

  local launch=()
  if [ -n "${SLURM_JOB_ID:-}" ] && [ -n "${SLURM_PROCID:-}" ] && [ "${SLURM_NNODES:-1}" -gt 1 ]; then
    # One task per node (srun --ntasks-per-node=1 bash scripts/pretrain_gpt_*.sh ...).
    [ -n "$master_addr" ] || master_addr=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
    [ -n "${SLURM_GPUS_ON_NODE:-}" ] && [ -z "${NPROC_PER_NODE:-}" ] && nproc=${SLURM_GPUS_ON_NODE%%(*}
    launch=(--nnodes "$SLURM_NNODES" --node-rank "$SLURM_NODEID" --rdzv-backend c10d
            --rdzv-endpoint "$master_addr:$master_port" --rdzv-id "${SLURM_JOB_ID}")
  elif [ -n "$hostfile" ]; then
    [ -f "$hostfile" ] || _die "--hostfile $hostfile: no such file"
    [ "$dry_run" != 1 ] || { echo "dry run: would start every host of $hostfile over ssh" >&2; return 0; }
    local hosts=() slots=() line h s
    while read -r line; do
      line=${line%%#*}; h=$(echo "$line" | awk '{print $1}'); [ -n "$h" ] || continue
      s=$(echo "$line" | sed -n 's/.*slots=\([0-9][0-9]*\).*/\1/p')
      hosts+=("$h"); slots+=("${s:-$nproc}")
    done < "$hostfile"
    [ ${#hosts[@]} -gt 0 ] || _die "--hostfile $hostfile: no hosts (expected lines 'HOST slots=N')"
    [ -n "$master_addr" ] || master_addr=${hosts[0]}
    local i pids=() q_args=""
    [ ${#args[@]} -eq 0 ] || q_args=$(printf '%q ' "${args[@]}")
    echo "launching on ${#hosts[@]} hosts from $hostfile (ssh), rendezvous $master_addr:$master_port" >&2
    for i in "${!hosts[@]}"; do
      ssh -o BatchMode=yes "${hosts[$i]}" "cd $(printf %q "$PWD") && \
        TOPO_ALIGN_SKIP_SETUP=1 NPROC_PER_NODE=${slots[$i]} NNODES=${#hosts[@]} NODE_RANK=$i \
        MASTER_ADDR=$master_addr MASTER_PORT=$master_port \
        bash scripts/$(basename "$0") $q_args" &
      pids+=($!)
    done
    local rc=0
    for i in "${pids[@]}"; do wait "$i" || rc=$?; done
    return $rc
  elif [ -n "$nnodes" ] && [ "$nnodes" -gt 1 ]; then
    [ -n "$node_rank" ] || _die "NNODES=$nnodes needs NODE_RANK (this node's index) too"
    [ -n "$master_addr" ] || _die "NNODES=$nnodes needs MASTER_ADDR (the first node's address) too"
    launch=(--nnodes "$nnodes" --node-rank "$node_rank" --master-addr "$master_addr" --master-port "$master_port")
  else
    launch=(--standalone)
    # One machine: topo-align needs at least two "nodes" to have anything to do, so on CPU the ranks
    # are split into virtual nodes (TOPO_ALIGN_HOSTNAME per rank) unless told otherwise.
    if [ -z "$vnodes" ] && [ "$gpus" = 0 ] && [ "$nproc" -ge 4 ] && [ $((nproc % 2)) = 0 ]; then vnodes=2; fi
  fi
  if [ -n "$vnodes" ] && [ "$vnodes" != 0 ]; then args=(--virtual-nodes "$vnodes" "${args[@]}"); fi
  # Refuse bad flags in one line before starting any rank (Megatron-LM's own flags are its business).
  case " ${args[*]} " in
    *" --megatron-lm "*) ;;
    *) "$py" -m "$module" --check-args "${args[@]}" || exit $? ;;
  esac

  if [ "$dry_run" = 1 ]; then
    echo "dry run: $py -m torch.distributed.run ${launch[*]} --nproc-per-node $nproc -m $module ${args[*]}"
    return 0
  fi
  exec "$py" -m torch.distributed.run "${launch[@]}" --nproc-per-node "$nproc" -m "$module" "${args[@]}"
}
