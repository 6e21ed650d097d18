#!/bin/bash
# A Ray cluster for `megatron.rollout_placement: ray` (a fleet of vLLM engines as Ray actors, docs/rollouts.md) across
# nodes: the trainer's ranks join it as clients (megatron.ray_address) and place the engines on its GPUs.
#
#   on the head node:    bash configs/launch/ray_fleet_up.sh head
#   on each other node:  bash configs/launch/ray_fleet_up.sh worker <head_ip>
#   then, on the trainer's nodes (GPUs not given to Ray), with the same token (below), e.g.:
#     RAY_AUTH_MODE=token oumi distributed torchrun --nproc-per-node 4 -c configs/llama8b_grpo_8gpu_async.yaml \
#       --megatron.ray_address <head_ip>:6379
#   when done, on every node:  bash configs/launch/ray_fleet_up.sh down
#
# Whoever reaches a Ray cluster can run code on every node of it (and call the engines, weight pushes included), so
# this cluster takes only callers that hold its token (Ray's token authentication, RAY_AUTH_MODE=token; Ray >= 2.52)
# and its nodes listen on RAY_NODE_IP, the private interface the nodes share (default: this host's first address; set
# it to the cluster network's). The token is made once on the head (`ray get-auth-token --generate` writes
# ~/.ray/auth_token); every node and the trainer read it from there (a home folder every node mounts) or from the file
# RAY_AUTH_TOKEN_PATH names. Keep the Ray ports (6379 and the ranges docs/security.md lists) closed beyond that network.
#
# RAY_GPUS: the GPUs of this node Ray may give to engines (default: all of them); the trainer's GPUs must not be among
# them (CUDA_VISIBLE_DEVICES below, or run the trainer on other nodes). The run checks before conversion that the
# cluster has rollout_engines x rollout_gpus_per_engine GPUs, and stops with the fix if not.
set -euo pipefail
role="${1:?head, worker or down}"
port="${RAY_PORT:-6379}"
source .venv/bin/activate
if [ "$role" = down ]; then
  ray stop
  exit 0
fi
export RAY_AUTH_MODE=token
node_ip="${RAY_NODE_IP:-$(hostname -I | awk '{print $1}')}"
gpus="${RAY_GPUS:-$(nvidia-smi -L | wc -l)}"
if [ "$role" = head ]; then
  ray get-auth-token --generate > /dev/null  # the cluster's token (kept in ~/.ray/auth_token, never printed here)
  ray start --head --port="$port" --node-ip-address="$node_ip" --dashboard-host=127.0.0.1 --num-gpus="$gpus"
else
  ray start --address="${2:?the head node address}:$port" --node-ip-address="$node_ip" --num-gpus="$gpus"
fi
ray status
