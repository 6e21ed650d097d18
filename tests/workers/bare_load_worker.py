"""A vLLM engine on GPU takes pushed weights with a bare ``load_weights``, one bucket at a time (run as a subprocess).

    python tests/workers/bare_load_worker.py WORKDIR OUT_JSON

rollout/vllm_engine.py's streamed pushes (``StreamWeightTransferEngine``, separate engines and the Ray fleet) load
each bucket into an unquantized GPU engine's parameters without vLLM's layerwise-reload session, and buckets split
fused parameters (q/k/v, gate/up) anywhere. Here the engine starts from tiny model A and takes model B's tensors one
per call (the worst split); its greedy logprobs are then compared with transformers' of B: far before, close after.
"""

import json
import sys
from pathlib import Path

import torch


def main() -> None:
    work, out = Path(sys.argv[1]), Path(sys.argv[2])
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from oumi_megatron.examples.tiny_models import build_tiny_model
    from oumi_megatron.rollout.vllm_engine import EngineSpec, VllmEngineHost

    a = build_tiny_model(work / "a", arch="qwen2", head_dim=64, seed=0)
    hf = AutoModelForCausalLM.from_pretrained(build_tiny_model(work / "b0", arch="qwen2", head_dim=64, seed=1), dtype=torch.float32)
    with torch.no_grad():  # sharp distributions (the tiny models' are near uniform): A and B then differ by nats
        hf.model.embed_tokens.weight.mul_(5)
    b = work / "b"
    hf.save_pretrained(b)
    hf = hf.cuda().eval()
    host = VllmEngineHost(EngineSpec(model=str(a), dtype="bfloat16", max_model_len=64, seed=0, gpu_memory_utilization=0.3))
    prompts = [[5, 17, 42, 99, 7], [3, 250, 11], [8, 8, 8, 120, 64, 1]]

    def max_diff_to_b() -> float:
        """max |engine logprob - B's logprob| over the engine's greedy completion tokens."""
        worst = 0.0
        for prompt, samples in zip(prompts, host.generate(prompts, dict(n=1, temperature=0.0, max_tokens=8)), strict=True):
            ids, logprobs, _ = samples[0]
            full = torch.tensor([prompt + ids], device="cuda")
            with torch.no_grad():
                ref = torch.log_softmax(hf(full).logits.float(), -1)[0, len(prompt) - 1:-1].gather(-1, full[0, len(prompt):, None])
            diff = (ref[:, 0].cpu() - torch.tensor(logprobs)).abs()
            worst = max(worst, diff.max().item() if diff.isfinite().all() else float("inf"))  # NaN: broken weights
        return worst

    before = max_diff_to_b()
    tensors = load_file(str(next(b.glob("*.safetensors"))))
    for name, tensor in tensors.items():  # one tensor per load: a layer's q, k and v (gate and up) in separate calls
        host.load_in_process([(name, tensor.to("cuda", torch.bfloat16))])
    out.write_text(json.dumps({"layerwise": host.weights_processed_after_loading, "tensors": len(tensors),
                               "before_max_abs_diff": before, "after_max_abs_diff": max_diff_to_b()}))


if __name__ == "__main__":
    main()
