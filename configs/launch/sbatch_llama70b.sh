#!/bin/bash
# Llama-3.1-70B GRPO (configs/train_70b_grpo.yaml) on 2 nodes x 8 GPUs with plain sbatch (no Oumi launcher):
#
#   OUTPUT_DIR=/shared/oumi-megatron/llama70b sbatch --account=<account> --partition=<partition> configs/launch/sbatch_llama70b.sh
#
# Slurm runs this script once, on the first node; `srun --ntasks-per-node=1` starts one `oumi distributed torchrun` on
# each node, which reads SLURM_NODELIST / SLURM_NODEID for the rendezvous and starts 8 ranks. Run it from the
# repository on a filesystem every node sees, with its venv made there (OUMI_MEGATRON_VENV, default .venv;
# docs/cluster.md). Gated models: HF_TOKEN, or `hf auth login` with this HF_HOME.
#SBATCH --job-name=oumi-megatron-llama70b
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --output=oumi-megatron-%j.log
set -euo pipefail
: "${OUTPUT_DIR:?set OUTPUT_DIR to a folder every node mounts at the same path}"
export HF_HOME="${HF_HOME:-$(dirname "$OUTPUT_DIR")/hf_home}" NCCL_NVLS_ENABLE=0 TORCH_NCCL_ASYNC_ERROR_HANDLING=1 DO_NOT_TRACK=1
# export NCCL_SOCKET_IFNAME=ib0 NCCL_IB_HCA=mlx5   # where the network preflight warns that NCCL picked sockets
source "${OUMI_MEGATRON_VENV:-.venv}/bin/activate"
# srun does not pass sbatch's --cpus-per-task on to its tasks by itself (Slurm >= 22.05): given again
srun --ntasks-per-node=1 --cpus-per-task="$SLURM_CPUS_PER_TASK" --kill-on-bad-exit=1 oumi distributed torchrun -m oumi train -c configs/train_70b_grpo.yaml --training.output_dir "$OUTPUT_DIR"
