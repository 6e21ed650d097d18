#!/usr/bin/env bash
# GPU tests and benchmarks in one call, on the lent GPU machine (torch 2.11 preinstalled there).
#   bash scripts/gpu_check.sh            # from the repo root; wheels carried in .whl/ (see docs/benchmarks.md)
# Installs what the image lacks (megatron-core, megatron-bridge, omegaconf) from .whl/, runs the GPU
# tests (tests/test_gpu.py: parity, layouts, async checkpoints, the GRPO loop on 1 GPU and PP=2, the
# vLLM engine on GPU when its wheels were carried: scripts/gpu_vllm_install.sh) and
# scripts/bench_train_step.py on 1 GPU and, with 2 GPUs, TP=2 and PP=2.
# Prints a short table last; results also land in $OUT (or ./gpu_results) for docs/benchmarks.md.
# GPU_CHECK_BENCH=0 runs the tests only, =sync only the weight-sync benchmark (2 GPUs), =train1 only the
# one-GPU training benchmark (HF reference, the engine before issue 12, the fast path, the fast path + CUDA graphs,
# in one call),
# =bisect the fast path + CUDA graphs with each piece off in turn, =logprobs the 152k-vocabulary logprob benchmark,
# =rollout generation (scripts/bench_rollout.py) for each SHAPE:ROWSxNEW[:PATHS] of GPU_CHECK_ROLLOUT,
# =grpo whole GRPO runs, this project vs TRL (scripts/bench_grpo.py) for each task of GPU_CHECK_GRPO_TASKS ("real scale";
# real needs GPU_CHECK_GGUF), GPU_CHECK_GRPO_STEPS, GPU_CHECK_GRPO_PATHS (embedded,vllm,vllm_kv,vllm_awake,trl,trl_vllm); trl,
# datasets, dill, multiprocess wheels in .whl/),
# =async asynchronous GRPO (1 trainer GPU + 1 engine GPU, max_staleness 1) against synchronous DP=2 and the same
# placement synchronously, on the real task (scripts/bench_async.py; 2 GPUs, vLLM, GPU_CHECK_GGUF; GPU_CHECK_ASYNC_STEPS,
# GPU_CHECK_ASYNC_PATHS),
# =scale GRPO at scale on the Llama-3.1-8B shape, synchronous colocated and asynchronous with a Ray fleet, against
# NeMo-RL's published throughput (scripts/bench_scale.py, vLLM; --gpus is the machine's; GPU_CHECK_SCALE_ARGS),
# =loop the tiny GRPO loop on 1 GPU before issue 12 / fast path / fast path + CUDA graphs,
# =train2 TP=2 and PP=2 before issue 12 and fast (2 GPUs), =8b Llama-3-8B dimensions with TP=2 (2 x H200),
# =zb ZB-H1 against 1F1B on PP=2 (PP=4 with 4 GPUs), alternating, GPU_CHECK_REPEAT times, for each of
# GPU_CHECK_ZB_MICROBATCHES (default 8), GPU_CHECK_ZB_PP (default "2 4"), GPU_CHECK_ZB_ARGS (more bench arguments),
# =cp CP=2 on 2 GPUs against CP=1 on one at GPU_CHECK_CP_SEQS (default "16384 32768"; GPU_CHECK_CP_ARGS more bench arguments),
# =moe the Qwen3-MoE shape (2.6B, 32 experts) EP=1 on 1 GPU vs EP=2 on 2 (GPU_CHECK_MOE_ARGS),
# =plan the memory plan's estimate vs max_memory_allocated (full recompute; PP=2 +/- ModuleQueue; DP=2 +/- distributed optimizer),
# =sp TP=2 with and without sequence parallelism at GPU_CHECK_SP_SEQS (default 8192; GPU_CHECK_SP_ARGS),
# =laws the Llama-3.1-70B-wide slice's convert / GRPO step / checkpoint save / load / export against the plan (issue 43),
# =mq ModuleQueue off and with GPU_CHECK_MQ_CHUNKS (default "0 2 4 8") on PP=2, Qwen2.5-7B shape (GPU_CHECK_MQ_ARGS more
# bench arguments, GPU_CHECK_MQ_TAG names the result files of one setting)
# (GPU_CHECK_REPEAT=N: the fast path N times, one process each);
# GPU_CHECK_TESTS="expr" selects tests (pytest -k). vLLM travels in parts (scripts/gpu_vllm_install.sh).
# GPU_CHECK_JOBS runs several of these settings at once, one GPU each (below).
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HF_HUB_OFFLINE=1 DO_NOT_TRACK=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
RESULTS=${OUT:-gpu_results}
mkdir -p "$RESULTS"
export GPU_RESULTS=$RESULTS
if ls .whl/*.whl >/dev/null 2>&1; then
  if [ ! -f /tmp/site/.oumi_megatron_whl ]; then  # once per machine: a later vLLM install may upgrade pydantic
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    touch /tmp/site/.oumi_megatron_whl
  fi
  export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests
else
  export PYTHONPATH=$PWD/src:$PWD/tests
fi
# vLLM, when its parts were carried (scripts/gpu_vllm_install.sh); its tests skip, visibly, otherwise.
# The trimmed wheel set has no flashinfer: vLLM's sampler must not ask for it.
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1
bash scripts/gpu_vllm_install.sh
# The image's python has no venv: make `python`, `torchrun` and the CLIs resolve for the tests.
mkdir -p /tmp/bin && ln -sf "$(command -v python3)" /tmp/bin/python
printf '#!/usr/bin/env bash\nexec python3 -m oumi_megatron "$@"\n' > /tmp/bin/oumi-megatron && chmod +x /tmp/bin/oumi-megatron
export PATH=/tmp/bin:$PATH
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
NGPU=$(nvidia-smi -L | wc -l)

# GPU_CHECK_JOBS="JOB | JOB": one job per GPU, in parallel, after the installs above (one call, e.g. on 2 x H200, runs
# two benchmarks side by side). A JOB is this script's settings, shell-quoted: GPU_CHECK_BENCH=grpo GPU_CHECK_TESTS='a or b'.
# Job i runs with CUDA_VISIBLE_DEVICES=i, its own MASTER_PORT and its results in $RESULTS/jobI; its log's tail is
# printed at the end. GPU_CHECK_GGUF set outside the jobs is converted once, before they start.
if [ -n "${GPU_CHECK_JOBS:-}" ]; then
  if [ -n "${GPU_CHECK_GGUF:-}" ] && [ ! -f output/smollm2_135m_instruct/config.json ]; then
    python3 -m oumi_megatron gguf-to-hf --gguf "$GPU_CHECK_GGUF" --out output/smollm2_135m_instruct 2>&1 | tail -1
  fi
  IFS='|' read -r -a JOBS <<< "$GPU_CHECK_JOBS"
  [ "${#JOBS[@]}" -le "$NGPU" ] || { echo "GPU_CHECK_JOBS: ${#JOBS[@]} jobs for $NGPU GPU(s)"; exit 1; }
  for i in "${!JOBS[@]}"; do
    mkdir -p "$RESULTS/job$i"
    eval "env -u GPU_CHECK_JOBS CUDA_VISIBLE_DEVICES=$i MASTER_PORT=$((29500 + 111 * i)) OUT=$RESULTS/job$i ${JOBS[$i]} bash $0" \
      > "/tmp/gpu_job$i.log" 2>&1 &
  done
  JOB_RC=0
  for i in "${!JOBS[@]}"; do wait -n || JOB_RC=1; done
  for i in "${!JOBS[@]}"; do echo "== job $i:${JOBS[$i]}"; tail -30 "/tmp/gpu_job$i.log"; done
  exit $JOB_RC
fi

TEST_RC=0
if [ "${GPU_CHECK_TESTS:-}" != "none" ]; then
  python3 -m pytest -p no:cacheprovider -q tests/test_gpu.py -rs ${GPU_CHECK_TESTS:+-k "$GPU_CHECK_TESTS"} 2>&1 | tee "$RESULTS/gpu_tests.log" | tail -25
  TEST_RC=${PIPESTATUS[0]}
fi

# The real-model run (configs/smollm2_arithmetic_gpu.yaml) when GPU_CHECK_REAL_MODEL names the GGUF file:
# rows and Oumi's gsm8k reward from .gpu_real/rows (scripts/prepare_gpu_real_model.py), GGUF -> HF here.
# GPU_CHECK_REAL_STEPS caps the steps (a run resumes from output/ on a machine still warm);
# GPU_CHECK_REAL_BACKEND=vllm runs it with vLLM rollouts (output/real_gpu_vllm), GPU_CHECK_REAL_KV_GIB sizes their KV cache;
# GPU_CHECK_REAL_BUDGET_S stops it in time for its metrics to come back; GPU_CHECK_REAL_SAVE_STEPS checkpoints more
# often than the config (a run stopped by the budget resumes from its last checkpoint in the next call).
if [ -n "${GPU_CHECK_REAL_MODEL:-}" ]; then
  [ -f output/smollm2_135m_instruct/config.json ] || python3 -m oumi_megatron gguf-to-hf --gguf "$GPU_CHECK_REAL_MODEL" --out output/smollm2_135m_instruct 2>&1 | tail -4
  REAL_OUT=output/real_gpu${GPU_CHECK_REAL_BACKEND:+_$GPU_CHECK_REAL_BACKEND}
  timeout "${GPU_CHECK_REAL_BUDGET_S:-540}" python3 tests/workers/real_model_worker.py configs/smollm2_arithmetic_gpu.yaml "$REAL_OUT" \
      --rows .gpu_real/rows ${GPU_CHECK_REAL_STEPS:+--max-steps "$GPU_CHECK_REAL_STEPS"} ${GPU_CHECK_REAL_BASE:+--eval-base} \
      ${GPU_CHECK_REAL_BACKEND:+--inference-backend "$GPU_CHECK_REAL_BACKEND"} \
      ${GPU_CHECK_REAL_KV_GIB:+--vllm-kv-cache-gib "$GPU_CHECK_REAL_KV_GIB"} \
      ${GPU_CHECK_REAL_SAVE_STEPS:+--save-steps "$GPU_CHECK_REAL_SAVE_STEPS"} \
      > "$RESULTS/real_model.log" 2>&1
  echo "real-model run exit $? ($(grep -c . "$REAL_OUT/run/metrics.jsonl" 2>/dev/null) metrics rows)"
  grep -E "eval at step|accuracy: step|Error|error" "$RESULTS/real_model.log" | tail -15
  cp "$REAL_OUT/run/metrics.jsonl" "$RESULTS/real_metrics.jsonl" 2>/dev/null
  cp "$REAL_OUT/result.json" "$RESULTS/real_result.json" 2>/dev/null
  tail -c 3000 "$RESULTS/real_model.log" > "$RESULTS/real_model_tail.log"; rm -f "$RESULTS/real_model.log"
fi

BENCH=${GPU_CHECK_BENCH:-1}
want() { [[ " $BENCH " == *" $1 "* ]]; }  # GPU_CHECK_BENCH may name several modes: "cp sp"
if want 0; then echo "benchmarks skipped (GPU_CHECK_BENCH=0)"; fi
if want laws; then  # issue 43: the Llama-3.1-70B-wide slice's phases against the plan; its ~53 GB checkpoint on a RAM disk
  LAWS_DIR=/tmp/oumi_laws  # where /dev/shm has the room, else the disk
  [ "$(df -Pk /dev/shm 2>/dev/null | awk 'NR==2 {print int($4 / 1048576)}')" -ge 75 ] 2>/dev/null && LAWS_DIR=/dev/shm/oumi_laws
  df -h / /dev/shm | tail -2; free -g | head -2
  python3 scripts/bench_scale_laws.py --gpu --state-dir "$LAWS_DIR" --json "$RESULTS/slice.json" 2>&1 | tee "$RESULTS/slice.log" | tail -12
  rm -rf "$LAWS_DIR"
fi
# the engine before issue 12: SDPA only (fusions, chunked logprobs and fused optimizer kernels off)
NOFUSE="--set gradient_accumulation_fusion=false --set apply_rope_fusion=false --set bias_activation_fusion=false --set optimizer_config.fused_kernels=false --logprob-chunk 0"
GRAPHS="--set cuda_graph_impl=local --set cuda_graph_seq_length=2048"
if want 1 || want train1; then
  # the HF reference, the engine before, the fast path and the fast path + CUDA graphs: same call, same card
  python3 scripts/bench_train_step.py --hf-reference $NOFUSE --out "$RESULTS/bench_1gpu_a_unfused.json" 2>&1 | tail -3
  # the step without graphs is host-bound, so its tokens/s vary between processes: GPU_CHECK_REPEAT runs
  # the fast path that many times (a row each)
  for k in $(seq 1 "${GPU_CHECK_REPEAT:-1}"); do
    python3 scripts/bench_train_step.py --out "$RESULTS/bench_1gpu_b_fast_$k.json" 2>&1 | tail -3
  done
  python3 scripts/bench_train_step.py $GRAPHS --out "$RESULTS/bench_1gpu_c_fast_graphs.json" 2>&1 | tail -3
fi
if want bisect; then  # the fast path + CUDA graphs with one piece off at a time
  for f in gradient_accumulation_fusion apply_rope_fusion bias_activation_fusion optimizer_config.fused_kernels; do
    python3 scripts/bench_train_step.py $GRAPHS --set $f=false --out "$RESULTS/bench_1gpu_no_$f.json" 2>&1 | tail -3
  done
  python3 scripts/bench_train_step.py $GRAPHS --logprob-chunk 4096 --out "$RESULTS/bench_1gpu_chunked_logprobs.json" 2>&1 | tail -3
fi
if want 1 || want logprobs; then  # vocab 152k, seq 4096: full logits vs chunked
  python3 scripts/bench_logprobs.py --out "$RESULTS/logprobs.json" 2>&1 | tail -3
fi
if want rollout; then  # rollout generation: static-cache decoder (graphs / eager), the schedule path, transformers generate
  for job in ${GPU_CHECK_ROLLOUT:-smollm2-135m:128x128 qwen2.5-1.5b:128x128}; do
    IFS=: read -r -a parts <<< "$job"; set -- "${parts[@]}"
    python3 scripts/bench_rollout.py --shape "$1" --batch "$2" ${3:+--paths "$3"} --out "$RESULTS/rollout_$1_$2.json" \
      > "$RESULTS/rollout_$1_$2.log" 2>&1 || tail -30 "$RESULTS/rollout_$1_$2.log"
    grep -A6 "^| $1" "$RESULTS/rollout_$1_$2.log"
  done
fi
if want grpo; then  # whole GRPO runs against TRL (scripts/bench_grpo.py) for each task of GPU_CHECK_GRPO_TASKS
  # (real: GPU_CHECK_GGUF names the GGUF, not GPU_CHECK_REAL_MODEL, which would also start the 120-step real run above;
  # scale: the random Qwen2.5-1.5B shape, built here). Work dirs stay in
  # /tmp/grpo (checkpoints must not travel back); the table, the rows' JSON and the log's tail come back.
  for task in ${GPU_CHECK_GRPO_TASKS:-real}; do
    if [ "$task" = real ]; then
      [ -f output/smollm2_135m_instruct/config.json ] || python3 -m oumi_megatron gguf-to-hf --gguf "$GPU_CHECK_GGUF" --out output/smollm2_135m_instruct 2>&1 | tail -2
      model=output/smollm2_135m_instruct; rows=.gpu_real/rows
    else
      model=/tmp/scale_model; rows=/tmp/scale_rows
    fi
    python3 scripts/bench_grpo.py --task "$task" --model "$model" --rows "$rows" --steps "${GPU_CHECK_GRPO_STEPS:-20}" \
      --paths "${GPU_CHECK_GRPO_PATHS:-embedded,trl}" --out /tmp/grpo --results "$RESULTS" > "$RESULTS/grpo_$task.log" 2>&1
    # the log (row lines as they finish) and RESULTS/TASK_result.json come back even when the call is cut off
    tail -c 6000 "$RESULTS/grpo_$task.log" > "$RESULTS/grpo_$task.tail" && rm -f "$RESULTS/grpo_$task.log"
    grep -E "^\||^FAILED|^20" "$RESULTS/grpo_$task.tail" || tail -40 "$RESULTS/grpo_$task.tail"
  done
fi
if [ "$NGPU" -ge 2 ] && want async; then  # asynchronous GRPO vs the best synchronous use of 2 GPUs, real task (issue 32)
  [ -f output/smollm2_135m_instruct/config.json ] || python3 -m oumi_megatron gguf-to-hf --gguf "$GPU_CHECK_GGUF" --out output/smollm2_135m_instruct 2>&1 | tail -2
  python3 scripts/bench_async.py --model output/smollm2_135m_instruct --rows .gpu_real/rows --steps "${GPU_CHECK_ASYNC_STEPS:-120}" \
    --paths "${GPU_CHECK_ASYNC_PATHS:-sync_dp2,sync_separate,async}" --out /tmp/async --results "$RESULTS" > "$RESULTS/async.log" 2>&1
  tail -c 6000 "$RESULTS/async.log" > "$RESULTS/async.tail" && rm -f "$RESULTS/async.log"
  grep -E "^\||^FAILED|^20" "$RESULTS/async.tail" || tail -40 "$RESULTS/async.tail"
fi
if want scale; then  # GRPO at scale (issue 33): the Llama-3.1-8B shape, sync colocated and async Ray fleet (scripts/bench_scale.py)
  # GPU_CHECK_SCALE_ARGS sizes it (e.g. "--gpus 1 --tp 1 --layers 16 --prompts 2 --paths sync" on one GPU); the model,
  # built here on the GPU, and the work dirs stay in /tmp
  python3 scripts/bench_scale.py --model /tmp/scale_llama --rows /tmp/scale_rows --out /tmp/scale --results "$RESULTS" \
    --gpus "$NGPU" ${GPU_CHECK_SCALE_ARGS:-} > "$RESULTS/scale.log" 2>&1
  tail -c 6000 "$RESULTS/scale.log" > "$RESULTS/scale.tail" && rm -f "$RESULTS/scale.log"
  grep -E "^\||^FAILED|^20" "$RESULTS/scale.tail" || tail -40 "$RESULTS/scale.tail"
fi
if want loop; then  # the tiny GRPO loop's step time on 1 GPU: before issue 12, fast path, + CUDA graphs
  for v in ${GPU_CHECK_LOOP:-unfused fast graphs}; do
    flag=$([ "$v" = fast ] || echo "--$v")
    python3 tests/workers/grpo_loop_worker.py "/tmp/loop_$v" --steps 80 $flag > "$RESULTS/loop_$v.log" 2>&1 || tail -20 "$RESULTS/loop_$v.log"
    cp "/tmp/loop_$v/result.json" "$RESULTS/grpo_loop_1gpu_$v.json" 2>/dev/null
  done
fi
if [ "$NGPU" -ge 2 ] && { want 1 || want train2; }; then  # TP=2 and PP=2: before issue 12 and fast path
  for layout in "--tp 2" "--pp 2"; do
    name=$(echo $layout | tr -d ' -')
    torchrun --nproc_per_node 2 scripts/bench_train_step.py $layout $NOFUSE --out "$RESULTS/bench_2gpu_${name}_a_unfused.json" 2>&1 | tail -2
    torchrun --nproc_per_node 2 scripts/bench_train_step.py $layout --out "$RESULTS/bench_2gpu_${name}_b_fast.json" 2>&1 | tail -2
  done
fi
if [ "$NGPU" -ge 2 ] && want zb; then  # ZB-H1 against 1F1B, PP=2 (and PP=4 with 4 GPUs), same call
  ZB_ARGS=${GPU_CHECK_ZB_ARGS:-}  # e.g. "--mbs 4": larger microbatches keep the GPU, not the host, the bottleneck
  for pp in ${GPU_CHECK_ZB_PP:-2 4}; do
    [ "$NGPU" -ge "$pp" ] || continue
    for k in $(seq 1 "${GPU_CHECK_REPEAT:-1}"); do
      for m in ${GPU_CHECK_ZB_MICROBATCHES:-8}; do  # the 1F1B bubble is (pp - 1) / (m + pp - 1) of the step
        for s in 1f1b zb_h1; do
          torchrun --nproc_per_node "$pp" scripts/bench_train_step.py --pp "$pp" --microbatches "$m" --schedule "$s" $ZB_ARGS \
            --out "$RESULTS/bench_pp${pp}_m${m}_${s}_$k.json" 2>&1 | tail -2
        done
      done
    done
  done
fi
if [ "$NGPU" -ge 2 ] && want mq; then  # ModuleQueue off / on with 2, 4, 8 chunks, PP=2, Qwen2.5-7B shape
  # GPU_CHECK_MQ_ARGS adds bench arguments (default: Qwen2.5-7B dimensions, seq 4096, the distributed optimizer
  # (DP = 1: nothing sharded): needs 2 x H200; "--layers 14" fits 2 x H100; own parameter storage:
  # --set ddp_config.use_distributed_optimizer=false)
  for k in ${GPU_CHECK_MQ_CHUNKS:-0 2 4 8}; do
    torchrun --nproc_per_node 2 scripts/bench_train_step.py --pp 2 --shape qwen7b --seq 4096 --mbs 1 --microbatches 4 --steps 3 \
      --module-queue "$k" ${GPU_CHECK_MQ_ARGS:-} \
      --out "$RESULTS/mq_${GPU_CHECK_MQ_TAG:-default}_k$k.json" 2>&1 | tail -2
  done
fi
if [ "$NGPU" -ge 2 ] && want cp; then  # context parallelism: CP=2 on 2 GPUs against CP=1 on one, same call
  # GPU_CHECK_CP_SEQS: sequence lengths (CP=1 runs each too, and may run out of memory at the longest: recorded as such)
  for seq in ${GPU_CHECK_CP_SEQS:-16384 32768}; do
    python3 scripts/bench_train_step.py --seq "$seq" --mbs 1 --microbatches 2 --steps 3 ${GPU_CHECK_CP_ARGS:-} \
      --out "$RESULTS/bench_cp1_seq$seq.json" 2>&1 | tail -2
    torchrun --nproc_per_node 2 scripts/bench_train_step.py --cp 2 --seq "$seq" --mbs 1 --microbatches 2 --steps 3 ${GPU_CHECK_CP_ARGS:-} \
      --out "$RESULTS/bench_cp2_seq$seq.json" 2>&1 | tail -2
  done
fi
if [ "$NGPU" -ge 2 ] && want sp; then  # sequence parallelism: TP=2 with and without SP, same call
  for seq in ${GPU_CHECK_SP_SEQS:-8192}; do
    for sp in "" --sequence-parallel; do
      torchrun --nproc_per_node 2 scripts/bench_train_step.py --tp 2 $sp --seq "$seq" --mbs 1 --microbatches 4 --steps 3 ${GPU_CHECK_SP_ARGS:-} \
        --out "$RESULTS/bench_tp2${sp:+_sp}_seq$seq.json" 2>&1 | tail -2
    done
  done
fi
if [ "$NGPU" -ge 2 ] && want moe; then  # expert parallelism: the 2.6B Qwen3-MoE shape, EP=1 on one GPU vs EP=2 (DP=2) on two
  python3 scripts/bench_train_step.py --shape moe --seq 4096 --mbs 1 --microbatches 4 --steps 3 ${GPU_CHECK_MOE_ARGS:-} \
    --out "$RESULTS/bench_moe_ep1.json" 2>&1 | tail -2
  torchrun --nproc_per_node 2 scripts/bench_train_step.py --shape moe --ep 2 --seq 4096 --mbs 1 --microbatches 4 --steps 3 \
    ${GPU_CHECK_MOE_ARGS:-} --out "$RESULTS/bench_moe_ep2.json" 2>&1 | tail -2
fi
if want plan; then  # oumi-megatron plan's estimate against max_memory_allocated (issue 16): full recompute, PP=2 (+ ModuleQueue), DP=2 +/- distributed optimizer
  B="scripts/bench_train_step.py --mbs 1 --warmup 1 --steps 1"
  python3 $B --seq 16384 --microbatches 2 --recompute full --out "$RESULTS/plan_1gpu_full_recompute.json" 2>&1 | tail -1
  if [ "$NGPU" -ge 2 ]; then
    T="torchrun --nproc_per_node 2"
    $T $B --pp 2 --seq 8192 --microbatches 4 --out "$RESULTS/plan_pp2.json" 2>&1 | tail -1
    $T $B --pp 2 --seq 8192 --microbatches 4 --module-queue 4 --out "$RESULTS/plan_pp2_module_queue.json" 2>&1 | tail -1
    $T $B --seq 8192 --microbatches 2 --out "$RESULTS/plan_dp2_distributed_optimizer.json" 2>&1 | tail -1
    $T $B --seq 8192 --microbatches 2 --set ddp_config.use_distributed_optimizer=false --out "$RESULTS/plan_dp2_plain_optimizer.json" 2>&1 | tail -1
  fi
fi
if [ "$NGPU" -ge 2 ] && want 8b; then  # Llama-3-8B dimensions, TP=2 (needs 2 x H200: not in the default run)
  torchrun --nproc_per_node 2 scripts/bench_train_step.py --shape 8b --tp 2 --steps 4 --out "$RESULTS/bench_8b_tp2_a_fast.json" 2>&1 | tail -2
  torchrun --nproc_per_node 2 scripts/bench_train_step.py --shape 8b --tp 2 --steps 4 $GRAPHS --out "$RESULTS/bench_8b_tp2_b_graphs.json" 2>&1 | tail -2
fi
if [ "$NGPU" -ge 2 ] && { want 1 || want sync; }; then
  python3 scripts/bench_weight_sync.py --out "$RESULTS/sync.json" 2>&1 | tail -20
fi

python3 - "$RESULTS" <<'PY'
import json, pathlib, sys
rows = [json.loads(p.read_text()) for p in sorted(pathlib.Path(sys.argv[1]).glob("bench_*.json"))]
print("\n| layout | attention | fusions | GPUs | card | tokens/s | tokens/s/GPU | TFLOP/s/GPU | MFU | peak GiB | activations GiB |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for r in rows:
    hf = r.get("hf_reference")
    if hf:
        print(f"| HF transformers | sdpa | - | 1 | {r['card']} | {hf['tokens_per_s']:.0f} | {hf['tokens_per_s']:.0f} | {hf['tflops']} | {100*hf['mfu']:.1f}% | {hf['peak_mem_gib']} | {hf['activation_mem_gib']} |")
    print(f"| {r['layout']} seq {r.get('seq', '?')}{' ' + r['schedule'] if r.get('schedule') not in (None, 'none') else ''} | {r.get('attention', '?')} | {r.get('fusions', '?')}{' + chunked logprobs' if r.get('logprobs') == 'chunked' else ''}{' + CUDA graphs' if r.get('cuda_graphs') == 'local' else ''} | {r['gpus']} | {r['card']} | {r['tokens_per_s']:.0f} | {r['tokens_per_s_per_gpu']:.0f} | {r['tflops_per_gpu']} | {100*r['mfu']:.1f}% | {r['peak_mem_gib']} | {r.get('activation_mem_gib', '?')} |")
hf = next((r["hf_reference"] for r in rows if r.get("hf_reference")), None)
if hf:
    print("tokens/s vs HF (same call): " + ", ".join(f"{r['layout']} {r.get('fusions', '?')}: "
                                                    f"{r['tokens_per_s'] / hf['tokens_per_s']:.2f}x" for r in rows if r["gpus"] == 1))
zb = [r for r in rows if r.get("schedule") in ("1f1b", "zb_h1")]
if zb:  # ZB-H1 against 1F1B: the median of each (layout, microbatches, schedule), then the ratio
    import statistics
    groups = {}
    for r in zb:
        groups.setdefault((r["layout"], r["tokens_per_step"], r["schedule"]), []).append(r)
    print("\n| layout | tokens/step | schedule | runs | tokens/s (median) | vs 1F1B | peak GiB by stage | deferred W/step | F / B / W ms per microbatch by stage |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for (layout, tokens, sched), rs in sorted(groups.items()):
        tps = statistics.median(r["tokens_per_s"] for r in rs)
        base = groups.get((layout, tokens, "1f1b"))
        ratio = tps / statistics.median(r["tokens_per_s"] for r in base) if base else float("nan")
        phases = "; ".join("/".join(str(p.get(k, "-")) for k in "FBW") for p in rs[-1].get("phase_ms_per_microbatch_by_rank") or [])
        print(f"| {layout} | {tokens} | {sched} | {len(rs)} | {tps:.0f} | {ratio:.3f} | {' / '.join(str(max(r.get('peak_mem_gib_by_rank', [r['peak_mem_gib']])[i] for r in rs)) for i in range(len(rs[0].get('peak_mem_gib_by_rank', [0]))))} | {rs[-1]['deferred_wgrad_ops']} | {phases or '-'} |")
mq = [json.loads(p.read_text()) for p in sorted(pathlib.Path(sys.argv[1]).glob("mq_*.json"))]
if mq:  # ModuleQueue: the last stage's peak and the step time against the run without it (same call, same settings)
    print("\n| layout | settings | card | ModuleQueue chunks | step s | vs off | last-stage peak GiB | vs off | saving GiB | seed formula GiB | released MiB/step | last stage: passes / optimizer peak GiB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    setting = lambda r: (r["layout"], r["tokens_per_step"], r.get("recompute"), r.get("settings", []))  # noqa: E731
    for r in sorted(mq, key=lambda r: (setting(r), r["module_queue_chunks"])):
        base = next((b for b in mq if not b["module_queue_chunks"] and setting(b) == setting(r)), None)
        last = r["peak_mem_gib_by_rank"][-1]
        b_last = base["peak_mem_gib_by_rank"][-1] if base else float("nan")
        print(f"| {r['layout']} | {r['tokens_per_step'] // r['seq']} x {r['seq']} tokens, recompute {r.get('recompute')} {' '.join(r.get('settings') or [])} | {r['card']} | {r['module_queue_chunks'] or 'off'} | {r['step_s']} "
              f"| {r['step_s'] / base['step_s'] if base else float('nan'):.3f} | {last} | {last / b_last:.3f} | {b_last - last:.2f} "
              f"| {r['seed_formula_saving_gib'] if r['module_queue_chunks'] else '-'} | {r['module_queue_offloaded_mib']} "
              f"| {r.get('passes_peak_gib_by_rank', ['-'])[-1]} / {r.get('optimizer_peak_gib_by_rank', ['-'])[-1]} |")
plans = [(p.stem, json.loads(p.read_text())) for p in sorted(pathlib.Path(sys.argv[1]).glob("*.json"))]
plans = [(n, r) for n, r in plans if isinstance(r, dict) and r.get("plan_peak_gib_by_stage")]
if plans:  # the memory plan (oumi_megatron/plan.py) against torch.cuda.max_memory_allocated of the same step
    print("\n| run | card | measured peak GiB by rank | plan GiB by stage | plan / measured (max) | outside allocator GiB | allocator reserve GiB |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for n, r in plans:
        measured, plan = r["peak_mem_gib_by_rank"], r["plan_peak_gib_by_stage"]
        print(f"| {n} ({r['layout']}, seq {r['seq']}) | {r['card']} | {measured} | {plan} | {max(plan) / max(measured):.3f} | {r['outside_allocator_gib']} | {r['allocator_reserve_gib']} |")
lp = pathlib.Path(sys.argv[1]) / "logprobs.json"
if lp.is_file():
    r = json.loads(lp.read_text())
    print(f"\n| logprobs, vocab {r['vocab']}, {r['tokens_per_microbatch']} tokens/microbatch | card | forward s | forward peak above state GiB | train step s | train peak above state GiB |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name in ("full_logits", "chunked"):
        x = r[name]
        print(f"| {name} | {r['card']} | {x['forward_s']} | {x['forward_peak_above_state_gib']} | {x['train_step_s']} | {x['train_peak_above_state_gib']} |")
loops = [json.loads(p.read_text()) for p in sorted(pathlib.Path(sys.argv[1]).glob("grpo_loop_*.json"))]
if loops:
    print("\n| GRPO loop (tiny demo) | GPUs | card | steps | reward first 10 -> last 10 | wall s | rollout s | train s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
for r in loops:
    name = f"TP{r['tp']} PP{r['pp']}" + (" packed" if r["packing"] else "") + (f" {r['variant']}" if r.get("variant") else "")
    w = r["rewards"]
    print(f"| {name} | {r['world_size']} | {r['card']} | {r['steps']} | {sum(w[:10])/10:.3f} -> {sum(w[-10:])/10:.3f} | {r['seconds']:.0f} | {r['rollout_s']:.0f} | {r['train_s']:.0f} |")
vl = [(p.stem.removeprefix("vllm_gpu_"), json.loads(p.read_text())) for p in sorted(pathlib.Path(sys.argv[1]).glob("vllm_gpu_*.json"))]
if vl:
    print("\n| vLLM engine on GPU (bf16) | sync | tensors | MB | sync s | stale engine mean/max abs diff | after sync mean/max |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
for name, r in vl:
    s = r["sync"]
    print(f"| {name} | {s['method']} | {s['tensors']} | {s['bytes']/1e6:.1f} | {s['seconds']:.3f} | {r['stale_engine_mean']:.3f} / {r['stale_engine']:.3f} | {r['after_sync_mean']:.4f} / {r['after_sync']:.4f} |")
real = pathlib.Path(sys.argv[1]) / "real_result.json"
# the real-model run's file; bench_grpo's real-task rows (GPU_CHECK_BENCH=grpo) share the name and hold "rows" instead
r = json.loads(real.read_text()) if real.is_file() else {}
if "eval_curve" in r:
    c, t = r["eval_curve"], r["train"]
    print("\n| real model (SmolLM2-135M, arithmetic) | eval set | card | steps | accuracy first -> last eval | exported hf_model | format | rollout s / train s (last step) | peak GiB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for prefix in [k.split("/")[0] for k in c[-1] if k.endswith("/accuracy")]:
        print(f"| configs/smollm2_arithmetic_gpu.yaml | {prefix} | {r['card']} | {c[-1]['step']} | {c[0][prefix + '/accuracy']:.3f} -> {c[-1][prefix + '/accuracy']:.3f} "
              f"| {r['hf_model_eval'][prefix + '/accuracy']:.3f} | {c[-1][prefix + '/format_rate']:.2f} | {t[-1]['time/rollout_s']:.1f} / {t[-1]['time/train_s']:.2f} "
              f"| {max(x['perf/peak_gpu_memory_gib'] or 0 for x in t):.1f} |")
sync = pathlib.Path(sys.argv[1]) / "sync.json"
if sync.is_file():
    r = json.loads(sync.read_text())
    print("\n| weight sync (trainer GPU 0 -> receiver GPU 1, NCCL) | card | GB | tensors | bucket MiB | raw broadcast GB/s | export only s | sync s | sync GB/s | of raw |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    print(f"| Bridge export -> buckets -> weight_stream | {r['card']} | {r['bytes']/1e9:.2f} | {r['tensors']} | {r['bucket_mb']:.0f} | {r['raw_broadcast_gbps']:.1f} | {r['export_only_s']:.2f} | {r['sync_s']:.2f} | {r['sync_gbps']:.1f} | {100*r['fraction_of_raw']:.0f}% |")
PY
exit $TEST_RC
