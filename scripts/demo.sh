#!/usr/bin/env bash
# The main job on a CPU machine: set up .venv (idempotent), build the tiny model and data locally,
# validate every shipped config for its world size, then run the tiny GRPO demo and report its
# reward curve and the exported model's generations.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY=.venv/bin/python
$PY scripts/make_demo_data.py
$PY scripts/make_tiny_model.py --out output/tiny_qwen2 --arch qwen2
run() { echo; echo "\$ $*"; "$@"; }
run .venv/bin/oumi-megatron validate -c configs/tiny_cpu_grpo.yaml --world-size 1
run .venv/bin/oumi-megatron validate -c configs/tiny_cpu_grpo.yaml --world-size 2 --megatron.pipeline_model_parallel_size 2
# offline (HF_HUB_OFFLINE=1): the Hub models' shapes come from configs/model_shapes/, the Hub datasets are not read
run .venv/bin/oumi-megatron validate -c configs/one_gpu_grpo.yaml --world-size 1
run .venv/bin/oumi-megatron validate -c configs/train_70b_grpo.yaml --world-size 16 --gpus-per-node 8
run .venv/bin/oumi-megatron validate -c configs/train_405b_grpo.yaml --world-size 256 --gpus-per-node 8
# The main job: GRPO on the tiny model (convert once, train, checkpoint, export, plots), then a report.
rm -rf output/tiny_cpu_grpo
start=$(date +%s)
run .venv/bin/oumi train -c configs/tiny_cpu_grpo.yaml --grpo.rollout_dump_steps 50
echo "oumi train took $(( $(date +%s) - start )) s (conversion, 150 GRPO steps, checkpoints, export)"
run $PY scripts/demo_report.py output/tiny_cpu_grpo
run .venv/bin/oumi-megatron rollouts output/tiny_cpu_grpo --sample 0   # the last step's first sample, as the model saw it
