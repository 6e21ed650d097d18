#!/usr/bin/env bash
# The main job on a CPU machine: set up .venv (idempotent), build the tiny model locally, and run the
# furthest part of the pipeline that works today: validate every shipped config for its world size,
# then convert the tiny model to Megatron-Core with Megatron-Bridge and export it back to HF.
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
run .venv/bin/oumi-megatron validate -c configs/one_gpu_grpo.yaml --world-size 1 \
    --model-config configs/model_shapes/qwen2.5-1.5b-instruct/config.json
run .venv/bin/oumi-megatron validate -c configs/train_70b_grpo.yaml --world-size 16 --gpus-per-node 8 \
    --model-config configs/model_shapes/llama-3.1-70b-instruct/config.json
run .venv/bin/oumi-megatron validate -c configs/train_405b_grpo.yaml --world-size 256 --gpus-per-node 8 \
    --model-config configs/model_shapes/llama-3.1-405b-instruct/config.json
run .venv/bin/oumi-megatron convert --hf output/tiny_qwen2 --out output/tiny_cpu_grpo/megatron_checkpoint
run .venv/bin/oumi-megatron export --checkpoint output/tiny_cpu_grpo/megatron_checkpoint --out output/tiny_cpu_grpo/hf_model
run $PY - <<'PY'
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
src = AutoModelForCausalLM.from_pretrained("output/tiny_qwen2")
out = AutoModelForCausalLM.from_pretrained("output/tiny_cpu_grpo/hf_model")
tok = AutoTokenizer.from_pretrained("output/tiny_cpu_grpo/hf_model")
ids = tok("Reply with digits only.", return_tensors="pt").input_ids
same = all(torch.equal(a, b) for a, b in zip(src.state_dict().values(), out.state_dict().values()))
print(f"HF -> Megatron -> HF round trip bit-identical: {same}")
print("generate:", repr(tok.decode(out.generate(ids, max_new_tokens=8, do_sample=False)[0][ids.shape[1]:])))
PY
