#!/bin/bash
# A Ray cluster for `megatron.rollout_placement: ray` (a fleet of vLLM engines as Ray actors, docs/rollouts.md) across
# nodes: the trainer's ranks join it as clients (megatron.ray_address) and place the engines on its GPUs.
#
#   on the head node:    bash configs/launch/ray_fleet_up.sh head
#   on each other node:  bash configs/launch/ray_fleet_up.sh worker <head_ip>
#   then, on the trainer's nodes (GPUs not given to Ray), e.g. configs/llama8b_grpo_8gpu_async.yaml:
#     oumi distributed torchrun --nproc-per-node 4 -c configs/llama8b_grpo_8gpu_async.yaml --megatron.ray_address <head_ip>:6379
#
# RAY_GPUS: the GPUs of this node Ray may give to engines (default: all of them); the trainer's GPUs must not be among
# them (CUDA_VISIBLE_DEVICES below, or run the trainer on other nodes). The run checks before conversion that the
# cluster has rollout_engines x rollout_gpus_per_engine GPUs, and stops with the fix if not.
set -euo pipefail
role="${1:?head or worker}"
port="${RAY_PORT:-6379}"
gpus="${RAY_GPUS:-$(nvidia-smi -L | wc -l)}"
source .venv/bin/activate
if [ "$role" = head ]; then
  ray start --head --port="$port" --num-gpus="$gpus"
else
  ray start --address="${2:?the head node's address}:$port" --num-gpus="$gpus"
fi
ray status
